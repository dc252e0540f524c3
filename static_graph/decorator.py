"""``@static_graph``: record a Chain method once per key, replay afterwards."""
import functools
import threading

import chainer

from static_graph import compat
from static_graph import diagnostics
from static_graph import places

if compat.UNSUPPORTED is None:
    # The recorder needs Chainer internals of version 7; older Chainers get
    # the pass-through decorator below and never import it.
    from static_graph import capture
    from static_graph import entry as entry_module
    from static_graph import glance
    from static_graph import link_state
    from static_graph import nstep_loop
    from static_graph import recorder
    from static_graph import replay
    from static_graph import signature
    from static_graph import splice
    from static_graph import stand_in

from static_graph.cache import caches_of  # NOQA  (public: tests, explain)
from static_graph.cache import DEFAULT_CACHE_SIZE, DEFAULT_WARN_RETRACE
from static_graph import cache as cache_module


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
    threads: how many threads a large kernel may be split across, where
        that measures faster: an element-wise one that writes in place
        (ReLU, its gradient, Add), a convolution's im2col and col2im (by
        batch); where NumPy's BLAS takes one thread a product, also two
        independent products at a time. Default None: the cores this
        process may use; 1: never split (split_kernels.py).
    """
    unknown = set(options) - {'cache_size', 'warn_retrace', 'recompute',
                              'plan_memory', 'cuda_graph', 'threads'}
    if unknown:
        raise TypeError('static_graph got unknown option(s): %s'
                        % ', '.join(sorted(unknown)))
    opts = {'cache_size': DEFAULT_CACHE_SIZE,
            'warn_retrace': DEFAULT_WARN_RETRACE, 'recompute': True,
            'plan_memory': True, 'cuda_graph': True, 'threads': None}
    opts.update(options)
    for flag in ('recompute', 'plan_memory', 'cuda_graph'):
        if not isinstance(opts[flag], bool):
            raise TypeError('%s must be True or False, got %r'
                            % (flag, opts[flag]))
    t = opts['threads']
    if t is not None and (isinstance(t, bool) or not isinstance(t, int) or
                          t < 1):
        raise ValueError('threads must be None or a positive int, got %r'
                         % (t,))
    for count in ('cache_size', 'warn_retrace'):
        v = opts[count]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError('%s must be a positive int, got %r'
                             % (count, v))
    if method is None:
        return lambda m: static_graph(m, **options)
    if isinstance(method, (staticmethod, classmethod)) or \
            not callable(method):
        raise TypeError('static_graph decorates a method of a Chain, got %r'
                        % (method,))

    if compat.UNSUPPORTED is not None:
        diagnostics.warn_once(
            ('unsupported',),
            'static_graph is a pass-through here: %s; methods run '
            'define-by-run' % compat.UNSUPPORTED)
        return method

    name = method.__name__
    arg_names = signature.arg_names_of(method)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if not isinstance(self, chainer.Link):
            raise TypeError(
                'static_graph decorates a method of a Chain: %s was called '
                'on %s, not a chainer.Link (a plain function, a static or '
                'class method, a method of another class)'
                % (method.__qualname__, type(self).__name__))
        if not getattr(chainer.config, 'use_static_graph', True):
            return method(self, *args, **kwargs)
        if _records_elsewhere(self):
            # Another thread records this chain (_record): define-by-run.
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
        cache = cache_module.cache_for(self, name, opts, method, wrapper)
        if cache.stand_ins:
            for c in cache.take_stand_ins():
                stand_in.record(c)
        if cache.define_by_run is not None:
            cache.fallback_calls += 1
            return _define_by_run(method, self, args, kwargs)
        glanced = sig = None     # (glance.py: calls on probation)
        if cache.probation is not None and not cache.calls_waiting():
            glanced, sig = glance.look(cache, args, kwargs)
            if glanced is True:
                cache.fallback_calls += 1
                return _define_by_run(method, self, args, kwargs)
        config = signature.config_key()
        if cache.shortcuts and (config, signature.outline(
                args, kwargs)) in cache.shortcuts and \
                not cache.calls_waiting():
            cache.fallback_calls += 1
            return _define_by_run(method, self, args, kwargs)
        if cache.too_many and not cache.calls_waiting() and \
                cache.skip_walk((config, signature.types_of(args, kwargs))):
            cache.fallback_calls += 1
            return _define_by_run(method, self, args, kwargs)
        try:
            _check_backends()
            try:
                spec, leaves, paths = signature.flatten(arg_names, args,
                                                        kwargs)
            except signature.TooManyValues:
                if not cache.calls_waiting():
                    raise
                # Calls wait for their backward as one node each: this one
                # records however large its key (define-by-run among them
                # would add a parameter's gradients in another order).
                spec, leaves, paths = signature.flatten(arg_names, args,
                                                        kwargs, None)
        except signature.TooManyValues as e:
            return _key_too_costly(method, self, name, cache, config, args,
                                   kwargs, 'too many values', str(e))
        except signature.Unsupported as e:
            diagnostics.warn_once(
                (type(self), name, str(e)),
                '%s.%s runs define-by-run: %s' % (type(self).__name__, name,
                                                  e))
            cache.fallback_calls += 1
            return _define_by_run(method, self, args, kwargs)
        base = spec
        if cache.state_slots or cache.kept:
            # Recurrent state the links hold: its presence and shape decide
            # which ops run (L.LSTM after reset_state() has no h).
            spec = spec + (cache.state_key(),)
        key = signature.Key((spec, config))
        e = cache.get(key)
        why = None
        stale = 0
        counted = False      # (a new key counted by cache.must_repeat)
        probation = None
        wait = cache.backoff.get(key) if cache.backoff else None
        if wait is not None and wait[0] > 0 and not cache.calls_waiting():
            wait[0] -= 1      # (a key whose recordings went stale)
            cache.fallback_calls += 1
            return _define_by_run(method, self, args, kwargs)
        if e is None:
            # (Not define-by-run next to calls that wait for their backward
            # as one node each: cache.calls_waiting. This call records.)
            reason = cache.family_fallback(key)
            if reason is not None and not cache.calls_waiting():
                cache.fallback_calls += 1
                cache.family_hit(key, reason, signature.outline(args, kwargs))
                return _define_by_run(method, self, args, kwargs)
            # A key whose calls get no backward: None, its next call
            # records from a stand-in gradient (after must_repeat, as any
            # new key's: more such keys than cache_size, cycling, were
            # recorded at every call); a reason, define-by-run.
            only = cache.forward_only.get(key, False) \
                if cache.forward_only else False
            if only:
                return _forward_only(method, self, name, cache, key, args,
                                     kwargs, leaves, paths)
            if sig is not None:
                glance.keyed(cache, sig, key, glanced)
            before = cache.new_keys
            probation = cache.must_repeat(key)
            counted = cache.new_keys != before
            if probation is not None and (not cache.calls_waiting() or
                                          splice.let_go_waiting(cache)):
                diagnostics.warn_once(
                    (type(self), name, 'must repeat', cache.probation[:24]),
                    '%s.%s: %s' % (type(self).__name__, name,
                                   cache.probation))
                if sig is None:
                    glance.counted(cache, args, kwargs, key)
                cache.fallback_calls += 1
                return _define_by_run(method, self, args, kwargs)
            if only is None:
                return _forward_only(method, self, name, cache, key, args,
                                     kwargs, leaves, paths)
        else:
            if e.state == entry_module.FALLBACK:
                cache.fallback_calls += 1
                cache.family_hit(key, e.reason,
                                 signature.outline(args, kwargs))
                return _define_by_run(method, self, args, kwargs)
            if e.state == entry_module.COMPLETE:
                if paths.values and _key_costs_more(e, paths.values) and \
                        not cache.calls_waiting():
                    return _key_too_costly(
                        method, self, name, cache, config, args, kwargs,
                        'key costs more',
                        'the key of its arguments walks %d values in lists, '
                        'tuples and dicts, which costs more than a replay '
                        'of its %d ops saves (pass them as an array, or '
                        'keep them on the chain)' % (paths.values, _ops(e)))
                if e.recheck is None and e.matches(self):
                    if cache.waiting:
                        cache.waiting.pop(key, None)
                    cache.tally[1] += 1     # (Cache.replays)
                    e.replays += 1
                    if e.recurrent:
                        leaves = leaves + [d[k] for d, k in e.recurrent]
                    return replay.replay(e, leaves)
                if e.recheck is not None:
                    why = ('its recording changed %s; recorded again to see '
                           'whether every call does' % ', '.join(e.recheck))
                else:
                    changed = (e.link_values.first_change()
                               if e.link_values is not None else None) or \
                        e.first_structure_change()
                    why = ('%s changed' % changed if changed else
                           'parameters or persistent arrays were replaced, '
                           'or the links changed')
                    stale = 0 if e.replays else e.stale + 1
                    if stale >= cache_module.STALE_AFTER and \
                            not cache.calls_waiting():
                        return _stale(method, self, name, cache, key, e,
                                      why, wait, args, kwargs)
            else:
                if cache.forward_only and key in cache.forward_only:
                    # (Evaluation that keeps the last call's output while
                    # it calls again: ``loss = model(x, t)`` in a loop.)
                    return _forward_only(method, self, name, cache, key,
                                         args, kwargs, leaves, paths)
                # Its recording waits for the backward (a loss summed over
                # calls, PTB's truncated BPTT). This call records too, not
                # define-by-run: one backward through recording nodes and
                # define-by-run nodes could add a parameter's gradients
                # in another order than define-by-run alone.
                why = ('the earlier recording of this key has not had its '
                       'backward yet')
                stale = e.stale
                _count_waiting(self, name, cache, key)
        if _dead_proxy(self, name, cache):
            return _define_by_run(method, self, args, kwargs)
        cap = capture.Capture(self, method, name, cache, key, why, e)
        cap.entry.stale = stale
        cap.on_probation = probation is not None
        cap.base = base, config
        return _record(cap, method, self, args, kwargs, leaves, paths,
                       counted)

    wrapper.__static_graph__ = True
    return wrapper


def _count_waiting(self, name, cache, key):
    n = cache.waiting[key] = cache.waiting.get(key, 0) + 1
    cache_module.bound(cache.waiting)
    if n == cache_module.WAITING_WARN:
        diagnostics.warn_once(
            (type(self), name, 'waiting'),
            '%s.%s: %d calls of one key have recorded while an earlier call '
            'of it waits for its backward. Each records (about two '
            "define-by-run calls' time), so that a loss summed over them "
            "adds gradients in define-by-run's order: expected before the "
            "first backward of such a loss, which builds the key's "
            'schedules. If their outputs never get a backward (evaluation '
            'with backprop enabled, outputs kept in a list), call it under '
            'chainer.no_backprop_mode(), which replays'
            % (type(self).__name__, name, n))


def _stale(method, self, name, cache, key, e, why, wait, args, kwargs):
    """A key whose recordings keep going stale before they replay: it runs
    define-by-run for the next STALE_WAIT calls (twice as many each time
    it goes stale again, up to STALE_WAIT_MAX), then records once more
    (what changed may have settled: a warm-up schedule)."""
    n = cache_module.STALE_WAIT if wait is None else \
        min(2 * wait[1], cache_module.STALE_WAIT_MAX)
    cache.backoff.pop(key, None)
    cache.backoff[key] = [n, n]
    cache_module.bound(cache.backoff)
    # After the wait, one recording; gone stale again, the next wait.
    e.stale = cache_module.STALE_AFTER - 2
    if e.link_values is not None:
        # (what big containers held: replaced arrays, let go)
        places.forget_contents(e.link_values.pairs)
    diagnostics.warn_once(
        (type(self), name, 'stale'),
        '%s.%s runs define-by-run for this call signature: it records '
        'again at every call (its last %d recordings no longer matched the '
        'chain at the next call and never replayed; the last time: %s), '
        'and a recording costs about two define-by-run iterations. It '
        'records again after %d calls, and after twice as many each time '
        'this repeats' % (type(self).__name__, name,
                          cache_module.STALE_AFTER, why, n))
    cache.fallback_calls += 1
    return _define_by_run(method, self, args, kwargs)


# id(link) -> the thread that records a call of a chain holding it: while
# it does, the links hold that recording's traced arrays (capture.py),
# which another thread's call (of that chain, or of a decorated child)
# must neither record nor match against.
_recording = {}


def _records_elsewhere(chain):
    owner = _recording.get(id(chain))
    return owner is not None and owner != threading.get_ident()


_ELSEWHERE = object()


def _record(cap, method, chain, args, kwargs, leaves, paths,
            counted=False):
    """``cap.forward``, or define-by-run where another thread records a
    chain holding one of ``chain``'s links now. ``counted``: the call was
    counted as a new key (cache.must_repeat), which one that raises or
    runs define-by-run is not (not a key that did not repeat)."""
    try:
        out = _try_record(cap, method, chain, args, kwargs, leaves, paths)
    except BaseException:
        if counted:       # (InvalidType, say)
            cap.cache.new_keys -= 1
        raise
    if out is _ELSEWHERE:
        if counted:
            cap.cache.new_keys -= 1
        cap.cache.fallback_calls += 1
        return _define_by_run(method, chain, args, kwargs)
    return out


def _try_record(cap, method, chain, args, kwargs, leaves, paths):
    """``cap.forward``, unless another thread records a chain holding one
    of ``chain``'s links now (one model called from several threads, a
    child link shared): then ``_ELSEWHERE``, and the call is to run
    define-by-run."""
    me = threading.get_ident()
    mine = []
    try:
        for link in chain.links():
            owner = _recording.setdefault(id(link), me)
            if owner != me:
                return _ELSEWHERE
            mine.append(id(link))
        return cap.forward(args, kwargs, leaves, paths)
    finally:
        for k in mine:
            _recording.pop(k, None)


def _dead_proxy(chain, name, cache):
    """A link attribute of ``chain`` that is a ``weakref.proxy`` whose
    object is gone, which a recording cannot look at: the call runs
    define-by-run (warned once); True then."""
    dead = link_state.dead_proxy_attribute(chain)
    if dead is None:
        return False
    diagnostics.warn_once(
        (type(chain), name, 'dead proxy', dead),
        '%s.%s runs define-by-run while its link attribute %s is a '
        'weakref.proxy whose object is gone: the recording cannot look at '
        'it' % (type(chain).__name__, name, dead))
    cache.fallback_calls += 1
    return True


def _forward_only(method, self, name, cache, key, args, kwargs, leaves,
                  paths):
    """A call of a key whose calls get no backward: it records its
    backward from a stand-in gradient, or, where that cannot be done, runs
    define-by-run (warned once)."""
    reason = cache.forward_only[key]
    if reason is None and _dead_proxy(self, name, cache):
        return _define_by_run(method, self, args, kwargs)
    if reason is None:
        return _record(capture.Capture(self, method, name, cache, key,
                                       stand_in=True),
                       method, self, args, kwargs, leaves, paths)
    diagnostics.warn_once(
        (type(self), name, 'forward only', reason),
        '%s.%s runs define-by-run for this call signature: %s'
        % (type(self).__name__, name, reason))
    cache.fallback_calls += 1
    return _define_by_run(method, self, args, kwargs)


def _ops(e):
    return len(e.forward.ops) + (len(e.backward.ops) if e.backward else 0)


def _key_costs_more(e, values):
    """Does a key of ``values`` scalars and nested arrays
    (``Paths.values``) cost more than a replay of entry ``e`` saves?
    (signature.VALUES_PER_OP)"""
    return values > signature.VALUES_PER_OP * _ops(e)


def _key_too_costly(method, self, name, cache, config, args, kwargs, what,
                    why):
    """A call whose key costs more than it is worth runs define-by-run,
    warned once (``what``: which cost; ``why``: the text); the next calls
    with arguments of these types skip the walk that found it (a
    vocabulary passed at each call, a log that grows), for a while: then
    one walks again."""
    diagnostics.warn_once(
        (type(self), name, what),
        '%s.%s runs define-by-run: %s' % (type(self).__name__, name, why))
    cache.note_too_many((config, signature.types_of(args, kwargs)))
    cache.fallback_calls += 1
    return _define_by_run(method, self, args, kwargs)


def _define_by_run(method, self, args, kwargs):
    """A call the library runs define-by-run: as written, except that an
    NStep LSTM it calls runs as one node (nstep_loop: the same bits)."""
    with nstep_loop.fused():
        return method(self, *args, **kwargs)


def _check_backends():
    use_ideep = getattr(chainer.config, 'use_ideep', 'never')
    if use_ideep != 'never':
        intel64 = getattr(chainer.backends, 'intel64', None)
        if intel64 is not None and intel64.is_ideep_available():
            raise signature.Unsupported(
                'chainer.config.use_ideep is %r and iDeep is available'
                % use_ideep)
