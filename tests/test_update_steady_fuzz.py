"""The captured update's steady path on fake CuPy against reading every
step in full, over the random cases of tests/update_fuzz.py (driven by
tests/update_steady_fuzz.py): a fixed run in CI; the long run is
``benchmarks/fuzz_update.py --steady``."""
import pytest

from static_graph import update_cupy_steady
from tests import update_fuzz
from tests import update_steady_fuzz

CI_CASES = 150


def _run(n):
    results = update_fuzz.run_cases(update_steady_fuzz, n)
    return sum(r.steps for r in results), sum(r.steady for r in results)


def test_steady_path_fuzz():
    steps, steady = _run(CI_CASES)
    # The steady path was taken often enough for the comparison to mean
    # something.
    assert steps > 3 * CI_CASES and steady > 0.05 * steps, (steps, steady)


def test_the_fuzz_finds_a_steady_path_that_skips_a_check(monkeypatch):
    """A template that takes a parameter's new array for the old one is
    caught."""
    real = update_cupy_steady._plain

    def fits(self, structure):
        if structure is not self.structure:
            return False
        for p, rule, enabled, a, gw, state, arrays in self.checks:
            if rule.enabled != enabled or (enabled and (
                    p.grad is None or not real(p, rule, p.array))):
                return False
        return True
    monkeypatch.setattr(update_cupy_steady.Steady, 'fits', fits)
    with pytest.raises(pytest.fail.Exception):
        _run(CI_CASES)
