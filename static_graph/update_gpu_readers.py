"""Chainer's update rules and hooks on CuPy, read for the captured update.

For each rule class the captured update knows (``update_readers.RULES``):
the kernel of ``schedules.update_cuda`` that is its ``update_core_gpu``,
the host scalars Chainer 7.8.1 passes that kernel, computed with Chainer's
own Python expressions (``1 - hp.beta1``, ``rule.alpha_t``,
``grad.dtype.type(hp.eps)``, ...) at every step, and the state arrays it
writes, in the kernel's order. The values are handed to the device as CuPy
would cast them (``update_cuda.device_values``), so the kernel computes
with the same bits. A reader raises ``Unsupported`` where Chainer's
``update_core_gpu`` would raise.
"""
import numpy

from schedules import update_cuda as C
from static_graph.update_readers import Unsupported, registrar

FLOAT16 = numpy.dtype(numpy.float16)

RULES = {}     # rule class -> reader(rule, grad_dtype) -> (kernel, scalars,
#                state keys, scalar dtype)


_rule = registrar(RULES)


@_rule('sgd', 'SGDRule')
def _sgd(rule, dtype):
    return C.SGD, (rule.hyperparam.lr,), (), dtype


@_rule('momentum_sgd', 'MomentumSGDRule')
def _momentum_sgd(rule, dtype):
    return (C.MOMENTUM_SGD, (rule.hyperparam.lr, rule.hyperparam.momentum),
            ('v',), dtype)


@_rule('nesterov_ag', 'NesterovAGRule')
def _nesterov_ag(rule, dtype):
    return (C.NESTEROV_AG, (rule.hyperparam.lr, rule.hyperparam.momentum),
            ('v',), dtype)


@_rule('corrected_momentum_sgd', 'CorrectedMomentumSGDRule')
def _corrected_momentum_sgd(rule, dtype):
    return (C.CORRECTED_MOMENTUM_SGD,
            (rule.hyperparam.lr, rule.hyperparam.momentum), ('v',), dtype)


@_rule('ada_grad', 'AdaGradRule')
def _ada_grad(rule, dtype):
    return (C.ADA_GRAD, (rule.hyperparam.lr, rule.hyperparam.eps), ('h',),
            dtype)


@_rule('ada_delta', 'AdaDeltaRule')
def _ada_delta(rule, dtype):
    return (C.ADA_DELTA, (1 - rule.hyperparam.rho, rule.hyperparam.eps),
            ('msg', 'msdx'), dtype)


@_rule('rmsprop', 'RMSpropRule')
def _rmsprop(rule, dtype):
    hp = rule.hyperparam
    eps = dtype.type(hp.eps)
    if eps == 0:
        raise Unsupported('eps of RMSprop underflows in %s (Chainer raises)'
                          % dtype.name)
    kernel = C.RMSPROP[True] if hp.eps_inside_sqrt else C.RMSPROP[False]
    return kernel, (hp.lr, hp.alpha, eps), ('ms',), dtype


# Rules and dtypes whose captured update on CuPy differs from Chainer's:
# Chainer's update runs them, with the reason. The kernels are Chainer's
# but read their scalars from a device array, and the device's assembler
# (ptxas) may fuse a multiply and an add of the same PTX differently then
# (benchmarks/compile_update_kernels.py compares the SASS).
# tests/test_captured_update_gpu.py tries them without this table.
DIFFERED_ON_GPU = {
    ('rmsprop_graves', 'float64'):
        'RMSpropGraves on float64 on CuPy: with its scalars read from a '
        'device array, the assembler fuses delta * momentum - lr * grad * '
        'rsqrt(...) into another FMA than in Chainer\'s kernel (one '
        'rounding apart; found by the GPU fuzzer on an H100)',
}


def check_differed(kernel, dtype):
    """Unsupported where ``kernel`` (a RuleKernel) on ``dtype`` is in
    DIFFERED_ON_GPU."""
    for (name, dt), reason in DIFFERED_ON_GPU.items():
        if name == kernel.name and numpy.dtype(dtype).name == dt:
            raise Unsupported(reason)


@_rule('rmsprop_graves', 'RMSpropGravesRule')
def _rmsprop_graves(rule, dtype):
    hp = rule.hyperparam
    return (C.RMSPROP_GRAVES, (hp.lr, hp.alpha, hp.momentum, hp.eps),
            ('n', 'g', 'delta'), dtype)


@_rule('smorms3', 'SMORMS3Rule')
def _smorms3(rule, dtype):
    return (C.SMORMS3, (rule.hyperparam.lr, rule.hyperparam.eps),
            ('mem', 'g', 'g2'), dtype)


