"""The optimizer update, captured: in-place kernels, split across threads.

    optimizer = chainer.optimizers.Adam().setup(model)
    static_graph.capture_update(optimizer)       # the opt-in, one line

From then on ``optimizer.update()`` (called by you, ``StandardUpdater``, or
ChainerMN's multi-node optimizer) runs each parameter's update rule, and the
optimizer's and rules' hooks, as the op sequences of
``schedules.update_rules``: NumPy ufuncs writing into Chainer's own
parameter, gradient and state arrays (``out=``), with the same operations
in the same order and dtypes as Chainer 7.8.1's ``update_core_cpu``, so the
same bits. Element-wise work is split across a pool of threads (one
dispatch per phase; reductions such as GradientClipping's norm run whole,
serially, between phases). Everything around it stays Chainer's:
hyperparameters, ``enabled``, ``t`` and the state dictionaries are read at
every step (learning-rate extensions, ``disable_update()``,
``serializers.load_npz`` just work), loss scaling and ``use_fp32_update()``
are followed, and a step the captured update cannot run as Chainer would
(an update rule or hook of your own, CuPy/ChainerX/iDeep arrays, ...) runs
Chainer's own ``update`` instead, with the reason given once as a
``StaticGraphWarning`` and listed by ``explain_update(optimizer)``.
``chainer.config.use_static_graph = False`` runs Chainer's update too.
``update_schedule(optimizer)`` is the last captured step as a
``schedules.ir.Schedule`` (print it).

The optimizer's class is swapped for a subclass (same name) whose only
change is ``update``; ``copy.copy``, ``deepcopy`` and ``pickle`` of it
give the plain Chainer optimizer.
"""
import collections
import itertools
import threading

import numpy

import chainer
from chainer import optimizer as optimizer_module
from chainer import variable

from schedules import parallel
from static_graph import blas_idle
from static_graph import compat
from static_graph import diagnostics
from static_graph import update_cupy
from static_graph import update_plan
from static_graph import update_readers as R

MIN_SPLIT = 1 << 15    # elements: smaller parameters run on one thread
BLOCK = None           # a thread's whole chunk in one go (see capture_update)

_KEY = '_static_graph_update'
# NumPy 1 computes with 0-d arrays by their values (a 0-d float32 times a
# Python float is float64); NumPy 2 by their dtypes (NEP 50).
_VALUE_BASED = int(numpy.__version__.split('.')[0]) < 2
_uids = itertools.count()


def capture_update(optimizer, threads=None, min_split=MIN_SPLIT,
                   block=BLOCK, quiet_blas=True, cuda_graph=True,
                   native=True):
    """Run ``optimizer.update()`` as captured in-place kernels from now
    on; returns ``optimizer``.

    ``threads``: how many threads split the element-wise work (default:
    the cores this process may use, ``len(os.sched_getaffinity(0))``; 1:
    no split). ``min_split``: parameters of fewer elements are not split.
    ``block``: run each thread's chunk in blocks of this many elements
    (every op of a block back to back, while its operands are in cache);
    None (default): the whole chunk at once, which measured fastest on the
    MLP of ``benchmarks/update.py`` (its arrays fit in the L3 cache, and
    each block costs the GIL-holding Python of one call per op).
    ``quiet_blas``: at the first split step, make OpenBLAS's idle threads
    sleep soon after a matrix product instead of spinning for about 0.1 s
    on the cores the split needs (once per process; see
    ``static_graph.blas_idle``; False leaves BLAS as it is).
    ``native``: run each parameter's element-wise ops as one compiled C
    loop (one pass over memory, the same bits; built once with the C
    compiler and cached, see ``schedules.update_native``) where a C
    compiler is found, else as NumPy ufuncs; False: NumPy ufuncs.
    ``cuda_graph`` (default True): on CuPy, capture a step whose device
    work touches the same arrays as the step before into a CUDA graph, and
    launch it for later such steps (``static_graph.update_cupy``; see
    docs/captured_update.md); False: every step launch by launch.

    Works on a ChainerMN multi-node optimizer (it captures the optimizer
    it wraps) and on an optimizer not set up yet. Calling it again changes
    the options.
    """
    if compat.UNSUPPORTED is not None:
        diagnostics.warn_once(
            ('capture_update', 'unsupported'),
            'static_graph.capture_update is a pass-through: %s; the '
            'optimizer runs Chainer\'s update' % compat.UNSUPPORTED)
        return optimizer
    actual = optimizer
    inner = getattr(optimizer, '__dict__', {}).get('actual_optimizer')
    if inner is not None:       # chainermn's _MultiNodeOptimizer and co.
        actual = inner
    if not isinstance(actual, optimizer_module.Optimizer):
        raise TypeError('capture_update takes a chainer.Optimizer, not %s'
                        % type(optimizer).__name__)
    if threads is None:
        threads = parallel.default_threads()
    threads = int(threads)
    if threads < 1 or (block is not None and block < 1) or min_split < 0:
        raise ValueError('threads and block must be positive, min_split '
                         'not negative')
    actual.__dict__[_KEY] = _Capture(
        threads, int(min_split), None if block is None else int(block),
        bool(quiet_blas), bool(cuda_graph), bool(native))
    cls = type(actual)
    if not cls.__dict__.get('_static_graph_captured', False):
        actual.__class__ = _captured_class(cls)
    return optimizer


