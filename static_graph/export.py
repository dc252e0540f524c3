"""Export a static chain's inference schedule to ONNX."""
import chainer

from schedules import ir
from schedules import onnx_export
from static_graph import decorator
from static_graph import signature


def _wrapped_name(chain, method):
    attr = getattr(type(chain), method, None)
    if attr is None or not getattr(attr, '__static_graph__', False):
        raise TypeError(
            '%s.%s is not decorated with @static_graph; export_onnx reads '
            'the schedule it records' % (type(chain).__name__, method))
    return attr.__wrapped__.__name__


def inference_schedule(chain, args, method='forward', kwargs=None):
    """Record (or reuse) the forward schedule of ``chain.method(*args)``
    under ``train=False`` and ``no_backprop_mode``; returns the entry."""
    kwargs = dict(kwargs or {})
    if not isinstance(args, (tuple, list)):
        args = (args,)
    name = _wrapped_name(chain, method)
    with chainer.using_config('train', False), chainer.no_backprop_mode(), \
            chainer.using_config('use_static_graph', True):
        getattr(chain, method)(*args, **kwargs)
        arg_names = decorator._arg_names(getattr(type(chain),
                                                 method).__wrapped__)
        spec, _, _ = signature.flatten(arg_names, tuple(args), kwargs)
        key = (spec, signature.config_key())
    cache = decorator.caches_of(chain).get(name)
    entry = cache.get(key) if cache is not None else None
    if entry is None or entry.state != 'complete':
        reason = entry.reason if entry is not None else 'nothing was recorded'
        raise ValueError('cannot export %s.%s: its call runs define-by-run '
                         '(%s)' % (type(chain).__name__, method, reason))
    return entry


def schedule_values(schedule):
    """Current arrays of the parameters, persistents and constants."""
    return {b: buf.storage for b, buf in schedule.buffers.items()
            if buf.role in (ir.PARAM, ir.PERSIST, ir.CONST)}


def export_onnx(chain, args, path, method='forward', opset=13,
                dynamic_batch=True, input_names=None, output_names=None,
                kwargs=None):
    """Write the inference graph of ``chain.method(*args)`` to ``path``.

    The parameters become initializers; the array arguments are the graph's
    inputs (their leading dimension is a symbolic batch size unless
    ``dynamic_batch=False``). An op without an ONNX converter raises
    ``UnsupportedOpError`` naming it and the source line that recorded it;
    nothing is written then. Returns the ``onnx.ModelProto``.
    """
    entry = inference_schedule(chain, args, method, kwargs)
    sched = entry.forward
    return onnx_export.export_schedule(
        sched, schedule_values(sched), path, opset=opset,
        dynamic_batch=dynamic_batch, input_names=input_names,
        output_names=output_names)
