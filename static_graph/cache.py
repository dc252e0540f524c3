"""The cache of one decorated method of one chain: its entries by key,
least recently used first, the counters ``explain()`` shows, and the
warning a chain that keeps recording gets."""
import collections
import threading
import weakref

from static_graph import diagnostics

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


def cache_for(chain, name, options):
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


def maybe_warn_retrace(cache, key, why=None):
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
