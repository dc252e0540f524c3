"""NumPy calls between Chainer functions, recorded as ops of the schedule.

While a call records (its forward, outside any Chainer function), these
NumPy calls become ops instead of values frozen at recording:

* a draw from NumPy's global generator with an array result
  (``numpy.random.randn(*h.shape)`` in DCGAN's ``add_noise``,
  ``numpy.random.standard_normal`` in ``chainer.distributions.Normal``'s
  ``sample``), made by user code, by ``chainer.distributions`` or by
  ``F.gumbel_softmax``, or from
  a generator object the chain holds or the method names as a global
  (``self.rng.randn(...)``, through generators.py's stand-in);
* NumPy arithmetic on an array the recording traces (a drawn array, an
  input array, one read through ``Variable.array``): ufuncs (``sigma *
  noise``, ``x / 255``), ``astype``, ``copy``, the copies NumPy's
  constructors make (``numpy.asarray(x, dtype=numpy.float32)``,
  patches.py) and NumPy functions whose result is new memory
  (``numpy.concatenate``, ``numpy.where``);
* a call of one of Chainer's own pure array functions (``PURE``) with a
  traced array among its arguments: ``concat_examples(xs, padding=-1)``,
  which text classification's CNN and bag-of-words encoders call in their
  forward, pads into a new array with item assignments, which would
  otherwise be writes the recording cannot repeat.

Each is a ``NumpyCall`` node applied like any Chainer function (the
recorder sees it through ``FunctionNode.apply``); its forward makes the
very call again, with the recorded constants, on that call's arrays. At
replay a draw runs at its place among the schedule's ops, so the global
generator is drawn from in define-by-run's order (F.dropout's own draws
included), and a ufunc gets the same operands: the same bits. Results are
handed back to user code traced, so what it does with them next is seen
too. What stays a reason to fall back: a draw with a scalar result (a
number used in Python), a reduction to one value, anything whose result's
shape depends on the values (traced.py), arguments other than arrays and
plain constants. CuPy's generators are not covered (device_reads.py).
"""
import functools

import numpy

import chainer
from chainer import function_node

from static_graph import traced

# Chainer's own code whose draws are ops: a distribution's sample, and
# F.gumbel_softmax's Gumbel noise (drawn outside its nodes; F.dropout and
# the other noise functions draw inside theirs, which replay runs). (Its
# initializers and link hooks draw once, for state they keep: not an op of
# every call.)
DRAWING_DIRS = traced.USER_LIKE

_NONE = object()
# Functions of the global generator that set its state or write into their
# argument: never ops.
NOT_DRAWS = frozenset(('seed', 'set_state', 'shuffle'))
_CONSTANTS = (int, float, complex, bool, str, bytes, type(None),
              numpy.generic, numpy.dtype, type, slice, type(Ellipsis))


class NumpyCall(function_node.FunctionNode):
    """``fn(*args, **kwargs)`` with the arrays at ``slots`` given as the
    node's inputs: a NumPy call of a recorded forward (module docstring).
    Its results carry no gradient, as a NumPy call's do not."""

    static_graph_pure = True    # (it reads its inputs, writes none)

    def __init__(self, fn, name, args, kwargs, slots, draws=False):
        self.fn = fn
        self.name = name
        self.args = args
        self.kwargs = kwargs
        self.slots = slots      # per input: ('a', i), ('a', i, j), ('k', k)
        self.scalar = _NONE     # a draw's result that is no array
        self.draws = draws      # from a generator on the host (graphs.py)

    @property
    def label(self):
        return 'NumpyCall(%s)' % self.name

    def forward(self, inputs):
        args, kwargs = list(self.args), dict(self.kwargs)
        for slot, x in zip(self.slots, inputs):
            if slot[0] == 'k':
                kwargs[slot[1]] = x
            elif len(slot) == 2:
                args[slot[1]] = x
            else:
                seq = args[slot[1]]
                args[slot[1]] = seq[:slot[2]] + type(seq)((x,)) + \
                    seq[slot[2] + 1:]
        r = self.fn(*args, **kwargs)
        outs = r if type(r) is tuple else (r,)
        if not all(type(o) is numpy.ndarray for o in outs):
            self.scalar = r
            return tuple(numpy.asarray(o) for o in outs)
        return outs


def _constant(v):
    """A plain constant of a call, or a tuple or list of them."""
    return isinstance(v, _CONSTANTS) or type(v) in (tuple, list) and all(
        isinstance(x, _CONSTANTS) for x in v)


def _template(args, kwargs):
    """(args with None for arrays, kwargs likewise, slots, arrays), or
    None where an argument is neither an array nor a plain constant (one
    level of tuples and lists of them is looked into)."""
    args = list(args)
    kwargs = dict(kwargs)
    slots, arrays = [], []
    for i, a in enumerate(args):
        if isinstance(a, numpy.ndarray):
            slots.append(('a', i))
            arrays.append(a)
            args[i] = None
        elif type(a) in (tuple, list):
            seq = list(a)
            for j, x in enumerate(seq):
                if isinstance(x, numpy.ndarray):
                    slots.append(('a', i, j))
                    arrays.append(x)
                    seq[j] = None
                elif not _constant(x):
                    return None
            args[i] = type(a)(seq)
        elif not _constant(a):
            return None
    for k, v in kwargs.items():
        if isinstance(v, numpy.ndarray):
            slots.append(('k', k))
            arrays.append(v)
            kwargs[k] = None
        elif not _constant(v):
            return None
    return tuple(args), kwargs, tuple(slots), arrays


