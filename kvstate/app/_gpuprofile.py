"""``kvstate profile``'s measurements: one model's kernels at one TP degree, timed on a GPU.

For each rank's share of the model (its matrices cut by TP), with PyTorch on the current GPU:

- every weight GEMM of a layer (the fused QKV projection, the output projection, the MLP's
  gate-and-up and down; an expert's, the shared experts', the router's) and the LM head, over a
  step's tokens from 1 to 16,384;
- a prefill's attention (flash attention through ``scaled_dot_product_attention``, causal, no
  cache) over its length;
- a decode step's attention over (batch, context) (one query a request over contiguous K and V:
  what a paged kernel reads);
- a layer's element-wise traffic (norms, rotary, the activation, residual adds) as six kernels
  moving its bytes;
- with TP GPUs present, an all-reduce over the sizes a layer sends (NCCL, NVLink multicast off).

Each kernel is captured ``reps`` times in a CUDA graph and replayed, so the time is the GPU's,
not the launches' (a serving engine replays graphs too), on random data (zeros run faster),
with several weight copies rotated so a matrix does not sit in the L2 cache between calls.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from .._errors import ConfigError
from ..sim._profile import FORMAT, SHAPE_FIELDS
from ..sim._scenario import ModelSpec

__all__ = ["measure_profile", "TOKENS", "allreduce_curve", "allreduce_worker"]

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREFILL = (16, 64, 256, 1024, 2048, 4096, 8192, 16384)
DECODE = ((1, 512), (1, 4096), (8, 1024), (32, 1024), (32, 4096), (128, 1024), (128, 2048), (256, 512))


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ConfigError("kvstate profile needs PyTorch with a CUDA device (pip install torch)") from None
    if not torch.cuda.is_available():
        raise ConfigError("kvstate profile needs a CUDA device: none is visible")
    return torch


def _timed(torch: Any, fn: Callable[[], Any], reps: int) -> float:
    """Seconds of one ``fn()`` on the GPU: ``reps`` calls captured in a graph, replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1000.0 / reps)
    del g
    return sorted(times)[len(times) // 2]


def _gemms(m: ModelSpec, tp: int) -> dict[str, tuple[int, int]]:
    """The weight matrices of one rank: name -> (K, N)."""
    mats = {name: (k, n) for name, k, n in m.attention_matrices(tp)}
    mats.update(m.mlp_matrices(tp))
    mats["lm_head"] = (m.hidden, m.vocab / tp)
    return {name: (int(k), int(n)) for name, (k, n) in mats.items()}


def _gemm_curves(torch: Any, m: ModelSpec, tp: int, tokens: tuple[int, ...]) -> dict[str, list[list[float]]]:
    dt = torch.bfloat16
    out: dict[str, list[list[float]]] = {}
    for name, (k, n) in _gemms(m, tp).items():
        copies = max(1, min(4, math.ceil(200e6 / (k * n * 2))))  # past the L2 between calls
        ws = [torch.randn(k, n, device="cuda", dtype=dt) for _ in range(copies)]
        out[name] = [[t, _time_gemm(torch, ws, t, k, n)] for t in tokens]
        del ws
        torch.cuda.empty_cache()
    return out


def _time_gemm(torch: Any, ws: list[Any], t: int, k: int, n: int) -> float:
    """One ``[t, k] x [k, n]`` GEMM, the weights rotating among ``ws`` (captured as called)."""
    x = torch.randn(t, k, device="cuda", dtype=ws[0].dtype)
    y = torch.empty(t, n, device="cuda", dtype=ws[0].dtype)
    turn = iter(range(1 << 30))

    def call() -> Any:
        return torch.matmul(x, ws[next(turn) % len(ws)], out=y)
    return _timed(torch, call, 8 if t >= 1024 else 32)


def _sdpa(torch: Any, q_shape: tuple[int, ...], kv_shape: tuple[int, ...], causal: bool, reps: int) -> float:
    """One flash attention call of these shapes (GQA where the heads differ)."""
    import torch.nn.functional as F

    q = torch.randn(*q_shape, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(*kv_shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(*kv_shape, device="cuda", dtype=torch.bfloat16)
    gqa = q_shape[1] != kv_shape[1]

    def call() -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return _timed(torch, call, reps)


def _attention(torch: Any, m: ModelSpec, tp: int) -> tuple[list[list[float]], list[list[float]]]:
    hq, hk, d = m.num_heads // tp, max(1, m.total_kv_heads // tp), m.head_dim
    prefill = [[n, _sdpa(torch, (1, hq, n, d), (1, hk, n, d), True, 4 if n >= 4096 else 16)] for n in PREFILL]
    decode = [[b, ctx, _sdpa(torch, (b, hq, 1, d), (b, hk, ctx, d), False, 16)] for b, ctx in DECODE]
    torch.cuda.empty_cache()
    return prefill, decode


def _elementwise(torch: Any, m: ModelSpec, tp: int, tokens: tuple[int, ...]) -> list[list[float]]:
    width = m.moe_intermediate * m.experts_per_token if m.experts else m.intermediate
    per_token = 2 * (10 * m.hidden + 3 * width // tp)  # the bytes compute.py counts for a layer
    pts = []
    for t in tokens:
        n = max(1, per_token * t // 2 // 6 // 3)  # six kernels, each reading two and writing one bf16 array
        pts.append([t, 6 * _time_add(torch, n)])
    return pts


def _time_add(torch: Any, n: int) -> float:
    a, b, c = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def call() -> Any:
        return torch.add(a, b, out=c)
    return _timed(torch, call, 32)


def measure_profile(m: ModelSpec, tp: int, quick: bool = False) -> dict[str, Any]:
    """The profile of ``m`` at ``tp`` on this GPU (the format of :mod:`kvstate.sim._profile`)."""
    torch = _torch()
    if m.total_kv_heads % tp and tp % m.total_kv_heads:
        raise ConfigError(f"--tp {tp}: the model's {m.total_kv_heads} KV heads neither split over {tp} ranks nor "
                          "replicate evenly on them")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    tokens = TOKENS[::2] if quick else TOKENS
    prop = torch.cuda.get_device_properties(torch.cuda.current_device())
    prefill, decode = _attention(torch, m, tp)
    return {
        "format": FORMAT, "version": 1, "tp": tp,
        "gpu": _datasheet(prop.name),
        "model": {"name": m.name, **{f: getattr(m, f) for f in SHAPE_FIELDS}},
        "gemm": _gemm_curves(torch, m, tp, tokens), "attn_prefill": prefill, "attn_decode": decode,
        "elementwise": _elementwise(torch, m, tp, tokens), "allreduce": _allreduce(torch, m, tp),
        "torch": torch.__version__,
    }


def _datasheet(name: str) -> dict[str, Any]:
    """The GPU's name, preset, and the peak and bandwidth its times are carried to another GPU by."""
    from ..sim._gpus import GPUS

    key = "H200" if "H200" in name else "H100-PCIe" if "H100" in name and "PCIe" in name else \
        "H100-SXM" if "H100" in name else "A100-SXM-80G" if "A100" in name else "L40S" if "L40S" in name else None
    if key is None:
        raise ConfigError(f"kvstate profile: no datasheet figures for {name!r} (add it to kvstate/sim/_gpus.py)")
    return {"name": name, "preset": key, "tflops": GPUS[key]["tflops"], "hbm_gbps": GPUS[key]["hbm_gbps"]}


def _allreduce(torch: Any, m: ModelSpec, tp: int) -> list[list[float]]:
    """All-reduce seconds over the sizes a layer sends (``tokens x hidden`` bf16), when ``tp``
    GPUs are here; empty otherwise (the scenario's link figures apply)."""
    if tp < 2 or torch.cuda.device_count() < tp:
        return []
    return allreduce_curve([t * m.hidden * 2 for t in (1, 8, 64, 512, 2048, 8192)], tp)


def allreduce_curve(sizes: list[int], tp: int, backend: str = "nccl") -> list[list[float]]:
    """``[[bytes, seconds], ...]``: the median all-reduce of each size over ``tp`` processes
    (``nccl``: one GPU each; ``gloo``: CPU tensors, which checks the harness where one GPU is
    all there is)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        result = manager.dict()
        mp.spawn(allreduce_worker, args=(tp, sizes, result, _free_port(), backend), nprocs=tp, join=True)
        return [[n, float(result[n])] for n in sizes]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def allreduce_worker(rank: int, tp: int, sizes: list[int], result: Any, port: int,
                     backend: str = "nccl") -> None:
    """One rank of the all-reduce timing (``torch.multiprocessing.spawn``'s target): 5 warm-up
    all-reduces per size, then 20 timed one by one (CUDA events on a GPU, the host clock on
    CPU tensors); rank 0 records the median."""
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
                            timeout=datetime.timedelta(seconds=120))  # a rank that never comes fails the run
    gpu = backend == "nccl"
    try:
        if gpu:
            torch.cuda.set_device(rank)
        for n in sizes:
            x = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda") if gpu else torch.randn(n // 4)
            for _ in range(5):
                dist.all_reduce(x)
            times = [_one_allreduce(torch, dist, x, gpu) for _ in range(20)]
            if rank == 0:
                result[n] = sorted(times)[len(times) // 2]
    finally:
        dist.destroy_process_group()


def _one_allreduce(torch: Any, dist: Any, x: Any, gpu: bool) -> float:
    """Seconds of one all-reduce of ``x``: between CUDA events on a GPU, by the host clock on CPU."""
    if not gpu:
        t0 = time.perf_counter()
        dist.all_reduce(x)
        return time.perf_counter() - t0
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    dist.all_reduce(x)
    b.record()
    torch.cuda.synchronize()
    return float(a.elapsed_time(b)) / 1000.0
