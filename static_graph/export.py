"""Export a static chain's inference schedule to ONNX."""
import chainer

from schedules import ir
from schedules import onnx_export
from static_graph import arrayutil
from static_graph import decorator
from static_graph import signature


def _wrapped_name(chain, method):
    """The undecorated function of ``chain``'s decorated ``method``."""
    attr = getattr(type(chain), method, None)
    if attr is None or not getattr(attr, '__static_graph__', False):
        raise TypeError(
            '%s.%s is not decorated with @static_graph; export_onnx reads '
            'the schedule it records' % (type(chain).__name__, method))
    return attr.__wrapped__


def cache_of(chain, fn):
    """The chain's Cache of the decorated function ``fn`` (two methods of
    one name, ``wrapper`` from a user's decorator, have one each)."""
    for cache in decorator.caches_of(chain).values():
        if cache.method is fn:
            return cache
    return None


def inference_schedule(chain, args, method='forward', kwargs=None):
    """Record (or reuse) the forward schedule of ``chain.method(*args)``
    under ``train=False`` and ``no_backprop_mode``; returns the entry."""
    kwargs = dict(kwargs or {})
    if not isinstance(args, (tuple, list)):
        args = (args,)
    fn = _wrapped_name(chain, method)
    with chainer.using_config('train', False), chainer.no_backprop_mode(), \
            chainer.using_config('use_static_graph', True):
        getattr(chain, method)(*args, **kwargs)
        arg_names = signature.arg_names_of(getattr(type(chain),
                                                 method).__wrapped__)
        spec, _, _ = signature.flatten(arg_names, tuple(args), kwargs)
        key = signature.Key((spec, signature.config_key()))
    cache = cache_of(chain, fn)
    entry = cache.get(key) if cache is not None else None
    if entry is None and cache is not None and (cache.state_slots or
                                                cache.kept):
        # Keys then hold what the links' state slots held at the call
        # (decorator.py), which the call changed: the call's own entry
        # is the last one used of these arguments and flags.
        with cache.lock:
            entry = next((e for k, e in reversed(cache.entries.items())
                          if k[1] == key[1] and k[0][:-1] == key[0]), None)
    if entry is None or entry.state != 'complete':
        reason = entry.reason if entry is not None else \
            "Chainer's debug mode is on" if chainer.is_debug() else \
            'nothing was recorded' + (
                ': ' + cache.probation if cache is not None and
                cache.probation else '')
        raise ValueError('cannot export %s.%s: its call runs define-by-run '
                         '(%s)' % (type(chain).__name__, method, reason))
    return entry


def schedule_values(schedule):
    """Current arrays of the parameters, persistents and constants."""
    return {b: buf.storage for b, buf in schedule.buffers.items()
            if buf.role in (ir.PARAM, ir.PERSIST, ir.CONST)}


def _doubled_batch(args, kwargs):
    """The arguments with every array whose leading axis has the batch size
    (that of the first array, as the exporter takes it) repeated twice
    along it; and that size."""
    _, leaves, _ = signature.flatten((), args, kwargs)
    arrays = [getattr(a, 'raw_array', a) for a in leaves]
    batch = next((a.shape[0] for a in arrays if a.ndim >= 1), None)

    def double(leaf, a):
        if a.ndim >= 1 and a.shape[0] == batch:
            a = chainer.backend.get_array_module(a).concatenate([a, a])
        if isinstance(leaf, chainer.Variable):
            return chainer.Variable(a, requires_grad=leaf.requires_grad)
        return a
    return signature.rebuild(args, kwargs, [
        double(leaf, a) for leaf, a in zip(leaves, arrays)]), batch


def _distinct(args, kwargs):
    """The arguments with an array or Variable given twice (one example
    for two inputs: ``export_onnx(m, (x, x), ...)``) copied: each is an
    input of the graph. (The key of such a call holds that they are one,
    and its schedule reads one input: the graph read the last for both.)"""
    _, leaves, _ = signature.flatten((), args, kwargs)
    seen, out = set(), []
    for leaf in leaves:
        if id(leaf) in seen:
            if isinstance(leaf, chainer.Variable):
                leaf = chainer.Variable(leaf.array.copy(),
                                        requires_grad=leaf.requires_grad)
            else:
                leaf = leaf.copy()
        seen.add(id(leaf))
        out.append(leaf)
    if all(a is b for a, b in zip(out, leaves)):
        return args, kwargs
    return signature.rebuild(args, kwargs, out)


