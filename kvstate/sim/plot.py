"""PNG charts of a simulation or a plan (matplotlib, the optional ``plot`` extra)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["plot_simulation", "plot_plan", "plan_figure", "latency_figure", "pyplot"]


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a ConfigError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'kvstate[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def latency_figure(result: dict[str, Any], latencies: dict[str, list[float]]) -> Any:
    """Latency CDFs, each with its SLO (a vertical line) and the attainment target (horizontal):
    the curve must cross the target's line left of the SLO's."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    slo = result["slo"]
    lines = {"TTFT": slo["ttft_ms"], "TPOT": slo["tpot_ms"]}
    for ax, (name, xs) in zip(axes, latencies.items()):
        xs = sorted(xs)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
        if name in lines:
            ax.axvline(lines[name], color="tab:red", ls="--", lw=1, label=f"SLO {lines[name]:g} ms")
            ax.axhline(slo["target"], color="gray", ls=":", lw=1, label=f"target {100 * slo['target']:.0f} %")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
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
    xs = range(len(rows))
    panels = (("goodput (req/s)", "goodput_rps", None),
              (f"TTFT met by {100 * target:.0f} % (ms)", "ttft_at_target_ms", slo["ttft_ms"]),
              (f"TPOT met by {100 * target:.0f} % (ms)", "tpot_at_target_ms", slo["tpot_ms"]))
    for ax, (title, key, line) in zip(axes, panels):
        ax.bar(xs, [r.get(key) or 0 for r in rows], color=colors, edgecolor=edges, linewidth=2)
        if line is not None:
            ax.axhline(line, color="black", ls="--", lw=1, label=f"SLO {line:g} ms")
        else:
            ax.scatter(xs, [target * r.get("offered_rps", 0.0) for r in rows], marker="_", s=300, color="black",
                       zorder=3, label=f"{target:g} x offered (needed)")
        ax.set_ylabel(title)
        ax.legend(fontsize=7, loc="upper right")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"capacity plan by {x} (green: meets the SLOs, red: does not, orange: too short to judge, "
                 "gray: infeasible; * chosen)")
    fig.tight_layout()
    return fig
