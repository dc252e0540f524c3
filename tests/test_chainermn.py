"""ChainerMN inside decorated methods, with two processes under MPI
(``mpiexec.gforker``, shared memory only: no network socket is opened).
Skipped where mpi4py or MPICH's launcher is missing."""
import json
import os
import shutil
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


def run(tmp_path, program, *args, n=2, timeout=120):
    """What each rank wrote (``OUT/rank<N>.json``), by rank."""
    tmp_path.mkdir()
    env = dict(os.environ, UCX_TLS='self,sm', UCX_NET_DEVICES='lo',
               PYTHONUNBUFFERED='1', OMP_NUM_THREADS='1',
               OPENBLAS_NUM_THREADS='1')
    proc = subprocess.run(
        [LAUNCHER, '-n', str(n), sys.executable, os.path.join(HERE, 'mpi',
                                                              program)]
        + list(args) + [str(tmp_path)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, timeout=timeout, universal_newlines=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = {}
    for rank in range(n):
        with open(os.path.join(str(tmp_path), 'rank%d.json' % rank)) as f:
            out[rank] = json.load(f)
    return out


def test_send_and_recv_inside_decorated_methods(tmp_path):
    """Rank 0's layer gets its gradient from rank 1 (it got none: replay
    skipped the backward of send's output, which has no elements, and of
    recv, on no path to a parameter; the processes then waited for each
    other); both ranks train bit for bit like define-by-run, replaying."""
    dbr = run(tmp_path / 'dbr', 'p2p.py', 'dbr')
    static = run(tmp_path / 'static', 'p2p.py', 'static')
    for rank in (0, 1):
        assert static[rank]['steps'] == dbr[rank]['steps'], rank
        counts = static[rank]['counts']
        assert counts['recordings'] == 1 and counts['replays'] == 5 and \
            counts['fallback_calls'] == 0, counts
