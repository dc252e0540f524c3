"""Record a Chainer Chain's method once, replay it as a static schedule.

    from static_graph import static_graph

    class MLP(chainer.Chain):
        @static_graph
        def forward(self, x):
            ...

``explain(chain)`` and ``cached(chain)`` show what was recorded and why a
call fell back; ``capture_update(optimizer)`` (one line after
``optimizer.setup(model)``) runs the optimizer's update as captured in-place
kernels split across threads, bit for bit Chainer's (``explain_update``,
``update_schedule``); ``export_onnx(chain, args, path)`` writes the inference
schedule as an ONNX model.
"""
from static_graph import chainer_import as _chainer_import

_chainer_import.prepare()   # Chainer 7.8.1 on Python 3.12+ and NumPy 2

from static_graph import compat as _compat  # NOQA (after prepare)
from static_graph.decorator import static_graph  # NOQA
from static_graph.diagnostics import StaticGraphWarning  # NOQA
from static_graph.diagnostics import logger  # NOQA
from static_graph.inspect import cached, explain  # NOQA
from static_graph.update import capture_update  # NOQA
from static_graph.update import explain_update  # NOQA
from static_graph.update import update_schedule  # NOQA

if _compat.UNSUPPORTED is None:
    from static_graph.export import export_onnx  # NOQA
else:
    def export_onnx(*args, **kwargs):
        """Unavailable: this Chainer cannot be recorded."""
        raise RuntimeError('export_onnx needs a recorded schedule: %s'
                           % _compat.UNSUPPORTED)

__all__ = ['static_graph', 'StaticGraphWarning', 'logger', 'cached',
           'explain', 'export_onnx', 'capture_update', 'explain_update',
           'update_schedule']