def explain_update(optimizer):
    """A report of the captured update: steps captured and run by Chainer,
    each fallback reason with its count, and the last captured plan."""
    cap = _capture_of(optimizer)
    if cap is None:
        return '%s: update not captured (static_graph.capture_update)' % (
            type(optimizer).__name__)
    return cap.explain()


def update_schedule(optimizer):
    """The last captured step as a ``schedules.ir.Schedule``, or None."""
    cap = _capture_of(optimizer)
    if cap is None or cap.last is None:
        return None
    return update_plan.schedule(*cap.last)


def fallback_reasons(optimizer):
    """{reason: steps} of the steps that ran Chainer's own update."""
    cap = _capture_of(optimizer)
    return dict(cap.reasons) if cap is not None else {}


def _capture_of(optimizer):
    d = getattr(optimizer, '__dict__', {})
    actual = d.get('actual_optimizer', optimizer)
    return getattr(actual, '__dict__', {}).get(_KEY)


# -- the class swap -----------------------------------------------------------

_classes = {}
_classes_lock = threading.Lock()


def _captured_class(base):
    with _classes_lock:
        cls = _classes.get(base)
        if cls is None:
            cls = _classes[base] = type(base.__name__, (base,), {
                'update': _update, '__reduce_ex__': _reduce_ex,
                '__module__': base.__module__,
                '__qualname__': base.__qualname__,
                '__doc__': base.__doc__,
                '_static_graph_captured': True,
                '_static_graph_base': base})
        return cls


def _reduce_ex(self, protocol):
    # Copies and pickles are the plain optimizer.
    state = dict(self.__dict__)
    state.pop(_KEY, None)
    return _new_plain, (type(self)._static_graph_base,), state


def _new_plain(cls):
    return cls.__new__(cls)


def _update(self, lossfun=None, *args, **kwds):
    base = type(self)._static_graph_base
    cap = self.__dict__.get(_KEY)
    if cap is None:
        return base.update(self, lossfun, *args, **kwds)
    return cap.update(self, base, lossfun, args, kwds)


# -- the capture --------------------------------------------------------------

_GRADIENT_METHOD = {
    name: getattr(optimizer_module.GradientMethod, name, None)
    for name in R.OPTIMIZER_METHODS}


def _class_reason(cls):
    if not issubclass(cls, optimizer_module.GradientMethod):
        return '%s is not a GradientMethod' % cls.__name__
    for name, fn in _GRADIENT_METHOD.items():
        if getattr(cls, name) is not fn:
            return '%s overrides GradientMethod.%s' % (cls.__name__, name)
    return None


