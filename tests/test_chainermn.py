"""ChainerMN training with static chains, two processes under MPI
(``mpiexec.gforker``, shared memory only: no network socket is opened).
Skipped where mpi4py or MPICH's launcher is missing."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _launcher():
    try:
        import mpi4py  # NOQA
    except Exception as e:
        return None, 'mpi4py is not installed (%s)' % type(e).__name__
    for d in (os.path.dirname(sys.executable), None):
        path = shutil.which('mpiexec.gforker', path=d)
        if path:
            return path, None
    return None, 'no mpiexec.gforker (MPICH) on the PATH'


LAUNCHER, REASON = _launcher()
pytestmark = pytest.mark.skipif(LAUNCHER is None, reason=str(REASON))


def bounded(command, env, timeout, cwd=None):
    """``command``'s output; it fails the test where it exits with an
    error or runs past ``timeout`` seconds (a deadlock), and leaves no
    process behind: the launcher and its ranks are one process group,
    killed as one."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, universal_newlines=True,
                            start_new_session=True, cwd=cwd)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        pytest.fail('%s ran past %d s (a rank waits for another?):\n%s'
                    % (' '.join(map(os.path.basename, command[:5])),
                       timeout, stdout[-3000:]))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stdout[-3000:]
    return stdout


def run(tmp_path, program, *args, n=2, timeout=120):
    """What each rank wrote (``OUT/rank<N>.json``), by rank."""
    tmp_path.mkdir()
    env = dict(os.environ, UCX_TLS='self,sm', UCX_NET_DEVICES='lo',
               PYTHONUNBUFFERED='1', OMP_NUM_THREADS='1',
               OPENBLAS_NUM_THREADS='1')
    bounded(
        [LAUNCHER, '-n', str(n), sys.executable, os.path.join(HERE, 'mpi',
                                                              program)]
        + list(args) + [str(tmp_path)], env, timeout)
    out = {}
    for rank in range(n):
        with open(os.path.join(str(tmp_path), 'rank%d.json' % rank)) as f:
            out[rank] = json.load(f)
    return out


# Scenarios of tests/mpi/mn.py run by one launch per mode (each launch
# costs a few seconds of process start): recordings and replays expected of
# each rank's static chains over its 6 training steps (the evaluator's
# predictor: one recording for training, one for evaluation, then 5 + 5
# replays: 3 evaluations of 2 batches).
SCENARIOS = {
    'sgd': {'MLP.forward': (1, 5)},
    'adam': {'MLP.forward': (1, 5)},
    'mnbn': {'BNMLP.forward': (1, 5)},
    'allgather': {'Gathered.forward': (1, 5)},
    'evaluator': {'Predictor.forward': (2, 10)},
    'p2p': ({'First.forward': (1, 5)}, {'Second.forward': (1, 5)}),
    'bcast': {'Broadcast.forward': (1, 5)},
    # (recordings, replays, define-by-run calls): comm.allreduce in the
    # method (communicator_calls.py)
    'normalized': {'Normalized.forward': (1, 0, 5)},
}
DATA_PARALLEL = ('sgd', 'adam', 'mnbn', 'allgather', 'evaluator',
                 'normalized')

# The captured optimizer update (static_graph.capture_update): scenarios
# of tests/mpi/mn.py that run a scenario above with
# capture_update(multi_node_optimizer) in static mode, each compared with
# that scenario's define-by-run run.
CAPTURED_UPDATE = {'sgd+update': 'sgd', 'adam+update': 'adam'}


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """{mode: {rank: {scenario: result}}}, both modes, every scenario."""
    base = tmp_path_factory.mktemp('mn')
    names = ','.join(SCENARIOS)
    return dict((mode, run(base / mode, 'mn.py', mode, names))
                for mode in ('dbr', 'static'))


def expected_counts(name, rank):
    want = SCENARIOS[name]
    if isinstance(want, tuple):
        want = want[rank]
    return dict((method, {'recordings': n[0], 'replays': n[1],
                          'fallback_calls': n[2] if len(n) > 2 else 0})
                for method, n in want.items())


def check_bit_for_bit(static, dbr, name, rank):
    assert len(dbr['steps']) == 6, dbr['steps']
    for i, (s, d) in enumerate(zip(static['steps'], dbr['steps'])):
        assert s == d, 'rank %d, step %d differs: %s' % (rank, i, sorted(
            k for k in d['state'] if s['state'].get(k) != d['state'][k]))
    assert len(static['steps']) == len(dbr['steps'])


