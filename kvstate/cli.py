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
    d.add_argument("--store", choices=("memory", "file", "mooncake"), default="memory",
                   help="storage pool (default memory)")
    d.add_argument("--store-dir", help="directory of the file store (with --store file)")
    d.add_argument("--master", help="Mooncake master HOST:PORT (with --store mooncake)")
    d.add_argument("--metadata", help="Mooncake metadata server URL, e.g. http://HOST:8080/metadata")
    d.add_argument("--protocol", choices=("tcp", "rdma"), default="tcp", help="Mooncake transport (default tcp)")
    d.add_argument("--start-master", action="store_true",
                   help="start a local mooncake_master on free loopback ports for this run, stop it after")
    d.add_argument("--backend", choices=("reference", "cuda"), default="reference",
                   help="reference: numpy caches on the CPU (default); cuda: GPU caches through the CUDA kernels")
    d.add_argument("--concurrency", type=_positive_int, default=8, help="requests in flight (default 8)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    g = sub.add_parser("diagram", help="print each lifecycle machine's diagram (mermaid), drawn from the machines")
    g.add_argument("--machine", choices=("prefill", "decode"), help="only this machine")
    return p


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, format_summary, run_demo

    cfg = DemoConfig(requests=args.requests, seed=args.seed, tp=args.tp, store=args.store,
                     store_dir=args.store_dir, concurrency=args.concurrency, backend=args.backend)
    master = None
    try:
        if args.store == "mooncake":
            from .backends.mooncake import MooncakeConfig, MooncakeMaster, MooncakeStore
            from .errors import ConfigError

            if args.start_master:
                if args.master or args.metadata:
                    raise ConfigError("--start-master starts its own master: drop --master/--metadata")
                master = MooncakeMaster().start()
                mc = master.config(protocol=args.protocol)
            elif not (args.master and args.metadata):
                raise ConfigError("--store mooncake needs --master HOST:PORT and --metadata URL, or --start-master")
            else:
                mc = MooncakeConfig(master=args.master, metadata=args.metadata, protocol=args.protocol)
            mc.validate()
            cfg.store, cfg.store_factory = "custom", lambda spec: MooncakeStore(mc)
        elif args.start_master or args.master or args.metadata:
            from .errors import ConfigError

            raise ConfigError("--master, --metadata and --start-master go with --store mooncake")
        s = run_demo(cfg)
    finally:
        if master is not None:
            master.stop()
    print(json.dumps(s, sort_keys=True) if args.json else format_summary(s))
    return 0 if s["integrity_ok"] and s["leaked_blocks"] == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "demo":
            return _demo(args)
        from .machines import MACHINES, mermaid

        names = [args.machine] if args.machine else list(MACHINES)
        print("\n\n".join(mermaid(MACHINES[n]) for n in names))
        return 0
    except KVStateError as e:
        print(f"kvstate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
