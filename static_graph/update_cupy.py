"""The captured update on CuPy parameters.

A step does on the host what Chainer 7.8.1's ``GradientMethod.update``
does there (the counters, the fp32 copies, the state dictionaries, every
hyperparameter and per-step value computed with Chainer's expressions:
``update_gpu_readers``), writes all the step's host scalars with one
host-to-device copy into a device array (``update_cuda.ScalarRing``), then
enqueues the device work in Chainer's order: each rule's
``update_core_gpu`` kernel with its scalars read from that array, and the
hooks' kernels and CuPy ufuncs with 0-d views of it where Chainer passes a
host scalar. Nothing reads a device value on the host: the step never
waits for the device (a ring buffer's event is queried, not waited on).

With ``cuda_graph=True`` a step whose device work touches the same arrays
as the step before (the same parameter, gradient and state arrays, at the
same addresses) is captured into a ``cupy.cuda.Graph`` and later such steps
launch it after the scalar copy; the fp32 copy of a ``use_fp32_update()``
parameter is then written into the parameter's own array instead of a new
one. A step on other arrays runs launch by launch.
"""
import collections

import numpy

import chainer
from chainer import variable

from schedules import update_cuda as C
from schedules import update_rules as K
from static_graph import update_gpu_readers as G
from static_graph import update_readers as R
from static_graph.update_readers import Unsupported

FLOAT16 = numpy.dtype(numpy.float16)
_REAL = (int, float, bool)
# A step like the one before reuses its device work and reads only the
# rules' scalars (update_cupy_steady.py); False reads every step in full.
STEADY = True


def cupy_module():
    import cupy
    return cupy


def on_cupy(params):
    """Whether the first initialized parameter is a CuPy array."""
    for p in params:
        a = p.array
        if a is not None:
            t = type(a)
            return t is not numpy.ndarray and t.__name__ == 'ndarray' and \
                t.__module__.startswith('cupy')
    return False


