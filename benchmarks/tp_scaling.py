"""Llama-3-8B decode step time (TPOT) at TP 1/2/4/8 on an H100 SXM, with the all-reduce share.

    python benchmarks/tp_scaling.py [--json PATH] [--gpu H100-SXM] [--model llama-3-8b]

For each TP degree and a few decode batches (each request holding ``--context`` tokens), the
simulator's compute model gives one decode step's time and how much of it the two all-reduces
a layer take, with the link figures of the GPU preset (printed above the table: the one-shot
and ring algorithms' latency and bus bandwidth, and where they come from:
:mod:`kvstate.sim._gpus`). The speed-up column is TP 1's step over this one's: perfect scaling
would read the TP degree.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstate.sim import Scenario, with_overrides  # noqa: E402
from kvstate.sim._compute import ComputeModel  # noqa: E402
from kvstate.sim._gpus import GPUS, gpu_overrides  # noqa: E402
from kvstate.sim._models import resolve_model  # noqa: E402

TPS = (1, 2, 4, 8)
BATCHES = (1, 16, 64, 256)


def step(gpu: str, model: str, tp: int, batch: int, context: int) -> dict[str, float]:
    """One decode step's ms, and its all-reduces' ms (two a layer)."""
    m = resolve_model(model)
    s = with_overrides(Scenario(), {**gpu_overrides(gpu), "cluster.tp": tp,
                                    **{f"model.{k}": v for k, v in dataclasses.asdict(m).items()
                                       if k != "block_size"}})
    cm = ComputeModel(s)
    total = cm.decode_step_time(batch, batch * context)
    ar = 2 * cm.layers * cm.allreduce(batch * cm.hidden * 2)
    return {"step_ms": round(1e3 * total, 3), "allreduce_ms": round(1e3 * ar, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="H100-SXM", choices=sorted(GPUS))
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--context", type=int, default=1024, help="tokens each decoding request holds")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    g = GPUS[a.gpu]
    print(f"{a.model} on {a.gpu}, {a.context}-token contexts; all-reduce: one-shot {g['allreduce_us']:g} us + "
          f"bytes at {g['allreduce_ll_gbps']:g} GB/s, ring {g['allreduce_ring_us']:g} us + bytes at "
          f"{g['allreduce_gbps']:g} GB/s (bus), the faster of the two")
    print(f"{'batch':>6}" + "".join(f"{f'TP {tp} step ms':>16}{'(AR ms)':>9}{'x':>6}" for tp in TPS))
    rows = []
    for b in BATCHES:
        cells = [step(a.gpu, a.model, tp, b, a.context) for tp in TPS]
        base = cells[0]["step_ms"]
        line = f"{b:>6}"
        for tp, c in zip(TPS, cells):
            c["speedup"] = round(base / c["step_ms"], 2)
            line += f"{c['step_ms']:>16.2f}{c['allreduce_ms']:>9.2f}{c['speedup']:>6.2f}"
            rows.append({"batch": b, "tp": tp, **c})
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": a.gpu, "model": a.model, "context": a.context, "link": {
                k: g[k] for k in ("allreduce_us", "allreduce_ll_gbps", "allreduce_ring_us", "allreduce_gbps")},
                "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
