"""The simulator's compute model: a forward is its GEMMs, then its attention, then the overhead."""
from __future__ import annotations

import pytest

from kvstate.sim import Scenario, with_overrides
from kvstate.sim.compute import ComputeModel

FIGURES = {"cluster.tp": 1, "gpu.mfu": 0.6, "gpu.mbu": 0.8, "gpu.step_overhead_ms": 2.0}


def model(**extra) -> tuple[Scenario, ComputeModel]:
    s = with_overrides(Scenario(), {**FIGURES, **extra})
    return s, ComputeModel(s)


def combined(parts, mfu=0.6, mbu=0.8, ov=2e-3) -> float:
    gemm_flops, weights, attn_flops, attn_bytes = parts
    return max(gemm_flops / mfu, weights / mbu) + max(attn_flops / mfu, attn_bytes / mbu) + ov


@pytest.mark.parametrize("tokens,context", [(1, 256), (8, 8192), (256, 512), (512, 4096)])
def test_decode_step_is_its_parts_combined(tokens, context):
    _, cm = model()
    assert cm.decode_step_time(tokens, tokens * context) == pytest.approx(combined(cm.parts("decode", tokens, context)))


@pytest.mark.parametrize("tokens,context", [(256, 0), (4096, 0), (2048, 6144)])
def test_prefill_is_its_parts_combined(tokens, context):
    _, cm = model()
    assert cm.prefill_time([(tokens, context)]) == pytest.approx(combined(cm.parts("prefill", tokens, context)))


def test_parts_are_the_raw_flops_and_bytes_at_full_efficiency():
    s, cm = model()
    gemm, weights, attn_flops, attn_bytes = cm.parts("decode", 4, 1000)
    peak, hbm = s.gpu.tflops * 1e12, s.gpu.hbm_gbps * 1e9
    assert gemm == pytest.approx(2 * s.model.params_b * 1e9 * 4 / peak)
    assert weights == pytest.approx(s.weight_bytes / hbm)
    assert attn_bytes == pytest.approx(4000 * s.kv_bytes_per_token / hbm)
    assert attn_flops == pytest.approx(4 * s.model.num_layers * s.model.hidden * 4000 / peak)


def test_attention_does_not_hide_under_compute_bound_gemms():
    """At a big batch the GEMMs are compute-bound; the cache read still adds its own time."""
    _, cm = model()
    gemm_flops, weights, _, attn_bytes = cm.parts("decode", 2048, 1024)
    assert gemm_flops / 0.6 > weights / 0.8  # compute-bound GEMMs
    bigger = cm.decode_step_time(2048, 2048 * 1024) - cm.decode_step_time(2048, 2048 * 512)
    assert bigger == pytest.approx(attn_bytes / 2 / 0.8)


def test_an_empty_decode_batch_takes_no_time():
    assert model()[1].decode_step_time(0, 0) == 0.0
