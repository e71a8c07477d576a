"""Models from Hugging Face config.json files: dense and mixture-of-experts families, fp8."""
from __future__ import annotations

import json

import pytest

from kvstate._errors import ConfigError
from kvstate.sim._models import model_from_hf_config

#: the fields that matter of published configs, and the published parameter counts (billions)
MIXTRAL = ({"_name_or_path": "mistralai/Mixtral-8x7B-v0.1", "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
            "num_local_experts": 8, "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}, 46.7)
QWEN_MOE = ({"_name_or_path": "Qwen/Qwen1.5-MoE-A2.7B", "hidden_size": 2048, "num_hidden_layers": 24,
             "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 5632, "vocab_size": 151936,
             "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
             "shared_expert_intermediate_size": 5632, "torch_dtype": "bfloat16"}, 14.3)
DEEPSEEK_V3 = ({"_name_or_path": "deepseek-ai/DeepSeek-V3", "hidden_size": 7168, "num_hidden_layers": 61,
                "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
                "vocab_size": 129280, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "kv_lora_rank": 512,
                "qk_rope_head_dim": 64, "torch_dtype": "bfloat16",
                "quantization_config": {"quant_method": "fp8"}}, 671.0)
LLAMA4_SCOUT = ({"_name_or_path": "meta-llama/Llama-4-Scout-17B-16E", "text_config": {
    "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384, "vocab_size": 202048,
    "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
    "torch_dtype": "bfloat16"}}, 109.0)


def load(tmp_path, cfg):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return model_from_hf_config(p)


@pytest.mark.parametrize("cfg,params", [MIXTRAL, QWEN_MOE, DEEPSEEK_V3, LLAMA4_SCOUT],
                         ids=["mixtral", "qwen-moe", "deepseek-v3", "llama-4-scout"])
def test_parameter_counts_match_the_published_ones(tmp_path, cfg, params):
    """The weights' memory follows from the shapes: every expert counted."""
    assert load(tmp_path, cfg).params_b == pytest.approx(params, rel=0.06)


def test_mixtral_routes_every_layer_through_two_of_eight_experts(tmp_path):
    m = load(tmp_path, MIXTRAL[0])
    assert (m.experts, m.experts_per_token, m.shared_experts, m.moe_intermediate, m.dense_layers) == (8, 2, 0, 14336, 0)


def test_qwen_moe_has_a_shared_expert(tmp_path):
    m = load(tmp_path, QWEN_MOE[0])
    assert (m.experts, m.experts_per_token, m.moe_intermediate, m.shared_experts) == (60, 4, 1408, 4)


def test_deepseek_has_dense_first_layers_a_latent_cache_and_fp8_weights(tmp_path):
    m = load(tmp_path, DEEPSEEK_V3[0])
    assert (m.experts, m.shared_experts, m.dense_layers, m.experts_per_token) == (256, 1, 3, 8)
    assert (m.total_kv_heads, m.head_dim) == (1, 576)  # one latent head: kv_lora_rank + rope dims
    assert m.weight_dtype == "fp8" and m.dtype == "bfloat16"


def test_llama4_reads_its_text_config_and_interleaved_moe(tmp_path):
    m = load(tmp_path, LLAMA4_SCOUT[0])
    assert (m.num_layers, m.hidden, m.experts, m.experts_per_token, m.shared_experts) == (48, 5120, 16, 1, 1)
    assert m.intermediate == 16384 and m.dense_layers == 0  # every layer routed (step 1)


def test_bad_configs_are_named(tmp_path):
    with pytest.raises(ConfigError, match="hidden_size"):
        load(tmp_path, {"num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="torch_dtype"):
        load(tmp_path, {**MIXTRAL[0], "torch_dtype": "int4"})
    with pytest.raises(ConfigError, match="model config not found"):
        model_from_hf_config(tmp_path / "absent.json")


# -- quantized weights --------------------------------------------------------------------------------
def _ct(weights: dict, activations: dict | None) -> dict:
    """A compressed-tensors quantization_config with one group of this scheme."""
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}}


FP8_W8A8 = _ct({"num_bits": 8, "type": "float", "strategy": "channel"}, {"num_bits": 8, "type": "float"})
INT8_W8A8 = _ct({"num_bits": 8, "type": "int", "strategy": "channel"}, {"num_bits": 8, "type": "int"})
W4A16 = _ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, None)


@pytest.mark.parametrize("quant, dtype, wbytes, eight_bit_cores", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8", 1, True),
    (FP8_W8A8, "fp8", 1, True),
    (INT8_W8A8, "int8", 1, True),
    (W4A16, "int4_weight_only", 0.5, False),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, "int4_weight_only", 0.5, False),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "int4_weight_only", 0.5, False),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "int8_weight_only", 1, False),
])
def test_quantized_configs_are_read_as_served(tmp_path, quant, dtype, wbytes, eight_bit_cores):
    """The weights' bytes follow the stored width; the GEMMs run on 8-bit tensor cores only when
    the activations are quantized too (weight-only kernels compute in 16 bits)."""
    from kvstate.sim._compute import ComputeModel
    from kvstate.sim._gpus import gpu_overrides
    from kvstate.sim._scenario import Scenario
    from kvstate.sim._scenario_io import with_overrides

    m = load(tmp_path, {**MIXTRAL[0], "quantization_config": quant})
    assert m.weight_dtype == dtype
    s = with_overrides(Scenario(), {**gpu_overrides("H100-SXM"), **{f"model.{k}": getattr(m, k) for k in (
        "name", "params_b", "num_layers", "hidden", "num_heads", "total_kv_heads", "head_dim", "intermediate",
        "vocab", "experts", "experts_per_token", "moe_intermediate", "weight_dtype")}})
    assert s.weight_bytes == pytest.approx(m.params_b * 1e9 * wbytes)
    cm = ComputeModel(s)
    assert cm.peak == pytest.approx((1979.0 if eight_bit_cores else 989.0) * 1e12)


