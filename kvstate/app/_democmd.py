"""The ``kvstate demo`` command: its options, the store it runs on, and its exit status."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from ._argtypes import NON_NEGATIVE_INT, POSITIVE_INT

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Add ``demo`` and its options to the command line's subparsers."""
    d = sub.add_parser("demo", help="run requests P -> storage -> D on real bytes and check every byte")
    d.add_argument("--requests", type=POSITIVE_INT, default=64, help="number of requests (default 64)")
    d.add_argument("--seed", type=NON_NEGATIVE_INT, default=0, help="workload seed (default 0)")
    d.add_argument("--tp", type=POSITIVE_INT, default=2, help="TP ranks per instance (default 2)")
    d.add_argument("--store", choices=("memory", "arena", "file", "mooncake"), default=None,
                   help="storage pool (default memory; with --processes a shared-memory arena)")
    d.add_argument("--store-dir", help="an existing directory for the file store (with --store file)")
    d.add_argument("--master", help="Mooncake master HOST:PORT (with --store mooncake)")
    d.add_argument("--metadata", help="Mooncake metadata server URL, e.g. http://HOST:8080/metadata")
    d.add_argument("--protocol", choices=("tcp", "rdma"), default="tcp", help="Mooncake transport (default tcp)")
    d.add_argument("--start-master", action="store_true",
                   help="start a local mooncake_master on free loopback ports for this run, stop it after")
    d.add_argument("--backend", choices=("reference", "cuda"), default="reference",
                   help="reference: numpy caches on the CPU (default); cuda: GPU caches through the CUDA kernels")
    d.add_argument("--concurrency", type=POSITIVE_INT, default=8, help="requests in flight (default 8)")
    d.add_argument("--processes", action="store_true",
                   help="run P and D as separate processes, each a scheduler plus --tp rank-worker processes, over a "
                        "store that works across processes (a shared-memory arena, a FileStore, or Mooncake)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")


def _check(args: argparse.Namespace) -> None:
    """Options that go together, checked before anything starts."""
    if args.store_dir and args.store != "file":
        raise ConfigError("--store-dir goes with --store file")
    if args.store == "file":
        if not args.store_dir:
            raise ConfigError("--store file needs --store-dir DIR")
        if not Path(args.store_dir).is_dir():
            raise ConfigError(f"--store-dir {args.store_dir}: no such directory (create it first)")
    if args.processes and args.store == "memory":
        raise ConfigError("--processes needs a store other processes reach: --store arena, file or mooncake "
                          "(without --store: an arena)")
    if args.processes and args.backend != "reference":
        raise ConfigError("--processes runs the reference (numpy) backend; the GPU split is examples/pd_engine")
    if args.store != "mooncake" and (args.start_master or args.master or args.metadata):
        raise ConfigError("--master, --metadata and --start-master go with --store mooncake")
    if args.store == "mooncake":
        if args.start_master and (args.master or args.metadata):
            raise ConfigError("--start-master starts its own master: drop --master/--metadata")
        if not args.start_master and not (args.master and args.metadata):
            raise ConfigError("--store mooncake needs --master HOST:PORT and --metadata URL, or --start-master")


def run(args: argparse.Namespace) -> int:
    from ._demo import DemoConfig, format_summary, run_demo

    _check(args)
    cfg = DemoConfig(requests=args.requests, seed=args.seed, tp=args.tp, store=args.store or "memory",
                     store_dir=args.store_dir, concurrency=args.concurrency, backend=args.backend)
    master = None
    try:
        worker_store = {"kind": "file", "root": args.store_dir} if args.store == "file" else None
        if args.store == "mooncake":
            from ..backends._mooncake import MooncakeConfig, MooncakeStore
            from ..backends._mooncake_master import MooncakeMaster

            if args.start_master:
                master = MooncakeMaster().start()
                mc = master.config(protocol=args.protocol)
            else:
                mc = MooncakeConfig(master=args.master, metadata=args.metadata, protocol=args.protocol)
            mc.validate()
            cfg.store, cfg.store_factory = "custom", lambda spec: MooncakeStore(mc)
            worker_store = {"kind": "mooncake", **dataclasses.asdict(mc)}
        if args.processes:
            from ._procdemo import run_processes

            s = run_processes(cfg, worker_store)
        else:
            s = run_demo(cfg)
    finally:
        if master is not None:
            master.stop()
    print(json.dumps(s, sort_keys=True) if args.json else format_summary(s))
    if args.store == "mooncake":
        from ..backends._mooncake import mooncake_log_dir

        where = mooncake_log_dir()
        print(f"kvstate demo: Mooncake's own logging is in {where} (set MC_LOG_LEVEL to see it here)" if where
              else "kvstate demo: Mooncake's own logging follows your MC_LOG_LEVEL", file=sys.stderr)
    return 0 if s["integrity_ok"] and s["leaked_blocks"] == 0 else 1
