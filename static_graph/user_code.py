"""Which code is the user's: the directories of the library code user code
calls (Chainer, NumPy, CuPy) and of this package, whose frames are looked
through to find the user's line (``user_frame``, ``user_location``), and
Chainer's code whose reads of array values count as the user's own
(``reads_as_user``). Used by traced.py, which re-exports these names."""
import os
import sys

import numpy

import chainer

import schedules


def cupy_module():
    """CuPy, where Chainer found it importable; else None."""
    cuda = getattr(chainer.backends, 'cuda', None)
    if cuda is None or not getattr(cuda, 'available', False):
        return None
    return cuda.cupy


def _dir_of(module):
    return os.path.dirname(module.__file__) + os.sep


# This package's code and its schedules' (schedules/bits.py compares
# arrays while a call records: no user read).
OWN_DIR = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
           _dir_of(schedules))
# Library code user code calls (its frames are looked through to find the
# user's line): Chainer, NumPy, and CuPy where it is there.
LIBRARY_DIRS = tuple(_dir_of(m) for m in (chainer, numpy, cupy_module())
                     if m is not None)
INTERNAL_DIRS = LIBRARY_DIRS + OWN_DIR


_internal_files = {}   # file name -> is it in INTERNAL_DIRS?
# Chainer's code that computes with the values of Variables outside its
# functions' nodes and builds nodes from them: chainer.distributions
# (``Categorical.log_prob`` indexes with ``x.data.astype(int32)``,
# ``Exponential.log_prob`` masks with ``x.array >= 0``, samples draw from
# ``p.data``), Gumbel-softmax's draw. Its reads of Variables' arrays are
# looked at as user code's are (``reads_as_user``).
CHAINER_DIR = os.path.dirname(chainer.__file__)
USER_LIKE = (os.path.join(CHAINER_DIR, 'distributions') + os.sep,
             os.path.join(CHAINER_DIR, 'functions', 'noise',
                          'gumbel_softmax.py'))
_user_like_files = {}


def reads_as_user(name):
    """Are reads of array values by code of file ``name`` the method's
    own (user code, or ``USER_LIKE``)? (Remembered per name.)"""
    user = _user_like_files.get(name)
    if user is None:
        if len(_user_like_files) > 4096:
            _user_like_files.clear()
        user = _user_like_files[name] = not internal_file(name) or \
            name.startswith(USER_LIKE)
    return user


def internal_file(name):
    """Is file ``name`` in INTERNAL_DIRS? (Remembered per name.)"""
    inside = _internal_files.get(name)
    if inside is None:
        if len(_internal_files) > 4096:     # (files made on the fly)
            _internal_files.clear()
        inside = _internal_files[name] = name.startswith(INTERNAL_DIRS)
    return inside


def user_frame(depth=2):
    """The innermost frame outside Chainer, NumPy, CuPy and this package."""
    f = sys._getframe(depth)
    internal = _internal_files
    while f is not None:
        name = f.f_code.co_filename
        inside = internal.get(name)
        if inside is None:
            inside = internal_file(name)
        if not inside:
            break
        f = f.f_back
    return f


def user_location(depth=2):
    f = user_frame(depth + 1)
    if f is None:
        return None
    return '%s:%d' % (f.f_code.co_filename, f.f_lineno)


_NUMPY_OR_OWN = (_dir_of(numpy),) + OWN_DIR
_CHAINER_ROOT = os.path.dirname(CHAINER_DIR) + os.sep


def chainer_location(depth=2):
    """Where Chainer's own code made the call that reached here (its
    innermost frame outside NumPy and this package, where that is
    Chainer's: a link hook's power iteration calling
    ``numpy.linalg.norm``), as 'chainer/...py:line'; else None."""
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.startswith(_NUMPY_OR_OWN):
        f = f.f_back
    if f is None or not f.f_code.co_filename.startswith(CHAINER_DIR):
        return None
    return '%s:%d' % (f.f_code.co_filename[len(_CHAINER_ROOT):],
                      f.f_lineno)


def read_reason(what, depth=2):
    """The reason to fall back where code reads array values (``what``:
    'numpy.norm()', '.item()'), naming Chainer's code where that is what
    reads them (SpectralNormalization's power iteration; gans31 hunt: the
    reason named the user's line alone)."""
    inner = chainer_location(depth)
    if inner is not None:
        return ("Chainer's code reads array values (%s at %s, reached from "
                '%s); replay would freeze them'
                % (what, inner, user_location(depth)))
    return ('user code reads array values (%s) at %s; replay would freeze '
            'them' % (what, user_location(depth)))
