"""What one function application shows, while a call records, that replay
could not repeat (recorder.Recording.on_apply): each a reason, or None.

* ``raised``: an exception whose raising may follow the values (``F.inv``
  of a singular matrix), which a method could catch and branch on;
* ``held_contents`` / ``held_changed``: a list, dict or set a node defined
  outside Chainer holds and writes into in its forward (``self.st['k'] =
  k``): no attribute is set, so its backward would read the last replay's;
* ``nested_arrays``: the arrays in a node's tuple or list attribute
  (GetItem's ``slices``): one computed from values, or a boolean mask from
  the data (the result's shape follows the values);
* ``kept_arrays``: a list or tuple of arrays a node keeps for its backward
  (``F.tree_lstm``'s gates): one for all calls, where a second call's
  forward before the first's backward would hand the first the second's;
* ``sizes_from_data``: sizes a node is built with, from the data
  (``F.split_axis(h, numpy.cumsum(sizes)[:-1])``): its results' shapes
  follow the values.
"""
import numpy

from chainer.utils import type_check

from static_graph import traced
from static_graph.arrayutil import is_array, root_of

# Exceptions of a Chainer function that its inputs' shapes and dtypes decide
# (part of the key), not their values.
_BY_SHAPE = (IndexError, TypeError, type_check.InvalidType)


def raised(e, kind, pre, in_arrays):
    """Exception ``e`` of op ``kind`` (``pre``: its attributes before the
    forward, ``in_arrays``: its inputs), where its raising may follow the
    values. An index past the end, ``for v in variable`` ending, a type
    check are the same at every call of a key, but not an IndexError from
    an index array: one in the node's attributes (``F.get_item(x, idx)``)
    or among its inputs (EmbedID's ids past the vocabulary; GetItem's
    input is the data, its index an attribute)."""
    if isinstance(e, _BY_SHAPE):
        if not isinstance(e, IndexError) or not (any(
                is_array(v) or type(v) is tuple and any(
                    is_array(x) for x in v) for v in pre.values()) or
                kind != 'GetItem' and any(
                    getattr(getattr(a, 'dtype', None), 'kind', None)
                    in ('i', 'u') for a in in_arrays)):
            return None
    return '%s raised %s' % (kind, type(e).__name__)


def _contents(v):
    return [x for kv in v.items() for x in kv] if type(v) is dict \
        else list(v)


def held_contents(d):
    """[(name, container, its contents)] of the lists, dicts and sets in
    node attributes ``d``."""
    return [(k, v, _contents(v)) for k, v in d.items()
            if type(v) in (list, dict, set)]


def held_changed(held, kind):
    """A reason where the forward of ``kind`` changed one of ``held``
    (held_contents before it)."""
    for k, v, before in held:
        now = _contents(v)
        if len(now) != len(before) or any(
                x is not y for x, y in zip(now, before)):
            return ('%s (defined outside Chainer) changes the %s it holds '
                    'as %s in its forward; replay would not repeat that'
                    % (kind, type(v).__name__, k))
    return None


def kept_arrays(kind, name, value):
    """A reason where ``kind``'s forward left a list or tuple of arrays
    on its node as ``name``."""
    if type(value) in (list, tuple) and any(is_array(x) for x in value):
        return ('%s keeps a %s of arrays on its node (%s) for its backward, '
                'which replay cannot keep per call'
                % (kind, type(value).__name__, name.rpartition('.')[2]))
    return None


def nested_arrays(rec, kind, value):
    """Arrays held inside a node's tuple or list attribute (GetItem's
    ``slices``): a view of a recorded buffer is seen like any, one
    computed from values is not, and a boolean mask decides the shape of
    the result. Returns ``value``, or a copy with the constants the method
    made as their plain arrays (what the node keeps)."""
    out, changed = [], False
    for x in value:
        y = x
        if type(x) in (tuple, list):
            y = nested_arrays(rec, kind, x)
        elif getattr(x, 'key_constant', False):
            y = rec.untrace(x, kind)
        elif isinstance(x, traced.TracedArray):
            if x.dtype == numpy.bool_:
                rec.add_reason(
                    '%s indexes with a boolean mask from the data at %s: '
                    'the shape of its result depends on the values'
                    % (kind, traced.user_location(4)))
            else:
                rec.untrace(x, kind)
        elif rec.user_made:
            rec.check_device_computed(kind, x)
        out.append(y)
        changed = changed or y is not x
    return type(value)(out) if changed else value


# Attributes of Chainer's nodes that give the shapes of their results,
# arrays where the caller may pass one (F.split_axis's split points,
# F.pad's widths).
_SIZES = {'SplitAxis': ('indices',), 'Pad': ('pad_width', 'pad_bw')}


def sizes_from_data(rec, kind, name, value):
    """A reason where node ``kind``'s attribute ``name`` (a traced array
    or a KeyConstant, ``value``) gives the shapes of its results and is
    computed from the data: replay would run the op with the new values,
    and its recorded backward with the recording's shapes (graph31 hunt:
    per-graph pooling by ``numpy.cumsum`` of the graph sizes, gradients
    17.3 off, or a ValueError)."""
    if name not in _SIZES.get(kind, ()) or \
            getattr(value, 'key_constant', False) and \
            id(root_of(value)) in rec.shape_made:
        return None
    return ('%s takes its sizes (%s) from the data at %s: the shapes of '
            'its results follow the values, which replay would not'
            % (kind, name, traced.user_location(3)))
