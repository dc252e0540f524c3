"""Chainer's update rules and optimizer hooks, read for the captured update.

For each supported class: which kernel (``schedules.update_rules``) runs
it, and its per-step scalars, computed from the rule's hyperparameters with
Chainer 7.8.1's own Python expressions (``1.0 - hp.beta1``, ``(1 +
momentum) * lr``, ``rule.alpha_t``, ``rule.bounds``), read at every step.
A reader raises ``Unsupported`` where Chainer's update would not run the
kernel's ops (or would raise): the step then runs Chainer's own update.
"""
import operator

import numpy

from chainer import optimizer as optimizer_module
from chainer import optimizer_hooks
from chainer import optimizers
from chainer.optimizer_hooks import gradient_clipping

from schedules import update_rules as K


class Unsupported(Exception):
    """The captured update cannot run this step as Chainer would; the
    message says why."""


_getters = {}


def pack(kernel, values):
    """``values`` (a dict by scalar name) in ``kernel.scalars``' order."""
    get = _getters.get(kernel)
    if get is None:
        names = kernel.scalars
        if len(names) == 1:
            name = names[0]
            get = _getters[kernel] = lambda d: (d[name],)
        else:
            get = _getters[kernel] = operator.itemgetter(*names)
    return get(values)


# -- update rules -------------------------------------------------------------

RULES = {}     # rule class -> reader(rule, dtype) -> (kernel, scalars)


def registrar(table):
    """``@rule(module, name)``: registers its function in ``table`` for
    the update rule class ``chainer.optimizers.<module>.<name>`` (a
    Chainer older than 7 may lack the class: nothing is registered)."""
    def rule(module, name):
        cls = getattr(getattr(optimizers, module, None), name, None)

        def register(fn):
            if cls is not None:
                table[cls] = fn
            return fn
        return register
    return rule


_rule = registrar(RULES)


@_rule('sgd', 'SGDRule')
def _sgd(rule, dtype):
    return K.SGD, (rule.hyperparam.lr,)


@_rule('momentum_sgd', 'MomentumSGDRule')
def _momentum_sgd(rule, dtype):
    hp = rule.hyperparam
    return K.MOMENTUM_SGD, (hp.momentum, hp.lr)


@_rule('nesterov_ag', 'NesterovAGRule')
def _nesterov_ag(rule, dtype):
    lr, momentum = rule.hyperparam.lr, rule.hyperparam.momentum
    return K.NESTEROV_AG, pack(K.NESTEROV_AG, {
        'momentum': momentum, 'lr': lr,
        'momentum_sq': momentum * momentum,
        'one_plus_momentum_lr': (1 + momentum) * lr})


@_rule('corrected_momentum_sgd', 'CorrectedMomentumSGDRule')
def _corrected_momentum_sgd(rule, dtype):
    hp = rule.hyperparam
    return K.CORRECTED_MOMENTUM_SGD, (hp.momentum, hp.lr)


def _adam_check_eps(hp, dtype):
    # AdamRule._check_eps, which raises ValueError where eps underflows.
    eps = dtype.type(hp.eps)
    if hp.eps != 0 and eps == 0:
        raise Unsupported('eps of Adam underflows in %s (Chainer raises)'
                          % dtype.name)


@_rule('adam', 'AdamRule')
def _adam(rule, dtype):
    hp = rule.hyperparam
    _adam_check_eps(hp, dtype)
    amsgrad, adabound = bool(hp.amsgrad), bool(hp.adabound)
    a = 1.0 - hp.eta * hp.weight_decay_rate
    if isinstance(a, numpy.ndarray):
        # (Chainer computes with it as an array: its dtype widens the
        # update's temporaries)
        raise Unsupported('Adam: eta or weight_decay_rate is an array')
    values = {'one_minus_beta1': 1.0 - hp.beta1,
              'one_minus_beta2': 1.0 - hp.beta2,
              'eps': hp.eps, 'alpha_t': rule.alpha_t, 'a': a, 'b': -hp.eta}
    if adabound:
        if not hasattr(rule, 'initial_alpha'):
            raise Unsupported('adabound turned on after the AdamRule was '
                              'made (it has no initial_alpha: Chainer '
                              'raises)')
        values['lower'], values['upper'] = rule.bounds
    kernel = K.ADAM[(amsgrad, adabound, a == 1)]
    return kernel, pack(kernel, values)


