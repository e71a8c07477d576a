"""The benchmark scripts run and report the keys the docs quote (no timing asserted here)."""
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_lifecycle_benchmark_json_keys():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lifecycle.py"), "--requests", "50",
                        "--repeats", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("requests_per_s", "us_per_request", "baseline_us_per_request", "bytes_per_request"):
        assert out[key] > 0


@pytest.mark.slow
def test_every_benchmark_script_starts():
    """Each script's imports resolve and it answers --help (the GPU and Mooncake ones too,
    which need their hardware or server only once they run)."""
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    assert scripts
    for script in scripts:
        r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "usage" in r.stdout, (script.name, r.stderr[-500:])


def test_engine_sim_dry_run_serves_every_request(tmp_path):
    """The engine-against-simulator harness on a CPU stand-in: every request is served by P's
    and D's lifecycles and ends done in the simulator, no block leaks, and the fit holds out half."""
    out = tmp_path / "es.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_sim.py"), "--dry", "--layers", "2",
                        "--requests", "4", "--rate", "20", "--prompt", "100:600", "--output", "5",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    eng = res["engine"]
    assert eng["leaked_blocks"] == {"P": 0, "D": 0}
    assert eng["ttft_ms_p50"] > 0 and eng["tpot_ms_p50"] > 0
    assert eng["d_median_ms"]["step"] > 0
    for sim in res["simulator"].values():
        assert sim["reasons"] == {"done": 4}
    points = res["compute_fit"]["points"]
    held = [p for p in points if p["held_out"]]
    assert held and len(held) < len(points) and all("model_error" in p for p in held)


