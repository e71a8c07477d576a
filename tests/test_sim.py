"""The simulator: scenarios and traces (validation), the cost model, the cluster run, deadlocks, CLI."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvstate._errors import ConfigError, KVStateError, ValidationError
from kvstate.app._cli import main
from kvstate.kernels._cost import TransferCostModel, fit_cost_model
from kvstate.kernels._plan import plan_layout
from kvstate.sim import (
    Cluster,
    Scenario,
    load_scenario,
    scenario_from_dict,
    search_deadlocks,
    simulate,
    to_json,
    with_overrides,
)
from kvstate.sim._metrics import summarize
from kvstate.sim._request import SimRequest
from kvstate.sim._tp import TaskSchedule, run_schedule
from kvstate.sim._workload import Arrival, load_trace, unique_tokens

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "mooncake_synthetic_trace.jsonl"


def small(**over) -> Scenario:
    """A fast scenario: 120 requests of modest length on the default cluster."""
    base = {"workload.num_requests": 120, "workload.input_mean": 600.0, "workload.input_max": 4096,
            "workload.output_mean": 24.0, "workload.output_max": 128, "workload.prefix_tokens": 256}
    return with_overrides(Scenario(), {**base, **over})


def run(s: Scenario) -> tuple[Cluster, dict]:
    cl = Cluster(s)
    raw = cl.run()
    return cl, summarize(cl, raw)


def assert_clean(cl: Cluster) -> None:
    """Every request ended on both sides and no GPU block is held or pinned anywhere."""
    for inst in cl.prefill + cl.decode:
        assert inst.lc.live_requests() == [], inst.name
        assert inst.lc.pool.num_used == 0, inst.name
        assert inst.lc.pending_commands() == [], inst.name


# -- scenarios -------------------------------------------------------------------------------
def test_an_empty_scenario_file_is_an_error(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text("# nothing here\n")
    with pytest.raises(ConfigError, match="s.toml: the scenario file is empty"):
        load_scenario(f)
    assert Scenario().gpu_blocks() > 1000  # H100 memory left after Llama-3-8B weights at TP 2


@pytest.mark.parametrize("text, needle", [
    ("[workload]\nrate = -1.0\n", "[workload] rate: must be > 0"),
    ("[workload]\nrte = 3.0\n", "[workload] unknown key 'rte'"),
    ("[cluster]\ntp = 'two'\n", "[cluster] tp: expected int"),
    ("[tpx]\n", "unknown top-level key 'tpx'"),
    ("[policy]\npreempt = 'drop'\n", "[policy] Policy.preempt must be one of"),
    ("[tp]\nskew_ms = [1.0, 2.0, 3.0]\n", "skew_ms: 3 entries for 2 ranks"),
    ("[workload]\narrival = 'trace'\n", "trace: arrival 'trace' needs a trace file"),
    ("seed = 1.5\n", "seed: expected int"),
    ("[model\n", "not valid TOML"),
])
def test_bad_scenarios_name_file_field_and_rule(tmp_path, text, needle):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_scenario(f)
    assert str(f) in str(e.value) and needle in str(e.value)


def test_overrides_are_validated_too():
    with pytest.raises(ConfigError, match="unknown scenario field"):
        with_overrides(Scenario(), {"cluster.nope": 1})
    with pytest.raises(ConfigError, match="n_decode: must be > 0"):
        with_overrides(Scenario(), {"cluster.n_decode": 0})
    assert with_overrides(Scenario(), {"cluster.n_decode": 3}).cluster.n_decode == 3


def test_a_model_too_big_for_the_gpu_is_refused():
    s = scenario_from_dict({"model": {"params_b": 200.0}, "cluster": {"tp": 1}})
    with pytest.raises(ConfigError, match="do not fit"):
        s.gpu_blocks()


# -- traces ----------------------------------------------------------------------------------
def write_trace(path: Path, records: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


@pytest.mark.parametrize("records, needle", [
    ([{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": []},
      {"timestamp": 4, "input_length": 10, "output_length": 1, "hash_ids": []}], ":2: timestamp 4 goes back in time"),
    ([{"timestamp": 0, "input_length": 10, "output_length": 0, "hash_ids": []}],
     ":1: output_length must be an int > 0"),
    ([{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3]}],
     ":1: 3 hash_ids but input_length 600 allows at most 2 blocks of 512"),
    ([{"timestamp": 0, "input_length": 10, "output_length": 1}, "{oops"], ":2: not JSON"),
    ([{"timestamp": -1, "input_length": 10, "output_length": 1}], ":1: timestamp must be a number of ms >= 0"),
    ([{"timestamp": 0, "input_length": 10, "output_length": 1, "extra": 1}], ":1: unknown field(s) ['extra']"),
])
def test_bad_traces_name_file_line_and_rule(tmp_path, records, needle):
    f = write_trace(tmp_path / "t.jsonl", records)
    with pytest.raises(ConfigError) as e:
        load_trace(f)
    assert str(f) + needle in str(e.value)


def test_invalid_trace_stops_the_run_before_anything_runs(tmp_path):
    f = write_trace(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 10, "output_length": 0}])
    with pytest.raises(ConfigError, match="output_length"):
        Cluster(with_overrides(Scenario(), {"workload.arrival": "trace", "workload.trace": str(f)}))


def test_the_mooncake_trace_loads():
    recs = load_trace(TRACE)
    assert len(recs) == 3993
    assert int(np.median([r.input_length for r in recs])) == 11587


def test_trace_prefix_reuse_flows_through_storage(tmp_path):
    """Requests repeating hash ids read their prefix from the pool; unique ids never hit.
    A hash block size other than 512 works (the same format, different block size)."""
    shared = [{"timestamp": 100 * i, "input_length": 1000, "output_length": 4, "hash_ids": [7, 8, 9, 10 + i]}
              for i in range(20)]
    unique = [{"timestamp": 100 * i, "input_length": 1000, "output_length": 4,
               "hash_ids": [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3]} for i in range(20)]
    out = {}
    for name, recs in (("shared", shared), ("unique", unique)):
        f = write_trace(tmp_path / f"{name}.jsonl", recs)
        cl, r = run(with_overrides(Scenario(), {"workload.arrival": "trace", "workload.trace": str(f),
                                                "workload.hash_block_size": 256}))
        assert r["states"] == {"done": 20}
        assert_clean(cl)
        out[name] = r["prefix_hit_rate"]
    assert out["unique"] == 0.0
    # 19 of 20 requests find 3 x 256 tokens, minus the last partial 64-token block rule
    assert out["shared"] > 0.6


# -- cost model ------------------------------------------------------------------------------
def test_shipped_h100_calibration_loads_and_charges_plans():
    m = TransferCostModel.load("h100")
    assert "H100" in m.gpu
    caches = [np.zeros((64, 2, 16, 8), np.uint16) for _ in range(4)]
    host = np.zeros((16, 4, 2, 16, 8), np.uint16)
    plan = plan_layout(caches, host, list(range(8)), list(range(8)), "d2h")
    assert m.time(plan) == m.time_of("d2h", plan.chunks, plan.chunk_bytes) > 0
    # more chunks never cost less; bigger chunks never cost less
    ts = [m.time_of("h2d", n, 65536) for n in (32, 256, 2048, 20000)]
    assert ts == sorted(ts)
    assert m.time_of("d2h", 1024, 1 << 20) > m.time_of("d2h", 1024, 1 << 16)
    assert m.time_of("d2h", 0, 4096) == 0.0
    with pytest.raises(ValidationError, match="direction"):
        m.time_of("sideways", 1, 1)


def test_fit_interpolates_between_points_and_sizes():
    samples = [{"direction": d, "chunk_bytes": c, "chunks": n, "seconds": 1e-4 + n * c / 50e9}
               for d in ("d2h", "h2d") for c in (1024, 4096) for n in (100, 1000)]
    m = fit_cost_model(samples, {"d2h": 50e9, "h2d": 50e9})
    assert m.time_of("d2h", 550, 1024) == pytest.approx(1e-4 + 550 * 1024 / 50e9)
    mid = m.time_of("d2h", 1000, 2048)
    assert m.time_of("d2h", 1000, 1024) < mid < m.time_of("d2h", 1000, 4096)
    round_trip = TransferCostModel.from_dict(m.to_dict())
    assert round_trip.time_of("h2d", 777, 3000) == m.time_of("h2d", 777, 3000)


def test_bad_calibrations_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        TransferCostModel.load("a100-unknown")
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"directions": {"d2h": {}}}))
    with pytest.raises(ConfigError, match="not a cost-model calibration"):
        TransferCostModel.load(str(f))


# -- the cluster run ----------------------------------------------------------------------------
def test_default_workload_drains_with_every_block_back():
    cl, r = run(small())
    assert r["drained"] and r["deadlock"] is None
    assert r["states"] == {"done": 120}
    assert_clean(cl)
    assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
    assert r["tpot_ms"]["p50"] > 0 and r["e2e_ms"]["p50"] > r["ttft_ms"]["p50"]
    assert 0 < r["goodput_rps"] <= r["throughput_rps"]
    assert r["prefix_hit_rate"] > 0  # shared prefixes were read back from the pool
    assert r["storage"]["bytes_written"] > 0 and r["storage"]["bytes_read"] > 0
    # nothing is evicted here: P's prefix reads that stop at a miss are not partial reads
    assert r["storage"]["evicted_blocks"] == 0 and r["partial_reads"] == 0
    assert r["series"] and set(r["series"][0]) >= {"t", "prefill_queue", "decode_running", "blocks_used"}


def test_same_seed_same_bytes_other_seed_other_bytes():
    a, b = to_json(simulate(small())), to_json(simulate(small()))
    assert a == b
    assert to_json(simulate(small(seed=5))) != a


def test_a_requests_decoded_tokens_are_its_own_run_however_sliced():
    """D's decoded tokens come from one run made at first use: any slice equals the run's
    tokens at those positions, and positions past what it decodes still come out right."""
    req = SimRequest(Arrival(7, 0.0, 100, 40, unique_tokens(0, 0, 100)))
    for lo, hi in [(101, 102), (101, 141), (120, 141), (101, 165), (90, 95), (140, 141)]:
        assert list(req.decoded(lo, hi)) == list(unique_tokens(req.base, lo, hi)), (lo, hi)
    other = SimRequest(Arrival(8, 0.0, 100, 40, unique_tokens(9, 0, 100)))
    assert not set(req.decoded(101, 141)) & set(other.decoded(101, 141))  # each request's own run


def test_storage_evictions_make_reads_partial_and_the_policy_runs():
    """A pool too small for the load evicts blocks between P's write and D's read."""
    tiny = {"storage.capacity_gib": 0.25, "workload.rate": 200.0, "workload.prefix_groups": 0}
    cl, r = run(small(**tiny, **{"policy.read_failure": "recompute"}))
    assert r["storage"]["evicted_blocks"] > 0 and r["partial_reads"] > 0
    assert r["states"] == {"done": 120}  # recomputed from the longest prefix read
    assert any(i.lc.counters["done"] for i in cl.decode)
    assert_clean(cl)
    cl, r = run(small(**tiny, **{"policy.read_failure": "fail"}))
    assert r["states"].get("failed", 0) > 0 and r["errors"].get("502", 0) == r["states"]["failed"]
    assert_clean(cl)


@pytest.mark.parametrize("policy", ["write", "recompute"])
def test_block_pressure_preempts_and_every_request_still_finishes(policy):
    s = small(**{"cluster.gpu_blocks": 160, "workload.output_mean": 300.0, "workload.output_max": 600,
                 "workload.rate": 100.0, "policy.preempt": policy})
    cl, r = run(s)
    assert r["preemptions"] > 0
    assert r["states"] == {"done": 120}
    assert_clean(cl)


@pytest.mark.parametrize("host_blocks", [400, 12])
def test_preemption_through_the_host_tier_round_trips_and_leaks_no_slot(host_blocks):
    s = small(**{"cluster.gpu_blocks": 160, "workload.output_mean": 300.0, "workload.output_max": 600,
                 "workload.rate": 100.0, "policy.preempt": "swap", "cluster.host_blocks": host_blocks})
    cl, r = run(s)
    assert r["preemptions"] > 0 and r["states"] == {"done": 120}
    tier = r["host_tier"]
    assert tier["swap_outs"] > 0 and tier["swap_ins"] == tier["swap_outs"]  # a small tier evicts, never fails here
    assert (sum(d.lc.host.stats().evictions for d in cl.decode) > 0) == (host_blocks == 12)
    assert r["preemption_round_trip_ms"]["p50"] > 0
    assert_clean(cl)
    assert all(d.lc.host.stats().referenced == 0 for d in cl.decode)


def test_p_serves_shared_prefixes_from_its_host_tier_first():
    cl, r = run(small(**{"cluster.host_blocks": 400}))
    tier = r["host_tier"]
    assert r["states"] == {"done": 120}
    assert tier["prefix_blocks_from_host"] > 0 and tier["prefix_hit_rate_host"] > 0
    # every prefix block came from one tier or the other
    assert tier["prefix_hit_rate_host"] + tier["prefix_hit_rate_store"] == pytest.approx(r["prefix_hit_rate"], abs=1e-3)
    assert_clean(cl)
    assert all(i.lc.host.stats().referenced == 0 for i in cl.prefill + cl.decode)


def test_swap_without_a_host_tier_is_refused():
    with pytest.raises(ConfigError, match="host_blocks"):
        small(**{"policy.preempt": "swap"})


def test_injected_write_failures_end_requests_with_503_or_retry():
    cl, r = run(small(**{"faults.write_fail": 0.3}))
    assert r["injected_failures"]["write"] > 0
    assert r["states"].get("failed", 0) > 0 and r["errors"].get("503", 0) > 0
    assert r["states"]["done"] + r["states"]["failed"] == 120
    assert sum(i.lc.counters["retries"] for i in cl.prefill) > 0
    assert_clean(cl)


def test_shared_barrier_protocol_deadlocks_and_is_reported():
    """Concurrent writes on a shared manual-reset barrier strand a rank's workers; the
    lifecycle's deadlines still end the requests whose answers never come (no hang)."""
    s = small(**{"tp.protocol": "shared-barrier", "tp.barrier": "manual-reset", "tp.barrier_timeout_s": 5.0,
                 "workload.num_requests": 40, "workload.rate": 200.0, "tp.skew_ms": [0.0, 1.0]})
    cl, r = run(s)
    d = r["deadlock"]
    assert d is not None and d["stuck_ranks"]
    assert "waits on barrier" in d["stuck_ranks"][0] and "ranks missing" in d["stuck_ranks"][0]
    assert r["drained"] and r["states"].get("failed", 0) > 0  # timed out, recycled, nothing hangs
    assert sum(i.lc.counters["expired"] for i in cl.prefill + cl.decode) > 0
    # kvstate's own protocol under the same semantics and skew: none
    cl, r = run(small(**{"tp.barrier": "manual-reset", "tp.skew_ms": [0.0, 1.0], "workload.num_requests": 40,
                         "workload.rate": 200.0}))
    assert r["deadlock"] is None and r["states"] == {"done": 40}


