"""How far kernels measured on the H200 carry to the H100: against Vidur's H100 measurements.

    python benchmarks/profile_carry.py [--json PATH]

Vidur (github.com/microsoft/vidur) publishes per-operator times of Llama-2-7B layers measured
on an H100 (an extract is in ``benchmarks/data/vidur_h100_llama2_7b_tp1_ops.csv``): data kvstate
did not produce. For each operator and step size the table gives the simulator's time on an
H100 SXM, as a ratio to Vidur's, two ways:

- ``roofline``: the compute model's defaults and the H100's datasheet (:mod:`kvstate.sim._compute`);
- ``H200 profile``: the kernels ``kvstate profile`` measured on the device machine's H200
  (``h200-llama-2-7b-tp1``, shipped), each carried to the H100 by the ratio of the two
  datasheets' figures for the bound it ran under there (HBM bandwidth for a memory-bound
  kernel, peak FLOP/s for a compute-bound one).

Element-wise is the sum of the norms, rotary, activation and residual adds: Vidur times
separate kernels (the adds apart from the norms), vLLM and ``kvstate profile`` fused ones, so
that row measures the kernels' implementation as much as the carry.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from kvstate.sim import Scenario, with_overrides  # noqa: E402
from kvstate.sim._compute import ComputeModel  # noqa: E402
from kvstate.sim._gpus import gpu_overrides  # noqa: E402
from kvstate.sim._models import MODELS  # noqa: E402

DATA = os.path.join(HERE, "data", "vidur_h100_llama2_7b_tp1_ops.csv")
OPS = {"qkv": ("attn_pre_proj",), "o": ("attn_post_proj",), "gate_up": ("mlp_up_proj",),
       "down": ("mlp_down_proj",),
       "elementwise": ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add", "add")}


def vidur() -> dict[int, dict[str, float]]:
    """Vidur's H100 ms per op class and step size."""
    with open(DATA) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return {int(r["num_tokens"]): {k: sum(float(r[c]) for c in cols) for k, cols in OPS.items()} for r in rows}


def model(profile: str) -> ComputeModel:
    m = MODELS["llama-2-7b"]
    s = with_overrides(Scenario(), {**gpu_overrides("H100-SXM"), "cluster.tp": 1,
                                    **{f"model.{k}": v for k, v in dataclasses.asdict(m).items() if k != "block_size"},
                                    **({"gpu.profile": profile} if profile else {})})
    return ComputeModel(s)


def ms(cm: ComputeModel, op: str, tokens: int) -> float:
    mats = {name: (k, n) for name, k, n in cm.attn_mats + cm.dense_mats}
    if op == "elementwise":
        return 1e3 * cm.elementwise(tokens)
    k, n = mats[op]
    return 1e3 * cm.gemm(op, tokens, k, n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    measured = vidur()
    ways = {"roofline": model(""), "H200 profile": model("h200-llama-2-7b-tp1")}
    print(f"{'op':<12}{'tokens':>7}{'Vidur H100 ms':>15}" + "".join(f"{w + ' ratio':>22}" for w in ways))
    rows = []
    for op in OPS:
        for t, ops in sorted(measured.items()):
            row = {"op": op, "tokens": t, "vidur_ms": round(ops[op], 4)}
            for w, cm in ways.items():
                row[w] = round(ms(cm, op, t) / ops[op], 3)
            rows.append(row)
            print(f"{op:<12}{t:>7}{ops[op]:>15.4f}" + "".join(f"{row[w]:>22.2f}" for w in ways))
    summary = {}
    for w in ways:
        gemm = [r[w] for r in rows if r["op"] != "elementwise"]
        summary[w] = {"gemm_median_ratio": round(float(np.median(gemm)), 3),
                      "gemm_max_abs_error_pct": round(100 * float(np.max(np.abs(np.array(gemm) - 1))), 1)}
    print("\nGEMMs, model / Vidur: " + "; ".join(
        f"{w} median {v['gemm_median_ratio']:.2f}, worst {v['gemm_max_abs_error_pct']:.0f} % off"
        for w, v in summary.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
