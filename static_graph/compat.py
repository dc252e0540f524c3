"""Which Chainer versions the recorder supports."""
import chainer

MIN_VERSION = (7, 0)


def _version_tuple(text):
    parts = []
    for piece in text.split('.')[:2]:
        digits = ''.join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def unsupported_reason():
    """None if this Chainer can be recorded, else why not."""
    version = _version_tuple(chainer.__version__)
    if version < MIN_VERSION:
        return ('chainer %s is older than %d.%d, which the static-graph '
                'recorder needs' % ((chainer.__version__,) + MIN_VERSION))
    for name in ('FunctionNode', 'grad', 'Variable', 'backend'):
        if not hasattr(chainer, name):
            return 'chainer %s has no chainer.%s' % (chainer.__version__, name)
    if not hasattr(chainer.Variable, 'raw_array'):
        return 'chainer %s has no Variable.raw_array' % chainer.__version__
    return None


UNSUPPORTED = unsupported_reason()
