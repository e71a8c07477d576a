"""The CUDA transfer ops and backend: byte-identical to the numpy reference, same errors, no leaks.

Marked ``gpu``: skipped with a reason where CuPy or a CUDA device is missing, run for real on
the GPU machine (docs/benchmarks.md records the run).
"""
import gc
import resource

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from needs import gpu as needs_gpu
from needs import gpu_missing, has_module

from kvstate import ConfigError, KVStateError, ValidationError
from kvstate.kernels import _reference as reference
from kvstate.kernels._cuda import load_cupy

GPU = gpu_missing() is None
gpu = needs_gpu()
pytestmark = pytest.mark.gpu
STRATS = ["zero_copy", "staged", "dma", "auto"]
HSET = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.skipif(GPU or has_module("cupy"), reason="checks the error where CuPy is absent")
def test_without_cupy_a_clear_config_error():
    with pytest.raises(ConfigError, match="CuPy"):
        load_cupy()


@pytest.fixture(scope="module", params=["ids_inline", "ids_on_device"])
def sw(request):
    """Both ways of handing block ids to the kernels: in the launch's parameters (calls of up to
    INLINE_IDS blocks) and uploaded to device memory first (forced with inline_ids=0)."""
    from kvstate.kernels._cuda import CudaSwapper

    inline = 480 if request.param == "ids_inline" else 0
    with CudaSwapper(staging_bytes=4 << 20, inline_ids=inline) as s:  # small staging: many staged pieces
        yield s


@st.composite
def case(draw):
    layers = draw(st.integers(1, 4))
    n_gpu, n_host = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    heads, bs, dim = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 40))
    dtype = draw(st.sampled_from(["float16", "uint8", "bfloat16"]))
    k = draw(st.integers(0, min(n_gpu, n_host)))
    gids = draw(st.permutations(range(n_gpu)))[:k]
    hids = draw(st.permutations(range(n_host)))[:k]
    if draw(st.booleans()) and k:
        g0, h0 = draw(st.integers(0, n_gpu - k)), draw(st.integers(0, n_host - k))
        gids, hids = list(range(g0, g0 + k)), list(range(h0, h0 + k))
    lib = draw(st.sampled_from(["torch", "cupy"] if has_module("torch") else ["cupy"]))
    return dict(layers=layers, n_gpu=n_gpu, n_host=n_host, chunk=(heads, bs, dim), dtype=dtype,
                gids=list(gids), hids=list(hids), lib=lib, seed=draw(st.integers(0, 2**31)))


def _np_dtype(name):
    return np.dtype("uint16" if name == "bfloat16" else name)


def _to_gpu(a, lib, dtype):
    """A GPU tensor holding numpy array ``a``'s bytes (bfloat16 through a 16-bit view)."""
    if lib == "cupy":
        import cupy as cp

        return cp.asarray(a)
    import torch

    t = torch.from_numpy(a.view(np.int16) if a.dtype == np.uint16 else a).cuda()
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def _to_np(t):
    import cupy as cp

    if isinstance(t, cp.ndarray):
        return cp.asnumpy(t)
    import torch

    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.cpu().numpy().view(np.uint16) if t.dtype == torch.int16 else t.cpu().numpy()


@gpu
@HSET
@given(c=case(), direction=st.sampled_from(["d2h", "h2d"]), strategy=st.sampled_from(STRATS))
def test_layout_identical_to_reference(sw, c, direction, strategy):
    rng = np.random.default_rng(c["seed"])
    dt = _np_dtype(c["dtype"])
    caches = [rng.integers(0, 255, (c["n_gpu"],) + c["chunk"]).astype(dt) for _ in range(c["layers"])]
    host = sw.pinned((c["n_host"], c["layers"]) + c["chunk"], dt)
    host[...] = rng.integers(0, 255, host.shape).astype(dt)  # poisoned: every byte must be right
    want_c, want_h = [x.copy() for x in caches], host.copy()
    reference.swap_cache_layout(want_c, want_h, c["gids"], c["hids"], direction)
    gcaches = [_to_gpu(x, c["lib"], c["dtype"]) for x in caches]
    plan = sw.swap_cache_layout(gcaches, host, c["gids"], c["hids"], direction, strategy=strategy)
    assert plan.blocks == len(c["gids"])
    assert np.array_equal(host, want_h)
    for g, w in zip(gcaches, want_c):
        assert np.array_equal(_to_np(g), w)


