"""The simulator's commands: ``kvstate simulate``, ``kvstate plan`` and ``kvstate scenario``, and the
progress line a long run shows on a terminal."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from .._errors import ConfigError
from ..sim._gpus import gpu_overrides
from ..sim._metrics import SLOS
from ..sim._models import resolve_model
from ..sim._presets import PRESETS, describe, preset
from ..sim._scenario import ModelSpec, Scenario
from ..sim._scenario_io import load_scenario, to_toml, with_overrides
from ..sim._workload import check_workload

__all__ = ["simulate", "plan", "scenario", "build_scenario", "check_mode_options", "check_output_file",
           "check_output_dir", "write_json", "Interrupted", "Progress"]


class Progress:
    """``update(done, total)`` redraws ``label: done/total`` at most five times a second, once
    the run has taken ``after`` seconds; ``close()`` ends the line. Silent when ``quiet`` or
    when ``stream`` is not a terminal (a pipe or a CI log gets the result only)."""

    def __init__(self, label: str, quiet: bool = False, stream: TextIO | None = None, after: float = 2.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.label, self.after = label, after
        self.enabled = not quiet and bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self._last = 0.0
        self.shown = False

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.after or (now - self._last < 0.2 and done < total):
            return
        self._last = now
        pct = 100 * done // total if total else 100
        self.stream.write(f"\r{self.label}: {done:,}/{total:,} ({pct} %), {now - self.start:.0f} s")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False


class Interrupted(Exception):
    """Ctrl-C during a command: what it kept is in the message (the CLI prints it, exit 130)."""

_SHORTCUTS = (("rate", "workload.rate"), ("num_prompts", "workload.num_requests"), ("tp", "cluster.tp"),
              ("n_prefill", "cluster.n_prefill"), ("n_decode", "cluster.n_decode"), ("mode", "cluster.mode"),
              ("n_instances", "cluster.n_instances"))
#: what --model sets: the model's own fields (the KV block size is the engine's setting)
_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelSpec) if f.name != "block_size")
_LAYER_KINDS = ("window", "window_layers", "state_layers", "state_bytes")  #: what --model fixes for good
#: with a trace, --rate re-times its arrivals and --num-prompts takes its first requests
_TRACE_SHORTCUTS = {"rate": "workload.trace_rate", "num_prompts": "workload.trace_requests"}


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
        model = resolve_model(args.model)
        over.update({f"model.{k}": getattr(model, k) for k in _MODEL_FIELDS})
    if args.gpu:
        over.update(gpu_overrides(args.gpu))
    sets: dict[str, Any] = {}
    for item in args.set:
        field, sep, value = item.partition("=")
        if not sep or not field.strip():
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. slo.ttft_ms=500")
        sets[field.strip()] = _set_value(value)
    trace = sets.get("workload.arrival", over.get("workload.arrival", sc.workload.arrival)) == "trace"
    over.update({_TRACE_SHORTCUTS.get(opt, field) if trace else field: getattr(args, opt)
                 for opt, field in _SHORTCUTS if getattr(args, opt) is not None})
    if args.model:
        _check_layer_kinds(args.model, model, sets)
    over.update(sets)
    if args.seed is not None:
        over["seed"] = args.seed
    if getattr(args, "goodput", None):
        over.update(parse_goodput(args.goodput))
    return with_overrides(sc, over) if over else sc


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``--goodput ttft:500 tpot:50`` as ``{"slo.ttft_ms": 500.0, "slo.tpot_ms": 50.0,
    "slo.e2el_ms": 0.0}``: the SLOs named, every other one off (vllm bench serve's meaning)."""
    out = {f"slo.{key}": 0.0 for key, _ in SLOS.values()}
    seen: set[str] = set()
    for item in items:
        name, sep, value = item.partition(":")
        if name not in SLOS:
            raise ConfigError(f"--goodput {item!r}: unknown SLO {name!r} (known: {', '.join(SLOS)}, as vllm bench "
                              "serve's --goodput; ITL has no per-request SLO there)")
        if name in seen:
            raise ConfigError(f"--goodput {item!r}: {name} is given twice")
        try:
            ms = float(value) if sep else math.nan
        except ValueError:
            ms = math.nan
        if not 0 < ms < math.inf:
            raise ConfigError(f"--goodput {item!r}: expected {name}:MS with MS a number of milliseconds > 0")
        seen.add(name)
        out[f"slo.{SLOS[name][0]}"] = ms
    return out


