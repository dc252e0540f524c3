"""The public entry points: check the opset, convert a schedule to an
``onnx.ModelProto``, write it atomically."""
import os
import tempfile

from schedules.onnx_export.common import MIN_OPSET, _import_onnx
from schedules.onnx_export.graph import _Context


# -- public API --------------------------------------------------------------

def check_opset(opset):
    """Validate ``opset``; return it as an int."""
    onnx = _import_onnx()
    try:
        value = float(opset)
    except (TypeError, ValueError):
        value = None
    if value is None or not value.is_integer() or isinstance(opset, bool):
        raise ValueError('opset must be an integer, not %r' % (opset,))
    opset = int(value)
    newest = onnx.defs.onnx_opset_version()
    if opset < MIN_OPSET:
        raise ValueError(
            'ONNX export needs opset %d or newer (got opset=%d)'
            % (MIN_OPSET, opset))
    if opset > newest:
        raise ValueError(
            'opset %d is newer than the installed onnx package knows '
            '(newest: %d)' % (opset, newest))
    return opset


def schedule_to_onnx(schedule, values, opset=13, dynamic_batch=True,
                     input_names=None, output_names=None,
                     graph_name='static_graph', other_batch=None):
    """Convert an inference schedule to an ``onnx.ModelProto``.

    Args:
        schedule (schedules.ir.Schedule): an inference (forward) schedule.
        values (dict): buffer id -> array for the PARAM, PERSIST and CONST
            buffers the schedule reads (a CONST buffer missing here falls
            back to its ``storage``). They become initializers named after
            the buffers (``/l1/W`` -> ``l1.W``).
        opset (int): ONNX opset, 13 or newer.
        dynamic_batch (bool): make the leading (batch) dimension symbolic.
        input_names, output_names (list of str): graph input/output names;
            default: sanitised input buffer names and ``output``/
            ``output_<i>``.
        graph_name (str): name of the ONNX graph.
        other_batch (tuple): ``(batch size, {buffer id: shape})``, the
            shapes the same program gave at another batch size. With
            ``dynamic_batch``, every result is checked against them: where
            the exported graph would not follow the batch size as the
            program does (a reshape to ``(2, B, C)`` recorded at B = 2, a
            split of the batch axis), UnsupportedOpError is raised instead
            of writing a model that is wrong at other batch sizes.

    Raises:
        UnsupportedOpError: an op has no converter (or an unsupported use).
        ValueError: bad arguments or a value missing for a parameter.
    """
    onnx = _import_onnx()
    opset = check_opset(opset)
    ctx = _Context(onnx, schedule, values or {}, opset, dynamic_batch)
    if dynamic_batch:
        ctx.other_batch = other_batch
    return ctx.build(input_names, output_names, graph_name)


def save_onnx(model, path):
    """Write ``model`` to ``path`` atomically.

    The model is serialised first, then written to a temporary file in the
    same directory which replaces ``path`` at the end: on any error nothing
    (in particular no half-written file) is left at ``path``.
    """
    path = os.fspath(path)
    data = model.SerializeToString()
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError('cannot write %s: no directory %s'
                                % (path, directory))
    fd, tmp = tempfile.mkstemp(
        prefix='.%s.' % os.path.basename(path), suffix='.tmp', dir=directory)
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def export_schedule(schedule, values, path, **kwargs):
    """``schedule_to_onnx`` then ``save_onnx``; returns the model.

    The model is fully built (and any UnsupportedOpError raised) before
    anything is written.
    """
    model = schedule_to_onnx(schedule, values, **kwargs)
    save_onnx(model, path)
    return model
