"""Look inside a static chain: its cached schedules and why calls fell back.

    for s in static_graph.cached(model):
        s.key, s.state    # key as text; 'complete', 'recording' or 'fallback'
        str(s.forward)    # the schedule as text, one op a line
    static_graph.explain(model)   # a text report of every key and reason
"""
import collections

import numpy

from schedules import ir
from static_graph import cache as cache_module
from static_graph import decorator
from static_graph import graphs


class CachedSchedule(collections.namedtuple(
        'CachedSchedule', ['method', 'key', 'state', 'reason', 'forward',
                           'backward', 'entry'])):
    """One cache entry: its key as text, state ('complete', 'recording' or
    'fallback'), fallback reason, and schedules."""

    def memory_plan(self):
        """Liveness-based memory plan of forward+backward (``Plan``:
        ``arena_bytes``, ``total_bytes``, ``offsets``, ``summary()``)."""
        if self.state != 'complete':
            return None
        return self.entry.memory_plan()


def _layout_text(layout):
    if layout == 'C':
        return ''
    if layout == 'F':
        return ' order=F'
    if layout == 'strided':
        return ' strided'
    return ' strides=(%s)' % ','.join(map(str, layout))


def _byte_order_text(dtype):
    """`` big-endian`` for a byte order other than the machine's (another
    key), else nothing."""
    dtype = numpy.dtype(dtype)
    if dtype.isnative:
        return ''
    return ' big-endian' if dtype.byteorder == '>' else ' little-endian'


def _spec_text(spec):
    tag = spec[0]
    if isinstance(tag, type) and issubclass(tag, numpy.ndarray):
        # an ndarray subclass (signature._walk)
        return '%s %s' % (tag.__name__, _spec_text(spec[1]))
    if tag == 'V':
        _, shape, dtype, dev, rg, name, layout = spec
        return 'Variable %s[%s]%s%s%s%s%s' % (
            ir.dtype_short(numpy.dtype(dtype)), ','.join(map(str, shape)),
            _byte_order_text(dtype), _layout_text(layout),
            '' if dev == -1 else ' @gpu%s' % dev,
            '' if rg else ' requires_grad=False',
            '' if name is None else ' name=%r' % (name,))
    if tag == 'A':
        _, shape, dtype, dev, layout = spec
        return '%s[%s]%s%s%s' % (ir.dtype_short(numpy.dtype(dtype)),
                                 ','.join(map(str, shape)),
                                 _byte_order_text(dtype),
                                 _layout_text(layout),
                                 '' if dev == -1 else ' @gpu%s' % dev)
    if tag in (tuple, list):
        inner = ', '.join(_spec_text(s) for s in spec[1])
        return '(%s)' % inner if tag is tuple else '[%s]' % inner
    if tag is dict:
        return '{%s}' % ', '.join('%r: %s' % (k, _spec_text(v))
                                  for k, v in spec[1])
    if tag == 'K':      # where calls keep arrays: None or not (cache.kept)
        return 'kept %s' % ' '.join('None' if none else 'set'
                                    for none in spec[1])
    return repr(spec[1])


def spec_text(spec):
    """The argument part of a key as text: ``(f32[8,784], t=i32[8])``."""
    pos, kw = spec[:2]
    parts = [_spec_text(s) for s in pos]
    parts += ['%s=%s' % (k, _spec_text(s)) for k, s in kw]
    # (signature imports Chainer's backend module, which the Chainers the
    # library falls back under lack: not at import.)
    from static_graph.signature import SAME
    for extra in spec[2:]:
        if extra[:1] == (SAME,):   # model(x, x)
            parts.extend('array %d is array %d' % pair
                         for pair in extra[1])
        else:      # the recurrent state the links hold
            parts.append('state=(%s)' % ', '.join(
                'None' if s is None else _spec_text(s) for s in extra))
    return '(%s)' % ', '.join(parts)


def key_text(key, extra=()):
    """A cache key as text: ``(f32[8,784], t=i32[8]) | train=True ...``;
    ``extra``: more config flags to show."""
    spec, flags = key
    return '%s | %s' % (spec_text(spec), flags_text(flags, extra))


def _flag_value(v):   # (a key holds a value as (type, value): scalar_key)
    return v[1] if type(v) is tuple and len(v) >= 2 and \
        isinstance(v[0], type) else v


def flags_text(flags, extra=()):
    """The config flags a reader cares about: ``train=True ...``, and
    those named in ``extra``."""
    flags = dict(flags)
    names = ('train', 'enable_backprop') + tuple(
        n for n in extra if n not in ('train', 'enable_backprop'))
    return ' '.join('%s=%s' % (n, getattr(_flag_value(flags.get(n)),
                                          '__name__',
                                          _flag_value(flags.get(n))))
                    for n in names)


def _varying_flags(keys):
    """Names of the config flags whose values differ among ``keys``
    (``dtype`` of keys recorded under float16 and float32): shown, or
    such keys would print alike."""
    seen = {}
    for _, flags in keys:
        for n, v in flags:
            seen.setdefault(n, set()).add(repr(v))
    n_keys = len(keys)
    return tuple(sorted(n for n, vs in seen.items()
                        if len(vs) > 1 or n_keys > 1 and
                        sum(1 for _, f in keys if n in dict(f)) < n_keys))


