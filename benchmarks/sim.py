"""Simulator speed and determinism: prints a table, ``--json`` prints one object.

    python benchmarks/sim.py [--json] [--quick] [--repeats N]
    python benchmarks/sim.py --against TREE [--repeats N] [--scenarios default,trace,conversation]

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

``--against TREE`` does that: it runs each scenario (the first three above; the default at 500
requests with ``--quick``) ``--repeats`` times in pairs, a run of each tree back to back, the
tree that goes first alternating; each run in a fresh process of its tree (its own ``kvstate``
first on the path, ``PYTHONHASHSEED=0``), warmed up by a short run. A pair's ratio (that tree's
wall time over this one's) is taken seconds apart, so the machine's drift over minutes, which
moves a run by tens of percent, falls on both sides of it alike; fresh processes keep one
process's memory layout, which can hold it a few percent apart for its whole life, from
counting in every pair. Printed per figure: each side's best run, and the median, lowest and
highest of the pairs' ratios with the number of pairs this tree won (the tree against itself:
see docs/benchmarks.md; take seven pairs or more).
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


#: a warm simulator of one tree, in its own process: one JSON line in (the scenario's overrides of
#: the default, its label), one out (wall seconds of its ``simulate()``, requests, the report's digest)
WORKER = """
import hashlib, json, sys, time
from kvstate.sim import Scenario, simulate, to_json, with_overrides
simulate(with_overrides(Scenario(), {"workload.num_requests": 50}))  # imports and first calls
print("ready", flush=True)
for line in sys.stdin:
    ask = json.loads(line)
    s = with_overrides(Scenario(), ask["overrides"])
    t = time.perf_counter()
    r = simulate(s)
    wall = time.perf_counter() - t
    print(json.dumps({"wall": wall, "requests": r["requests"],
                      "digest": hashlib.sha256(to_json(r).encode()).hexdigest()}), flush=True)
"""


class Worker:
    """One tree's warm simulator process (its own ``kvstate``, first on its path)."""

    def __init__(self, tree: str) -> None:
        path = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], cwd=tree, text=True,
                                     env={**os.environ, "PYTHONPATH": path, "PYTHONHASHSEED": "0"},
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.tree = tree
        self._expect("ready")

    def _expect(self, what: str | None = None) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line or (what and line.strip() != what):
            self.close()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise SystemExit(f"{self.tree}: its simulator stopped: {err.strip()[-500:]}")
        return line

    def run(self, overrides: dict) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"overrides": overrides}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect())

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


#: the scenarios ``--against`` can compare (``--scenarios``), in the order they run
SCENARIOS = ("default", "trace", "conversation")


def against_scenarios(quick: bool, workdir: str, scenarios: tuple[str, ...] = SCENARIOS) -> dict[str, dict]:
    """The figures ``--against`` compares: the scenarios' overrides of the default, by figure."""
    if quick:
        return {"default_wall_s": {"workload.num_requests": 500}}
    out: dict[str, dict] = {}
    if "default" in scenarios:
        out["default_wall_s"] = {}
    if "trace" in scenarios:
        out["trace_wall_s"] = {"workload.arrival": "trace", "workload.trace": TRACE}
    if "conversation" in scenarios:
        path = os.path.join(workdir, "conversation.jsonl")
        write_trace(conversation_trace(12000, seed=0), path)
        out["conversation_wall_s"] = {"workload.arrival": "trace", "workload.trace": path}
    return out


