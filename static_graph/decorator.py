"""``@static_graph``: record a Chain method once per key, replay afterwards."""
import collections
import contextlib
import functools
import gc
import inspect
import threading
import weakref

import numpy

import chainer

from static_graph import compat
from static_graph import diagnostics

if compat.UNSUPPORTED is None:
    # The recorder needs Chainer internals of version 7; older Chainers get
    # the pass-through decorator below and never import it.
    from schedules import ir
    from static_graph import analysis
    from static_graph import entry as entry_module
    from static_graph import nodes
    from static_graph import generators
    from static_graph import link_values
    from static_graph import outputs
    from static_graph import recorder
    from static_graph import signature
    from static_graph import traced

_caches = weakref.WeakKeyDictionary()   # chain -> {method name: Cache}
_caches_lock = threading.Lock()

DEFAULT_CACHE_SIZE = 16
DEFAULT_WARN_RETRACE = 8


class Cache(object):
    """The entries of one method of one chain, least recently used first."""

    def __init__(self, owner_name, size, warn_retrace, recompute=True,
                 plan_memory=True, cuda_graph=True):
        self.owner_name = owner_name
        self.size = size
        self.warn_retrace = warn_retrace
        self.recompute = recompute
        self.plan_memory = plan_memory
        self.cuda_graph = cuda_graph
        self.entries = collections.OrderedDict()
        self.lock = threading.RLock()
        self.recordings = 0
        self.replays = 0
        self.fallback_calls = 0
        self.last_recorded_key = None
        # Set when a recording saw the method read recurrent state (a
        # Variable of an earlier call's graph kept on a link): every later
        # call runs define-by-run (_detach_link_variables).
        self.define_by_run = None

    def get(self, key):
        with self.lock:
            e = self.entries.get(key)
            if e is not None:
                self.entries.move_to_end(key)
            return e

    def put(self, key, e):
        with self.lock:
            self.entries[key] = e
            self.entries.move_to_end(key)
            while len(self.entries) > self.size:
                old_key, _ = self.entries.popitem(last=False)
                diagnostics.logger.info('%s: evicted a cached schedule',
                                        self.owner_name)

    def discard(self, key, e):
        with self.lock:
            if self.entries.get(key) is e:
                del self.entries[key]


def _cache_for(chain, name, options):
    with _caches_lock:
        per_chain = _caches.get(chain)
        if per_chain is None:
            per_chain = {}
            _caches[chain] = per_chain
        cache = per_chain.get(name)
        if cache is None:
            cache = Cache('%s.%s' % (type(chain).__name__, name),
                          options['cache_size'], options['warn_retrace'],
                          options['recompute'], options['plan_memory'],
                          options['cuda_graph'])
            per_chain[name] = cache
        return cache


def caches_of(chain):
    """{method name: Cache} of a chain (empty if it never recorded)."""
    with _caches_lock:
        return dict(_caches.get(chain, {}))


def _arg_names(method):
    names = []
    for p in list(inspect.signature(method).parameters.values())[1:]:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    return names


