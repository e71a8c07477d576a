"""PNG charts of a simulation or a plan (matplotlib, the optional ``plot`` extra)."""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from .._errors import ConfigError

__all__ = ["plot_simulation", "plot_plan", "plan_figure", "latency_figure", "pyplot", "run_title", "SPREAD_FOR_LOG"]


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a ConfigError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'kvstate[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


SPREAD_FOR_LOG = 20.0  #: a latency axis spanning more than this ratio (SLO line included) is drawn log


def _log_if_spread(values: list[float], line: float | None) -> bool:
    """Whether an axis holding ``values`` and the SLO ``line`` needs a log scale to show both."""
    pos = [v for v in [*values, *([line] if line else [])] if v and v > 0]
    return bool(pos) and max(pos) / min(pos) > SPREAD_FOR_LOG


def run_title(result: dict[str, Any]) -> str:
    """What a chart is of: the model, where it ran and how many GPUs, the load."""
    s = result["scenario"]
    c, w = s["cluster"], s["workload"]
    where = (f"{c['n_instances']} co-located" if result["mode"] == "colocated"
             else f"{c['n_prefill']} P + {c['n_decode']} D")
    load = f"{w['rate']:g} req/s" if w["arrival"] != "trace" else f"trace {Path(w['trace']).name}"
    return (f"{s['model']['name']}: {where}, TP {c['tp']}, {result['gpus']} x {s['gpu']['name']}; {load}, "
            f"{result['requests']:,} requests")


