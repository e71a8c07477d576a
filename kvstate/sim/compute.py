"""Compute model: how long a prefill forward and a decode step take (a roofline per phase).

For an instance of ``tp`` GPUs, each with peak ``tflops`` (reached at fraction ``mfu``) and
HBM bandwidth ``hbm_gbps`` (reached at fraction ``mbu``), a forward is its weight GEMMs, then
its attention, then a fixed step overhead; each phase takes the longer of its FLOPs and its
bytes (the two phases run one after the other, so neither hides the other):

- GEMMs: ``max(2·P·T / (tp·peak·mfu), weight bytes / (tp·hbm·mbu))`` for ``T`` tokens
  (a prefill's new tokens, a decode step's batch);
- prefill attention of prompts with ``n_i`` new tokens over ``c_i`` cached ones: FLOPs
  ``2·L·h·Σ n_i·(n_i + 2·c_i)`` (causal scores and values), bytes ``Σ c_i`` · KV bytes per token;
- decode attention of ``b`` requests holding ``K`` context tokens in all: bytes ``K`` · KV bytes
  per token, FLOPs ``4·L·h·K``.

``P`` parameters, ``L`` layers, ``h`` hidden size. Tensor-parallel communication is folded
into the efficiencies. The model is deliberately small: its inputs are what a capacity planner
knows, and every figure is in the scenario file. Fitted on a real model on an H100 (figures
in docs/benchmarks.md), it predicts held-out prefills and decode steps within 10 %.
"""
from __future__ import annotations

from collections.abc import Iterable

from .scenario import Scenario

__all__ = ["ComputeModel"]


class ComputeModel:
    """Prefill and decode-step times of one instance of a scenario."""

    __slots__ = ("_flops", "_mem", "_params2", "_attn", "_weights", "_kv_tok", "_overhead", "_mfu", "_mbu")

    def __init__(self, s: Scenario) -> None:
        tp, g, m = s.cluster.tp, s.gpu, s.model
        self._flops = tp * g.tflops * 1e12 * g.mfu
        self._mem = tp * g.hbm_gbps * 1e9 * g.mbu
        self._params2 = 2.0 * m.params_b * 1e9
        self._attn = 2.0 * m.num_layers * m.hidden
        self._weights = s.weight_bytes
        self._kv_tok = float(s.kv_bytes_per_token)
        self._overhead = g.step_overhead_ms / 1000.0
        self._mfu, self._mbu = g.mfu, g.mbu

    def prefill_time(self, work: Iterable[tuple[int, int]]) -> float:
        """Seconds for one forward over ``(new_tokens, cached_tokens)`` per prompt."""
        new = attn = cached = 0.0
        for n, c in work:
            new += n
            cached += c
            attn += n * (n + 2.0 * c)
        gemm = max(self._params2 * new / self._flops, self._weights / self._mem)
        return gemm + max(self._attn * attn / self._flops, cached * self._kv_tok / self._mem) + self._overhead

    def decode_step_time(self, batch: int, context_tokens: int) -> float:
        """Seconds for one decode step of ``batch`` requests with ``context_tokens`` in all."""
        if batch <= 0:
            return 0.0
        gemm = max(self._params2 * batch / self._flops, self._weights / self._mem)
        attn = max(context_tokens * self._kv_tok / self._mem, 2.0 * self._attn * context_tokens / self._flops)
        return gemm + attn + self._overhead

    def parts(self, kind: str, tokens: int, context: int) -> tuple[float, float, float, float]:
        """Seconds of a one-prompt prefill (``tokens`` new over ``context`` cached) or a decode
        step (``tokens`` requests of ``context`` each) at ``mfu`` = ``mbu`` = 1, no overhead:
        GEMM FLOPs, weight bytes, attention FLOPs, attention bytes (for fits)."""
        peak, hbm = self._flops / self._mfu, self._mem / self._mbu
        if kind == "prefill":
            attn_flops, attn_bytes = self._attn * tokens * (tokens + 2.0 * context), context * self._kv_tok
        else:
            k = tokens * context
            attn_flops, attn_bytes = 2.0 * self._attn * k, k * self._kv_tok
        return self._params2 * tokens / peak, self._weights / hbm, attn_flops / peak, attn_bytes / hbm
