"""A glance at a call's arguments, for calls on probation.

Once a method's new keys run define-by-run until their ``sightings``-th
call (cache.must_repeat: keys that do not repeat, or copies that do not
repay their recordings, instances.py), most of its calls run
define-by-run, and building their key cost more than the wrapper's whole
saving for a small model: the key of two arrays and the configuration
(``signature.flatten``, ``signature.config_key``), the cache lookup, the
count and the warning took about 45 us of a 450 us call (slow32 hunt:
0.80x-0.88x define-by-run). A glance counts calls by a cheaper signature
instead (each argument's shape, dtype and strides, or its value for a
number or string; the training and backprop flags): a call whose glance
was seen fewer than ``sightings`` times runs define-by-run without a key.
At its ``sightings``-th, the call builds its key, which the count
credits (``cache.sightings_of``), and goes on as before: it records, or
replays where its key has an entry. Where the glance merges keys that
differ (another configuration flag, a layout), a key may record sooner
than its own count says: a question of cost, not of numbers.
"""
import numpy

import chainer

KEYS_REMEMBERED = 4096
_SCALARS = (int, float, bool, str, type(None))


def signature(args, kwargs):
    """The glance of a call, or None where one argument is of another
    kind (containers, CuPy arrays, objects: their key is built)."""
    if kwargs:
        return None
    out = []
    for a in args:
        t = type(a)
        if t is chainer.Variable:
            arr = a.raw_array
            if type(arr) is not numpy.ndarray:
                return None
            out.append((arr.shape, arr.dtype.num, arr.strides,
                        a.requires_grad))
        elif t is numpy.ndarray:
            out.append((a.shape, a.dtype.num, a.strides))
        elif t in _SCALARS:
            out.append((t, a))
        else:
            return None
    config = chainer.config
    return config.train, config.enable_backprop, tuple(out)


def look(cache, args, kwargs):
    """(verdict, glance) of this call, counted (``cache.glances``: per
    glance, the calls seen, or the key the last full look built). verdict:
    True where the call is to run define-by-run without its key (seen
    fewer than ``cache.sightings`` times); else the key is built: the
    count (0 where the glance's last key has an entry: it replays), or
    None where there is no glance."""
    sig = signature(args, kwargs)
    if sig is None:
        return None, None
    with cache.lock:
        glances = cache.glances
        last = glances.pop(sig, 0)
        if type(last) is not int:
            e = cache.entries.get(last)
            if e is not None and e.state in ('complete', 'recording'):
                glances[sig] = last
                return 0, sig
            last = 0    # (let go, or fallen out of the cache: counted again)
        n = last + 1
        glances[sig] = n
        while len(glances) > KEYS_REMEMBERED:
            glances.popitem(last=False)
    return (True if n < cache.sightings else n), sig


def keyed(cache, sig, key, n):
    """The call of glance ``sig``, seen ``n`` times, built its key: the
    key counts as seen ``n - 1`` times before (cache.must_repeat adds this
    call), and is the glance's from now on."""
    with cache.lock:
        if n > 1 and cache.sightings_of.get(key, 0) < n - 1:
            cache.sightings_of[key] = n - 1
        if sig in cache.glances:
            cache.glances[sig] = key


def counted(cache, args, kwargs, key):
    """A call on probation that built its key without a look (the one
    that began the probation, one next to calls that wait for their
    backward) and runs define-by-run: its glance takes the key's count."""
    sig = signature(args, kwargs)
    if sig is None:
        return
    with cache.lock:
        last = cache.glances.get(sig, 0)
        n = cache.sightings_of.get(key, 0)
        if type(last) is int and last < n:
            cache.glances[sig] = n
