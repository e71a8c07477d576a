"""The simulator under overload: every request ends with a reason, nothing leaks, nothing escapes."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate._policy import REASONS
from kvstate.sim import Cluster, scenario_from_dict
from kvstate.sim._metrics import summarize

#: the shape that crashed: a 70B-class model at TP 4, 1 P + 2 D on H200-class GPUs, bursty
#: arrivals at about twice what P can prefill, 4,096-token prompts and 512-token answers, D
#: waiting 20 s at most for a first token
OVERLOAD_70B = {
    "model": {"name": "llama-70b-like", "params_b": 70.6, "num_layers": 80, "hidden": 8192, "num_heads": 64,
              "total_kv_heads": 8, "head_dim": 128, "intermediate": 28672},
    "gpu": {"name": "H200", "mem_gib": 141.0, "hbm_gbps": 4800.0},
    "cluster": {"n_prefill": 1, "n_decode": 2, "tp": 4},
    "policy": {"first_token_timeout": 20.0},
    "workload": {"arrival": "gamma", "cv": 2.0, "rate": 12.0, "num_requests": 600,
                 "input_dist": "fixed", "input_mean": 4096.0, "output_dist": "fixed", "output_mean": 512.0},
}


def run(data: dict) -> tuple[Cluster, dict]:
    cl = Cluster(scenario_from_dict(data))
    return cl, summarize(cl, cl.run())


def assert_every_request_ended_clean(cl: Cluster, r: dict) -> None:
    assert r["drained"] and not r["deadlock"], r["deadlock"]
    assert r["requests"] == cl.total
    reasons = r["reasons"]
    assert sum(reasons.values()) == cl.total
    assert set(reasons) <= set(REASONS) | {"rejected_too_long"}, reasons
    for name, i in r["instances"].items():  # a forward outlasting the run counts until its end
        assert 0.0 <= i["compute_busy"] <= 1.0, (name, i["compute_busy"])
    for inst in cl.prefill + cl.decode:
        assert inst.lc.live_requests() == [], inst.name
        assert inst.lc.pool.num_used == 0, (inst.name, inst.lc.pool.stats())
        assert inst.lc.pending_commands() == [], inst.name


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 7])
def test_overloaded_70b_cluster_drains_with_reasons(seed):
    """D's first-token deadline fires while prompts still wait at P: P's late first tokens are
    dropped, the router aborts what P still holds, and the run reports every end."""
    cl, r = run({**OVERLOAD_70B, "seed": seed})
    assert_every_request_ended_clean(cl, r)
    assert r["reasons"]["first_token_timeout"] > 0  # the overload really happened
    assert r["reasons"]["done"] > 0
    p = cl.prefill[0].lc.counters
    assert p["aborted"] == r["reasons"]["first_token_timeout"] - cl.counters.get("late_first_token", 0)


@pytest.mark.parametrize("layerwise", [False, True])
def test_prompts_whose_request_ended_while_queued_are_not_computed(layerwise):
    """A burst that one P cannot prefill before D's first-token deadline: the prompts still
    queued when their request ends leave P's queue uncomputed, so P computes exactly the
    prompts that were not dropped (one prompt a forward, every forward alike). Layer-wise, a
    dropped prompt's save, which waited for its forward, answers at once."""
    cl, r = run(found(seed=3, model={"params_b": 8.0},  # about 70 ms a forward
                      storage={"bandwidth_gbps": 100.0},
                      cluster={"n_prefill": 1, "gpu_blocks": 4000, "prefill_token_budget": 2048,
                               "layerwise": layerwise},
                      policy={"first_token_timeout": 0.5, "queue_timeout": 30.0},
                      workload={"arrival": "poisson", "rate": 5000.0, "num_requests": 40, "prefix_groups": 0,
                                "input_dist": "fixed", "input_mean": 2048.0, "output_dist": "fixed",
                                "output_mean": 4.0}))
    assert_every_request_ended_clean(cl, r)
    dropped = r["prompts_dropped"]
    assert 0 < dropped < cl.total and r["reasons"]["first_token_timeout"] >= dropped
    forward = cl.sv.compute.prefill_time([(2048, 0)])
    p, = cl.prefill
    assert p.busy_time == pytest.approx((cl.total - dropped) * forward, rel=1e-9)
    assert p.queued_tokens == 0 and not p.waiting and not p.saves
    assert p.lc.counters["forced_releases"] == 0  # every cancelled save answered: none left to the fence