def latency_figure(result: dict[str, Any], latencies: dict[str, list[float]]) -> Any:
    """Latency CDFs, each with its SLO (a vertical line) and the attainment target (horizontal):
    the curve must cross the target's line left of the SLO's. The axis always reaches the SLO
    line, and turns logarithmic where the latencies and the line span more than
    :data:`SPREAD_FOR_LOG`, so a line far from the curve stays readable."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    slo = result["slo"]
    lines = {"TTFT": slo["ttft_ms"], "TPOT": slo["tpot_ms"], "E2E": slo.get("e2el_ms", 0.0)}
    for ax, (name, xs) in zip(axes, latencies.items()):
        xs = sorted(xs)
        line = lines.get(name) or None  # an SLO of 0 is none: no line
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
        else:
            ax.text(0.5, 0.5, "no request finished", ha="center", va="center", transform=ax.transAxes)
        if _log_if_spread(xs, line):
            ax.set_xscale("log")
        if line is not None:
            ax.axvline(line, color="tab:red", ls="--", lw=1.5, label=f"SLO {line:g} ms")
            ax.axhline(slo["target"], color="gray", ls=":", lw=1, label=f"target {100 * slo['target']:.0f} %")
            ax.legend(fontsize=8, loc="lower right")
        ax.set_xlabel(f"{name} (ms{', log scale' if ax.get_xscale() == 'log' else ''})")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(run_title(result), fontsize=10)
    fig.tight_layout()
    return fig


def plot_simulation(result: dict[str, Any], latencies: dict[str, list[float]], out_dir: str | Path) -> list[str]:
    """Latency CDFs and queues / block use / storage use over time; returns the files written."""
    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(exist_ok=True)  # its parent must exist: missing directories are not made up
    files = [str(out / "latency_cdf.png")]
    fig = latency_figure(result, latencies)
    fig.savefig(files[-1], dpi=100)
    plt.close(fig)

    series = result["series"]
    t = [x["t"] for x in series]
    pd = result["mode"] != "colocated"
    fig, axes = plt.subplots(3 if pd else 2, 1, figsize=(12, 9 if pd else 6.5), sharex=True)
    fig.suptitle(run_title(result), fontsize=10)
    _queues(axes[0], series, t, pd)
    total = result["gpu_blocks_per_instance"]
    for name in (series[0]["blocks_used"] if series else {}):
        axes[1].plot(t, [100 * x["blocks_used"][name] / total for x in series], label=name)
    axes[1].set_ylabel("GPU blocks used (%)")
    axes[1].legend(fontsize=7, ncol=4)
    if pd:
        cap = result["storage"]["capacity_bytes"]
        axes[2].plot(t, [100 * x["storage_used_bytes"] / cap for x in series])
        axes[2].set_ylabel("storage used (%)")
    axes[-1].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    files.append(str(out / "utilisation.png"))
    fig.savefig(files[-1], dpi=100)
    plt.close(fig)
    return files


def _queues(ax: Any, series: list[dict[str, Any]], t: list[float], pd: bool) -> None:
    """Requests queued and running per instance over time (P, D and the backlog; or co-located)."""
    lines = ((("prefill_queue", "P{} prefill queue", "-"), ("decode_running", "D{} running", "-"),
              ("decode_preempted", "D{} preempted", ":")) if pd else
             (("waiting", "C{} waiting", "-"), ("running", "C{} running", ":")))
    for key, label, style in lines:
        for i in range(len(series[0][key]) if series else 0):
            ax.plot(t, [x[key][i] for x in series], ls=style, label=label.format(i))
    if pd:
        ax.plot(t, [x["backlog"] for x in series], ls="--", label="backlog")
    ax.set_ylabel("requests")
    ax.legend(fontsize=7, ncol=3)


_COLORS = {"meets": "tab:green", "fails": "tab:red", "too short": "tab:orange", "infeasible": "tab:gray"}


def plot_plan(res: dict[str, Any], x: str, out_file: str | Path) -> str:
    """:func:`plan_figure` as a PNG; returns its path."""
    plt = pyplot()
    fig = plan_figure(res, x)
    fig.savefig(out_file, dpi=100)
    plt.close(fig)
    return str(out_file)


def _no_bar(r: dict[str, Any], key: str) -> str | None:
    """Why a plan row has no bar in the panel of ``key``, or None when it has one."""
    if r.get(key) is not None:
        return None
    if r["verdict"] == "infeasible":  # the rule broken, without the scenario's name and field
        rule = str(r.get("reason") or "").rsplit(": ", 1)[-1]
        return "infeasible:\n" + textwrap.shorten(rule, 70, placeholder="...").replace(" split", "\nsplit", 1)
    return "too few finished" if key != "goodput_rps" else "none finished"


def _plan_panel(ax: Any, rows: list[dict[str, Any]], key: str, line: float | None, colors: list[str],
                edges: list[str], target: float) -> None:
    """One panel of the plan chart: a bar a row, the row's reason where it has none, the SLO
    line (or the goodput needed), log where the bars and the line span too much."""
    values = [r.get(key) for r in rows]
    xs = range(len(rows))
    ax.bar(xs, [v or 0 for v in values], color=colors, edgecolor=edges, linewidth=2)
    if line and _log_if_spread([v for v in values if v], line):
        ax.set_yscale("log")
    if line:
        ax.axhline(line, color="black", ls="--", lw=1.5, label=f"SLO {line:g} ms")
    elif key == "goodput_rps":
        ax.scatter(xs, [target * r.get("offered_rps", 0.0) for r in rows], marker="_", s=300, color="black",
                   zorder=3, label=f"{target:g} x offered (needed)")
    for i, r in enumerate(rows):
        why = _no_bar(r, key)
        if why:
            ax.text(i, 0.02, why, rotation=90, ha="center", va="bottom", fontsize=7, color="dimgray",
                    transform=ax.get_xaxis_transform())


def plan_figure(res: dict[str, Any], x: str) -> Any:
    """Every swept configuration against the SLO tests it is judged by: goodput beside target x
    offered, and the TTFT and TPOT that the target share of requests met beside their SLOs.
    The chosen configuration is outlined and starred."""
    plt = pyplot()
    rows, slo, target = res["rows"], res["slo"], res["attainment"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    labels = [", ".join(f"{k.split('.')[-1]}={v}" for k, v in r["config"].items()) for r in rows]
    best = res["best"]["config"] if res.get("best") else None
    chosen = [r["config"] == best for r in rows]
    labels = [f"* {label} (chosen)" if c else label for label, c in zip(labels, chosen)]
    colors = [_COLORS[r["verdict"]] for r in rows]
    edges = ["black" if c else "none" for c in chosen]
    labels = [f"{label}\n{r['gpus']} GPUs" if r.get("gpus") else label for label, r in zip(labels, rows)]
    panels = (("goodput (req/s)", "goodput_rps", None),
              (f"TTFT met by {100 * target:.0f} % (ms)", "ttft_at_target_ms", slo["ttft_ms"]),
              (f"TPOT met by {100 * target:.0f} % (ms)", "tpot_at_target_ms", slo["tpot_ms"]))
    for ax, (title, key, line) in zip(axes, panels):
        _plan_panel(ax, rows, key, line, colors, edges, target)
        ax.set_ylabel(title + (" (log scale)" if ax.get_yscale() == "log" else ""))
        ax.legend(fontsize=7, loc="upper right")
        ax.set_xticks(list(range(len(rows))))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.grid(alpha=0.3, axis="y", which="both")
    target_rate = f", target {res['rate']:g} req/s" if res.get("rate") else ""
    fig.suptitle(f"capacity plan of {Path(str(res.get('base') or 'the default scenario')).name} by {x}{target_rate} "
                 f"(green: meets the SLOs, red: does not, orange: too short to judge, "
                 "gray: infeasible; * chosen)", fontsize=10)
    fig.tight_layout()
    return fig
