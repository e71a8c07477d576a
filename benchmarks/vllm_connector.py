"""The vLLM connector's scheduler-side cost beside vLLM's ExampleConnector, in one run (CPU).

    python3 benchmarks/vllm_connector.py [--requests 200] [--prompt 512] [--reps 3] [--out F.json]

vLLM's real ``Scheduler`` (vLLM's CPU build), fake model outputs, a producer's requests of
``--prompt`` tokens and one output token, for three connectors: none, ``ExampleConnector``
(its own scheduler side: a folder lookup per request, a slot mapping per saved request) and
``KVStateConnector`` (a store lookup, a P lifecycle per request, the save's answers and the
release). Only the scheduler's time counts: ``schedule()`` and ``update_from_output()`` (which
call every scheduler-side connector method); the worker side of kvstate's connector runs
between steps, untimed, so its saves land and its requests end. Medians over ``--reps``
alternated runs; per request and per step; the ratio kvstate / Example.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
          "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
          "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
BS, NB = 32, 4096


def build(model: str, connector: str | None, tmp: str) -> tuple[Any, Any]:
    import torch
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    tc = None
    if connector == "kvstate":
        tc = KVTransferConfig(kv_connector="KVStateConnector", kv_connector_module_path="kvstate.integrations.vllm",
                              kv_role="kv_producer",
                              kv_connector_extra_config={"store": {"kind": "memory", "name": tmp,
                                                                   "capacity_bytes": 8 << 30}})
    elif connector == "example":
        tc = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": tmp})
    vc = VllmConfig(scheduler_config=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=4096,
                                                     enable_chunked_prefill=True, is_encoder_decoder=False),
                    model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", seed=0),
                    cache_config=CacheConfig(block_size=BS, enable_prefix_caching=False), kv_transfer_config=tc,
                    device_config=DeviceConfig("cpu"))
    vc.cache_config.num_gpu_blocks = NB
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    kvc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        names, FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.bfloat16))])
    sched = Scheduler(vllm_config=vc, kv_cache_config=kvc, log_stats=False,
                      structured_output_manager=StructuredOutputManager(vc), block_size=BS)
    worker = None
    if connector == "kvstate":
        from kvstate.integrations.vllm import KVStateConnector

        worker = KVStateConnector(vc, KVConnectorRole.WORKER, kvc)
        worker.register_kv_caches({n: torch.zeros(NB, 1, BS, 128, dtype=torch.bfloat16) for n in names})
    return sched, worker


def run(model: str, connector: str | None, requests: int, prompt: int) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    with tempfile.TemporaryDirectory() as tmp:
        sched, worker = build(model, connector, tmp)
        sp = SamplingParams(max_tokens=1)
        sp.update_from_generation_config({}, 2)
        for i in range(requests):
            tokens = [(i * 7 + j) % 500 + 3 for j in range(prompt)]
            sched.add_request(Request(request_id=f"r{i}", prompt_token_ids=tokens, sampling_params=sp,
                                      pooling_params=None))
        spent, steps = 0.0, 0
        while sched.has_requests() and steps < 100 * requests:
            t0 = time.perf_counter()
            so = sched.schedule()
            spent += time.perf_counter() - t0
            kco = None
            if worker is not None:  # untimed: the worker side, between the scheduler's calls
                worker.bind_connector_metadata(so.kv_connector_metadata)
                worker.start_load_kv(None)
                deadline = time.monotonic() + 5
                while worker.transfers.inflight() and time.monotonic() < deadline:
                    time.sleep(0.0005)
                sending, recving = worker.get_finished(so.finished_req_ids)
                kco = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                        kv_connector_worker_meta=worker.build_connector_worker_meta())
                worker.clear_connector_metadata()
            ids = list(so.num_scheduled_tokens)
            out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                                    sampled_token_ids=[[7] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                                    pooler_output=None, kv_connector_output=kco)
            t0 = time.perf_counter()
            sched.update_from_output(so, out)
            spent += time.perf_counter() - t0
            steps += 1
        if sched.has_requests():
            raise SystemExit(f"{connector}: requests left after {steps} steps")
        if worker is not None:
            worker.shutdown()
        if sched.connector is not None:
            sched.connector.shutdown()
    return {"us_per_request": spent / requests * 1e6, "us_per_step": spent / steps * 1e6, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model = tempfile.mkdtemp()
    Path(model, "config.json").write_text(json.dumps(CONFIG))
    kinds = [None, "example", "kvstate"]
    runs: dict[str, list[dict[str, float]]] = {str(k): [] for k in kinds}
    for _ in range(a.reps):
        for k in kinds:
            runs[str(k)].append(run(model, k, a.requests, a.prompt))
    med = {k: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for k, rs in runs.items()}
    print(f"{'connector':<10} {'us/request':>11} {'us/step':>9} {'steps':>6}")
    for k, m in med.items():
        print(f"{k:<10} {m['us_per_request']:>11.1f} {m['us_per_step']:>9.1f} {m['steps']:>6.0f}")
    ratio = med["kvstate"]["us_per_request"] / med["example"]["us_per_request"]
    print(f"kvstate / example, per request: {ratio:.2f}x (requests {a.requests}, prompt {a.prompt} tokens, "
          f"medians of {a.reps})")
    if a.out:
        a.out.write_text(json.dumps({"medians": med, "ratio_per_request": ratio, "requests": a.requests,
                                     "prompt": a.prompt, "reps": a.reps}, indent=1))
    print(sys.version.split()[0])


if __name__ == "__main__":
    main()