def static_graph(method=None, **options):
    """Make a Chain method record its first call and replay it afterwards.

    Usable bare (``@static_graph``) or with options
    (``@static_graph(cache_size=4)``). Options:

    cache_size: how many keys (argument shapes/dtypes/values, config flags)
        are kept per chain and method, least recently used out (default 16).
    warn_retrace: warn when a chain has recorded this many times, and again
        at 2, 4, 8... times as many (default 8).
    recompute: let the backward compute BatchNormalization and ReLU outputs
        again from arrays it holds anyway instead of keeping them from the
        forward (the same bits, less memory; default True).
    plan_memory: False turns memory reuse off for comparison: every buffer
        of a schedule lives until it returns, no kernel writes into an
        input that dies with it, nothing is recomputed (default True).
    cuda_graph: on CuPy, replay the forward and the backward each as one
        CUDA graph launch once they have run a few times, where the capture
        is faithful (default True; see ``explain``).
    """
    unknown = set(options) - {'cache_size', 'warn_retrace', 'recompute',
                              'plan_memory', 'cuda_graph'}
    if unknown:
        raise TypeError('static_graph got unknown option(s): %s'
                        % ', '.join(sorted(unknown)))
    opts = {'cache_size': DEFAULT_CACHE_SIZE,
            'warn_retrace': DEFAULT_WARN_RETRACE, 'recompute': True,
            'plan_memory': True, 'cuda_graph': True}
    opts.update(options)
    for flag in ('recompute', 'plan_memory', 'cuda_graph'):
        if not isinstance(opts[flag], bool):
            raise TypeError('%s must be True or False, got %r'
                            % (flag, opts[flag]))
    if not isinstance(opts['cache_size'], int) or opts['cache_size'] < 1:
        raise ValueError('cache_size must be a positive int, got %r'
                         % (opts['cache_size'],))
    if method is None:
        return lambda m: static_graph(m, **options)
    if not callable(method):
        raise TypeError('static_graph decorates a method, got %r' % (method,))

    if compat.UNSUPPORTED is not None:
        diagnostics.warn_once(
            ('unsupported',),
            'static_graph is a pass-through here: %s; methods run '
            'define-by-run' % compat.UNSUPPORTED)
        return method

    name = method.__name__
    arg_names = _arg_names(method)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if not getattr(chainer.config, 'use_static_graph', True):
            return method(self, *args, **kwargs)
        if recorder.current() is not None:
            diagnostics.logger.debug(
                '%s.%s called while another static chain records: inlined '
                'into that recording', type(self).__name__, name)
            return method(self, *args, **kwargs)
        if chainer.is_debug():
            diagnostics.warn_once(
                (type(self), name, 'debug'),
                "%s.%s runs define-by-run while Chainer's debug mode is on: "
                'its checks are per function (a NaN in each result and '
                'gradient, named after the function that made it), which '
                'replay would make once per call' % (type(self).__name__,
                                                     name))
            return method(self, *args, **kwargs)
        try:
            _check_backends()
            spec, leaves, paths = signature.flatten(arg_names, args, kwargs)
        except signature.Unsupported as e:
            diagnostics.warn_once(
                (type(self), name, str(e)),
                '%s.%s runs define-by-run: %s' % (type(self).__name__, name,
                                                  e))
            return method(self, *args, **kwargs)
        key = (spec, signature.config_key())
        cache = _cache_for(self, name, opts)
        if cache.define_by_run is not None:
            cache.fallback_calls += 1
            return method(self, *args, **kwargs)
        e = cache.get(key)
        why = None
        if e is not None:
            if e.state == 'fallback':
                cache.fallback_calls += 1
                return method(self, *args, **kwargs)
            if e.state == 'complete':
                if e.recheck is None and e.matches(self):
                    cache.replays += 1
                    return _replay(e, leaves)
                if e.recheck is not None:
                    why = ('its recording changed %s; recorded again to see '
                           'whether every call does' % ', '.join(e.recheck))
                else:
                    changed = e.link_values.first_change() \
                        if e.link_values is not None else None
                    why = ('%s changed' % changed if changed else
                           'parameters or persistent arrays were replaced, '
                           'or the links changed')
            else:
                why = ('the earlier recording of this key got no backward; '
                       'call forward-only evaluation under '
                       'chainer.no_backprop_mode() to replay it')
        return _record(self, method, name, cache, key, args, kwargs, leaves,
                       paths, why, e)

    wrapper.__static_graph__ = True
    return wrapper


def _check_backends():
    use_ideep = getattr(chainer.config, 'use_ideep', 'never')
    if use_ideep != 'never':
        intel64 = getattr(chainer.backends, 'intel64', None)
        if intel64 is not None and intel64.is_ideep_available():
            raise signature.Unsupported(
                'chainer.config.use_ideep is %r and iDeep is available'
                % use_ideep)


# -- replay ---------------------------------------------------------------------
def _replay(e, leaves):
    node = nodes.ReplayNode(e)
    outs = nodes.detach_outputs(node.apply(list(leaves) + e.params),
                                       e.no_grad_outs)
    exposed = node.exposed
    node.exposed = None
    vals = []
    for v, kind in zip(outs, e.out_kinds):
        vals.append(v if kind == 'V' else v.raw_array)
    _side_effects(e, exposed, outs)
    return outputs.rebuild(e.out_spec, vals[:e.n_outs])


