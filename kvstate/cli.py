"""The ``kvstate`` command line: ``simulate``, ``plan``, ``demo`` and ``diagram``."""
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
    s = sub.add_parser("simulate", help="simulate a PD cluster under a workload (SimPy, the production machines)")
    s.add_argument("scenario", nargs="?", help="scenario TOML file (default: the embedded default scenario)")
    s.add_argument("--trace", help="replay this Mooncake-format JSONL trace instead of the scenario's arrivals")
    s.add_argument("--seed", type=int, help="override the scenario's seed")
    s.add_argument("--json", action="store_true", help="print every metric as one JSON object")
    s.add_argument("--plot", metavar="DIR", help="write PNG charts (latency CDFs, utilisation, queues) into DIR")
    pl = sub.add_parser("plan", help="sweep scenario fields; find the cheapest configuration meeting the SLOs")
    pl.add_argument("scenario", nargs="?", help="scenario TOML file (default: the embedded default)")
    pl.add_argument("--sweep", action="append", default=[], metavar="FIELD=V1,V2",
                    help="a field and its values, e.g. cluster.n_decode=1,2,4 (repeatable); "
                         "default: n_prefill and n_decode 1..4")
    pl.add_argument("--rate", type=float, help="target request rate (default: the scenario's)")
    pl.add_argument("--attainment", type=float, default=0.9, help="fraction of requests that must meet both SLOs")
    pl.add_argument("--workers", type=_positive_int, help="parallel simulations (default: every core)")
    pl.add_argument("--out", default="plan.json", help="JSON result file (default plan.json)")
    pl.add_argument("--plot", metavar="PNG", help="write a chart of every configuration")
    pl.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
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


def _simulate(args: argparse.Namespace) -> int:
    from .sim.metrics import format_report, simulate, to_json
    from .sim.scenario import load_scenario, with_overrides

    sc = load_scenario(args.scenario)
    over: dict = {}
    if args.seed is not None:
        over["seed"] = args.seed
    if args.trace:
        over.update({"workload.arrival": "trace", "workload.trace": args.trace})
    if over:
        sc = with_overrides(sc, over)
    r = simulate(sc)
    if args.plot:
        from .sim.plot import plot_simulation

        files = plot_simulation(r, r["_latencies_ms"], args.plot)
        print(f"kvstate: wrote {', '.join(files)}", file=sys.stderr)
    print(to_json(r) if args.json else format_report(r))
    return 0 if r["drained"] and not r["deadlock"] else 3


def _plan(args: argparse.Namespace) -> int:
    from .sim.plan import parse_sweep, plan
    from .sim.scenario import load_scenario

    sc = load_scenario(args.scenario)
    sweep = parse_sweep(args.sweep) if args.sweep else {"cluster.n_prefill": [1, 2, 3, 4],
                                                        "cluster.n_decode": [1, 2, 3, 4]}

    def progress(done: int, total: int) -> None:
        bar = "#" * (30 * done // total)
        print(f"\rplan [{bar:<30}] {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)

    res = plan(sc, sweep, rate=args.rate, attainment=args.attainment, workers=args.workers, progress=progress)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    if args.plot:
        from .sim.plot import plot_plan

        plot_plan(res["rows"], ", ".join(sweep), args.plot)
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        names = list(sweep)
        print(f"target {res['rate']} req/s; SLOs TTFT {res['slo']['ttft_ms']} ms, TPOT {res['slo']['tpot_ms']} ms, "
              f"met by >= {100 * res['attainment']:.0f} % of requests")
        print("  ".join(f"{n.split('.')[-1]:>12}" for n in names) + f"{'GPUs':>6}{'goodput':>9}{'attain':>8}"
              f"{'TTFT p99':>10}{'TPOT p99':>10}  ok")
        for r in res["rows"]:
            print("  ".join(f"{r['config'][n]!s:>12}" for n in names) + f"{r['gpus']:>6}{r['goodput_rps']:>9.2f}"
                  f"{r['slo_attainment']:>8.3f}{r['ttft_p99_ms'] or 0:>10.1f}{r['tpot_p99_ms'] or 0:>10.1f}  "
                  f"{'yes' if r['meets_slo'] else 'no'}")
        b = res["best"]
        print(f"cheapest meeting the SLOs: {b['config']} ({b['gpus']} GPUs)" if b else "no configuration meets the SLOs")
        print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0 if res["best"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "demo":
            return _demo(args)
        if args.cmd == "simulate":
            return _simulate(args)
        if args.cmd == "plan":
            return _plan(args)
        from .machines import MACHINES, mermaid

        names = [args.machine] if args.machine else list(MACHINES)
        print("\n\n".join(mermaid(MACHINES[n]) for n in names))
        return 0
    except KVStateError as e:
        print(f"kvstate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
