"""Differential fuzzing of the captured optimizer update: a random
optimizer set-up (rule, dtype, float32 update of float16 parameters, static
loss scaling, optimizer and per-parameter hooks before or after the update,
the capture's options) and a random run of steps (learning-rate shifts, a
parameter's own hyperparameter changed, a rule disabled, a missing
gradient, gradients accumulated over two backwards), twin-trained: Chainer's
own update against ``static_graph.capture_update``, compared bit for bit
after every step (``tests/update_twins.assert_same``).

A case is a plain dict made from ``(seed, index)``, so a failure names what
to run again (``benchmarks/fuzz_update.py --seed S --case I``). Driven by
``tests/test_update_fuzz.py`` (a few cases in CI) and
``benchmarks/fuzz_update.py`` (long runs, ``--device @cupy:0`` on a GPU).
"""
import warnings

import numpy

from chainer import optimizer_hooks as H
from chainer import serializers
from chainer.training import extensions

from tests.update_twins import RULES, Twins, _host, captured, loss_of

DTYPES = ('float32', 'float32', 'float64', 'float16')
OPT_HOOKS = {
    'WeightDecay': lambda rs: H.WeightDecay(_pick(rs, (1e-4, 0.01, 0.5))),
    'Lasso': lambda rs: H.Lasso(_pick(rs, (1e-4, 0.01))),
    'GradientClipping': lambda rs: H.GradientClipping(
        _pick(rs, (0.01, 0.5, 1e9))),
    'GradientHardClipping': lambda rs: _hard_clip(rs),
    'GradientLARS': lambda rs: H.GradientLARS(
        threshold=_pick(rs, (1e-3, 10.0)),
        weight_decay=_pick(rs, (0.0, 0.01))),
}
# Hooks an update rule takes (GradientClipping is optimizer-wide only).
RULE_HOOKS = ('WeightDecay', 'Lasso', 'GradientHardClipping', 'GradientLARS')
PARAMS = ('/l1/W', '/l1/b', '/l2/W', '/l2/b')
EVENTS = ('shift', 'param_hyperparam', 'disable', 'enable', 'no_grad',
          'accumulate', 'zerograds', 'serialize', 'new_array', 'add_hook')


def _pick(rs, values):
    return values[rs.randint(len(values))]


def _hard_clip(rs):
    b = _pick(rs, (0.01, 0.05, 1.0))
    return H.GradientHardClipping(-b, b)


def make_case(seed, index, device=None):
    """The set-up and the steps of case ``index`` of run ``seed``."""
    rs = numpy.random.RandomState([seed, index])
    dtype = _pick(rs, DTYPES)
    case = {
        'seed': seed, 'index': index, 'device': device,
        'rule': _pick(rs, sorted(RULES)),
        'dtype': dtype,
        'fp32': dtype == 'float16' and rs.rand() < 0.7,
        'loss_scale': _pick(rs, (None, None, 8.0, 64.0)),
        'opt_hooks': [(name, _pick(rs, ('pre', 'post')))
                      for name in sorted(OPT_HOOKS) if rs.rand() < 0.25],
        'rule_hooks': [(p, _pick(rs, RULE_HOOKS), _pick(rs, ('pre', 'post')))
                       for p in PARAMS if rs.rand() < 0.2],
        'capture': {'threads': _pick(rs, (1, 2)),
                    'min_split': _pick(rs, (0, 64, 32768)),
                    'block': _pick(rs, (None, None, 16, 100)),
                    'native': rs.rand() < 0.7},
        'steps': [],
    }
    if device is not None and device != '@numpy':
        case['capture'] = {'cuda_graph': rs.rand() < 0.7}
    for _ in range(rs.randint(2, 7)):
        case['steps'].append(sorted(set(
            _pick(rs, EVENTS) for _ in range(rs.randint(0, 3)))))
    return case


def run_cases(fuzz, n, seed=0):
    """The results of cases 0 to n - 1 of run ``seed`` of ``fuzz`` (this
    module or ``update_steady_fuzz``: ``make_case``, ``run_case``,
    ``describe``), for the tests: a divergence fails the test, naming the
    case."""
    import pytest
    out = []
    for i in range(n):
        case = fuzz.make_case(seed, i)
        try:
            out.append(fuzz.run_case(case))
        except AssertionError as e:
            pytest.fail('case %d (%s): %s' % (i, fuzz.describe(case), e))
    return out


def describe(case):
    parts = [case['rule'], case['dtype']]
    if case['fp32']:
        parts.append('fp32-update')
    if case['loss_scale']:
        parts.append('loss-scale %g' % case['loss_scale'])
    parts += ['%s(%s)' % h for h in case['opt_hooks']]
    parts += ['%s:%s(%s)' % h for h in case['rule_hooks']]
    parts.append(' '.join('%s=%s' % kv for kv in sorted(
        case['capture'].items())))
    parts.append('steps ' + ' | '.join(','.join(s) or '-'
                                       for s in case['steps']))
    return '; '.join(parts)


class Result(object):
    def __init__(self):
        self.steps = self.captured = self.fallback = 0
        self.reasons = set()
        self.raised = None      # both raised alike (not a divergence)


