"""The plan of a captured update: what runs for which parameter, in which
phase, on which thread.

A ``Structure`` is keyed on identities: the optimizer's parameters (in
``target.params()`` order), their update rules, and the optimizer's and
rules' hooks; a change to any of them (a parameter added, ``setup`` on
another link, a hook added) builds a new one. Under it, a ``Variant`` per
step signature (each parameter's kernel, or None where it does not update
this step; whether it updates in fp32; whether its gradient is unscaled)
holds the compiled programs of each phase and the reductions between them.
Scalars (hyperparameters) are values of the step, never part of a plan.
"""
import collections

import numpy

from schedules import parallel
from schedules import update_ir
from schedules import update_native
from schedules import update_rules as K
from static_graph import update_readers as R


class Stale(Exception):
    """A parameter's array changed shape or dtype: plan again."""


class Structure(object):

    def __init__(self, opt, params, threads, min_split, block,
                 native=True):
        self.params = params
        self.native = native
        self.rules = [getattr(p, 'update_rule', None) for p in params]
        self.own = R.OwnMethods()
        self.own.check(opt, params, self.rules)
        names = {id(p): name for name, p in opt.target.namedparams()}
        self.names = [names.get(id(p), p.name or '?') for p in params]
        if len(set(map(id, params))) != len(params):
            raise R.Unsupported('a parameter comes twice in target.params() '
                                '(a link registered twice)')
        self.shapes, self.dtypes, self.readers = [], [], []
        for p, rule, name in zip(params, self.rules, self.names):
            if p.layout is not None:
                raise R.Unsupported('parameter %s has a memory layout'
                                    % name)
            arr = p.array
            if arr is None:       # uninitialized: no work, t still counts
                self.shapes.append(None)
                self.dtypes.append(None)
            elif type(arr) is not numpy.ndarray:
                raise R.Unsupported('parameter %s is a %s.%s' % (
                    name, type(arr).__module__, type(arr).__name__))
            else:
                self.shapes.append(arr.shape)
                self.dtypes.append(arr.dtype)
            if rule is None:
                self.readers.append(None)
                continue
            reason = R.check_rule_class(type(rule))
            if reason is not None:
                raise R.Unsupported(reason)
            self.readers.append(R.RULES[type(rule)])
        hooks = opt._hookable
        self.opt_pre = tuple(hooks._pre_update_hooks.values())
        self.opt_post = tuple(hooks._post_update_hooks.values())
        self.opt_pre_items = [self._opt_item(h) for h in self.opt_pre]
        self.opt_post_items = [self._opt_item(h) for h in self.opt_post]
        self.rule_pre, self.rule_post = [], []
        self.rule_pre_items, self.rule_post_items = [], []
        for rule in self.rules:
            pre = post = ()
            if rule is not None:
                pre = tuple(rule._hookable._pre_update_hooks.values())
                post = tuple(rule._hookable._post_update_hooks.values())
            self.rule_pre.append(pre)
            self.rule_post.append(post)
            self.rule_pre_items.append([self._rule_item(h) for h in pre])
            self.rule_post_items.append([self._rule_item(h) for h in post])
        self.sizes = [0 if s is None else int(numpy.prod(s))
                      for s in self.shapes]
        # GradientClipping's norm: Chainer's target.params(False)
        self.initialized = [p for p, s in zip(params, self.shapes)
                            if s is not None]
        self.threads, self.min_split, self.block = threads, min_split, block
        self.temps = parallel.Temps(threads)
        self.variants = {}
        self._flat = [{} for _ in params]
        self._grad32 = {}

    @staticmethod
    def _opt_item(hook):
        R.hook_kind(hook, getattr(hook, 'call_for_each_param', False))
        return hook, R.hook_kernel(hook)

    @staticmethod
    def _rule_item(hook):
        R.hook_kind(hook, True)
        return hook, R.hook_kernel(hook)

    def matches(self, opt, params):
        if len(params) != len(self.params):
            return False
        for p, q, rule in zip(params, self.params, self.rules):
            if p is not q or p.update_rule is not rule:
                return False
        hooks = opt._hookable
        if tuple(hooks._pre_update_hooks.values()) != self.opt_pre or \
                tuple(hooks._post_update_hooks.values()) != self.opt_post:
            return False
        for rule, pre, post in zip(self.rules, self.rule_pre,
                                   self.rule_post):
            if rule is None:
                continue
            h = rule._hookable
            a, b = h._pre_update_hooks, h._post_update_hooks
            if (a or pre) and tuple(a.values()) != pre:
                return False
            if (b or post) and tuple(b.values()) != post:
                return False
        self.own.check(opt, params, self.rules)
        return True     # shapes and dtypes: checked by the step (Stale)

    def grad32(self, i):
        """The float32 gradient buffer of a float16 parameter that updates
        in fp32 (Chainer makes a new one each step and drops it after)."""
        g = self._grad32.get(i)
        if g is None:
            g = self._grad32[i] = numpy.empty(self.shapes[i], numpy.float32)
        return g

    def flatten(self, i, arrays, fp32):
        """Flat views of a parameter's arrays, or None where one is not
        C-contiguous (then its programs run on the whole arrays, unsplit).
        The views of the arrays that last (the parameter, its state) are
        kept for the next step; not those of a step's own arrays (the
        gradient; with fp32 the float16 parameter and its new array), which
        would stay alive a step longer than in Chainer."""
        cache = self._flat[i]
        out = []
        last = len(arrays) - 1
        for j, a in enumerate(arrays):
            c = cache.get(j)
            if c is not None and c[0] is a:
                out.append(c[1])
                continue
            if not a.flags.c_contiguous:
                return None
            f = a if a.ndim == 1 else a.reshape(-1)
            if j != 1 and not (fp32 and (j == 0 or j == last)):
                cache[j] = (a, f)
            out.append(f)
        return out

    def variant(self, sigs):
        v = self.variants.get(sigs)
        if v is None:
            v = self.variants[sigs] = Variant(self, sigs)
        return v


