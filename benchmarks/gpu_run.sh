#!/usr/bin/env bash
# The GPU machine's run: CUDA tests, the kernels, engine and host tier benchmarks beside the anchor
# baseline, the compute model fitted on a real model, and the layer-wise save and load.
# From the repo root, with the wheels of transitions and simpy in .whl/ and a copy of
# ../shared/anchors/swap_small.py in .dev/ (both git-ignored, carried by the device tool).
# Results go to $OUT (default ./results).
set -o pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# the optional C id packer, built for this Python (setup.py does it on a normal install)
python3 -c 'import subprocess, sysconfig as s; c = ["gcc", "-O2", "-shared", "-fPIC", "-I" + s.get_paths()["include"],
  "kvstate/kernels/_idpack.c", "-o", "kvstate/kernels/idpack" + s.get_config_var("EXT_SUFFIX")]; print(*c, "->", subprocess.run(c).returncode)' 2>&1 | tee "$OUT/idpack.log"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -m gpu tests/ ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log"
python3 benchmarks/kernels.py ${BENCH_ARGS:-} --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
ANCHOR_ARG=""; [ -f .dev/swap_small.py ] && ANCHOR_ARG="--anchor .dev/swap_small.py"
python3 benchmarks/engine.py $ANCHOR_ARG ${ENGINE_ARGS:-} --out "$OUT/engine.json" 2>&1 | tee "$OUT/engine.log"
if [ -f .dev/swap_small.py ] && [ -z "${NO_ANCHOR:-}" ]; then
  (cd "$OUT" && OUT=. python3 "$OLDPWD/.dev/swap_small.py") 2>&1 | tee "$OUT/anchor.log"
fi
python3 benchmarks/host_tier.py ${HOST_TIER_ARGS:-} --out "$OUT/host_tier.json" 2>&1 | tee "$OUT/host_tier.log"
python3 benchmarks/model_calibration.py ${CALIBRATION_ARGS:-} --out "$OUT/model_calibration.json" 2>&1 | tee "$OUT/model_calibration.log"
python3 benchmarks/layerwise.py ${LAYERWISE_ARGS:-} --out "$OUT/layerwise.json" 2>&1 | tee "$OUT/layerwise.log"
python3 benchmarks/memory_store.py --json > "$OUT/memory_store.json"
for rate in 2 4 6 8; do
  python3 benchmarks/engine_sim.py --rate $rate --out "$OUT/engine_sim_r$rate.json" 2>&1 | tee "$OUT/engine_sim_r$rate.log"
done
