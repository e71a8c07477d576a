#!/usr/bin/env bash
# The GPU machine's run for checksummed stores: the GPU tests, the 8k-token handoff with and
# without checksums, the embedded stores against memory bandwidth, the host hash, the checksum
# work timed inside the handoff.
# From the repo root, with the wheels of transitions, simpy, pyzmq and xxhash in .dev/whl/
# (git-ignored, carried by the device tool). Results go to $OUT (default ./results).
set -o pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.txt"
nproc | tee -a "$OUT/gpu.txt"; date -u | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ ${PYTEST_ARGS:-} 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
timeout 120 python3 benchmarks/store_speed.py --json "$OUT/store_speed.json" 2>&1 | tee "$OUT/store_speed.log"
timeout 60 python3 benchmarks/integrity_soak.py --hash --json "$OUT/hash.json" 2>&1 | tee "$OUT/hash.log"
timeout 200 python3 benchmarks/kernels.py --sections limits,handoff --out "$OUT/kernels.json" 2>&1 | tail -8 | tee "$OUT/kernels.log"
timeout 120 python3 benchmarks/checksum_work.py --json "$OUT/checksum_work.json" 2>&1 | tail -12 | tee "$OUT/checksum_work.log"