def _other_batch(chain, args, kwargs, method, entry):
    """(2 * batch, {buffer id: shape}) of ``entry``'s forward schedule,
    recorded again at twice the batch size, for the exporter's check."""
    (args2, kwargs2), batch = _doubled_batch(args, kwargs)
    if batch is None:
        return None
    try:
        entry2 = inference_schedule(chain, args2, method, kwargs2)
    except Exception as err:
        raise ValueError(
            'dynamic_batch=True: %s.%s did not run at batch size %d (%s: '
            '%s); export with dynamic_batch=False' % (
                type(chain).__name__, method, 2 * batch,
                type(err).__name__, err))
    s1, s2 = entry.forward, entry2.forward
    if [op.kind for op in s1.ops] != [op.kind for op in s2.ops] or \
            len(s1.inputs) != len(s2.inputs):
        raise ValueError(
            'dynamic_batch=True: %s.%s runs other functions at batch size %d '
            'than at %d; export with dynamic_batch=False'
            % (type(chain).__name__, method, 2 * batch, batch))
    shapes = {}
    for b1, b2 in zip(s1.inputs, s2.inputs):
        shapes[b1] = s2.buffers[b2].shape
    # (Memory that holds each call's values: a constant that is a view of
    # it, ``x[:, ::-1]`` of an input, is exported as that view.)
    per_call = set(id(o.storage) for o in s1.buffers.values()
                   if o.role not in (ir.PARAM, ir.PERSIST, ir.CONST) and
                   o.storage is not None)
    for o1, o2 in zip(s1.ops, s2.ops):
        for b1, b2 in zip(o1.inputs, o2.inputs):
            c1, c2 = s1.buffers[b1], s2.buffers[b2]
            if c1.role == ir.CONST and c1.shape != c2.shape and \
                    id(arrayutil.root_of(c1.storage)) not in per_call:
                # (numpy.zeros((len(x), H)): an ONNX constant would keep
                # the recorded batch size.)
                raise ValueError(
                    'dynamic_batch=True: %s.%s makes an array of shape %s '
                    'at batch size %d and %s at %d, an input of %s at %s; '
                    'an ONNX constant would keep one size (make it with a '
                    'Chainer function of the input, or export with '
                    'dynamic_batch=False)' % (
                        type(chain).__name__, method, c1.shape, batch,
                        c2.shape, 2 * batch, o1.kind, o1.source))
        for b1, b2 in zip(o1.outputs, o2.outputs):
            shapes[b1] = s2.buffers[b2].shape
    return 2 * batch, shapes


def export_onnx(chain, args, path, method='forward', opset=13,
                dynamic_batch=True, input_names=None, output_names=None,
                kwargs=None):
    """Write the inference graph of ``chain.method(*args)`` to ``path``.

    The parameters become initializers; the array arguments are the graph's
    inputs (their leading dimension is a symbolic batch size unless
    ``dynamic_batch=False``; the method is then recorded at twice the batch
    size too, and a result whose shape would not follow the batch size in
    the exported graph raises). An op without an ONNX converter raises
    ``UnsupportedOpError`` naming it and the source line that recorded it;
    nothing is written then. Returns the ``onnx.ModelProto``.
    """
    if not isinstance(args, (tuple, list)):
        args = (args,)
    args, kwargs = _distinct(tuple(args), dict(kwargs or {}))
    entry = inference_schedule(chain, args, method, kwargs)
    other = _other_batch(chain, args, kwargs, method,
                         entry) if dynamic_batch else None
    sched = entry.forward
    return onnx_export.export_schedule(
        sched, schedule_values(sched), path, opset=opset,
        dynamic_batch=dynamic_batch, input_names=input_names,
        output_names=output_names, other_batch=other)