class Step(object):
    """One step's device work, collected on the host: ``segments`` (dtype,
    scalar values), ``ops`` (function, arguments, segment index or None),
    ``keys`` (what the work touches: kernel names and array addresses)."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.segments = []
        self.ops = []
        self.keys = []
        self.zero_d = []     # (segment, index) of scalars ufuncs read
        self.reads = []      # (rule, dtype, kernel, state keys, sdt)

    def scalars(self, dtype, values):
        for v in values:
            if type(v) not in _REAL and not (
                    isinstance(v, numpy.generic) and v.dtype.kind in 'fiub'):
                raise Unsupported('a scalar of the update is a %s' %
                                  type(v).__name__)
        self.segments.append((numpy.dtype(dtype), tuple(values)))
        return len(self.segments) - 1

    def op(self, fn, args, seg=None, key=None):
        self.ops.append((fn, args, seg))
        keys = self.keys
        keys.append(key or fn.__name__)
        ndarray = self.cupy.ndarray
        for a in args:
            if isinstance(a, ndarray):
                keys.append(_where(a))
            elif isinstance(a, _GradRef):
                keys.append(a.box is not None or _where(a.param.grad))
            elif isinstance(a, (tuple, list)):
                for b in a:
                    if isinstance(b, ndarray):
                        keys.append(_where(b))
                    elif isinstance(b, chainer.Variable):
                        keys.append(_where(b.grad))

    def layout_key(self):
        return tuple((d.char, len(v)) for d, v in self.segments)


class GpuUpdate(object):
    """The CuPy side of a captured optimizer (``update._Capture.gpu``)."""

    def __init__(self, cuda_graph=False, xp=None):
        cupy = self.cupy = xp if xp is not None else cupy_module()
        self.legacy = C.legacy_scalars(cupy)
        self.staging = C.CupyStaging(cupy)
        self.rings = collections.OrderedDict()      # layout key -> ring
        self.cuda_graph = cuda_graph
        self.graph = None        # (keys, graph, keep)
        self.last_keys = None
        self.refused = {}        # keys -> reason
        self.steps = self.graph_launches = self.captures = 0
        self._dtypes = {}
        self.steady = None       # the last step's template (steady path)
        self.steady_steps = 0    # steps read through it

    # -- reading a step ------------------------------------------------------
    def step(self, opt, params, structure):
        """Run one update of ``opt`` (set up, static or no loss scaling)
        as Chainer's ``GradientMethod.update`` would; raises Unsupported
        (with every counter put back) where it cannot."""
        if opt._loss_scaling_is_dynamic:
            raise Unsupported(
                'dynamic loss scaling on CuPy: Chainer checks on the host '
                'whether every gradient is finite (a synchronization that '
                'decides the step)')
        steady = self.steady
        if steady is not None and STEADY and steady.fits(structure):
            bumped = []
            with self.cupy.cuda.Device(steady.dev):
                try:
                    st = steady.read(opt, bumped)
                    ring = self._ring(st)
                except BaseException as e:
                    for rule in bumped:
                        rule.t -= 1
                    if not isinstance(e, Exception):
                        raise
                    st = None    # read in full below (which raises, if)
                if st is not None:
                    self._run(opt, st, ring, ())
                    self.steps += 1
                    self.steady_steps += 1
                    return
        self.steady = None
        dev = _device_of(params)
        bumped = []
        fixed = self.cuda_graph
        with self.cupy.cuda.Device(dev):
            try:
                st = Step(self.cupy)
                news = self._read(opt, params, structure, st, bumped, fixed)
                ring = self._ring(st)
            except BaseException:
                for rule in bumped:
                    rule.t -= 1
                raise
            before = self.last_keys
            self._run(opt, st, ring, news)
        self.steps += 1
        if STEADY and not news and self.last_keys == before:
            # Two steps on the same arrays: the next may read in part.
            self.steady = _steady.Steady.of(structure, dev, st)

    def _read(self, opt, params, structure, st, bumped, fixed):
        cupy = self.cupy
        opt._loss_scaling_isnan = False      # as check_nan_in_grads
        # GradientMethod.update: gradients of None become zeros.
        for p in params:
            a = p.array
            if a is None:
                continue
            try:
                g = p.grad
            except RuntimeError as e:     # Chainer raises it too
                raise Unsupported('gradient of %s: %s' % (p.name, e))
            if g is None:
                with chainer.using_device(p.device):
                    g = cupy.zeros_like(a)
                    p._set_grad(g, layout_check=False)
            if not isinstance(a, cupy.ndarray) or \
                    not isinstance(g, cupy.ndarray) or \
                    g.dtype != a.dtype or g.shape != a.shape:
                raise Unsupported('parameter or gradient of %s is not a CuPy '
                                  'array of its dtype and shape' % p.name)
        for hook in structure.opt_pre:
            self._opt_hook(hook, opt, params, st, {})
        news = []
        memo = {}
        for p, rule in zip(params, structure.rules):
            if rule is None or not rule.enabled:
                continue
            news += self._rule(p, rule, st, bumped, fixed, memo)
        # Chainer calls the optimizer's post hooks after each parameter
        # took its new array (use_fp32_update): they read that one.
        new_arrays = dict((id(p), new) for p, new in news)
        for hook in structure.opt_post:
            self._opt_hook(hook, opt, params, st, new_arrays)
        return news

    def _rule(self, p, rule, st, bumped, fixed, memo):
        cupy = self.cupy
        a = p.array
        if a is None:            # Chainer's rule only counts the step
            if rule._use_fp32_update:
                raise Unsupported('uninitialized parameter %s with '
                                  'use_fp32_update' % p.name)
            rule.t += 1
            bumped.append(rule)
            return []
        rule.t += 1
        bumped.append(rule)
        loss_scale = p._loss_scale
        news = []
        fp32 = rule._use_fp32_update and a.dtype == FLOAT16
        if fp32:
            if rule._fp32_param is None:
                with chainer.using_device(p.device):
                    rule._fp32_param = variable.Parameter(
                        a.astype(numpy.float32), name=p.name)
            param_ = rule._fp32_param
            grad_of = [None]
            st.op(_to_fp32, (p.grad, grad_of))
        else:
            param_ = p
            grad_of = None
        self._init_states(rule, param_)
        arr_ = param_.array
        dtype = arr_.dtype
        if loss_scale is not None:
            ls = G.ufunc_scalar(loss_scale, dtype, 'the loss scale')
            j = st.scalars(dtype, (ls,))
            st.zero_d.append((j, 0))
            st.op(_loss_scale_op, (_GradRef(param_, grad_of),), j)
        ls_ = param_._loss_scale if fp32 else loss_scale
        for hook in rule._hookable._pre_update_hooks.values():
            self._param_hook(hook, param_, grad_of, ls_, st)
        state = rule._state
        kernel, values, state_keys, sdt = G.read_rule(rule, dtype, memo)
        st.reads.append((rule, dtype, kernel, state_keys, sdt))
        if not isinstance(state, dict):
            state = {}
        arrays = []
        for k in state_keys:
            s = state.get(k)
            if not isinstance(s, cupy.ndarray) or s.shape != arr_.shape \
                    or s.dtype != arr_.dtype:
                raise Unsupported('state %r of %s is not a CuPy array of its '
                                  'shape and dtype' % (k, p.name))
            arrays.append(s)
        j = st.scalars(sdt, values)
        st.op(_rule_op, (kernel.kernel(cupy), _GradRef(param_, grad_of),
                         arr_, tuple(arrays)), j, key=kernel.name)
        for hook in rule._hookable._post_update_hooks.values():
            self._param_hook(hook, param_, grad_of, ls_, st)
        if fp32:
            if fixed:
                st.op(_copy_into, (a, arr_))
            else:
                new = cupy.empty(a.shape, a.dtype)
                st.op(_copy_into, (new, arr_))
                news.append((p, new))
        return news

    def _init_states(self, rule, param_):
        state = rule._state
        if state is not None:
            dev = param_.array.device.id
            ok = True
            for s in state.values():
                if not isinstance(s, self.cupy.ndarray) or \
                        s.device.id != dev:
                    ok = False
                    break
            if ok:
                return
        rule._init_states(param_)       # Chainer's: init, or to the device

    # -- hooks ---------------------------------------------------------------
    def _opt_hook(self, hook, opt, params, st, new_arrays):
        if getattr(hook, 'call_for_each_param', False):
            for p in params:
                if p.array is not None:
                    self._param_hook(hook, p, None, p._loss_scale, st,
                                     new_arrays.get(id(p)))
            return
        # GradientClipping (the one optimizer-wide hook it knows)
        grads = [p.grad for p in params if p.array is not None]
        if not grads:
            return
        dts = set(g.dtype for g in grads)
        if len(dts) != 1:
            raise Unsupported('GradientClipping over gradients of several '
                              'dtypes')
        dtype = self._result_dtype('sqnorm', dts.pop())
        thr = G.ufunc_scalar(hook.threshold, dtype,
                             'GradientClipping.threshold')
        j = st.scalars(dtype, (thr,))
        st.zero_d.append((j, 0))
        st.op(_clip_op, ([p for p in params if p.array is not None],), j)

    def _param_hook(self, hook, param_, grad_of, loss_scale, st,
                    array=None):
        cupy = self.cupy
        R.hook_kind(hook, True)
        kernel = R.hook_kernel(hook)
        p = param_.array if array is None else array
        g = _GradRef(param_, grad_of)
        dtype = p.dtype
        name = type(hook).__name__
        if kernel is K.WEIGHT_DECAY:
            j = st.scalars(dtype, (G.weight_decay_rate(hook, loss_scale),))
            st.op(_weight_decay_op, (C.WEIGHT_DECAY.kernel(cupy), p, g), j)
        elif kernel is K.LASSO:
            j = st.scalars(dtype, (hook.rate,))
            st.op(_lasso_op, (C.LASSO.kernel(cupy), p, g), j)
        elif kernel is K.GRADIENT_HARD_CLIPPING:
            lo = G.ufunc_scalar(hook.lower_bound, dtype, name + '.lower_bound')
            hi = G.ufunc_scalar(hook.upper_bound, dtype, name + '.upper_bound')
            j = st.scalars(dtype, (lo, hi))
            st.zero_d += [(j, 0), (j, 1)]
            st.op(_hard_clip_op, (g,), j)
        elif kernel is K.GRADIENT_LARS:
            # eps, weight_decay and threshold meet the norms (in the
            # dtype CuPy's norm gives), weight_decay the parameter too.
            ndt = self._result_dtype('norm', dtype)
            vals = tuple(G.ufunc_scalar(getattr(hook, a), ndt, name + '.'
                                        + a)
                         for a in ('eps', 'weight_decay', 'threshold'))
            vals += (G.ufunc_scalar(hook.weight_decay, dtype,
                                    name + '.weight_decay'),)
            j = st.scalars(ndt, vals[:3])
            k = st.scalars(dtype, vals[3:])
            st.zero_d += [(j, 0), (j, 1), (j, 2), (k, 0)]
            st.op(_lars_op, (p, g, k), j)
        else:
            raise Unsupported('hook %s on CuPy' % name)

    def _result_dtype(self, what, dtype):
        """The dtype of GradientClipping's squared norm ('sqnorm') or of
        ``cupy.linalg.norm`` ('norm') of arrays of ``dtype``, as CuPy
        computes it (a dtype is host metadata: found once per dtype from a
        one-element array, nothing waits for the device)."""
        key = (what, dtype)
        dt = self._dtypes.get(key)
        if dt is None:
            cupy = self.cupy
            x = cupy.zeros(1, dtype)
            if what == 'norm':
                dt = cupy.linalg.norm(x).dtype
            else:
                dt = cupy.sqrt(0 + x.dot(x)).dtype
            dt = self._dtypes[key] = numpy.dtype(dt)
        return dt

    # -- running it ----------------------------------------------------------
    def _ring(self, st):
        key = st.layout_key()
        ring = self.rings.get(key)
        if ring is None:
            ring = C.ScalarRing(C.Layout([(d, len(v)) for d, v in
                                          st.segments]),
                                self.staging, self.legacy)
            ring.zero_d = {}
            self.rings[key] = ring
            while len(self.rings) > 8:
                self.rings.popitem(last=False)
        for j, k in st.zero_d:
            if (j, k) not in ring.zero_d:      # a 0-d view, not a copy
                ring.zero_d[(j, k)] = ring.slices[j][k:k + 1].reshape(())
        return ring

    def _run(self, opt, st, ring, news):
        ring.stage([v for _, v in st.segments])
        opt.t += 1
        keys = (id(ring), tuple(st.keys))
        if self.cuda_graph and self._launch_graph(keys, st, ring):
            pass
        else:
            _launch(st, ring)
        self.last_keys = keys
        for p, new in news:          # use_fp32_update: a new array
            p.array = new
        opt.update_loss_scale()

    def _launch_graph(self, keys, st, ring):
        g = self.graph
        if g is not None and g[0] == keys:
            self.graph_launches += 1
            g[1].launch()
            return True
        if keys != self.last_keys or keys in self.refused:
            return False
        from schedules import cuda_graph
        backend = cuda_graph.CupyBackend()
        try:
            graph, _, keep = backend.capture(
                lambda inputs: (_launch(st, ring), ())[1], ())
        except cuda_graph.NotCapturable as e:
            self.refused[keys] = str(e)
            return False
        self.graph = (keys, graph, keep, ring)   # the ring: its device array
        self.captures += 1
        self.graph_launches += 1
        graph.launch()
        return True

    def describe(self):
        lines = ['  on CuPy: %d steps (%d like the step before: only the '
                 'scalars read); scalars: one copy a step into %d '
                 'device array(s) (%s)' % (
                     self.steps, self.steady_steps, len(self.rings),
                     ', '.join('%d B, %d pinned buffer(s), %d copies, '
                               '%d waits' % (r.layout.nbytes, len(r.slots),
                                             r.copies, r.waits)
                               for r in self.rings.values()))]
        if self.cuda_graph:
            lines.append('  CUDA graph: %d captured, %d launches%s' % (
                self.captures, self.graph_launches, ''.join(
                    '; refused: ' + r for r in set(self.refused.values()))))
        return '\n'.join(lines)


def _where(a):
    # What a kernel a graph keeps depends on: address, shape, strides, dtype.
    return (a.data.ptr, a.shape, a.strides, a.dtype.char)


def _device_of(params):
    dev = None
    for p in params:
        a = p.array
        if a is None:
            continue
        d = a.device.id
        if dev is None:
            dev = d
        elif d != dev:
            raise Unsupported('parameters on several devices (Chainer '
                              'reads the global norm on the host there)')
    return 0 if dev is None else dev


class _GradRef(object):
    """The gradient a device op works on: the parameter's, or the fp32
    copy the step made (known when the ops run)."""

    __slots__ = ('param', 'box')

    def __init__(self, param, box):
        self.param, self.box = param, box

    def get(self):
        return self.box[0] if self.box is not None else self.param.grad


class GpuStructure(object):
    """The parameters, their update rules and the optimizer's hooks, as
    read at a step (identities; a change reads them again). Raises
    Unsupported for a rule or hook the captured update does not know."""

    def __init__(self, opt, params):
        self.params = params
        self.rules = [getattr(p, 'update_rule', None) for p in params]
        if len(set(map(id, params))) != len(params):
            raise Unsupported('a parameter comes twice in target.params() '
                              '(a link registered twice)')
        self.own = R.OwnMethods()
        self.own.check(opt, params, self.rules)
        for p, rule in zip(params, self.rules):
            if p.layout is not None:
                raise Unsupported('parameter %s has a memory layout'
                                  % p.name)
            if rule is None:
                continue
            reason = R.check_rule_class(type(rule))
            if reason is None and type(rule) not in G.RULES:
                reason = 'update rule %s on CuPy' % type(rule).__name__
            if reason is not None:
                raise Unsupported(reason)
        hooks = opt._hookable
        self.opt_pre = tuple(hooks._pre_update_hooks.values())
        self.opt_post = tuple(hooks._post_update_hooks.values())
        for h in self.opt_pre + self.opt_post:
            R.hook_kind(h, getattr(h, 'call_for_each_param', False))

    def matches(self, opt, params):
        if len(params) != len(self.params):
            return False
        for p, q, rule in zip(params, self.params, self.rules):
            if p is not q or getattr(p, 'update_rule', None) is not rule:
                return False
        hooks = opt._hookable
        if tuple(hooks._pre_update_hooks.values()) != self.opt_pre or \
                tuple(hooks._post_update_hooks.values()) != self.opt_post:
            return False
        self.own.check(opt, params, self.rules)
        return True


def _launch(st, ring):
    xp = st.cupy
    for fn, args, j in st.ops:
        if j is None:
            fn(xp, *args)
        else:
            fn(xp, *args, ring, j)


# -- the device ops, in Chainer's order and with Chainer's calls --------------
# (``ring.slices[j]``: the op's scalars on the device; ``ring.zero_d[(j,
# k)]``: the k-th of them as a 0-d array, where Chainer hands a ufunc a
# host scalar.)

def _to_fp32(cupy, g, box):
    box[0] = g.astype(numpy.float32)     # param.grad.astype(numpy.float32)


def _loss_scale_op(cupy, g, ring, j):
    grad = g.get()
    cupy.true_divide(grad, ring.zero_d[(j, 0)], out=grad)   # grad /= ls


def _rule_op(cupy, kernel, g, param, states, ring, j):
    kernel(g.get(), ring.slices[j], param, *states)


def _copy_into(cupy, dst, src):
    cupy.copyto(dst, src)                # fp32_param.array.astype(dtype)


def _weight_decay_op(cupy, kernel, p, g, ring, j):
    kernel(p, ring.slices[j], g.get())


def _lasso_op(cupy, kernel, p, g, ring, j):
    kernel(cupy.sign(p), ring.slices[j], g.get())


def _hard_clip_op(cupy, g, ring, j):
    grad = g.get()
    cupy.clip(grad, ring.zero_d[(j, 0)], ring.zero_d[(j, 1)], out=grad)


def _lars_op(cupy, p, g, k, ring, j):
    grad = g.get()
    eps, wd, thr = (ring.zero_d[(j, i)] for i in range(3))
    p_norm = cupy.linalg.norm(p)
    g_norm = cupy.linalg.norm(grad)
    local_rate = (p_norm / (eps + g_norm + wd * p_norm))
    rate = cupy.where(p_norm > thr, local_rate, 1.0)
    grad += ring.zero_d[(k, 0)] * p
    grad *= rate


def _clip_op(cupy, params, ring, j):
    sqnorm, _ = G.sum_sqnorm_grads(params)     # Chainer's own sum
    norm = cupy.sqrt(sqnorm)
    rate = cupy.true_divide(ring.zero_d[(j, 0)], norm)   # threshold / norm
    rate = rate.clip(None, 1)
    for p in params:
        grad = p.grad
        grad *= rate


from static_graph import update_cupy_steady as _steady  # NOQA (uses names above)
