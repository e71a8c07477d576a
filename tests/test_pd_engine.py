"""A real transformer's KV cache through kvstate on the GPU (examples/pd_engine/).

A Llama-architecture model with random weights runs PD: P prefills and writes through
``CudaBackend`` to a store, D reads back and decodes greedily. Each test compares D's tokens and
logits with a monolithic run of the same model — bit for bit — and checks that no block leaks.

Marked ``gpu``: skipped with a reason where CuPy, PyTorch or a CUDA device is missing.
"""
import pytest
from needs import gpu as needs_gpu
from pd_helpers import BS, assert_exact, serve, window_read_bytes, workload

pytestmark = [pytest.mark.gpu, needs_gpu("torch")]


@pytest.fixture(scope="module")
def model():
    from model import LlamaConfig, TinyLlama

    return TinyLlama(LlamaConfig(), seed=0)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("store", ["memory", "file"])
def test_token_exact_handoff(model, tp, store, tmp_path):
    from kvstate.backends import FileStore

    reqs = workload()
    eng, leaks = serve(model, reqs, FileStore(str(tmp_path)) if store == "file" else None, tp=tp)
    assert leaks == {"P": 0, "D": 0, "pinned": 0}
    assert_exact(model, reqs)


@pytest.mark.parametrize("tp,d_tp", [(2, 1), (1, 2)])
@pytest.mark.parametrize("layerwise", [False, True])
def test_p_and_d_of_different_tp_degrees_are_token_exact(model, tp, d_tp, layerwise):
    """P at one TP degree, D at another: head groups both split (one head an object here), each
    D rank reading exactly its heads; tokens and logits are the monolithic run's."""
    reqs = workload()
    eng, leaks = serve(model, reqs, tp=tp, d_tp=d_tp, layerwise=layerwise)
    assert leaks == {"P": 0, "D": 0, "pinned": 0}
    assert eng.spec.tp_size == tp and eng.d_spec.tp_size == d_tp
    assert eng.spec.object_heads == eng.d_spec.object_heads == model.cfg.kv_heads // 2
    assert sum(b.broken_blocks for b in eng.backends) == 0
    assert_exact(model, reqs)


def test_layerwise_save_is_exact(model):
    """P saves each layer as the GPU finishes it, one stored object per layer, and D loads them
    layer group by group: no retry, and D's tokens and logits are the monolithic run's."""
    reqs = workload()
    eng, leaks = serve(model, reqs, layerwise=True)
    assert leaks == {"P": 0, "D": 0, "pinned": 0}
    assert eng.P.stats()["retries"] == 0 and eng.P.layerwise and eng.D.layerwise
    assert all(name.rsplit("_", 1)[1].startswith("g") for name in eng.store)
    assert_exact(model, reqs)


def test_prefix_read_from_the_store_is_exact(model):
    """Requests run one after another, so every shared prefix is stored before it is wanted."""
    from kvstate.backends import MemoryStore

    store = MemoryStore(1 << 30)
    reqs = workload(8)
    for r in reqs:
        eng, leaks = serve(model, [r], store)
        assert leaks == {"P": 0, "D": 0, "pinned": 0}
    assert_exact(model, reqs)
    # P read every full block an earlier prompt had stored (leaving one token to compute)
    shared = _shared_prefixes(reqs)
    assert {r.rid: r.cached_tokens for r in reqs} == shared and any(shared.values())


def test_gpu_prefix_cache_is_exact(model):
    """One engine serves the requests one after another with its GPU prefix caches on: P
    computes only past the blocks an earlier prompt left on its GPU, D reads only what its GPU
    lacks, and tokens and logits stay exact."""
    from engine import PDEngine

    from kvstate.backends import MemoryStore

    reqs = workload(8)
    eng = PDEngine(model, MemoryStore(1 << 30), block_size=BS, num_blocks=1024, prefix_cache=True)
    try:
        for r in reqs:
            eng.run([r])
        leaks, p, d = eng.leaks(), eng.P.stats(), eng.D.stats()
    finally:
        eng.close()
    assert leaks == {"P": 0, "D": 0, "pinned": 0}
    assert_exact(model, reqs)
    shared = _shared_prefixes(reqs)
    assert {r.rid: r.cached_tokens for r in reqs} == shared and any(shared.values())
    assert p["gpu_prefix_blocks"] * BS == sum(shared.values()) and p["store_prefix_blocks"] == 0
    assert d["gpu_read_blocks"] >= p["gpu_prefix_blocks"]


