"""State pages in the simulator: a hybrid model's recurrent states hold a page per live
request on P and D (the lifecycles' own :mod:`kvstate._statepages`), their memory comes out
of the blocks', and a co-located instance takes a cached prefix back from a checkpoint only."""
from __future__ import annotations

import pytest
from test_sim_layer_kinds import model  # the small model those tests vary

from kvstate import ConfigError
from kvstate.sim._run import simulate
from kvstate.sim._scenario_io import with_overrides

STATES = {"state_layers": 6, "state_bytes": 1 << 16, "state_checkpoint": 256}
BUSY = {"workload.num_requests": 80, "workload.rate": 50.0, "workload.output_mean": 256.0,
        "workload.output_dist": "fixed"}


def test_state_pages_bound_the_requests_d_decodes_at_once():
    """Three pages: D decodes at most three requests, the rest wait and are served later; the
    default (a page for each of decode_max_batch) leaves the batch to the blocks."""
    few = simulate(with_overrides(model(**STATES), {**BUSY, "cluster.state_pages": 3}))
    many = simulate(with_overrides(model(**STATES), BUSY))
    assert few["states"] == many["states"] == {"done": 80}
    assert max(few["peaks"]["decode_running"]) == 3 < max(many["peaks"]["decode_running"])
    assert few["backlogged_requests"] > 0 and few["ttft_ms"]["mean"] > 10 * many["ttft_ms"]["mean"]


def test_a_model_without_state_layers_holds_no_pages():
    s = with_overrides(model(), {"cluster.state_pages": 3})
    assert s.state_pages() == 0
    assert simulate(with_overrides(s, {**BUSY, "workload.num_requests": 20}))["states"] == {"done": 20}


def test_state_pages_take_their_memory_from_the_blocks():
    """Each page is a request's states on a rank; what they take the blocks lose, and pages
    that would leave none are refused with the rule."""
    s = model(**STATES)
    per_page, per_block = s.cache_spec().state_bytes_per_rank, s.block_bytes_per_rank
    assert per_page == 6 * (1 << 15)
    a = with_overrides(s, {"cluster.state_pages": 10}).gpu_blocks()
    b = with_overrides(s, {"cluster.state_pages": 10_010}).gpu_blocks()
    assert a - b == pytest.approx(10_000 * per_page / per_block, abs=1)
    assert s.state_pages() == s.cluster.decode_max_batch
    with pytest.raises(ConfigError, match="state_pages: 65,536 state pages .* leave no memory for KV blocks"):
        with_overrides(model(state_layers=6, state_bytes=1 << 24), {"cluster.state_pages": 65_536}).gpu_blocks()


def test_a_colocated_instance_holds_a_page_a_seat_and_refuses_state_pages():
    s = with_overrides(model(**STATES), {"cluster.mode": "colocated", "scheduler.max_num_seqs": 64})
    assert s.state_pages() == 64
    with pytest.raises(ConfigError, match="state_pages: a PD setting"):
        with_overrides(s, {"cluster.state_pages": 8})


def test_a_colocated_prefix_is_taken_back_from_a_checkpoint_only():
    """1,200-token prompts sharing 600 tokens: without state layers a co-located instance
    takes 592 back (37 blocks), with states every 256 tokens 512."""
    work = {"cluster.mode": "colocated", "workload.num_requests": 60, "workload.rate": 4.0,
            "workload.prefix_groups": 2, "workload.prefix_tokens": 600, "workload.input_mean": 1200.0,
            "workload.input_dist": "fixed", "workload.output_mean": 8.0, "workload.output_dist": "fixed"}
    plain = simulate(with_overrides(model(), work))
    state = simulate(with_overrides(model(**STATES), work))
    assert plain["prefix_hit_rate"] > 0 and state["states"] == {"done": 60}
    assert state["prefix_hit_rate"] == pytest.approx(512 / 592 * plain["prefix_hit_rate"], rel=1e-3)


def test_p_keeping_more_checkpoints_lets_prompts_sharing_a_system_prompt_reuse_it():
    """1,200-token prompts sharing 600 tokens, states every 256: P keeps the states at 1,024
    (one kept), 768 and 1,024 (two), or 512, 768 and 1,024 (three). Only with three does a
    prompt find a stored state inside the shared 600 tokens: it reuses 512 and prefills less."""
    work = {"workload.num_requests": 60, "workload.rate": 5.0, "workload.prefix_groups": 2,
            "workload.prefix_tokens": 600, "workload.input_mean": 1200.0, "workload.input_dist": "fixed"}
    runs = {k: simulate(with_overrides(model(**STATES), {**work, "policy.state_checkpoints": k})) for k in (1, 2, 3)}
    assert all(r["states"] == {"done": 60} for r in runs.values())
    assert runs[1]["prefix_hit_rate"] == runs[2]["prefix_hit_rate"] == 0
    assert runs[3]["prefix_hit_rate"] == pytest.approx(512 / 1200 * 58 / 60, rel=0.05)
    assert runs[3]["ttft_ms"]["mean"] < runs[1]["ttft_ms"]["mean"]


def test_a_colocated_instance_refuses_p_s_checkpoint_count():
    with pytest.raises(ConfigError, match=r"\[policy\] state_checkpoints: a PD setting"):
        with_overrides(model(**STATES), {"cluster.mode": "colocated", "policy.state_checkpoints": 3})