@pytest.mark.parametrize("kind", ["write", "read", "swap"])
def test_a_command_cancelled_before_a_worker_takes_it_costs_no_time(kind):
    """As the threaded driver does: a worker reaching a cancelled command answers it at once,
    moving nothing; the same command not cancelled takes its transfer time."""
    from kvstate import commands as C
    from kvstate.sim._instance import Swap, Transfer
    cl = Cluster(scenario_from_dict({"cluster": {"n_prefill": 1, "tp": 2}}))
    p = cl.prefill[0]
    keys = tuple(f"k{i}" for i in range(8))
    if kind == "read":
        cl.store.write(0, keys)
    cmd_cls = {"write": C.WriteBlocks, "read": C.ReadBlocks, "swap": C.SwapOut}[kind]
    cmds = [cmd_cls(f"r{i}", i, (0,), 30.0, keys, tuple(range(8))) for i in (1, 2)]
    tasks = [Swap(p, c, True) if kind == "swap" else Transfer(p, c, kind == "write") for c in cmds]
    p.cancelled.add(1)
    assert tasks[0].start(0) == 0.0
    assert cl.store.busy_until == 0.0 and p.link_free == [0.0, 0.0]  # nothing reserved
    assert tasks[1].start(0) > 0.0


@st.composite
def overloaded(draw) -> dict:
    """A small cluster far past its capacity: few blocks, a small pool, short deadlines."""
    tp = draw(st.sampled_from([1, 2, 4]))
    block = draw(st.sampled_from([16, 64]))
    gpu_blocks = draw(st.integers(24, 160))
    host_blocks = draw(st.sampled_from([0, 0, 16, 400]))  # none, too small for most caches, ample
    input_max = min(2048, (gpu_blocks // 3) * block - 1)
    return {
        "seed": draw(st.integers(0, 2**16)),
        "time_limit_s": 5000.0,
        "model": {"name": "tiny", "params_b": 1.0, "num_layers": draw(st.integers(2, 8)), "hidden": 1024,
                  "total_kv_heads": 4, "head_dim": 64, "block_size": block},
        "cluster": {"n_prefill": draw(st.integers(1, 2)), "n_decode": draw(st.integers(1, 2)), "tp": tp,
                    "gpu_blocks": gpu_blocks, "decode_max_batch": draw(st.sampled_from([4, 32, 256])),
                    "prefill_token_budget": draw(st.sampled_from([512, 4096])), "host_blocks": host_blocks,
                    "prefix_cache": draw(st.booleans()), "layerwise": draw(st.booleans())},
        "storage": {"capacity_gib": draw(st.sampled_from([0.01, 0.2, 64.0])),
                    "bandwidth_gbps": draw(st.sampled_from([1.0, 100.0]))},
        "policy": {"preempt": draw(st.sampled_from(["write", "recompute"] + ["swap"] * (host_blocks > 0))),
                   "swap_write": draw(st.sampled_from(["host", "through", "back"])),
                   "read_failure": draw(st.sampled_from(["fail", "recompute"])),
                   "write_retries": draw(st.integers(0, 2)),
                   "transfer_timeout": draw(st.sampled_from([0.05, 1.0, 30.0])),
                   "queue_timeout": draw(st.sampled_from([0.5, 30.0])),
                   "first_token_timeout": draw(st.sampled_from([0.5, 5.0, 60.0])),
                   "decode_headroom_blocks": draw(st.integers(0, 2))},
        "faults": {"write_fail": draw(st.sampled_from([0.0, 0.1])),
                   "read_fail": draw(st.sampled_from([0.0, 0.1]))},
        "tp": {"skew_ms": [draw(st.sampled_from([0.0, 50.0]))] * tp},
        "workload": {"arrival": draw(st.sampled_from(["poisson", "gamma"])), "cv": 3.0,
                     "rate": draw(st.sampled_from([200.0, 2000.0])), "num_requests": draw(st.integers(10, 60)),
                     "input_mean": float(draw(st.integers(8, input_max))), "input_max": input_max,
                     "output_mean": float(draw(st.integers(1, 200))), "output_max": 400,
                     "prefix_groups": draw(st.integers(0, 3)), "prefix_tokens": draw(st.integers(0, 256))},
    }


@settings(max_examples=int(os.environ.get("KVSTATE_SIM_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(overloaded())
def test_random_overloaded_clusters_end_every_request_and_leak_nothing(data):
    cl, r = run(data)
    assert_every_request_ended_clean(cl, r)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overloaded())
def test_the_lazy_decode_batch_keeps_exact_books(data):
    """After every decode step the batch's context sum equals its members' contexts, every
    member has its next event ahead, and the batch is full whenever requests wait for a slot."""
    from kvstate.sim._decode import DecodeInstance
    errors: list[str] = []
    real = DecodeInstance._run_events

    def audited(self, b, d):
        real(self, b, d)
        errors.extend(self.audit())
    DecodeInstance._run_events = audited
    try:
        cl, r = run(data)
    finally:
        DecodeInstance._run_events = real
    assert not errors, errors[:5]
    assert_every_request_ended_clean(cl, r)


#: what the cases the random search below found share; each overrides what it drew
TINY = {"time_limit_s": 5000.0,
        "model": {"name": "tiny", "params_b": 1.0, "hidden": 1024, "total_kv_heads": 4, "head_dim": 64},
        "cluster": {"n_decode": 1, "tp": 1, "gpu_blocks": 39, "decode_max_batch": 4, "prefill_token_budget": 512},
        "storage": {"bandwidth_gbps": 1.0},
        "policy": {"read_failure": "fail", "queue_timeout": 0.5, "decode_headroom_blocks": 0},
        "workload": {"arrival": "gamma", "cv": 3.0, "output_max": 400}}


def found(seed: int, **sections: dict) -> dict:
    """A case found by the random search: :data:`TINY`, each section updated by its draws."""
    out: dict = {**TINY, "seed": seed}
    for name, values in sections.items():
        out[name] = {**TINY.get(name, {}), **values}
    return out


def test_resumed_requests_have_room_to_grow():
    """Three prompts that each fill a third of D's blocks exactly: resumed into just their old
    blocks, each would be preempted again at its next token, forever (a livelock found by the
    random search above). A preempted request resumes only with room for its next token."""
    shape = found(seed=3165, model={"num_layers": 8, "block_size": 64}, cluster={"n_prefill": 2},
                  storage={"capacity_gib": 0.2},
                  policy={"preempt": "recompute", "write_retries": 1, "transfer_timeout": 30.0,
                          "first_token_timeout": 5.0},
                  tp={"skew_ms": [50.0]},
                  workload={"rate": 2000.0, "num_requests": 54, "input_mean": 737.0, "input_max": 831,
                            "output_mean": 17.0, "prefix_groups": 3, "prefix_tokens": 226})
    cl, r = run(shape)
    assert_every_request_ended_clean(cl, r)
    assert r["reasons"] == {"done": 54}
    assert r["preemptions"] < 100  # a handful, not a livelock's hundreds of thousands


def test_preempted_requests_resume_when_a_late_answer_unpins_their_blocks():
    """Write-backs time out (50 ms) on a slow pool: each preempted request lets go of its blocks
    while its write still pins them, and the write's late answer frees them with no notice. With
    no batch running, D must still wake and resume (found by the random search above: five
    requests waited preempted beside 39 free blocks until the time limit)."""
    shape = found(seed=1, model={"num_layers": 2, "block_size": 16}, cluster={"n_prefill": 1},
                  storage={"capacity_gib": 0.01},
                  policy={"preempt": "write", "write_retries": 0, "transfer_timeout": 0.05,
                          "first_token_timeout": 0.5},
                  tp={"skew_ms": [0.0]},
                  workload={"rate": 200.0, "num_requests": 49, "input_mean": 194.0, "input_max": 207,
                            "output_mean": 35.0, "prefix_groups": 0, "prefix_tokens": 0})
    cl, r = run(shape)
    assert_every_request_ended_clean(cl, r)
    assert r["preemptions"] > 0 and sum(r["reasons"].values()) == 49