@pytest.mark.parametrize('name', sorted(SCENARIOS))
def test_scenario_bit_for_bit_and_replays(runs, name):
    """Every rank's losses (or trainer observations), parameters and
    persistent arrays after each step are the bytes of define-by-run's,
    and the static chains recorded once per key and replayed after."""
    for rank in (0, 1):
        static = runs['static'][rank][name]
        dbr = runs['dbr'][rank][name]
        check_bit_for_bit(static, dbr, name, rank)
        assert static['counts'] == expected_counts(name, rank), rank
        assert dbr['counts'] is None


@pytest.mark.parametrize('name', DATA_PARALLEL)
def test_data_parallel_ranks_agree(runs, name):
    """The scenarios train: every step changes the parameters, the two
    ranks see different losses (their shards of the data) and end with
    the same parameters (the gradients were averaged over the ranks)."""
    for mode in ('dbr', 'static'):
        r0, r1 = (runs[mode][rank][name]['steps'] for rank in (0, 1))
        for a, b in zip(r0, r1):
            assert a['state'] == b['state'], (mode, name)
        states = [step['state'] for step in r0]
        assert all(a != b for a, b in zip(states, states[1:])), (mode, name)
        key = 'observation' if name == 'evaluator' else 'loss'
        assert [s[key] for s in r0] != [s[key] for s in r1]


def test_mnbn_running_statistics_are_global(runs):
    """MultiNodeBatchNormalization's running mean and variance are
    persistent arrays of the state compared step by step; they move and
    are the same on both ranks (the batch statistics were averaged)."""
    steps = [runs['static'][rank]['mnbn']['steps'] for rank in (0, 1)]
    keys = [k for k in steps[0][0]['state'] if k.startswith('persistent')]
    assert sorted(keys) == ['persistent /bn/avg_mean',
                            'persistent /bn/avg_var']
    for k in keys:
        assert steps[0][0]['state'][k] != steps[0][-1]['state'][k]
        assert [s['state'][k] for s in steps[0]] == \
            [s['state'][k] for s in steps[1]]


def test_evaluator_observations(runs):
    """The multi-node evaluator ran at iterations 2, 4 and 6 and reported
    the same (averaged) validation values on both ranks."""
    obs = [[s['observation'] for s in runs['static'][rank]['evaluator']
            ['steps']] for rank in (0, 1)]
    for rank in (0, 1):
        assert [sorted(k for k in o if k.startswith('validation/'))
                for o in obs[rank]] == [[], VALIDATION] * 3
    for o0, o1 in zip(obs[0][1::2], obs[1][1::2]):
        assert dict((k, o0[k]) for k in VALIDATION) == \
            dict((k, o1[k]) for k in VALIDATION)


VALIDATION = ['validation/main/accuracy', 'validation/main/loss']


@pytest.mark.parametrize('name', sorted(CAPTURED_UPDATE))
def test_captured_update_with_multi_node_optimizer(runs, tmp_path, name):
    """static_graph.capture_update(create_multi_node_optimizer(...)):
    bit for bit with the define-by-run run of the same scenario."""
    static = run(tmp_path / 'static', 'mn.py', 'static', name)
    base = CAPTURED_UPDATE[name]
    for rank in (0, 1):
        check_bit_for_bit(static[rank][name], runs['dbr'][rank][base],
                          name, rank)
        assert static[rank][name]['counts'] == expected_counts(base, rank)


def test_mnist_example_with_two_processes(tmp_path):
    """examples/mnist/train_mnist.py --communicator naive under two
    processes: it trains and both ranks print the same final accuracy
    (the multi-node evaluator averages it over the ranks), each on its
    half of the data; the per-epoch report comes from rank 0 only."""
    example = os.path.join(os.path.dirname(HERE), 'examples', 'mnist',
                           'train_mnist.py')
    stdout = bounded(
        [LAUNCHER, '-n', '2', sys.executable, example, '--communicator',
         'naive', '--iterations', '4', '--epoch', '1', '--batchsize', '20',
         '--out', str(tmp_path / 'result')],
        dict(os.environ, UCX_TLS='self,sm', UCX_NET_DEVICES='lo',
             OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1'), 120,
        cwd=str(tmp_path))
    found = re.findall(r'\[static graph, rank (\d) of 2\] final validation '
                       r'accuracy: ([0-9.]+) \(loss ([0-9.]+)\) after 4 '
                       r'iterations', stdout)
    assert sorted(rank for rank, _, _ in found) == ['0', '1'], stdout
    assert found[0][1:] == found[1][1:], found
    header = re.findall(r'^model: .*\((\d+) train / \d+ test\)',
                        stdout, re.M)
    assert len(header) == 1, stdout     # rank 0's, with its shard:
    assert 0 < int(header[0]) <= 30000, header   # half of the data set
    assert stdout.count('validation/main/accuracy') == 1, stdout
