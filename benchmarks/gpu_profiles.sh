#!/usr/bin/env bash
# The GPU machine's run that measures the shipped kernel profiles (kvstate profile) and a real
# graphed model's forwards to hold the compute model against. From the repo root, with wheels of
# transitions, simpy and pyzmq in .whl/ (git-ignored, carried by the device tool).
set -o pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/transitions*.whl .whl/simpy*.whl .whl/pyzmq*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
for spec in ${PROFILES:-"llama-3-8b:1" "llama-3-8b:2" "llama-3-8b:4" "llama-3-8b:8" "llama-2-7b:1" "codellama-34b:2" "mixtral-8x7b:2"}; do
  m=${spec%%:*}; tp=${spec##*:}
  python3 -m kvstate profile --model "$m" --tp "$tp" --out "$OUT/h200-$m-tp$tp.json" 2>&1 | tail -2
done
python3 benchmarks/model_calibration.py --out "$OUT/model_calibration.json" 2>&1 | tail -40
