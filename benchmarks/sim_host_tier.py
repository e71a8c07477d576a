"""The cache tiers in the simulator: the shared trace with none, the host tier, and both tiers.

    python benchmarks/sim_host_tier.py [--json] [--trace PATH] [--fraction 0.25]

Replays the Mooncake synthetic trace (64 % block reuse) three times on the default cluster:
with no cache tier, with a host tier per instance of ``--fraction`` of the trace's unique
blocks (its ``hash_ids`` in the model's blocks), and with that host tier under a GPU prefix
cache. P looks prompts' prefixes up on its GPU first, then in host memory, then in the storage
pool, and copies each stored cache into its host tier (write-through); D reads only what its
GPU lacks. Prints the prefix hit rate per tier and TTFT for each run, and the TTFT change
against no tier.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from kvstate.sim import (  # noqa: E402
    Scenario,
    load_trace,  # noqa: E402
    simulate,
    with_overrides,
)

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
    tier = with_overrides(base, {"cluster.host_blocks": slots})
    runs = {"no cache tier": simulate(base), f"host tier {slots:,} blocks": simulate(tier),
            "GPU cache + host tier": simulate(with_overrides(tier, {"cluster.prefix_cache": True}))}
    rows = {}
    for name, r in runs.items():
        host, gpu = r["host_tier"] or {}, r["gpu_prefix_cache"] or {}
        rows[name] = {"host_blocks": host.get("slots_per_instance", 0),
                      "prefix_hit_gpu": gpu.get("prefix_hit_rate_gpu", 0.0),
                      "prefix_hit_host": host.get("prefix_hit_rate_host", 0.0),
                      "prefix_hit_store": host.get("prefix_hit_rate_store", r["prefix_hit_rate"]),
                      "decode_hit_gpu": gpu.get("decode_hit_rate_gpu", 0.0),
                      "ttft_ms": {k: r["ttft_ms"][k] for k in ("mean", "p50", "p90", "p99")},
                      "reasons": r["reasons"], "evictions": host.get("evictions", 0)}
    first = rows["no cache tier"]["ttft_ms"]
    out = {"trace": os.path.basename(args.trace), "unique_blocks": unique, "fraction": args.fraction, "runs": rows,
           "ttft_change": {name: {k: round(x["ttft_ms"][k] / first[k] - 1, 4) for k in first}
                           for name, x in rows.items() if x["ttft_ms"] is not first}}
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    print(f"{'run':<24}{'GPU hits':>9}{'host hits':>10}{'store hits':>11}{'D not read':>11}{'TTFT mean':>11}"
          f"{'p50':>9}{'p90':>9}{'p99':>9}  ended")
    for name, x in rows.items():
        t = x["ttft_ms"]
        print(f"{name:<24}{x['prefix_hit_gpu']:>9.1%}{x['prefix_hit_host']:>10.1%}{x['prefix_hit_store']:>11.1%}"
              f"{x['decode_hit_gpu']:>11.1%}{t['mean']:>11.1f}{t['p50']:>9.1f}{t['p90']:>9.1f}{t['p99']:>9.1f}"
              f"  {x['reasons']}")
    for name, change in out["ttft_change"].items():
        print(f"TTFT change, {name}: " + ", ".join(f"{k} {v:+.1%}" for k, v in change.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
