"""Timing shared by the examples: an updater that times every step."""
import time

import numpy

from chainer import training


class TimedUpdater(training.updaters.StandardUpdater):
    """StandardUpdater that records the wall time of every training step.

    ``device`` is an ``_compat.Device``; the updater gets what this Chainer
    takes (a device object, a GPU id or ``None``).
    """

    def __init__(self, iterator, optimizer, device):
        super(TimedUpdater, self).__init__(iterator, optimizer,
                                           device=device.arg)
        self.compat_device = device
        self.step_times = []
        self.losses = []

    def update_core(self):
        device = self.compat_device
        device.synchronize()
        start = time.perf_counter()
        super(TimedUpdater, self).update_core()
        device.synchronize()
        self.step_times.append(time.perf_counter() - start)
        loss = getattr(self.get_optimizer('main').target, 'loss', None)
        if loss is not None:
            self.losses.append(float(loss.array))


def mean_step_time(step_times):
    """Mean time per iteration, excluding the first (recording) iteration."""
    if len(step_times) < 2:
        return float('nan')
    return float(numpy.mean(step_times[1:]))
