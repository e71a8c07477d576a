"""Two real vLLM CPU engines, P (``kv_producer``) and D (``kv_consumer``), each in its own
process, handing off through kvstate's FileStore: D's greedy tokens equal a run without a
connector; with a stored block corrupted D detects it, recomputes, and its tokens still equal.
vLLM's ExampleConnector, given the same corruption, changes D's tokens."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from needs import vllm_missing

pytestmark = [pytest.mark.slow, pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))]

HERE = Path(__file__).parent
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
          "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
          "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
PROMPTS = [list(range(5, 81)), [9, 8, 7, 6, 5, 4, 3, 2, 1, *range(100, 141)], list(range(200, 300, 3))]
KVSTATE = {"connector": "KVStateConnector", "module": "kvstate.integrations.vllm"}


#: a Gemma-2-shaped model: a sliding-window layer, then a full one (vLLM gives a connector
#: without SupportsHMA every layer's blocks for every token)
GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 128,
          "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
          "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
          "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 32,
          "query_pre_attn_scalar": 64, "attn_logit_softcapping": None, "final_logit_softcapping": None,
          "hidden_activation": "gelu_pytorch_tanh"}


def engine(tmp: Path, max_tokens: int, model: str = "model", **conf: Any) -> dict[str, Any]:
    args = {"model": str(tmp / model), "prompts": PROMPTS, "max_tokens": max_tokens, **conf}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(HERE / "vllm_engine.py"), json.dumps(args)], capture_output=True,
                         text=True, timeout=300, env=env, cwd=tmp)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: Any) -> Path:
    d = tmp_path_factory.mktemp("engines")
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text(json.dumps(CONFIG))
    (d / "gemma2").mkdir()
    (d / "gemma2" / "config.json").write_text(json.dumps(GEMMA2))
    return d


@pytest.fixture(scope="module")
def reference(tmp: Path) -> list[list[int]]:
    return engine(tmp, 8)["tokens"]


def corrupt_block(root: Path, block: int, group: int | None = None) -> None:
    """Flip bytes of one stored block of the first prompt (of one layer group's object, with
    layer groups), through the store's own API."""
    import numpy as np

    from kvstate import block_keys, rank_key
    from kvstate.backends._filestore import FileStore

    key = block_keys(PROMPTS[0][:-1], 32, namespace=str(root.parent / "model"))[block]
    fs = FileStore(root)
    name = [rank_key(key, "key", 0, group)]
    buf = np.zeros(1 << 20, np.uint8)
    n = fs.batch_get_into(name, [buf])[0]
    assert n > 0
    buf[: n // 2] = 0x7F  # large bf16 values: a cache no model would compute
    fs.batch_put_from(name, [buf[:n]])
    fs.close()


def test_d_tokens_equal_a_run_without_a_connector_and_survive_a_corrupt_block(tmp, reference):
    store = {"store": {"kind": "file", "root": str(tmp / "kv")}}
    p = engine(tmp, 1, role="kv_producer", extra=store, **KVSTATE)
    assert p["counters"]["saved"] == len(PROMPTS)
    d = engine(tmp, 8, role="kv_consumer", extra=store, remote=True, **KVSTATE)
    assert d["counters"]["loaded"] == len(PROMPTS)
    assert d["tokens"] == reference
    corrupt_block(tmp / "kv", 1)
    d = engine(tmp, 8, role="kv_consumer", extra={**store, "wait_for_cache": 0}, remote=True, **KVSTATE)
    assert d["counters"]["load_partial"] == 1 and d["counters"]["loaded"] == len(PROMPTS) - 1
    assert d["tokens"] == reference


def test_p_saving_layer_by_layer_hands_d_the_same_tokens(tmp, reference):
    store = {"store": {"kind": "file", "root": str(tmp / "kv-layered")}, "layer_groups": 2}
    p = engine(tmp, 1, role="kv_producer", extra=store, **KVSTATE)
    assert p["counters"]["saved"] == p["counters"]["layerwise_saves"] == len(PROMPTS)
    d = engine(tmp, 8, role="kv_consumer", extra=store, remote=True, **KVSTATE)
    assert d["counters"]["loaded"] == len(PROMPTS) and d["tokens"] == reference


def test_d_loading_layer_by_layer_within_its_forward_keeps_the_tokens_and_survives_a_corrupt_block(tmp, reference):
    store = {"store": {"kind": "file", "root": str(tmp / "kv-layerload")}, "layer_groups": 2}
    p = engine(tmp, 1, role="kv_producer", extra=store, **KVSTATE)
    assert p["counters"]["saved"] == len(PROMPTS)
    load = {**store, "load": "layerwise", "wait_for_cache": 0}
    d = engine(tmp, 8, role="kv_consumer", extra=load, remote=True, **KVSTATE)
    assert d["counters"]["loaded"] == len(PROMPTS) and d["tokens"] == reference
    corrupt_block(tmp / "kv-layerload", 1, group=1)  # the second group: the first arrived, the forward ran on
    d = engine(tmp, 8, role="kv_consumer", extra=load, remote=True, **KVSTATE)
    assert d["counters"]["load_partial"] == 1 and d["counters"]["loaded"] == len(PROMPTS) - 1
    assert d["tokens"] == reference


def test_a_model_with_sliding_window_layers_hands_off_token_exact(tmp):
    reference = engine(tmp, 8, model="gemma2")["tokens"]
    store = {"store": {"kind": "file", "root": str(tmp / "kv-gemma2")}}
    p = engine(tmp, 1, model="gemma2", role="kv_producer", extra=store, **KVSTATE)
    assert p["counters"]["saved"] == len(PROMPTS)
    d = engine(tmp, 8, model="gemma2", role="kv_consumer", extra=store, remote=True, **KVSTATE)
    assert d["counters"]["loaded"] == len(PROMPTS) and d["tokens"] == reference


def test_the_same_corruption_through_vllms_example_connector_changes_d_tokens(tmp, reference):
    store = {"shared_storage_path": str(tmp / "example")}
    example = {"connector": "ExampleConnector", "role": "kv_both", "extra": store}
    engine(tmp, 1, **example)
    files = sorted((tmp / "example").rglob("*.safetensors"))
    assert files
    from safetensors.torch import load_file, save_file

    for f in files[:2]:  # the first prompt's layers (its folder)
        t = load_file(f)
        t["kv_cache"].fill_(30.0)
        save_file(t, f)
    d = engine(tmp, 8, **example)
    assert d["tokens"] != reference
