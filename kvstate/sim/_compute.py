"""Compute model: how long one forward step of an instance takes, from the model's shapes.

A step computes ``T`` tokens: the new tokens of some prompts (``n`` new over ``c`` already
cached, each) and one token of each of ``b`` decoding requests (holding ``K`` context tokens
in all). Per layer, on each of the instance's ``tp`` GPUs, one after the other:

- **GEMMs**: each weight matrix of the layer (the fused QKV projection, the output
  projection, the MLP's gate-and-up and down, each cut by TP) over the ``T`` tokens; a
  mixture-of-experts layer instead reads only the experts its tokens were routed to (``E``
  experts, ``k`` a token: a step touches ``E·(1 − (1 − k/E)^T)`` of them) and multiplies each
  token by ``k`` experts, in one grouped kernel (one launch), plus any shared ones;
- **attention**: a prompt's ``4·h·d·n·(c + (n+1)/2)`` FLOPs (causal), reading its cache; a
  decode request reads its whole cache;
- **element-wise** kernels (two norms, rotary, the activation, two residual adds): bytes
  proportional to ``T``;
- **all-reduce**, twice a layer with TP > 1, of the ``T × hidden`` activations: the faster of
  two algorithms, each ``latency + 2(tp−1)/tp · bytes / bus bandwidth``, as the engine picks
  one by size: a low-latency one-shot kernel (vLLM's custom all-reduce: a few µs, but short
  of the links' bandwidth) and NCCL's ring (tens of µs, but the links' full bandwidth); the
  latencies grow by a quarter with each doubling of the ranks. A profile's all-reduce curve
  (``kvstate profile`` on several GPUs: NCCL through ``torch.distributed``) replaces them only
  above ``gpu.custom_allreduce_mib``: up to it vLLM runs its own one-shot kernel, which NCCL's
  measured latency (tens of µs a call) says nothing about;
- **expert parallelism** (``cluster.expert_parallel``, vLLM's ``--enable-expert-parallel``
  over the TP ranks): a rank holds ``E / tp`` experts whole and runs a ``tp``-th of those a
  step touches at full width (routing spreads evenly); a MoE layer sends its ``T·k`` token
  rows to their experts' ranks and back, two all-to-alls each ``latency + (tp−1)/tp ·
  bytes / tp / bus bandwidth`` at NCCL's ring figures, instead of its MLP's all-reduce.
  Shared experts stay split over the ranks.

Then the LM head, on the *sampled* positions only (a prompt's last token when its prefill
ends, every decoding request; the embedding lookup is a gather and costs nothing here), and
the engine's fixed ``gpu.step_overhead_ms``.

Each kernel takes the longer of its FLOPs at the GPU's peak and its bytes at its bandwidth: a
roofline whose GEMM efficiency grows with the tokens in the step (``mfu · T / (T +
gemm_half_tokens)``: a small step fills few tiles) and whose bytes move at ``mbu`` of HBM.
Where a measured profile is given (``gpu.profile``, from ``kvstate profile``), its measured
times replace the roofline kernel by kernel (:mod:`~kvstate.sim._profile`); a profile measured
on another GPU is carried over through the two datasheets.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from ._profile import Profile
from ._scenario import WEIGHT_KINDS, Scenario

__all__ = ["ComputeModel"]

#: a layer's element-wise traffic, in activations of ``hidden`` read or written per token: two
#: RMSNorms (read, write), two residual adds (two reads, a write), rotary on q and k (read,
#: write), the gated activation (two reads of the MLP width, one write: counted apart)
_ELEMENTWISE_HIDDENS = 2 * 2 + 2 * 3
_ELEMENTWISE_KERNELS = 4  #: vLLM's fused kernels: two add-and-RMSNorm, rotary, the gated activation
_ACT = 2  #: bytes of an activation (bf16)
_MEMO = 1 << 16  #: prefill batches whose times are kept (cleared when full)


class ComputeModel:
    """Step times of one instance of a scenario (see the module's docstring). Slotted: its
    forty-odd figures are read on every step, and an object with more attributes than CPython's
    shared key table holds (about thirty) would read each through a dictionary of its own."""

    __slots__ = ("tp", "layers", "hidden", "vocab", "wbytes", "peak", "attn_peak", "hbm", "mfu", "half",
                 "attn_mfu", "mbu", "attn_mbu", "overhead", "kernel", "heads_rank", "head_dim", "kv_token_layer",
                 "full_layers", "window_layers", "state_layers", "window", "state_rank", "attn_mats", "dense_mats",
                 "mlp_width", "experts", "top_k", "shared", "ep", "expert_width", "moe_width_tp", "moe_layers",
                 "custom_ar_bytes", "ar_algos", "profile", "_scale", "_decode_fixed", "_prefill", "_tokens",
                 "_heads", "_decode_per_token")

    def __init__(self, s: Scenario) -> None:
        m, g, tp = s.model, s.gpu, s.cluster.tp
        self.tp, self.layers, self.hidden, self.vocab = tp, m.num_layers, m.hidden, m.vocab
        self.wbytes, cores = WEIGHT_KINDS[m.weight_dtype]  # weight-only kinds read 4 or 8 bits, compute in 16
        self.peak = (g.fp8_tflops if cores == "8" else g.tflops) * 1e12
        self.attn_peak = g.tflops * 1e12
        self.hbm = g.hbm_gbps * 1e9
        self.mfu, self.half, self.attn_mfu, self.mbu = g.mfu, g.gemm_half_tokens, g.attn_mfu, g.mbu
        self.attn_mbu = g.attn_mbu
        self.overhead = g.step_overhead_ms / 1000.0
        self.kernel = g.kernel_us * 1e-6  #: every kernel's fixed time: launch, ramp-up, tail
        self.heads_rank = m.num_heads / tp
        self.head_dim = m.attention_head_dim
        # a token's cache bytes, one layer, one rank: K and V, or MLA's one latent (replicated)
        kv_bytes = m.head_dim if m.kv_lora_rank else 2 * max(1.0, m.total_kv_heads / tp) * m.head_dim  # a replica
        self.kv_token_layer = kv_bytes * _kv_itemsize(m.dtype)
        # layer kinds: full attention, a sliding window of `window` tokens, a recurrent state
        self.full_layers, self.window_layers, self.state_layers = m.full_layers, m.window_layers, m.state_layers
        self.window, self.state_rank = m.window, m.state_bytes / tp
        # the weight matrices of one layer on one rank: (name, K, N)
        self.attn_mats = m.attention_matrices(tp)
        mlp = m.mlp_matrices(tp)
        self.dense_mats = tuple((name, *mlp[name]) for name in ("gate_up", "down") if name in mlp)
        self.mlp_width = m.intermediate / tp
        self.experts, self.top_k, self.shared = m.experts, m.experts_per_token, m.shared_experts
        #: expert parallelism: each rank holds experts / tp whole experts (vLLM's EP over the TP ranks)
        self.ep = bool(s.cluster.expert_parallel and m.experts and tp > 1)
        self.expert_width = m.moe_intermediate / (1 if self.ep else tp)
        self.moe_width_tp = m.moe_intermediate / tp  #: a shared expert's width on a rank (always split)
        self.moe_layers = (m.num_layers - m.dense_layers) if m.experts else 0
        grow = 1 + 0.25 * math.log2(tp / 2) if tp > 1 else 0.0  # latency grows with the ranks to sync
        self.custom_ar_bytes = g.custom_allreduce_mib * 2**20  # up to it the engine's one-shot kernel runs
        self.ar_algos = ((g.allreduce_us * 1e-6 * grow, g.allreduce_ll_gbps * 1e9),
                         (g.allreduce_ring_us * 1e-6 * grow, g.allreduce_gbps * 1e9))
        self.profile: Profile | None = None
        self._scale = {"compute": 1.0, "memory": 1.0}
        if g.profile:
            self._use_profile(s, g.profile)
        self._decode_fixed: dict[int, float] = {}
        self._prefill: dict[tuple[tuple[int, int], ...], float] = {}
        self._tokens: dict[int, tuple[float, float, float]] = {}
        self._heads: dict[int, float] = {}  # the LM head's GEMM, per count of tokens sampled
        self._decode_per_token = self.decode_attention(1, 1) - self.decode_attention(1, 0)  # one layer's

    def _use_profile(self, s: Scenario, path: str) -> None:
        src = Path(s.source).parent / path if s.source and not Path(path).is_absolute() else Path(path)
        prof = Profile.load(src if src.exists() else Profile.shipped(path))
        prof.check_matches(s.model, self.tp, s.source)
        self.profile = prof
        self._scale = {"compute": prof.gpu["tflops"] * 1e12 / self.attn_peak, "memory": prof.gpu["hbm_gbps"] * 1e9
                       / self.hbm}

    # -- kernels ------------------------------------------------------------------------------------
    def _measured(self, seconds: float, flops: float, nbytes: float) -> float:
        """A profile's time carried to this GPU by the bound it was under where it was measured."""
        p = self.profile
        assert p is not None
        bound = "compute" if flops / (p.gpu["tflops"] * 1e12) >= nbytes / (p.gpu["hbm_gbps"] * 1e9) else "memory"
        return seconds * self._scale[bound]

    def gemm(self, name: str, m: float, k: float, n: float) -> float:
        """Seconds of ``[m, k] x [k, n]`` (weights ``k·n``)."""
        if m <= 0:
            return 0.0
        flops, nbytes = 2.0 * m * k * n, k * n * self.wbytes + _ACT * m * (k + n)
        curve = self.profile.gemm.get(name) if self.profile is not None else None
        if curve is not None:
            return self._measured(curve(m), flops, nbytes)
        eff = self.mfu * m / (m + self.half)
        return self.kernel + max(flops / (self.peak * eff), nbytes / (self.hbm * self.mbu))

    def prefill_attention(self, n: int, c: int) -> float:
        """One layer's attention of ``n`` new tokens over ``c`` cached ones (one prompt). A
        profile measures prompts with no cache; the cached part adds its roofline time."""
        h, d = self.heads_rank, self.head_dim
        if self.profile is not None:
            flops0 = 4.0 * h * d * n * (n + 1) / 2
            bytes0 = n * self.kv_token_layer + 2 * _ACT * n * h * d
            base = self._measured(self.profile.attn_prefill(n), flops0, bytes0)
            return base + (self._attention_roofline(n, c) - self._attention_roofline(n, 0) if c else 0.0)
        return self.kernel + self._attention_roofline(n, c)

    def _attention_roofline(self, n: int, c: int) -> float:
        flops = 4.0 * self.heads_rank * self.head_dim * n * (c + (n + 1) / 2)
        nbytes = (c + n) * self.kv_token_layer + 2 * _ACT * n * self.heads_rank * self.head_dim
        eff = self.attn_mfu * n / (n + self.half)
        return max(flops / (self.attn_peak * eff), nbytes / (self.hbm * self.attn_mbu))

    def decode_attention(self, batch: int, context: int) -> float:
        """One layer's attention of ``batch`` decoding requests holding ``context`` tokens in all:
        a fixed part and the KV bytes it reads (linear in ``context``)."""
        if batch <= 0:
            return 0.0
        if self.profile is not None:
            p = self.profile
            return (p.decode_base + p.decode_per_token * context) * self._scale["memory"]
        return self.kernel + context * self.kv_token_layer / (self.hbm * self.attn_mbu)

    def window_prefill_attention(self, n: int, c: int) -> float:
        """One window layer's attention of ``n`` new tokens over ``c`` cached ones: a new token
        attends at most ``window`` tokens, so the time scales by the tokens attended."""
        w = self.window
        if c + n <= w:
            return self.prefill_attention(n, c)
        k = max(0, min(n, w - c))  # new tokens that still see their whole past
        attended = (k * c + k * (k + 1) / 2 + (n - k) * w) / n
        return self.prefill_attention(n, min(c, w)) * attended / (min(c, w) + (n + 1) / 2)

    def state_update(self, batch: int, prompts: Sequence[tuple[int, int, bool]]) -> float:
        """One state layer's step: each decoding request reads and writes its state once; each
        prompt chunk scans its tokens through the state (two multiply-adds per state value and
        token) and reads and writes it once. Its projections are timed as attention's."""
        state, t = self.state_rank, 0.0
        if batch:
            t += self.kernel + batch * 2 * state / (self.hbm * self.attn_mbu)
        for n, _, _ in prompts:
            flops = 4.0 * n * state / 2  # bf16 values
            t += self.kernel + max(flops / (self.attn_peak * self.attn_mfu), 2 * state / (self.hbm * self.attn_mbu))
        return t

    def _layers_attention(self, prompts: Sequence[tuple[int, int, bool]], batch: int, context: int) -> float:
        """Every layer's attention (or state update) in one step, by layer kind."""
        t = 0.0
        if self.full_layers:
            full = self.decode_attention(batch, context) if batch else 0.0
            prefill = 0.0  # the prompts' attention, summed in their order
            for n, c, _ in prompts:
                prefill += self.prefill_attention(n, c)
            t += self.full_layers * (full + prefill)
        if self.window_layers:
            window = self.decode_attention(batch, min(context, batch * self.window)) + sum(
                self.window_prefill_attention(n, c) for n, c, _ in prompts)
            t += self.window_layers * window
        if self.state_layers:
            t += self.state_layers * self.state_update(batch, prompts)
        return t

    def elementwise(self, tokens: int) -> float:
        """One layer's norms, rotary, activation and residual adds over ``tokens``."""
        nbytes = tokens * _ACT * (_ELEMENTWISE_HIDDENS * self.hidden + 3 * self.mlp_width)
        if self.profile is not None:
            return self._measured(self.profile.elementwise(tokens), 0.0, nbytes)
        return _ELEMENTWISE_KERNELS * self.kernel + nbytes / (self.hbm * self.mbu)

    def allreduce(self, nbytes: float) -> float:
        """One all-reduce of ``nbytes`` over the instance's ``tp`` GPUs (0 at TP 1)."""
        if self.tp == 1 or nbytes <= 0:
            return 0.0
        bus = 2.0 * (self.tp - 1) / self.tp * nbytes  # what crosses a link, per NCCL's bus bandwidth
        if self.profile is not None and self.profile.allreduce is not None and nbytes > self.custom_ar_bytes:
            return self.profile.allreduce(nbytes)  # NCCL's, as measured: the engine's kernel does not go this far
        (lat_a, bw_a), (lat_b, bw_b) = self.ar_algos  # the faster of the two (no generator: a call per step)
        a, b = lat_a + bus / bw_a, lat_b + bus / bw_b
        return a if a <= b else b

    def _mlp(self, tokens: int, moe: bool) -> float:
        if not moe:
            return self._gemms(tokens, self.dense_mats)
        e, k = self.experts, self.top_k
        touched = e * (1.0 - (1.0 - k / e) ** tokens)
        per_expert = tokens * k / touched  # tokens each touched expert multiplies
        w = self.expert_width
        # one grouped kernel runs every touched expert's GEMM: one launch, each expert's FLOPs and bytes;
        # with EP a rank runs its own experts whole, a tp-th of those touched (routing spreads evenly)
        each = (self.gemm("expert_gate_up", per_expert, self.hidden, 2 * w) +
                self.gemm("expert_down", per_expert, w, self.hidden))
        mine = touched / self.tp if self.ep else touched
        t = 2 * self.kernel + mine * max(each - 2 * self.kernel, 0.0)
        if self.shared:  # shared experts stay split over the ranks
            ws = self.moe_width_tp
            t += self.gemm("shared_gate_up", tokens, self.hidden, 2 * ws * self.shared) + \
                self.gemm("shared_down", tokens, ws * self.shared, self.hidden)
        t += self.gemm("router", tokens, self.hidden, e)
        if self.ep:  # tokens to their experts' ranks and back instead of the MLP's all-reduce
            t += 2 * self.alltoall(tokens * k * self.hidden * _ACT) - self.allreduce(tokens * self.hidden * _ACT)
        return t

    def alltoall(self, nbytes: float) -> float:
        """One all-to-all in which the instance's ranks together send ``nbytes`` (each sends
        the (tp - 1) / tp of its share that other ranks hold): NCCL's ring latency, and each
        rank's share over the link at the ring's bus bandwidth."""
        if self.tp == 1 or nbytes <= 0:
            return 0.0
        latency, bw = self.ar_algos[1]
        return latency + nbytes / self.tp * (self.tp - 1) / self.tp / bw

    # -- a whole step --------------------------------------------------------------------------------
    def step_time(self, prompts: Iterable[tuple[int, int, bool]] = (), batch: int = 0, context: int = 0) -> float:
        """Seconds of one step: prompts' chunks ``(new, cached, ends_the_prompt)`` and one token
        of each of ``batch`` decoding requests holding ``context`` tokens in all."""
        prompts = list(prompts)
        tokens = sampled = batch
        for n, _, last in prompts:
            tokens += n
            if last:
                sampled += 1
        if tokens <= 0:
            return 0.0
        layers, dense, moe = self._by_tokens(tokens)
        t = layers + self._layers_attention(prompts, batch, context)
        t += dense
        if self.moe_layers:
            t += moe
        head = self._heads.get(sampled)
        if head is None:
            head = self._heads[sampled] = self.gemm("lm_head", sampled, self.hidden, self.vocab / self.tp)
        return t + head + self.overhead

    def _by_tokens(self, tokens: int) -> tuple[float, float, float]:
        """A step's parts that depend on its token count alone, kept per count: every layer's
        projections, element-wise kernels and all-reduces; the dense MLPs; the MoE ones."""
        got = self._tokens.get(tokens)
        if got is not None:
            return got
        per_layer = self._gemms(tokens, self.attn_mats)
        per_layer += self.elementwise(tokens) + 2 * self.allreduce(tokens * self.hidden * _ACT)
        dense = (self.layers - self.moe_layers) * self._gemms(tokens, self.dense_mats)  # _mlp(tokens, False)
        moe = self.moe_layers * self._mlp(tokens, True) if self.moe_layers else 0.0
        if len(self._tokens) >= _MEMO:
            self._tokens.clear()
        got = self._tokens[tokens] = (self.layers * per_layer, dense, moe)
        return got

    def _gemms(self, m: int, mats: Sequence[tuple[str, float, float]]) -> float:
        """``sum(gemm(name, m, k, n) for name, k, n in mats)``, the roofline's loop written out
        (its arithmetic unchanged) where no profile measures a matrix."""
        if self.profile is not None or m <= 0:
            return sum(self.gemm(name, m, k, n) for name, k, n in mats)
        compute = self.peak * (self.mfu * m / (m + self.half))
        memory, kernel, wbytes = self.hbm * self.mbu, self.kernel, self.wbytes
        t = 0.0
        for _, k, n in mats:
            t += kernel + max(2.0 * m * k * n / compute, (k * n * wbytes + _ACT * m * (k + n)) / memory)
        return t

    def prefill_time(self, work: Iterable[tuple[int, int]]) -> float:
        """Seconds of one forward over whole prompts ``(new_tokens, cached_tokens)``, kept per
        batch of prompts: a trace's prompts repeat their lengths, and a step costs tens of
        gemm calls."""
        key = tuple(work)
        t = self._prefill.get(key)
        if t is None:
            if len(self._prefill) >= _MEMO:
                self._prefill.clear()
            t = self._prefill[key] = self.step_time([(n, c, True) for n, c in key])
        return t

    def decode_step_time(self, batch: int, context_tokens: int) -> float:
        """Seconds of one decode step of ``batch`` requests with ``context_tokens`` in all: the
        step with no context, kept per batch size, plus the context's attention (linear in it),
        so the simulator's many decode steps cost a look-up each."""
        if batch <= 0:
            return 0.0
        fixed = self._decode_fixed.get(batch)
        if fixed is None:
            fixed = self._decode_fixed[batch] = self.step_time((), batch, 0)
        window = min(context_tokens, batch * self.window) if self.window_layers else 0
        return fixed + self._decode_per_token * (self.full_layers * context_tokens + self.window_layers * window)

    def decode_step_times(self, batch: int, context: int, count: int) -> list[float]:
        """:meth:`decode_step_time` of ``count`` steps from ``context``, growing by ``batch`` a
        step (a span of quiet steps, :mod:`kvstate.sim._span`): one look-up for them all."""
        if batch <= 0:
            return [0.0] * count
        fixed = self._decode_fixed.get(batch)
        if fixed is None:
            fixed = self._decode_fixed[batch] = self.step_time((), batch, 0)
        per, full, wl = self._decode_per_token, self.full_layers, self.window_layers
        if not wl:  # ``wl * window`` is 0: the same sums without it
            return [fixed + per * (full * (context + i * batch)) for i in range(count)]
        reach = batch * self.window
        return [fixed + per * (full * c + wl * min(c, reach)) for c in range(context, context + count * batch, batch)]


def _kv_itemsize(dtype: str) -> int:
    return 1 if dtype == "uint8" else 2
