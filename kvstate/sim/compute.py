"""Compute model: how long a prefill forward and a decode step take (a roofline).

For an instance of ``tp`` GPUs, each with peak ``tflops`` (reached at fraction ``mfu``) and
HBM bandwidth ``hbm_gbps`` (reached at fraction ``mbu``):

- prefill of prompts with ``n_i`` new tokens over ``c_i`` cached ones:
  FLOPs = 2·P·Σn_i + 2·L·h·Σ n_i·(n_i + 2·c_i)  (weights; causal attention scores and values)
  time  = max(FLOPs / (tp·peak·mfu), weight bytes / (tp·hbm·mbu)) + step overhead;
- a decode step of ``b`` requests holding ``K`` context tokens in all:
  bytes = weights + K · KV bytes per token; FLOPs = 2·P·b + 4·L·h·K
  time  = max(bytes / (tp·hbm·mbu), FLOPs / (tp·peak·mfu)) + step overhead.

``P`` parameters, ``L`` layers, ``h`` hidden size. Tensor-parallel communication is folded
into the efficiencies. The model is deliberately small: its inputs are what a capacity
planner knows, and every figure is in the scenario file.
"""
from __future__ import annotations

from collections.abc import Iterable

from .scenario import Scenario

__all__ = ["ComputeModel"]


class ComputeModel:
    """Prefill and decode-step times of one instance of a scenario."""

    __slots__ = ("_flops", "_mem", "_params2", "_attn", "_weights", "_kv_tok", "_overhead")

    def __init__(self, s: Scenario) -> None:
        tp, g, m = s.cluster.tp, s.gpu, s.model
        self._flops = tp * g.tflops * 1e12 * g.mfu
        self._mem = tp * g.hbm_gbps * 1e9 * g.mbu
        self._params2 = 2.0 * m.params_b * 1e9
        self._attn = 2.0 * m.num_layers * m.hidden
        self._weights = s.weight_bytes
        self._kv_tok = float(s.kv_bytes_per_token)
        self._overhead = g.step_overhead_ms / 1000.0

    def prefill_time(self, work: Iterable[tuple[int, int]]) -> float:
        """Seconds for one forward over ``(new_tokens, cached_tokens)`` per prompt."""
        new = attn = 0.0
        for n, c in work:
            new += n
            attn += n * (n + 2.0 * c)
        flops = self._params2 * new + self._attn * attn
        return max(flops / self._flops, self._weights / self._mem) + self._overhead

    def decode_step_time(self, batch: int, context_tokens: int) -> float:
        """Seconds for one decode step of ``batch`` requests with ``context_tokens`` in all."""
        if batch <= 0:
            return 0.0
        mem = (self._weights + context_tokens * self._kv_tok) / self._mem
        flops = (self._params2 * batch + 2.0 * self._attn * context_tokens) / self._flops
        return max(mem, flops) + self._overhead
