"""Warnings and logging: the library never prints."""
import logging
import sys
import threading
import warnings

from static_graph import traced

logger = logging.getLogger('static_graph')
logger.addHandler(logging.NullHandler())   # a library leaves output to the app


class StaticGraphWarning(UserWarning):
    """A static chain fell back to define-by-run, or keeps re-recording."""


_seen = set()
_seen_lock = threading.Lock()


def _user_stacklevel():
    """The stacklevel, for a warnings.warn called in warn_once, of the
    innermost frame outside this package, Chainer, NumPy and CuPy: the
    user's line that called the chain (or decorated the method)."""
    level, f = 2, sys._getframe(2)    # 2: warn_once's caller
    while f is not None and \
            f.f_code.co_filename.startswith(traced.INTERNAL_DIRS):
        f = f.f_back
        level += 1
    return level if f is not None else 2


def warn_once(key, message):
    """Warn (StaticGraphWarning, at the user's line) and log once per
    ``key``."""
    with _seen_lock:
        if key in _seen:
            logger.debug('%s', message)
            return False
        _seen.add(key)
    logger.warning('%s', message)
    warnings.warn(message, StaticGraphWarning, stacklevel=_user_stacklevel())
    return True


def reset_warnings():
    """Forget which warnings were given (for tests)."""
    with _seen_lock:
        _seen.clear()