@_rule('adam', 'AdamRule')
def _adam(rule, dtype):
    hp = rule.hyperparam
    interm = numpy.dtype(numpy.float32) if dtype == FLOAT16 else dtype
    eps = interm.type(hp.eps)                     # AdamRule._check_eps
    if hp.eps != 0 and eps == 0:
        raise Unsupported('eps of Adam underflows in %s (Chainer raises)'
                          % interm.name)
    bounds = ()
    if hp.adabound:
        if not hasattr(rule, 'initial_alpha'):
            raise Unsupported('adabound turned on after the AdamRule was '
                              'made (it has no initial_alpha: Chainer '
                              'raises)')
        bounds = rule.bounds
    if hp.amsgrad and hp.adabound:
        kernel = C.ADAM[(True, True)]
    elif hp.adabound:
        kernel = C.ADAM[(False, True)]
    elif hp.amsgrad:
        kernel = C.ADAM[(True, False)]
    else:
        kernel = C.ADAM[(False, False)]
    scalars = (rule.alpha_t, 1 - hp.beta1, 1 - hp.beta2) + tuple(bounds) + \
        (hp.eps, hp.eta, hp.weight_decay_rate)
    states = ('m', 'v', 'vhat') if hp.amsgrad else ('m', 'v')
    return kernel, scalars, states, interm


_SCALAR_TYPES = (int, float, bool, type(None))


def read_rule(rule, dtype, memo):
    """``RULES``' reader of ``rule`` for gradients of ``dtype``, checked
    against ``DIFFERED_ON_GPU``; once per step for rules that agree in
    everything a reader reads (``memo``, one step's): their type, ``t``,
    their hyperparameters along the parent chain and their own scalar
    attributes (AdamRule's ``initial_alpha``). An optimizer's rules usually
    all do: the reader then runs once a step, not once per parameter."""
    key = None
    try:
        # (The rule's own hyperparameters inline, its parents' as a token:
        # each rule's own object would only miss in _chain_token's memo.)
        d = vars(rule.hyperparam)
        parent = d.get('_parent')
        key = (type(rule), dtype,
               tuple([kv for kv in vars(rule).items()
                      if type(kv[1]) in _SCALAR_TYPES]),
               tuple([kv for kv in d.items() if kv[0] != '_parent']),
               None if parent is None else _chain_token(parent, memo))
        found = memo.get(key)
    except TypeError:       # a value that is not hashable
        key = found = None
    if found is not None:
        return found
    found = RULES[type(rule)](rule, dtype)
    check_differed(found[0], dtype)
    if key is not None:
        memo[key] = found
    return found


def _chain_token(hp, memo):
    """A number for what hyperparameter object ``hp`` and its parents hold:
    the same for two that hold the same values. Found once per step for
    each (``memo``): the optimizer's, the parent of all its rules' own,
    is not read again for each rule."""
    token = memo.get(id(hp))
    if token is None:
        d = vars(hp)
        parent = d.get('_parent')
        content = ('chain', tuple([kv for kv in d.items()
                                   if kv[0] != '_parent']),
                   None if parent is None else _chain_token(parent, memo))
        token = memo[id(hp)] = memo.setdefault(content, len(memo))
    return token


# -- hooks: the host scalars of their device work -----------------------------

F16_MAX = 65504.0


def ufunc_scalar(value, dtype, what):
    """A host scalar Chainer hands a CuPy ufunc together with arrays of
    ``dtype`` (loss scaling, GradientClipping, GradientHardClipping,
    GradientLARS): where CuPy computes in ``dtype`` whatever its version
    (a Python number; for float16 one within its range: CuPy 13 would
    compute in float32 past it), the value; else Unsupported."""
    t = type(value)
    if t is bool or not (t is float or t is int or (
            isinstance(value, numpy.generic) and value.dtype == dtype)):
        raise Unsupported(
            '%s is a %s, which CuPy\'s ufuncs may promote (the captured '
            'update on CuPy takes Python numbers there)' % (what, t.__name__))
    if dtype == FLOAT16 and numpy.isfinite(value) and abs(value) > F16_MAX:
        raise Unsupported('%s (%r) is out of float16\'s range (CuPy 13 '
                          'computes in float32 then)' % (what, value))
    return value


def weight_decay_rate(hook, loss_scale):
    rate = hook.rate
    if loss_scale is not None:
        rate *= loss_scale
    return rate


def sum_sqnorm_grads(params):
    """Chainer's own ``_sum_sqnorm_grads`` (GradientClipping's norm)."""
    from static_graph.update_readers import _sum_sqnorm_grads
    return _sum_sqnorm_grads(params)