#: the shortcut options that mean something in one mode only
_MODE_OPTIONS = {"n_instances": "colocated", "n_prefill": "pd", "n_decode": "pd"}


def check_mode_options(args: argparse.Namespace, modes: set[str]) -> None:
    """Refuse a shortcut option that no mode of the run (``modes``: a plan may sweep both) uses:
    ``--n-instances`` counts co-located instances, ``--n-prefill`` and ``--n-decode`` PD's."""
    for opt, mode in _MODE_OPTIONS.items():
        if getattr(args, opt, None) is not None and mode not in modes:
            flag = "--" + opt.replace("_", "-")
            raise ConfigError(f"{flag}: a {mode} setting; this run's mode is {' and '.join(sorted(modes))} "
                              f"(--mode {mode} to use it)")


def _check_layer_kinds(source: str, model: ModelSpec, sets: dict[str, Any]) -> None:
    """A model's sliding-window and state layers, and its state's size, are its config's (or
    preset's): a --set that contradicts them is refused, not simulated."""
    for k in _LAYER_KINDS:
        v = sets.get(f"model.{k}")
        if v is not None and v != getattr(model, k):
            raise ConfigError(f"--set model.{k}={v!r}: --model {source} gives {getattr(model, k)!r} (its layer kinds "
                              "and state size are the model's)")


def _probe(directory: Path, path: str, option: str) -> None:
    """Create and remove a file in ``directory``: the only test of writability that root, a
    read-only mount and a pseudo file system (/sys) all answer truthfully."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvstate-probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"{option} {path}: cannot write in {str(directory)!r} ({e.strerror or e})") from None


def check_output_file(path: str, option: str) -> Path:
    """An output file whose directory exists and takes files, and which is not a directory."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{option} {path}: is a directory, not a file")
    if not p.parent.is_dir():
        raise ConfigError(f"{option} {path}: directory {str(p.parent)!r} does not exist")
    _probe(p.parent, path, option)
    return p


