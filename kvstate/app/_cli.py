"""The ``kvstate`` command line: its parser, and the commands that are not the simulator's.

``simulate``, ``plan`` and ``scenario`` run in :mod:`~kvstate.app._simcmds`; ``demo``,
``profile``, ``arena`` and ``diagram`` are here, each an options function and a run function.
Bad input (an option, a scenario, a path) is one line on stderr and exit 2, checked before
anything runs; see :data:`EXIT_CODES`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .. import __version__
from .._errors import ConfigError, KVStateError
from ..sim._gpus import GPUS
from ..sim._scenario import MODES
from . import _simcmds as simcmds

__all__ = ["main", "EXIT_CODES"]


def _number(kind: Callable[[str], float], low: float, inclusive: bool, what: str) -> Callable[[str], float]:
    """An argparse type: ``kind(text)``, finite and above ``low`` (or at it, ``inclusive``)."""
    def parse(text: str) -> float:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(v) or not (v >= low if inclusive else v > low):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return v
    return parse


POSITIVE_INT = _number(int, 0, False, "an integer > 0")
NON_NEGATIVE_INT = _number(int, 0, True, "an integer >= 0")
POSITIVE_FLOAT = _number(float, 0, False, "a number > 0")


#: What the exit status means (``kvstate --help`` and the README print this).
EXIT_CODES = {
    0: "success (plan: a configuration meets the SLOs)",
    1: "plan: no configuration meets the SLOs; demo: a byte differed or a block leaked",
    2: "bad input: an option, a scenario or trace file, an output path",
    3: "simulate: the run did not drain (a deadlock, or its time limit passed)",
    4: "plan: a configuration at most as cheap as any that meets the SLOs was too short to judge",
    130: "interrupted (Ctrl-C); plan keeps the rows so far in its --out file, if given",
    141: "stdout was closed early (e.g. piped into head)",
}


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (``kvstate CMD: error: ...``) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _overrides(p: argparse.ArgumentParser) -> None:
    """The scenario options ``simulate`` and ``plan`` share."""
    p.add_argument("scenario", nargs="?", metavar="SCENARIO",
                   help="a scenario TOML file or a preset name (`kvstate scenario --list`); default: the embedded one")
    g = p.add_argument_group("scenario overrides (applied in this order, --set last)")
    g.add_argument("--trace", help="replay this Mooncake-format JSONL trace instead of the scenario's arrivals")
    g.add_argument("--model", metavar="NAME_OR_CONFIG",
                   help="a model preset (llama-3-8b, llama-3-70b, ...) or a Hugging Face config.json")
    g.add_argument("--gpu", metavar="NAME", help=f"a GPU preset's datasheet and link figures ({', '.join(GPUS)})")
    g.add_argument("--mode", choices=MODES, help="pd: separate prefill and decode instances; colocated: both on "
                   "each instance ([scheduler], cluster.n_instances)")
    g.add_argument("--rate", type=POSITIVE_FLOAT, help="request rate, per second")
    g.add_argument("--num-prompts", type=POSITIVE_INT, help="number of requests")
    g.add_argument("--tp", type=POSITIVE_INT, help="tensor-parallel GPUs per instance")
    g.add_argument("--n-prefill", type=POSITIVE_INT, help="prefill instances")
    g.add_argument("--n-decode", type=POSITIVE_INT, help="decode instances")
    g.add_argument("--n-instances", type=POSITIVE_INT, help="co-located instances (--mode colocated)")
    g.add_argument("--seed", type=NON_NEGATIVE_INT, help="random seed (>= 0)")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="the SLOs as vllm bench serve spells them: any "
                   "of ttft:MS tpot:MS e2el:MS; a request is good when it meets every one given (the others are off)")
    g.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any scenario field, e.g. --set slo.ttft_ms=500 (repeatable; VALUE is JSON or text)")
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr")


def _add_demo(sub: Any) -> None:
    """``kvstate demo``: P -> storage -> D on real bytes, every byte checked."""
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
                   help="reference: numpy caches on the CPU (default); cuda: GPU caches through the CUDA kernels "
                        "(with --processes: each scheduler's caches on its GPU, its rank workers attached by CUDA IPC)")
    d.add_argument("--concurrency", type=POSITIVE_INT, default=8, help="requests in flight (default 8)")
    d.add_argument("--processes", action="store_true",
                   help="run P and D as separate processes, each a scheduler plus --tp rank-worker processes, over a "
                        "store that works across processes (a shared-memory arena, a FileStore, or Mooncake)")
    d.add_argument("--devices", type=_device_pair, metavar="P,D",
                   help="with --processes --backend cuda: P's and D's GPU (default 0,1 with two GPUs, else 0,0), "
                        "or one GPU a TP rank joined by '+' (--tp 2 --devices 0+1,0+1)")
    d.add_argument("--handoff", choices=("store", "direct", "both"), default="store",
                   help="how a cache reaches D: through the store (default), or pulled straight from P's caches "
                        "(direct; both: the store written too, for D to fall back on), with --processes")
    d.add_argument("--arm-reads", action=argparse.BooleanOptionalAction, default=None,
                   help="with --handoff direct or both: D queues each pull on the GPU when it reserves the blocks, "
                        "and P's lend fires it (default: on with --backend cuda, where the rank workers only move "
                        "bytes; docs/engine.md says when it is safe)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")


def _device_pair(text: str) -> tuple[int | tuple[int, ...], int | tuple[int, ...]]:
    """``P,D``: each a GPU index (all of that role's ranks there), or one GPU a TP rank joined
    by ``+`` (``0+1,1+0``: P's rank 0 on GPU 0 and rank 1 on GPU 1, D's the other way)."""
    parts = text.split(",")
    gpus = [[g.strip() for g in p.split("+")] for p in parts]
    if len(parts) != 2 or not all(g.isdigit() and int(g) < 1024 for role in gpus for g in role):
        raise argparse.ArgumentTypeError(f"expected two GPU indices P,D (each may be one GPU a TP rank, joined by "
                                         f"'+'), got {text!r}")
    p_gpus, d_gpus = (tuple(int(g) for g in role) for role in gpus)
    return (p_gpus if len(p_gpus) > 1 else p_gpus[0]), (d_gpus if len(d_gpus) > 1 else d_gpus[0])


def _check_demo(args: argparse.Namespace) -> None:
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
    _check_demo_engines(args)
    if args.store != "mooncake" and (args.start_master or args.master or args.metadata):
        raise ConfigError("--master, --metadata and --start-master go with --store mooncake")
    if args.store == "mooncake":
        if args.start_master and (args.master or args.metadata):
            raise ConfigError("--start-master starts its own master: drop --master/--metadata")
        if not args.start_master and not (args.master and args.metadata):
            raise ConfigError("--store mooncake needs --master HOST:PORT and --metadata URL, or --start-master")


def _check_demo_engines(args: argparse.Namespace) -> None:
    """The engines' options: the handoff, the GPUs."""
    if args.handoff != "store" and not args.processes:
        raise ConfigError("--handoff direct or both needs --processes (P and D running side by side)")
    if args.arm_reads and args.handoff == "store":
        raise ConfigError("--arm-reads arms direct pulls: it goes with --handoff direct or both")
    if args.devices is not None and not (args.processes and args.backend == "cuda"):
        raise ConfigError("--devices goes with --processes --backend cuda")
    if args.backend == "cuda":
        from ..kernels._cuda_launch import cuda_available

        if not cuda_available():
            raise ConfigError("--backend cuda needs CuPy and a CUDA device (none here)")


def _arms_reads(args: argparse.Namespace) -> bool:
    """``--arm-reads`` as asked; unasked, on where the rank workers' GPUs compute nothing (the
    CUDA backend with a direct handoff), the one place arming was measured safe."""
    if args.arm_reads is not None:
        return bool(args.arm_reads)
    return args.backend == "cuda" and args.handoff != "store"


def _demo(args: argparse.Namespace) -> int:
    from ._demo import DemoConfig, format_summary, run_demo

    _check_demo(args)
    cfg = DemoConfig(requests=args.requests, seed=args.seed, tp=args.tp, store=args.store or "memory",
                     store_dir=args.store_dir, concurrency=args.concurrency, backend=args.backend,
                     handoff=args.handoff, devices=args.devices, arm_reads=_arms_reads(args))
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


def _add_profile(sub: Any) -> None:
    """``kvstate profile``: measure a model's kernels on this GPU into a profile file."""
    p = sub.add_parser("profile", help="time a model's GEMMs, attention, element-wise kernels and all-reduce on "
                                       "this GPU; a scenario given the file (gpu.profile) interpolates it")
    p.add_argument("--model", required=True, metavar="NAME_OR_CONFIG",
                   help="a model preset (llama-3-8b, ...) or a Hugging Face config.json")
    p.add_argument("--tp", type=POSITIVE_INT, default=1, help="the TP degree whose per-rank shapes are timed "
                                                              "(all-reduce too, where that many GPUs are present)")
    p.add_argument("--out", required=True, help="the profile file to write (JSON)")
    p.add_argument("--quick", action="store_true", help="half the token sizes (a quicker, coarser profile)")


def _profile(args: argparse.Namespace) -> int:
    from ..sim._models import resolve_model
    from ._gpuprofile import measure_profile

    out = simcmds.check_output_file(args.out, "--out")
    model = resolve_model(args.model)
    profile = measure_profile(model, args.tp, quick=args.quick)
    simcmds.write_json(out, profile, "--out")
    gemm = profile["gemm"]
    print(f"kvstate profile: {model.name} at TP {args.tp} on {profile['gpu']['name']}: {len(gemm)} GEMMs over "
          f"{len(next(iter(gemm.values())))} sizes, attention, element-wise"
          + (", all-reduce" if profile["allreduce"] else "") + f"; wrote {out}")
    print(json.dumps({"gpu": profile["gpu"], "tp": args.tp}))
    return 0


def _add_arena(sub: Any) -> None:
    """``kvstate arena``: make a shared-memory arena store and hold it for a host's engines."""
    p = sub.add_parser("arena", help="make a shared-memory arena store, print its path, and hold it until stopped "
                                     "(P's and D's engines on this host name the path)")
    p.add_argument("--slot-bytes", type=POSITIVE_INT, required=True,
                   help="one object: one block of one kind, every layer, one rank "
                        "(layers x heads/TP x block size x head dim x dtype bytes)")
    p.add_argument("--slots", type=POSITIVE_INT, required=True,
                   help="objects it holds (its memory: slots x slot bytes)")
    p.add_argument("--small-bytes", type=POSITIVE_INT, default=1024, help="a manifest slot (default 1024)")
    p.add_argument("--tag", default="", help="the geometry it is for; an opener naming another is refused")
    p.add_argument("--directory", help="where the file goes (default /dev/shm)")


def _arena(args: argparse.Namespace) -> int:
    """Make the arena (every page touched now), print its path, hold it until SIGTERM or
    SIGINT, then remove it; the engines' mappings stay valid until they exit."""
    from ..backends._arena import ArenaStore

    store = ArenaStore.create(args.slot_bytes, args.slots, small_bytes=args.small_bytes, tag=args.tag,
                              directory=args.directory)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(store.path, flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        store.close()
    return 0


def _parser() -> argparse.ArgumentParser:
    codes = "\n".join(f"  {k:>3}  {v}" for k, v in EXIT_CODES.items())
    p = _Parser(prog="kvstate", description="The KV-cache life of PD-disaggregated LLM serving: simulate a "
                "cluster, plan capacity, run the demo.", epilog=f"exit status:\n{codes}",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"kvstate {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser, metavar="COMMAND")
    s = sub.add_parser("simulate", help="simulate a PD cluster under a workload (the production machines, SimPy)")
    _overrides(s)
    s.add_argument("--json", action="store_true", help="print every metric as one JSON object")
    s.add_argument("--percentile-metrics", metavar="M,M", help="report percentiles of these, as vllm bench serve: "
                   "any of ttft,tpot,itl,e2el (default with --metric-percentiles: ttft,tpot,itl)")
    s.add_argument("--metric-percentiles", metavar="Q,Q", help="the percentiles to report, as vllm bench serve: "
                   "numbers in (0, 100] (default with --percentile-metrics: 99)")
    s.add_argument("--plot", metavar="DIR", help="write PNG charts (latency CDFs, utilisation) into DIR")
    s.add_argument("--timeline", metavar="FILE", help="write every request's states, transfers and steps as a "
                   "Chrome trace (Perfetto, chrome://tracing) to FILE (PD runs)")
    pl = sub.add_parser("plan", help="sweep scenario fields; find the cheapest configuration meeting the SLOs")
    _overrides(pl)
    pl.add_argument("--sweep", action="append", default=[], metavar="FIELD=V1,V2",
                    help="a field and its values, e.g. cluster.n_decode=1,2,4 (repeatable; each field once); "
                         "default: cluster.n_prefill and cluster.n_decode 1..4")
    pl.add_argument("--attainment", type=_number(float, 0, False, "a number in (0, 1]"),
                    help="share of requests that must meet each SLO (default: the scenario's)")
    pl.add_argument("--workers", type=POSITIVE_INT, help="parallel simulations (default: every core)")
    pl.add_argument("--ray", metavar="ADDRESS", help="run the configurations as tasks on a Ray cluster: 'auto' "
                    "(the one this machine runs), HOST:PORT or ray://HOST:PORT (needs the ray extra; results "
                    "are the same as with local processes)")
    pl.add_argument("--out", metavar="FILE", help="write the JSON result to FILE, rewritten as rows come (none "
                    "without it)")
    pl.add_argument("--search-rate", action="store_true", help="also find, for each configuration, the highest "
                    "arrival rate at which it still meets the SLOs (a bisection on the rate, to within 5 %%)")
    pl.add_argument("--plot", metavar="DIR", help="write plan.png (every configuration) into DIR")
    pl.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    sc = sub.add_parser("scenario", help="print the default scenario, or a preset, as commented TOML")
    sc.add_argument("name", nargs="?", default="default", help="a preset (default: the embedded default)")
    sc.add_argument("--list", action="store_true", help="list the presets")
    _add_demo(sub)
    _add_profile(sub)
    _add_arena(sub)
    g = sub.add_parser("diagram", help="print each lifecycle machine's diagram (mermaid), drawn from the machines")
    g.add_argument("--machine", choices=("prefill", "decode"), help="only this machine")
    return p


def _diagram(args: argparse.Namespace) -> int:
    from .. import MACHINES
    from .._machine import mermaid

    names = [args.machine] if args.machine else list(MACHINES)
    print("\n\n".join(f"```mermaid\n{mermaid(MACHINES[n]).rstrip()}\n```" for n in names))
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "simulate": simcmds.simulate, "plan": simcmds.plan, "scenario": simcmds.scenario,
    "demo": _demo, "diagram": _diagram, "profile": _profile, "arena": _arena,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (:data:`EXIT_CODES`)."""
    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.cmd](args)
    except KVStateError as e:
        print(f"kvstate {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except simcmds.Interrupted as e:
        print(f"kvstate {args.cmd}: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"kvstate {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`kvstate diagram | head -1`): stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return 141
    except OSError as e:  # an output that could not be written after all (disk full, ...)
        raise SystemExit(f"kvstate {args.cmd}: error: {ConfigError(str(e))}") from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
