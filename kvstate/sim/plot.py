"""PNG charts of a simulation or a plan (matplotlib, the optional ``plot`` extra)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["plot_simulation", "plot_plan", "pyplot"]


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a ConfigError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'kvstate[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_simulation(result: dict[str, Any], latencies: dict[str, list[float]], out_dir: str | Path) -> list[str]:
    """Latency CDFs and queues / block use / storage use over time; returns the files written."""
    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(exist_ok=True)  # its parent must exist: missing directories are not made up
    files = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (name, xs) in zip(axes, latencies.items()):
        xs = sorted(xs)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    files.append(str(out / "latency_cdf.png"))
    fig.savefig(files[-1], dpi=100)
    plt.close(fig)

    series = result["series"]
    t = [x["t"] for x in series]
    fig, axes = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    for i in range(len(series[0]["prefill_queue"]) if series else 0):
        axes[0].plot(t, [x["prefill_queue"][i] for x in series], label=f"P{i} prefill queue")
    for i in range(len(series[0]["decode_running"]) if series else 0):
        axes[0].plot(t, [x["decode_running"][i] for x in series], label=f"D{i} running")
        axes[0].plot(t, [x["decode_preempted"][i] for x in series], ls=":", label=f"D{i} preempted")
    axes[0].plot(t, [x["backlog"] for x in series], ls="--", label="backlog")
    axes[0].set_ylabel("requests")
    axes[0].legend(fontsize=7, ncol=3)
    total = result["gpu_blocks_per_instance"]
    for name in (series[0]["blocks_used"] if series else {}):
        axes[1].plot(t, [100 * x["blocks_used"][name] / total for x in series], label=name)
    axes[1].set_ylabel("GPU blocks used (%)")
    axes[1].legend(fontsize=7, ncol=4)
    cap = result["storage"]["capacity_bytes"]
    axes[2].plot(t, [100 * x["storage_used_bytes"] / cap for x in series])
    axes[2].set_ylabel("storage used (%)")
    axes[2].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    files.append(str(out / "utilisation.png"))
    fig.savefig(files[-1], dpi=100)
    plt.close(fig)
    return files


def plot_plan(rows: list[dict[str, Any]], x: str, out_file: str | Path) -> str:
    """Goodput and TTFT p99 of every swept configuration, by ``x``."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    labels = [", ".join(f"{k.split('.')[-1]}={v}" for k, v in r["config"].items()) for r in rows]
    colors = ["tab:green" if r["meets_slo"] else "tab:red" if r["feasible"] else "tab:gray" for r in rows]
    axes[0].bar(range(len(rows)), [r.get("goodput_rps", 0.0) for r in rows], color=colors)
    axes[0].set_ylabel("goodput (req/s)")
    axes[1].bar(range(len(rows)), [r.get("ttft_p99_ms") or 0 for r in rows], color=colors)
    axes[1].set_ylabel("TTFT p99 (ms)")
    for ax in axes:
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"capacity plan (green: meets the SLOs, red: does not, gray: infeasible), by {x}")
    fig.tight_layout()
    fig.savefig(out_file, dpi=100)
    plt.close(fig)
    return str(out_file)