@gpu
@HSET
@given(c=case(), direction=st.sampled_from(["d2h", "h2d"]), strategy=st.sampled_from(STRATS),
       one=st.booleans())
def test_per_layer_and_all_layers_identical(sw, c, direction, strategy, one):
    rng = np.random.default_rng(c["seed"])
    dt = _np_dtype(c["dtype"])
    layers = 1 if one else c["layers"]
    caches = [rng.integers(0, 255, (c["n_gpu"],) + c["chunk"]).astype(dt) for _ in range(layers)]
    hosts = [sw.pinned((c["n_host"],) + c["chunk"], dt) for _ in range(layers)]
    for h in hosts:
        h[...] = rng.integers(0, 255, h.shape).astype(dt)
    want_c, want_h = [x.copy() for x in caches], [h.copy() for h in hosts]
    gcaches = [_to_gpu(x, c["lib"], c["dtype"]) for x in caches]
    if one:
        reference.swap_cache_per_layer(want_c[0], want_h[0], c["gids"], c["hids"], direction)
        sw.swap_cache_per_layer(gcaches[0], hosts[0], c["gids"], c["hids"], direction, strategy=strategy)
    else:
        reference.swap_cache_all_layers(want_c, want_h, c["gids"], c["hids"], direction)
        sw.swap_cache_all_layers(gcaches, hosts, c["gids"], c["hids"], direction, strategy=strategy)
    for h, w in zip(hosts, want_h):
        assert np.array_equal(h, w)
    for g, w in zip(gcaches, want_c):
        assert np.array_equal(_to_np(g), w)