class _Clip(object):
    """GradientClipping: the global norm (Chainer's own sum), then each
    parameter's (clip, rate) scalars."""

    def __init__(self, hook, params, slots):
        self.hook, self.params, self.slots = hook, params, slots

    def __call__(self, whole, scalars):
        clip, rate = R.clip_rate(self.hook, self.params)
        for i, cs, rs in self.slots:
            scalars[i][cs] = clip
            scalars[i][rs] = rate


class _Lars(object):
    """GradientLARS: the norms of one parameter and its gradient."""

    def __init__(self, hook, i, pslot, gslot, rslot):
        self.hook, self.i = hook, i
        self.pslot, self.gslot, self.rslot = pslot, gslot, rslot

    def __call__(self, whole, scalars):
        arrays = whole[self.i]
        scalars[self.i][self.rslot] = R.lars_rate(
            self.hook, arrays[self.pslot], arrays[self.gslot])


class Variant(object):
    """Phases of element-wise programs and the reductions between them,
    for one step signature. ``items`` keeps, in execution order, what each
    phase and reduction does, for ``schedule()`` and ``describe()``."""

    def __init__(self, st, sigs):
        n = len(sigs)
        self.sigs = sigs
        counters = [0] * n
        slots = [0] * n
        segs = collections.defaultdict(list)     # (i, phase) -> Segments
        reds = collections.defaultdict(list)     # phase -> reductions
        self.red_info = collections.defaultdict(list)
        self.slot_names = [[] for _ in range(n)]
        self.array_labels = []
        self.fp32 = []

        def scalar_map(i, kernel, prefix):
            base = slots[i]
            slots[i] += len(kernel.scalars)
            self.slot_names[i] += ['%s.%s' % (prefix, s) if prefix else s
                                   for s in kernel.scalars]
            return {s: base + j for j, s in enumerate(kernel.scalars)}

        # scalars NumPy promotes past the arrays' dtype, by item
        promos = [dict(sig[3]) if sig is not None and sig[3] else {}
                  for sig in sigs]

        def add(i, kernel, amap, smap, dtype, item=None):
            segs[(i, counters[i])].append(K.Segment(
                kernel, amap, smap, dtype, promos[i].get(item, ())))

        def hook_items(items, amap_of, level):
            # Optimizer hooks: every parameter, hook by hook.
            for j, (hook, kernel) in enumerate(items):
                per = [(i, scalar_map(i, kernel, type(hook).__name__))
                       for i in range(n) if st.shapes[i] is not None]
                if kernel is K.GRADIENT_CLIPPING:
                    k = max(counters) if counters else 0
                    cl = [(i, m['clip'], m['rate']) for i, m in per]
                    reds[k].append(_Clip(hook, st.initialized, cl))
                    self.red_info[k].append((
                        'GradientClipping',
                        [(i, amap_of(i)['grad']) for i, _ in per], cl))
                    for i in range(n):
                        counters[i] = k + 1
                for i, m in per:
                    amap = amap_of(i)
                    if kernel is K.GRADIENT_LARS:
                        self._lars(reds, counters, hook, i, amap, m)
                    add(i, kernel, {a: amap[a] for a in kernel.arrays}, m,
                        st.dtypes[i], (level, j))

        def rule_hooks(i, items, rmap, dtype, level):
            # An update rule's hooks: its own parameter only.
            for j, (hook, kernel) in enumerate(items):
                m = scalar_map(i, kernel, type(hook).__name__)
                if kernel is K.GRADIENT_LARS:
                    self._lars(reds, counters, hook, i, rmap, m)
                add(i, kernel, {a: rmap[a] for a in kernel.arrays}, m,
                    dtype, (level, j))

        hook_items(st.opt_pre_items, lambda i: {'param': 0, 'grad': 1},
                   'opt_pre')
        post_amap = {}
        for i, sig in enumerate(sigs):
            labels = ['param', 'grad']
            if sig is None or sig[0] is None:   # not updated this step
                self.fp32.append(False)
                self.array_labels.append(labels)
                continue
            kernel, fp32, scaled, _ = sig
            nstate = len(kernel.arrays) - 2
            labels += list(kernel.arrays[2:])
            dtype = numpy.dtype(numpy.float32) if fp32 else st.dtypes[i]
            if fp32:
                p32, g32, pnew = 2 + nstate, 3 + nstate, 4 + nstate
                labels += ['param32', 'grad32', 'new param']
                add(i, K.TO_FP32, {'grad': 1, 'grad32': g32}, {}, dtype)
                pslot, gslot = p32, g32
                post_amap[i] = {'param': pnew, 'grad': 1}
            else:
                pslot, gslot = 0, 1
            self.fp32.append(fp32)
            self.array_labels.append(labels)
            if scaled:
                add(i, K.LOSS_SCALE, {'grad': gslot},
                    scalar_map(i, K.LOSS_SCALE, ''), dtype)
            rmap = {'param': pslot, 'grad': gslot}
            rule_hooks(i, st.rule_pre_items[i], rmap, dtype, 'rule_pre')
            amap = dict(rmap)
            amap.update({s: 2 + j for j, s in enumerate(kernel.arrays[2:])})
            add(i, kernel, amap, scalar_map(i, kernel, ''), dtype, ('rule',))
            rule_hooks(i, st.rule_post_items[i], rmap, dtype, 'rule_post')
            if fp32:
                add(i, K.FROM_FP32, {'param32': p32, 'param': pnew}, {},
                    dtype)
        hook_items(st.opt_post_items,
                   lambda i: post_amap.get(i, {'param': 0, 'grad': 1}),
                   'opt_post')
        self.nphases = max([k for _, k in segs] + list(reds) + [0]) + 1
        work = [[] for _ in range(self.nphases)]
        self.segments = {}
        self.why_numpy = {}     # (i, k) -> why its program is not C
        for (i, k), seg_list in sorted(segs.items(), key=lambda kv:
                                       (kv[0][1], kv[0][0])):
            prog = K.compile_program(seg_list)
            if st.native:
                prog, why = update_native.program(prog)
            else:
                why = 'native=False'
            work[k].append((i, prog))
            self.segments[(i, k)] = seg_list
            if why is not None:
                self.why_numpy[(i, k)] = why
        self.reductions = [reds.get(k, []) for k in range(self.nphases)]
        self.red_info = dict(self.red_info)
        self.phases = parallel.Phases(work, st.sizes, st.threads,
                                      st.min_split, st.block, st.temps)
        self.st = st
        self._full = {}

    def _lars(self, reds, counters, hook, i, amap, smap):
        k = counters[i]
        reds[k].append(_Lars(hook, i, amap['param'], amap['grad'],
                             smap['rate']))
        self.red_info[k].append(('GradientLARS', [(i, amap['param']),
                                                  (i, amap['grad'])],
                                 [(i, smap['rate'])]))
        counters[i] = k + 1

    def full_temps(self, i, prog):
        key = (i, prog)
        t = self._full.get(key)
        if t is None:
            shape = self.st.shapes[i]
            t = self._full[key] = tuple(numpy.empty(shape, dt)
                                        for dt in prog.temp_dtypes)
        return t

    def run(self, whole, flat, scalars, runner, errstate):
        phases = self.phases
        for k in range(self.nphases):
            if phases.work[k]:
                phases.run_phase(k, flat, whole, scalars, self.full_temps,
                                 runner, errstate)
            for red in self.reductions[k]:
                red(whole, scalars)


