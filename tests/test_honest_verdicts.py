"""``kvstate simulate`` and ``plan`` as a new user tries them: every verdict, rate and path honest."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstate.app._cli import main
from kvstate.sim import Cluster, Scenario, with_overrides
from kvstate.sim._metrics import summarize
from kvstate.sim._workload import load_trace, offered_rate

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "mooncake_synthetic_trace.jsonl"
TINY = ["--set", "workload.input_mean=300", "--set", "workload.output_mean=8", "--set", "workload.prefix_tokens=64"]


def run_json(capsys, *argv: str) -> dict:
    assert main(["simulate", "--json", "--quiet", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def no_simulation(monkeypatch) -> None:
    def boom(*a, **k):
        raise AssertionError("a simulation ran before the bad input was reported")
    monkeypatch.setattr("kvstate.sim._run.simulate", boom)
    monkeypatch.setattr("kvstate.sim._capacity.simulate", boom)


def one_line(capsys, needle: str) -> str:
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err, err
    return err


# -- short runs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [50, 100, 150])
def test_a_short_run_that_meets_every_slo_is_too_short_to_judge_not_failed(n, capsys):
    r = run_json(capsys, "--num-prompts", str(n))
    assert r["slo"]["attainment"] == 1.0 and r["reasons"] == {"done": n}
    assert r["slo"]["meets"] is False and r["slo"]["unmet"] == []
    assert r["slo"]["too_short"].startswith("too short to judge") and r["slo"]["requests_needed"] > n
    assert main(["simulate", "--quiet", "--num-prompts", str(n)]) == 0
    assert "verdict: too short to judge" in capsys.readouterr().out


def test_the_offered_rate_is_the_one_over_the_window_printed(capsys):
    """50 requests at 40 req/s arrive over ~1.4 s: the offered rate is the rate of the arrivals
    in the window printed beside it, never the requests over the whole run."""
    s = with_overrides(Scenario(), {"workload.num_requests": 50})
    cl = Cluster(s)
    r = summarize(cl, cl.run())
    arrivals = sorted(q.arrival for q in cl.done)
    a, b = r["window_s"]
    assert arrivals[0] <= a < b <= arrivals[-1] + 1e-6 and b - a < r["duration_s"] / 2
    inside = [t for t in arrivals if a - 1e-6 <= t <= b + 1e-6]
    expected = len(inside) / (b - a) if r["window"] == "steady" else (len(inside) - 1) / (b - a)
    assert r["offered_rps"] == pytest.approx(expected, rel=1e-3)
    assert r["offered_rps"] > 2 * 50 / r["duration_s"]  # not the run's 50 requests over its length
    assert main(["simulate", "--quiet", "--num-prompts", "50"]) == 0
    label = {"steady": "steady window", "arrival span": "arrival span"}[r["window"]]
    assert f"arrivals of the {label} {a:.1f}-{b:.1f} s, which every rate below counts" in capsys.readouterr().out


def test_a_short_run_that_misses_an_slo_still_fails(capsys):
    r = run_json(capsys, "--num-prompts", "50", "--set", "slo.ttft_ms=5")
    assert r["slo"]["meets"] is False and r["slo"]["too_short"] is None
    assert any("TTFT attainment" in u for u in r["slo"]["unmet"])


def test_a_long_enough_run_gets_a_verdict(capsys):
    r = run_json(capsys, "--num-prompts", "600")
    assert r["window"] == "steady" and r["slo"]["meets"] is True and r["slo"]["too_short"] is None
    assert r["rate_uncertainty"] < 0.05


def test_plan_on_a_short_run_is_undecided_not_infeasible(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--num-prompts", "50", "--sweep", "cluster.n_decode=1,2", "--workers", "1",
               "--out", str(out), "--quiet"])
    res = json.loads(out.read_text())
    assert rc == 4 and res["best"] is None
    assert [r["verdict"] for r in res["rows"]] == ["too short", "too short"]
    assert len(res["undecided"]) == 2 and all(r["feasible"] for r in res["rows"])
    text = capsys.readouterr().out
    assert "infeasible" not in text and "undecided" in text and "too short to judge" in text


# -- rates offered ------------------------------------------------------------------------------
def test_plan_over_a_trace_states_the_trace_rate(tmp_path, capsys):
    records = load_trace(TRACE)
    span_s = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000
    out = tmp_path / "plan.json"
    main(["plan", "--trace", str(TRACE), "--num-prompts", "40", "--sweep", "cluster.n_decode=1", "--workers", "1",
          "--out", str(out), "--quiet"])
    first40 = (records[39].timestamp_ms - records[0].timestamp_ms) / 1000
    res = json.loads(out.read_text())
    assert res["rate"] == pytest.approx(39 / first40, rel=1e-3)
    assert f"target {res['rate']:g} req/s" in capsys.readouterr().out
    s = with_overrides(Scenario(), {"workload.arrival": "trace", "workload.trace": str(TRACE)})
    assert offered_rate(s.workload) == pytest.approx((len(records) - 1) / span_s)  # 3.94 req/s, not 40


def test_a_trace_retimed_and_cut_as_vllm_bench_serve_does(capsys):
    """--rate re-times the trace to that mean rate, every gap scaled alike; --num-prompts
    takes its first requests."""
    r = run_json(capsys, "--trace", str(TRACE), "--rate", "10", "--num-prompts", "100")
    w = r["scenario"]["workload"]
    assert r["requests"] == 100 and (w["trace_rate"], w["trace_requests"]) == (10.0, 100)
    s = with_overrides(Scenario(), {"workload.arrival": "trace", "workload.trace": str(TRACE),
                                    "workload.trace_rate": 10.0, "workload.trace_requests": 100})
    cl = Cluster(s)
    cl.run()
    t = np.array(sorted(q.arrival for q in cl.done))
    assert len(t) == 100 and 99 / (t[-1] - t[0]) == pytest.approx(10.0)
    orig = np.array([x.timestamp_ms for x in load_trace(TRACE)[:100]]) / 1000
    scale = (t[-1] - t[0]) / (orig[-1] - orig[0])
    np.testing.assert_allclose(np.diff(t), np.diff(orig) * scale, atol=1e-9)  # the gaps' shape kept


@pytest.mark.parametrize("argv, needle", [
    (["--trace", str(TRACE), "--set", "workload.cv=2"], "cv does not apply to 'trace' arrivals"),
    (["--trace", str(TRACE), "--set", "workload.rate=3"], "use workload.trace_rate"),
    (["--set", "workload.trace_rate=3"], "trace_rate does not apply to 'poisson' arrivals (use workload.rate)"),
    (["--trace", str(TRACE), "--rate", "3", "--set", "workload.time_scale=0.5"], "not both"),
    (["--n-decode", "100000"], "n_decode: at most 1,024"),
    (["--n-prefill", "5000"], "n_prefill: at most 1,024"),
    (["--tp", "128"], "tp: at most 64"),
    (["--num-prompts", "1000000000"], "at most 2,000,000 requests"),
    (["--set", "cluster.gpu_blocks=1000000000"], "a run holds at most 67,108,864"),
    (["--set", "gpu.mem_gib=1e9"], "a run holds at most 67,108,864"),
])
def test_options_that_cannot_apply_or_would_exhaust_memory_are_refused(argv, needle, capsys, monkeypatch):
    no_simulation(monkeypatch)
    assert main(["simulate", *argv]) == 2
    one_line(capsys, needle)


# -- the whole plan checked before any simulation ---------------------------------------------------
@pytest.mark.parametrize("sweep, needle", [
    ("cluster.n_decode=1,x", "--sweep cluster.n_decode='x': n_decode: expected int"),
    ("cluster.n_decode=-1", "--sweep cluster.n_decode=-1: n_decode: must be > 0"),
    ("policy.preempt=bogus", "--sweep policy.preempt='bogus': Policy.preempt must be one of"),
    ("seed=-2", "--sweep seed=-2: seed: must be >= 0"),
    ("workload.trace_rate=2", "does not apply to 'poisson' arrivals"),
])
def test_a_bad_sweep_value_is_an_error_before_any_simulation(sweep, needle, tmp_path, capsys, monkeypatch):
    no_simulation(monkeypatch)
    assert main(["plan", "--sweep", sweep, "--out", str(tmp_path / "p.json")]) == 2
    one_line(capsys, needle)
    assert not (tmp_path / "p.json").exists()


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux's /sys (a file system nobody writes)")
@pytest.mark.parametrize("argv, needle", [
    (["plan", "--out", "/sys/plan.json"], "--out /sys/plan.json: cannot write in '/sys'"),
    (["plan", "--out", "/sys/kernel/plan.json"], "--out /sys/kernel/plan.json: cannot write"),
    (["simulate", "--plot", "/sys/kernel"], "--plot /sys/kernel: cannot write"),
    (["simulate", "--plot", "/sys/kvstate-charts"], "--plot /sys/kvstate-charts: cannot create it"),
])
def test_an_unwritable_output_is_refused_before_any_simulation(argv, needle, capsys, monkeypatch):
    """Even as root, for whom os.access says yes: the check writes a file and removes it."""
    no_simulation(monkeypatch)
    assert main(argv) == 2
    err = one_line(capsys, needle)
    assert ".kvstate-probe" not in err and ".plan.json." not in err


def test_output_files_get_the_usual_permissions(tmp_path, capsys):
    old = os.umask(0o022)
    try:
        out = tmp_path / "plan.json"
        main(["plan", "--num-prompts", "20", *TINY, "--sweep", "cluster.n_decode=1", "--workers", "1",
              "--out", str(out), "--quiet"])
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no probe or temporary file left


def test_a_plot_directory_checked_but_not_used_is_not_left_behind(tmp_path, capsys, monkeypatch):
    no_simulation(monkeypatch)
    assert main(["plan", "--sweep", "cluster.n_decode=0", "--plot", str(tmp_path / "charts"),
                 "--out", str(tmp_path / "p.json")]) == 2
    assert list(tmp_path.iterdir()) == []


# -- Ctrl-C -----------------------------------------------------------------------------------------
def interrupt(argv: list[str], cwd: Path, ready) -> subprocess.CompletedProcess:
    """Run ``kvstate ARGV`` in its own process group, SIGINT the group once ``ready()``."""
    p = subprocess.Popen([sys.executable, "-m", "kvstate", *argv], cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not ready() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.poll() is None, "the command ended before it could be interrupted"
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


@pytest.mark.slow
def test_ctrl_c_in_plan_prints_one_line_and_keeps_the_rows_so_far(tmp_path):
    out = tmp_path / "plan.json"
    r = interrupt(["plan", "--num-prompts", "30000", "--sweep", "cluster.n_decode=1,2,3", "--workers", "1",
                   "--out", str(out)], tmp_path, lambda: out.exists())
    assert r.returncode == 130, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "interrupted after 1 of 3 configurations" in r.stderr and str(out) in r.stderr
    kept = json.loads(out.read_text())
    assert kept["complete"] is False and len(kept["rows"]) == 1


@pytest.mark.slow
def test_ctrl_c_in_simulate_prints_one_line(tmp_path):
    started = time.monotonic()
    r = interrupt(["simulate", "--num-prompts", "200000"], tmp_path, lambda: time.monotonic() - started > 3)
    assert r.returncode == 130 and r.stderr == "kvstate simulate: interrupted\n", r.stderr


# -- charts and diagrams ----------------------------------------------------------------------------
def plan_result() -> dict:
    def row(n: int, verdict: str, ttft: float) -> dict:
        return {"config": {"cluster.n_decode": n}, "verdict": verdict, "meets_slo": verdict == "meets",
                "feasible": True, "goodput_rps": 9.0, "offered_rps": 10.0, "ttft_at_target_ms": ttft,
                "tpot_at_target_ms": 20.0}
    rows = [row(1, "fails", 1320.0), row(2, "meets", 800.0), row(3, "too short", 700.0)]
    return {"rows": rows, "best": rows[1], "slo": {"ttft_ms": 1000.0, "tpot_ms": 30.0}, "attainment": 0.9}


def test_the_plan_chart_draws_the_slo_lines_and_marks_the_chosen_configuration():
    pytest.importorskip("matplotlib")
    from kvstate.sim._plot import plan_figure
    fig = plan_figure(plan_result(), "cluster.n_decode")
    goodput, ttft, tpot = fig.axes
    assert any(list(line.get_ydata()) == [1000.0, 1000.0] for line in ttft.get_lines())
    assert any(list(line.get_ydata()) == [30.0, 30.0] for line in tpot.get_lines())
    labels = [t.get_text() for t in ttft.get_xticklabels()]
    assert [("chosen" in x) for x in labels] == [False, True, False]
    bars = ttft.patches
    assert bars[0].get_height() == 1320.0 and bars[0].get_facecolor()[:3] != bars[1].get_facecolor()[:3]
    assert bars[1].get_linewidth() > bars[0].get_linewidth() or bars[1].get_edgecolor() != bars[0].get_edgecolor()
    needed = goodput.collections[0].get_offsets()[:, 1]
    assert list(needed) == [9.0, 9.0, 9.0]  # 0.9 x offered, the goodput each must reach


def test_the_plan_chart_says_why_a_configuration_has_no_bar_and_goes_log_when_spread():
    pytest.importorskip("matplotlib")
    from kvstate.sim._plot import plan_figure
    res = plan_result()
    res["rows"][0]["ttft_at_target_ms"] = 60_000.0  # 60x the SLO: a linear axis would flatten the rest
    res["rows"].append({"config": {"cluster.n_decode": 4}, "verdict": "infeasible", "meets_slo": False,
                        "feasible": False, "gpus": None, "reason": "<x>: [cluster] tp: 8 KV heads do not split"})
    res["rate"], res["base"] = 10.0, "examples/llama-3-70b-h200.toml"
    fig = plan_figure(res, "cluster.n_decode")
    goodput, ttft, _ = fig.axes
    assert ttft.get_yscale() == "log" and goodput.get_yscale() == "linear"
    texts = [t.get_text() for t in ttft.texts]
    assert len(texts) == 1 and texts[0].startswith("infeasible:") and "KV heads" in texts[0]
    assert "llama-3-70b-h200.toml" in fig._suptitle.get_text() and "10 req/s" in fig._suptitle.get_text()


def test_plan_writes_no_file_without_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["plan", "--quiet", "--num-prompts", "20", *TINY, "--sweep", "cluster.n_decode=1", "--workers", "1"])
    assert list(tmp_path.iterdir()) == [] and "wrote" not in capsys.readouterr().out


def test_the_latency_chart_draws_the_slo_lines(capsys):
    pytest.importorskip("matplotlib")
    from kvstate.sim._plot import latency_figure
    from kvstate.sim._run import simulate
    r = simulate(with_overrides(Scenario(), {"workload.num_requests": 30, "workload.input_mean": 300.0,
                                             "workload.output_mean": 8.0, "workload.prefix_tokens": 64}))
    fig = latency_figure(r, r["_latencies_ms"])
    ttft, tpot, _ = fig.axes
    assert any(list(line.get_xdata()) == [1000.0, 1000.0] for line in ttft.get_lines())
    assert any(list(line.get_xdata()) == [30.0, 30.0] for line in tpot.get_lines())
    assert ttft.get_xscale() == "log"  # TTFTs of ~10 ms beside a 1,000 ms SLO line
    assert tpot.get_xscale() == "linear"  # TPOTs of ~6 ms beside a 30 ms one
    assert f"{r['gpus']} x H100-SXM" in fig._suptitle.get_text()


def test_diagram_prints_fenced_mermaid_blocks(capsys):
    assert main(["diagram"]) == 0
    text = capsys.readouterr().out
    blocks = text.split("\n\n")
    assert len(blocks) == 2
    for b in blocks:
        lines = b.strip().splitlines()
        assert lines[0] == "```mermaid" and lines[-1] == "```" and "stateDiagram-v2" in b