def _side_effects(e, exposed, outs):
    """Repeat the recorded reports and attribute writes."""
    if not e.reports and not e.attr_writes:
        return
    values = dict(zip(e.expose, exposed or ()))
    by_out = {}
    for b, v in zip(e.forward.outputs, outs):
        by_out.setdefault(b, v)

    def var(b):
        if b in by_out:
            return by_out[b]
        return chainer.Variable(values[b], requires_grad=False)

    for observer_ref, items in e.reports:
        observer = observer_ref() if observer_ref is not None else None
        if observer_ref is not None and observer is None:
            continue
        report = {}
        for k, how, v in items:
            report[k] = var(v) if how == 'buffer' else v
        chainer.reporter.report(report, observer)
    for d, k, b, kind in e.attr_writes:
        if kind == 'V':
            d[k] = var(b)
        else:
            d[k] = by_out[b].raw_array if b in by_out else values[b]


# -- recording ------------------------------------------------------------------


class _Unreplayable(Exception):
    """Found while building: the recording cannot be replayed faithfully."""


def _snapshot_links(chain):
    """[(link __dict__, a copy of it, the link's path)]."""
    return [(link.__dict__, dict(link.__dict__), path)
            for path, link in chain.namedlinks()]


def _read_by(rec, old):
    """Did an op of the recording read ``old`` (an array or a Variable's
    array), whole or through a view?"""
    a = old.raw_array if isinstance(old, chainer.Variable) else old
    if not recorder.is_array(a):
        return False
    return id(a) in rec.by_id or any(
        recorder.root_of(buf.storage) is a for buf in rec.buffers.values()
        if recorder.is_array(buf.storage))


def _attr_changes(rec, snapshot, detached=()):
    """The link attributes the method assigned, as (dict, name, buffer id,
    'V' or 'A'); one it read before assigning it is state carried from
    call to call (``self.h = h.array``), which the recording's reason
    list gets (``detached``: ids of recurrent Variables, handled by
    _reattach)."""
    changed = [(d, k, v, before.get(k, recorder.MISSING))
               for d, before, _ in snapshot for k, v in list(d.items())
               if before.get(k, recorder.MISSING) is not v]
    # Before the writes below add buffers (``self.a, self.b = self.b,
    # self.a`` reads neither).
    for d, k, v, old in changed:
        if old is not recorder.MISSING and id(old) not in detached and \
                _read_by(rec, old):
            rec.add_reason(
                'it reads attribute %r and then assigns it a new value: '
                'state carried from one call to the next, which replay '
                'would freeze at the recorded value' % k)
    writes = []
    for d, k, v, old in changed:
        if isinstance(v, chainer.Variable):
            if v.raw_array is None:
                continue
            writes.append((d, k, rec.buffer_of(v.raw_array,
                                               'attribute ' + k), 'V'))
        elif recorder.is_array(v):
            a = rec._untrace(v, 'attribute ' + k)
            writes.append((d, k, rec.buffer_of(a, 'attribute ' + k), 'A'))
        elif link_values.same_value(v, old):
            continue     # (a Variable or array before: not ==)
        else:
            rec.add_reason('the method sets attribute %r (%s), which '
                           'replay would not repeat'
                           % (k, type(v).__name__))
    return writes


def _detach_link_variables(chain, rec):
    """Variables that the chain's links hold and that belong to a graph
    (recurrent state: L.LSTM's ``h`` and ``c``, left by the previous call)
    are swapped for detached leaves of the recording, so that its backward
    does not run into an earlier call's graph. Returns [(dict, name, the
    link's Variable, the leaf, path)]; ``_reattach`` puts them back."""
    out = []
    for path, link in chain.namedlinks():
        d = link.__dict__
        for k, v in list(d.items()):
            if type(v) is chainer.Variable and v.creator_node is not None \
                    and v.raw_array is not None:
                leaf = chainer.Variable(recorder.copy_exact(v.raw_array),
                                        requires_grad=v.requires_grad)
                rec.arrays.append(leaf.raw_array)   # ids stay unique
                d[k] = leaf
                out.append((d, k, v, leaf, '%s/%s' % (path.rstrip('/'), k)))
    return out


