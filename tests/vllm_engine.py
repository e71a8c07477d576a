"""One vLLM CPU engine over prompts, in its own process: ``python vllm_engine.py JSON`` prints
``RESULT {...}`` with each prompt's greedy tokens and, with kvstate's connector, its counters.

The JSON: ``model`` (a directory with a config.json; random weights), ``prompts`` (token ids),
``max_tokens``, and optionally ``connector`` / ``module`` / ``role`` / ``extra`` (the KV
transfer config) and ``remote`` (each request says its cache comes from a producer). The
offline engine stops stepping once its outputs are in; with kvstate's connector it is stepped
on until every save landed, as a server's engine loop does.
"""
from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: not most of the machine's memory


def _allow_amx() -> None:
    """Ask Linux for the AMX tile state, as PyTorch's own helper does. vLLM's CPU attention
    takes its AMX kernel wherever the CPU has AMX, but this engine's path never asks for the
    state, and a process that has not asked dies of SIGILL at the first tile instruction."""
    import torch

    init = getattr(torch.cpu, "_init_amx", None)
    if init is not None and torch.cpu._is_amx_tile_supported():
        init()


def main() -> None:
    a = json.loads(sys.argv[1])
    _allow_amx()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kt = None
    if a.get("connector"):
        kt = KVTransferConfig(kv_connector=a["connector"], kv_connector_module_path=a.get("module"),
                              kv_role=a["role"], kv_connector_extra_config=a.get("extra", {}),
                              kv_load_failure_policy="recompute")
    llm = LLM(model=a["model"], load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              enforce_eager=True, max_model_len=512, block_size=32, seed=0, kv_transfer_config=kt,
              enable_prefix_caching=False, max_num_seqs=8)
    params = {"kv_transfer_params": {"do_remote_prefill": True}} if a.get("remote") else None
    sp = SamplingParams(max_tokens=a["max_tokens"], temperature=0.0, ignore_eos=True, extra_args=params)
    outs = llm.generate([{"prompt_token_ids": p} for p in a["prompts"]], sp, use_tqdm=False)
    res: dict = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
    core = llm.llm_engine.engine_core.engine_core
    handoff = getattr(core.scheduler.connector, "handoff", None)
    if handoff is not None:
        deadline = time.monotonic() + 30
        while handoff.live() and time.monotonic() < deadline:
            core.step_fn()
            time.sleep(0.01)
        res["counters"] = dict(handoff.counters)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
