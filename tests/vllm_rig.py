"""vLLM's real Scheduler with kvstate's connector on both sides, a worker-side connector on
real CPU tensors and fake model outputs, as vLLM's own connector unit tests drive it (the
contract tests and the state machine share it). Import only where vLLM imports."""
from __future__ import annotations

import json
import os
import time
from typing import Any

__all__ = ["BS", "NB", "CONFIG", "Engine", "kv_pattern", "write_model"]

BS = 32  # vLLM's CPU attention takes blocks of a multiple of 32 tokens
NB = 48
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
          "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
          "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


def kv_pattern(tokens: list[int], lo: int, hi: int) -> Any:
    """The fake model's KV of positions ``lo..hi-1``: one small integer each, a function of the
    tokens up to it (as a causal model's KV is), exact in bfloat16."""
    import torch

    total, out = sum(tokens[:lo]), []
    for j in range(lo, hi):
        total += tokens[j]
        out.append((total * 31 + j) % 199 + 1)
    return torch.tensor(out, dtype=torch.float32).to(torch.bfloat16)


def write_model(d: Any) -> str:
    """A directory holding the tiny Llama's config.json (weights are random: load_format dummy)."""
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    return str(d)


class Engine:
    """vLLM's scheduler with one worker-side connector and fake model outputs."""

    def __init__(self, model_dir: str, role: str, store_name: str, cache_dtype: str = "auto",
                 prefix_caching: bool = True, **extra: Any) -> None:
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
        cc = CacheConfig(block_size=BS, cache_dtype=cache_dtype, enable_prefix_caching=prefix_caching)
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
        self.lose_answers = False  #: the ranks' answers of the next steps never reach the scheduler
        self.delay_answers = False  #: ... reach it one step late
        self.model = False  #: the fake forward writes each computed token's KV (kv_pattern)
        self._late: Any = None
        self._poisoned: set[str] = set()

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
        return self._finish_step(self.scheduler.schedule(), settle, token)

    def _finish_step(self, so: Any, settle: float, token: int = 7, after_forward: Any = None) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        w = self.worker
        if self.model:
            self.poison_loads()
        w.bind_connector_metadata(so.kv_connector_metadata)
        if self.model:
            self.poison_layerwise(so)
        w.start_load_kv(None)  # as vLLM: loads and this forward's layer-wise saves start before it
        for name in self.caches_names():  # each attention waits for its layer's layer-wise loads
            w.wait_for_layer_load(name)
        if self.model:
            self.compute(so)
        for name in self.caches_names():  # the forward wrote each layer's KV
            w.save_kv_layer(name, self.caches[name], None)
        if after_forward is not None:
            after_forward()
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
        elif self.delay_answers:  # this step's answers wait; the last held ones go now
            meta, self._late = self._late, meta
        elif self._late is not None:
            meta = self._late if meta is None else self._late.aggregate(meta)
            self._late = None
        ids = list(so.num_scheduled_tokens)
        kco = KVConnectorOutput(finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid,
                                kv_connector_worker_meta=meta)
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[token] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                                pooler_output=None, kv_connector_output=kco)
        #: the request ids whose tokens this step kept (vLLM drops those of a step that read an invalid block)
        self.kept = {o.request_id for outs in self.scheduler.update_from_output(so, out).values()
                     for o in outs.outputs if o.new_token_ids}
        return so

    def compute(self, so: Any) -> None:
        """The fake forward: each token scheduled this step gets its KV, a function of the
        tokens up to it (:func:`kv_pattern`), in every layer and head."""
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            hi = req.num_computed_tokens  # vLLM counts a step's tokens as it schedules them
            self.write_tokens(rid, req.all_token_ids, hi - n, hi)

    def poison_loads(self) -> None:
        """Blocks just allocated for a load hold 0s (the pattern never does) before it lands,
        as reused memory would hold anything: a block the load did not fill is never right.
        Blocks vLLM's prefix cache gave the request (they have a hash) hold their cache."""
        pool = self.scheduler.kv_cache_manager.block_pool.blocks
        for rid, req in self.scheduler.requests.items():
            if str(req.status) == "WAITING_FOR_REMOTE_KVS" and rid not in self._poisoned:
                self._poisoned.add(rid)
                ids = [b for b in self.block_ids(rid) if pool[b].block_hash is None]
                for t in self.caches.values():
                    t[ids] = 0

    def poison_layerwise(self, so: Any) -> None:
        """As :meth:`poison_loads` for this step's layer-wise loads, which run as it computes."""
        from kvstate import commands as C

        for cmd in so.kv_connector_metadata.orders.commands["load"]:
            if isinstance(cmd, C.LoadLayers):
                for t in self.caches.values():
                    t[list(cmd.block_ids)] = 0

    def write_tokens(self, rid: str, tokens: list[int], lo: int, hi: int) -> None:
        ids = self.block_ids(rid)
        values = kv_pattern(tokens, lo, hi)
        for j in range(lo, hi):
            b, r = divmod(j, BS)
            for t in self.caches.values():
                t[ids[b], :, r, :] = values[j - lo]

    def wrong_tokens(self, rid: str, tokens: list[int], upto: int) -> list[int]:
        """Positions below ``upto`` whose KV in the request's blocks is not the pattern."""
        ids, want = self.block_ids(rid), kv_pattern(tokens, 0, upto)
        bad = []
        for j in range(upto):
            b, r = divmod(j, BS)
            if any(not (t[ids[b], :, r, :] == want[j]).all() for t in self.caches.values()):
                bad.append(j)
        return bad

    def step_checked(self, loading: set[str], check: Any, settle: float = 2.0) -> Any:
        """As :meth:`step`, calling ``check(rid, tokens)`` for each request of ``loading`` (ids
        waiting for their load before the step) that this step schedules, with the tokens it
        counted as computed before the step, once the step's fake forward wrote its tokens."""
        so = self.scheduler.schedule()
        counted = {rid: self.scheduler.requests[rid].num_computed_tokens - n
                   for rid, n in so.num_scheduled_tokens.items() if rid in loading}

        def after_forward() -> None:  # a prefix hit on blocks this very step computes is fine
            for rid, upto in counted.items():
                check(rid, upto)
        return self._finish_step(so, settle, after_forward=after_forward)

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