@gpu
@pytest.mark.parametrize("strategy", ["zero_copy", "staged"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_odd_chunks_over_several_shared_memory_pieces_and_unaligned_hosts(sw, strategy, direction):
    """Spans longer than one kv_span piece (40 layers x 1005 B), and host layers starting 3
    bytes past a 16-byte boundary (per-layer layout), byte for byte against the reference."""
    import cupy as cp

    from kvstate.kernels._cuda_src import SPAN_PIECE

    rng = np.random.default_rng(7)
    L, n_gpu, n_host, chunk = 40, 12, 9, (1, 5, 201)
    assert L * 1005 > 2 * SPAN_PIECE
    caches = [rng.integers(0, 255, (n_gpu,) + chunk).astype(np.uint8) for _ in range(L)]
    gids, hids = [11, 0, 5, 6, 7, 2], [8, 0, 1, 4, 3, 2]
    host = sw.pinned((n_host, L) + chunk, np.uint8)
    host[...] = rng.integers(0, 255, host.shape)
    want_c, want_h = [x.copy() for x in caches], host.copy()
    reference.swap_cache_layout(want_c, want_h, gids, hids, direction)
    g = [cp.asarray(x) for x in caches]
    sw.swap_cache_layout(g, host, gids, hids, direction, strategy=strategy)
    assert np.array_equal(host, want_h)
    assert all(np.array_equal(cp.asnumpy(a), b) for a, b in zip(g, want_c))
    # per-layer host arrays at odd addresses: head and tail bytes around the vector middle
    raw = sw.pinned((L, n_host * 1005 + 3), np.uint8)
    hosts = [raw[i, 3:].reshape((n_host,) + chunk) for i in range(L)]
    for h in hosts:
        h[...] = rng.integers(0, 255, h.shape)
    want_c, want_h = [cp.asnumpy(a) for a in g], [h.copy() for h in hosts]
    reference.swap_cache_all_layers(want_c, want_h, gids, hids, direction)
    sw.swap_cache_all_layers(g, hosts, gids, hids, direction, strategy=strategy)
    assert all(np.array_equal(h, w) for h, w in zip(hosts, want_h))
    assert all(np.array_equal(cp.asnumpy(a), b) for a, b in zip(g, want_c))


@gpu
@pytest.mark.skipif(not has_module("torch"), reason="needs PyTorch")
def test_async_form_orders_through_events(sw):
    """d2h then h2d enqueued on a PyTorch side stream, no host wait between: the event of the
    first orders the second, and a later kernel on the stream sees the result."""
    import torch

    src = [torch.randint(0, 30000, (64, 2, 16, 64), dtype=torch.int16, device="cuda").view(torch.bfloat16)
           for _ in range(3)]
    dst = [torch.zeros_like(s) for s in src]
    host = torch.zeros((40, 2, 16, 64), dtype=torch.bfloat16).pin_memory()
    side = torch.cuda.Stream()
    ids = [(7 * i) % 64 for i in range(40)]  # distinct, scattered
    for layer in range(3):
        ev1 = sw.swap_cache_per_layer_async(src[layer], host, ids, list(range(40)), "d2h", stream=side)
        ev2 = sw.swap_cache_per_layer_async(dst[layer], host, ids, list(range(40)), "h2d", stream=side)
        assert ev1 is not None and ev2 is not None
    with torch.cuda.stream(side):  # enqueued after the swaps, no host wait in between
        diff = sum((d[ids].view(torch.int16) != s[ids].view(torch.int16)).sum() for d, s in zip(dst, src))
    side.synchronize()
    assert int(diff) == 0
    untouched = sorted(set(range(64)) - set(ids))
    assert all(int(d[untouched].view(torch.int16).abs().sum()) == 0 for d in dst)


def _bad_cases():
    return [
        (dict(gids=[0, 1], hids=[0]), "lengths must match"),
        (dict(gids=[4], hids=[0]), "out of range"),
        (dict(gids=[-1], hids=[0]), "negative"),
        (dict(gids=[0], hids=[3]), "out of range"),
        (dict(gids=[0, 1], hids=[1, 1]), "appears twice"),
        (dict(gids=[1, 1], hids=[0, 1], direction="h2d"), "appears twice"),
        (dict(gids=[0.5], hids=[0]), "not an int"),
        (dict(direction="up"), "direction"),
        (dict(host_shape=(3, 1, 2, 3, 5)), "host must be"),
        (dict(host_dtype="uint8"), "host dtype"),
        (dict(layer_dtype="float32"), "dtype"),
    ]


@gpu
@pytest.mark.parametrize("bad,msg", _bad_cases())
def test_bad_input_same_error_as_reference_and_nothing_moves(sw, bad, msg):
    import cupy as cp

    direction = bad.get("direction", "d2h")
    gids, hids = bad.get("gids", [0]), bad.get("hids", [0])
    np_caches = [np.full((4, 2, 3, 5), 7, np.float16) for _ in range(2)]
    if "layer_dtype" in bad:
        np_caches[1] = np_caches[1].astype(bad["layer_dtype"])
    hshape, hdt = bad.get("host_shape", (3, 2, 2, 3, 5)), bad.get("host_dtype", "float16")
    np_host = np.ones(hshape, hdt)
    host = sw.pinned(hshape, hdt)
    host[...] = 1
    g_caches = [cp.asarray(x) for x in np_caches]
    with pytest.raises(KVStateError) as ref_err:
        reference.swap_cache_layout(np_caches, np_host, gids, hids, direction)
    with pytest.raises(KVStateError) as gpu_err:
        sw.swap_cache_layout(g_caches, host, gids, hids, direction)
    assert type(gpu_err.value) is type(ref_err.value)
    assert str(gpu_err.value) == str(ref_err.value)
    assert msg in str(gpu_err.value)
    assert (host == 1).all() and all(int((g != 7).sum()) == 0 for g in g_caches)


@gpu
def test_gpu_specific_rules(sw):
    import cupy as cp

    caches = [cp.zeros((4, 2, 3, 5), cp.float16) for _ in range(2)]
    pinned = sw.pinned((3, 2, 2, 3, 5), np.float16)
    with pytest.raises(ValidationError, match="host memory.*GPU tensor|GPU tensor"):
        sw.swap_cache_layout([np.zeros((4, 2, 3, 5), np.float16)] * 2, pinned, [0], [0], "d2h")
    with pytest.raises(ValidationError, match="GPU memory: the host side"):
        sw.swap_cache_layout(caches, cp.zeros((3, 2, 2, 3, 5), cp.float16), [0], [0], "d2h")
    with pytest.raises(ValidationError, match="page-locked"):
        sw.swap_cache_layout(caches, np.zeros((3, 2, 2, 3, 5), np.float16), [0], [0], "d2h")
    strided = [cp.zeros((4, 2, 3, 10), cp.float16)[..., ::2] for _ in range(2)]
    with pytest.raises(ValidationError, match="contiguous"):
        sw.swap_cache_layout(strided, pinned, [0], [0], "d2h")
    with pytest.raises(ValidationError, match="strategy"):
        sw.swap_cache_layout(caches, pinned, [0], [0], "d2h", strategy="fast")
    from kvstate.kernels._cuda import CudaSwapper

    for bad in (481, -1, True, 2.0):
        with pytest.raises(ValidationError, match="inline_ids"):
            CudaSwapper(inline_ids=bad)


@gpu
@pytest.mark.parametrize("chunk", [(1, 3, 35), (2, 4, 8)])  # 105 B (kv_span), 64 B (kv_chunks)
@pytest.mark.parametrize("strategy", ["zero_copy", "staged"])
def test_ids_inline_up_to_the_limit_then_uploaded(sw, monkeypatch, chunk, strategy):
    """Calls of up to inline_ids blocks upload no ids; bigger ones do; both byte-exact."""
    import cupy as cp

    rng = np.random.default_rng(7)
    L, N = 3, 1200
    caches = [cp.asarray(rng.integers(0, 255, (N,) + chunk).astype(np.uint8)) for _ in range(L)]
    for n in (sw.inline_ids or 5, 700):
        gids = rng.choice(N, n, replace=False)
        hids = rng.permutation(n)
        host = sw.pinned((n, L) + chunk, np.uint8)
        before = sw.id_uploads
        sw.swap_cache_layout(caches, host, gids, hids, "d2h", strategy=strategy)
        want = np.zeros_like(host)
        reference.swap_cache_layout([cp.asnumpy(c) for c in caches], want, gids, hids, "d2h")
        assert np.array_equal(host, want)
        assert (sw.id_uploads > before) == (n > sw.inline_ids), (n, sw.inline_ids, sw.id_uploads - before)
        host[...] = rng.integers(0, 255, host.shape).astype(np.uint8)
        sw.swap_cache_layout(caches, host, gids, hids, "h2d", strategy=strategy)
        for i, c in enumerate(caches):
            assert np.array_equal(cp.asnumpy(c)[gids], host[hids, i])


@gpu
def test_create_and_close_1000_times_leaks_nothing():
    import cupy as cp

    from kvstate.kernels._cuda import CudaSwapper

    caches = [cp.arange(8 * 64, dtype=cp.uint8).reshape(8, 1, 8, 8) for _ in range(4)]

    def cycle():
        with CudaSwapper(staging_bytes=1 << 20) as s:
            host = s.pinned((8, 4, 1, 8, 8), np.uint8)
            s.swap_cache_layout(caches, host, [1, 2], [0, 1], "d2h", strategy="staged")
            s.swap_cache_layout(caches, host, [3], [2], "d2h", strategy="zero_copy")

    for _ in range(20):  # warm caches (compiled module, allocator pools)
        cycle()
    gc.collect()
    free0 = cp.cuda.runtime.memGetInfo()[0]
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(1000):
        cycle()
    gc.collect()
    free1 = cp.cuda.runtime.memGetInfo()[0]
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert free0 - free1 < 4 << 20, f"device memory fell by {(free0 - free1) >> 20} MiB over 1000 swappers"
    assert rss1 - rss0 < 64 << 10, f"peak RSS grew by {(rss1 - rss0) >> 10} MiB over 1000 swappers"


@gpu
def test_closed_swapper_refuses_work():
    import cupy as cp

    from kvstate.kernels._cuda import CudaSwapper

    s = CudaSwapper()
    host = s.pinned((2, 1, 1, 1, 16), np.uint8)
    s.close()
    s.close()
    with pytest.raises(ValidationError, match="closed"):
        s.swap_cache_layout([cp.zeros((2, 1, 1, 16), cp.uint8)], host, [0], [0], "d2h")


@gpu
def test_module_ops_dispatch_to_cuda_for_gpu_tensors():
    import cupy as cp

    from kvstate.kernels import swap_cache_layout
    from kvstate.kernels._cuda import CudaSwapper

    caches = [cp.arange(6 * 105, dtype=cp.uint8).reshape(6, 1, 1, 105) + i for i in range(3)]
    with CudaSwapper() as s:
        host = s.pinned((4, 3, 1, 1, 105), np.uint8)
        swap_cache_layout(caches, host, [5, 0], [3, 1], "d2h", swapper=s)
        assert np.array_equal(host[3, 2, 0, 0], cp.asnumpy(caches[2][5, 0, 0]))
        host[...] = 0
        swap_cache_layout(caches, host, [5, 0], [3, 1], "d2h")  # a transient swapper
        assert np.array_equal(host[1, 1, 0, 0], cp.asnumpy(caches[1][0, 0, 0]))


def test_auto_keeps_strided_dma_for_big_calls_only():
    """No GPU needed: the choice reads the plan. A whole request's layers in one run take strided
    DMA; a backend piece of 4 blocks (64 DMA calls of 512 KiB each) must not."""
    from kvstate.kernels._cuda import choose_strategy
    from kvstate.kernels._plan import LayerSet, plan_layout

    class Arr:  # shape/dtype only: planning never touches memory
        def __init__(self, shape):
            self.shape, self.dtype = shape, np.dtype("uint16")

    chunk = (8, 64, 128)  # 128 KiB of bfloat16
    layers = LayerSet.of([Arr((512,) + chunk) for _ in range(32)])

    def plan(n, gids=None):
        return plan_layout(layers, Arr((n, 32) + chunk), np.arange(n) if gids is None else gids,
                           np.arange(n), "d2h")

    assert choose_strategy(plan(256)) == "dma"  # 32 calls of 32 MiB
    assert choose_strategy(plan(4)) == "zero_copy"  # 16 MiB: 32 DMA calls of 512 KiB, or one launch
    assert choose_strategy(plan(64, np.arange(64) * 2)) == "staged"  # 256 MiB, 2,048 runs x layers
    assert choose_strategy(plan(1)) == "zero_copy"


@gpu
@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_a_cache_list_bound_on_use_is_not_kept_alive(sw, lib):
    """Lists passed to an op are remembered weakly: once the engine drops them, their memory
    goes; a new list that happens to reuse their ids is bound afresh and moves its own bytes."""
    import weakref

    import cupy as cp
    if lib == "torch":
        torch = pytest.importorskip("torch", reason="needs PyTorch")
    rng = np.random.default_rng(3)
    host = sw.pinned((4, 2, 2, 4, 8), np.float16)
    for rep in range(3):
        data = rng.standard_normal((2, 16, 2, 4, 8)).astype(np.float16)
        caches = [cp.asarray(d) for d in data] if lib == "cupy" else [torch.as_tensor(d).cuda() for d in data]
        sw.swap_cache_layout(caches, host, [5, 1, 9, 3], [0, 1, 2, 3], "d2h")
        assert np.array_equal(host, data[:, [5, 1, 9, 3]].swapaxes(0, 1)), rep  # its own bytes, not a stale list's
        refs = [weakref.ref(c) for c in caches]
        del caches
        gc.collect()
        assert all(r() is None for r in refs), "the swapper kept a dropped cache alive"
