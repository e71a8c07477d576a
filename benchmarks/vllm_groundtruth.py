"""Replay real vLLM serving runs through the co-located simulator and compare latencies.

Each run of ``../shared/data/vllm_groundtruth/`` (vLLM v0.15.1 on one H100 SXM, every
request's arrival, lengths, measured TTFT and E2E) is turned into the two files a user
would write, then simulated by the command a user would type::

    kvstate simulate RUN/scenario.toml --model MODEL/config.json --gpu H100-SXM --json

- ``trace.jsonl`` (Mooncake format, ``hash_block_size`` 16): each request's arrival, its
  prompt length as measured, its answer length as the load generator asked
  (``output_len``, with ``ignore_eos``: the client's own count falls short on some runs), and
  its prefix identity. The generator (inference-perf ``shared_prefix``) makes
  ``num_groups x num_prompts_per_group`` prompts, each a group's system prompt then a question,
  and sends them in one shuffled order, over and over: request ``i`` repeats prompt
  ``i mod N`` (the measured prompt lengths repeat with that period). The blocks a prompt
  shares with its group (BOS and the system prompt) get the group's hash ids, the rest the
  prompt's own. Which group each shuffled prompt belongs to is not recorded: prompt ``p``
  is put in group ``p // num_prompts_per_group``, which only matters before each prompt's
  first repeat.
- ``scenario.toml``: ``cluster.mode = "colocated"``, the TP degree, the server's scheduler
  settings (``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``, chunked prefill
  and prefix caching on, as vLLM's defaults), its block size and KV blocks.

Nothing is fitted to these runs: the compute model runs on its defaults and the H100-SXM
datasheet, or (``--profile``) on the kernels measured on the device machine's H200, carried to
the H100 through the two datasheets. Per run the table gives simulated against measured TTFT and E2E (mean, p90) and
their errors; for the overloaded runs (``reasoning``), whether the simulation shows the
overload (its throughput short of the offered rate, its queue still growing at the last
arrival). ``--json PATH`` writes ``runs`` (each with ``name``, ``ttft_mean_err_pct``,
``e2e_mean_err_pct``, ...) and ``max_ttft_mean_err_pct`` / ``max_e2e_mean_err_pct`` over the
runs that were not overloaded.

    python benchmarks/vllm_groundtruth.py [--data DIR] [--out DIR] [--json PATH] [--only SUBSTR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "vllm_groundtruth"
GOALS = {"e2e": 10.0, "ttft": 15.0}  #: |error| goals on the means, %, for runs that are not overloaded
#: the front end outside vLLM's engine (HTTP, SSE, the client), ms: client TTFT minus vLLM's own
#: ``time_to_first_token`` metric on the completions endpoint, the mean of the two rounds published in
#: vllm-project/vllm#54628 (8.4 and 12.0 ms). A peer's measurement, not one of these runs'.
FRONTEND_MS = 10.2


def _yaml_block(text: str, key: str) -> dict[str, Any]:
    """The scalar ``name: value`` lines under ``key:`` of a small YAML file (no YAML library needed)."""
    out: dict[str, Any] = {}
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"{key}:")
    indent = len(lines[start]) - len(lines[start].lstrip())
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        name, sep, value = line.strip().partition(":")
        if sep and value.strip():
            out[name.strip()] = value.strip()
    return out


def _stages(text: str) -> list[tuple[float, float]]:
    """(rate, duration) of each load stage of an inference-perf config."""
    out, rate = [], None
    for line in text.splitlines():
        s = line.strip().lstrip("- ")
        if s.startswith("rate:"):
            rate = float(s.split(":")[1])
        elif s.startswith("duration:") and rate is not None:
            out.append((rate, float(s.split(":")[1])))
            rate = None
    return out


def load_run(run: Path) -> dict[str, Any]:
    """One run's server settings, generator settings, requests and measurements."""
    req = json.loads((run / "requests.json").read_text())
    gen_text = (run / "results" / "config.yaml").read_text()
    gen = {k: int(v) for k, v in _yaml_block(gen_text, "shared_prefix").items()}
    server = {k: v for k, v in (line.split(":", 1) for line in (run / "exp-config.yaml").read_text().splitlines()
                                if ":" in line)}
    truth = {r["index"]: r for r in json.loads((run / "ground_truth.json").read_text())}
    return {"name": run.name, "config": req["config"], "model_id": req["model_id"], "gen": gen,
            "max_model_len": int(server["max_model_len"]), "stages": _stages(gen_text),
            "requests": sorted(req["requests"], key=lambda r: r["index"]), "truth": truth}


