"""Differential fuzzing: random chains and call patterns, define-by-run vs
static twin (grammar and comparison in tests/fuzz_grammar.py).

CI runs a bounded, derandomized number of examples; the long run is
``.venv/bin/python benchmarks/fuzz.py --examples 5000`` (see its --help).
"""
import warnings

import numpy
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import chainer

from tests import fuzz_grammar as grammar

CI_EXAMPLES = 100

# Derandomized: the same examples on every run. No shrinking and stop at the
# first failure to stay fast; benchmarks/fuzz.py shrinks to a minimal
# example.
CI_SETTINGS = settings(
    max_examples=CI_EXAMPLES, deadline=None, database=None,
    derandomize=True, print_blob=True, report_multiple_bugs=False,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck))


def test_differential_fuzz():
    stats = grammar.Stats()

    @CI_SETTINGS
    @given(grammar.examples())
    def prop(example):
        prog, seq, seed = example
        grammar.check_example(prog, seq, seed, stats)

    try:
        prop()
    finally:
        print('\n' + stats.summary())
    assert stats.examples >= CI_EXAMPLES // 2
    # the twins really replayed, not only recorded
    assert stats.replays > stats.examples


def test_fuzz_float64_only_long_chains():
    """Deeper chains in float64 (tight tolerance)."""
    stats = grammar.Stats()

    @settings(CI_SETTINGS, max_examples=10)
    @given(grammar.examples(dtypes=('float64',), max_layers=10,
                            fallback_ops=False))
    def prop(example):
        prog, seq, seed = example
        grammar.check_example(prog, seq, seed, stats)

    try:
        prop()
    finally:
        print('\n' + stats.summary())
    assert stats.examples >= 10 and stats.replays > stats.examples


@settings(CI_SETTINGS, max_examples=30)
@given(grammar.programs())
def test_grammar_builds_runnable_chains(prog):
    """Sanity of the grammar itself: every drawn program runs
    define-by-run and its source is what ``repr`` shows."""
    net, static_net = prog.classes()
    with chainer.using_config('dtype', numpy.dtype(prog.dtype)):
        m = net()
    x = numpy.zeros((2,) + prog.in_shape, prog.dtype)
    t = numpy.zeros(2, numpy.int32)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        out = m(x, t) if prog.head == 'ce' else m(x)
    loss = out[0] if isinstance(out, tuple) else (
        out['loss'] if isinstance(out, dict) else out)
    loss = getattr(loss, 'loss', loss)     # (a Holder of the loss)
    assert loss.shape == ()
    assert prog.source in repr(prog)


@settings(CI_SETTINGS, max_examples=20)
@given(st.data())
def test_steps_are_well_formed(data):
    seq = data.draw(grammar.steps())
    for s in seq:
        assert s.batch in grammar.BATCH_SIZES
        if s.mode in ('eval', 'forward_only'):
            assert not s.update
