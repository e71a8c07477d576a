"""transformers' own Gemma 2, Mistral and DeepSeek-V2 through P → store → D on the GPU (examples/pd_engine/hf.py).

Both are built from configs with random weights (nothing downloaded) and keep their cache in
kvstate's pages. Each test compares D's greedy tokens and logits with transformers' own run
(its ``DynamicCache``, the same chunks), bit for bit, and checks that no block leaks:

- Gemma 2 (a sliding window of two blocks on every other layer): D reads the window layers only
  from their last window, at TP 1 and 2 and from P at TP 2 to D at TP 1; a failed or partial
  read is recomputed; a preempted request is written back and reloaded.
- Mistral (a sliding window on every layer): a decoding request frees the blocks behind it.
- Gemma 2 and DeepSeek-V2: P reads a prefix an earlier request stored, or finds it on its GPU
  (prefix cache), and computes only the rest.
- DeepSeek-V2 (MLA and MoE): the latent is stored once whatever the TP degree, and every D rank
  reads that one object; a failed or partial read is recomputed.

Marked ``gpu``: skipped with a reason where CuPy, PyTorch, transformers or a CUDA device is missing.
"""
import pytest
from needs import gpu as needs_gpu
from pd_helpers import BS, assert_exact, serve, window_read_bytes, workload

pytestmark = [pytest.mark.gpu, needs_gpu("torch", "transformers")]

LENGTHS = [1, 31, 33, 64, 95, 130, 257, 500]  # partial blocks, and prompts longer than a window
NO_LEAK = {"P": 0, "D": 0, "pinned": 0}


@pytest.fixture(scope="module")
def gemma():
    from hf import gemma2

    return gemma2(window=2 * BS)


@pytest.fixture(scope="module")
def mistral():
    from hf import mistral

    return mistral(window=2 * BS)


@pytest.fixture(scope="module")
def deepseek():
    from hf import deepseek_v2

    return deepseek_v2()


def transformers_run(model):
    """The reference: each request through transformers' own cache."""
    from hf import native

    return lambda reqs: {r.rid: native(model, r.prompt, r.max_new, BS) for r in reqs}


def hf_workload(n: int = 8, **kw):
    return workload(n, lengths=LENGTHS, **kw)


def test_the_models_are_what_the_issue_names(gemma, deepseek):
    """Gemma 2 interleaves sliding and full layers; DeepSeek-V2 caches one latent a token; the
    engine's cache specs follow them; greedy decoding does not just repeat one token."""
    from engine import cache_spec

    assert gemma.hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
    spec = cache_spec(gemma.cfg, 1, BS)
    assert [(g.kind, g.layers, g.window) for g in spec.groups] == [("window", (0, 2), 2 * BS), ("full", (1, 3), 0)]
    spec = cache_spec(deepseek.cfg, 2, BS)
    assert [(g.kind, g.layers) for g in spec.groups] == [("latent", (0, 1, 2, 3))]
    assert spec.kinds == ("key",) and spec.head_dim == 64 + 16
    assert type(deepseek.hf.model.layers[1].mlp).__name__ == "DeepseekV2Moe"
    reqs = hf_workload(4, max_new=8)
    for model in (gemma, deepseek):
        runs = transformers_run(model)(reqs)
        assert len({t for tokens, _ in runs.values() for t in tokens}) > 4