def run_case(case):
    """Twin-train ``case``; raises AssertionError where the two differ.
    Returns a Result (steps run, captured or not, the fallback reasons)."""
    res = Result()
    dtype = numpy.dtype(case['dtype'])
    make, attr = RULES[case['rule']]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        t = Twins(make, dtype=dtype, capture=case['capture'],
                  device=case['device'])
        _set_up(t, case)
        rs = numpy.random.RandomState([case['seed'], case['index'], 1])
        shifts = make_shifts(t, attr)
        for events in case['steps']:
            res.steps += 1
            if _step(t, events, shifts, rs, res):
                break
    cap = captured(t.ob)
    res.fallback = cap.fallback_steps
    res.captured = res.steps - res.fallback
    res.reasons = set(cap.reasons)
    return res


def _set_up(t, case):
    hook_rs = numpy.random.RandomState([case['seed'], case['index'], 2])
    if case['fp32']:
        t.for_both(lambda m, o: o.use_fp32_update())
    if case['loss_scale']:
        t.for_both(lambda m, o: o.loss_scaling(scale=case['loss_scale']))
    for i, (name, timing) in enumerate(case['opt_hooks']):
        for o, hook in zip((t.oa, t.ob), _twin_hooks(hook_rs, name)):
            o.add_hook(hook, name='h%d' % i, timing=timing)
    for i, (pname, name, timing) in enumerate(case['rule_hooks']):
        for m, hook in zip((t.a, t.b), _twin_hooks(hook_rs, name)):
            _param(m, pname).update_rule.add_hook(
                hook, name='r%d' % i, timing=timing)


def _param(model, name):
    return dict(model.namedparams())[name]


def _twin_hooks(rs, name):
    """Two hooks ``name`` with the same random settings."""
    state = rs.get_state()
    a = OPT_HOOKS[name](rs)
    rs.set_state(state)
    return a, OPT_HOOKS[name](rs)


def make_shifts(t, attr):
    """A learning-rate shift of each twin's optimizer (the 'shift' event)."""
    shifts = [extensions.ExponentialShift(attr, 0.7, optimizer=o)
              for o in (t.oa, t.ob)]
    for s in shifts:
        s.initialize(None)
    return shifts


def apply_events(t, events, shifts, rs, n):
    """A step's events before its gradients, on both twins (``n``: the
    step's number); returns the parameter the step picked."""
    if 'shift' in events:
        for s in shifts:
            s(None)
    pname = _pick(rs, PARAMS)
    if 'param_hyperparam' in events:
        for m in (t.a, t.b):
            hp = _param(m, pname).update_rule.hyperparam
            for name in ('lr', 'alpha', 'eps'):
                if hasattr(hp, name):
                    setattr(hp, name, getattr(hp, name) * 0.5)
                    break
    if 'disable' in events or 'enable' in events:
        for m in (t.a, t.b):
            _param(m, pname).update_rule.enabled = 'enable' in events
    if 'new_array' in events:
        for m in (t.a, t.b):
            p = _param(m, pname)
            p.array = p.array.copy()
    if 'add_hook' in events:
        name = _pick(rs, sorted(OPT_HOOKS))
        timing = _pick(rs, ('pre', 'post'))
        for o, hook in zip((t.oa, t.ob), _twin_hooks(rs, name)):
            o.add_hook(hook, name='added%d' % n, timing=timing)
    if 'serialize' in events:
        for o in (t.oa, t.ob):
            saved = {}
            o.serialize(serializers.DictionarySerializer(saved))
            saved = dict((k, _host(v)) for k, v in saved.items())
            o.serialize(serializers.NpzDeserializer(saved, strict=False))
    return pname


def _step(t, events, shifts, rs, res):
    """One step of both twins; True where both raised alike (the case ends
    there)."""
    pname = apply_events(t, events, shifts, rs, res.steps)
    x = t.batch()
    errors = []
    for m, o in ((t.a, t.oa), (t.b, t.ob)):
        try:
            _backward(m, o, x, events, pname)
            o.update()
            errors.append(None)
        except Exception as e:  # NOQA: compared below
            errors.append(e)
    if both_raised(errors, res, ('Chainer\'s step', 'the captured one\'s')):
        return True
    t.check()
    return False


def both_raised(errors, res, names):
    """Did the twins' steps raise (``errors``: each one's exception or
    None)? Where one did, the other must have raised alike (asserted; the
    twins ``names`` in the message); recorded in ``res.raised``."""
    ea, eb = errors
    if ea is None and eb is None:
        return False
    assert type(ea) is type(eb), '%s raised %r, %s %r' % (
        names[0], ea, names[1], eb)
    res.raised = '%s: %s' % (type(ea).__name__, ea)
    return True


def _backward(m, o, x, events, pname):
    if 'zerograds' in events:
        # Gradients kept and zeroed in place (Link.zerograds would keep
        # the float32 NaN gradients a Parameter starts with, of its
        # initializer's dtype, next to these float64/float16 arrays).
        for p in m.params():
            if p.grad is None or p.grad.dtype != p.array.dtype:
                p.grad = p.array * 0
            else:
                p.grad.fill(0)
    else:
        m.cleargrads()
    for _ in range(2 if 'accumulate' in events else 1):
        loss_of(m, x).backward(loss_scale=o._loss_scale)
    if 'no_grad' in events:
        _param(m, pname).grad = None
