"""What a recorded call reports (``chainer.report``), kept so that every
replay reports what define-by-run would.

Each reported value becomes a code (``encode``, while recording) that replay
turns back into a value (``decode``):

* ``('var', b)``: a Variable of buffer ``b``'s value (a loss);
* ``('array', b)``: the array itself (``loss.array``, an input);
* ``('scalar', b)``: the NumPy scalar of 0-d buffer ``b``, where define-by-run
  had one (``numpy.exp(loss.array * n / words)``, a ufunc of a 0-d array:
  numpy_calls records it as a 0-d op);
* ``('live', v)``: the very object, for a parameter or a view of the chain's
  memory: define-by-run's reporter keeps a reference too, so whoever reads
  it later (LogReport, after the update) sees the updated values;
* ``('seq', type, codes)``: a tuple or list of them (``(value, weight)``,
  which Chainer's summaries take), ``('dict', [(key, code)])`` a dict;
* ``('const', v)``: a Python value the key fixes (``len(x)``, a string).

A NumPy number reported is a reason to fall back: it was computed in
Python (``numpy.float32(loss.array)``), and replay would report its
recorded value.
"""
import numpy

import chainer

from static_graph import arrayutil
from static_graph import traced


def _chain_memory(rec):
    """(ids of the chain's Parameters, ids of its arrays' memory), once per
    recording."""
    found = getattr(rec, '_chain_memory', None)
    if found is None:
        from static_graph import analysis     # (analysis imports recorder)
        params = set(id(p) for p in rec.chain.params())
        roots = set()
        for hit in analysis.chain_arrays(rec.chain).values():
            owner, attr = hit[2], hit[3]
            a = owner.array if attr is None else getattr(owner, attr)
            roots.update((id(a), id(arrayutil.root_of(a))))
        found = rec._chain_memory = (params, roots)
    return found


def encode(rec, key, v):
    """The code of reported value ``v`` (see the module)."""
    params, roots = _chain_memory(rec)
    if isinstance(v, chainer.Variable):
        if chainer.config.keep_graph_on_report and v.creator is not None:
            rec.add_reason(
                'it reports a Variable (%s) under keep_graph_on_report=True; '
                'replay reports its value without the graph' % key)
        if id(v) in params:
            return ('live', v)
        a = v.raw_array
        if not arrayutil.is_array(a):
            return ('const', v)
        if id(arrayutil.root_of(traced.untraced(a))) in roots:
            return ('live', v)
        if isinstance(a, traced.TracedArray):
            a = rec.untrace(a, 'chainer.report')
        return ('var', rec.buffer_of(a, 'report'))
    if arrayutil.is_array(v):
        plain = traced.untraced(v)
        root = arrayutil.root_of(plain)
        if id(root) in roots:
            if root is not plain:
                # A view of a parameter's array: replay shows it only
                # while the parameter holds that array (Entry.matches
                # records again where it gets another).
                rec.held.add(rec.buffer_of(root, 'report'))
            return ('live', plain)
        scalar = isinstance(v, traced.TracedArray) and \
            id(v) in rec.scalar_like
        a = rec.untrace(v, 'chainer.report') \
            if isinstance(v, traced.TracedArray) else v
        return ('scalar' if scalar else 'array', rec.buffer_of(a, 'report'))
    if type(v) in (tuple, list):
        codes = [encode(rec, key, x) for x in v]
        if all(c[0] == 'const' for c in codes):
            return ('const', v)
        return ('seq', type(v), codes)
    if type(v) is dict:
        codes = [(k, encode(rec, key, x)) for k, x in v.items()]
        if all(c[0] == 'const' for _, c in codes):
            return ('const', v)
        return ('dict', codes)
    if isinstance(v, numpy.generic):
        rec.add_reason(
            'it reports a NumPy number (%s), computed in Python; replay '
            'would report its recorded value' % key)
    return ('const', v)


def recording_value(rec, v, code, keep_graph=False):
    """What the recording call itself hands the reporter for ``v``: what
    define-by-run would (a copy where replay may rewrite the memory); with
    ``keep_graph`` (``keep_graph_on_report``: the call falls back), a
    Variable as it is, with its graph."""
    kind = code[0]
    if kind == 'live':
        return code[1]       # (an array as the chain holds it, untraced)
    if kind == 'const' or kind == 'var' and keep_graph:
        return v
    if kind == 'scalar':
        return numpy.array(traced.untraced(v))[()]
    if kind == 'seq':
        return type(v)(recording_value(rec, x, c, keep_graph)
                       for x, c in zip(v, code[2]))
    if kind == 'dict':
        return dict((k, recording_value(rec, v[k], c, keep_graph))
                    for k, c in code[1])
    return arrayutil.detached_copy(v)


def buffers(code):
    """The buffer ids a code reads."""
    kind = code[0]
    if kind in ('var', 'array', 'scalar'):
        yield code[1]
    elif kind == 'seq':
        for c in code[2]:
            yield from buffers(c)
    elif kind == 'dict':
        for _, c in code[1]:
            yield from buffers(c)


def decode(code, var, value):
    """The value a replay reports: ``var(b)`` a Variable of buffer ``b``,
    ``value(b)`` its array."""
    kind = code[0]
    if kind == 'var':
        return var(code[1])
    if kind == 'array':
        return value(code[1])
    if kind == 'scalar':
        return value(code[1])[()]
    if kind == 'seq':
        return code[1](decode(c, var, value) for c in code[2])
    if kind == 'dict':
        return dict((k, decode(c, var, value)) for k, c in code[1])
    return code[1]      # live, const