@pytest.mark.parametrize("tp,d_tp", [(1, 1), (2, 2), (2, 1)])
def test_gemma2_through_the_store_equals_transformers_run(gemma, tp, d_tp):
    reqs = hf_workload()
    eng, leaks = serve(gemma, reqs, tp=tp, d_tp=d_tp)
    assert leaks == NO_LEAK
    assert_exact(gemma, reqs, reference=transformers_run(gemma))
    whole = sum(-(-len(r.prompt) // BS) for r in reqs) * eng.d_spec.bytes_per_block_per_rank * d_tp
    assert eng.backends[1].bytes_moved == window_read_bytes(eng.d_spec, reqs) < whole


@pytest.mark.parametrize("name", ["gemma", "deepseek"])
def test_a_prefix_read_from_the_store_equals_transformers_run(name, request):
    """Requests one after another, so every shared prefix is stored before it is wanted: P
    reads it (Gemma 2's window layers from their window on) and computes only the rest."""
    from kvstate.backends import MemoryStore

    model, store, reqs = request.getfixturevalue(name), MemoryStore(1 << 30), hf_workload()
    for r in reqs:
        _, leaks = serve(model, [r], store)
        assert leaks == NO_LEAK
    assert [r.cached_tokens for r in reqs if r.cached_tokens] == [32, 128]
    assert_exact(model, reqs, reference=transformers_run(model))


def test_mistral_frees_the_blocks_behind_its_window_and_equals_transformers_run(mistral, monkeypatch):
    """Every layer a window layer: D reads each prompt's last window only, and a decoding
    request frees the blocks wholly behind its window, which its steps then never touch."""
    from kvstate._pool import FREED

    freed_steps = []
    forward = mistral.forward

    def spy(tokens, start, cache, table, on_layer=None, state=None):
        freed_steps.append(FREED in table)
        return forward(tokens, start, cache, table, on_layer, state)

    monkeypatch.setattr(mistral, "forward", spy)
    reqs = hf_workload(max_new=40)
    eng, leaks = serve(mistral, reqs, tp=2)
    monkeypatch.undo()
    assert leaks == NO_LEAK and eng.d_spec.frees_behind_window
    assert sum(freed_steps) > 20  # decode steps over tables whose early blocks were freed
    assert eng.backends[1].bytes_moved == window_read_bytes(eng.d_spec, reqs)
    assert_exact(mistral, reqs, reference=transformers_run(mistral))


@pytest.mark.parametrize("preempt", [None, "write", "recompute"])
def test_gemma2_with_a_table_per_group_frees_its_window_and_equals_transformers_run(gemma, monkeypatch, preempt):
    """D gives Gemma 2's window and full layers a block table each (kvstate._tables): decoding
    frees the window layers' blocks behind the window while the full layers keep theirs, and
    tokens and logits stay transformers' own, through preemption too (a write-back stores the
    full layers' every block and the window's, so a reload continues without recomputing)."""
    from kvstate import Policy
    from kvstate._pool import FREED

    freed_steps = []
    forward = gemma.forward

    def spy(tokens, start, cache, table, on_layer=None, state=None):
        freed_steps.append(any(isinstance(b, tuple) and FREED in b for b in table))
        return forward(tokens, start, cache, table, on_layer, state)

    monkeypatch.setattr(gemma, "forward", spy)
    per = {i: {"preempt_after": 20 + i} for i in range(0, 8, 2)} if preempt else None
    reqs = hf_workload(max_new=40, per_request=per)
    eng, leaks = serve(gemma, reqs, tp=2, group_tables=True, policy=Policy(preempt=preempt or "write"))
    monkeypatch.undo()
    assert leaks == NO_LEAK and eng.d_spec.group_tables and eng.d_cache.caches[0]["key"][0] is \
        eng.d_cache.caches[0]["key"][1]  # a window and a full layer share a block's first slot
    assert sum(freed_steps) > 20  # decode steps whose window column was freed behind the window
    assert_exact(gemma, reqs, reference=transformers_run(gemma))


@pytest.mark.parametrize("name", ["gemma", "deepseek"])
def test_the_gpu_prefix_cache_equals_transformers_run(name, request):
    """One engine serves the requests in turn with its GPU prefix caches on: P computes only
    past the blocks an earlier prompt left on its GPU, and the store is not asked for them."""
    from engine import PDEngine

    from kvstate.backends import MemoryStore

    model, reqs = request.getfixturevalue(name), hf_workload()
    eng = PDEngine(model, MemoryStore(1 << 30), block_size=BS, num_blocks=1024, prefix_cache=True)
    try:
        for r in reqs:
            eng.run([r])
        leaks, p = eng.leaks(), eng.P.stats()
    finally:
        eng.close()
    assert leaks == NO_LEAK
    assert [r.cached_tokens for r in reqs if r.cached_tokens] == [32, 128]
    assert p["gpu_prefix_blocks"] * BS == 160 and p["store_prefix_blocks"] == 0
    assert_exact(model, reqs, reference=transformers_run(model))


@pytest.mark.parametrize("fault", [0, 1, "fail"])
def test_gemma2_recomputes_exactly_after_a_failed_read(gemma, fault):
    from kvstate import Policy

    reqs = hf_workload(per_request={i: {"read_fault": fault} for i in (4, 5, 7)})
    eng, leaks = serve(gemma, reqs, policy=Policy(read_failure="recompute"))
    assert leaks == NO_LEAK
    assert {"r04", "r05", "r07"} <= set(eng.recomputed)
    assert_exact(gemma, reqs, reference=transformers_run(gemma))


@pytest.mark.parametrize("preemption", ["write", "recompute"])
def test_gemma2_preempted_mid_decode_equals_transformers_run(gemma, preemption):
    from kvstate import Policy

    reqs = hf_workload(max_new=10, per_request={i: {"preempt_after": 3 + i % 4} for i in range(0, 8, 2)})
    _, leaks = serve(gemma, reqs, policy=Policy(preempt=preemption))
    assert leaks == NO_LEAK
    assert_exact(gemma, reqs, reference=transformers_run(gemma))


def test_deepseek_v2_stores_its_latent_once_and_equals_transformers_run(deepseek):
    from kvstate.backends import MemoryStore

    used = {}
    for tp in (1, 2):
        store, reqs = MemoryStore(1 << 30), hf_workload()
        eng, leaks = serve(deepseek, reqs, store=store, tp=tp)
        assert leaks == NO_LEAK
        assert_exact(deepseek, reqs, reference=transformers_run(deepseek))  # each D rank reads its own copy
        used[tp] = store.used_bytes
    assert used[1] == used[2] > 0  # rank 0 writes: TP 2 stores no second copy


@pytest.mark.parametrize("fault", [1, "fail"])
def test_deepseek_v2_recomputes_exactly_after_a_failed_read(deepseek, fault):
    from kvstate import Policy

    reqs = hf_workload(per_request={i: {"read_fault": fault} for i in (4, 5, 7)})
    eng, leaks = serve(deepseek, reqs, tp=2, policy=Policy(read_failure="recompute"))
    assert leaks == NO_LEAK
    assert {"r04", "r05", "r07"} <= set(eng.recomputed)
    assert_exact(deepseek, reqs, reference=transformers_run(deepseek))


def test_deepseek_v2_saved_layer_by_layer_equals_transformers_run(deepseek):
    """P saves each layer once transformers' decoder layer ran (a hook records its event), one
    stored object per layer; D loads them layer by layer."""
    reqs = hf_workload()
    eng, leaks = serve(deepseek, reqs, layerwise=True)
    assert leaks == NO_LEAK
    assert eng.P.layerwise and eng.P.stats()["retries"] == 0
    assert all(name.rsplit("_", 1)[1].startswith("g") for name in eng.store)
    assert_exact(deepseek, reqs, reference=transformers_run(deepseek))
