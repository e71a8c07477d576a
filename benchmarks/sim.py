"""Simulator speed and determinism: prints a table, ``--json`` prints one object.

    python benchmarks/sim.py [--json] [--trace FILE] [--quick]

- the embedded default scenario (2,000 requests), run twice with the same seed: simulated
  requests per wall second (best of the two) and whether the two ``--json`` documents are
  byte-identical;
- the Mooncake synthetic trace (3,993 requests), when found: wall seconds.
One process, one core (SimPy is single-threaded).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstate.sim import simulate, to_json  # noqa: E402
from kvstate.sim import Scenario, with_overrides  # noqa: E402

TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "mooncake_synthetic_trace.jsonl")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace", default=TRACE, help="Mooncake-format trace to time (default: data/mooncake_synthetic_trace.jsonl)")
    ap.add_argument("--quick", action="store_true", help="500 requests, no trace")
    args = ap.parse_args()
    s = Scenario()
    if args.quick:
        s = with_overrides(s, {"workload.num_requests": 500})
    runs = []
    for _ in range(2):
        t = time.perf_counter()
        r = simulate(s)
        runs.append((time.perf_counter() - t, to_json(r), r))
    best = min(w for w, _, _ in runs)
    r = runs[0][2]
    out = {
        "sim_requests_per_s": round(r["requests"] / best, 1),
        "default_requests": r["requests"], "default_wall_s": round(best, 3),
        "default_simulated_s": r["simulated_s"], "deterministic": runs[0][1] == runs[1][1],
        "json_bytes": len(runs[0][1]),
    }
    if not args.quick and os.path.exists(args.trace):
        ts = with_overrides(Scenario(), {"workload.arrival": "trace", "workload.trace": os.path.abspath(args.trace)})
        t = time.perf_counter()
        tr = simulate(ts)
        out.update({"trace_requests": tr["requests"], "trace_wall_s": round(time.perf_counter() - t, 3),
                    "trace_simulated_s": tr["simulated_s"], "trace_states": tr["states"],
                    "trace_goodput_rps": tr["goodput_rps"], "trace_ttft_p99_ms": tr["ttft_ms"]["p99"]})
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        w = max(len(k) for k in out)
        for k, v in out.items():
            print(f"{k:<{w}}  {v}")
    return 0 if out["deterministic"] else 1


if __name__ == "__main__":
    sys.exit(main())
