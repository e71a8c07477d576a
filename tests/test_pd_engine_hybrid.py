"""transformers' own Qwen3-Next, a hybrid of linear-attention and full-attention layers, through
P → store → D on the GPU (examples/pd_engine/hf.py).

Built from a config with random weights (nothing downloaded). Its full-attention layer keeps
its keys and values in kvstate's blocks; its three linear-attention layers keep a fixed-size
state (a convolution window and a gated-delta-rule matrix) in a state page, which kvstate stores
with the prefix it follows. Each test compares D's greedy tokens and logits with transformers'
own run (its ``DynamicCache``, the same chunks), bit for bit, and checks that nothing leaks:

- the handoff at TP 1 and 2 (each rank stores its share of the state), also layer-wise;
- a prefix reused from a stored checkpoint, and not from a prefix no state was stored for
  (unless P keeps more of a prompt's checkpoints: ``Policy.state_checkpoints``);
- a prefix reused from a checkpoint state P's GPU prefix cache kept;
- a failed or partial read, recomputed from the last checkpoint every rank read, or from 0;
- a state object corrupted on one rank: detected, evicted, recomputed;
- a request preempted mid-decode: its running state written back and reloaded, or recomputed,
  or its blocks swapped to D's host tier while its state page stays.

Marked ``gpu``: skipped with a reason where CuPy, PyTorch, transformers or a CUDA device is missing.
"""
import random

import pytest
from needs import gpu as needs_gpu
from pd_helpers import BS, assert_exact, serve, workload

pytestmark = [pytest.mark.gpu, needs_gpu("torch", "transformers")]

LENGTHS = [1, 31, 33, 64, 95, 130, 257, 500]
NO_LEAK = {"P": 0, "D": 0, "pinned": 0}
CHECKPOINT = 2 * BS


@pytest.fixture(scope="module")
def qwen():
    from hf import qwen3_next

    return qwen3_next(checkpoint=CHECKPOINT)


def transformers_run(model):
    from hf import native

    return lambda reqs: {r.rid: native(model, r.prompt, r.max_new, BS) for r in reqs}


def test_qwen3_next_is_a_hybrid_and_its_spec_says_so(qwen):
    from engine import cache_spec

    assert qwen.hf.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert type(qwen.hf.model.layers[0].linear_attn).__name__ == "Qwen3NextGatedDeltaNet"
    assert type(qwen.hf.model.layers[0].mlp).__name__ == "Qwen3NextSparseMoeBlock"
    spec = cache_spec(qwen.cfg, 2, BS)
    assert [(g.kind, g.layers) for g in spec.groups] == [("full", (3,)), ("state", (0, 1, 2))]
    # a layer: a 4-token window over q, k, v (2·64 + 128 values, bf16) and a 4×32×32 float32 matrix
    assert qwen.cfg.state_bytes == 256 * 4 * 2 + 4 * 32 * 32 * 4
    assert spec.state_bytes_per_rank == 3 * qwen.cfg.state_bytes // 2
    runs = transformers_run(qwen)(workload(4, max_new=8, lengths=LENGTHS))
    assert len({t for tokens, _ in runs.values() for t in tokens}) > 4


@pytest.mark.parametrize("tp", [1, 2])
def test_the_handoff_equals_transformers_run(qwen, tp):
    from kvstate._keys import block_keys, rank_key
    from kvstate.backends import MemoryStore

    store, reqs = MemoryStore(1 << 30), workload(8, lengths=LENGTHS)
    eng, leaks = serve(qwen, reqs, store, tp=tp)
    assert leaks == NO_LEAK
    assert_exact(qwen, reqs, reference=transformers_run(qwen))
    names = set(store)
    for r in reqs:  # the prompt's state, each rank's share, stored with its last block
        last = block_keys(r.prompt, BS)[-1]
        assert {rank_key(last, "state", rank) for rank in range(tp)} <= names, r.rid
    assert eng.backends[1].broken_states == 0