def outline_text(outline):
    """``signature.outline`` as text: ``(list[64], list[64], t=ndarray)``."""
    parts = []
    for a, b in outline:
        if isinstance(a, type):
            parts.append(a.__name__ + ('' if b is None else '[%d]' % b))
        else:
            parts.append('%s=%s' % (a, b.__name__))
    return '(%s)' % ', '.join(parts)


def cached(chain, method=None):
    """The chain's cache entries, least recently used first."""
    out = []
    fn = getattr(getattr(type(chain), method, None), '__wrapped__', None) \
        if method is not None else None
    for name, cache in sorted(decorator.caches_of(chain).items()):
        if method is not None and name != method and (
                fn is None or cache.method is not fn):
            continue
        with cache.lock:
            entries = list(cache.entries.items())
        for key, e in entries:
            out.append(CachedSchedule(name, key_text(key), e.state, e.reason,
                                      e.forward, e.backward, e))
    return out


def explain(chain):
    """A report of every cached key, its state, and fallback reasons (of
    an optimizer: ``explain_update``)."""
    import chainer
    if isinstance(chain, chainer.Optimizer) or \
            'actual_optimizer' in getattr(chain, '__dict__', {}):
        from static_graph import update
        return update.explain_update(chain)
    lines = []
    caches = decorator.caches_of(chain)
    if caches:
        _explain_caches(caches, lines)
        return '\n'.join(lines)
    # (``L.Classifier(predictor)`` with the predictor's forward decorated:
    # the caches are its links'.)
    inner = [(path, link) for path, link in chain.namedlinks(skipself=True)
             if decorator.caches_of(link)] \
        if isinstance(chain, chainer.Link) else []
    if not inner:
        return '%s has no static-graph cache (never called, or the flag ' \
               'use_static_graph was off)' % type(chain).__name__
    lines.append('%s has no static-graph cache of its own; its links\' '
                 'caches:' % type(chain).__name__)
    for path, link in inner:
        lines.append('%s (%s):' % (path, type(link).__name__))
        sub = []
        _explain_caches(decorator.caches_of(link), sub)
        lines.extend('  ' + ln for ln in sub)
    return '\n'.join(lines)


def _explain_caches(caches, lines):
    for name, cache in sorted(caches.items()):
        with cache.lock:    # (other threads' calls change the entries)
            _explain_cache(cache, lines)


def _explain_cache(cache, lines):
    lines.append('%s: %d recordings, %d replays, %d define-by-run calls '
                 'after a fallback, %d cached keys (at most %d)' % (
                     cache.owner_name, cache.recordings, cache.replays,
                     cache.fallback_calls, len(cache.entries),
                     cache.size))
    if cache.define_by_run is not None:
        lines.append('  every call runs define-by-run: %s'
                     % cache.define_by_run)
    if cache.probation is not None:
        lines.append('  new keys run define-by-run until they repeat: %s'
                     % cache.probation)
    for fam, reason in cache.family_fallbacks.items():
        lines.append('  every size of %s runs define-by-run (two sizes '
                     'fell back for the same reason): %s'
                     % (key_text(fam), reason))
    for (config, outline), reason in cache.shortcuts.items():
        lines.append('  every call %s | %s runs define-by-run without '
                     'computing its key (calls of such arguments fell '
                     'back for one reason %d times in a row): %s' % (
                         outline_text(outline), flags_text(config),
                         cache_module.SHORTCUT_AFTER, reason))
    if cache.too_many:
        # (Not at import: signature needs Chainer 7, and the library
        # imports on older Chainers as a pass-through.)
        from static_graph import signature
    for config, types in list(cache.too_many):
        lines.append('  every call with arguments of types %s | %s runs '
                     'define-by-run: its lists, tuples and dicts held '
                     'more than %d values' % (
                         ', '.join(getattr(t, '__name__', str(t))
                                   for t in types),
                         flags_text(config),
                         signature.MAX_KEY_VALUES))
    extra = _varying_flags(list(cache.entries) +
                           list(cache.forward_only) + list(cache.backoff))
    for key, reason in cache.forward_only.items():
        lines.append(
            '  %s runs define-by-run: %s' % (key_text(key, extra), reason)
            if reason is not None else
            '  %s: its calls get no backward; its backward was recorded '
            'from a stand-in gradient' % key_text(key, extra))
    for key, (left, wait) in cache.backoff.items():
        if left > 0:
            lines.append(
                '  %s runs define-by-run for %d more calls (of %d), then '
                'records again: its recordings went stale before they '
                'replayed (the value they read changes at every call)'
                % (key_text(key, extra), left, wait))
    for key, e in cache.entries.items():
        line = '  %s: %s' % (key_text(key, extra), e.state)
        if e.state == 'complete':
            line += ' (forward %d ops%s)' % (
                len(e.forward.ops),
                ', backward %d ops' % len(e.backward.ops)
                if e.backward is not None else ', no backward')
            reruns = [op for op in (e.backward.ops if e.backward
                                    is not None else ())
                      if op.fn is not None and
                      op.fn.__name__ == 'rerun_backward']
            if reruns:
                line += '\n    define-by-run in backward (its ' \
                    'backward() runs again: a mask built in Python, a ' \
                    'message): ' + ', '.join(
                        '%s at %s' % (op.kind[:-len('.backward')],
                                      op.source or '?')
                        for op in reruns)
            graph = graphs.describe(e)
            if graph:
                line += '\n    ' + graph
        elif e.state == 'recording':
            line += ' (waiting for its first backward)'
        if e.reason:
            line += '\n    reason: %s' % e.reason
        lines.append(line)