def _reattach(rec, detached):
    """After the method ran: the link Variables it did not replace are put
    back; those it read (an op took the leaf's array) are returned as
    [(link Variable, leaf, path)]: the recording call takes them as inputs,
    so gradients reach the earlier call once, as in define-by-run."""
    _put_back(detached)
    read = []
    for d, k, v, leaf, path in detached:
        bid = rec.by_id.get(id(leaf.raw_array))
        if bid is not None:
            buf = rec.buffers[bid]
            buf.role, buf.name = ir.INPUT, path
            rec.unknown = [u for u in rec.unknown if u[0] != bid]
            read.append((v, leaf, path))
    return read


def _write_back_inputs(rec, leaves, inner, leaf_bids):
    """The recording ran on copies of the array arguments: a method that
    wrote into one (its fallback reason is recorded) leaves the caller's
    array changed, and one that gave an argument Variable another array
    (``x.array = ...``) does so to the caller's, as define-by-run would."""
    for leaf, mine, bid in zip(leaves, inner, leaf_bids):
        if isinstance(leaf, chainer.Variable):
            if mine.raw_array is not rec.buffers[bid].storage:
                rec.add_reason('the method assigns a new array to its '
                               'argument Variable (x.array = ...), which '
                               'replay would not repeat')
                leaf.array = traced.untraced(mine.raw_array)
                continue
            leaf, mine = leaf.raw_array, mine.raw_array
        if type(leaf) is not numpy.ndarray or mine is None:
            continue
        mine = traced.untraced(mine)
        if leaf.shape == mine.shape and leaf.dtype == mine.dtype and \
                leaf.flags.writeable and recorder._changed(leaf, mine):
            numpy.copyto(leaf, mine)


def _trace_held_arrays(chain, rec):
    """Hand the method the links' NumPy array attributes (not persistents)
    as traced views, as its inputs are: writing into one or reading its
    values is caught, and one feeding a Chainer function is a constant of
    the chain (analysis.chain_arrays). Returns [(dict, name, array, view)]
    for _untrace_held."""
    held = []
    for link in chain.links():
        d = link.__dict__
        for k, v in analysis.held_arrays(link):
            rec.chain_held.add(id(v))
            d[k] = rec.trace(v)
            held.append((d, k, v, d[k]))
    return held


def _untrace_held(chain, held):
    """Put the arrays back, also where the method stored a view it was
    handed under another name."""
    if not held:
        return
    views = dict((id(view), a) for _, _, a, view in held)
    for link in chain.links():
        d = link.__dict__
        for k, v in list(d.items()):
            if id(v) in views and isinstance(v, numpy.ndarray):
                d[k] = views[id(v)]


def _put_back(detached):
    for d, k, v, leaf, _ in detached:
        if d.get(k) is leaf:
            d[k] = v


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector. Recording allocates thousands of
    small objects (nodes, variables, buffers, ops); each 700 allocations
    would start a collection, and the older generations' passes scan every
    object of the process again. Measured on 200 tiny ops: building the
    schedules took 10 ms with the collector running, 4.7 ms without.
    Reference counting still frees what it can; the collector resumes when
    the recording step returns (unless it was off before).

    What the step leaves alive (its schedules, kernels, recorded nodes) is
    then handed to the oldest generation without being scanned
    (``gc.freeze()`` then ``gc.unfreeze()``): else the first young
    collection after the step scans every object it made, 0.8 ms on the
    tiny graph, and the next generation's pass does so again. Nothing is
    kept from the collector: a full collection still scans them. Not done
    where the program has frozen objects itself (``gc.freeze()`` before a
    fork), which ``unfreeze`` would let go."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _with_gc_paused(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _gc_paused():
            return fn(*args, **kwargs)
    return wrapper


