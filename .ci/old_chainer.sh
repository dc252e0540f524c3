#!/usr/bin/env bash
# The library and the examples on Chainers without static-graph support:
# for each old Chainer, a fresh venv, then .ci/old_chainer_check.py (the
# decorator is a pass-through that warns once and trains identically), the
# MNIST example (MLP and CNN) and the ImageNet example (one arch), each of
# which must run and say it ran define-by-run.  One line per check.
# Run from the repository root.  PYTHON overrides the interpreter (3.11).
set -euo pipefail

PYTHON=${PYTHON:-python3}
VERSIONS=(4.5.0 6.7.0)
export PIP_DISABLE_PIP_VERSION_CHECK=1

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# run NAME EXPECT CMD...: run CMD, quietly; print one line (the last line
# matching EXPECT); on failure or no match, print the output's tail and stop.
run() {
    local name=$1 expect=$2 log="$tmp/log"
    shift 2
    local rc=0 line
    "$@" >"$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        tail -n 30 "$log"
        echo "FAIL  $name (exit status $rc)"
        exit 1
    fi
    line=$(sed 's/\x1b\[[0-9;]*[A-Za-z]//g' "$log" | grep -F -- "$expect" \
           | tail -n 1 || true)
    if [ -z "$line" ]; then
        tail -n 30 "$log"
        echo "FAIL  $name (no line with: $expect)"
        exit 1
    fi
    echo "ok    $name: $line"
}

start=$SECONDS
for v in "${VERSIONS[@]}"; do
    venv="$tmp/chainer-$v"
    py="$venv/bin/python"
    t0=$SECONDS
    run "chainer $v: venv" "chainer $v" bash -c '
        set -euo pipefail
        "$1" -m venv "$2"
        "$2/bin/pip" install -q "setuptools<70" wheel "numpy<2"
        "$2/bin/pip" install -q --no-build-isolation "chainer==$3" scikit-learn
        if [ "$3" = 6.7.0 ]; then
            "$2/bin/pip" install -q "typing_extensions>=4"
        fi
        "$2/bin/python" -c "import chainer; print(\"chainer\", chainer.__version__)"
    ' _ "$PYTHON" "$venv" "$v"
    echo "      (set-up $((SECONDS - t0)) s)"

    run "chainer $v: old_chainer_check.py" "pass-through" \
        "$py" .ci/old_chainer_check.py
    label="[define-by-run: static_graph unavailable on chainer $v]"
    for model in mlp cnn; do
        run "chainer $v: mnist $model" "$label final validation" \
            "$py" examples/mnist/train_mnist.py --model "$model" \
            --iterations 3 --out "$tmp/mnist-$v-$model"
    done
    run "chainer $v: imagenet resnet50" "$label final validation" \
        "$py" examples/imagenet/train_imagenet.py --arch resnet50 \
        --insize 32 --batchsize 4 --iterations 2 --out "$tmp/imagenet-$v"
done
echo "old Chainers (${VERSIONS[*]}): all checks passed in $((SECONDS - start)) s"