@_rule('rmsprop', 'RMSpropRule')
def _rmsprop(rule, dtype):
    hp = rule.hyperparam
    eps = dtype.type(hp.eps)
    if hp.eps != 0 and eps == 0:
        raise Unsupported('eps of RMSprop underflows in %s (Chainer raises)'
                          % dtype.name)
    kernel = K.RMSPROP[bool(hp.eps_inside_sqrt)]
    return kernel, pack(kernel, {
        'alpha': hp.alpha, 'one_minus_alpha': 1 - hp.alpha, 'eps': eps,
        'lr': hp.lr})


@_rule('rmsprop_graves', 'RMSpropGravesRule')
def _rmsprop_graves(rule, dtype):
    hp = rule.hyperparam
    return K.RMSPROP_GRAVES, pack(K.RMSPROP_GRAVES, {
        'alpha': hp.alpha, 'one_minus_alpha': 1 - hp.alpha,
        'momentum': hp.momentum, 'lr': hp.lr, 'eps': hp.eps})


@_rule('ada_grad', 'AdaGradRule')
def _ada_grad(rule, dtype):
    hp = rule.hyperparam
    return K.ADA_GRAD, (hp.lr, hp.eps)


@_rule('ada_delta', 'AdaDeltaRule')
def _ada_delta(rule, dtype):
    rho, eps = rule.hyperparam.rho, rule.hyperparam.eps
    return K.ADA_DELTA, pack(K.ADA_DELTA, {
        'rho': rho, 'one_minus_rho': 1 - rho, 'eps': eps})


@_rule('smorms3', 'SMORMS3Rule')
def _smorms3(rule, dtype):
    hp = rule.hyperparam
    return K.SMORMS3, pack(K.SMORMS3, {'eps': hp.eps, 'lr': hp.lr})


# What the readers mirror: the methods of these classes as this module saw
# them (a patched method is code this module does not know).
_RULE_METHODS = ('update', 'update_core', 'update_core_cpu', 'init_state',
                 '_init_states', 'alpha_t', 'bounds')
_rule_methods = {cls: tuple(cls.__dict__.get(m) or
                            getattr(cls, m, None) for m in _RULE_METHODS)
                 for cls in RULES}


# The optimizer's methods the captured step stands for (GradientMethod's).
OPTIMIZER_METHODS = ('update', 'reallocate_cleared_grads', 'call_hooks',
                     'call_hook', 'check_nan_in_grads', 'is_safe_to_update',
                     'update_loss_scale')
_OWN = (('the optimizer', frozenset(OPTIMIZER_METHODS)),
        ('a parameter', frozenset(('update',))),
        ('an update rule', frozenset(_RULE_METHODS + (
            'update_core_gpu', 'update_core_chainerx'))))


class OwnMethods(object):
    """A method set on the optimizer, a parameter or an update rule object
    itself, not on its class (``rule.update_core = types.MethodType(
    masked, rule)``): Chainer calls it, the captured step would not.
    Setting one adds an attribute, so the objects' attribute counts are
    compared at each step, and their names looked at where a count
    changed."""

    def __init__(self):
        self.sizes = None

    def check(self, opt, params, rules):
        """Raise Unsupported where one of the objects has such a method of
        its own."""
        groups = ((opt,), params, [r for r in rules if r is not None])
        sizes = [len(o.__dict__) for g in groups for o in g]
        if sizes == self.sizes:
            return
        for (what, names), objs in zip(_OWN, groups):
            for o in objs:
                own = names.intersection(o.__dict__)
                if own:
                    raise Unsupported(
                        '%s has method %s set on itself (not on its class), '
                        'which Chainer\'s update calls' % (
                            what, ', '.join(sorted(own))))
        self.sizes = sizes


