"""static_graph.blas_idle: OpenBLAS's idle threads told to sleep soon.

What it changes is process-wide and done once per process, so every check
runs in a fresh interpreter."""
import json
import os
import subprocess
import sys
import textwrap

import numpy
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code, **env_extra):
    env = dict(os.environ)
    env.pop('OPENBLAS_THREAD_TIMEOUT', None)
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, '-c', textwrap.dedent(code)], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120,
        universal_newlines=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


_PROBE = '''
import ctypes, json, os
import static_graph
from static_graph import blas_idle
import numpy
rs = numpy.random.RandomState(0)
a = rs.rand(300, 300).astype(numpy.float32)
before = a @ a

def timeout():
    # NumPy's own OpenBLAS (others, SciPy's, may be loaded too)
    here = os.path.dirname(os.path.dirname(numpy.__file__))
    for path in blas_idle._loaded_openblas():
        if path.startswith(os.path.join(here, 'numpy')):
            fns = blas_idle._entry_points(path)
            return None if fns is None else fns[2]()
    return 'not found'

t0 = timeout()
said = %s
after = a @ a
print(json.dumps(dict(said=said, t0=t0, t1=timeout(),
                      same=bool((before == after).all()),
                      env=os.environ.get('OPENBLAS_THREAD_TIMEOUT'))))
'''


def _has_openblas():
    cfg = json.dumps(getattr(numpy, '__config__').__dict__.get(
        'CONFIG', {}), default=str)
    return 'openblas' in cfg.lower()


needs_openblas = pytest.mark.skipif(
    not sys.platform.startswith('linux') or not _has_openblas(),
    reason='NumPy here is not linked with OpenBLAS (or not on Linux)')


@needs_openblas
def test_quiet_sets_the_wait_and_changes_no_result():
    r = _run(_PROBE % 'blas_idle.quiet()')
    assert r['t0'] != 'not found'
    if r['t0'] is None:
        # NumPy 2's scipy-openblas keeps the entry points private
        assert 'left spinning' in r['said']
        assert r['same']
        return
    assert r['t0'] == 0               # unset: OpenBLAS's compiled default
    assert r['t1'] == 4
    assert r['same']                  # same bits from the restarted threads
    assert r['env'] is None           # the environment is left as it was
    assert 'sleep after 2**4 cycles' in r['said']


@needs_openblas
def test_a_users_setting_is_kept():
    r = _run(_PROBE % 'blas_idle.quiet()', OPENBLAS_THREAD_TIMEOUT='9')
    assert r['t1'] in (9, None)
    assert 'set by the user, kept' in r['said']


@needs_openblas
def test_captured_update_quiets_blas_at_its_first_split_step_only_if_asked():
    code = '''
    import json
    import static_graph
    from static_graph import blas_idle
    import numpy, chainer, chainer.links as L
    out = {}
    for quiet in (False, True):
        m = L.Linear(400, 300)
        for p in m.params():
            p.grad = numpy.ones(p.shape, numpy.float32)
        opt = chainer.optimizers.Adam()
        opt.setup(m)
        static_graph.capture_update(opt, threads=2, min_split=1,
                                    quiet_blas=quiet)
        opt.update()
        out[str(quiet)] = blas_idle.state()
        out['explain' + str(quiet)] = static_graph.explain_update(opt)
    print(json.dumps(out))
    '''
    r = _run(code)
    assert r['False'] is None
    assert 'OpenBLAS idle threads' not in r['explainFalse']
    assert r['True'] is not None
    assert 'OpenBLAS idle threads' in r['explainTrue']


def test_the_number_of_blas_threads_is_read(tmp_path):
    """numpy_blas_threads reads what OpenBLAS was told (None where the
    BLAS is not an OpenBLAS it can ask)."""
    import os
    import subprocess
    import sys
    code = ('import static_graph, numpy\n'
            'from static_graph import blas_idle\n'
            'print(blas_idle.numpy_blas_threads())\n')
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    seen = []
    for n in ('1', '2'):
        env = dict(os.environ, OPENBLAS_NUM_THREADS=n, PYTHONPATH=root)
        out = subprocess.run([sys.executable, '-c', code], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        seen.append(out.stdout.strip())
    # (OpenBLAS takes no more threads than the machine has cores)
    two = str(min(2, os.cpu_count() or 1))
    assert seen in (['1', two], ['None', 'None'])
