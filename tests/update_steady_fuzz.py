"""Differential fuzzing of the captured update's steady path
(``static_graph/update_cupy_steady.py``) on fake CuPy: the random set-ups
and events of ``tests/update_fuzz.py`` (rules, dtypes, fp32 updates,
static loss scaling, optimizer and rule hooks, learning-rate shifts, a
rule's own hyperparameter, rules disabled and enabled, a missing gradient,
a parameter's new array, hooks added, the optimizer serialized and loaded
back), two captured twins on fake CuPy arrays: ``a`` reads a step like the
one before in part where it can, ``b`` reads every step in full. Both run
the same fake kernels, so they must agree bit for bit after every step.

Gradients are given, not computed (Chainer's backward does not run on fake
CuPy arrays): random values copied into the same arrays at every step, as a
CUDA graph lends them, so that the steady path is taken; new arrays in a
step with ``accumulate`` or ``zerograds`` among its events. Three events of
its own change what the path's template must notice: a rule's own hook
added, a state array replaced by a copy, a loss scale for one step,
``use_fp32_update()`` turned on.
"""
import contextlib
import warnings

import numpy

import static_graph
from static_graph import update_cupy
from tests import fake_cupy
from tests import update_fuzz as F
from tests.update_twins import RULES, Net, assert_same, captured


def make_case(seed, index):
    """A case of ``update_fuzz``'s kinds, drawn for this path: fewer hooks,
    loss scales and fp32 updates (each of which reads every step in full)
    and longer runs of steps, most without events (the steady path needs
    two steps on the same arrays read in full before it)."""
    case = F.make_case(seed, index)
    rs = numpy.random.RandomState([seed, index, 3])
    if rs.rand() < 0.7:
        case['opt_hooks'] = []
    if rs.rand() < 0.7:
        case['rule_hooks'] = []
    if rs.rand() < 0.7:
        case['loss_scale'] = None
    if rs.rand() < 0.5:
        case['fp32'] = False
    case['capture'] = {'cuda_graph': False}
    case['steps'] = [
        [] if rs.rand() < 0.6 else sorted(set(
            F._pick(rs, EVENTS) for _ in range(rs.randint(1, 3))))
        for _ in range(rs.randint(4, 11))]
    return case


# update_fuzz's events, and what may change between two steps of this
# path's template: a rule's own hook added, a state array replaced by a
# copy, a loss scale for one step only, use_fp32_update() turned on.
EVENTS = F.EVENTS + ('rule_hook', 'new_state', 'scaled', 'fp32')


@contextlib.contextmanager
def steady_path(on):
    """``update_cupy.STEADY`` set to ``on`` inside, put back after."""
    old = update_cupy.STEADY
    update_cupy.STEADY = on
    try:
        yield
    finally:
        update_cupy.STEADY = old


class Result(object):
    def __init__(self):
        self.steps = self.captured = self.fallback = self.steady = 0
        self.reasons = set()
        self.raised = None      # both raised alike (not a divergence)


def run_case(case):
    """Twin-train ``case``; raises AssertionError where the two differ."""
    res = Result()
    make, attr = RULES[case['rule']]
    dtype = numpy.dtype(case['dtype'])
    old = update_cupy.cupy_module
    update_cupy.cupy_module = lambda: fake_cupy
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            t = _Twins(make, dtype)
            F._set_up(t, case)
            rs = numpy.random.RandomState([case['seed'], case['index'], 1])
            shifts = F.make_shifts(t, attr)
            for events in case['steps']:
                res.steps += 1
                if _step(t, events, shifts, rs, res, case):
                    break
    finally:
        update_cupy.cupy_module = old
    cap = captured(t.oa)
    res.steady = cap.gpu.steady_steps if cap.gpu is not None else 0
    res.fallback = cap.fallback_steps
    res.captured = res.steps - res.fallback
    res.reasons = set(cap.reasons)
    return res


class _Twins(object):
    def __init__(self, make_opt, dtype):
        numpy.random.seed(0)
        self.a, self.b = Net(dtype), Net(dtype)
        self.b.copyparams(self.a)
        for m in (self.a, self.b):
            for p in m.params():
                p.array = fake_cupy.asarray(p.array.copy())
        self.oa = make_opt().setup(self.a)
        self.ob = make_opt().setup(self.b)
        for o in (self.oa, self.ob):
            static_graph.capture_update(o, threads=1, cuda_graph=False)
        self.grads = ({}, {})

    def for_both(self, fn):
        fn(self.a, self.oa)
        fn(self.b, self.ob)


def _step(t, events, shifts, rs, res, case):
    """One step of both twins; True where both raised alike."""
    pname = F.apply_events(t, events, shifts, rs, res.steps)
    if 'rule_hook' in events:
        name = F._pick(rs, F.RULE_HOOKS)
        for m, hook in zip((t.a, t.b), F._twin_hooks(rs, name)):
            F._param(m, pname).update_rule.add_hook(
                hook, name='added%d' % res.steps)
    if 'new_state' in events:
        for m in (t.a, t.b):
            state = F._param(m, pname).update_rule.state
            for k in sorted(state or ())[:1]:
                state[k] = fake_cupy.asarray(numpy.array(state[k]))
    if 'fp32' in events:
        t.for_both(lambda m, o: o.use_fp32_update())
    fresh = 'accumulate' in events or 'zerograds' in events
    scale = 8.0 if 'scaled' in events else case['loss_scale']
    values = {}
    for name, p in t.a.namedparams():
        g = rs.standard_normal(p.shape)
        if scale:
            g = g * scale
        values[name] = g.astype(p.dtype)
    errors = []
    for m, o, grads, steady in ((t.a, t.oa, t.grads[0], True),
                                (t.b, t.ob, t.grads[1], False)):
        m.cleargrads()
        for name, p in m.namedparams():
            if p.array is None or ('no_grad' in events and name == pname):
                continue
            g = grads.get(name)
            if fresh or g is None or g.dtype != p.dtype:
                g = grads[name] = fake_cupy.asarray(values[name].copy())
            else:
                numpy.copyto(g, values[name])
            p.grad = g
            p._loss_scale = scale
        try:
            with steady_path(steady):
                o.update()
            errors.append(None)
        except Exception as e:  # NOQA: compared below
            errors.append(e)
    if F.both_raised(errors, res, ('the steady twin', 'the full one')):
        return True
    assert_same(t.a, t.b, t.oa, t.ob)
    assert captured(t.ob).gpu is None or \
        captured(t.ob).gpu.steady_steps == 0
    return False


def describe(case):
    return F.describe(case)
