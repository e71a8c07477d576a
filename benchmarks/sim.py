"""Simulator speed and determinism: prints a table, ``--json`` prints one object.

    python benchmarks/sim.py [--json] [--quick] [--repeats N]

- the embedded default scenario (2,000 requests), run ``--repeats`` times with the same seed:
  simulated requests per wall second (best run) and whether every ``--json`` document is
  byte-identical;
- the shipped Mooncake synthetic trace (3,993 requests, 64 % block reuse): wall seconds;
- a 12,000-request conversation-style trace (``kvstate.sim._conversation``, seed 0, 37 % block
  reuse), generated into a temporary file: wall seconds;
- the co-located mode (``cluster.mode = "colocated"``) replaying the 16,800 requests of the
  real vLLM "general" run (``benchmarks/vllm_groundtruth.py``'s scenario and trace, Llama-2-7B
  on one H100): wall seconds, when ``../shared/data/vllm_groundtruth`` is there.
One process, one core (SimPy is single-threaded). Wall times on a shared machine vary by
tens of percent between runs, and by more from day to day: take the best of several, and
compare versions side by side.

``--against TREE`` does that: it runs TREE's own ``benchmarks/sim.py --json`` (another checkout,
an older commit) and this one's, alternating, ``--repeats`` times each, each in its own
process, and prints both sides' best figures and the speed-ups (that side's time over this
side's) of the figures both report; and, per figure, the median, lowest and highest of the
rounds' own speed-ups (a round: one run of each tree, back to back), the figure to quote
from a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")  # this checkout
sys.path.insert(0, ROOT)

from kvstate.sim import Scenario, simulate, to_json, with_overrides  # noqa: E402
from kvstate.sim._conversation import block_reuse, conversation_trace, write_trace  # noqa: E402

TRACE = os.path.join(ROOT, "data", "mooncake_synthetic_trace.jsonl")


def timed(s: Scenario) -> tuple[float, dict]:
    t = time.perf_counter()
    r = simulate(s)
    return time.perf_counter() - t, r


def replay(path: str) -> tuple[float, dict]:
    return timed(with_overrides(Scenario(), {"workload.arrival": "trace", "workload.trace": os.path.abspath(path)}))


#: figures compared by --against: lower is better, except the rate
WALLS = ("default_wall_s", "trace_wall_s", "conversation_wall_s", "colocated_general_wall_s")
GENERAL_RUN = "20260217-231439-llama-2-7b-tp1-general"


def colocated_general() -> dict:
    """The co-located replay of the real 16,800-request run, as a user would set it up."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from vllm_groundtruth import DEFAULT_DATA, load_run, write_inputs

    from kvstate.sim import load_scenario
    from kvstate.sim._models import model_from_hf_config
    run_dir = DEFAULT_DATA / "runs" / GENERAL_RUN
    if not run_dir.is_dir():
        return {"colocated_general": f"skipped: {run_dir} not found"}
    run = load_run(run_dir)
    with tempfile.TemporaryDirectory() as d:
        from pathlib import Path
        sc = load_scenario(write_inputs(run, Path(d)))
        model = model_from_hf_config(DEFAULT_DATA / "model_configs" / "Llama-2-7b-hf" / "config.json")
        fields = {f"model.{k}": getattr(model, k) for k in ("name", "params_b", "num_layers", "hidden", "num_heads",
                                                             "total_kv_heads", "head_dim", "intermediate", "vocab")}
        wall, r = timed(with_overrides(sc, fields))
    return {"colocated_general_requests": r["requests"], "colocated_general_wall_s": round(wall, 3),
            "colocated_general_reasons": r["reasons"]}


