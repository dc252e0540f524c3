"""A captured optimizer update as a ``schedules.ir.Schedule``.

The update writes into arrays it reads (``m = add(m, t0)``); in the IR
every write makes a new version of the array, a buffer that is a view of
the array's first buffer (printed ``%12 view of %3``): the same memory, a
new value. Temporaries are new TEMP buffers per write; hyperparameters are
0-d INPUT buffers read at each step; number literals are 0-d constants.
Reductions (GradientClipping's norm, GradientLARS's norms) are ops of
their own, marked ``serial``; element-wise ops of a parameter that is
split across threads carry ``threads=N``. The ops come in execution order:
phase by phase, parameter by parameter, each phase's reductions after it.
"""
import collections

import numpy

from schedules import ir

Entry = collections.namedtuple('Entry', [
    'name', 'shape', 'dtype', 'array_labels', 'scalar_names', 'fp32',
    'threads'])

_ROLE = {'param': ir.PARAM, 'grad': ir.INPUT, 'param32': ir.STATE}
_CREATED = ('grad32', 'new param')     # first written by the update


def build(entries, segments, reductions, nphases, threads):
    """``entries``: an Entry per parameter (None where nothing runs);
    ``segments[(i, k)]``: entry i's Segments of phase k;
    ``reductions[k]``: (kind, reads [(entry, array slot)], writes [(entry,
    scalar slot, ...)]) run after phase k."""
    buffers = {}
    inputs, notes = [], []
    current = {}          # ('a', i, slot) / ('s', i, slot) -> buffer id
    roots = {}
    consts = {}

    def new(shape, dtype, role, name=None):
        b = len(buffers)
        # Arrays (not temporaries or scalars) are written in place: one
        # array object for their whole life.
        buffers[b] = ir.Buffer(b, shape, dtype, role, name=name,
                               static=role != ir.TEMP and shape != ())
        return b

    for i, e in enumerate(entries):
        if e is None:       # nothing runs for it
            continue
        cdtype = numpy.dtype(numpy.float32) if e.fp32 else e.dtype
        for j, label in enumerate(e.array_labels):
            if label in _CREATED:
                continue
            dtype = e.dtype if label in ('param', 'grad') else cdtype
            role = _ROLE.get(label, ir.STATE)
            name = e.name if label == 'param' else '%s.%s' % (e.name, label)
            b = new(e.shape, dtype, role, name)
            current[('a', i, j)] = roots[('a', i, j)] = b
            inputs.append(b)
        for j, s in enumerate(e.scalar_names):
            b = new((), numpy.float64, ir.INPUT, '%s:%s' % (e.name, s))
            current[('s', i, j)] = b
            inputs.append(b)
        size = int(numpy.prod(e.shape))
        notes.append('%s: %s[%s], %d elements, %s%s' % (
            e.name, ir.dtype_short(e.dtype),
            ','.join(str(d) for d in e.shape), size,
            'split across %d threads' % e.threads if e.threads > 1 else
            'one thread', ', updated in float32' if e.fp32 else ''))

    ops = []
    for k in range(nphases):
        for i, e in enumerate(entries):
            for seg in segments.get((i, k), ()):
                ops += _segment_ops(seg, i, e, buffers, current, roots,
                                    consts, new)
        for kind, reads, writes in reductions.get(k, ()):
            ins = [current[('a', i, j)] for i, j in reads]
            i0 = writes[0][0]
            outs = [new((), numpy.float64, ir.TEMP,
                        '%s:%s' % (kind, entries[i0].scalar_names[s]
                                   .split('.')[-1]))
                    for s in writes[0][1:]]
            for w in writes:
                for s, b in zip(w[1:], outs):
                    current[('s', w[0], s)] = b
            ops.append(ir.Op(kind, ins, outs, attrs={'serial': True},
                             source='after phase %d' % k, fn=kind))
    outputs = [current[key] for key in sorted(current) if key[0] == 'a']
    notes.append('%d phase(s) on %d thread(s): one dispatch per phase' % (
        nphases, threads))
    return ir.Schedule('update', buffers, ops, inputs, outputs, notes=notes)


def _segment_ops(seg, i, e, buffers, current, roots, consts, new):
    kernel = seg.kernel
    temps = {}
    out_ops = []
    for op, tdt in zip(kernel.ops, seg.temp_dtypes()):
        ins = []
        for a in op.args + ((('$' + op.guard),) if op.guard else ()):
            if not isinstance(a, str):
                c = consts.get(a)
                if c is None:
                    c = consts[a] = new((), numpy.float64, ir.CONST,
                                        repr(a))
                ins.append(c)
            elif a.startswith('$'):
                ins.append(current[('s', i, seg.scalars[a[1:]])])
            elif a in temps:
                ins.append(temps[a])
            else:
                ins.append(current[('a', i, seg.arrays[a])])
        out = op.out
        if out.startswith('t') and out[1:].isdigit():
            b = temps[out] = new(e.shape, tdt, ir.TEMP)
        else:
            key = ('a', i, seg.arrays[out])
            label = e.array_labels[seg.arrays[out]]
            if key in roots:
                root = buffers[roots[key]]
                b = new(root.shape, root.dtype, root.role, root.name)
                buffers[b].view_of = root.id
            else:
                dtype = e.dtype if label == 'new param' else seg.dtype
                b = roots[key] = new(e.shape, dtype, ir.TEMP,
                                     '%s.%s' % (e.name, label))
                buffers[b].static = True
            current[key] = b
        attrs = {}
        if e.threads > 1:
            attrs['threads'] = e.threads
        if op.guard:
            attrs['if'] = 'last input'
        out_ops.append(ir.Op(op.fn, ins, [b], attrs=attrs,
                             source='%s %s' % (e.name, kernel.name),
                             fn=op.fn))
    return out_ops