def test_a_quantized_llama4_scout_fits_where_its_bf16_weights_would_not(tmp_path):
    """Llama-4-Scout (109B) at TP 2 on H100s: 218 GB of bf16 weights do not fit 2 x 80 GB; its
    compressed-tensors fp8 checkpoint (109 GB) does, as vLLM serves it."""
    from kvstate.sim._models import resolve_model
    from kvstate.sim._scenario import Scenario
    from kvstate.sim._scenario_io import with_overrides

    def blocks(cfg: dict) -> int:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(cfg))
        m = resolve_model(str(path))
        s = with_overrides(Scenario(), {**{f"model.{f}": getattr(m, f) for f in (
            "name", "params_b", "num_layers", "hidden", "num_heads", "total_kv_heads", "head_dim", "intermediate",
            "vocab", "experts", "experts_per_token", "shared_experts", "moe_intermediate", "dense_layers",
            "weight_dtype")}, "cluster.tp": 2})
        return s.gpu_blocks()

    with pytest.raises(ConfigError, match="mem_gib"):
        blocks(LLAMA4_SCOUT[0])
    assert blocks({**LLAMA4_SCOUT[0], "quantization_config": FP8_W8A8}) > 0


@pytest.mark.parametrize("quant, rule", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not modeled"),
    ({"quant_method": "awq", "bits": 3}, "awq with bits 3"),
    (_ct({"num_bits": 4, "type": "int"}, {"num_bits": 8, "type": "int"}), "group 'group_0'"),
    ({"quant_method": "compressed-tensors"}, "needs config_groups"),
    ("fp8", "must be a JSON object"),
])
def test_a_quantization_the_model_does_not_know_is_refused_by_name_not_read_as_bf16(tmp_path, quant, rule):
    with pytest.raises(ConfigError, match=rule):
        load(tmp_path, {**MIXTRAL[0], "quantization_config": quant})