def check_output_dir(path: str, option: str) -> Path:
    """An output directory that exists and takes files, or whose parent does (the directory is
    then created when used; the check makes and removes it)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{option} {path}: is a file, not a directory")
    if p.exists():
        _probe(p, path, option)
        return p
    if not p.parent.is_dir():
        raise ConfigError(f"{option} {path}: directory {str(p.parent)!r} does not exist")
    try:
        p.mkdir()
    except OSError as e:
        raise ConfigError(f"{option} {path}: cannot create it ({e.strerror or e})") from None
    try:
        _probe(p, path, option)
    finally:
        p.rmdir()
    return p


def _file_mode() -> int:
    """What ``open()`` would give a new file: 0o666 less the umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_json(path: Path, data: Any, option: str) -> None:
    """Write atomically, with the usual permissions: a reader never sees half a file, a crash
    leaves the previous one; an error names the user's path, not the temporary file."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as e:
        raise ConfigError(f"{option} {path}: cannot write ({e.strerror or e})") from None
    try:
        os.fchmod(fd, _file_mode())
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise ConfigError(f"{option} {path}: cannot write ({e.strerror or e})") from None
        raise


def simulate(args: argparse.Namespace) -> int:
    from ..sim._report import format_report, to_json
    from ..sim._run import simulate as run

    sc = build_scenario(args)
    check_mode_options(args, {sc.cluster.mode})
    sc.gpu_blocks()  # the model fits, within the run's bounds: said before the run
    check_workload(sc.workload, sc.model.context, sc.time_limit_s)
    plot_dir = check_output_dir(args.plot, "--plot") if args.plot else None
    trace = check_output_file(args.timeline, "--timeline") if args.timeline else None
    if plot_dir is not None:
        from ..sim._plot import pyplot

        pyplot()  # matplotlib missing: say so before the run, not after
    timeline = None
    if trace is not None:
        from .._timeline import Timeline

        timeline = Timeline()
    asked = parse_percentiles(args.percentile_metrics, args.metric_percentiles)
    bar = Progress("simulate", args.quiet)
    try:
        r = run(sc, progress=bar.update, timeline=timeline)
    finally:
        bar.close()
    if asked is not None:
        from ..sim._metrics import percentiles

        r["percentiles"] = percentiles(r, *asked)
    if timeline is not None and trace is not None:
        write_json(trace, timeline.to_json(), "--timeline")
        print(f"kvstate simulate: wrote {trace}", file=sys.stderr)
    if plot_dir is not None:
        from ..sim._plot import plot_simulation

        plot_dir.mkdir(exist_ok=True)
        print(f"kvstate simulate: wrote {', '.join(plot_simulation(r, r['_latencies_ms'], plot_dir))}",
              file=sys.stderr)
    print(to_json(r) if args.json else format_report(r))
    return 0 if r["drained"] and not r["deadlock"] else 3


def parse_percentiles(metrics: str | None, qs: str | None) -> tuple[list[str], list[float]] | None:
    """``--percentile-metrics`` and ``--metric-percentiles`` as vllm bench serve takes them (either
    alone takes the other's default), or None when neither is given; a bad one is refused."""
    from ..sim._metrics import PERCENTILE_METRICS

    if metrics is None and qs is None:
        return None
    names = [m.strip() for m in (metrics or "ttft,tpot,itl").split(",")]
    for m in names:
        if m not in PERCENTILE_METRICS:
            raise ConfigError(f"--percentile-metrics: unknown metric {m!r} (known: {', '.join(PERCENTILE_METRICS)})")
    values = []
    for q in (qs or "99").split(","):
        try:
            v = float(q)
        except ValueError:
            v = math.nan
        if not 0 < v <= 100:
            raise ConfigError(f"--metric-percentiles: {q.strip()!r} is not a percentile in (0, 100]")
        values.append(v)
    return list(dict.fromkeys(names)), list(dict.fromkeys(values))


def _verdict_text(r: dict[str, Any]) -> str:
    """A plan row's verdict in a table cell."""
    if r["verdict"] == "too short":
        more = f"; ~{r['requests_needed']:,} requests would tell" if r["requests_needed"] else ""
        return f"too short to judge: rates uncertain by {100 * r['rate_uncertainty']:.1f} %{more}"
    return {"meets": "meets", "fails": "no: " + "; ".join(r["unmet"]),
            "infeasible": f"infeasible: {r['reason']}"}[r["verdict"]]


def _max_rate(r: dict[str, Any]) -> str:
    """A row's highest rate held, with how far above it the limit may lie."""
    if r.get("max_rate_rps") is None:
        return f"{'-':>14}"
    p = r["max_rate_precision"]
    return f"{r['max_rate_rps']:>8.2f}" + (f" +{100 * p:>3.0f}%" if p is not None else "      ")


def _plan_table(res: dict[str, Any], names: list[str]) -> list[str]:
    slo = res["slo"]
    search = res.get("ties_broken_by") == "max_rate_rps"
    slos = ", ".join(f"{label} {slo[key]:g} ms" for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"),
                                                                   ("e2el_ms", "E2E")) if slo.get(key))
    lines = [f"target {res['rate']:g} req/s offered; SLOs {slos}, "
             f"each met by >= {100 * res['attainment']:.0f} % of requests, goodput >= that x offered",
             "".join(f"{n.split('.')[-1]:>14}" for n in names) + f"{'GPUs':>6}{'$/h':>9}{'$/Mtok':>8}{'offered':>9}"
             f"{'goodput':>9}{'failed':>8}{'TTFT ok':>9}{'TPOT ok':>9}{'TTFT p99':>10}"
             + (f"{'max rate':>14}" if search else "") + "  verdict",
             "(rates in req/s over the steady window's arrivals; $/h: the GPUs' on-demand price, $/Mtok: per "
             "million output tokens served; failed: requests that ended without an answer; TTFT ok and TPOT ok: of "
             "the requests that reached each)"]
    for r in res["rows"]:
        cells = "".join(f"{r['config'][n]!s:>14}" for n in names)
        if not r["feasible"] and r["gpus"] is None:
            lines.append(f"{cells}{'-':>6}  infeasible: {r['reason']}")
            continue
        verdict = _verdict_text(r)
        lines.append(f"{cells}{r['gpus']:>6}{_money(r['cost_per_hour'], 9)}{_money(r['cost_per_mtok'], 8)}"
                     f"{r['offered_rps']:>9.2f}{r['goodput_rps']:>9.2f}"
                     f"{sum(r['failed'].values()):>8,}"
                     f"{100 * r['ttft_attainment']:>8.1f}%{100 * r['tpot_attainment']:>8.1f}%"
                     f"{r['ttft_p99_ms'] or 0:>10.1f}" + (_max_rate(r) if search else "") + f"  {verdict}")
    lines += _recommendation(res, search)
    if res["undecided"]:
        lines.append(f"undecided: {len(res['undecided'])} configuration(s) at most as cheap were too short to judge "
                     f"({'; '.join(_config(c) for c in res['undecided'][:4])}): rerun with more requests")
    return lines