def _shared_prefixes(reqs) -> dict[str, int]:
    """Prompt tokens in full blocks each request shares with an earlier one (leaving one to compute)."""
    shared = {}
    for i, r in enumerate(reqs):
        common = max((_common(r.prompt, d.prompt) for d in reqs[:i]), default=0)
        shared[r.rid] = min(common, len(r.prompt) - 1) // BS * BS
    return shared


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("preemption", ["write", "recompute"])
def test_preemption_mid_decode_is_exact(model, preemption, prefix_cache):
    """With the GPU prefix cache, a resume claims back the blocks still on the GPU and reloads
    or recomputes only the rest."""
    from kvstate import Policy

    reqs = workload(8, max_new=10, per_request={i: {"preempt_after": 3 + i % 4} for i in range(0, 8, 2)})
    eng, leaks = serve(model, reqs, policy=Policy(preempt=preemption), prefix_cache=prefix_cache)
    assert leaks == {"P": 0, "D": 0, "pinned": 0}
    assert_exact(model, reqs)
    if prefix_cache:
        assert eng.D.stats()["prefix_cache"].hit_blocks > 0


@pytest.mark.parametrize("fault", [0, 1, "fail"])
def test_failed_or_partial_read_recompute_is_exact(model, fault):
    from kvstate import Policy

    reqs = workload(8, per_request={i: {"read_fault": fault} for i in (4, 5, 7)})  # prompts of 64..257 tokens
    _, leaks = serve(model, reqs, policy=Policy(read_failure="recompute"))
    assert leaks == {"P": 0, "D": 0, "pinned": 0}
    assert_exact(model, reqs)


def test_failed_read_under_fail_policy_ends_with_its_error(model):
    from kvstate import Policy

    reqs = workload(8, per_request={5: {"read_fault": "fail"}})
    _, leaks = serve(model, reqs, policy=Policy(read_failure="fail"))
    assert leaks == {"P": 0, "D": 0, "pinned": 0}
    bad = next(r for r in reqs if r.rid == "r05")
    assert bad.ended is not None and bad.ended[0] == "failed" and bad.ended[1] == 502
    assert_exact(model, reqs, skip=("r05",))


STATES = ["waiting", "reading_prefix", "prefilling", "writing",  # P
          "reserved", "reading", "recomputing", "running", "preempt_writing", "preempted", "reloading"]  # D


@pytest.mark.parametrize("state", STATES)
def test_abort_in_every_state_leaks_nothing(model, state):
    from kvstate import Policy

    target = 6  # shares a prefix with an earlier prompt: P reads it
    extra = {"abort_in": state}
    if state in ("preempt_writing", "preempted", "reloading"):
        extra["preempt_after"] = 2
    if state == "recomputing":
        extra["read_fault"] = "fail"
    reqs = workload(8, max_new=6, per_request={target: extra})
    # a small P pool makes requests wait for blocks at P
    kw = {"p_blocks": 10} if state == "waiting" else {}
    eng, leaks = serve(model, reqs, policy=Policy(read_failure="recompute"), **kw)
    assert leaks == {"P": 0, "D": 0, "pinned": 0}
    r = reqs[target]
    assert r.abort_in is None, f"the run never reached {state}"
    assert r.ended is not None and r.ended[0] == "aborted", r.ended
    assert_exact(model, reqs, skip=(r.rid,))


