"""The ``kvstate`` command line: ``demo`` and ``diagram``."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .errors import KVStateError

__all__ = ["main"]


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v} must be > 0")
    return v


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstate", description="KV-cache lifecycle of PD-disaggregated serving.")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run requests P -> storage -> D on real bytes and check every byte")
    d.add_argument("--requests", type=_positive_int, default=64, help="number of requests (default 64)")
    d.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    d.add_argument("--tp", type=_positive_int, default=2, help="TP ranks per instance (default 2)")
    d.add_argument("--store", choices=("memory", "file"), default="memory", help="storage pool (default memory)")
    d.add_argument("--store-dir", help="directory of the file store (with --store file)")
    d.add_argument("--concurrency", type=_positive_int, default=8, help="requests in flight (default 8)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    g = sub.add_parser("diagram", help="print each lifecycle machine's diagram (mermaid), drawn from the machines")
    g.add_argument("--machine", choices=("prefill", "decode"), help="only this machine")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "demo":
            from .demo import DemoConfig, format_summary, run_demo

            s = run_demo(DemoConfig(requests=args.requests, seed=args.seed, tp=args.tp, store=args.store,
                                    store_dir=args.store_dir, concurrency=args.concurrency))
            print(json.dumps(s, sort_keys=True) if args.json else format_summary(s))
            return 0 if s["integrity_ok"] and s["leaked_blocks"] == 0 else 1
        from .machines import MACHINES, mermaid

        names = [args.machine] if args.machine else list(MACHINES)
        print("\n\n".join(mermaid(MACHINES[n]) for n in names))
        return 0
    except KVStateError as e:
        print(f"kvstate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
