"""Differential fuzzing of the captured optimizer update (cases in
tests/update_fuzz.py): a fixed run of cases in CI, bit for bit against
Chainer's update; the long run is ``benchmarks/fuzz_update.py``."""
import numpy
import pytest

from static_graph import update_readers
from tests import update_fuzz

CI_CASES = 120


def test_captured_update_fuzz():
    results = update_fuzz.run_cases(update_fuzz, CI_CASES)
    steps = sum(r.steps for r in results)
    captured = sum(r.captured for r in results)
    # Most steps ran the captured update (only float16 without
    # use_fp32_update falls back on NumPy): the comparison compared it.
    assert steps > 3 * CI_CASES and captured > 0.8 * steps


def test_the_fuzz_finds_a_wrong_update(monkeypatch):
    """A captured SGD that reads a learning rate a little off is caught."""
    sgd_class = next(c for c in update_readers.RULES
                     if c.__name__ == 'SGDRule')
    right = update_readers.RULES[sgd_class]

    def wrong(rule, dtype):
        kernel, values = right(rule, dtype)[:2]
        values = tuple(numpy.nextafter(v, 1) if isinstance(v, float) else v
                       for v in values)
        return (kernel, values) + tuple(right(rule, dtype)[2:])
    monkeypatch.setitem(update_readers.RULES, sgd_class, wrong)
    case = next(c for c in (update_fuzz.make_case(0, i) for i in range(200))
                if c['rule'] == 'SGD' and c['dtype'] in ('float32',
                                                         'float64'))
    with pytest.raises(AssertionError):
        update_fuzz.run_case(case)
