import pytest

from static_graph import diagnostics


@pytest.fixture(autouse=True)
def fresh_warnings():
    """Each test sees the library's warn-once warnings afresh."""
    diagnostics.reset_warnings()
    yield
