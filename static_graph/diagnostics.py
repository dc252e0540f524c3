"""Warnings and logging: the library never prints."""
import logging
import threading
import warnings

logger = logging.getLogger('static_graph')
logger.addHandler(logging.NullHandler())   # a library leaves output to the app


class StaticGraphWarning(UserWarning):
    """A static chain fell back to define-by-run, or keeps re-recording."""


_seen = set()
_seen_lock = threading.Lock()


def warn_once(key, message, stacklevel=3):
    """Warn (StaticGraphWarning) and log once per ``key``."""
    with _seen_lock:
        if key in _seen:
            logger.debug('%s', message)
            return False
        _seen.add(key)
    logger.warning('%s', message)
    warnings.warn(message, StaticGraphWarning, stacklevel=stacklevel)
    return True


def reset_warnings():
    """Forget which warnings were given (for tests)."""
    with _seen_lock:
        _seen.clear()
