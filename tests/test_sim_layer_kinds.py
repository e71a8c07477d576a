"""The simulator's layer kinds: read from Hugging Face configs, built into the cache's layer
groups, and charged as each kind costs (window attention, recurrent states, a latent cache
stored once)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from kvstate import ConfigError
from kvstate.sim._compute import ComputeModel
from kvstate.sim._models import model_from_hf_config
from kvstate.sim._presets import preset
from kvstate.sim._scenario import Scenario
from kvstate.sim._scenario_io import scenario_from_dict, with_overrides
from kvstate.sim._services import Services

BASE = {"hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 128, "intermediate_size": 4096, "vocab_size": 32000, "torch_dtype": "bfloat16"}


def read(tmp_path, **cfg):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**BASE, **cfg}))
    return model_from_hf_config(p)


@pytest.mark.parametrize("cfg, want", [
    ({"model_type": "gemma2", "sliding_window": 4096}, (4096, 6, 0)),
    ({"model_type": "gemma3_text", "sliding_window": 1024, "sliding_window_pattern": 6}, (1024, 10, 0)),
    ({"model_type": "gemma3_text", "sliding_window": 512}, (512, 10, 0)),  # pattern 6 by default
    ({"model_type": "gpt_oss", "sliding_window": 128,
      "layer_types": ["sliding_attention", "full_attention"] * 6}, (128, 6, 0)),
    ({"model_type": "mistral", "sliding_window": 4096}, (4096, 12, 0)),
    ({"model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False}, (0, 0, 0)),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 8},
     (4096, 4, 0)),
    ({"model_type": "llama", "sliding_window": None}, (0, 0, 0)),
])
def test_window_layers_come_from_the_config(tmp_path, cfg, want):
    m = read(tmp_path, **cfg)
    assert (m.window, m.window_layers, m.state_layers) == want
    assert m.full_layers == 12 - want[1]


def test_linear_attention_layers_keep_a_state_of_the_config_s_size(tmp_path):
    """Qwen3-Next: 3 gated-delta-rule layers to 1 full; a state of 32 value heads x 128 x 128
    and a convolution window of 3 x (2 x 16 x 128 + 32 x 128) values, in bf16."""
    m = read(tmp_path, model_type="qwen3_next", layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3,
             linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=32, linear_value_head_dim=128,
             linear_conv_kernel_dim=4)
    assert (m.state_layers, m.full_layers) == (9, 3)
    assert m.state_bytes == 2 * (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128))


def test_jamba_s_mamba_layers_are_every_layer_but_its_attention_ones(tmp_path):
    m = read(tmp_path, model_type="jamba", num_hidden_layers=16, attn_layer_period=8, attn_layer_offset=4,
             mamba_d_state=16, mamba_d_conv=4, mamba_expand=2)
    inner = 2 * 1024
    assert (m.state_layers, m.full_layers, m.state_bytes) == (14, 2, 2 * (inner * 16 + 3 * inner))


@pytest.mark.parametrize("cfg, needle", [
    ({"hybrid_override_pattern": "M-M*"}, "hybrid_override_pattern: this hybrid layer layout is not read"),
    ({"layer_types": ["full_attention"] * 11}, "one type for each of the 12 layers"),
    ({"layer_types": ["full_attention"] * 11 + ["cross_attention"]}, "'cross_attention' is not a layer type"),
    ({"layer_types": ["sliding_attention"] * 12}, "sliding_window"),
    ({"layer_types": ["linear_attention"] * 6 + ["full_attention"] * 6, "linear_num_value_heads": 4,
      "linear_key_head_dim": 8}, "linear_num_key_heads"),
])
def test_a_layout_the_reader_does_not_know_is_refused(tmp_path, cfg, needle):
    with pytest.raises(ConfigError, match=needle):
        read(tmp_path, **cfg)


def model(**kw) -> Scenario:
    return scenario_from_dict({"model": {"name": "m", "params_b": 1.0, "num_layers": 12, "hidden": 1024,
                                         "num_heads": 8, "total_kv_heads": 4, "head_dim": 128,
                                         "intermediate": 4096, "block_size": 16, **kw},
                               "cluster": {"tp": 2}})


def test_the_cache_spec_holds_each_kind_as_a_layer_group():
    s = model(window=64, window_layers=6, state_layers=3, state_bytes=4000, state_checkpoint=64)
    spec = s.cache_spec()
    assert [(g.kind, len(g.layers)) for g in spec.groups] == [("window", 6), ("state", 3), ("full", 3)]
    assert spec.state_bytes_per_rank == 3 * 2000 and spec.paged_layers == 9
    assert spec.paged().groups[0].kind == "window" and spec.paged().num_layers == 9
    assert model().cache_spec().groups == ()  # a plain decoder: the one-group format


@pytest.mark.parametrize("kw, needle", [
    ({"window_layers": 4}, "window_layers: 4 with window 0"),
    ({"state_bytes": 100}, "state_layers: 0 with state_bytes 100"),
    ({"state_layers": 12, "state_bytes": 100}, "no attention layer to page"),
    ({"window": 100, "window_layers": 4}, "window of 100 tokens is not a multiple of the block size 16"),
    ({"state_layers": 4, "state_bytes": 100, "state_checkpoint": 24}, "checkpoint every 24 tokens"),
])
def test_layer_kinds_that_break_a_rule_are_refused(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        model(**kw)


def test_a_latent_cache_is_stored_once_at_any_tp():
    """DeepSeek-V3 at TP 8: one latent head, no value cache, replicated; rank 0 writes."""
    s = preset("deepseek-v3-h200")
    spec = s.cache_spec()
    assert (spec.kinds, spec.kv_heads, spec.heads_total, spec.replicas) == (("key",), 1, 1, 8)
    assert [spec.writes(r) for r in range(8)] == [True] + [False] * 7
    assert spec.bytes_per_block_per_rank == 61 * 64 * 576 * 2  # layers, tokens, 512 + 64 values, bf16
    side = Services(s).sides["prefill"]
    assert side.writers.count(True) == 1


def test_window_layers_cost_less_the_longer_the_context():
    """Decode over 32k tokens: window layers read 1,024 tokens each, full layers all of them."""
    s = preset("gemma-3-27b-h200")
    plain = dataclasses.replace(s, model=dataclasses.replace(s.model, window=0, window_layers=0))
    win, full = ComputeModel(s), ComputeModel(plain)
    short = win.decode_step_time(8, 8 * 512), full.decode_step_time(8, 8 * 512)
    long = win.decode_step_time(8, 8 * 32768), full.decode_step_time(8, 8 * 32768)
    assert short[0] == pytest.approx(short[1], rel=1e-9)  # within the window: the same
    assert long[0] < 0.5 * long[1]
    assert win.window_prefill_attention(512, 256) == win.prefill_attention(512, 256)
    assert win.window_prefill_attention(8192, 0) < 0.3 * win.prefill_attention(8192, 0)


def test_state_layers_cost_the_same_at_any_context_and_move_their_state():
    s = model(state_layers=6, state_bytes=1 << 20, state_checkpoint=64)
    cm = ComputeModel(s)
    assert cm.decode_step_time(4, 4 * 100) < cm.decode_step_time(4, 4 * 10000)  # the full layers still read
    plain = ComputeModel(with_overrides(s, {"model.state_layers": 0, "model.state_bytes": 0}))
    grow = cm.decode_step_time(4, 4 * 10000) - cm.decode_step_time(4, 4 * 100)
    grow_plain = plain.decode_step_time(4, 4 * 10000) - plain.decode_step_time(4, 4 * 100)
    assert grow == pytest.approx(grow_plain / 2, rel=1e-6)  # half the layers read the context
    side = Services(s).sides["prefill"]
    checkpoints = [g.checkpoint for g in side.lifecycle_spec.groups if g.kind == "state"]
    assert side.state_bytes == 6 * (1 << 19) and checkpoints == [64]  # half a state each
    with_state = side.link_seconds("d2h", 4)
    side.state_bytes = 0
    assert with_state > side.link_seconds("d2h", 4) and side.link_seconds("d2h", 0) == 0


def test_a_stored_prefix_is_reused_from_a_state_checkpoint_only():
    """Prompts share 600-token prefixes: a model without state layers reuses them to the block
    (592 tokens); with states checkpointed every 256 tokens, P stores the state of its prompt's
    last checkpoint only (kvstate._statepages), so a 700-token prompt's (512) is reused and a
    1,200-token prompt's (1,024, past the shared part) never is."""
    from kvstate.sim._run import simulate

    work = {"workload.num_requests": 60, "workload.rate": 4.0, "workload.prefix_groups": 2,
            "workload.prefix_tokens": 600, "workload.input_dist": "fixed",
            "workload.output_mean": 8.0, "workload.output_dist": "fixed"}
    states = dict(state_layers=6, state_bytes=1 << 16, state_checkpoint=256)
    for prompt, reused in ((700.0, 512), (1200.0, 0)):
        w = {**work, "workload.input_mean": prompt}
        plain = simulate(with_overrides(model(), w))
        state = simulate(with_overrides(model(**states), w))
        assert plain["prefix_hit_rate"] > 0 and state["states"] == {"done": 60}
        assert state["prefix_hit_rate"] == pytest.approx(reused / 592 * plain["prefix_hit_rate"], rel=0.05, abs=1e-9)


def test_d_reads_window_layers_from_their_last_window_only():
    """1,200-token prompts, half the layers sliding over 64 tokens: D's reads leave most of
    those layers' bytes in the pool, as the reference backend does; a window as long as the
    prompts reads everything."""
    from kvstate.sim._run import simulate

    work = {"workload.num_requests": 40, "workload.rate": 2.0, "workload.prefix_groups": 0,
            "workload.input_mean": 1200.0, "workload.input_dist": "fixed", "workload.output_mean": 8.0,
            "workload.output_dist": "fixed", "policy.read_prefix": False}
    short = simulate(with_overrides(model(window=64, window_layers=6), work))
    long = simulate(with_overrides(model(window=4096, window_layers=6), work))
    read = {name: r["storage"]["bytes_read"] for name, r in (("short", short), ("long", long))}
    blocks, first = -(-1200 // 16), (1200 - 64) // 16  # a prompt's 75 blocks; its window from block 71
    assert read["short"] == pytest.approx(read["long"] * (6 * blocks + 6 * (blocks - first)) / (12 * blocks),
                                          rel=1e-6)
