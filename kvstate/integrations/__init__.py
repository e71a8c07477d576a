"""kvstate inside other engines.

- :mod:`kvstate.integrations._pagedkv`: an engine's paged KV tensors (PyTorch, CPU or CUDA)
  seen as kvstate caches, and a rank's transfers over them (no engine imported).
- :mod:`kvstate.integrations._handoff`: the scheduler's side of a connector: kvstate's P and D
  lifecycles over the blocks an engine allocated, step by step (no engine imported).
- :mod:`kvstate.integrations.vllm`: the vLLM v1 KV connector over both; the only module that
  imports vLLM (import it only where vLLM is installed).
"""
