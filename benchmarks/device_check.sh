#!/usr/bin/env bash
# The GPU checks, in one call on a lent GPU machine (Python 3.12, NumPy 2,
# CuPy 14, no Chainer): install the carried Chainer wheel, make it import
# (python -m static_graph.chainer_import --install), then the GPU tests, the
# GPU benchmark and the main job on @cupy:0. Logs and results go to $OUT
# (or ./device_out). Each step has its own time limit, so one that hangs
# leaves the others their time; the limits of the default steps add up to
# 590 s (on an H200, 2026-11-27, they took about 150 s; 190 s with the
# steady update fuzzer and the main job's phases), under the device
# tool's 600 s a command (run it with timeout_s=600;
# a machine's start is not counted there but is in the session's budget).
#
#   (here)  pip wheel --no-deps --no-build-isolation chainer==7.8.1 -w .whl
#   (there) bash benchmarks/device_check.sh            # carry: .whl
#
# STEPS picks steps (default "probe tests fuzz_update bench main profile",
# the last where a replayed step's host time goes, benchmarks/gpu_profile.py,
# the main job's, benchmarks/main_job_phases.py, and a capture's,
# benchmarks/capture_time.py;
# "fuzz", the GPU differential fuzzer, 150 s, where time is left);
# BENCH_CASES the benchmark's cases.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"probe tests fuzz_update bench main profile"}
PY=${PY:-python3}

log() { echo "== $* ($(date +%T))"; }

log setup
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site .whl/chainer-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
$PY -m static_graph chainer-import --install
$PY - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import sys, platform
import chainer, numpy, cupy
print('python', platform.python_version(), 'chainer', chainer.__version__,
      'numpy', numpy.__version__, 'cupy', cupy.__version__)
print(cupy.cuda.runtime.getDeviceProperties(0)['name'].decode(),
      'CUDA runtime', cupy.cuda.runtime.runtimeGetVersion())
print('numpy.distutils imported:', 'numpy.distutils' in sys.modules,
      'numpy.sctypes:', hasattr(numpy, 'sctypes'))
EOF

for step in $STEPS; do
  case $step in
  probe)
    log probe
    timeout 30 $PY - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
# Can CuPy capture what a schedule does: a matmul, an elementwise kernel,
# a reduction, allocations from a private pool?
import cupy
from schedules import cuda_graph
b = cuda_graph.CupyBackend()
w = cupy.random.rand(64, 64, dtype='f')
x = cupy.random.rand(8, 64, dtype='f')
def run(args):
    x, w = args
    h = cupy.maximum(x.dot(w), 0)
    return h, h.sum()
g, outs, keep = b.capture(run, (x, w))
b.launch(g)
want = run((x, w))
print('capture probe: equal', all(b.same(o, r) for o, r in zip(outs, want)))
try:
    b.capture(lambda a: (a[0] * float(a[0].sum()),), (x,))
    print('host read probe: captured (unexpected)')
except cuda_graph.NotCapturable as e:
    print('host read probe: refused:', e)
try:
    b.capture(lambda a: (a[0] * cupy.random.rand(*a[0].shape, dtype='f'),),
              (x,))
    print('random probe: captured (unexpected)')
except cuda_graph.NotCapturable as e:
    print('random probe: refused:', e)
try:
    import numpy
    b.capture(lambda a: (a[0] + cupy.asarray(numpy.ones(64, 'f')),), (x,))
    print('host copy probe: captured (unexpected)')
except cuda_graph.NotCapturable as e:
    print('host copy probe: refused:', e)
EOF
    ;;
  tests)
    log tests
    # The captured optimizer update on CuPy first (small parameters, few
    # steps).
    timeout 90 $PY -m pytest -q -p no:cacheprovider \
        tests/test_captured_update_gpu.py tests/test_captured_update_cuda.py \
        tests/test_captured_update_fake_gpu.py 2>&1 \
        | tee "$OUT/tests.txt" | tail -25
    timeout 70 $PY -m pytest -q -p no:cacheprovider \
        tests/test_cuda_graph.py tests/test_cupy.py tests/test_outputs.py \
        tests/test_real_code.py tests/test_chainer_examples.py 2>&1 \
        | tee -a "$OUT/tests.txt" | tail -25
    ;;
  fuzz_update)
    log fuzz_update
    # The captured update against Chainer's CuPy update, random set-ups;
    # then with steps like the one before (the steady path).
    timeout 35 $PY benchmarks/fuzz_update.py --device @cupy:0 --minutes 0.4 \
        --seed 1 --quiet > "$OUT/fuzz_update.txt" 2>&1
    echo "exit status $?" >> "$OUT/fuzz_update.txt"
    timeout 35 $PY benchmarks/fuzz_update.py --device @cupy:0 --minutes 0.4 \
        --steady --seed 2 --quiet >> "$OUT/fuzz_update.txt" 2>&1
    echo "exit status $?" >> "$OUT/fuzz_update.txt"
    grep -E "DIVERGED|cases,|steady path|exit status" "$OUT/fuzz_update.txt"
    ;;
  bench)
    log bench
    timeout 110 $PY benchmarks/gpu.py --device @cupy:0 \
        --json "$OUT/gpu.json" ${BENCH_CASES:+--cases $BENCH_CASES} 2>&1 \
        | tee "$OUT/bench.txt"
    ;;
  main)
    log main job
    timeout 45 $PY examples/mnist/train_mnist.py --compare \
        --device @cupy:0 2>&1 | tee "$OUT/main.txt" | tail -8
    # L.Classifier's loss and accuracy in the static graph too.
    log main job, --static-loss
    timeout 35 $PY examples/mnist/train_mnist.py --compare --static-loss \
        --device @cupy:0 2>&1 | tee "$OUT/main_static_loss.txt" | tail -3
    ;;
  profile)
    log profile
    timeout 35 $PY benchmarks/gpu_profile.py --device @cupy:0 \
        --case mlp-b8-adam-capture --steps 1000 --top 40 \
        > "$OUT/profile.txt" 2>&1
    grep -E "^(dbr|graph) " "$OUT/profile.txt"
    # The main job's iteration, phase by phase (what stays outside).
    timeout 35 $PY benchmarks/main_job_phases.py --device @cupy:0 \
        --steps 500 >> "$OUT/profile.txt" 2>&1
    grep -E "^(define-by-run|static|round) " "$OUT/profile.txt"
    timeout 35 $PY benchmarks/main_job_phases.py --device @cupy:0 \
        --steps 500 --static-loss > "$OUT/phases_static_loss.txt" 2>&1
    grep -E "^(define-by-run|static|round) " "$OUT/phases_static_loss.txt"
    # What a capture costs, in a fresh process and a warm one.
    timeout 35 $PY benchmarks/capture_time.py --device @cupy:0 --twins 2 \
        >> "$OUT/profile.txt" 2>&1
    grep -E "^twin " "$OUT/profile.txt"
    ;;
  fuzz)
    log fuzz
    timeout 150 $PY benchmarks/fuzz.py --device @cupy:0 --capture-early \
        --max-steps 7 --minutes 1.5 --chunk 50 --quiet --seed 1931 2>&1 \
        | tee "$OUT/fuzz.txt" | tail -8
    ;;
  esac
done
log done
