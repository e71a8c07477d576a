"""The simulator's commands: ``kvstate simulate``, ``kvstate plan`` and ``kvstate scenario``."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..sim.models import resolve_model
from ..sim.presets import PRESETS, describe, preset
from ..sim.scenario import Scenario
from ..sim.scenario_io import load_scenario, to_toml, with_overrides
from .progress import Progress

__all__ = ["simulate", "plan", "scenario", "build_scenario", "check_output_file", "check_output_dir"]

_SHORTCUTS = (("rate", "workload.rate"), ("num_prompts", "workload.num_requests"), ("tp", "cluster.tp"),
              ("n_prefill", "cluster.n_prefill"), ("n_decode", "cluster.n_decode"))


def _set_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # plain text: a string field


def build_scenario(args: argparse.Namespace) -> Scenario:
    """The scenario file or preset, then --trace, --model, the shortcuts, --set, --seed."""
    name = args.scenario
    is_preset = name is not None and not Path(name).exists() and name in PRESETS
    sc = preset(name) if is_preset else load_scenario(name)
    over: dict[str, Any] = {}
    if args.trace:
        over.update({"workload.arrival": "trace", "workload.trace": args.trace})
    if args.model:
        over.update({f"model.{k}": v for k, v in dataclasses.asdict(resolve_model(args.model)).items()})
    over.update({field: getattr(args, opt) for opt, field in _SHORTCUTS if getattr(args, opt) is not None})
    for item in args.set:
        field, sep, value = item.partition("=")
        if not sep or not field.strip():
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. slo.ttft_ms=500")
        over[field.strip()] = _set_value(value)
    if args.seed is not None:
        over["seed"] = args.seed
    return with_overrides(sc, over) if over else sc


def check_output_file(path: str, option: str) -> Path:
    """An output file whose directory exists and which is not a directory itself."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{option} {path}: is a directory, not a file")
    if not p.parent.is_dir():
        raise ConfigError(f"{option} {path}: directory {str(p.parent)!r} does not exist")
    if not os.access(p.parent, os.W_OK):
        raise ConfigError(f"{option} {path}: directory {str(p.parent)!r} is not writable")
    return p


def check_output_dir(path: str, option: str) -> Path:
    """An output directory that exists, or whose parent does (it is then created when used)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{option} {path}: is a file, not a directory")
    if not p.exists() and not p.parent.is_dir():
        raise ConfigError(f"{option} {path}: directory {str(p.parent)!r} does not exist")
    return p


def _write_json(path: Path, data: Any) -> None:
    """Write atomically: a reader never sees half a file, a crash leaves the previous one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def simulate(args: argparse.Namespace) -> int:
    from ..sim.report import format_report, to_json
    from ..sim.run import simulate as run

    sc = build_scenario(args)
    plot_dir = check_output_dir(args.plot, "--plot") if args.plot else None
    if plot_dir is not None:
        from ..sim.plot import pyplot

        pyplot()  # matplotlib missing: say so before the run, not after
    bar = Progress("simulate", args.quiet)
    try:
        r = run(sc, progress=bar.update)
    finally:
        bar.close()
    if plot_dir is not None:
        from ..sim.plot import plot_simulation

        plot_dir.mkdir(exist_ok=True)
        print(f"kvstate simulate: wrote {', '.join(plot_simulation(r, r['_latencies_ms'], plot_dir))}",
              file=sys.stderr)
    print(to_json(r) if args.json else format_report(r))
    return 0 if r["drained"] and not r["deadlock"] else 3


def _plan_table(res: dict[str, Any], names: list[str]) -> list[str]:
    slo = res["slo"]
    lines = [f"target {res['rate']:g} req/s; SLOs TTFT {slo['ttft_ms']:g} ms, TPOT {slo['tpot_ms']:g} ms, "
             f"each met by >= {100 * res['attainment']:.0f} % of requests, goodput >= that x offered",
             "".join(f"{n.split('.')[-1]:>14}" for n in names) + f"{'GPUs':>6}{'offered':>9}{'goodput':>9}"
             f"{'TTFT ok':>9}{'TPOT ok':>9}{'TTFT p99':>10}  verdict"]
    for r in res["rows"]:
        cells = "".join(f"{r['config'][n]!s:>14}" for n in names)
        if not r["feasible"] and r["gpus"] is None:
            lines.append(f"{cells}{'-':>6}  infeasible: {r['reason']}")
            continue
        verdict = "meets" if r["meets_slo"] else ("infeasible: " + r["reason"] if not r["feasible"]
                                                  else "no: " + "; ".join(r["unmet"]))
        lines.append(f"{cells}{r['gpus']:>6}{r['offered_rps']:>9.2f}{r['goodput_rps']:>9.2f}"
                     f"{100 * r['ttft_attainment']:>8.1f}%{100 * r['tpot_attainment']:>8.1f}%"
                     f"{r['ttft_p99_ms'] or 0:>10.1f}  {verdict}")
    b = res["best"]
    lines.append(f"cheapest meeting the SLOs: {', '.join(f'{k}={v}' for k, v in b['config'].items())} "
                 f"({b['gpus']} GPUs)" if b else "no configuration meets the SLOs")
    return lines


def plan(args: argparse.Namespace) -> int:
    from ..sim.capacity import parse_sweep
    from ..sim.capacity import plan as run_plan

    sc = build_scenario(args)
    sweep = parse_sweep(args.sweep) if args.sweep else {"cluster.n_prefill": [1, 2, 3, 4],
                                                        "cluster.n_decode": [1, 2, 3, 4]}
    out = check_output_file(args.out, "--out")
    plot_dir = check_output_dir(args.plot, "--plot") if args.plot else None
    if plot_dir is not None:
        from ..sim.plot import pyplot

        pyplot()
    rows: list[dict[str, Any]] = []
    bar = Progress("plan", args.quiet)

    def on_row(row: dict[str, Any], done: int, total: int) -> None:  # the file holds every row so far
        rows.append(row)
        _write_json(out, {"complete": False, "rows": rows, "sweep": sweep})
        bar.update(done, total)

    try:
        res = run_plan(sc, sweep, attainment=args.attainment, workers=args.workers, on_row=on_row)
    finally:
        bar.close()
    _write_json(out, res)
    if plot_dir is not None:
        from ..sim.plot import plot_plan

        plot_dir.mkdir(exist_ok=True)
        plot_plan(res["rows"], ", ".join(sweep), plot_dir / "plan.png")
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        print("\n".join(_plan_table(res, list(sweep))))
        print(f"wrote {out}" + (f" and {plot_dir / 'plan.png'}" if plot_dir else ""))
    return 0 if res["best"] else 1


def scenario(args: argparse.Namespace) -> int:
    if args.list:
        for name in PRESETS:
            print(f"{name:<20} {describe(name)}")
        return 0
    sc = preset(args.name)  # an unknown name: a ConfigError listing the presets
    title = (f"kvstate scenario preset {args.name!r}: {describe(args.name)}\n"
             f"Run it: kvstate simulate {args.name}  (or save this file and edit it: any key left out keeps its "
             "default)")
    print(to_toml(sc, title), end="")
    return 0