def _money(usd: float | None, width: int) -> str:
    return f"{'-':>{width}}" if usd is None else f"{usd:>{width}.2f}"


def _deployment(r: dict[str, Any]) -> str:
    """One row as a sentence's clause: its configuration, GPUs, cost, the rate it holds."""
    cost = f", ${r['cost_per_hour']:,.2f}/h" if r.get("cost_per_hour") is not None else ""
    mtok = f", ${r['cost_per_mtok']:,.2f} per million output tokens" if r.get("cost_per_mtok") is not None else ""
    held = f", holds up to {r['max_rate_rps']:g} req/s" if r.get("max_rate_rps") is not None else ""
    return f"{_config(r['config'])} ({r['gpus']} GPUs{cost}{mtok}{held})"


def _recommendation(res: dict[str, Any], search: bool) -> list[str]:
    """The plan's verdict: the cheapest configuration meeting the SLOs, and the cheapest of each
    other mode swept beside it, with how cost was counted and ties broken."""
    b, by = res["best"], "money (each GPU's price an hour)" if res.get("cost_by") == "cost_per_hour" else "GPUs"
    if b is None:
        return ["no configuration meets the SLOs"]
    out = [f"recommended: {_deployment(b)}: the cheapest meeting the SLOs at {res['rate']:g} req/s; cost counted "
           f"in {by}, ties broken by {'the highest rate held' if search else 'goodput'}"]
    for mode, r in (res.get("best_by_mode") or {}).items():
        if mode != b.get("mode"):
            out.append(f"  best {'co-located' if mode == 'colocated' else 'disaggregated'} beside it: "
                       + (_deployment(r) if r else "none meets the SLOs"))
    return out


def _config(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items())


def plan(args: argparse.Namespace) -> int:
    from ..sim._capacity import parse_sweep
    from ..sim._capacity import plan as run_plan

    sc = build_scenario(args)
    sweep = parse_sweep(args.sweep) if args.sweep else {"cluster.n_prefill": [1, 2, 3, 4],
                                                        "cluster.n_decode": [1, 2, 3, 4]}
    check_mode_options(args, {str(m) for m in sweep.get("cluster.mode", [sc.cluster.mode])})
    check_workload(sc.workload, sc.model.context, sc.time_limit_s)
    out = check_output_file(args.out, "--out") if args.out else None
    plot_dir = check_output_dir(args.plot, "--plot") if args.plot else None
    if plot_dir is not None:
        from ..sim._plot import pyplot

        pyplot()
    rows: list[dict[str, Any]] = []
    bar = Progress("plan", args.quiet)

    total = [0]

    def on_row(row: dict[str, Any], done: int, n: int) -> None:  # the file holds every row so far
        rows.append(row)
        total[0] = n
        if out is not None:
            write_json(out, {"complete": False, "rows": rows, "sweep": sweep}, "--out")
        bar.update(done, n)

    try:
        res = run_plan(sc, sweep, attainment=args.attainment, workers=args.workers, ray=args.ray, on_row=on_row,
                       search_rate=args.search_rate)
    except KeyboardInterrupt:
        kept = ("no configuration had finished" if not rows else f"the {len(rows)} rows so far are in {out}"
                if out is not None else "give --out FILE to keep the rows of a run")
        raise Interrupted(f"interrupted after {len(rows)} of {total[0] or '?'} configurations; {kept}") from None
    finally:
        bar.close()
    if out is not None:
        write_json(out, res, "--out")
    if plot_dir is not None:
        from ..sim._plot import plot_plan

        plot_dir.mkdir(exist_ok=True)
        plot_plan(res, ", ".join(sweep), plot_dir / "plan.png")
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        print("\n".join(_plan_table(res, list(sweep))))
        wrote = [str(p) for p in (out, plot_dir / "plan.png" if plot_dir else None) if p is not None]
        if wrote:
            print(f"wrote {' and '.join(wrote)}")
    return 4 if res["undecided"] else 0 if res["best"] else 1


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
