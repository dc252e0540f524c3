import os

import pytest

from static_graph import diagnostics


if os.environ.get('STATIC_GRAPH_FAKE_CUDA_GRAPH'):
    # The whole suite with every NumPy schedule replayed through the
    # CUDA-graph tier (tests/fake_cuda_graph.py): the tier's bookkeeping
    # (static results, copies out, saved activations read in place) must
    # keep every comparison with define-by-run.
    from static_graph import graphs
    from tests import fake_cuda_graph
    graphs.set_backend(fake_cuda_graph.FakeBackend())
    graphs.CAPTURE_AFTER = 0     # as early as possible: more captures


@pytest.fixture(autouse=True)
def fresh_warnings():
    """Each test sees the library's warn-once warnings afresh."""
    diagnostics.reset_warnings()
    yield


def pytest_terminal_summary(terminalreporter):
    if os.environ.get('STATIC_GRAPH_FAKE_CUDA_GRAPH'):
        b = graphs.backend()
        terminalreporter.write_line(
            'fake CUDA graphs: %d captured, %d launches' % (
                len(b.graphs), sum(g.launches for g in b.graphs)))
