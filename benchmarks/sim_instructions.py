"""The simulator's work counted in machine instructions, beside another tree: prints a table,
``--json`` prints one object.

    python benchmarks/sim_instructions.py --against TREE [--scenarios default,trace,conversation]

Wall time on a shared machine moves by ±2× from one run to the next (``benchmarks/sim.py
--against`` shows the rounds' spread), which hides a 10 % change however many rounds are run.
This counts instead what one core must execute: each scenario's one ``simulate()`` call (after
a short warm-up run in the same process, so imports and first-call caches are left out) runs
under valgrind's callgrind, which counts every instruction the process executes while
collection is on. Collection is switched on and off around that call by callgrind's client
requests, from a five-line C helper compiled here. The count does not move with the machine's
load: run twice, it agrees to a few parts in a million.

What a count leaves out: memory stalls (a count treats a cache miss as one instruction), and
hardware paths valgrind does not emulate (OpenSSL's sha256 runs its plain code under valgrind,
about three times the instructions of its SHA-NI code, so the key chain weighs more here than
in a native run). Read a ratio of counts as the ratio of CPU work, not of seconds. ``--caches``
adds callgrind's simulated first-level and last-level cache misses and mispredicted branches
(its own small caches and a simple predictor, not the host's: a guide to where two trees
differ, not a figure of this machine).

Scenarios (as ``benchmarks/sim.py`` runs them): the embedded default (2,000 requests); the
shipped Mooncake synthetic trace (3,993 requests); a 12,000-request conversation trace
(``kvstate.sim._conversation``, seed 0, generated once by this tree and replayed by both). Both
trees run in parallel, each scenario in its own process, with ``PYTHONHASHSEED=0``.
Needs ``valgrind`` (with its headers, ``/usr/include/valgrind``) and a C compiler.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

TRACE = os.path.join(ROOT, "data", "mooncake_synthetic_trace.jsonl")
SCENARIOS = ("default", "trace", "conversation")

HELPER = """
#include <valgrind/callgrind.h>
void kv_collect(void) { CALLGRIND_TOGGLE_COLLECT; }
"""

#: one scenario in a fresh process: a warm-up run, then the counted one (argv: tree, helper,
#: scenario, trace, requests of the default scenario or 0 for its own)
CHILD = """
import ctypes, sys
tree, helper, which, trace, n = sys.argv[1:6]
sys.path.insert(0, tree)
from kvstate.sim import Scenario, simulate, with_overrides
base = with_overrides(Scenario(), {"workload.num_requests": int(n)}) if int(n) else Scenario()
simulate(with_overrides(base, {"workload.num_requests": 50}))  # imports and first-call caches: not counted
s = base if which == "default" else with_overrides(base, {"workload.arrival": "trace", "workload.trace": trace})
collect = ctypes.CDLL(helper).kv_collect
collect()
r = simulate(s)
collect()
print(r["requests"])
"""


def build_helper(directory: str) -> str:
    """Compile the collection switch; a SystemExit naming what is missing."""
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt install valgrind)")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler (cc) to build the collection switch")
    src, lib = os.path.join(directory, "kv_collect.c"), os.path.join(directory, "kv_collect.so")
    with open(src, "w") as f:
        f.write(HELPER)
    r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", lib, src], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"building the collection switch failed (valgrind headers?): {r.stderr.strip()[-300:]}")
    return lib


#: callgrind's event names, as this script reports them
EVENTS = {"Ir": "instructions", "D1mr": "l1_read_misses", "D1mw": "l1_write_misses", "DLmr": "ll_read_misses",
          "DLmw": "ll_write_misses", "Bcm": "mispredicted_branches", "Bim": "mispredicted_indirect"}


def count(side: str, tree: str, helper: str, which: str, trace: str, directory: str, caches: bool = False,
          requests: int = 0) -> dict:
    """Instructions of one ``simulate()`` of ``which`` on ``tree``'s sources (with ``caches``,
    its simulated cache misses and mispredicted branches too), and its requests."""
    out = os.path.join(directory, f"{side}-{which}.callgrind")
    sim = ["--cache-sim=yes", "--branch-sim=yes"] if caches else []
    cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", *sim, f"--callgrind-out-file={out}",
           sys.executable, "-c", CHILD, tree, helper, which, trace, str(requests)]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=7200)
    text = Path(out).read_text() if os.path.exists(out) else ""
    names = re.search(r"^events: (.+)$", text, re.M)
    totals = re.search(r"^(?:summary|totals): (.+)$", text, re.M)
    if r.returncode or names is None or totals is None:
        raise SystemExit(f"{tree} {which}: exited {r.returncode}: {r.stderr.strip()[-500:]}")
    got = dict(zip(names.group(1).split(), map(int, totals.group(1).split())))
    res = {EVENTS[k]: v for k, v in got.items() if k in EVENTS}
    return {**res, "requests": int(r.stdout.split()[-1])}


def compare(against: str, scenarios: list[str], caches: bool = False, requests: int = 0,
            keep: str | None = None) -> dict:
    """Both trees' counts per scenario and the ratios (that tree's count over this one's);
    ``keep``: a directory to copy callgrind's files into (``SIDE-SCENARIO.callgrind``), for
    ``callgrind_annotate`` to compare function by function."""
    from kvstate.sim._conversation import conversation_trace, write_trace

    against = os.path.abspath(against)
    if not os.path.isdir(os.path.join(against, "kvstate")):
        raise SystemExit(f"--against {against}: no kvstate package there (give a kvstate checkout)")
    with tempfile.TemporaryDirectory() as d:
        helper = build_helper(d)
        traces = {"default": "", "trace": TRACE, "conversation": os.path.join(d, "conversation.jsonl")}
        if "conversation" in scenarios:
            write_trace(conversation_trace(12_000, seed=0), traces["conversation"])
        jobs = [(side, tree, which) for which in scenarios for side, tree in (("this", ROOT), ("that", against))]
        with ThreadPoolExecutor(2) as pool:  # one valgrind a core; the counts do not care
            done = list(pool.map(lambda j: count(j[0], j[1], helper, j[2], traces[j[2]], d, caches, requests), jobs))
        if keep:
            os.makedirs(keep, exist_ok=True)
            for side, _, which in jobs:
                shutil.copy(os.path.join(d, f"{side}-{which}.callgrind"), keep)
    rows: dict[str, dict] = {}
    for (side, _, which), res in zip(jobs, done):
        rows.setdefault(which, {})[side] = res
    for row in rows.values():
        row["speedup"] = {k: round(row["that"][k] / row["this"][k], 4) for k in row["this"]
                          if k != "requests" and row["this"][k]}
    return {"against": against, "python": sys.version.split()[0], "scenarios": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, metavar="TREE", help="another kvstate checkout")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: " + ", ".join(SCENARIOS))
    ap.add_argument("--caches", action="store_true",
                    help="simulate the caches and branch predictors too (about twice as slow)")
    ap.add_argument("--quick", action="store_true", help="the default scenario alone, at 200 requests")
    ap.add_argument("--keep", metavar="DIR", help="keep callgrind's files there (for callgrind_annotate)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    scenarios = ["default"] if args.quick else [s for s in args.scenarios.split(",") if s]
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad or not scenarios:
        ap.error(f"--scenarios: unknown {bad or 'none given'}; choose from {', '.join(SCENARIOS)}")
    res = compare(args.against, scenarios, args.caches, 200 if args.quick else 0, args.keep)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"against {res['against']} (python {res['python']}); speed-up: that tree's instructions over this one's")
    print(f"{'scenario':14} {'requests':>9} {'count':22} {'this':>16} {'that':>16} {'speed-up':>9}")
    for which, row in res["scenarios"].items():
        for k, ratio in row["speedup"].items():
            print(f"{which:14} {row['this']['requests']:>9} {k:22} {row['this'][k]:>16,} {row['that'][k]:>16,} "
                  f"{ratio:>8.4f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