def recordable(rec):
    """May a NumPy call be an op of ``rec`` now (its forward, outside any
    Chainer function)?"""
    return rec is not None and not rec.depth and rec.phase == 'forward'


def apply(rec, fn, name, template, draws=False):
    """Make the call of ``fn`` that ``template`` (``_template``'s) holds an
    op of ``rec``: (node, its results as traced arrays, or its result that
    is no array)."""
    targs, tkwargs, slots, arrays = template
    node = NumpyCall(fn, name, targs, tkwargs, slots, draws)
    outs = node.apply(arrays)
    if node.scalar is not _NONE:
        return node, node.scalar
    return node, tuple(rec.trace(y.array) for y in outs)


def draw(rec, fn, module_name, name, args, kwargs):
    """A draw from the global generator (patches.py) as an op: the draw's
    result, or None where it is not one (nothing was drawn)."""
    t = _template(args, kwargs)
    if t is None:
        return None
    node, result = apply(rec, fn, '%s.%s' % (module_name, name), t, True)
    if node.scalar is _NONE:
        return result[0]
    rec.add_reason(
        'user code draws random numbers (%s.%s) at %s, a number used in '
        'Python; replay would freeze it (draw an array, use Chainer '
        'functions such as F.dropout or F.gaussian, or pass it in as an '
        'argument)' % (module_name, name, traced.user_location(3)))
    return result


# Chainer's functions of arrays and plain constants whose result is new
# memory, shaped by their arguments' shapes alone (which are the key's),
# as (module, name, label in the printout): made ops whole where a traced
# array is among their arguments (patches.py wraps them while a recording
# is under way).
PURE = (('chainer.dataset.convert', '_concat_arrays_with_padding',
         'chainer.dataset.concat_examples'),)


def pure_function(orig, label):
    """``orig`` (one of ``PURE``) as an op of the thread's recording where
    it may be one and is given a traced array."""
    def call(*args, **kwargs):
        rec = traced.active_recording()
        if recordable(rec):
            t = _template(args, kwargs)
            if t is not None and any(type(a) is traced.TracedArray
                                     for a in t[3]):
                return apply(rec, orig, label, t)[1][0]   # (one array)
        return orig(*args, **kwargs)

    call.__name__ = orig.__name__
    call.__doc__ = orig.__doc__
    return call


# Chainer's functions that compute on their argument's array outside any
# node, their result a Variable with no graph: (module, name, label). Made
# ops where the argument is an array of the recording (``F.sign(
# F.mean(h))``; a result that happened to be uniform was taken for a
# constant, and replay froze it).
ON_ARRAYS = tuple(('chainer.functions.math.' + n, n, 'F.' + n)
                  for n in ('sign', 'floor', 'ceil', 'fix'))


def array_function(orig, label):
    """``orig`` (one of ``ON_ARRAYS``) as an op of the thread's recording
    where its argument is a Variable (a Parameter too: ``F.sign(self.W)``
    of a binarized network) or a recorded array."""
    def call(x):
        rec = traced.active_recording()
        if recordable(rec):
            variable = isinstance(x, chainer.Variable)
            a = x.raw_array if variable else x
            if isinstance(a, numpy.ndarray) and (
                    variable or type(a) is traced.TracedArray or
                    rec.is_recorded(a)):
                out = apply(rec, _array_of(orig), label,
                            ((None,), {}, (('a', 0),), [a]))[1][0]
                return chainer.as_variable(out)
        return orig(x)

    call.__name__ = orig.__name__
    call.__doc__ = orig.__doc__
    return call


def walker_sample(orig):
    """``WalkerAlias.sample_xp`` (``orig``) as a draw of the thread's
    recording where it may be one: ``L.BlackOut`` draws its negative
    samples with it in its forward, outside any node (a sample of one
    element was taken for a constant, and replay froze it)."""
    def sample_xp(self, xp, shape):
        rec = traced.active_recording()
        if xp is numpy and recordable(rec):
            made = draw(rec, functools.partial(orig, self, xp),
                        'WalkerAlias', 'sample', (shape,), {})
            if made is not None:
                return made
        return orig(self, xp, shape)

    return sample_xp


def _array_of(orig):
    def call(a):
        return orig(a).array
    call.__name__ = orig.__name__
    return call


def _new_memory(result, arrays):
    outs = result if type(result) in (tuple, list) else (result,)
    return all(type(o) is numpy.ndarray for o in outs) and not any(
        numpy.shares_memory(o, a) for o in outs for a in arrays)