def check_rule_class(cls):
    """None where ``cls`` is a rule this module reads, else why not."""
    if cls not in RULES:
        return ('update rule %s.%s is not one the captured update knows '
                '(a rule of your own, or a subclass)'
                % (cls.__module__, cls.__name__))
    now = tuple(cls.__dict__.get(m) or getattr(cls, m, None)
                for m in _RULE_METHODS)
    if now != _rule_methods[cls]:
        return '%s has patched methods' % cls.__name__
    return None


# -- hooks --------------------------------------------------------------------

ELEMENTWISE = 'elementwise'
GLOBAL = 'global'        # a reduction over every parameter
PER_PARAM = 'per_param'  # a reduction over the parameter's own arrays

_sum_sqnorm_grads = getattr(gradient_clipping, '_sum_sqnorm_grads', None)
_HOOKS = {getattr(optimizer_hooks, name, None): kind for name, kind in (
    ('WeightDecay', ELEMENTWISE), ('Lasso', ELEMENTWISE),
    ('GradientHardClipping', ELEMENTWISE),
    ('GradientClipping', GLOBAL if _sum_sqnorm_grads else None),
    ('GradientLARS', PER_PARAM))}
_HOOKS = {cls: kind for cls, kind in _HOOKS.items() if cls and kind}
_hook_calls = {cls: cls.__call__ for cls in _HOOKS}
# The deprecated chainer.optimizer.WeightDecay & co. only warn in __init__.
for _name in ('WeightDecay', 'Lasso', 'GradientClipping',
              'GradientHardClipping'):
    _old = getattr(optimizer_module, _name, None)
    if _old is not None and _old.__mro__[1] in _HOOKS:
        _HOOKS[_old] = _HOOKS[_old.__mro__[1]]
        _hook_calls[_old] = _hook_calls[_old.__mro__[1]]


def hook_kind(hook, per_param_call):
    """ELEMENTWISE, GLOBAL or PER_PARAM for a hook the captured update
    knows, called as Chainer would call it (``hook(rule, param)`` where
    ``per_param_call``, else ``hook(optimizer)``); raises Unsupported."""
    cls = type(hook)
    kind = _HOOKS.get(cls)
    if kind is None:
        raise Unsupported('hook %s is not one the captured update knows'
                          % getattr(hook, 'name', cls.__name__))
    if cls.__call__ is not _hook_calls[cls]:
        raise Unsupported('hook %s has a patched __call__' % cls.__name__)
    if (kind == GLOBAL) == per_param_call:
        raise Unsupported('hook %s is called as %s, which it does not take '
                          '(Chainer raises)' % (
                              cls.__name__, 'hook(rule, param)'
                              if per_param_call else 'hook(optimizer)'))
    return kind


_HOOK_KERNELS = {'WeightDecay': K.WEIGHT_DECAY, 'Lasso': K.LASSO,
                 'GradientHardClipping': K.GRADIENT_HARD_CLIPPING,
                 'GradientClipping': K.GRADIENT_CLIPPING,
                 'GradientLARS': K.GRADIENT_LARS}


def hook_kernel(hook):
    """The element-wise kernel of a hook (of a class in _HOOKS)."""
    for cls in type(hook).__mro__:
        if cls.__module__.startswith('chainer.optimizer_hooks'):
            return _HOOK_KERNELS[cls.__name__]
    raise AssertionError(type(hook))


def hook_scalars(hook, kernel, loss_scale):
    """The per-step scalars of an element-wise hook (reduction results are
    None here; the reduction fills them in). ``loss_scale``: the
    ``_loss_scale`` of the parameter the hook is handed."""
    if kernel is K.WEIGHT_DECAY:
        rate = hook.rate
        if loss_scale is not None:
            rate *= loss_scale
        return (rate,)
    if kernel is K.LASSO:
        return (hook.rate,)
    if kernel is K.GRADIENT_HARD_CLIPPING:
        return (hook.lower_bound, hook.upper_bound)
    if kernel is K.GRADIENT_CLIPPING:
        return (None, None)
    return (hook.weight_decay, None)


