"""The simulator's compute model: kernels from the model's shapes, TP all-reduces, MoE, fp8,
the LM head where it runs, and measured profiles carried between GPUs."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kvstate._errors import ConfigError
from kvstate.sim import Scenario, with_overrides
from kvstate.sim._compute import ComputeModel
from kvstate.sim._gpus import GPUS, gpu_overrides
from kvstate.sim._models import MODELS
from kvstate.sim._profile import Profile


def model(name: str = "llama-3-8b", tp: int = 1, gpu: str = "H100-SXM", **extra) -> ComputeModel:
    m = MODELS[name]
    fields = {f"model.{k}": v for k, v in dataclasses.asdict(m).items() if k != "block_size"}
    return ComputeModel(with_overrides(Scenario(), {**gpu_overrides(gpu), "cluster.tp": tp, **fields, **extra}))


def gemm_efficiency(cm: ComputeModel, tokens: int) -> float:
    """Achieved fraction of peak of the MLP's gate-and-up GEMM at ``tokens``."""
    _, k, n = cm.dense_mats[0]
    return 2.0 * tokens * k * n / cm.gemm("gate_up", tokens, k, n) / cm.peak


def test_gemm_efficiency_grows_with_the_tokens_in_a_step():
    """One efficiency cannot fit every shape: a decode-sized GEMM is memory-bound, a 256-token
    one short of the large GEMMs' ~75-80 % of peak (Hopper, measured by `kvstate profile`)."""
    cm = model()
    assert gemm_efficiency(cm, 8) < 0.05
    assert 0.45 < gemm_efficiency(cm, 256) < gemm_efficiency(cm, 2048) < gemm_efficiency(cm, 8192) < 0.8
    assert gemm_efficiency(cm, 8192) > 0.7


@pytest.mark.parametrize("name", [n for n in Profile.shipped_names() if "mixtral" not in n])
def test_the_roofline_gemms_agree_with_the_kernels_measured_on_the_h200(name):
    """The default curve against every dense GEMM of the shipped H200 profiles, 1 to 8k tokens:
    6-14 % off on average (log error) by profile, 50 % at worst (TP 8's small matrices); the
    curve fitted to Vidur's older H100 profile (0.75 x T / (T + 192)) is 17-24 % off on average."""
    prof = Profile.load(Profile.shipped(name))
    preset = next(m for m in MODELS.values() if m.hidden == prof.model["hidden"] and
                  m.intermediate == prof.model["intermediate"] and m.num_layers)
    cm = model(preset.name, tp=prof.tp, gpu="H200")
    errors = []
    for mat, k, n in cm.attn_mats + cm.dense_mats:
        for tokens, seconds in ((t, prof.gemm[mat](t)) for t in (1, 8, 64, 128, 256, 512, 1024, 2048, 8192)):
            errors.append(abs(math.log(cm.gemm(mat, tokens, k, n) / seconds)))
    assert sum(errors) / len(errors) < 0.15 and max(errors) < 0.5, (name, max(errors))


def test_a_small_gemm_costs_its_weights_at_the_memory_bandwidth_plus_a_launch():
    cm = model(**{"gpu.kernel_us": 4.0, "gpu.mbu": 0.85})
    _, k, n = cm.attn_mats[0]
    weights = k * n * 2
    assert cm.gemm("qkv", 1, k, n) == pytest.approx(4e-6 + (weights + 2 * (k + n)) / (3350e9 * 0.85))


def test_the_lm_head_runs_only_on_sampled_positions():
    """A prompt's chunk that does not end it samples nothing; the one that ends it, one row."""
    cm = model()
    middle = cm.step_time([(4096, 0, False)])
    last = cm.step_time([(4096, 0, True)])
    assert last - middle == pytest.approx(cm.gemm("lm_head", 1, cm.hidden, cm.vocab))
    # counted per token of the prompt, the LM head would be 4096 rows: far more than that one
    assert cm.gemm("lm_head", 4096, cm.hidden, cm.vocab) > 10 * (last - middle)


def test_element_wise_kernels_are_a_share_of_a_prefill():
    cm = model()
    t = cm.prefill_time([(4096, 0)])
    share = cm.layers * cm.elementwise(4096) / t
    assert 0.02 < share < 0.15  # norms, rotary, activation, residual adds: a few percent
    assert cm.elementwise(8192) == pytest.approx(2 * cm.elementwise(4096), rel=0.05)


def test_tensor_parallelism_pays_two_all_reduces_a_layer():
    one, two = model(tp=1), model(tp=2)
    assert one.allreduce(1 << 20) == 0.0
    ar = two.allreduce(64 * 4096 * 2)
    assert ar > 0
    free = model(tp=2, **{"gpu.allreduce_us": 0.0, "gpu.allreduce_ring_us": 0.0, "gpu.allreduce_ll_gbps": 1e12,
                          "gpu.allreduce_gbps": 1e12})  # the same step with a free link
    assert two.decode_step_time(64, 64 * 1024) - free.decode_step_time(64, 64 * 1024) == \
        pytest.approx(2 * two.layers * ar, rel=1e-3)