def child(tree: str, quick: bool) -> dict:
    """One run of ``tree``'s own benchmark, in a fresh process on that tree's sources."""
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "sim.py"), "--json"] + (["--quick"] if quick else [])
    # that tree first, then whatever path this process was given (where its dependencies are)
    path = os.pathsep.join(p for p in (os.path.abspath(tree), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    lines = r.stdout.strip().splitlines()
    if r.returncode not in (0, 1) or not lines:  # 1: that run was not deterministic, its figures still stand
        raise SystemExit(f"{tree}: benchmarks/sim.py exited {r.returncode}: {r.stderr.strip()[-500:]}")
    return json.loads(lines[-1])


def against(tree: str, repeats: int, quick: bool) -> dict:
    """This tree's and ``tree``'s figures, alternating runs; the best of each and the speed-ups."""
    tree = os.path.abspath(tree)  # each child runs in its own tree: a relative path would not hold there
    if not os.path.isfile(os.path.join(tree, "benchmarks", "sim.py")):
        raise SystemExit(f"--against {tree}: no benchmarks/sim.py there (give a kvstate checkout)")
    runs: dict[str, list[dict]] = {"this": [], "that": []}
    for _ in range(max(1, repeats)):
        runs["this"].append(child(ROOT, quick))
        runs["that"].append(child(tree, quick))
    best = {}
    for side, docs in runs.items():
        keys = set(WALLS + ("sim_requests_per_s",)).intersection(*docs)
        best[side] = {k: (max if k == "sim_requests_per_s" else min)(d[k] for d in docs) for k in sorted(keys)}
    common = sorted(set(best["this"]) & set(best["that"]))
    speedup = {k: round(_speedup(k, best["this"], best["that"]), 3) for k in common}
    return {"against": os.path.abspath(tree), "runs": len(runs["this"]), "this": best["this"], "that": best["that"],
            "speedup": speedup, "paired": paired(runs["this"], runs["that"], common),
            "this_runs": runs["this"], "that_runs": runs["that"]}


def _speedup(key: str, this: dict, that: dict) -> float:
    """That side's time over this side's (this side's rate over that side's)."""
    return this[key] / that[key] if key == "sim_requests_per_s" else that[key] / this[key]


def paired(this_runs: list[dict], that_runs: list[dict], keys: list[str]) -> dict:
    """Each round's speed-up (a round: this tree's run and that tree's run next to it), as the
    median, lowest and highest over the rounds: on a shared machine a burst of load slows one
    run of one side, which a best-of figure can credit to either tree; the median of the
    rounds' ratios is the estimate that one burst cannot move."""
    out = {}
    for k in keys:
        ratios = sorted(_speedup(k, a, b) for a, b in zip(this_runs, that_runs) if k in a and k in b)
        if ratios:
            out[k] = {"median": round(statistics.median(ratios), 3), "min": round(ratios[0], 3),
                      "max": round(ratios[-1], 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="500 requests, no traces")
    ap.add_argument("--repeats", type=int, default=3, help="runs of the default scenario (best is reported)")
    ap.add_argument("--against", metavar="TREE", help="another kvstate checkout to run side by side (see above)")
    args = ap.parse_args()
    if args.against:
        out = against(args.against, args.repeats, args.quick)
        if args.json:
            print(json.dumps(out, sort_keys=True))
        else:
            for k, v in out["speedup"].items():
                p = out["paired"][k]
                print(f"{k:<20}  this {out['this'][k]:>9}  that {out['that'][k]:>9}  speed-up {v:.3f}x  "
                      f"rounds: median {p['median']:.3f}x ({p['min']:.3f}-{p['max']:.3f})")
        return 0
    s = Scenario()
    if args.quick:
        s = with_overrides(s, {"workload.num_requests": 500})
    runs = [timed(s) for _ in range(max(2, args.repeats))]
    best = min(w for w, _ in runs)
    r = runs[0][1]
    docs = {to_json(x) for _, x in runs}
    out = {"python": platform.python_version(), "sim_requests_per_s": round(r["requests"] / best, 1),
           "default_requests": r["requests"], "default_wall_s": round(best, 3),
           "default_simulated_s": r["duration_s"], "deterministic": len(docs) == 1}
    if not args.quick:
        wall, tr = replay(TRACE)
        out.update({"trace_requests": tr["requests"], "trace_wall_s": round(wall, 3),
                    "trace_simulated_s": tr["duration_s"], "trace_reasons": tr["reasons"]})
        with tempfile.TemporaryDirectory() as d:
            recs = conversation_trace(12000, seed=0)
            path = os.path.join(d, "conversation.jsonl")
            write_trace(recs, path)
            wall, cr = replay(path)
        out.update({"conversation_requests": cr["requests"], "conversation_block_reuse": round(block_reuse(recs), 4),
                    "conversation_wall_s": round(wall, 3), "conversation_simulated_s": cr["duration_s"],
                    "conversation_reasons": cr["reasons"]})
        out.update(colocated_general())
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        w = max(len(k) for k in out)
        for k, v in out.items():
            print(f"{k:<{w}}  {v}")
    return 0 if out["deterministic"] else 1


if __name__ == "__main__":
    sys.exit(main())