def schedule(st, variant):
    """The variant as a ``schedules.ir.Schedule``."""
    return update_ir.build(_entries(st, variant), variant.segments,
                           variant.red_info, variant.nphases, st.threads)


def _entries(st, variant):
    out = []
    for i, name in enumerate(st.names):
        if st.shapes[i] is None:
            out.append(None)
            continue
        split = variant.phases.split[i]
        out.append(update_ir.Entry(
            name, st.shapes[i], st.dtypes[i], variant.array_labels[i],
            variant.slot_names[i], variant.fp32[i],
            st.threads if split else 1))
    return out


def _engine(whys):
    """How a parameter's programs run: compiled C loops or NumPy ufuncs
    (and why). (A loop's call still runs the ufuncs where the loop would
    not give their bits on its operands: update_native._loop_gives_numpys.)
    """
    if not whys:
        return ''
    if all(w is None for w in whys):
        return '; %s' % ('one C loop' if len(whys) == 1 else
                         '%d C loops' % len(whys))
    reasons = sorted(set(w for w in whys if w is not None))
    return '; NumPy ufuncs (%s)' % '; '.join(reasons)


def describe(st, variant):
    """A few lines: each parameter, its kernels, whether it is split."""
    lines = ['  last plan: %d phase(s), %d thread(s)' % (
        variant.nphases, st.threads)]
    for i, name in enumerate(st.names):
        if st.shapes[i] is None:
            lines.append('    %s: uninitialized' % name)
            continue
        kernels, whys = [], []
        for k in range(variant.nphases):
            kernels += [s.kernel.name for s in
                        variant.segments.get((i, k), [])]
            if (i, k) in variant.segments:
                whys.append(variant.why_numpy.get((i, k)))
        split = variant.phases.split[i]
        lines.append('    %s %s[%s]: %s; %s%s' % (
            name, st.dtypes[i].name, ','.join(map(str, st.shapes[i])),
            ' > '.join(kernels) or 'nothing',
            'split across %d threads' % st.threads if split else
            'one thread', _engine(whys)))
    for k in sorted(variant.red_info):
        for kind, reads, _ in variant.red_info[k]:
            names = sorted(set(st.names[i] for i, _ in reads))
            lines.append('    after phase %d, serially: %s of %s' % (
                k, kind, ', '.join(names)))
    return '\n'.join(lines)
