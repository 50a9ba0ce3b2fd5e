#!/usr/bin/env bash
# The GPU check: one call of the device tool that tests and times the GPU path (~7 min on an H200).
#
# The device machine has PyTorch, Triton, pytest and older transformers/peft, and no network: carry
# the versions we test as wheels. Once, here, in the repository root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl transformers==5.24.0 peft==0.21.2
# then: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=590)
#
# Rehearse the plumbing here first, on the CPU (no GPU, no wheels: the venv's packages, a tiny model):
#   bash benchmarks/gpu_check.sh --dry-run            (tests/test_gpu_check.py runs it)
#
# 1. installs the project from a copy of this tree into a separate folder (as a user would get it)
#    and runs the tests against that installed package (python -P: the source folder stays off
#    sys.path, so the installed copy is what runs), the CUDA-graph tests first (a cold Triton cache
#    compiles every kernel on first use);
# 2. times decoding in bf16 on SmolLM2-135M's shape with 16 random adapters (the zoo's files cannot
#    travel; acceptance is synthetic and reported): batch 8/32/64, 8/16 distinct adapters, the
#    baseline, k = 2 and the gate eager and with CUDA graphs, stock PEFT at batch 8 only (its
#    per-adapter loop syncs with the host about three times per adapter and module); each configuration on its own (an error is recorded,
#    the others go on) and the results written after every measurement.
# Everything lands in $OUT, which the device tool brings back.
set -uo pipefail
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=$(mktemp -d)
SRC=$(mktemp -d)
if [ $DRY = 1 ]; then
    PY=${PYTHON:-python3}
    WHEELS=""
    DEVICE=cpu; DTYPE=float32; T_TESTS=300; T_BENCH=300
    BENCH=(--smoke --stock-batches 1)
else
    PY=python3
    WHEELS=.whl/*.whl
    DEVICE=cuda; DTYPE=bfloat16; T_TESTS=240; T_BENCH=300
    BENCH=(--synthetic --strength "${STRENGTH:-0.3}" --batches 8 32 64 --adapter-counts 8 16 --new-tokens 64
           --repeats 2 --stock-batches 8 --configs stock_peft base_model k2 gate baseline_compiled k2_compiled gate_compiled)
fi

# A copy of the tree without environments and build leftovers, installed from there.
tar --exclude=./.git --exclude=./.venv --exclude=./.whl --exclude=./build --exclude='*.egg-info' \
    --exclude=__pycache__ -cf - . | tar -xf - -C "$SRC" || exit 1
$PY -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --target "$SITE" $WHEELS "$SRC" \
    > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
export PYTHONPATH=$SITE
$PY -P -c "import hf_invisiblelora, hf_invisiblelora.kernels, torch, transformers, peft
print('hf_invisiblelora from', hf_invisiblelora.__file__)
print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)
print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee "$OUT/versions.txt"
grep -q "from $SITE/hf_invisiblelora" "$OUT/versions.txt" || { echo "not the installed package"; exit 1; }

# CUDA graphs first: their tests pay the cold Triton compile; then the kernels against the reference.
timeout $((T_TESTS / 2)) $PY -P -m pytest -q -p no:cacheprovider tests/test_compiled.py -k cuda \
    2>&1 | tee "$OUT/tests_cuda_graphs.log"
timeout $((T_TESTS / 2)) $PY -P -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "triton" \
    2>&1 | tee "$OUT/tests_kernels.log"

timeout $T_BENCH $PY benchmarks/bench_decoding.py --device $DEVICE --dtype $DTYPE --no-extras --no-sampling \
    "${BENCH[@]}" --out "$OUT" 2>&1 | tee "$OUT/bench.log"
echo "gpu_check done: $OUT"