@pytest.fixture(scope="module")
def window_model():
    """Gemma 2's pattern: a sliding window of two blocks on every other layer."""
    from model import LlamaConfig, TinyLlama

    return TinyLlama(LlamaConfig(window=2 * BS, window_layers=(0, 2)), seed=0)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_sliding_window_model_is_token_exact_reading_only_its_last_windows(window_model, tp):
    reqs = workload(12)
    eng, leaks = serve(window_model, reqs, tp=tp)
    assert leaks == {"P": 0, "D": 0, "pinned": 0}
    assert_exact(window_model, reqs)
    want = window_read_bytes(eng.d_spec, reqs)
    assert eng.backends[1].bytes_moved == want < sum(-(-len(r.prompt) // BS) for r in reqs) * (
        eng.d_spec.bytes_per_block_per_rank * tp)


@pytest.mark.parametrize("fault", [0, 1, "fail"])
def test_a_sliding_window_model_recomputes_exactly_after_a_failed_read(window_model, fault):
    from kvstate import Policy

    reqs = workload(8, per_request={i: {"read_fault": fault} for i in (4, 5, 7)})
    _, leaks = serve(window_model, reqs, policy=Policy(read_failure="recompute"))
    assert leaks == {"P": 0, "D": 0, "pinned": 0}
    assert_exact(window_model, reqs)


@pytest.fixture(scope="module")
def mla_model():
    """DeepSeek-V2-shaped attention: a latent of 64 + 16 rotated values a token, no value cache."""
    from model import LlamaConfig, TinyLlama

    return TinyLlama(LlamaConfig(kv_lora_rank=64, rope_dim=16), seed=0)


def test_an_mla_model_is_token_exact_and_stores_its_latent_once(mla_model):
    from kvstate.backends import MemoryStore

    used = {}
    for tp in (1, 2):
        store, reqs = MemoryStore(1 << 30), workload(12)
        eng, leaks = serve(mla_model, reqs, store=store, tp=tp)
        assert leaks == {"P": 0, "D": 0, "pinned": 0}
        assert_exact(mla_model, reqs)  # at TP 2 each D rank's heads come from its own copy
        assert eng.spec.kinds == ("key",) and eng.spec.bytes_per_block_per_rank == eng.spec.layers * BS * 80 * 2
        used[tp] = store.used_bytes
    assert used[1] == used[2] > 0  # rank 0 writes: TP 2 stores no second copy


@pytest.mark.parametrize("fault", [1, "fail"])
def test_an_mla_model_recomputes_exactly_after_a_failed_read(mla_model, fault):
    from kvstate import Policy

    reqs = workload(8, per_request={i: {"read_fault": fault} for i in (4, 5, 7)})
    _, leaks = serve(mla_model, reqs, tp=2, policy=Policy(read_failure="recompute"))
    assert leaks == {"P": 0, "D": 0, "pinned": 0}
    assert_exact(mla_model, reqs)


@pytest.mark.parametrize("store", ["memory", "arena"])
@pytest.mark.parametrize("preemption", [None, "recompute"])
def test_p_on_the_first_gpu_and_d_on_the_second_are_token_exact(model, store, preemption):
    """P computes and saves on GPU 0, D reads and decodes on GPU 1 (its caches, its backend and
    a copy of the weights there), through the store; preempted requests are recomputed on GPU
    1: D's tokens and logits are the monolithic run's on GPU 0, bit for bit, nothing leaks."""
    import torch

    from kvstate import Policy
    from kvstate.app._demo import arena_store

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    reqs = workload(8, max_new=10, per_request={i: {"preempt_after": 3 + i % 4} for i in range(0, 8, 2)}
                    if preemption else {})
    kw = dict(d_device=1, policy=Policy(preempt=preemption)) if preemption else dict(d_device=1)
    if store == "arena":
        from engine import cache_spec

        st = arena_store(cache_spec(model.cfg, 1, BS, False), 2048)
        try:
            eng, leaks = serve(model, reqs, st, **kw)
        finally:
            st.close()
    else:
        eng, leaks = serve(model, reqs, **kw)
    assert leaks == {"P": 0, "D": 0, "pinned": 0}
    assert eng.d_cache.caches[0]["key"][0].device.index == 1 and eng.backends[1].device == 1
    assert torch.cuda.current_device() == 0  # D's backend on GPU 1 left the engine's thread on its own GPU
    assert_exact(model, reqs)
    if preemption:
        assert eng.recomputed
