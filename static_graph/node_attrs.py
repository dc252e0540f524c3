"""A recorded node's attributes as one mapping (recorder.py, kernels.py,
analysis.py...): its ``__dict__``, or for an old-style ``chainer.Function``'s
adapter node, the adapter's and the Function's together."""

_FUNCTION = '_function.'


class AdapterAttrs(object):
    """The attributes of an old-style ``chainer.Function``'s adapter node
    and of the Function it wraps, as one mapping: the Function's under
    ``'_function.' + name``. An old-style Function keeps its hidden state
    (F.hinge's ``bottom_diff``) on itself, not on the node; this lets that
    state be recorded, restored and handed back like a node's."""

    __slots__ = ('node', 'fn')

    def __init__(self, node):
        self.node = node.__dict__
        self.fn = node._function.__dict__

    def _where(self, k):
        if k.startswith(_FUNCTION):
            return self.fn, k[len(_FUNCTION):]
        return self.node, k

    def __getitem__(self, k):
        d, k = self._where(k)
        return d[k]

    def __setitem__(self, k, v):
        d, k = self._where(k)
        d[k] = v

    def __contains__(self, k):
        d, k = self._where(k)
        return k in d

    def get(self, k, default=None):
        d, k = self._where(k)
        return d.get(k, default)

    def pop(self, k, default=None):
        d, k = self._where(k)
        return d.pop(k, default)

    def update(self, pairs):
        for k, v in (pairs.items() if isinstance(pairs, dict) else pairs):
            self[k] = v

    def items(self):
        out = [(k, v) for k, v in self.node.items() if k != '_function']
        out.extend((_FUNCTION + k, v) for k, v in self.fn.items())
        return out

    def keys(self):
        return dict(self.items()).keys()

    def __iter__(self):
        return iter(self.keys())

    def __len__(self):
        return len(self.items())

    def copy(self):
        return dict(self.items())


def attrs(node):
    """A node's attributes as a mapping: its ``__dict__``, or for an
    old-style Function's adapter, ``AdapterAttrs``."""
    if getattr(node, '_function', None) is not None:
        return AdapterAttrs(node)
    return node.__dict__