@pytest.mark.slow  # two trees' simulators in their own processes
def test_sim_benchmark_against_another_tree_reports_speedups():
    """--against runs each tree's own simulator in its own warm process, in pairs of runs, and
    compares the figures (here the tree against itself; no timing asserted)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim.py"), "--against", str(ROOT), "--quick",
                        "--repeats", "2", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["runs"] == 2 and set(out["speedup"]) == {"default_wall_s", "sim_requests_per_s"}
    assert all(v > 0 for v in out["speedup"].values())
    assert {k: v["median"] for k, v in out["paired"].items()} == out["speedup"]
    assert all(v["min"] <= v["median"] <= v["max"] and v["rounds"] == 2 for v in out["paired"].values())
    assert out["deterministic"] == {"this": True, "that": True}
    runs = out["this_runs"] + out["that_runs"]
    assert all(d["default_requests"] == 500 for d in runs)
    assert len({d["default_digest"] for d in runs}) == 1  # one tree: one report, whichever process ran it
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim.py"), "--against", str(ROOT / "docs")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no kvstate/sim there" in bad.stderr


def _sim_bench():
    """benchmarks/sim.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("sim_bench", ROOT / "benchmarks" / "sim.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_sim_benchmark_against_runs_only_the_scenarios_asked(tmp_path):
    """--scenarios picks the figures compared (a run can spend its pairs on one); an unknown
    name is refused before any tree runs."""
    bench = _sim_bench()
    assert set(bench.against_scenarios(False, str(tmp_path), ("trace",))) == {"trace_wall_s"}
    assert not list(tmp_path.iterdir())  # the conversation trace is written only when it runs
    both = bench.against_scenarios(False, str(tmp_path), ("default", "conversation"))
    assert set(both) == {"default_wall_s", "conversation_wall_s"}
    assert (tmp_path / "conversation.jsonl").is_file()
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim.py"), "--against", str(ROOT),
                          "--scenarios", "default,nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--scenarios 'default,nope'" in bad.stderr
    alone = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim.py"), "--scenarios", "trace"],
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2 and "--scenarios applies to --against" in alone.stderr


def test_sim_benchmark_rounds_median_ignores_one_slow_run():
    """The rounds' median speed-up: times over this side's (rates the other way round), and a
    burst that slows one run of either side moves the extremes only."""
    bench = _sim_bench()
    this = [{"default_wall_s": 1.0, "sim_requests_per_s": 2000.0}] * 4 + [{"default_wall_s": 3.0}]
    that = [{"default_wall_s": 1.1, "sim_requests_per_s": 1000.0}] * 2 + [{"default_wall_s": 9.9}] + \
        [{"default_wall_s": 1.1, "sim_requests_per_s": 1000.0}] * 2
    out = bench.paired(this, that, ["default_wall_s", "sim_requests_per_s", "trace_wall_s"])
    assert out["default_wall_s"] == {"median": 1.1, "min": 0.367, "max": 9.9, "faster": 4, "rounds": 5}
    assert out["sim_requests_per_s"] == {"median": 2.0, "min": 2.0, "max": 2.0, "faster": 3, "rounds": 3}  # both report
    assert "trace_wall_s" not in out


@pytest.mark.slow
def test_layer_groups_benchmark_stores_a_latent_cache_once(tmp_path):
    """MLA at TP 8 stores 1/8 of a per-rank layout's bytes and every D rank reads P's bytes;
    the window case's accounting matches a count by hand."""
    out = tmp_path / "lg.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "layer_groups.py"), "--tokens", "512",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert abs(res["mla_stored_ratio"] - 1 / 8) < 1e-3
    assert all(v["d_matches_p"] for v in res["mla"].values())
    assert res["mla"]["latent group"]["written_blocks"] == [8] * 8  # replicas answer for what rank 0 stored
    assert res["window"]["matches_hand_count"] and res["window"]["ratio"] < 0.3
    read = res["window_read"]  # measured: 2 full layers of 12 and the window's 64 blocks of 512
    assert read["window"]["bytes_right"] and read["window"]["blocks_answered"] == read["blocks"]
    assert abs(read["ratio"] - (2 / 12 + 10 / 12 * 64 / 512)) < 1e-9
    held = res["held"]  # 514 blocks (32768 + 64 tokens + the next), the window's 64 and the one it starts in
    assert held["gemma2/one table"]["blocks_held"] == held["gemma3/one table"]["blocks_held"] == 514
    assert held["gemma2/group tables"]["blocks_held"] == 514 + 65  # 23 full and 23 window layers a block
    assert held["gemma3/group tables"]["blocks_held"] == 514 + 6 * 65  # 10 full, 52 window in 6 tables
    assert abs(held["gemma2/ratio"] - (514 + 65) / 514 / 2) < 1e-9 and held["gemma3/ratio"] < 0.3


def test_groundtruth_replay_writes_the_scenario_a_user_would(tmp_path):
    """The replay's inputs: the server's scheduler, the published front end (or the one asked
    for), a Mooncake trace whose prompts of one group share their system prompt's blocks."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import vllm_groundtruth as gt
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from kvstate.sim import load_scenario
    run = {"name": "r", "model_id": "org/m", "max_model_len": 4096,
           "config": {"tensor_parallelism": 2, "kv_blocks_total_gpu": 1000, "max_num_batched_tokens": 2048,
                      "max_num_seqs": 128, "block_size": 16},
           "gen": {"num_groups": 2, "num_prompts_per_group": 2, "system_prompt_len": 40, "question_len": 30,
                   "output_len": 9},
           "requests": [{"index": i, "arrival_time_us": 1000 * i, "input_tokens": 72} for i in range(6)]}
    s = load_scenario(gt.write_inputs(run, tmp_path / "a"))
    assert (s.scheduler.frontend_ms, s.cluster.tp, s.cluster.gpu_blocks) == (gt.FRONTEND_MS, 2, 1000)
    assert load_scenario(gt.write_inputs(run, tmp_path / "b", frontend_ms=0.0)).scheduler.frontend_ms == 0.0
    recs = [json.loads(line) for line in (tmp_path / "a" / "trace.jsonl").read_text().splitlines()]
    assert recs[0]["hash_ids"][:2] == recs[1]["hash_ids"][:2] != recs[2]["hash_ids"][:2]  # groups 0, 0, 1
    assert recs[4] == {**recs[0], "timestamp": 4.0}  # request 4 repeats prompt 0


@pytest.mark.slow
def test_a_flood_at_every_socket_applies_nothing_restarts_nothing_and_serving_goes_on(tmp_path):
    """benchmarks/flood.py for three seconds: forged and malformed messages at the driver's three
    sockets while handoffs run; every handoff exact, no restart, the workers the same processes,
    handoffs served after it, the driver's memory flat."""
    out = tmp_path / "flood.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "flood.py"), "--seconds", "3", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["wrong_count"] == 0 and res["restarts"] == 0 and res["workers_unchanged"]
    assert res["handoffs_during_flood"] > 0 and res["handoffs_after_flood"] > 0
    c = res["driver_counters"]
    assert c["foreign_hellos"] > 0 and c["unauthenticated_hellos"] > 0 and c["stale"] > 0 and c["bad_messages"] > 0
    assert res["rss_growth_mb"] <= 10


def test_instruction_benchmark_refuses_an_unknown_scenario_before_it_runs():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_instructions.py"), "--against", str(ROOT),
                        "--scenarios", "default,bursty"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown ['bursty']" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None or not Path("/usr/include/valgrind/callgrind.h").exists(),
                    reason="needs valgrind and its headers (apt install valgrind)")
def test_instruction_benchmark_counts_one_simulate_alike_on_one_tree():
    """The tree against itself: both sides count the same instructions of the measured run
    (collection switched on around it: a warm-up outside it would make the count larger)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_instructions.py"), "--against", str(ROOT),
                        "--quick", "--json"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout)["scenarios"]["default"]
    assert row["this"]["requests"] == row["that"]["requests"] == 200
    assert 1e8 < row["this"]["instructions"] < 2e9
    assert abs(row["speedup"]["instructions"] - 1.0) < 0.002