@_with_gc_paused
def _record(chain, method, name, cache, key, args, kwargs, leaves, paths,
            why=None, prev=None):
    """Record a call (``prev``: the key's earlier entry, if any)."""
    rec = recorder.Recording(chain)
    inner, leaf_bids = [], []
    for leaf, path in zip(leaves, paths):
        if isinstance(leaf, chainer.Variable):
            a = recorder.copy_exact(leaf.raw_array)
            leaf_bids.append(rec.new_buffer(a, ir.INPUT, name=path))
            inner.append(chainer.Variable(a, requires_grad=leaf.requires_grad))
        else:
            a = recorder.copy_exact(leaf)
            leaf_bids.append(rec.new_buffer(a, ir.INPUT, name=path))
            inner.append(rec.trace(a) if type(a) is numpy.ndarray else a)
    new_args, new_kwargs = signature.rebuild(args, kwargs, inner)
    detached = _detach_link_variables(chain, rec)
    snapshot = _snapshot_links(chain)
    classes = set(type(link) for link in chain.links())
    watch = link_values.Watch(
        snapshot, link_values.reachable_functions(method, classes), classes)
    held = _trace_held_arrays(chain, rec)
    rngs = generators.snapshot(chain, watch.named_globals)
    with rec:
        try:
            out = method(chain, *new_args, **new_kwargs)
        except BaseException:
            _put_back(detached)   # the links keep the caller's Variables
            _untrace_held(chain, held)
            raise
        _untrace_held(chain, held)
        for what in generators.drawn(rngs):
            rec.add_reason(
                'user code draws random numbers from the generator %s (its '
                'state changed during the call; a parameter initialized '
                'from it on first use counts too); replay would freeze them '
                '(use Chainer functions such as F.dropout or F.gaussian, or '
                'pass them in as arguments)' % what)
        rec.check_writes()
        recheck = watch.changed_by_call() or None
        if recheck and prev is not None and prev.recheck:
            # A memo fills once; this changes at every call.
            for what in recheck:
                rec.add_reason('the method changes %s at every call (a list '
                               'appended to, a dict entry, a global or a '
                               "helper object's attribute set); replay "
                               'would not repeat that' % what)
        _write_back_inputs(rec, leaves, inner, leaf_bids)
        try:
            out_spec, out_leaves = outputs.flatten(out)
        except outputs.Unrebuildable as err:
            rec.add_reason('it returns a %s that replay cannot rebuild: %s'
                           % (type(out).__name__, err))
            # This call hands out what the method returned, as it is.
            out_spec, out_leaves = ('K', out), []
        out_bids, out_kinds, inner_outs = [], [], []
        for o in out_leaves:
            if isinstance(o, chainer.Variable):
                out_kinds.append('V')
                inner_outs.append(o)
                a = o.raw_array
            else:
                out_kinds.append('A')
                a = rec._untrace(o, 'the return value')
                inner_outs.append(chainer.Variable(a, requires_grad=False))
            out_bids.append(rec.buffer_of(a, 'the return value'))
        attr_writes = _attr_changes(rec, snapshot,
                                    set(id(d[3]) for d in detached))
        recurrent = _reattach(rec, detached)
        n_outs = len(out_bids)
        if chainer.config.enable_backprop:
            # A kept Variable in the graph (``self.hidden = h``) is a hidden
            # output, so a loss computed from it outside backpropagates.
            for d, k, b, kind in attr_writes:
                v = d[k]
                if kind == 'V' and v.requires_grad and \
                        v.creator is not None and b not in out_bids:
                    out_bids.append(b)
                    out_kinds.append('V')
                    inner_outs.append(v)
    rec.phase = 'done'
    cache.recordings += 1
    _maybe_warn_retrace(cache, key, why)
    if recurrent:
        # This call takes the state as inputs (its gradient flows into the
        # earlier call once); later calls run define-by-run.
        leaves = list(leaves) + [v for v, _, _ in recurrent]
        inner = inner + [leaf for _, leaf, _ in recurrent]
        reason = ('it reads recurrent state, Variables of an earlier '
                  "call's graph kept on its links (%s, as L.LSTM keeps h "
                  'and c); replay does not take such state as an input, so '
                  'this method runs define-by-run from now on'
                  % ', '.join(p for _, _, p in recurrent))
        rec.add_reason(reason)
        cache.define_by_run = reason
    written = set((id(d), k) for d, k, _, _ in attr_writes)
    chain_map = analysis.chain_arrays(chain, written)
    params, persists = analysis.classify_unknown(rec, chain_map)
    shared = analysis.shared_parameter_arrays(chain, rec, params)
    if shared:
        rec.add_reason('parameters %s and %s hold the same array; replay '
                       'would give its gradients to one of them only '
                       '(share the Parameter or link instead)'
                       % tuple(sorted(shared[0][:2])))
        # This call's backward still gives each its gradient.
        params += [(bid, path, p) for _, path, bid, p in shared]

    e = entry_module.Entry(key, name)
    e.recheck = recheck
    e.n_outs = n_outs   # the method's outputs; hidden ones follow
    e.no_grad_outs = tuple(i for i, v in enumerate(inner_outs)
                           if not v.requires_grad)
    need_backward = chainer.config.enable_backprop and any(
        v.requires_grad and v.creator is not None for v in inner_outs)
    param_objs = [p for _, _, p in params]

    def fall_back(reason):
        e.state = 'fallback'
        e.reason = reason
        cache.put(key, e)
        diagnostics.warn_once(
            (type(chain), name, reason),
            '%s.%s falls back to define-by-run for this call signature: %s'
            % (type(chain).__name__, name, reason))

    reports = [(weakref.ref(obs) if obs is not None else None, items)
               for obs, items in rec.reports]

    def build(**backward):
        analysis.mark_captured(rec, chain_map)
        if rec.reasons:
            raise _Unreplayable(rec.reasons[0])
        e.build(rec, chain, len(leaves), leaf_bids, out_bids, out_kinds,
                out_spec, params, persists, attr_writes=attr_writes,
                reports=reports, link_values=watch,
                recompute=cache.recompute, plan_memory=cache.plan_memory,
                cuda_graph=cache.cuda_graph, **backward)
        e.verify()

    if not need_backward:
        if rec.reasons:
            fall_back(rec.reasons[0])
            return out
        try:
            build()
        except _Unreplayable as err:
            fall_back(str(err))
            return out
        except Exception as err:   # never replay what did not verify
            fall_back('could not build a schedule (%s: %s)'
                      % (type(err).__name__, err))
            return out
        cache.put(key, e)
        vals = _outputs_after_recording(e, inner_outs, out_kinds)
        _keep_attrs(attr_writes, dict(zip(map(id, inner_outs), vals)),
                    rec.buffers)
        return outputs.rebuild(out_spec, vals[:n_outs])

    if rec.reasons:
        fall_back(rec.reasons[0])
    else:
        cache.put(key, e)   # pending until its backward is recorded

    targets = [i for i, leaf in enumerate(leaves)
               if isinstance(leaf, chainer.Variable) and leaf.requires_grad]
    targets += [len(leaves) + j for j in range(len(param_objs))]
    target_vars = [inner[i] if i < len(leaves) else
                   param_objs[i - len(leaves)] for i in targets]

    def outputs_and_gradients(grad_outputs, keep):
        """The distinct outputs that get a gradient, their gradients, and
        [(index, gradient)] for an output returned again. ``keep``: the
        gradients as copies in GRAD_OUT buffers, whose ids come fourth
        (None for an output without one); else as Chainer handed them
        (double backpropagation follows their graph)."""
        outs, gys, more, bids = [], [], [], []
        position = {}   # id(output Variable) -> its index in outs
        grad_outputs = nodes.empty_gradients(inner_outs, grad_outputs)
        for o, g in zip(inner_outs, grad_outputs):
            if g is None or not o.requires_grad:
                bids.append(None)
                continue
            if keep:
                ga = recorder.copy_exact(nodes.raw(g))
                bids.append(rec.new_buffer(ga, ir.GRAD_OUT, name='grad'))
                g = chainer.Variable(ga)
            else:
                g = chainer.as_variable(g)
            if id(o) in position:
                more.append((position[id(o)], g))
                continue
            position[id(o)] = len(outs)
            gys.append(g)
            outs.append(o)
        return outs, gys, more, bids

    def backprop(outs, gys, more, earlier=None, **options):
        # ``return h, h``: chainer.grad keeps one gradient per output
        # Variable, so the gradients of the copies are added first (an op
        # of the recorded backward).
        for i, g in more:
            gys[i] = gys[i] + g
        # chainer.grad runs only the nodes on a path to target_vars;
        # Variable.backward (define-by-run) runs every node whose input needs
        # a gradient. A node on no such path matters by its side effects
        # (ChainerMN's recv sends the gradient back in its backward, from a
        # Variable it made inside the method): the method's own leaf
        # Variables are targets too, their gradients dropped.
        extra = _inner_leaves(rec, target_vars)
        if earlier is not None:
            # Gradients the targets hold already, added where define-by-run
            # adds them (before the contributions, in their order).
            options['grad_inputs'] = list(earlier) + [None] * len(extra)
        grads = chainer.grad(outs, target_vars + extra, grad_outputs=gys,
                             **options)
        n = len(target_vars)
        if rec.phase == 'backward':
            # What those backward() steps returned for them: buffers, so
            # that the steps resolve (their gradients go nowhere).
            for g in grads[n:]:
                if g is not None and g.raw_array is not None:
                    rec.buffer_of(g.raw_array, 'a gradient')
        return grads[:n]

    @_with_gc_paused
    def finish(grad_outputs, earlier=None):
        """The recording call's backward; called again for a second
        backward through it where no entry was built, with ``earlier``:
        {input position: the gradient it holds}, which the results
        include."""
        if chainer.config.enable_backprop:
            return _double_backprop(grad_outputs)
        recording = e.state == 'recording'
        outs_for_grad, gys, more, grad_out_bids = outputs_and_gradients(
            grad_outputs, keep=True)
        if recording:
            rec.phase = 'backward'
            rec.labels = {id(op.node): op.source for op in rec.forward_ops}
            with rec:
                grads = backprop(outs_for_grad, gys, more)
        else:
            grads = backprop(outs_for_grad, gys, more, earlier=None if
                             earlier is None else
                             [earlier.get(pos) for pos in targets])
        arrays = [g.raw_array if g is not None else None for g in grads]
        result = [None] * (len(leaves) + len(param_objs))
        for pos, a in zip(targets, arrays):
            result[pos] = a
        if recording:
            rec.phase = 'done'
            grad_in = [rec.buffer_of(a, 'a gradient') if a is not None
                       else None for a in arrays]
            more_params, more_persists = analysis.classify_unknown(
                rec, chain_map)
            if more_params:
                rec.add_reason('a parameter is used only in backward')
            if set(analysis.chain_arrays(chain, written)) != \
                    set(chain_map):
                # A parameter or persistent array was replaced (W.array =
                # ...) between the call and this backward, which read the
                # new one: not a recording of one consistent call. The next
                # call records again.
                cache.discard(key, e)
                e.state = 'discarded'
                diagnostics.logger.info(
                    '%s.%s: a parameter array was replaced between the '
                    'recorded call and its backward; not kept, the next '
                    'call records again', type(chain).__name__, name)
            elif rec.reasons:
                fall_back(rec.reasons[0])
            else:
                try:
                    build(grad_in=grad_in, grad_targets=targets,
                          grad_out_bids=grad_out_bids)
                    cache.put(key, e)
                except _Unreplayable as err:
                    fall_back(str(err))
                except Exception as err:
                    fall_back('could not build a schedule (%s: %s)'
                              % (type(err).__name__, err))
            if e.state == 'complete':
                bufs = rec.buffers
                result = [None] * len(result)
                for pos, a, b in zip(targets, arrays, grad_in):
                    if a is not None and (bufs[b].static or bufs[b].role in
                                          entry_module._ESCAPE_ROLES):
                        a = recorder.copy_exact(a)
                    result[pos] = a
        return [chainer.Variable(a) if a is not None else None
                for a in result]

    def _double_backprop(grad_outputs):
        """A backward asked for double backpropagation (an input-gradient
        penalty): the gradients keep their graph, through the recorded
        call's own nodes, to the parameters; not the inputs, which the
        recording took as copies. Replay cannot give either, so the key
        runs define-by-run from now on."""
        reason = ('its backward was asked for double backpropagation '
                  '(enable_double_backprop=True), which replay cannot give')
        if e.state in ('recording', 'complete'):
            fall_back(reason)
        if any(t < len(leaves) for t in targets):
            raise NotImplementedError(
                'double backpropagation through the recording call of a '
                'static graph to its input Variables is not supported: %s '
                'falls back to define-by-run from its next call; run this '
                'call with chainer.config.use_static_graph = False'
                % name)
        outs, gys, more, _ = outputs_and_gradients(grad_outputs, keep=False)
        grads = backprop(outs, gys, more, enable_double_backprop=True)
        result = [None] * (len(leaves) + len(param_objs))
        for pos, g in zip(targets, grads):
            result[pos] = g
        return result

    node = nodes.RecordNode(
        finish, [v.raw_array for v in inner_outs], e)
    outs = nodes.detach_outputs(node.apply(list(leaves) + param_objs),
                                       e.no_grad_outs)
    vals = [v if k == 'V' else v.raw_array for v, k in zip(outs, out_kinds)]
    _keep_attrs(attr_writes, {id(v): o for v, o in zip(inner_outs, outs)},
                rec.buffers)
    return outputs.rebuild(out_spec, vals[:n_outs])