def _zero_d(result, arrays):
    """Is ``result`` the NumPy scalar(s) a ufunc gives for 0-d arrays
    (``loss.array * n``)?"""
    outs = result if type(result) is tuple else (result,)
    return all(isinstance(o, numpy.generic) for o in outs) and all(
        a.ndim == 0 for a in arrays)


def _gives_scalars(rec, fn, arrays, args, kwargs):
    """Would ``fn`` give NumPy scalars where define-by-run has NumPy
    scalars for the 0-d arrays that stand for them (``s.astype(f32)``,
    ``s.copy()`` of ``s = loss.array * 0.5``, a NumPy scalar: then so is
    what they give)? ``fn`` runs again on those scalars to tell."""
    if not any(id(a) in rec.scalar_like for a in arrays):
        return False

    def shadow(a):
        if isinstance(a, traced.TracedArray):
            plain = traced.untraced(a)
            return plain[()] if id(a) in rec.scalar_like else plain
        if type(a) in (tuple, list):
            return type(a)(shadow(x) for x in a)
        return a
    try:
        out = fn(*[shadow(a) for a in args],
                 **dict((k, shadow(v)) for k, v in kwargs.items()))
    except Exception:
        return False
    outs = out if type(out) is tuple else (out,)
    return all(isinstance(o, numpy.generic) for o in outs)


def _giving_arrays(fn):
    """``fn`` with the NumPy scalars it gives as 0-d arrays (the same
    values), which an op hands on like any result."""
    def call(*args, **kwargs):
        r = fn(*args, **kwargs)
        if type(r) is tuple:
            return tuple(numpy.asarray(x) for x in r)
        return numpy.asarray(r)

    call.__name__ = getattr(fn, '__name__', 'call')
    return call


def compute(rec, fn, name, args, kwargs, result):
    """A pure NumPy call on traced arrays, already computed (``result``,
    plain arrays): as an op of ``rec`` where its result is new memory (or
    NumPy scalars of a ufunc of 0-d arrays, the perplexity
    ``numpy.exp(loss.array * n / words)`` that Chainer's seq2seq example
    reports: 0-d arrays, as the caller hands them back anyway), its traced
    results; else None (the caller hands back ``result`` as before)."""
    if not recordable(rec):
        return None
    t = _template(args, kwargs)
    if t is None:
        return None
    arrays = [traced.untraced(a) for a in t[3]]
    zero_d = _zero_d(result, arrays)
    if zero_d:
        fn = _giving_arrays(fn)
    elif not _new_memory(result, arrays):
        return None
    results = apply(rec, fn, name, t)[1]
    if zero_d or rec.scalar_like and _gives_scalars(rec, fn, t[3], args,
                                                    kwargs):
        # (reported, they are the NumPy scalars define-by-run has:
        # reports.py)
        rec.scalar_like.update(id(r) for r in results)
    # (in the container NumPy returned: numpy.where's tuple, a list)
    return type(result)(results) if type(result) in (tuple, list) else \
        results[0]


traced.calls = compute     # (traced.py cannot import this module)


def scalar_views(rec, fn, args, kwargs, out):
    """``out``, a view ``fn`` made of traced arrays of ``rec``, stands for
    a NumPy scalar too where it is 0-d and ``fn`` of the NumPy scalars
    that 0-d inputs stand for gives one (``s.T``, ``numpy.squeeze(s)``;
    not ``s[...]``, a 0-d array of a NumPy scalar too)."""
    if not isinstance(out, traced.TracedArray) or out.ndim:
        return
    arrays = [a for a in args if isinstance(a, traced.TracedArray)]
    if _gives_scalars(rec, fn, arrays, args, kwargs):
        rec.scalar_like.add(id(out))
        rec.scalar_views.append(out)     # (its id stays its own)


traced.scalar_views = scalar_views

# Variable arithmetic that computes otherwise with a number than with an
# array (Chainer tests ``numpy.isscalar``): ``x / s`` is x * (1 / s) for
# a NumPy scalar, a division by an array; ``s / x``, ``x ** s``, ``s ** x``
# differ in their backwards. (Addition, subtraction and multiplication give
# the same bits either way.)
SCALAR_PATHS = ('__truediv__', '__rtruediv__', '__floordiv__',
                 '__rfloordiv__', '__pow__', '__rpow__')


def scalar_arithmetic(orig, name):
    """Variable's ``name`` (``orig``) where the operand may be a NumPy
    scalar this recording computed from values (a 0-d traced array stands
    for it, ``compute``): the call computes with the scalar, on Chainer's
    path for a number, as define-by-run does, and the recording notes a
    reason (a replay would freeze the number or, as an array, compute
    other last bits)."""
    def call(self, rhs):
        if type(rhs) is traced.TracedArray:
            rec = traced.active_recording()
            if rec is not None and id(rhs) in rec.scalar_like:
                rec.add_reason(
                    'a NumPy scalar computed from array values enters '
                    'Variable.%s at %s: define-by-run computes with it as a '
                    'number (another function than for an array)'
                    % (name, traced.user_location(1)))
                rhs = traced.untraced(rhs)[()]
        return orig(self, rhs)

    call.__name__ = name
    return call
