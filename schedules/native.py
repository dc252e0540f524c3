"""Compiled C for element-wise work, where it gives NumPy's bits.

A loop written in C computes each element by the same IEEE operations as
a sequence of NumPy ufuncs (``+ - * /`` and the square root are correctly
rounded in both) when it is built without contraction into fused
multiply-adds (``-ffp-contract=off``) and without fast-math (no
reassociation, subnormals kept), each scalar cast to the op's dtype as
NumPy casts it. User: ``update_native`` (the captured update's
programs).

``load(source)`` builds a shared object once per source (and machine)
with ``$CC`` or ``cc`` and keeps it in ``native/`` under
``$STATIC_GRAPH_CACHE`` (default ``$XDG_CACHE_HOME/static_graph`` or
``~/.cache/static_graph``; where that cannot be written, a private
temporary directory of the process; a cached object another user owns
or could have written is built again); it returns the loaded library, or a
string saying why there is none (no compiler, a failed build), which is
also logged once at INFO on the ``static_graph`` logger.
``STATIC_GRAPH_NATIVE=0`` turns compiled loops off everywhere
(``enabled()``). ``report(flags, dtype)`` passes the floating-point
exceptions a loop raised on to NumPy's error handling. Framework-free.
"""
import atexit
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading

import numpy

FLAGS = ('-O3', '-std=c99', '-ffp-contract=off', '-fno-fast-math',
         '-fno-math-errno', '-fPIC', '-shared')

# What a loop returns: the exceptions it raised (fenv.h's own bits differ
# between platforms; FLAGS_C maps them to these).
DIVIDE, OVER, UNDER, INVALID = 1, 2, 4, 8
FLAGS_C = """(fetestexcept(FE_DIVBYZERO) ? %d : 0) |
        (fetestexcept(FE_OVERFLOW) ? %d : 0) |
        (fetestexcept(FE_UNDERFLOW) ? %d : 0) |
        (fetestexcept(FE_INVALID) ? %d : 0)""" % (DIVIDE, OVER, UNDER, INVALID)
CTYPE = {numpy.dtype(numpy.float32): 'float',
         numpy.dtype(numpy.float64): 'double'}


def enabled():
    """Not turned off by ``STATIC_GRAPH_NATIVE=0``."""
    return os.environ.get('STATIC_GRAPH_NATIVE', '1').strip() not in (
        '0', 'no', 'off', 'false', '')


def report(flags, dtype):
    """Raise each flag through NumPy, under this thread's error state: the
    warning, error or call NumPy's own op would have given."""
    one = numpy.ones(1, dtype)
    big = numpy.full(1, numpy.finfo(dtype).max, dtype)
    tiny = numpy.full(1, numpy.finfo(dtype).tiny, dtype)
    if flags & DIVIDE:
        numpy.true_divide(one, numpy.zeros(1, dtype))
    if flags & OVER:
        numpy.multiply(big, big)
    if flags & UNDER:
        numpy.multiply(tiny, tiny)
    if flags & INVALID:
        numpy.sqrt(-one)


_lock = threading.Lock()
_loaded = {}          # source digest -> ctypes library, or why not
_status = {'built': 0, 'loaded': 0, 'failed': None}


def status():
    """What the compiler did in this process: shared objects built and
    loaded from the cache, and the last failure (None if none)."""
    return dict(_status)


def compiler():
    """The C compiler's command (a list: ``$CC`` may name a wrapper,
    ``ccache gcc``; its options are dropped, as one such as -ffast-math
    would change the bits), or None."""
    words = [w for w in shlex.split(os.environ.get('CC') or 'cc')
             if not w.startswith('-')]
    for cmd in ([words] if words else []) + [['gcc'], ['clang']]:
        path = shutil.which(cmd[0])
        if path is not None:
            return [path] + cmd[1:]
    return None


def cache_dir():
    d = os.environ.get('STATIC_GRAPH_CACHE')
    if not d:
        base = os.environ.get('XDG_CACHE_HOME') or os.path.join(
            os.path.expanduser('~'), '.cache')
        d = os.path.join(base, 'static_graph')
    return os.path.join(d, 'native')


def load(source):
    """The library built from ``source``, from the cache where it was
    built before; a string (why) where that fails."""
    digest = hashlib.sha256(' '.join(
        (source,) + FLAGS + (sys.platform, platform.machine(),
                             str(ctypes.sizeof(ctypes.c_void_p)))
    ).encode()).hexdigest()[:32]
    with _lock:
        lib = _loaded.get(digest)
        if lib is None:
            try:
                lib = _build(source, digest)
            except OSError as e:       # a full disk, a vanished directory
                lib = _failed('building failed: %s' % e)
            _loaded[digest] = lib
        return lib


def _build(source, digest):
    cc = compiler()
    if cc is None:
        return _failed('no C compiler (cc, gcc, clang; or $CC)')
    name = 'loop_%s.so' % digest
    d = cache_dir()
    try:
        os.makedirs(d, exist_ok=True)
        work = tempfile.mkdtemp(dir=d)
    except OSError:
        # A cache that cannot be written: this process's own private
        # directory (never a shared name another user could plant).
        d = _private_dir()
        work = tempfile.mkdtemp(dir=d)
    path = os.path.join(d, name)
    try:
        if _ours(path):
            _status['loaded'] += 1
        else:
            src = os.path.join(work, 'loop.c')
            with open(src, 'w') as f:
                f.write(source)
            out = os.path.join(work, 'loop.so')
            try:
                r = subprocess.run(cc + list(FLAGS) + ['-o', out, src,
                                                        '-lm'],
                                   stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as e:
                return _failed('%s failed: %s' % (' '.join(cc), e))
            if r.returncode != 0:
                msg = r.stdout.decode(errors='replace').strip()
                return _failed('%s failed: %s' % (' '.join(cc), (
                    msg.splitlines()[0] if msg else r.returncode)))
            os.chmod(out, 0o755)         # whatever the umask: see _ours
            os.replace(out, path)        # atomic: other processes too
            _status['built'] += 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        return _failed('loading %s failed: %s' % (path, e))


def _ours(path):
    """Is ``path`` a shared object this user built (owned by us, and
    writable by nobody else)? Anything else is built again over it."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    getuid = getattr(os, 'getuid', None)
    return (getuid is None or st.st_uid == getuid()) and \
        not st.st_mode & 0o022


_private = []


def _private_dir():
    if not _private:
        d = tempfile.mkdtemp(prefix='static_graph-native-')
        atexit.register(shutil.rmtree, d, True)
        _private.append(d)
    return _private[0]


def _failed(why):
    if _status['failed'] != why:
        logging.getLogger('static_graph').info(
            'NumPy ufuncs instead of compiled C loops: %s', why)
    _status['failed'] = why
    return why