def test_deadlock_search_finds_the_shared_barrier_reset_race_and_nothing_in_kvstate():
    res = search_deadlocks(tps=(2,), tasks=(1, 2, 3), spacings=(0.0, 0.002), skews=(0.0, 0.002))
    assert res["shared-barrier/manual-reset"]["deadlocks"] > 0
    m = res["shared-barrier/manual-reset"]["minimal"]
    assert m["case"]["tasks"] == 2 and m["stuck"] and m["trace"]
    assert any(e[2] == "pass-open" for e in m["trace"])  # a rank passed the barrier left open
    for sem in ("auto", "manual-reset"):
        assert res[f"kvstate/{sem}"]["deadlocks"] == 0
        assert res[f"kvstate/{sem}"]["unsynchronized_cases"] == 0


def test_a_single_task_never_deadlocks_even_with_shared_barriers():
    for sem in ("auto", "manual-reset"):
        out = run_schedule(TaskSchedule("shared-barrier", sem, "rank0", 2, 1, 1, 0.0, 0.001, (0.0, 0.003)))
        assert not out["deadlock"] and out["unsynchronized"] == 0


# -- CLI ---------------------------------------------------------------------------------------
def scenario_file(tmp_path: Path, **sections) -> Path:
    lines = []
    for sec, fields in sections.items():
        lines.append(f"[{sec}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    f = tmp_path / "s.toml"
    f.write_text("\n".join(lines) + "\n")
    return f


def test_cli_simulate_json_is_deterministic(tmp_path, capsys):
    f = scenario_file(tmp_path, workload={"num_requests": 60, "input_mean": 500.0, "output_mean": 16.0,
                                          "prefix_tokens": 128})
    assert main(["simulate", str(f), "--json", "--seed", "3"]) == 0
    a = capsys.readouterr().out
    assert main(["simulate", str(f), "--json", "--seed", "3"]) == 0
    assert capsys.readouterr().out == a
    d = json.loads(a)
    assert d["requests"] == 60 and d["scenario"]["seed"] == 3
    assert {"ttft_ms", "tpot_ms", "e2e_ms", "goodput_rps", "storage", "prefix_hit_rate", "preemptions",
            "partial_reads", "series", "instances"} <= set(d)


def test_cli_simulate_exits_nonzero_on_deadlock(tmp_path, capsys):
    f = scenario_file(tmp_path, workload={"num_requests": 40, "input_mean": 600.0, "input_max": 4096,
                                          "output_mean": 24.0, "output_max": 128, "prefix_tokens": 256,
                                          "rate": 200.0},
                      tp={"protocol": "shared-barrier", "barrier": "manual-reset", "barrier_timeout_s": 5.0,
                          "skew_ms": [0.0, 1.0]})
    assert main(["simulate", str(f)]) == 3
    assert "DEADLOCK" in capsys.readouterr().out


def test_cli_simulate_bad_input_is_a_clear_error(tmp_path, capsys):
    f = scenario_file(tmp_path, workload={"rate": -2.0})
    assert main(["simulate", str(f)]) == 2
    assert "rate: must be > 0" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "trace file not found" in capsys.readouterr().err


def test_cli_trace_replay(tmp_path, capsys):
    recs = [{"timestamp": 50 * i, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]} for i in range(10)]
    t = write_trace(tmp_path / "t.jsonl", recs)
    assert main(["simulate", "--trace", str(t), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["requests"] == 10 and d["states"] == {"done": 10} and d["prefix_hit_rate"] > 0


def test_cli_plot_writes_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="needs matplotlib (the 'plot' extra)")
    f = scenario_file(tmp_path, workload={"num_requests": 40, "input_mean": 400.0, "output_mean": 8.0})
    assert main(["simulate", str(f), "--plot", str(tmp_path / "png")]) == 0
    for name in ("latency_cdf.png", "utilisation.png"):
        assert (tmp_path / "png" / name).read_bytes()[:4] == b"\x89PNG"


def test_cli_plan_finds_the_cheapest_configuration(tmp_path, capsys):
    f = scenario_file(tmp_path, workload={"num_requests": 80, "input_mean": 800.0, "output_mean": 16.0})
    out = tmp_path / "plan.json"
    rc = main(["plan", str(f), "--sweep", "cluster.n_prefill=1,2", "--sweep", "cluster.n_decode=1,2",
               "--rate", "20", "--workers", "2", "--out", str(out)])
    res = json.loads(out.read_text())
    assert len(res["rows"]) == 4 and res["rate"] == 20.0
    ok = [r for r in res["rows"] if r["meets_slo"]]
    assert rc == (0 if ok else 1)
    if ok:
        assert res["best"]["gpus"] == min(r["gpus"] for r in ok)
    assert "cheapest" in capsys.readouterr().out or not ok
    with pytest.raises(KVStateError, match="FIELD=V1"):
        from kvstate.sim._capacity import parse_sweep
        parse_sweep(["cluster.n_decode"])


def test_a_deadline_fires_at_its_exact_simulated_time(tmp_path):
    """r0's prompt is so long that D's first-token deadline passes while P0 still computes it;
    r1 (on P1) is quick, and its read's deadline is armed before r0's, then goes stale. r0 must
    still end at exactly arrival + first_token_timeout, not at the next tick of a poller."""
    recs = [{"timestamp": 0, "input_length": 60000, "output_length": 4, "hash_ids": []},
            {"timestamp": 0, "input_length": 100, "output_length": 4, "hash_ids": []}]
    t = write_trace(tmp_path / "t.jsonl", recs)
    s = with_overrides(Scenario(), {"workload.arrival": "trace", "workload.trace": str(t),
                                    "cluster.n_decode": 1, "gpu.tflops": 20.0,
                                    "policy.first_token_timeout": 2.345, "policy.transfer_timeout": 0.5})
    cl, r = run(s)
    r0, r1 = cl.reqs["r0"], cl.reqs["r1"]
    assert (r0.reason, r1.reason) == ("first_token_timeout", "done")
    assert r1.finish < 2.345  # r1's transfers came and went before r0's deadline
    assert r0.finish == pytest.approx(2.345, abs=1e-12)
    # D gave up while P0 still computed: the router aborted it there, so no token came late
    assert cl.prefill[0].lc.counters["aborted"] == 1 and r["late_events"] == {}
    assert_clean(cl)
