"""Layer-wise loads through KVStateConnector (``load: "layerwise"``) against vLLM's real
Scheduler with fake model outputs: the request runs at once, its forward waits before each
layer for that layer's load, and a block that does not arrive whole makes vLLM drop the
step's token and recompute from that block, on the same step's report."""
from __future__ import annotations

import time
from typing import Any

import pytest
from needs import vllm_missing
from test_vllm_connector import PROMPT, corrupt, prefill
from vllm_rig import BS, Engine, write_model

pytestmark = pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))

LAYERWISE = {"load": "layerwise", "layer_groups": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    return write_model(tmp_path_factory.mktemp("tinyllama"))


@pytest.fixture
def saved(model_dir: str, request: Any) -> Any:
    """A producer that stored PROMPT's cache (its fake forward's KV), and a maker of consumers
    on the same pool."""
    store = f"t{request.node.name}{time.monotonic_ns()}"
    P = Engine(model_dir, "kv_producer", store, layer_groups=2)
    P.model = True
    made = [P]
    prefill(P)
    P.run(3)
    assert P.handoff.counters["saved"] == 1

    def consumer(**extra: Any) -> Engine:
        D = Engine(model_dir, "kv_consumer", store, prefix_caching=False, **{**LAYERWISE, **extra})
        D.model = True
        made.append(D)
        return D
    yield P, consumer
    for e in made:
        e.close()


def slowed(monkeypatch: Any, D: Engine, seconds: float) -> Any:
    """D's rank reads from its store ``seconds`` late; returns the store's own read."""
    store = D.worker.transfers.backend.store
    read = store.batch_get_into

    def late(keys: Any, buffers: Any) -> Any:
        time.sleep(seconds)
        return read(keys, buffers)
    monkeypatch.setattr(store, "batch_get_into", late)
    return read


def test_the_request_runs_at_once_and_each_layer_is_in_place_before_its_attention(saved, monkeypatch):
    P, consumer = saved
    D = consumer()
    slowed(monkeypatch, D, 0.1)  # each group lands well after the forward would have run
    D.add("a", PROMPT, 3, remote=True)
    seen: dict[str, list[int]] = {}
    so = D.step_checked({"a"}, lambda rid, upto: seen.setdefault(rid, D.wrong_tokens(rid, PROMPT, upto)))
    assert so.num_scheduled_tokens == {"a": 1}  # the prompt's last token, in the step the load goes out
    assert [type(c).__name__ for c in so.kv_connector_metadata.orders.commands["load"]] == ["LoadLayers"]
    assert seen == {"a": []}  # right after the forward, before any settling: every cached token is P's
    assert str(D.scheduler.requests["a"].status) == "RUNNING"
    assert D.scheduler.requests["a"].num_output_tokens == 1  # that step's token stands
    D.run(6)
    assert D.handoff.counters["loaded"] == 1 and D.handoff.counters["load_partial"] == 0
    D.assert_clean()


@pytest.mark.parametrize("bad", [0, 1, 3])
def test_a_bad_block_drops_the_step_and_recomputes_from_it_on_the_same_report(saved, bad):
    P, consumer = saved
    corrupt(P.handoff.store.shared, P.handoff.cache_keys(PROMPT)[bad])
    D = consumer()
    D.add("a", PROMPT, 2, remote=True)
    so = D.step()
    assert so.num_scheduled_tokens == {"a": 1}
    req = D.scheduler.requests["a"]
    assert req.num_computed_tokens == bad * BS and req.num_output_tokens == 0  # rewound, its token dropped
    so = D.step()
    assert so.num_scheduled_tokens == {"a": len(PROMPT) - bad * BS}
    assert D.wrong_tokens("a", PROMPT, len(PROMPT)) == []
    D.run(4)
    assert D.handoff.counters["load_partial"] == 1
    D.assert_clean()


def test_a_load_that_misses_its_deadline_is_reported_once_its_fence_passed(saved, monkeypatch):
    """A rank whose store stalls past the load's deadline: the forward's waits give up at the
    deadline, the step's report waits for the fence (no transfer touches the blocks after it),
    and every block the load was to bring is recomputed."""
    P, consumer = saved
    D = consumer(transfer_timeout=0.3, fence_grace=0.3)
    store = D.worker.transfers.backend.store
    read = slowed(monkeypatch, D, 1.0)
    D.add("a", PROMPT, 2, remote=True)
    t = time.monotonic()
    so = D.step(settle=0.0)
    took = time.monotonic() - t
    assert 0.55 <= took < 1.5, took  # the deadline, then the fence (0.3 + 0.3 s)
    assert so.num_scheduled_tokens == {"a": 1}
    assert D.scheduler.requests["a"].num_computed_tokens == 0  # nothing vouched for: all of it again
    monkeypatch.setattr(store, "batch_get_into", read)
    time.sleep(1.0)  # the stalled read ends, touching nothing
    so = D.step()
    assert so.num_scheduled_tokens == {"a": len(PROMPT)}
    assert D.wrong_tokens("a", PROMPT, len(PROMPT)) == []
    D.run(6)
    D.assert_clean()


def test_layerwise_loads_with_the_recompute_policy_and_vllms_prefix_cache_are_refused(model_dir):
    """vLLM keeps the blocks a step reports invalid in its prefix cache for their request to
    recompute (it evicts them only under the fail policy); a request aborted first leaves them
    for a later prompt to hit, unverified. That combination is refused when vLLM builds the
    connector; without the prefix cache, or for a producer, it is taken."""
    from kvstate import ConfigError

    with pytest.raises(ConfigError, match="'layerwise' with kv_load_failure_policy 'recompute' needs "
                                          "enable_prefix_caching off"):
        Engine(model_dir, "kv_consumer", "refused", load="layerwise")
    for role, caching in (("kv_consumer", False), ("kv_producer", True)):
        Engine(model_dir, role, "taken", prefix_caching=caching, load="layerwise").close()