def against(tree: str, repeats: int, quick: bool, scenarios: tuple[str, ...] = SCENARIOS) -> dict:
    """This tree's and ``tree``'s wall times, scenario by scenario in pairs of runs back to back."""
    tree = os.path.abspath(tree)  # each worker runs in its own tree: a relative path would not hold there
    if not os.path.isdir(os.path.join(tree, "kvstate", "sim")):
        raise SystemExit(f"--against {tree}: no kvstate/sim there (give a kvstate checkout)")
    pairs = max(1, repeats)
    runs: dict[str, list[dict]] = {"this": [{} for _ in range(pairs)], "that": [{} for _ in range(pairs)]}
    with tempfile.TemporaryDirectory() as d:
        figures = against_scenarios(quick, d, scenarios)
        for fig, overrides in figures.items():
            for i in range(pairs):  # fresh processes for every pair: a process's own layout can
                # make it run a few per cent apart from another for its whole life
                workers = {"this": Worker(os.path.abspath(ROOT)), "that": Worker(tree)}
                try:
                    for side in (("this", "that") if i % 2 == 0 else ("that", "this")):  # each goes first in turn
                        r, doc = workers[side].run(overrides), runs[side][i]
                        doc[fig] = round(r["wall"], 3)
                        doc[fig.replace("_wall_s", "_digest")] = r["digest"]
                        if fig == "default_wall_s":
                            doc["default_requests"] = r["requests"]
                            doc["sim_requests_per_s"] = round(r["requests"] / r["wall"], 1)
                finally:
                    for w in workers.values():
                        w.close()
    keys = sorted([*figures, *(["sim_requests_per_s"] if "default_wall_s" in figures else [])])
    best = {side: {k: (max if k == "sim_requests_per_s" else min)(d[k] for d in docs) for k in keys}
            for side, docs in runs.items()}
    deterministic = {side: all(len({d[k] for d in docs}) == 1 for k in docs[0] if k.endswith("_digest"))
                     for side, docs in runs.items()}
    out = paired(runs["this"], runs["that"], keys)
    return {"against": tree, "runs": len(runs["this"]), "this": best["this"], "that": best["that"],
            "speedup": {k: v["median"] for k, v in out.items()}, "paired": out, "deterministic": deterministic,
            "this_runs": runs["this"], "that_runs": runs["that"]}


def _speedup(key: str, this: dict, that: dict) -> float:
    """That side's time over this side's (this side's rate over that side's)."""
    return this[key] / that[key] if key == "sim_requests_per_s" else that[key] / this[key]


def paired(this_runs: list[dict], that_runs: list[dict], keys: list[str]) -> dict:
    """Each round's speed-up (a round: this tree's run and that tree's run next to it), as the
    median, lowest and highest over the rounds, and the rounds this tree won: on a shared
    machine a burst of load slows one run of one side, which a best-of figure can credit to
    either tree; the median of the rounds' ratios is the estimate that one burst cannot move."""
    out = {}
    for k in keys:
        ratios = sorted(_speedup(k, a, b) for a, b in zip(this_runs, that_runs) if k in a and k in b)
        if ratios:
            out[k] = {"median": round(statistics.median(ratios), 3), "min": round(ratios[0], 3),
                      "max": round(ratios[-1], 3), "faster": sum(r > 1.0 for r in ratios), "rounds": len(ratios)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="500 requests, no traces")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of the default scenario (best is reported); with --against, pairs of each scenario")
    ap.add_argument("--against", metavar="TREE", help="another kvstate checkout to run side by side (see above)")
    ap.add_argument("--scenarios", help="with --against and without --quick, the scenarios to compare "
                                        "(comma-separated: " + ", ".join(SCENARIOS) + "; all by default)")
    args = ap.parse_args()
    scenarios = SCENARIOS
    if args.scenarios is not None:
        if not args.against or args.quick:
            ap.error("--scenarios applies to --against without --quick (--quick compares the default scenario)")
        scenarios = tuple(x for x in args.scenarios.split(",") if x)
        if not scenarios or any(x not in SCENARIOS for x in scenarios):
            ap.error(f"--scenarios {args.scenarios!r}: each must be one of {', '.join(SCENARIOS)}")
    if args.against:
        out = against(args.against, args.repeats, args.quick, scenarios)
        if args.json:
            print(json.dumps(out, sort_keys=True))
        else:
            for k, v in out["speedup"].items():
                p = out["paired"][k]
                print(f"{k:<20}  best: this {out['this'][k]:>9}  that {out['that'][k]:>9}   pairs' speed-up: median "
                      f"{v:.3f}x ({p['min']:.3f}-{p['max']:.3f}), this tree faster in {p['faster']} of {p['rounds']}")
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
