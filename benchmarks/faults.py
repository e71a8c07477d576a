"""How fast a dead rank worker is found, and how soon the requests it held end.

    python benchmarks/faults.py [--json] [--repeats 3]

P and D engines (the demo's roles, TP 2) with rank workers as processes (tests/procrig.py),
transfer deadline 3 s and fence grace 2 s, heartbeats every 0.1 s, a rank declared dead after
1 s of silence. Two faults, each at the first read D sends to rank 1:

- ``kill``: the worker is killed with SIGKILL (it is the driver's child: its exit is seen);
- ``silent``: the worker is stopped with SIGSTOP and never answers again (only the heartbeat
  limit can find it; the driver then kills it and starts another).

For each: seconds from the fault to the driver's ``RankDown`` (bar: heartbeat limit + 1 s),
and from the fault to the end of the last request that had a command on that rank then
(bar: deadline + grace).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from procrig import FAST, ProcRig  # noqa: E402

from kvstate import commands as C  # noqa: E402
from kvstate.distributed import RankDown  # noqa: E402

DEAD_AFTER = 1.0


def one(fault: str) -> dict:
    root = tempfile.mkdtemp(prefix="kvstate-faults-")
    rig = ProcRig(root, dead_after_s=DEAD_AFTER)
    seen: dict = {}

    def on_submit(side: str, cmd: C.Command) -> None:
        if seen or side != "D" or cmd.__class__ is not C.ReadBlocks:
            return
        child = rig.driver("D").child(1)
        seen["t"] = time.monotonic()
        child.signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        seen["touched"] = {c.request_id for c in rig.D.pending_commands()} | {cmd.request_id}

    try:
        r = rig.run(40, on_submit=on_submit, timeout=120)
        assert r["ended"] == r["requests"] and r["leaked"] == 0 and r["mismatched"] == 0, r
        down = next(n for n in rig.driver("D").notices() if isinstance(n, RankDown))
        assert down.rank == 1
        detect = down.at - seen["t"]
        ends = max(rig.ended_at[rid] for rid in seen["touched"] if rid in rig.ended_at) - seen["t"]
        return {"fault": fault, "detected_s": round(detect, 3), "touched": len(seen["touched"]),
                "last_touched_end_s": round(ends, 3), "reason": down.reason}
    finally:
        rig.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = [one(fault) for fault in ("kill", "silent") for _ in range(args.repeats)]
    bars = {"detected_s": DEAD_AFTER + 1.0, "last_touched_end_s": FAST.transfer_timeout + FAST.fence_grace}
    result = {"bars": bars, "rows": rows,
              "met": all(r[k] <= v for r in rows for k, v in bars.items())}
    if args.json:
        print(json.dumps(result))
        return
    print(f"fault detection (heartbeat limit {DEAD_AFTER} s; bars: found <= {bars['detected_s']} s, "
          f"requests touched ended <= {bars['last_touched_end_s']} s)")
    print(f"{'fault':>7} {'found after s':>14} {'touched':>8} {'all ended after s':>18}  reason")
    for r in rows:
        print(f"{r['fault']:>7} {r['detected_s']:>14.3f} {r['touched']:>8} {r['last_touched_end_s']:>18.3f}  "
              f"{r['reason']}")
    print("every bar met" if result["met"] else "A BAR WAS MISSED")


if __name__ == "__main__":
    main()