def _keep_attrs(attr_writes, by_inner, bufs):
    """What the recording call leaves in the attributes it set: the call's
    output when one was kept; the chain's own array (a parameter's,
    ``self.prev = self.b.array``) or a constant itself, as define-by-run
    leaves it; else a detached copy (replay may rewrite the recorded array
    in place), of the kept type."""
    for d, k, b, kind in attr_writes:
        cur = d.get(k)
        if id(cur) in by_inner:
            d[k] = by_inner[id(cur)]
        elif kind == 'A' and bufs[b].role in entry_module._STABLE_ROLES:
            d[k] = bufs[b].storage
        else:
            d[k] = recorder._detached_copy(cur)


def _inner_leaves(rec, targets):
    """Variables made inside the recorded call that need a gradient and
    no function made (``chainer.Variable(xp.zeros(...))``, the dummy input
    of ChainerMN's recv), other than ``targets``."""
    seen = set(id(v.node) for v in targets)
    out = []
    for rop in rec.forward_ops:
        for vn in rop.node.inputs or ():
            if vn.creator_node is None and vn.requires_grad and \
                    id(vn) not in seen:
                seen.add(id(vn))
                out.append(vn.get_variable())   # (made again if dropped)
    return out


def _outputs_after_recording(e, inner_outs, out_kinds):
    vals = []
    for v, k, copy in zip(inner_outs, out_kinds, e.out_copy):
        if copy:
            v = chainer.Variable(recorder.copy_exact(v.raw_array),
                                 requires_grad=v.requires_grad)
        vals.append(v if k == 'V' else v.raw_array)
    return vals


