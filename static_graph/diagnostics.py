"""Warnings and logging: the library never prints."""
import logging
import sys
import threading
import warnings
import weakref

from static_graph import traced

logger = logging.getLogger('static_graph')
logger.addHandler(logging.NullHandler())   # a library leaves output to the app


class StaticGraphWarning(UserWarning):
    """A static chain fell back to define-by-run, or keeps re-recording."""


_seen = set()
_seen_lock = threading.Lock()
# Distinct warnings remembered (past it, each may be given once more).
SEEN_MAX = 8192


def _user_stacklevel():
    """The stacklevel, for a warnings.warn called in warn_once, of
    traced.user_frame (the innermost frame outside this package, Chainer,
    NumPy and CuPy): the user's line that called the chain (or decorated
    the method)."""
    user = traced.user_frame(3)       # 3: warn_once's caller, from here
    if user is None:
        return 2
    level, f = 2, sys._getframe(2)    # stacklevel 2: warn_once's caller
    while f is not user:
        f = f.f_back
        level += 1
    return level


def warn_once(key, message):
    """Warn (StaticGraphWarning, at the user's line) and log once per
    ``key``."""
    # A class in the key by a weak reference: the key outlives a class a
    # notebook cell defines again (it kept each one alive, and what it
    # holds); another class of the same name is warned about again.
    key = tuple(weakref.ref(k) if isinstance(k, type) else k for k in key)
    with _seen_lock:
        if key in _seen:
            logger.debug('%s', message)
            return False
        if len(_seen) >= SEEN_MAX:
            _seen.clear()
        _seen.add(key)
    logger.warning('%s', message)
    warnings.warn(message, StaticGraphWarning, stacklevel=_user_stacklevel())
    return True


def reset_warnings():
    """Forget which warnings were given (for tests)."""
    with _seen_lock:
        _seen.clear()
