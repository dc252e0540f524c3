"""The cache of one decorated method of one chain: its entries by key,
least recently used first, the counters ``explain()`` shows, and the
warning a chain that keeps recording gets."""
import collections
import threading
import weakref

from static_graph import diagnostics
from static_graph import compat
from static_graph import instances

if compat.UNSUPPORTED is None:
    import chainer
    from static_graph.signature import device_tag as _device_tag
    from static_graph.signature import layout as _layout
    _Variable = chainer.Variable

# A chain's caches live on the chain, in its __dict__ under HOLDER, so that
# they die with it. (In a WeakKeyDictionary keyed by the chain they kept it
# alive: an entry holds the chain's links.) Copies of a chain (copy,
# deepcopy, pickle) start without any.
HOLDER = '_static_graph_caches'
_caches_lock = threading.Lock()


class _Holder(dict):
    """{name: Cache} of the chain ``owner()``: a decorated method's name, or
    another decorated function's qualified name (cache_for)."""

    __slots__ = ('owner', 'copied')

    def __init__(self, owner=None, copied=False):
        dict.__init__(self)
        self.owner = owner
        self.copied = copied   # one of a copy (deepcopy, pickle): instances

    def __copy__(self):
        return _Holder()

    def __deepcopy__(self, memo):
        return _Holder()

    def __reduce__(self):
        return _Holder, ()


def _holder(chain, make):
    d = chain.__dict__
    h = d.get(HOLDER)
    if h is None or h.owner is None or h.owner() is not chain:
        if not make:
            return None
        h = d[HOLDER] = _Holder(weakref.ref(chain), h is not None)
    return h

DEFAULT_CACHE_SIZE = 16
DEFAULT_WARN_RETRACE = 8

# Recording costs about two define-by-run iterations and a replay saves a
# fraction of one: a method whose keys do not repeat is slower recorded.
# (A small window: each recording it lets through that never replays costs
# about one iteration; a key that repeats but comes after the window waits
# only two define-by-run calls.)
# Every RECORDING_WINDOW recordings of new keys, a method that replayed
# fewer than REPLAYS_PER_RECORDING times per such recording in that window
# records a new key only at its SIGHTINGS-th call (Cache.must_repeat).
RECORDING_WINDOW = 4
# Why a key whose recordings see a parameter array replaced between the
# call and its backward, twice, runs define-by-run (capture.py).
REPLACED_MIDWAY = (
    'a parameter or persistent array is replaced (W.array = ...) between '
    'its calls and their backward, so no recording sees one consistent '
    'call')
# Why a key whose calls get no backward, with a parameter or persistent
# array replaced before the stand-in backward of two recordings in a row,
# runs define-by-run (capture.py; each such recording is let go).
REPLACED_BETWEEN = (
    'a parameter or persistent array is replaced (bn.avg_var = ..., '
    'W.array = ...) between its calls, which get no backward: the backward '
    'of each recording, recorded at the next call from a stand-in '
    'gradient, would read the new one')
REPLAYS_PER_RECORDING = 3
SIGHTINGS = 3
# Calls whose arguments held too many values for a key skip the walk that
# found it this many times, then one walks again (signature.TooManyValues).
TOO_MANY_SKIPS = 256
# Slots where calls keep arrays and Variables, whose None-ness keys hold.
KEPT_SLOTS = 32
# Under probation, every RECORDING_WINDOW recordings of new keys followed
# by too few replays double the sightings a new key needs (keys that come
# back only after the cache let them go: more cycling shapes than
# cache_size), up to SIGHTINGS_MAX; enough replays halve them again. (A
# low bound: a phase of repeating shapes after one of cycling shapes
# waits SIGHTINGS_MAX calls of a key at most; with 1024 a review saw no
# replay in 3,000 calls.)
SIGHTINGS_MAX = 24
# Per-key tables of a cache (keys without a backward, their decisions,
# stale keys' waits) hold at most this many keys, the oldest let go.
KEYS_REMEMBERED = 4096

# A key whose recording no longer matches the chain at its next call
# (parameter arrays replaced where a node holds the old one, a link
# attribute changed), this many times in a row without a replay in between,
# runs define-by-run (decorator.py): each recording cost about two
# define-by-run iterations and saved nothing. For STALE_WAIT calls, then
# it records once more; gone stale again, it waits twice as long (up to
# STALE_WAIT_MAX calls).
STALE_AFTER = 3
STALE_WAIT = 8
STALE_WAIT_MAX = 1024
# A key whose recordings are let go without a backward this many times in a
# row runs define-by-run (Cache.recording_died).
FORWARD_ONLY_AFTER = 2
SHORTCUT_AFTER = 8


