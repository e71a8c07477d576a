"""KVStateConnector against vLLM's real Scheduler, with fake model outputs (as vLLM's own
connector unit tests drive it): P holds its blocks until its save lands, D waits, loads and
runs, a bad block rewinds to the first token it cannot vouch for, and nothing leaks."""
from __future__ import annotations

import time
from typing import Any

import pytest
from needs import vllm_missing
from vllm_rig import BS, Engine, write_model

pytestmark = pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    return write_model(tmp_path_factory.mktemp("tinyllama"))

PROMPT = list(range(3, 3 + 100))  # 99 cached tokens: 4 blocks, the last partial


@pytest.fixture
def engines(model_dir: str, request: Any) -> Any:
    made: list[Engine] = []
    store = f"t{request.node.name}{time.monotonic_ns()}"

    def make(role: str, **extra: Any) -> Engine:
        e = Engine(model_dir, role, store, **extra)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


def prefill(P: Engine, rid: str = "a", prompt: list[int] = PROMPT) -> list[int]:
    """Run a producer request to its end; returns its block ids."""
    P.add(rid, prompt, 1)
    P.step()
    return P.block_ids(rid)


def test_p_holds_its_blocks_until_the_save_lands_then_vllm_frees_them(engines):
    P = engines("kv_producer")
    ids = prefill(P)
    assert len(ids) == 4 and P.free() == P.free_at_start - 4
    assert "a" in P.scheduler.requests  # finished, its blocks kept for the save
    P.step()  # the save goes out, lands
    assert P.handoff.counters["saved"] == 1
    P.step()  # the release travels through the ranks
    P.step()
    P.assert_clean()


def test_d_waits_for_the_cache_loads_it_and_runs_byte_exact(engines):
    P, D = engines("kv_producer"), engines("kv_consumer")
    D.add("a", PROMPT, 3, remote=True)
    D.step()
    assert str(D.scheduler.requests["a"].status) == "WAITING"  # P's save has not landed: ask again
    pids = prefill(P)
    P.run(3)
    so = D.step()
    assert str(D.scheduler.requests["a"].status) == "WAITING_FOR_REMOTE_KVS"
    dids = D.block_ids("a")
    D.run(2)
    assert D.handoff.counters["loaded"] == 1
    for p, d in zip(P.blocks(pids[:4]), D.blocks(dids[:4])):
        assert (p[:3] == d[:3]).all()  # the three full blocks, byte for byte
    for _ in range(6):
        so = D.step()
    assert so is not None and not D.scheduler.requests
    D.assert_clean()
    P.assert_clean()


def test_a_full_prefix_hit_writes_nothing(engines):
    P = engines("kv_producer")
    prefill(P, "a")
    P.run(3)
    store = P.handoff.store.shared
    stored = len(store)
    moved = P.worker.transfers.backend.bytes_moved
    prefill(P, "b")  # the same prompt again
    P.run(3)
    assert len(store) == stored and P.worker.transfers.backend.bytes_moved == moved
    assert P.handoff.counters["saved"] == 2
    P.assert_clean()


def test_d_with_a_local_prefix_hit_loads_only_the_blocks_past_it(engines):
    P, D = engines("kv_producer"), engines("kv_consumer")
    prefill(P)
    P.run(3)
    D.add("x", PROMPT, 1, remote=True)
    D.run(4)
    backend = D.worker.transfers.backend
    moved, per_block = backend.bytes_moved, D.worker.spec.bytes_per_block_per_rank
    assert moved == 4 * per_block
    D.add("y", PROMPT, 2, remote=True)  # vLLM's prefix cache holds 3 of the cache's 4 blocks
    D.step()
    assert str(D.scheduler.requests["y"].status) == "WAITING_FOR_REMOTE_KVS"
    D.run(6)
    assert backend.bytes_moved - moved == per_block and D.handoff.counters["loaded"] == 2
    D.assert_clean()