def test_tp_scaling_is_not_perfect():
    """Llama-3-8B decode: each doubling of TP gains less, all-reduces and launches do not shrink."""
    steps = [model(tp=tp).decode_step_time(64, 64 * 1024) for tp in (1, 2, 4, 8)]
    speedups = [steps[0] / s for s in steps]
    assert speedups[0] == 1 and all(a < b for a, b in zip(speedups, speedups[1:]))
    assert speedups[1] < 1.8 and speedups[3] < 4.0  # TP 8 is far from 8x


def test_all_reduce_picks_the_faster_algorithm_by_size():
    cm = model(tp=8)
    g = GPUS["H100-SXM"]
    small, large = 64 * 1024, 256 << 20
    grow = 1 + 0.25 * 2  # TP 8: two doublings past TP 2
    bus = 2 * 7 / 8
    one_shot = g["allreduce_us"] * 1e-6 * grow + bus * small / (g["allreduce_ll_gbps"] * 1e9)
    ring = g["allreduce_ring_us"] * 1e-6 * grow + bus * large / (g["allreduce_gbps"] * 1e9)
    assert cm.allreduce(small) == pytest.approx(one_shot) and cm.allreduce(large) == pytest.approx(ring)


def test_a_pcie_link_makes_tp_all_reduces_dearer():
    nvlink, pcie = model(tp=4), model(tp=4, gpu="H100-PCIe")
    assert pcie.allreduce(8 << 20) > 3 * nvlink.allreduce(8 << 20)


def test_moe_decode_reads_only_the_experts_its_tokens_touch():
    """Mixtral at batch 1 reads 2 of 8 experts; a big batch reads all 8."""
    cm = model("mixtral-8x7b", tp=2)
    every = model("mixtral-8x7b", tp=2, **{"model.experts_per_token": 8})  # each token through all 8
    w = cm.expert_width
    one_expert = cm.gemm("expert_gate_up", 1, cm.hidden, 2 * w) + cm.gemm("expert_down", 1, w, cm.hidden)
    launches = 2 * cm.kernel  # one grouped kernel a matrix runs every touched expert
    assert every.decode_step_time(1, 1024) - cm.decode_step_time(1, 1024) == \
        pytest.approx(cm.layers * 6 * (one_expert - launches), rel=1e-6)  # 6 more experts' weights read
    small, big = cm.decode_step_time(1, 1024), cm.decode_step_time(256, 256 * 1024)
    dense_like = model("llama-3-8b", tp=2).decode_step_time(1, 1024)
    assert small < 2.5 * dense_like  # 13B active of 47B: far less than all the weights
    assert big > 2.5 * small  # every expert's weights read, and 256x the FLOPs


def test_fp8_weights_halve_a_memory_bound_decode_and_use_the_fp8_peak():
    bf16 = model()
    fp8 = model(**{"model.weight_dtype": "fp8"})
    assert fp8.peak == pytest.approx(2 * bf16.peak, rel=1e-3)
    ratio = fp8.decode_step_time(1, 512) / bf16.decode_step_time(1, 512)
    assert 0.45 < ratio < 0.75  # the weights' bytes halve; launches and the cache do not


def test_an_empty_decode_batch_takes_no_time():
    assert model().decode_step_time(0, 0) == 0.0


# -- measured profiles -----------------------------------------------------------------------------
def test_a_shipped_h200_profile_is_used_and_carried_to_the_h100_through_the_datasheets():
    on_h200 = model("llama-2-7b", gpu="H200", **{"gpu.profile": "h200-llama-2-7b-tp1"})
    on_h100 = model("llama-2-7b", gpu="H100-SXM", **{"gpu.profile": "h200-llama-2-7b-tp1"})
    prof = on_h200.profile
    assert prof is not None and prof.gpu_name == "NVIDIA H200"
    k, n = 4096, 11008
    assert on_h200.gemm("down", 1, n, k) == pytest.approx(prof.gemm["down"](1))  # measured there: as is
    # a memory-bound kernel carried by the HBM ratio, a compute-bound one by the peak ratio
    assert on_h100.gemm("down", 1, n, k) == pytest.approx(prof.gemm["down"](1) * 4800 / 3350)
    assert on_h100.gemm("down", 8192, n, k) == pytest.approx(prof.gemm["down"](8192) * 989 / 989)


def test_a_profile_of_other_shapes_or_tp_is_refused():
    with pytest.raises(ConfigError, match="measured at TP 1"):
        model("llama-2-7b", tp=2, **{"gpu.profile": "h200-llama-2-7b-tp1"})
    with pytest.raises(ConfigError, match="measured for total_kv_heads = 32"):
        model("llama-3-8b", **{"gpu.profile": "h200-llama-2-7b-tp1"})
    with pytest.raises(ConfigError, match="profile not found.*h200-llama-3-8b-tp1"):
        model(**{"gpu.profile": "no-such-profile"})