def trace_records(run: dict[str, Any], block: int) -> list[dict[str, Any]]:
    """The run's requests as Mooncake-format records (see the module's docstring)."""
    g = run["gen"]
    n_prompts = g["num_groups"] * g["num_prompts_per_group"]
    shared = (1 + g["system_prompt_len"]) // block  # BOS and the system prompt: whole blocks only
    known: dict[int, int] = {}  # prompt -> a measured length (failed requests have none)
    for r in run["requests"]:
        if r["input_tokens"] > 0:
            known.setdefault(r["index"] % n_prompts, r["input_tokens"])
    fallback = 1 + g["system_prompt_len"] + 1 + g["question_len"]
    out = []
    for r in run["requests"]:
        p = r["index"] % n_prompts
        n_in = r["input_tokens"] if r["input_tokens"] > 0 else known.get(p, fallback)
        group = p // g["num_prompts_per_group"]
        full = n_in // block
        ids = [group * 1000 + j if j < shared else 1_000_000 + p * 1000 + j for j in range(full)]
        out.append({"timestamp": r["arrival_time_us"] / 1000.0, "input_length": n_in,
                    "output_length": g["output_len"], "hash_ids": ids})
    return out


def write_inputs(run: dict[str, Any], out: Path, block: int = 16, frontend_ms: float = FRONTEND_MS) -> Path:
    """``trace.jsonl`` and ``scenario.toml`` of one run, in ``out``; returns the scenario."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "trace.jsonl", "w") as f:
        for rec in trace_records(run, block):
            f.write(json.dumps(rec) + "\n")
    c = run["config"]
    (out / "scenario.toml").write_text(f"""# {run['name']}: {run['model_id']} on vLLM, replayed
# (benchmarks/vllm_groundtruth.py)
time_limit_s = 20000.0

[cluster]
mode = "colocated"
n_instances = 1
tp = {c['tensor_parallelism']}
gpu_blocks = {c['kv_blocks_total_gpu']}

[scheduler]
max_num_batched_tokens = {c['max_num_batched_tokens']}
max_num_seqs = {c['max_num_seqs']}
max_model_len = {run['max_model_len']}
chunked_prefill = true
prefix_caching = true
frontend_ms = {frontend_ms}

[model]
block_size = {c['block_size']}

[workload]
arrival = "trace"
trace = "trace.jsonl"
hash_block_size = {block}
""")
    return out / "scenario.toml"


def simulate(scenario: Path, model_config: Path, profile: str = "") -> dict[str, Any]:
    """``kvstate simulate`` as a user runs it; its JSON."""
    cmd = [sys.executable, "-m", "kvstate", "simulate", str(scenario), "--model", str(model_config),
           "--gpu", "H100-SXM", "--json", "--quiet"] + (["--set", f"gpu.profile={profile}"] if profile else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=REPO)
    if done.returncode not in (0, 1):  # 1: the SLOs are not met, which does not matter here
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)


def _err(sim: float, real: float) -> float:
    return round(100.0 * (sim - real) / real, 2)


def compare(run: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Measured against simulated latencies of one run, and its overload signs."""
    ok = [t for t in run["truth"].values() if not t["has_error"]]
    ttft = np.array([t["ttft_s"] for t in ok]) * 1000.0
    e2e = np.array([t["e2e_s"] for t in ok]) * 1000.0
    real = {"ttft_mean": float(ttft.mean()), "ttft_p90": float(np.percentile(ttft, 90)),
            "e2e_mean": float(e2e.mean()), "e2e_p90": float(np.percentile(e2e, 90))}
    s = {"ttft_mean": sim["ttft_ms"]["mean"], "ttft_p90": sim["ttft_ms"]["p90"],
         "e2e_mean": sim["e2e_ms"]["mean"], "e2e_p90": sim["e2e_ms"]["p90"]}
    last_arrival = max(r["arrival_time_us"] for r in run["requests"]) / 1e6
    series = sim["series"]
    at_last = next((x for x in series if x["t"] >= last_arrival), series[-1])
    half = next((x for x in series if x["t"] >= last_arrival / 2), series[0])
    waiting_last, waiting_half = sum(at_last["waiting"]), sum(half["waiting"])
    offered = len(run["requests"]) / last_arrival
    overloaded = "reasoning" in run["name"]
    return {
        "name": run["name"], "overloaded": overloaded, "requests": len(run["requests"]),
        "errors_measured": len(run["requests"]) - len(ok),
        **{f"{k}_measured_ms": round(v, 2) for k, v in real.items()},
        **{f"{k}_sim_ms": v for k, v in s.items()},
        **{f"{k}_err_pct": _err(s[k], real[k]) for k in real},
        "sim_offered_rps": round(offered, 3), "sim_throughput_rps": sim["throughput_rps"],
        "sim_waiting_half_way": waiting_half, "sim_waiting_at_last_arrival": waiting_last,
        "sim_shows_overload": bool(waiting_last > waiting_half > 0 and sim["throughput_rps"] < 0.95 * offered),
        "sim_duration_s": sim["duration_s"], "sim_preemptions": sim["preemptions"],
        "sim_prefix_hit_rate": sim["prefix_hit_rate"],
    }


