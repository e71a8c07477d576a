"""Protocol assurance report: runs the stateful suite's profile and prints one object.

    python benchmarks/protocol.py [--json] [--profile ci|deep|quick]

(``KVSTATE_PROTOCOL_PROFILE`` picks the profile when ``--profile`` is not given.) The object:
``examples``, ``steps``, ``faults`` (injections per fault class, and per state for cancel and
preempt), ``invariants`` (names checked, with how many checks), ``gpu_prefix_hit_blocks``
(blocks each side shared through its GPU prefix cache), ``layer_reports`` (layer counts
layer-wise prefills reported), ``violations`` (a failure's message;
empty when every invariant held), ``seconds``, and the TP barrier ``deadlock_search`` of
:func:`kvstate.sim.search_deadlocks` (counts per protocol and semantics, minimal cases).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from hypothesis.stateful import run_state_machine_as_test  # noqa: E402
from protocol_machine import Protocol  # noqa: E402
from protocol_support import FAULT_CLASSES, INVARIANTS, STATS, profile_settings  # noqa: E402

from kvstate.sim import search_deadlocks  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", choices=("ci", "deep", "quick"))
    args = ap.parse_args()
    profile = args.profile or os.environ.get("KVSTATE_PROTOCOL_PROFILE", "ci")
    STATS.clear()
    violations = []
    t = time.perf_counter()
    try:
        run_state_machine_as_test(Protocol, settings=profile_settings(profile))
    except Exception as e:  # noqa: BLE001 - a violation is reported, not raised
        violations.append(f"{type(e).__name__}: {e}")
    seconds = time.perf_counter() - t
    search = search_deadlocks()
    out = {
        "profile": profile, "examples": STATS["examples"], "steps": STATS["steps"],
        "faults": {f: STATS[f"fault:{f}"] for f in FAULT_CLASSES},
        "faults_by_state": {k[6:]: v for k, v in sorted(STATS.items())
                            if k.startswith(("fault:cancel:", "fault:preempt:"))},
        "invariants": {n: STATS[f"invariant:{n}"] for n in INVARIANTS},
        "gpu_prefix_hit_blocks": {side: STATS[f"gpu_prefix_hit_blocks:{side}"] for side in ("P", "D")},
        "layer_reports": STATS["layer_reports"],
        "violations": violations, "seconds": round(seconds, 2),
        "deadlock_search": {k: {"cases": v["cases"], "deadlocks": v["deadlocks"],
                                "unsynchronized_cases": v["unsynchronized_cases"],
                                "minimal": v["minimal"] and {"case": v["minimal"]["case"],
                                                             "stuck": v["minimal"]["stuck"],
                                                             "trace": v["minimal"]["trace"]}}
                            for k, v in search.items()},
    }
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(f"profile {profile}: {out['examples']} examples, {out['steps']} steps in {seconds:.1f} s, "
              f"{len(violations)} violations")
        for f, n in out["faults"].items():
            print(f"  fault {f:<32} {n:>7}")
        for n, c in out["invariants"].items():
            print(f"  invariant {n:<58} {c:>8} checks")
        print("  blocks shared through the GPU prefix cache: " +
              ", ".join(f"{k} {v}" for k, v in out["gpu_prefix_hit_blocks"].items()))
        print(f"  layer counts reported by layer-wise prefills: {out['layer_reports']}")
        for k, v in out["deadlock_search"].items():
            print(f"  TP barriers {k:<22} {v['cases']:>4} cases, {v['deadlocks']:>3} deadlocks, "
                  f"{v['unsynchronized_cases']:>3} unsynchronized")
        for msg in violations:
            print("VIOLATION:", msg[:2000])
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