@pytest.mark.parametrize("tp, layers", [(1, 4), (2, 4), (2, 8)])
def test_a_layerwise_handoff_equals_transformers_run(qwen, tp, layers):
    """P saves the full-attention layers' blocks group by group as the prefill launches them
    (one group in the 4-layer model, two in an 8-layer one, layers 3 and 7), the last group
    and the states once every layer is done; D loads the state before its first group."""
    from hf import qwen3_next

    from kvstate.backends import MemoryStore

    model = qwen if layers == 4 else qwen3_next(layers=layers, checkpoint=CHECKPOINT)
    assert model.cfg.paged_layers == tuple(range(3, layers, 4))
    reqs = workload(8, lengths=LENGTHS)
    eng, leaks = serve(model, reqs, MemoryStore(1 << 30), tp=tp, layerwise=True)
    assert leaks == NO_LEAK and eng.P.layerwise and eng.D.layerwise and eng.spec.layer_groups == layers // 4
    assert eng.P.stats()["retries"] == 0 and eng.recomputed == []  # every save and load whole at once
    assert_exact(model, reqs, reference=transformers_run(model))


def test_a_prefix_is_reused_from_a_stored_checkpoint_only(qwen):
    """P stores the state at a prompt's last checkpoint and at its end. A later prompt sharing
    past that checkpoint resumes there; one sharing only 4 blocks (no state stored at 128
    tokens) computes from 0. Both equal transformers' run."""
    from engine import Request

    from kvstate.backends import MemoryStore

    rng = random.Random(5)
    fresh = lambda n: [rng.randrange(512) for _ in range(n)]  # noqa: E731
    donor = fresh(200)  # checkpoints at 64, 128, 192: P stores 192's
    reqs = [Request("a", donor, 6), Request("b", donor + fresh(50), 6), Request("c", donor[:150] + fresh(100), 6)]
    store = MemoryStore(1 << 30)
    for r in reqs:
        _, leaks = serve(qwen, [r], store)
        assert leaks == NO_LEAK
    assert [r.cached_tokens for r in reqs] == [0, 192, 0]
    assert_exact(qwen, reqs, reference=transformers_run(qwen))


def test_p_keeping_every_checkpoint_lets_a_shorter_shared_prefix_resume(qwen):
    """With ``Policy(state_checkpoints=3)`` P's prefill copies the states at 64, 128 and 192
    tokens into pages of their own and stores them all: the prompt sharing only 150 tokens
    now resumes at 128. All equal transformers' run."""
    from engine import Request

    from kvstate._policy import Policy
    from kvstate.backends import MemoryStore

    rng = random.Random(5)
    fresh = lambda n: [rng.randrange(512) for _ in range(n)]  # noqa: E731
    donor = fresh(200)
    reqs = [Request("a", donor, 6), Request("b", donor + fresh(50), 6), Request("c", donor[:150] + fresh(100), 6)]
    store = MemoryStore(1 << 30)
    for r in reqs:
        _, leaks = serve(qwen, [r], store, policy=Policy(state_checkpoints=3))
        assert leaks == NO_LEAK
    assert [r.cached_tokens for r in reqs] == [0, 192, 128]
    assert_exact(qwen, reqs, reference=transformers_run(qwen))


def test_p_starts_a_prompt_from_a_checkpoint_state_its_gpu_prefix_cache_kept(qwen):
    """With P's GPU prefix cache, P keeps its state page of a prompt's last checkpoint. A later
    prompt sharing past it claims the cached blocks up to it and starts from a copy of that
    state (nothing read from the store); one sharing only 150 tokens computes from 0. All
    equal transformers' run."""
    from engine import PDEngine, Request

    from kvstate.backends import MemoryStore

    rng = random.Random(5)
    fresh = lambda n: [rng.randrange(512) for _ in range(n)]  # noqa: E731
    donor = fresh(200)  # checkpoints at 64, 128, 192: P keeps 192's
    reqs = [Request("a", donor, 6), Request("b", donor + fresh(50), 6), Request("c", donor[:150] + fresh(100), 6)]
    eng = PDEngine(qwen, MemoryStore(1 << 30), block_size=BS, num_blocks=1024, prefix_cache=True)
    try:
        for r in reqs:  # one after another, so b finds a's cached blocks and state
            eng.run([r])
        assert eng.leaks() == NO_LEAK and eng.P.states.pool.num_used == eng.D.states.pool.num_used == 0
    finally:
        eng.close()
    assert [r.cached_tokens for r in reqs] == [0, 192, 0]
    assert eng.P.counters["gpu_prefix_blocks"] == 192 // BS and eng.P.counters["store_prefix_blocks"] == 0
    assert_exact(qwen, reqs, reference=transformers_run(qwen))


