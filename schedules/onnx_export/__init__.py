"""Export an inference ``Schedule`` to an ONNX model.

The exporter reads only the schedule IR (``schedules.ir``): op kinds, their
``attrs`` (as given by ``static_graph.describe``), buffer shapes, dtypes and
roles. It does not import Chainer. ``onnx`` is imported lazily, so this package
can be imported without it.

Each op kind has one small converter function, registered in ``CONVERTERS``;
``supported_kinds()`` lists them. A live op (one that contributes to the
schedule's outputs) of any other kind raises ``UnsupportedOpError``.

Dynamic batch: with ``dynamic_batch=True`` the leading dimension of every
input whose leading dimension equals the recorded batch size (that of the
first input) is named ``'batch'``. The exporter follows the batch axis through
the ops (``Reshape``, ``Transpose``, ``GetItem``, reductions, broadcasts ...)
so that shape constants baked into the graph (reshape targets, broadcast
shapes) keep working for other batch sizes: a recorded reshape to
``(32, 512)`` becomes a reshape to ``(-1, 512)``. Outputs whose leading
dimension carries the batch get the symbolic dimension ``'batch'`` too.

Modules: ``common`` (errors, the converter registry, helpers), ``graph``
(the conversion context that builds the model), ``api`` (the entry points
re-exported here) and one module of converters per op family:
``elementwise`` (and activations), ``linalg``, ``conv`` (and pooling),
``norm``, ``reduce``, ``shape`` and ``indexing``.
"""
# The op families register their converters in CONVERTERS when imported.
from schedules.onnx_export import elementwise  # NOQA
from schedules.onnx_export import linalg  # NOQA
from schedules.onnx_export import conv  # NOQA
from schedules.onnx_export import norm  # NOQA
from schedules.onnx_export import reduce  # NOQA
from schedules.onnx_export import shape  # NOQA
from schedules.onnx_export import indexing  # NOQA

from schedules.onnx_export.api import (  # NOQA
    check_opset, export_schedule, save_onnx, schedule_to_onnx)
from schedules.onnx_export.common import (  # NOQA
    CONVERTERS, INT64_MAX, INT64_MIN, MIN_OPSET, UnsupportedOpError,
    converter, sanitize_name, supported_kinds)

__all__ = ['CONVERTERS', 'INT64_MAX', 'INT64_MIN', 'MIN_OPSET',
           'UnsupportedOpError', 'check_opset', 'converter', 'export_schedule',
           'sanitize_name', 'save_onnx', 'schedule_to_onnx', 'supported_kinds']
