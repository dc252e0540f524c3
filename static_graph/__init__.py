"""Record a Chainer Chain's method once, replay it as a static schedule.

    from static_graph import static_graph

    class MLP(chainer.Chain):
        @static_graph
        def forward(self, x):
            ...
"""
from static_graph.diagnostics import StaticGraphWarning  # NOQA
from static_graph.diagnostics import logger  # NOQA
from static_graph.decorator import static_graph  # NOQA

__all__ = ['static_graph', 'StaticGraphWarning', 'logger']
from static_graph.inspect import cached, explain  # NOQA

__all__ += ['cached', 'explain']
from static_graph.export import export_onnx  # NOQA

__all__ += ['export_onnx']
