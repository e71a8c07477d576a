#!/usr/bin/env bash
# The GPU machine's run for kvstate across processes: the CUDA IPC and PD-split tests, the
# rest of the GPU suite, and the 8k-token handoff through rank-worker processes. From the repo
# root, with wheels of transitions, simpy, pyzmq, mooncake-transfer-engine and
# nvidia-cuda-runtime-cu12 in .whl/ and the .deb files of libibverbs1 ibverbs-providers
# libnl-3-200 libnl-route-3-200 in .dev/debs/ (git-ignored, carried by the device tool).
set -o pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/ib && for f in .dev/debs/*.deb; do dpkg -x "$f" /tmp/ib; done
export LD_LIBRARY_PATH=/tmp/ib/usr/lib/x86_64-linux-gnu:/tmp/ib/usr/lib/x86_64-linux-gnu/libibverbs:/tmp/site/nvidia/cuda_runtime/lib:${LD_LIBRARY_PATH:-}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
df -h /dev/shm /tmp | tee "$OUT/disk.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_cuda_ipc.py} 2>&1 | tee "$OUT/tests.log"
python3 benchmarks/handoff_procs.py ${HANDOFF_ARGS:-} --out "$OUT/handoff_procs.json" 2>&1 | tee "$OUT/handoff_procs.log"
