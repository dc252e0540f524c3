"""Smoke test of the kit of real models (benchmarks/kit/): two of its
cases trained three steps next to their undecorated twins must stay equal
bit for bit, and replay. The kit itself is run by benchmarks/kit_run.py
(docs/kit.md); no timing is checked here."""
import pytest

from benchmarks import kit
from benchmarks.kit import common
from benchmarks.kit import runner
from benchmarks.kit import text_classification


@pytest.mark.parametrize('name', ['vae', 'memnn', 'mnist-custom-loop'])
def test_kit_case_trains_bit_for_bit_and_replays(name):
    # (mnist-custom-loop: its evaluation, backprop on, replays too.)
    case = kit.make(name)
    r = runner.run_case(case, steps=3, warmup=1)
    assert r['error'] is None, r['error']
    assert r['steps'] == 3
    assert r['equal'], r['first_mismatch']
    assert r['replays'] > 0 and r['fallback_calls'] == 0, r['reasons']
    assert not r['reasons'] and not r['warnings']


def test_kit_reports_a_fallback_and_its_reason(monkeypatch):
    """The kit's counters see a fallback: the text classifier's
    bag-of-words encoder divides by an array of the sentences' lengths
    made in the forward (``xp.array([len(x) for x in xs])``), which
    Chainer casts before ``Div``: an array no Chainer function made.
    (The same lengths in every batch, so that the second call is of the
    same key.)"""
    monkeypatch.setattr(common, 'lengths', lambda rs, n, lo, hi: [
        lo + i % 3 for i in range(n)])
    r = runner.run_case(text_classification.make_case('bow'), steps=2,
                        warmup=1)
    assert r['equal'], r['first_mismatch']
    assert r['fallback_calls'] == 1 and r['replays'] == 0
    assert r['reasons'] and r['warnings']
    assert 'enters Div' in r['reasons'][0]


def test_the_padded_cnn_encoder_replays():
    """The text classifier's CNN encoder pads its sentences in the forward
    with ``concat_examples(xs, padding=-1)``: one op of the schedule
    (numpy_calls.PURE), so its calls of one length replay, equal to
    define-by-run."""
    r = runner.run_case(kit.make('textclass-cnn-fixed'), steps=3, warmup=1)
    assert r['equal'], r['first_mismatch']
    assert r['replays'] == 2 and r['fallback_calls'] == 0
    assert not r['reasons'] and not r['warnings']


def test_the_vae_loss_replays_its_latent_draw():
    """The VAE's whole loss decorated draws its latent sample from NumPy's
    global generator inside ``q_z.sample`` (chainer.distributions): the
    draw and the cast after it are ops of the schedule (numpy_calls.py),
    so every call after the first replays, equal to define-by-run."""
    r = runner.run_case(kit.make('vae-loss'), steps=4, warmup=1)
    assert r['equal'], r['first_mismatch']
    assert r['replays'] == 3 and r['fallback_calls'] == 0
    assert not r['reasons'] and not r['warnings']


def test_every_case_is_registered_under_its_name():
    assert len(set(kit.NAMES)) == len(kit.NAMES)
    for name in kit.NAMES:
        assert kit.make(name).name == name


def test_seq2seq_with_new_lengths_runs_its_nstep_loops_bit_for_bit(
        monkeypatch):
    """Chainer's seq2seq (an NStepLSTM encoder handing its states to an
    NStepLSTM decoder) on batches of new lengths: past the recordings of
    new keys its calls run define-by-run with each NStep LSTM as one node
    (static_graph/nstep_loop.py), and every step stays equal to the
    undecorated twin's, bit for bit."""
    from static_graph import nstep_loop
    loops = []
    forward = nstep_loop.NStepLoop.forward
    monkeypatch.setattr(nstep_loop.NStepLoop, 'forward',
                        lambda self, inputs: loops.append(1) or
                        forward(self, inputs))
    r = runner.run_case(kit.make('seq2seq-var'), steps=11, warmup=1)
    assert r['error'] is None, r['error']
    assert r['equal'], r['first_mismatch']
    assert r['fallback_calls'] >= 2 and loops