class _Capture(object):

    def __init__(self, threads, min_split, block, quiet_blas,
                 cuda_graph=False, native=True):
        self.threads = threads
        self.native = native
        self.cuda_graph = cuda_graph
        self.gpu = None              # update_cupy.GpuUpdate, once on CuPy
        self.gpu_structure = None
        self.min_split = min_split
        self.block = block
        self.quiet_blas = quiet_blas
        self.uid = next(_uids)
        self.structure = None
        self.steps = 0
        self.fallback_steps = 0
        self.reasons = collections.OrderedDict()
        self.last = None             # (structure, variant)
        self.serial = None           # the last step's (name, name) sharing
        self._class_reasons = {}
        self.split = parallel.SplitChoice(threads)

    def __deepcopy__(self, memo):
        return _Capture(self.threads, self.min_split, self.block,
                        self.quiet_blas, self.cuda_graph, self.native)

    def update(self, opt, base, lossfun, args, kwds):
        if not getattr(chainer.config, 'use_static_graph', True):
            return base.update(opt, lossfun, *args, **kwds)
        cls = type(opt)
        reason = self._class_reasons.get(cls, 0)
        if reason == 0:
            reason = self._class_reasons[cls] = _class_reason(base)
        if reason is not None:
            self._fell_back(reason)
            return base.update(opt, lossfun, *args, **kwds)
        if lossfun is not None:      # GradientMethod.update's first part
            use_cleargrads = getattr(opt, '_use_cleargrads', True)
            loss = lossfun(*args, **kwds)
            if use_cleargrads:
                opt.target.cleargrads()
            else:
                opt.target.zerograds()
            loss.backward(loss_scale=opt._loss_scale)
            del loss
        try:
            target = opt.target
            if target is None or opt._hookable is None:
                raise R.Unsupported('the optimizer is not set up')
            params = list(target.params())
            if update_cupy.on_cupy(params):
                return self._gpu_step(opt, params)
            step = self._prepare(opt, params)
        except R.Unsupported as e:
            self._fell_back(str(e))
            return base.update(opt)
        self._run(opt, step)

    def _gpu_step(self, opt, params):
        gpu = self.gpu
        if gpu is None:
            gpu = self.gpu = update_cupy.GpuUpdate(self.cuda_graph)
        st = self.gpu_structure
        if st is None or not st.matches(opt, params):
            st = self.gpu_structure = update_cupy.GpuStructure(opt, params)
        gpu.step(opt, params, st)
        self.steps += 1

    def _fell_back(self, reason):
        self.fallback_steps += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        diagnostics.warn_once(
            ('update', self.uid, reason),
            'static_graph: the optimizer update runs Chainer\'s own update: '
            + reason)

    # -- one step -------------------------------------------------------------
    def _prepare(self, opt, params):
        """Read and check everything for one step; returns what ``_run``
        needs. Raises Unsupported (with every ``t`` it moved put back)
        where the step must run Chainer's update instead."""
        err = numpy.geterr()
        if 'raise' in err.values():
            # Chainer's update stops at the parameter that errs, with the
            # ones before it updated and their rules' t counted; the
            # captured step's threads and counters would be ahead.
            raise R.Unsupported(
                'numpy.seterr(%s): an error stops Chainer\'s update at '
                'the parameter that errs' % ', '.join(
                    sorted('%s=%r' % kv for kv in err.items()
                           if kv[1] == 'raise')))
        st = self.structure
        if st is None or not st.matches(opt, params):
            st = self.structure = update_plan.Structure(
                opt, params, self.threads, self.min_split, self.block,
                self.native)
        why = R.array_rate_scaled(st, params)
        if why is not None:
            raise R.Unsupported(why)
        if opt._loss_scaling_is_dynamic:
            # Chainer's order: gradients of None become zeros, then the
            # overflow check (which decides whether parameters update).
            opt.reallocate_cleared_grads()
            opt.check_nan_in_grads()
            safe = opt.is_safe_to_update()
        else:
            opt._loss_scaling_isnan = False     # as check_nan_in_grads
            safe = True
        for attempt in (0, 1):
            bumped = []
            try:
                return self._read(st, params, safe, bumped)
            except update_plan.Stale:
                # A parameter has a new array of another shape or dtype.
                for rule in bumped:
                    rule.t -= 1
                st = self.structure = update_plan.Structure(
                    opt, params, self.threads, self.min_split, self.block,
                    self.native)
            except BaseException:
                for rule in bumped:
                    rule.t -= 1
                raise
        raise R.Unsupported('parameter arrays change while read')

    def _read(self, st, params, safe, bumped):
        n = len(params)
        whole = [None] * n
        flat = [None] * n
        scalars = [None] * n
        sigs = [None] * n
        news = []
        read = {}
        ndarray = numpy.ndarray
        float16 = R.FLOAT16
        opt_pre, opt_post = st.opt_pre_items, st.opt_post_items
        # Parameters that share memory (W = base + delta: Add's backward
        # gives both one gradient array; two Parameters of one array):
        # Chainer updates one after the other, each seeing what the one
        # before wrote (the gradient divided by the loss scale twice).
        roots, shared = {}, None   # memory's owner id -> parameter index
        for i in range(n):
            p = params[i]
            arr = p.array
            rule = st.rules[i]
            if arr is None:
                # Uninitialized: Chainer's rule only counts the step.
                if st.shapes[i] is not None:
                    raise update_plan.Stale()
                try:
                    p.grad
                except RuntimeError as e:   # (no cleargrads since made)
                    raise R.Unsupported('gradient of %s: %s' % (
                        st.names[i], e))
                if safe and rule is not None and rule.enabled:
                    if rule._use_fp32_update:
                        raise R.Unsupported(
                            'uninitialized parameter %s with '
                            'use_fp32_update' % st.names[i])
                    rule.t += 1
                    bumped.append(rule)
                scalars[i] = []
                continue
            if type(arr) is not ndarray:
                raise R.Unsupported(_array_reason('parameter', arr))
            dtype = arr.dtype
            if arr.shape != st.shapes[i] or dtype != st.dtypes[i]:
                raise update_plan.Stale()
            if not arr.ndim and _VALUE_BASED and dtype.itemsize < 8:
                raise R.Unsupported(
                    '0-d parameter %s: NumPy 1 computes an update of 0-d '
                    '%s arrays in float64 (value-based casting), the '
                    'captured loops in %s' % (st.names[i], dtype.name,
                                              dtype.name))
            try:
                g = p.grad
            except RuntimeError as e:     # Chainer raises it too
                raise R.Unsupported('gradient of %s: %s' % (st.names[i], e))
            if g is None:                 # reallocate_cleared_grads
                g = numpy.zeros_like(arr)
                p._set_grad(g, layout_check=False)
            elif type(g) is not ndarray or g.dtype != dtype or \
                    g.shape != arr.shape:
                raise R.Unsupported(_array_reason('gradient', g))
            if not arr.flags.writeable or not g.flags.writeable and (
                    opt_pre or opt_post or st.rule_pre_items[i] or
                    st.rule_post_items[i]):
                # (Kept flat views stay writable: made before.) A hook
                # writes the gradient in place.
                raise R.Unsupported(
                    'the %s of %s is read-only: Chainer\'s update raises'
                    % ('parameter' if not arr.flags.writeable else
                       'gradient', st.names[i]))
            # (Most arrays own their memory: their own id.)
            r = id(arr) if arr.base is None else _root_id(arr)
            if roots.setdefault(r, i) != i:
                shared = (st.names[roots[r]], st.names[i])
            r = id(g) if g.base is None else _root_id(g)
            if roots.setdefault(r, i) != i:
                shared = (st.names[roots[r]], st.names[i])
            loss_scale = p._loss_scale
            S = []
            promo = None        # item -> scalars NumPy promotes past dtype
            for j, (hook, kernel) in enumerate(opt_pre):
                vals = R.hook_scalars(hook, kernel, loss_scale)
                strong = R.check_typed(kernel, vals, dtype)
                if strong:
                    promo = _promote(promo, ('opt_pre', j), strong)
                S += vals
            arrays = [arr, g]
            kernel = fp32 = scaled = None
            if safe and rule is not None and rule.enabled:
                fp32 = rule._use_fp32_update and dtype == float16
                if fp32:
                    param_ = _fp32_param(rule, p)
                    cdtype = R.SUPPORTED_DTYPES[0]
                else:
                    param_, cdtype = p, dtype
                    if dtype not in R.SUPPORTED_DTYPES:
                        raise R.Unsupported(
                            '%s parameter %s (without use_fp32_update)' % (
                                dtype.name, st.names[i]))
                if rule._state is None:
                    rule._init_states(param_)
                rule.t += 1
                bumped.append(rule)
                # Rules that share their hyperparameters (nothing set on
                # the rule's own) read the same values: once a step.
                hp = rule.hyperparam
                key = None
                if len(hp.__dict__) == 1:
                    key = (st.readers[i], hp._parent, rule.t, cdtype,
                           rule.__dict__.get('initial_alpha'))
                    got = read.get(key)
                if key is None or got is None:
                    kernel, vals = st.readers[i](rule, cdtype)
                    got = kernel, vals, R.check_typed(kernel, vals, cdtype)
                    if key is not None:
                        read[key] = got
                kernel, vals, strong = got
                if strong:
                    if kernel.name == 'SMORMS3':
                        # Chainer's binds new state arrays, of the wider
                        # dtype; the captured one writes into the old.
                        raise R.Unsupported(
                            'SMORMS3 with %s: Chainer\'s update makes its '
                            'state %s' % (', '.join(
                                '%s of dtype %s' % (n, numpy.dtype(d).name)
                                for n, d in strong),
                                numpy.dtype(strong[0][1]).name))
                    promo = _promote(promo, ('rule',), strong)
                state = rule._state
                for key in kernel.arrays[2:]:
                    s = state.get(key)
                    if type(s) is not ndarray or s.dtype != cdtype or \
                            s.shape != arr.shape or not s.flags.writeable:
                        raise R.Unsupported('state %r of %s: %s' % (
                            key, st.names[i], _array_reason('state', s)
                            if s is not None else 'missing (Chainer '
                            'raises)'))
                    arrays.append(s)
                if fp32:
                    p32 = param_.array
                    if type(p32) is not ndarray or p32.dtype != cdtype or \
                            p32.shape != arr.shape:
                        raise R.Unsupported(_array_reason('fp32 copy', p32))
                    pnew = numpy.empty(arr.shape, dtype)
                    arrays += [p32, st.grad32(i), pnew]
                    news.append((p, pnew))
                    ls_of_param_ = param_._loss_scale
                else:
                    ls_of_param_ = loss_scale
                scaled = loss_scale is not None
                if scaled:
                    S.append(loss_scale)
                for j, (hook, hkernel) in enumerate(st.rule_pre_items[i]):
                    hv = R.hook_scalars(hook, hkernel, ls_of_param_)
                    strong = R.check_typed(hkernel, hv, cdtype)
                    if strong:
                        promo = _promote(promo, ('rule_pre', j), strong)
                    S += hv
                S += vals
                for j, (hook, hkernel) in enumerate(st.rule_post_items[i]):
                    hv = R.hook_scalars(hook, hkernel, ls_of_param_)
                    strong = R.check_typed(hkernel, hv, cdtype)
                    if strong:
                        promo = _promote(promo, ('rule_post', j), strong)
                    S += hv
            for j, (hook, hkernel) in enumerate(opt_post):
                vals = R.hook_scalars(hook, hkernel, loss_scale)
                strong = R.check_typed(hkernel, vals, dtype)
                if strong:
                    promo = _promote(promo, ('opt_post', j), strong)
                S += vals
            if kernel is not None or promo is not None:
                sigs[i] = (kernel, fp32, scaled,
                           None if promo is None else
                           tuple(sorted(promo.items())))
            whole[i] = arrays
            flat[i] = st.flatten(i, arrays, fp32)
            scalars[i] = S
        variant = st.variant(tuple(sigs))
        if shared is not None:
            # The captured step runs a parameter at a time only on one
            # thread (here: the step is not split) and in one phase.
            if opt_pre or opt_post or variant.nphases > 1:
                raise R.Unsupported(
                    'parameters %s and %s share the memory of their arrays '
                    'or gradients (W = base + delta gives both one '
                    'gradient), and %s' % (shared + (
                        'an optimizer hook runs over every gradient before '
                        'any update' if opt_pre or opt_post else
                        'the step has a reduction between its element-wise '
                        'parts',)))
        return st, variant, whole, flat, scalars, news, shared

    def _run(self, opt, step):
        st, variant, whole, flat, scalars, news, serial = step
        opt.t += 1
        self.serial = serial
        if serial:     # parameters sharing memory: in order, one thread
            variant.run(whole, flat, scalars, None, None)
        else:
            self.split.run(
                lambda runner: variant.run(whole, flat, scalars, runner,
                                           parallel.caller_errstate()),
                blas_idle.quiet if self.quiet_blas else None)
        for p, pnew in news:         # use_fp32_update: a new array
            p.array = pnew
        opt.update_loss_scale()
        self.steps += 1
        self.last = (st, variant)

    def explain(self):
        lines = ['captured update: %d steps captured, %d ran Chainer\'s '
                 'update; threads=%d, min_split=%d, block=%s%s' % (
                     self.steps, self.fallback_steps, self.threads,
                     self.min_split, self.block, self.split.describe())]
        if self.quiet_blas and blas_idle.state() is not None:
            lines.append('  ' + blas_idle.state())
        if self.gpu is not None:
            lines.append(self.gpu.describe())
        for reason, count in self.reasons.items():
            lines.append('  fallback (%d steps): %s' % (count, reason))
        if self.serial is not None:
            lines.append('  the last step ran on one thread, a parameter '
                         'after the other: %s and %s share memory'
                         % self.serial)
        if self.last is not None:
            lines.append(update_plan.describe(*self.last))
        return '\n'.join(lines)


def _promote(promo, item, strong):
    if promo is None:
        promo = {}
    promo[item] = strong
    return promo


def _fp32_param(rule, param):
    # UpdateRule.__update's fp32 copy, made as Chainer makes it.
    if rule._fp32_param is None:
        rule._fp32_param = variable.Parameter(
            param.array.astype(numpy.float32), name=param.name)
    return rule._fp32_param


def _root_id(a):
    """id of the array that owns ``a``'s memory."""
    while isinstance(a.base, numpy.ndarray):
        a = a.base
    return id(a)


def _array_reason(what, a):
    if a is None:
        return '%s is None (uninitialized)' % what
    return '%s is a %s.%s%s' % (
        what, type(a).__module__, type(a).__name__,
        '' if type(a) is not numpy.ndarray else
        ' of %s %s%s' % (a.dtype, a.shape, '' if a.flags.writeable else
                         ', read-only: Chainer\'s update raises'))