@pytest.mark.parametrize("fault", [0, 1, 2, "fail"])
def test_a_failed_read_is_recomputed_exactly(qwen, fault, monkeypatch):
    """D's read of three prompts (95, 130 and 500 tokens) fails, or stops after 1 or 2 blocks.
    D reads the state stored with the prompt, else the one at its last checkpoint (64, 128 and
    448 tokens): after 2 blocks, the 95-token prompt's ranks hold the blocks and state of 64
    tokens, and D recomputes from there; every other one from 0."""
    from engine import PDEngine

    from kvstate import Policy

    starts = []
    recompute = PDEngine._recompute
    monkeypatch.setattr(PDEngine, "_recompute", lambda eng, r, cmd: (starts.append(cmd.from_token),
                                                                      recompute(eng, r, cmd)))
    reqs = workload(8, lengths=LENGTHS, per_request={i: {"read_fault": fault} for i in (4, 5, 7)})
    eng, leaks = serve(qwen, reqs, tp=2, policy=Policy(read_failure="recompute"))
    assert leaks == NO_LEAK
    assert {"r04", "r05", "r07"} == set(eng.recomputed)
    assert sorted(starts) == [0, 0, CHECKPOINT if fault == 2 else 0]
    assert_exact(qwen, reqs, reference=transformers_run(qwen))


def test_a_state_corrupt_on_one_rank_is_evicted_and_recomputed(qwen):
    """The same prompt three times over one store. The second time, D's read of rank 1's share
    of the prompt's state finds a flipped byte: D evicts it and recomputes (rank 0 holds the
    prompt's state, rank 1 the checkpoint's: no common start but 0). P stores it anew the third
    time, which is served whole. All exact."""
    from engine import Request

    from kvstate import Policy
    from kvstate._keys import block_keys, rank_key
    from kvstate.backends import MemoryStore

    prompt = [random.Random(7).randrange(512) for _ in range(150)]
    name = rank_key(block_keys(prompt, BS)[-1], "state", 1)

    class FlipOnce(MemoryStore):
        armed = False

        def batch_get_into(self, keys, buffers):
            got = super().batch_get_into(keys, buffers)
            if self.armed and name in keys:
                self.armed = False
                i = list(keys).index(name)
                buffers[i][got[i] // 2] ^= 0x10
            return got

    store = FlipOnce(1 << 30)
    first, second, third = (Request(rid, list(prompt), 6) for rid in ("a", "a2", "a3"))
    serve(qwen, [first], store, tp=2)
    store.armed = True
    eng, leaks = serve(qwen, [second], store, tp=2, policy=Policy(read_failure="recompute"))
    assert leaks == NO_LEAK and not store.armed
    assert eng.backends[1].broken_states == 1 and eng.recomputed == ["a2"]
    assert store.batch_is_exist([name]) == [0]
    eng, leaks = serve(qwen, [third], store, tp=2)
    assert leaks == NO_LEAK and eng.backends[1].broken_states == 0 and eng.recomputed == []
    assert store.batch_is_exist([name]) == [1]
    assert_exact(qwen, [first, second, third], reference=transformers_run(qwen))


@pytest.mark.parametrize("preemption", ["write", "recompute", "swap"])
def test_a_request_preempted_mid_decode_equals_transformers_run(qwen, preemption):
    """Write-back, recompute, or a swap into D's host tier (the blocks go to host memory, the
    state page stays on the GPU)."""
    from kvstate import Policy

    reqs = workload(8, lengths=LENGTHS, max_new=10,
                    per_request={i: {"preempt_after": 3 + i % 4} for i in range(0, 8, 2)})
    eng, leaks = serve(qwen, reqs, tp=2, policy=Policy(preempt=preemption),
                       host_blocks=256 if preemption == "swap" else 0)
    assert leaks == NO_LEAK and eng.D.states.pool.num_used == 0
    if preemption == "swap":  # every preempted request came back from host memory, none recomputed
        assert eng.recomputed == [] and eng.backends[1].bytes_swapped > 0
    assert_exact(qwen, reqs, reference=transformers_run(qwen))
