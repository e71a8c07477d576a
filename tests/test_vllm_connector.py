"""KVStateConnector against vLLM's real Scheduler, with fake model outputs (as vLLM's own
connector unit tests drive it): P holds its blocks until its save lands, D waits, loads and
runs, a bad block rewinds to the first token it cannot vouch for, and nothing leaks."""
from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
from needs import vllm_missing

pytestmark = pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))

BS = 32  # vLLM's CPU attention takes blocks of a multiple of 32 tokens
NB = 48
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
          "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
          "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    d = tmp_path_factory.mktemp("tinyllama")
    (d / "config.json").write_text(json.dumps(CONFIG))
    return str(d)


class Engine:
    """vLLM's scheduler with one worker-side connector and fake model outputs."""

    def __init__(self, model_dir: str, role: str, store_name: str, **extra: Any) -> None:
        os.environ["HF_HUB_OFFLINE"] = "1"
        import torch
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from kvstate.integrations.vllm import KVStateConnector

        init_none_hash(sha256)
        mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=0)
        sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=2048,
                             enable_chunked_prefill=True, is_encoder_decoder=False)
        cc = CacheConfig(block_size=BS, cache_dtype="auto", enable_prefix_caching=True)
        tc = KVTransferConfig(kv_connector="KVStateConnector", kv_connector_module_path="kvstate.integrations.vllm",
                              kv_role=role, kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"store": {"kind": "memory", "name": store_name}, **extra})
        self.config = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc, kv_transfer_config=tc,
                                 device_config=DeviceConfig("cpu"))
        self.config.cache_config.num_gpu_blocks = NB
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=self.kv_cache_config(), log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.config), block_size=BS)
        self.worker = KVStateConnector(self.config, KVConnectorRole.WORKER, self.kv_cache_config())
        gen = torch.Generator().manual_seed(hash(role) % 1000)
        self.caches = {f"model.layers.{i}.self_attn.attn": torch.randn(NB, 1, BS, 128, generator=gen).to(torch.bfloat16)
                       for i in range(2)}
        self.worker.register_kv_caches(self.caches)
        self.free_at_start = self.free()
        self.lose_answers = False

    def kv_cache_config(self) -> Any:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
        return KVCacheConfig(num_blocks=NB, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec(list(self.caches_names()), spec)])

    @staticmethod
    def caches_names() -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(2)]

    @property
    def handoff(self) -> Any:
        return self.scheduler.connector.handoff

    def free(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(self, rid: str, prompt: list[int], max_tokens: int, remote: bool = False) -> Any:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens)
        sp.update_from_generation_config({}, 2)
        r = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                    block_hasher=get_request_block_hasher(BS, sha256))
        r.kv_transfer_params = {"do_remote_prefill": True} if remote else None
        self.scheduler.add_request(r)
        return r

    def step(self, token: int = 7, settle: float = 2.0) -> Any:
        """One engine step: schedule, the worker's connector calls around a (fake) forward,
        the outputs back. Waits up to ``settle`` s for the transfers it started to answer."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
        w.wait_for_save()
        deadline = time.monotonic() + settle
        while w.transfers.inflight() and time.monotonic() < deadline:
            time.sleep(0.002)
        sending, recving = w.get_finished(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        if self.lose_answers:
            meta = None
        ids = list(so.num_scheduled_tokens)
        kco = KVConnectorOutput(finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid,
                                kv_connector_worker_meta=meta)
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[token] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                                pooler_output=None, kv_connector_output=kco)
        self.scheduler.update_from_output(so, out)
        return so

    def run(self, steps: int = 8) -> list[Any]:
        return [self.step() for _ in range(steps)]

    def block_ids(self, rid: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])

    def blocks(self, ids: list[int]) -> list[Any]:
        return [t[ids].clone() for t in self.caches.values()]

    def assert_clean(self) -> None:
        assert not self.scheduler.requests
        assert self.free() == self.free_at_start
        assert self.handoff.live() == 0
        assert self.worker.transfers.inflight() == 0

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.connector.shutdown()


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
    ({"store": {"kind": "s3"}}, "kind is 'file', 'mooncake' or 'memory'"),
    ({"transfer_timeout": -1}, "transfer_timeout must be seconds"),
    ({"workers": 0}, "workers must be an int"),
    ({"store": {"kind": "file", "root": "/proc/kvstate-nope"}}, "cannot be reached|Read-only|No such|denied"),
])
def test_bad_extra_config_is_refused_when_vllm_builds_the_connector(model_dir, extra, rule):
    from kvstate import ConfigError

    with pytest.raises(ConfigError, match=rule):
        Engine(model_dir, "kv_producer", "bad", **extra)