def _maybe_warn_retrace(cache, key, why=None):
    last = cache.last_recorded_key
    cache.last_recorded_key = key
    if cache.recordings < cache.warn_retrace or last is None:
        return
    # Warn at warn_retrace x 1, 2, 4, 8... recordings: a chain that keeps
    # recording is reported, but a long run does not fill the log.
    n = cache.recordings // cache.warn_retrace
    if n & (n - 1):
        return
    change = why or describe_key_change(last, key)
    diagnostics.warn_once(
        ('retrace', cache.owner_name, n),
        '%s has recorded %d times; each new argument shape, dtype, value or '
        'config flag records again. Why the last one recorded: %s'
        % (cache.owner_name, cache.recordings, change))


def describe_key_change(old, new):
    """A short text naming what differs between two cache keys."""
    from static_graph.inspect import spec_text
    (old_spec, old_flags), (new_spec, new_flags) = old, new
    diffs = []
    old_f, new_f = dict(old_flags), dict(new_flags)
    for name in sorted(set(old_f) | set(new_f)):
        a, b = old_f.get(name), new_f.get(name)
        if a != b:
            diffs.append('config.%s %r -> %r' % (name, a, b))
    if old_spec != new_spec:
        diffs.append('arguments %s -> %s' % (spec_text(old_spec),
                                             spec_text(new_spec)))
    return '; '.join(diffs) or 'the same key recorded again'
