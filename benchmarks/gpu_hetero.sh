#!/usr/bin/env bash
# The GPU machine's run for P and D of different TP degrees: the GPU tests that move blocks,
# the heterogeneous handoff beside the same-TP one, and the 8k-token handoff's checksum cost.
# From the repo root, with the wheels of transitions, simpy, pyzmq and xxhash in .dev/whl/
# (git-ignored, carried by the device tool). Results go to $OUT (default ./results).
set -o pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"; date -u | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu ${PYTEST_ARGS:-tests/} 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
timeout 200 python3 benchmarks/hetero_handoff.py --json "$OUT/hetero.json" 2>&1 | tee "$OUT/hetero.log"
timeout 200 python3 benchmarks/kernels.py --sections limits,handoff --out "$OUT/kernels.json" 2>&1 | tail -3 | tee "$OUT/kernels.log"