def corrupt(store: Any, key: str) -> None:
    import numpy as np

    names = [k for k in store if k.startswith(key) and "_key_" in k]
    assert names, key
    buf = np.zeros(1 << 16, np.uint8)
    n = store.batch_get_into(names[:1], [buf])[0]
    buf[n // 2] ^= 0xFF
    store.batch_put_from(names[:1], [buf[:n]])


@pytest.mark.parametrize("bad, expect", [(0, 0), (1, 32), (3, 96)])
def test_a_bad_block_rewinds_d_to_the_first_token_it_cannot_vouch_for(engines, bad, expect):
    P, D = engines("kv_producer"), engines("kv_consumer")
    prefill(P)
    P.run(3)
    corrupt(P.handoff.store.shared, P.handoff.cache_keys(PROMPT)[bad])
    D.add("a", PROMPT, 2, remote=True)
    D.step()
    dids = D.block_ids("a")
    scheduled = [D.step().num_scheduled_tokens.get("a") for _ in range(4)]
    assert D.handoff.counters["load_partial"] == 1
    first = next(n for n in scheduled if n)
    assert first == len(PROMPT) - expect  # recomputed from the bad block on (a whole load computes 1)
    D.run(4)
    D.assert_clean()
    assert dids


def test_abort_while_loading_keeps_the_blocks_until_the_read_is_fenced_then_frees_them(engines):
    from vllm.v1.request import RequestStatus

    P, D = engines("kv_producer"), engines("kv_consumer", transfer_timeout=0.2, fence_grace=0.2)
    prefill(P)
    P.run(3)
    D.add("a", PROMPT, 4, remote=True)
    D.lose_answers = True  # the read's answers never come back
    D.step()
    D.lose_answers = False
    D.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    D.step()
    assert D.free() < D.free_at_start  # no answer, fence not passed: the blocks stay
    assert D.handoff.counters["aborted"] == 1
    time.sleep(0.2 + 0.6)  # past the deadline and the fence's grace
    D.run(3)
    D.assert_clean()


def test_a_lost_answer_ends_at_the_deadline_and_leaks_nothing(engines):
    P = engines("kv_producer", transfer_timeout=0.2, fence_grace=0.2, write_retries=0)
    prefill(P)
    P.lose_answers = True
    P.step()  # the save runs, its answer is lost
    P.lose_answers = False
    time.sleep(0.2 + 0.6)  # past the deadline and the fence's grace
    P.run(3)
    assert P.handoff.counters["save_failed"] == 1
    P.assert_clean()


@pytest.mark.parametrize("extra, rule", [
    ({"stor": {}}, "unknown key"),
    ({"store": {"kind": "s3"}}, "kind is 'arena', 'file', 'mooncake' or 'memory'"),
    ({"transfer_timeout": -1}, "transfer_timeout must be seconds"),
    ({"workers": 0}, "workers must be an int"),
    ({"peer_tp": "2"}, "peer_tp must be an int"),
    ({"load": "eager"}, "load must be 'async' or 'layerwise'"),
    ({"store": {"kind": "file", "root": "/proc/kvstate-nope"}}, "cannot be reached|Read-only|No such|denied"),
])
def test_bad_extra_config_is_refused_when_vllm_builds_the_connector(model_dir, extra, rule):
    from kvstate import ConfigError

    with pytest.raises(ConfigError, match=rule):
        Engine(model_dir, "kv_producer", "bad", **extra)


def test_a_kv_both_engine_with_a_peer_of_another_tp_degree_is_refused(model_dir):
    from kvstate import ConfigError

    with pytest.raises(ConfigError, match="saves and loads its own caches"):
        Engine(model_dir, "kv_both", "bad", peer_tp=2)
    Engine(model_dir, "kv_both", "fine", peer_tp=1).close()  # its own degree: nothing to pair


def test_a_cache_dtype_whose_scales_live_beside_the_cache_is_refused(model_dir):
    from kvstate import ConfigError

    with pytest.raises(ConfigError, match="'int8_per_token_head' is not served"):
        Engine(model_dir, "kv_consumer", "bad", cache_dtype="int8_per_token_head")


def test_p_and_d_hand_off_through_a_shared_arena_and_one_of_another_geometry_is_refused(engines, model_dir):
    from kvstate import ConfigError
    from kvstate.backends._arena import ArenaStore

    slot = 2 * BS * 128 * 2  # one block of the tiny model's packed cache: 2 layers, 1 head of 128, bf16
    arena = ArenaStore.create(slot, 64, small_bytes=1024)
    try:
        store = {"kind": "arena", "path": arena.path}
        P, D = engines("kv_producer", store=store), engines("kv_consumer", store=store)
        pids = prefill(P)
        P.run(3)
        D.add("a", PROMPT, 3, remote=True)
        D.step()
        dids = D.block_ids("a")
        D.run(2)
        assert D.handoff.counters["loaded"] == 1
        for p, d in zip(P.blocks(pids[:3]), D.blocks(dids[:3])):
            assert (p == d).all()
        D.run(6)
        D.assert_clean()
        P.assert_clean()
        wrong = ArenaStore.create(slot * 2, 4, small_bytes=1024)
        with pytest.raises(ConfigError, match="another geometry"):
            Engine(model_dir, "kv_consumer", "bad", store={"kind": "arena", "path": wrong.path})
        wrong.close()
    finally:
        arena.close()


def test_with_no_path_p_and_d_meet_in_the_one_arena_of_their_host_whose_slots_fit(engines, model_dir, tmp_path):
    """The connector's default store is the arena ``kvstate arena`` holds on the host: P and D
    name none and find the one whose slots are the model's objects (here in ``directory``, so
    the host's own /dev/shm is left alone); none, or two, is refused naming the way out."""
    from kvstate import ConfigError
    from kvstate.backends._arena import ArenaStore
    from kvstate.integrations.vllm import Settings

    assert Settings().store == {"kind": "arena"}
    slot = 2 * BS * 128 * 2
    where = {"kind": "arena", "directory": str(tmp_path)}
    with pytest.raises(ConfigError, match=f"kvstate arena --slot-bytes {slot} --slots N"):
        Engine(model_dir, "kv_producer", "bad", store=where)
    other = ArenaStore.create(slot * 2, 4, small_bytes=1024, directory=tmp_path)  # another geometry: passed over
    arena = ArenaStore.create(slot, 64, small_bytes=1024, directory=tmp_path)
    try:
        P, D = engines("kv_producer", store=where), engines("kv_consumer", store=where)
        prefill(P)
        P.run(3)
        D.add("a", PROMPT, 3, remote=True)
        D.run(8)
        assert D.handoff.counters["loaded"] == 1
        D.assert_clean()
        P.assert_clean()
        second = ArenaStore.create(slot, 4, small_bytes=1024, directory=tmp_path)
        with pytest.raises(ConfigError, match="2 kvstate arenas .* name one by its path"):
            Engine(model_dir, "kv_consumer", "bad", store=where)
        second.close()
        with pytest.raises(ConfigError, match="an arena takes a path, or a directory"):
            Engine(model_dir, "kv_consumer", "bad", store={**where, "path": arena.path})
    finally:
        arena.close()
        other.close()


def test_a_producer_saves_a_prompt_layer_by_layer_within_its_forward_and_d_loads_it(engines):
    """With two layer groups, P's save of a prompt computed in one forward goes out before the
    forward (a SaveLayers) and stores each group as the forward reports its layer; D, with
    the same groups, loads it byte for byte. A prompt that decodes on after it (three tokens)
    is saved whole, once finished."""
    P, D = engines("kv_producer", layer_groups=2), engines("kv_consumer", layer_groups=2)
    P.model = D.model = True
    P.add("a", PROMPT, 1)
    so = P.step()
    assert [type(c).__name__ for c in so.kv_connector_metadata.orders.commands["save"]] == ["SaveLayers"]
    assert "a" in P.scheduler.requests  # finished; its blocks kept for the save
    P.run(3)
    assert P.handoff.counters["saved"] == 1
    P.assert_clean()
    D.add("a", PROMPT, 3, remote=True)
    for _ in range(6):
        D.step()
        if D.handoff.counters["loaded"]:
            break
    assert D.handoff.counters["loaded"] == 1 and D.handoff.counters["load_partial"] == 0
    assert D.wrong_tokens("a", PROMPT, len(PROMPT) - 1) == []  # every cached token's KV is P's
    D.run(6)
    D.assert_clean()
    P.add("b", [t + 1000 for t in PROMPT], 3)
    so = P.step()
    assert not so.kv_connector_metadata.orders.commands["save"]  # decodes on: saved whole, once it ends
    P.run(6)
    assert P.handoff.counters["saved"] == 2
    P.assert_clean()


def test_window_layers_promoted_to_full_blocks_are_served_and_a_window_only_cache_is_refused(engines):
    """A model with window and full layers reaches a connector without SupportsHMA as one group
    of FullAttentionSpec with the window set, every block allocated for every token: served.
    One whose every layer has a window keeps SlidingWindowSpec, which frees blocks: refused."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from kvstate import ConfigError
    from kvstate.integrations.vllm import cache_spec

    e = engines("kv_producer")
    names = e.caches_names()

    def config(spec):
        return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])

    promoted = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, sliding_window=64)
    s = cache_spec(e.config, config(promoted))
    assert (s.num_layers, s.block_size, s.layer_groups) == (2, 32, 1)
    window = SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, sliding_window=64)
    with pytest.raises(ConfigError, match="SlidingWindowSpec"):
        cache_spec(e.config, config(window))
