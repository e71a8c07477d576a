"""The host tier in the simulator: the shared trace with and without it, side by side.

    python benchmarks/sim_host_tier.py [--json] [--trace PATH] [--fraction 0.25]

Replays the Mooncake synthetic trace (64 % block reuse) twice on the default cluster: with no
host tier, and with a host tier per instance of ``--fraction`` of the trace's unique blocks
(its ``hash_ids`` in the model's blocks). P looks prompts' prefixes up in host memory first,
then in the storage pool, and copies each stored cache into its host tier (write-through).
Prints the prefix hit rate per tier and TTFT for both, and the TTFT change.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from kvstate.sim import Scenario, simulate, with_overrides  # noqa: E402
from kvstate.sim.workload import load_trace  # noqa: E402

TRACE = os.path.join(ROOT, "data", "mooncake_synthetic_trace.jsonl")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--fraction", type=float, default=0.25)
    args = ap.parse_args()
    base = with_overrides(Scenario(), {"workload.arrival": "trace", "workload.trace": os.path.abspath(args.trace)})
    hb = base.workload.hash_block_size
    unique = len({h for r in load_trace(args.trace, hb) for h in r.hash_ids}) * hb // base.model.block_size
    slots = max(1, int(unique * args.fraction))
    runs = {"no host tier": simulate(base),
            f"host tier {slots:,} blocks": simulate(with_overrides(base, {"cluster.host_blocks": slots}))}
    rows = {}
    for name, r in runs.items():
        tier = r["host_tier"] or {}
        rows[name] = {"host_blocks": tier.get("slots_per_instance", 0),
                      "prefix_hit_host": tier.get("prefix_hit_rate_host", 0.0),
                      "prefix_hit_store": tier.get("prefix_hit_rate_store", r["prefix_hit_rate"]),
                      "ttft_ms": {k: r["ttft_ms"][k] for k in ("mean", "p50", "p90", "p99")},
                      "reasons": r["reasons"], "evictions": tier.get("evictions", 0)}
    a, b = rows.values()
    out = {"trace": os.path.basename(args.trace), "unique_blocks": unique, "fraction": args.fraction,
           "runs": rows, "ttft_change": {k: round(b["ttft_ms"][k] / a["ttft_ms"][k] - 1, 4) for k in a["ttft_ms"]}}
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    print(f"{'run':<26}{'host hits':>10}{'store hits':>11}{'TTFT mean':>11}{'p50':>9}{'p90':>9}{'p99':>9}  ended")
    for name, x in rows.items():
        t = x["ttft_ms"]
        print(f"{name:<26}{x['prefix_hit_host']:>10.1%}{x['prefix_hit_store']:>11.1%}{t['mean']:>11.1f}"
              f"{t['p50']:>9.1f}{t['p90']:>9.1f}{t['p99']:>9.1f}  {x['reasons']}")
    print("TTFT change with the host tier: " + ", ".join(f"{k} {v:+.1%}" for k, v in out["ttft_change"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