def array_rate_scaled(st, params):
    """Why the step runs Chainer's update where a WeightDecay hook's rate
    is an array and a parameter has a loss scale, else None. Chainer's
    ``rate *= param._loss_scale`` multiplies that array in place, once per
    hook call, each parameter decaying with the value it has then, in
    Chainer's order of hooks and parameters (each optimizer hook over all
    parameters in turn; a parameter without a gradient skipped): optim31
    and review37 found the captured update's own order 19.8 off."""
    if not any(p._loss_scale is not None for p in params):
        return None
    items = st.opt_pre_items + st.opt_post_items
    for rule_items in st.rule_pre_items + st.rule_post_items:
        items = items + rule_items
    for hook, kernel in items:
        if kernel is K.WEIGHT_DECAY and (
                isinstance(hook.rate, numpy.ndarray) or
                hasattr(hook.rate, '__cuda_array_interface__')):
            return ('WeightDecay\'s rate is an array, under loss scaling: '
                    'Chainer multiplies it in place by each parameter\'s '
                    'loss scale in turn')
    return None


def clip_rate(hook, params):
    """GradientClipping's global scale, computed as Chainer does (its own
    sum of squared norms): (whether to scale, rate)."""
    sqnorm, _ = _sum_sqnorm_grads(params)
    norm = numpy.sqrt(sqnorm)
    rate = hook.threshold / norm
    return not (rate >= 1), rate


def lars_rate(hook, p, g):
    """GradientLARS's scale of one parameter, computed as Chainer does."""
    p_norm = numpy.linalg.norm(p)
    g_norm = numpy.linalg.norm(g)
    local_rate = (p_norm / (hook.eps + g_norm + hook.weight_decay * p_norm))
    return numpy.where(p_norm > hook.threshold, local_rate, 1.0)


# -- scalars and NumPy's promotion --------------------------------------------

weak = K.weak     # (the captured update's C loops ask it too)


_typed_index = {}


def check_typed(kernel, values, dtype):
    """() where every scalar that feeds a temporary leaves it ``dtype``
    (Python numbers always do); else ((name, dtype the temporaries take),
    ...) for the others. Raises Unsupported for a scalar NumPy cannot
    combine with ``dtype`` arrays into a float dtype, and for an array of
    more than one element or of more than one dimension."""
    for i, v in enumerate(values):
        if type(v) is numpy.ndarray and (v.size != 1 or v.ndim > 1):
            # (Chainer broadcasts it against the parameter: a rate per row;
            # one element of more dimensions, [[[1e-3]]], broadcasts a
            # parameter's update to more dimensions than the parameter
            # has, which Chainer's in-place updates refuse and its
            # assignments drop: the captured kernels, over flattened
            # arrays, would do neither.)
            raise Unsupported('%s: %s is an array of shape %s' % (
                kernel.name, kernel.scalars[i], v.shape))
    idx = _typed_index.get(kernel)
    if idx is None:
        idx = _typed_index[kernel] = tuple(
            i for i, n in enumerate(kernel.scalars) if n in kernel.typed)
    strong = ()
    for i in idx:
        v = values[i]
        if weak(v, dtype):
            continue
        try:
            dt = numpy.result_type(v, numpy.empty(0, dtype))
        except TypeError:
            dt = None
        if dt is None or dt.kind != 'f':
            raise Unsupported('%s: %s is %r, not a real number' % (
                kernel.name, kernel.scalars[i], v))
        strong += ((kernel.scalars[i], dt.str),)
    return strong


def is_numpy(array):
    return type(array) is numpy.ndarray


SUPPORTED_DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float64))
FLOAT16 = numpy.dtype(numpy.float16)
