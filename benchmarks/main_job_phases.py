"""Where an iteration of the main job goes, phase by phase, both twins.

    python benchmarks/main_job_phases.py [--device @cupy:0] [--steps 300]
    python benchmarks/main_job_phases.py --static-loss   # the example's option

The main job (``examples/mnist/train_mnist.py``) times Chainer's
``StandardUpdater.update_core``: the iterator's next batch, the converter
(``concat_examples`` and the copy to the device), then
``optimizer.update(model, x, t)``: cleargrads, ``L.Classifier``'s forward
(the decorated MLP, then the loss and the accuracy, each reported), the
backward and the update. This runs those same steps by hand on the same
model, data and optimizer (Adam; the decorated twin's update captured, as
the example does by default), the two twins in turn, and times each
phase on the host, the device synchronized only around each round: what
is left outside the decorated method and the captured update sets how
far the main job can go past define-by-run. With ``--static-loss`` the
static twin's classifier is the example's ``Classifier`` (its forward
decorated: the loss, the accuracy and the reports replay with the
predictor), and its forward is timed whole (``forward``).
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, os.path.join(ROOT, 'examples'),
           os.path.join(ROOT, 'examples', 'mnist')):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import static_graph  # NOQA  (before chainer: Python 3.12+/NumPy 2)
import numpy  # NOQA
import chainer  # NOQA
import chainer.links as L  # NOQA
from chainer import reporter as reporter_module  # NOQA

import data  # NOQA
import train_mnist  # NOQA

PHASES = ('next', 'convert', 'cleargrads', 'forward', 'predictor', 'loss',
          'accuracy', 'backward', 'update')


class _Timed(L.Classifier):
    """``L.Classifier.forward`` (Chainer 7) for ``forward(x, t)``, with a
    clock between its parts."""

    def forward(self, x, t):
        clock, acc = time.perf_counter, self.acc
        t0 = clock()
        self.y = self.predictor(x)
        t1 = clock()
        self.loss = self.lossfun(self.y, t)
        reporter_module.report({'loss': self.loss}, self)
        t2 = clock()
        self.accuracy = self.accfun(self.y, t)
        reporter_module.report({'accuracy': self.accuracy}, self)
        t3 = clock()
        acc['predictor'] += t1 - t0
        acc['loss'] += t2 - t1
        acc['accuracy'] += t3 - t2
        return self.loss


def _twin(static, device, seed, static_loss=False):
    numpy.random.seed(seed)
    whole = static and static_loss
    model = (train_mnist.Classifier if whole else _Timed)(train_mnist.MLP())
    acc = dict.fromkeys(PHASES, 0.0)
    if not whole:
        # (Not on the decorated classifier: an attribute that changes at
        # every call would make it record again.)
        model.acc = acc
    device.send_link(model)
    opt = chainer.optimizers.Adam()
    opt.setup(model)
    if static:
        static_graph.capture_update(opt)
    return model, opt, acc


def _round(model, opt, acc, it, device, static, n):
    for k in acc:
        acc[k] = 0.0
    clock = time.perf_counter
    rep = reporter_module.Reporter()
    rep.add_observer('main', model)
    device.synchronize()
    start = clock()
    outer = ('next', 'convert', 'cleargrads', 'forward', 'backward',
             'update')
    with chainer.using_config('use_static_graph', static), rep.scope({}):
        for _ in range(n):
            stamps = [clock()]
            batch = it.next()
            stamps.append(clock())
            x, t = chainer.dataset.concat_examples(batch, device.arg)
            stamps.append(clock())
            model.cleargrads()
            stamps.append(clock())
            loss = model(x, t)       # its parts timed inside (_Timed)
            stamps.append(clock())
            loss.backward()
            stamps.append(clock())
            opt.update()
            stamps.append(clock())
            for k, t0, t1 in zip(outer, stamps, stamps[1:]):
                if k is not None:
                    acc[k] += t1 - t0
    device.synchronize()
    total = (clock() - start) / n * 1e6
    return dict((k, v / n * 1e6) for k, v in acc.items()), total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--device', default='@numpy')
    p.add_argument('--steps', type=int, default=300)
    p.add_argument('--rounds', type=int, default=2)
    p.add_argument('--static-loss', action='store_true',
                   help="the static twin's L.Classifier forward decorated "
                        "too (train_mnist.py --static-loss)")
    a = p.parse_args(argv)
    device = train_mnist._compat.get_device(a.device)
    device.use()
    train_data, _, name = data.get_dataset(1)
    twins = {}
    for static in (True, False):
        m, o, acc = _twin(static, device, 0, a.static_loss)
        it = chainer.iterators.SerialIterator(train_data, 100)
        twins[static] = (m, o, acc, it)
        _round(m, o, acc, it, device, static, 20)     # records; warms up
    print('data: %s, device: %s, %d steps a round, host time per phase '
          '(us)' % (name, a.device, a.steps))
    rows = []
    for r in range(a.rounds):
        for static in (False, True):
            m, o, acc, it = twins[static]
            ph, total = _round(m, o, acc, it, device, static, a.steps)
            rows.append((static, total))
            print('%-15s round %d: iteration %7.1f (host+sync); %s' % (
                'static' if static else 'define-by-run', r, total,
                ', '.join('%s %.1f' % (k, ph[k]) for k in PHASES)))
    for r in range(a.rounds):
        dbr, st = rows[2 * r][1], rows[2 * r + 1][1]
        print('round %d: define-by-run / static = %.2fx' % (r, dbr / st))
    if a.static_loss:
        print(static_graph.explain(twins[True][0]))
    print(static_graph.explain(twins[True][0].predictor))
    print(static_graph.explain_update(twins[True][1]))


if __name__ == '__main__':
    main()
