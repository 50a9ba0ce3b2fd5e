#!/usr/bin/env bash
# The GPU run of issue 5 (part 5.5), prepared to fit one call of the device tool (~6-8 min on an H200).
#
# The device machine has PyTorch, Triton and older transformers/peft, and no network: carry the
# versions we test as wheels. Once, here, in the repository root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl transformers==5.24.0 peft==0.21.2
# then: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=590)
#
# 1. correctness on the GPU: the Triton kernels against the reference, and greedy decoding with
#    CUDA graphs equal to eager and to stock PEFT (tests that skip on a CPU machine);
# 2. decoding speed, bf16: SmolLM2-135M's shape with random weights and 16 random adapters (the
#    zoo's files cannot travel; acceptance is synthetic and reported), batch 8/32/64, 8/16
#    distinct adapters, stock PEFT / baseline / k = 1, 2, 4 / gate, eager and CUDA graphs.
# Logs and JSON land in $OUT (the device tool brings them back).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --target /tmp/site .whl/*.whl . \
    || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"

timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_compiled.py -k "cuda or triton" \
    2>&1 | tee "$OUT/tests.log"

timeout 400 python3 benchmarks/bench_decoding.py --synthetic --strength "${STRENGTH:-0.3}" --device cuda \
    --dtype bfloat16 --batches 8 32 64 --adapter-counts 8 16 --new-tokens 64 --repeats 3 \
    --configs stock_peft k1 k2 k4 gate baseline_compiled k2_compiled gate_compiled --out "$OUT" \
    2>&1 | tee "$OUT/bench.log"
