"""What the examples need from Chainer, on every Chainer they run on (4.5+).

Chainer >= 6 has ``chainer.get_device`` and device objects; Chainer 4 and 5
have neither and take a GPU id (``None`` for the CPU) wherever a device goes.
``get_device`` accepts ``@numpy`` and ``@cupy:N`` everywhere (and, on
Chainer >= 6, any specifier Chainer understands).  ``mode_label`` says what a
training run really is: the static graph only where it was asked for and the
library can record on this Chainer. ``capture_update`` and its flags: the
optimizer's update captured (``static_graph.capture_update``).
"""
import static_graph  # NOQA  (before chainer: Python 3.12+/NumPy 2)
import numpy

import chainer

from static_graph import compat


class Device(object):
    """The few device operations the examples use."""

    def __init__(self, spec):
        self.spec = spec
        self.gpu_id = None            # old Chainer only
        if hasattr(chainer, 'get_device'):
            self.device = chainer.get_device(spec)
            self.xp = self.device.xp
            # What updaters, evaluators and concat_examples take.
            self.arg = self.device
            return
        self.device = None
        if spec == '@numpy':
            self.xp, self.arg = numpy, None
        elif spec.startswith('@cupy:') and spec[6:].isdigit():
            chainer.backends.cuda.check_cuda_available()
            self.gpu_id = int(spec[6:])
            self.xp, self.arg = chainer.backends.cuda.cupy, self.gpu_id
        else:
            raise ValueError('device %r: chainer %s accepts only @numpy or '
                             '@cupy:N' % (spec, chainer.__version__))

    def use(self):
        if self.device is not None:
            self.device.use()
        elif self.gpu_id is not None:
            chainer.backends.cuda.get_device_from_id(self.gpu_id).use()

    def send_link(self, link):
        if self.device is not None:
            link.to_device(self.device)
        elif self.gpu_id is not None:
            link.to_gpu(self.gpu_id)
        return link

    def synchronize(self):
        if self.device is not None:
            if isinstance(self.device, chainer.backend.GpuDevice):
                self.device.device.synchronize()
        elif self.gpu_id is not None:
            chainer.backends.cuda.get_device_from_id(
                self.gpu_id).synchronize()


def get_device(spec):
    return Device(spec)


def static_active():
    """Whether ``@static_graph`` records and replays on this Chainer."""
    return compat.UNSUPPORTED is None


def mode_label(static):
    """``static graph`` only when it really is; else ``define-by-run``."""
    if not static:
        return 'define-by-run'
    if static_active():
        return 'static graph'
    return ('define-by-run: static_graph unavailable on chainer %s'
            % chainer.__version__)


def add_capture_update_arguments(parser):
    """``--capture-update`` (the default) and ``--no-capture-update``."""
    parser.add_argument('--capture-update', dest='capture_update',
                        action='store_true', default=True,
                        help='with the static graph, also run the '
                             'optimizer\'s update as captured in-place '
                             'kernels split across threads '
                             '(static_graph.capture_update; default)')
    parser.add_argument('--no-capture-update', dest='capture_update',
                        action='store_false',
                        help='leave the update to Chainer\'s optimizer')


def capture_update(optimizer, args, static, say=True):
    """Capture ``optimizer``'s update where the run is static and
    ``--capture-update`` holds; say so in one line (``say``)."""
    if static and args.capture_update:
        static_graph.capture_update(optimizer)
        if say and static_active():
            print('optimizer update: captured (static_graph.capture_update; '
                  '--no-capture-update leaves it to Chainer)')