def test_a_profile_interpolates_between_its_points(tmp_path):
    data = json.loads(Profile.shipped("h200-llama-3-8b-tp1").read_text())
    data["gemm"]["qkv"] = [[16, 1e-5], [256, 4e-5]]
    p = tmp_path / "p.json"
    p.write_text(json.dumps(data))
    prof = Profile.load(p)
    assert prof.gemm["qkv"](64) == pytest.approx(2e-5)  # log-log: halfway between 16 and 256
    assert prof.gemm["qkv"](1) == pytest.approx(1e-5)  # below the smallest: launch-bound
    assert prof.gemm["qkv"](512) == pytest.approx(8e-5)  # beyond the largest: proportional
    data["format"] = "other"
    p.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="not a kvstate profile"):
        Profile.load(p)


def test_a_measured_nccl_curve_applies_only_above_the_engines_custom_all_reduce():
    """The shipped TP 2 profile's all-reduce is NCCL through torch.distributed on two H200s
    (tens of µs a call). vLLM runs its own one-shot kernel up to 8 MiB, so below that the
    roofline's one-shot time stands; above it, the measured curve."""
    cm = model(tp=2, gpu="H200", **{"gpu.profile": "h200-llama-3-8b-tp2"})
    assert cm.profile is not None and cm.profile.allreduce is not None
    small, large = 64 * 4096 * 2, 8192 * 4096 * 2  # a decode step's 64 tokens; an 8k-token prefill (64 MiB)
    roofline = model(tp=2, gpu="H200")
    assert cm.allreduce(small) == pytest.approx(roofline.allreduce(small))
    assert cm.allreduce(large) == pytest.approx(cm.profile.allreduce(large))
    assert cm.allreduce(large) != pytest.approx(roofline.allreduce(large))
    lower = model(tp=2, gpu="H200", **{"gpu.profile": "h200-llama-3-8b-tp2", "gpu.custom_allreduce_mib": 0.0})
    assert lower.allreduce(small) == pytest.approx(cm.profile.allreduce(small))  # NCCL for every size


def test_fewer_kv_heads_than_ranks_are_replicated_as_vllm_does():
    """Qwen2.5-7B has 4 KV heads: at TP 8 each rank holds one, replicated on two ranks (vLLM
    serves it so); its memory and attention reads are one head a rank, and the store holds each
    head once."""
    from kvstate.sim._models import MODELS

    m = MODELS["qwen2.5-7b"]
    fields = {f"model.{k}": v for k, v in dataclasses.asdict(m).items() if k != "block_size"}
    at8 = with_overrides(Scenario(), {**fields, "cluster.tp": 8})
    at4 = with_overrides(Scenario(), {**fields, "cluster.tp": 4})
    spec8 = at8.cache_spec()
    assert (spec8.kv_heads, spec8.heads_total, spec8.replicas) == (1, 4, 2)
    assert at8.block_bytes_per_rank == at4.block_bytes_per_rank  # one head a rank either way
    assert at8.kv_bytes_per_token == at4.kv_bytes_per_token  # stored once, not once a replica
    assert ComputeModel(at8).kv_token_layer == ComputeModel(at4).kv_token_layer
    with pytest.raises(ConfigError, match="neither split over 3 ranks nor replicate"):
        with_overrides(Scenario(), {**fields, "cluster.tp": 3})


@pytest.mark.parametrize("name", ["llama-3-8b", "mixtral-8x7b"])
def test_step_times_kept_per_token_count_equal_a_fresh_models_to_the_last_bit(name):
    """A step's token-count part and a prefill batch's time are kept for reuse: whatever was
    asked before, each answer is exactly the one a model asked first would give."""
    shapes = [((n, c, True),) for n in (1, 17, 512, 4096) for c in (0, 300)] + [((64, 0, False), (9, 40, True))]
    warm = model(name, tp=2)
    for prompts in shapes:  # every shape once, so the reverse order below finds them all kept
        warm.step_time(prompts, batch=3, context=900)
        warm.prefill_time([(n, c) for n, c, _ in prompts])
    for prompts in reversed(shapes):
        fresh = model(name, tp=2)
        assert warm.step_time(prompts, batch=3, context=900) == fresh.step_time(prompts, batch=3, context=900)
        work = [(n, c) for n, c, _ in prompts]
        assert warm.prefill_time(work) == model(name, tp=2).prefill_time(work)
        assert fresh.step_time(prompts, 0, 0) == model(name, tp=2).step_time(prompts)


@pytest.mark.parametrize("name", ["llama-3-8b", "gemma-3-27b"])
def test_a_spans_step_times_are_its_steps_one_by_one(name):
    """A span of quiet decode steps asks for all its steps at once; each must be the step
    time asked alone, to the last bit (a window model caps its window layers' context)."""
    cm = model(name)
    for batch, context, count in ((1, 0, 3), (7, 5000, 40), (64, 100, 1)):
        one_by_one = [cm.decode_step_time(batch, context + i * batch) for i in range(count)]
        assert cm.decode_step_times(batch, context, count) == one_by_one
    assert cm.decode_step_times(0, 10, 2) == [0.0, 0.0]