def _model_config(data: Path, model_id: str) -> Path:
    return data / "model_configs" / model_id.split("/")[-1] / "config.json"


#: the shipped H200 profiles of the runs' models (``--profile``), by model and TP
PROFILES = {("Llama-2-7b-hf", 1): "h200-llama-2-7b-tp1", ("CodeLlama-34b-Instruct-hf", 2): "h200-codellama-34b-tp2"}


def _one(data: Path, run_dir: Path, out: Path, profiled: bool, frontend_ms: float) -> dict[str, Any]:
    run = load_run(run_dir)
    scenario = write_inputs(run, out / run["name"], frontend_ms=frontend_ms)
    profile = PROFILES[(run["model_id"].split("/")[-1], run["config"]["tensor_parallelism"])] if profiled else ""
    return compare(run, simulate(scenario, _model_config(data, run["model_id"]), profile))


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'run':<44}{'TTFT mean ms':>20}{'err':>8}{'TTFT p90':>18}{'E2E mean s':>18}{'err':>8}"
            f"{'E2E p90 s':>16}  overload")
    lines = [head, "-" * len(head)]
    for r in rows:
        over = ("sim shows it" if r["sim_shows_overload"] else "NOT shown") if r["overloaded"] else \
            ("sim overloaded!" if r["sim_shows_overload"] else "-")
        lines.append(
            f"{r['name']:<44}{r['ttft_mean_sim_ms']:>9.1f} /{r['ttft_mean_measured_ms']:>8.1f}"
            f"{r['ttft_mean_err_pct']:>+7.1f}%{r['ttft_p90_sim_ms']:>8.1f} /{r['ttft_p90_measured_ms']:>7.1f}"
            f"{r['e2e_mean_sim_ms'] / 1e3:>8.3f} /{r['e2e_mean_measured_ms'] / 1e3:>7.3f}"
            f"{r['e2e_mean_err_pct']:>+7.1f}%"
            f"{r['e2e_p90_sim_ms'] / 1e3:>7.3f} /{r['e2e_p90_measured_ms'] / 1e3:>6.3f}  {over}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("KVSTATE_GROUNDTRUTH", DEFAULT_DATA)),
                    help="the ground-truth folder (default: ../shared/data/vllm_groundtruth)")
    ap.add_argument("--out", type=Path, help="keep each run's scenario.toml and trace.jsonl here")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--only", default="", help="runs whose name contains this")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--profile", action="store_true", help="use the kernels measured on the H200 (shipped "
                    "profiles), carried to the H100 through the two datasheets, instead of the roofline")
    ap.add_argument("--frontend-ms", type=float, default=FRONTEND_MS, help="the front end's time on each request's "
                    f"path, ms (default {FRONTEND_MS}: vllm-project/vllm#54628; 0: the engine alone)")
    a = ap.parse_args(argv)
    runs = sorted(p for p in (a.data / "runs").glob("*") if p.is_dir() and a.only in p.name)
    if not runs:
        print(f"vllm_groundtruth: no runs under {a.data / 'runs'}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvstate-groundtruth-") as tmp:
        out = a.out or Path(tmp)
        with ThreadPoolExecutor(max(1, a.workers)) as ex:
            rows = list(ex.map(lambda r: _one(a.data, r, out, a.profile, a.frontend_ms), runs))
    print(_table(rows))
    fair = [r for r in rows if not r["overloaded"]]
    result: dict[str, Any] = {"runs": rows, "goals_pct": GOALS,
                              "compute": "H200 profiles carried to the H100" if a.profile else "roofline defaults",
                              "frontend_ms": a.frontend_ms}
    for key in ("ttft_mean", "e2e_mean", "ttft_p90", "e2e_p90"):
        result[f"max_{key}_err_pct"] = max((abs(r[f"{key}_err_pct"]) for r in fair), default=None)
    result["overload_shown"] = all(r["sim_shows_overload"] for r in rows if r["overloaded"])
    print(f"\nnot overloaded ({len(fair)} runs): max |error| TTFT mean {result['max_ttft_mean_err_pct']} % "
          f"(goal {GOALS['ttft']}), E2E mean {result['max_e2e_mean_err_pct']} % (goal {GOALS['e2e']}); "
          f"overloaded runs shown overloaded: {result['overload_shown']}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