class Cache(object):
    """The entries of one method of one chain, least recently used first."""

    def __init__(self, owner_name, size, warn_retrace, recompute=True,
                 plan_memory=True, cuda_graph=True, threads=None):
        self.owner_name = owner_name
        self.method = None      # the decorated function it serves
        self.wrapper = None     # the decorator's wrapper of it
        self.threads = threads
        self.size = size
        self.warn_retrace = warn_retrace
        self.recompute = recompute
        self.plan_memory = plan_memory
        self.cuda_graph = cuda_graph
        self.entries = collections.OrderedDict()
        self.lock = threading.RLock()
        self.tally = [0, 0, 1]    # recordings, replays: instances.py
        # Of them, recordings of a key whose earlier recording still waited
        # for its backward (not counted by the retrace warning).
        self.repeats = 0
        self.new_keys = 0       # recordings of keys not in the cache
        self.fallback_calls = 0
        self.last_recorded_key = None
        # Set when every later call runs define-by-run, with the reason.
        self.define_by_run = None
        # Set once new keys must repeat before they record (must_repeat),
        # with the reason; calls of each such key not recorded yet.
        self.probation = None
        self.sightings = SIGHTINGS    # a new key's calls before it records
        self.sightings_of = collections.OrderedDict()
        self.glances = collections.OrderedDict()    # glance.py
        # The window of recordings: replays when it began, and the count
        # of recordings that closes it.
        self._window_replays = 0
        self._window_end = RECORDING_WINDOW
        # Fallbacks by key family (the key without its arrays' sizes):
        # {family: (key, reason)} of the first, and {family: reason} once
        # two keys of a family fell back for the same reason, which then
        # holds for the whole family (a new size does not record again).
        self._family_first = {}
        self.family_fallbacks = {}
        # Once SHORTCUT_AFTER calls in a row of one configuration and
        # argument outline (signature.outline) ran define-by-run through
        # fallbacks (their family's or their key's) for one reason, and
        # nothing of that configuration replays: {(config, outline):
        # reason}, whose calls run define-by-run without computing their
        # keys (the key of 64 arrays costs 1-2% of a text classifier's
        # step).
        self.shortcuts = {}
        # {(config, argument types): calls left} of calls whose containers
        # held more values than a key holds (signature.TooManyValues): such
        # calls run define-by-run without walking them, TOO_MANY_SKIPS
        # times; the next walks again (the containers may have shrunk).
        self.too_many = {}
        self._family_hits = None     # ((config, outline), reason, count)
        # Keys whose recordings got no backward ({key: how many in a row});
        # at FORWARD_ONLY_AFTER, {key: None}: the next call (evaluation
        # outside no_backprop_mode) records its backward from a stand-in
        # gradient, and the key replays; {key: reason} where that cannot
        # be done: their calls run define-by-run.
        self._no_backward = {}
        self._let_go = {}     # keys whose recording was let go unbuilt
        self.forward_only = {}
        # {key: calls that recorded while an earlier one waited for its
        # backward} (decorator: warned once at WAITING_WARN)
        self.waiting = {}
        # Keys whose recordings went stale STALE_AFTER times in a row:
        # {key: [define-by-run calls left, the wait]} (decorator._stale).
        self.backoff = {}
        self.stand_ins = []     # captures let go, for take_stand_ins
        # Recurrent state: [(link __dict__, name)] where a call read a
        # Variable an earlier call left on the links; their values are part
        # of every later key. ``written``: where calls left Variables,
        # which a recording takes as state if it reads them (after
        # unchain_backward() they have no graph).
        self.state_slots = []
        self.written = []
        # (dict, name) where calls keep arrays and Variables: key part
        self.kept = []
        self.kept_epoch = 0
        # Keys a recording of which saw a parameter array replaced between
        # its call and its backward (replaced_midway).
        self._replaced_midway = collections.OrderedDict()
        self._replaced_between = collections.OrderedDict()

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

    recordings = instances.counter(0)
    replays = instances.counter(1)

    def calls_waiting(self):
        """Do calls of this method wait for their backward as one node each
        (recorded or replayed)? A call run define-by-run next to them would
        add its parameters' gradient contributions at its own nodes' ranks,
        in another order than theirs (a loss summed over three calls)."""
        with self.lock:
            # (entry.RECORDING: entry.py imports what old Chainers lack)
            return any(e.state == 'recording' or e.pending
                       for e in self.entries.values())

    def note_too_many(self, at):
        self.too_many.pop(at, None)
        self.too_many[at] = TOO_MANY_SKIPS
        bound(self.too_many)

    def skip_walk(self, at):
        """Does a call of (config, argument types) ``at`` run define-by-run
        without walking its arguments (note_too_many)?"""
        left = self.too_many.get(at)
        if left is None:
            return False
        if left <= 1:
            del self.too_many[at]
        else:
            self.too_many[at] = left - 1
        return True

    def must_repeat(self, key):
        """Called at each call of a key not in the cache: None where it may
        record, else why it runs define-by-run. Once the method's new keys
        do not repeat (fewer than REPLAYS_PER_RECORDING replays per
        recording of a new key over RECORDING_WINDOW such recordings), a
        new key records only at its SIGHTINGS-th call: keys that repeat
        (bucketed lengths, the last batch) still replay, keys that never
        do (every batch of another length) run define-by-run.

        A key whose last recording was let go without a backward (a
        generator sampled under ``train=False`` at every step, backprop
        on: recorded twice, then from a stand-in gradient) is not a new
        key again: counted, its own recordings put a GAN's sampling on
        probation in its third step (gans31 hunt); unless other new keys
        came in between (more such keys than the cache holds, cycling), or
        once on probation (it waits for its sightings as any key)."""
        at = self._let_go.pop(key, None)
        if at is not None and self.probation is None and \
                self.new_keys - at < RECORDING_WINDOW:
            return None
        if self.probation is None:
            if self.new_keys < self._window_end:
                self.new_keys += 1
                return None
            replays = self.replays - self._window_replays
            self._window_replays = self.replays
            self._window_end = self.new_keys + RECORDING_WINDOW
            if replays >= REPLAYS_PER_RECORDING * RECORDING_WINDOW:
                self.new_keys += 1
                return None
            self.probation = (
                'its keys do not repeat: the last %d new keys it recorded '
                'were followed by %d replays (a recording costs about two '
                'define-by-run iterations). From now on a new key runs '
                'define-by-run until it has been called %d times (more, '
                'doubling, while the keys it records still do not '
                'replay), and then records'
                % (RECORDING_WINDOW, replays, SIGHTINGS))
        with self.lock:
            n = self.sightings_of.pop(key, 0) + 1
            if n >= self.sightings:
                self.new_keys += 1
                if self.new_keys >= self._window_end:
                    replays = self.replays - self._window_replays
                    self._window_replays = self.replays
                    self._window_end = self.new_keys + RECORDING_WINDOW
                    if replays < REPLAYS_PER_RECORDING * RECORDING_WINDOW:
                        self.sightings = min(2 * self.sightings,
                                             SIGHTINGS_MAX)
                    else:
                        self.sightings = max(self.sightings // 2, SIGHTINGS)
                return None
            self.sightings_of[key] = n
            while len(self.sightings_of) > KEYS_REMEMBERED:
                self.sightings_of.popitem(last=False)
        return self.probation

    def fell_back(self, key, reason):
        """Note a key's fallback; the second key of a family to fall back
        for the same reason makes it the family's."""
        fam = family(key)
        first = self._family_first.get(fam)
        if first is None:
            self._family_first[fam] = (key, reason)
        elif first[0] != key and first[1] == reason:
            self.family_fallbacks[fam] = reason

    def note_slots(self, state, written, kept=()):
        """A recording read ``state`` and wrote ``written`` (Variables),
        and kept arrays or Variables at ``kept`` (of those, at most
        KEPT_SLOTS or this recording's: a loop that replaces a helper
        object leaves its old one's behind)."""
        with self.lock:
            for slots, new in ((self.state_slots, state),
                               (self.written, written), (self.kept, kept)):
                known = set((id(d), k) for d, k in slots)
                for d, k in new:
                    if (id(d), k) not in known:
                        known.add((id(d), k))
                        slots.append((d, k))
            # Past KEPT_SLOTS, the oldest this recording did not write go
            # (not those it wrote: a model that keeps an array on each of
            # 40 layers keeps every slot, and replays).
            mine = set((id(d), k) for d, k in kept)
            extra = len(self.kept) - max(KEPT_SLOTS, len(mine))
            if extra > 0:
                gone = set([(id(d), k) for d, k in self.kept
                            if (id(d), k) not in mine][:extra])
                self.kept[:] = [(d, k) for d, k in self.kept
                                if (id(d), k) not in gone]
                # (Keys from now on mean other slots: no earlier key's.)
                self.kept_epoch += 1

    def state_key(self):
        """What the state slots hold now, for the key: a Variable's shape,
        dtype, device, requires_grad, name and layout (as an argument's);
        None; another type. Then whether each slot where calls keep an
        array or a Variable holds None (``if self.m is None``; the loop
        resets it, as ``reset_state()`` does)."""
        out = [('K', tuple([d.get(k) is None for d, k in self.kept]),
                self.kept_epoch)] if self.kept else []
        for d, k in self.state_slots:
            v = d.get(k)
            if v is None:
                out.append(None)
            elif type(v) is _Variable and v.raw_array is not None:
                a = v.raw_array
                out.append(('V', a.shape, a.dtype.str, _device_tag(a),
                            v.requires_grad, v.name, _layout(a)))
            else:
                out.append(('O', type(v).__name__))
        return tuple(out)

    def recording_died(self, key, e, seen, stand_in=None):
        """A recording call's node was let go: without a backward
        (``seen[0]`` false), the key's pending entry is dropped, and the
        second time in a row the key's next call records to have its
        backward recorded from a stand-in gradient (``stand_in``: that
        call's capture, whose backward the next call records:
        take_stand_ins)."""
        if seen[0]:
            self._no_backward.pop(key, None)
            return
        with self.lock:
            if e.state != 'recording':
                return
            if stand_in is not None:
                self.stand_ins.append(stand_in)
                return
            e.move('discarded')
            self.discard(key, e)
            # (Its next recording is this key's again, not a new key's:
            # must_repeat.)
            self._let_go[key] = self.new_keys
            bound(self._let_go)
            n = self._no_backward.pop(key, 0) + 1
            self._no_backward[key] = n
            bound(self._no_backward)
            if n >= FORWARD_ONLY_AFTER and key not in self.forward_only:
                # The next call records; let go, its backward is recorded
                # from a stand-in gradient (stand_in.py), or, where that
                # cannot be done, the key's calls run define-by-run.
                self.forward_only[key] = None
                bound(self.forward_only)

    def take_stand_ins(self):
        """The stand-in recordings let go since the last call, whose
        backward it records (stand_in.record)."""
        with self.lock:
            todo, self.stand_ins = self.stand_ins, []
        return todo

    def covering(self, key, e, mask, chain):
        """The key's entry in the cache where it is a complete one (not
        ``e``) that replays for ``chain``, built from a call whose outputs
        got every gradient ``mask`` says and maybe more (a backward with
        fewer gradients runs from it: masked.py); else None."""
        kept = self.get(key)
        if kept is None or kept is e or kept.state != 'complete' or \
                kept.backward is None or \
                len(kept.grad_out_mask) != len(mask) or \
                not all(k or not n for k, n in zip(kept.grad_out_mask, mask)):
            return None
        return kept if kept.matches(chain) else None

    def no_stand_in(self, key, why):
        """The calls of ``key`` get no backward, and their backward cannot
        be recorded from a stand-in gradient (``why``): they run
        define-by-run."""
        self.forward_only[key] = (
            'its calls with backprop enabled get no backward (%d '
            'recordings in a row were let go without one), and its backward '
            'cannot be recorded without one: %s; they run define-by-run, as '
            'recording each would cost more. Evaluate under '
            'chainer.no_backprop_mode() to replay them'
            % (FORWARD_ONLY_AFTER, why))

    def family_hit(self, key, reason, outline):
        """A call of ``key`` ran define-by-run for a fallback ``reason``,
        its family's or its own; enough of them in a row make a shortcut
        (while nothing of their configuration replays)."""
        config = key[1]
        at = (config, outline)
        with self.lock:     # (other threads' calls reorder the entries)
            hits = self._family_hits
            n = hits[2] + 1 if hits is not None and hits[0] == at and \
                hits[1] == reason else 1
            self._family_hits = (at, reason, n)
            if n >= SHORTCUT_AFTER and not any(
                    e.state == 'complete' and k[1] == config
                    for k, e in self.entries.items()):
                self.shortcuts[at] = reason

    def family_fallback(self, key):
        """The reason a key's family falls back, or None."""
        if not self.family_fallbacks:
            return None
        return self.family_fallbacks.get(family(key))

    def discard(self, key, e):
        with self.lock:
            if self.entries.get(key) is e:
                del self.entries[key]

    def replaced_between(self, key, again=True):
        """A stand-in recording of ``key`` saw an array replaced before its
        backward (``again``; else one was built): how many in a row."""
        with self.lock:
            n = self._replaced_between.pop(key, 0) + 1
            if not again:
                return 0
            _remember(self._replaced_between, key, n)
            return n

    def replaced_midway(self, key):
        """A recording of ``key`` saw a parameter array replaced between
        the call and its backward: has an earlier one of the key seen it
        too?"""
        with self.lock:
            seen = key in self._replaced_midway
            _remember(self._replaced_midway, key, True)
            return seen


def _remember(d, key, value):
    """``d[key] = value`` in OrderedDict ``d`` of at most 1,024 keys (the
    oldest go)."""
    d[key] = value
    while len(d) > 1024:
        d.popitem(last=False)


def family(key):
    """A key without the sizes of its arrays (a shape becomes ``?`` per
    axis, a layout its kind): the keys of calls that differ only in batch
    size or sequence length share it."""
    spec, config = key
    return (_erase(spec), config)


def _erase(spec):
    if type(spec) is tuple and spec:
        head = spec[0]
        if (head == 'V' or head == 'A') and len(spec) >= 5 and \
                type(spec[1]) is tuple:
            # ('V', shape, dtype, device, requires_grad, name, layout) or
            # ('A', shape, dtype, device, layout)
            erased = _erased_leaves.get(spec)
            if erased is None:
                lay = spec[-1]
                erased = (head, ('?',) * len(spec[1])) + spec[2:-1] + (
                    lay if lay in ('C', 'F') else 'strided',)
                if len(_erased_leaves) < 4096:
                    _erased_leaves[spec] = erased
            return erased
        return tuple([_erase(s) for s in spec])
    return spec


_erased_leaves = {}   # leaf spec -> its family's (the same few recur)


# Calls of one key recorded while an earlier one waits for its backward,
# after which a warning says what they cost (outputs kept, never
# backpropagated: each call records, about 4x define-by-run's time).
WAITING_WARN = 256


def bound(table):
    """Let the oldest keys of a per-key ``table`` (a dict: insertion
    order) go past KEYS_REMEMBERED."""
    while len(table) > KEYS_REMEMBERED:
        del table[next(iter(table))]


def cache_for(chain, name, options, method, wrapper):
    """The Cache of the decorated function ``method`` (``wrapper``, the
    decorator's) on ``chain``: under ``name`` for the one the chain's class
    holds there; another of that name (``Base.forward`` called from a
    subclass that decorates its own, two methods made by one decorator of
    the user's, both ``wrapper``) under its qualified name."""
    with _caches_lock:
        per_chain = _holder(chain, True)
        cache = per_chain.get(name)
        if cache is not None and cache.method is method and \
                cache.wrapper is wrapper:
            return cache
        for cache in per_chain.values():
            # (One function decorated twice, with other options: a cache
            # per decoration.)
            if cache.method is method and cache.wrapper is wrapper:
                return cache
        key = name
        if name in per_chain and \
                getattr(type(chain), name, None) is not wrapper:
            key = base = method.__qualname__
            n = 2
            while key in per_chain:
                key = '%s#%d' % (base, n)
                n += 1
        # (Else a method of that name defined again on the class, in a
        # notebook: the old one's cache goes.)
        cache = Cache('%s.%s' % (type(chain).__name__, key),
                      options['cache_size'], options['warn_retrace'],
                      options['recompute'], options['plan_memory'],
                      options['cuda_graph'], options.get('threads'))
        cache.method, cache.wrapper = method, wrapper
        if per_chain.copied:
            instances.starting(cache, chain, method, SIGHTINGS,
                               SIGHTINGS_MAX, REPLAYS_PER_RECORDING)
        per_chain[key] = cache
        return cache


def caches_of(chain):
    """{name: Cache} of a chain (empty if it never recorded; see _Holder)."""
    with _caches_lock:
        return dict(_holder(chain, False) or {})


def maybe_warn_retrace(cache, key, why=None):
    last = cache.last_recorded_key
    cache.last_recorded_key = key
    count = cache.recordings - cache.repeats
    if count < cache.warn_retrace or last is None:
        return
    # Warn at warn_retrace x 1, 2, 4, 8... recordings: a chain that keeps
    # recording is reported, but a long run does not fill the log.
    n = count // cache.warn_retrace
    if n & (n - 1):
        return
    change = why or describe_key_change(last, key)
    diagnostics.warn_once(
        ('retrace', cache.owner_name, n),
        '%s has recorded %d times; each new argument shape, dtype, value or '
        'config flag records again. Why the last one recorded: %s'
        % (cache.owner_name, count, change))


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
