"""Expert parallelism in the compute model (``cluster.expert_parallel``): experts whole on a
tp-th of the ranks, two all-to-alls a MoE layer instead of its all-reduce."""
from __future__ import annotations

import dataclasses

import pytest

from kvstate._errors import ConfigError
from kvstate.sim import Scenario, simulate, with_overrides
from kvstate.sim._compute import ComputeModel
from kvstate.sim._models import MODELS

MIXTRAL = {f"model.{k}": v for k, v in dataclasses.asdict(MODELS["mixtral-8x7b"]).items()}


def compute(tp: int, ep: bool) -> ComputeModel:
    return ComputeModel(with_overrides(Scenario(), {**MIXTRAL, "cluster.tp": tp, "cluster.expert_parallel": ep,
                                                    "gpu.mem_gib": 141.0}))


def test_at_tp_1_expert_parallelism_changes_nothing():
    a, b = compute(1, False), compute(1, True)
    assert a.step_time(batch=32, context=32 * 1000) == b.step_time(batch=32, context=32 * 1000)
    assert a.prefill_time([(4096, 0)]) == b.prefill_time([(4096, 0)])


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_moe_layer_trades_its_all_reduce_for_two_all_to_alls_and_runs_its_experts_whole(tp):
    """The all-to-all's cost, and a step's extra time no more than the communication swapped in."""
    ep, split = compute(tp, True), compute(tp, False)
    assert ep.expert_width == MODELS["mixtral-8x7b"].moe_intermediate == split.expert_width * tp
    tokens = 512
    top_k, hidden = MODELS["mixtral-8x7b"].experts_per_token, MODELS["mixtral-8x7b"].hidden
    nbytes = tokens * top_k * hidden * 2
    latency, bw = ep.ar_algos[1]
    assert ep.alltoall(nbytes) == pytest.approx(latency + nbytes / tp * (tp - 1) / tp / bw)
    assert ep.alltoall(2 * nbytes) > ep.alltoall(nbytes) and ep.alltoall(0) == 0.0
    # the same FLOPs in whole experts on a tp-th of the ranks: the layer differs by at least its communication
    comm = 2 * ep.alltoall(nbytes) - ep.allreduce(tokens * hidden * 2)
    assert ep.step_time([(tokens, 0, True)]) - split.step_time([(tokens, 0, True)]) <= \
        MODELS["mixtral-8x7b"].num_layers * comm + 1e-9  # whole experts are never slower to compute


def test_with_eight_ranks_a_long_prefill_is_faster_and_a_small_decode_step_slower_with_ep():
    ep, split = compute(8, True), compute(8, False)
    assert ep.prefill_time([(8192, 0)]) < split.prefill_time([(8192, 0)])  # whole experts: fuller GEMMs
    assert ep.step_time(batch=8, context=8 * 500) > split.step_time(batch=8, context=8 * 500)  # all-to-all latency


def test_a_run_with_expert_parallelism_drains():
    s = with_overrides(Scenario(), {**MIXTRAL, "cluster.tp": 4, "cluster.expert_parallel": True,
                                    "gpu.mem_gib": 141.0, "workload.num_requests": 200, "workload.rate": 4.0,
                                    "workload.input_mean": 1000.0, "workload.output_mean": 64.0})
    r = simulate(s)
    assert r["drained"] and r["reasons"] == {"done": 200}


@pytest.mark.parametrize("over, rule", [
    ({"cluster.expert_parallel": True}, "has no experts"),
    ({**MIXTRAL, "cluster.tp": 1, "cluster.d_tp": 0, "cluster.expert_parallel": True, "model.experts": 6,
      "cluster.n_decode": 1, "gpu.mem_gib": 141.0} | {"cluster.tp": 4}, "6 experts do not spread evenly over tp 4"),
])
def test_expert_parallelism_without_experts_or_uneven_over_the_ranks_is_refused(over, rule):
    with pytest.raises(ConfigError, match=rule):
        with_overrides(Scenario(), over)
