"""Back-to-back async CUDA transfers keep the order they were enqueued in.

Staged calls on the swapper's own stream skip the cross-stream waits they do not need (see
:mod:`kvstate.kernels._cuda_strategy`); these tests enqueue calls that read what the one before
wrote, with no host wait between them, and hold the end state to the numpy reference applied
call by call. The swapper's stream is first held ~20 ms by a spinning kernel, so the calls
queue up and then run at the GPU's pace (not the host's): a missing wait shows as wrong bytes.

Marked ``gpu``: skipped with a reason where CuPy or a CUDA device is missing.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from needs import gpu as needs_gpu

from kvstate.kernels import _reference as reference

gpu = needs_gpu()
pytestmark = pytest.mark.gpu

LAYERS, N_GPU, N_HOST, CHUNK = 8, 512, 512, (1, 16, 128)  # 4 KiB chunks, 32 KiB a block
STRATS = ["zero_copy", "staged", "dma"]


@pytest.fixture(scope="module")
def rig():
    """A swapper with little staging (4 slots of 1 MiB: a call is many pieces and reuses slots
    across calls), its caches and its host buffer."""
    import cupy as cp

    from kvstate.kernels._cuda import CudaSwapper

    with CudaSwapper(staging_bytes=4 << 20) as sw:
        caches = [cp.zeros((N_GPU,) + CHUNK, cp.uint16) for _ in range(LAYERS)]
        host = sw.pinned((N_HOST, LAYERS) + CHUNK, np.uint16)
        yield sw, caches, host


_SPIN = r'''extern "C" __global__ void spin(long long t) {
    long long s = clock64(); while (clock64() - s < t) {} }'''


def _hold(stream, cycles=40_000_000):
    """Keep ``stream`` busy for ``cycles`` GPU clocks (~20 ms)."""
    import cupy as cp

    cp.RawKernel(_SPIN, "spin")((1,), (1,), (np.int64(cycles),), stream=stream)


def _fill(rig, seed):
    """Random caches and host buffer; their numpy copies."""
    import cupy as cp

    sw, caches, host = rig
    rng = np.random.default_rng(seed)
    want_c = [rng.integers(0, 2**16, (N_GPU,) + CHUNK, dtype=np.uint16) for _ in range(LAYERS)]
    for g, w in zip(caches, want_c):
        g[...] = cp.asarray(w)
    host[...] = rng.integers(0, 2**16, host.shape, dtype=np.uint16)
    cp.cuda.Device().synchronize()
    return want_c, host.copy()


def _check(rig, want_c, want_h):
    import cupy as cp

    sw, caches, host = rig
    assert np.array_equal(host, want_h)
    for i, (g, w) in enumerate(zip(caches, want_c)):
        assert np.array_equal(cp.asnumpy(g), w), f"layer {i}"


@st.composite
def calls(draw):
    """4-8 calls of random blocks (from a drawn seed); each takes the blocks the one before it
    wrote as its sources half the time."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    out, last = [], None
    for _ in range(draw(st.integers(4, 8))):
        n = draw(st.integers(1, 256))
        direction = draw(st.sampled_from(["d2h", "h2d"]))
        gids, hids = rng.permutation(N_GPU)[:n].tolist(), rng.permutation(N_HOST)[:n].tolist()
        if last is not None and draw(st.booleans()):  # read back what the last call wrote
            lg, lh, ld = last
            k = min(n, len(lg))
            if ld == "d2h" and direction == "h2d":
                hids = lh[:k] + [h for h in hids if h not in lh[:k]][:n - k]
            elif ld == "h2d" and direction == "d2h":
                gids = lg[:k] + [g for g in gids if g not in lg[:k]][:n - k]
        out.append((direction, draw(st.sampled_from(STRATS)), gids, hids))
        last = (gids, hids, direction)
    return out


@gpu
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq=calls(), seed=st.integers(0, 2**31))
def test_back_to_back_calls_on_the_own_stream_end_as_the_reference(rig, seq, seed):
    sw, caches, host = rig
    want_c, want_h = _fill(rig, seed)
    ev = None
    _hold(sw.stream)
    for direction, strategy, gids, hids in seq:
        reference.swap_cache_layout(want_c, want_h, gids, hids, direction)
        ev = sw.swap_cache_layout_async(caches, host, gids, hids, direction, strategy=strategy)
    sw.wait(ev)  # the last call's event covers every call before it on the stream
    _check(rig, want_c, want_h)


@gpu
@pytest.mark.parametrize("first,second", [("staged", "zero_copy"), ("staged", "dma"), ("staged", "staged"),
                                          ("zero_copy", "staged"), ("dma", "staged")])
def test_a_call_reads_the_host_blocks_the_call_before_wrote(rig, first, second):
    """A d2h of 256 blocks (8 MiB), then an h2d of the host blocks its last piece wrote."""
    sw, caches, host = rig
    want_c, want_h = _fill(rig, 1)
    src, slots = list(range(0, 512, 2)), list(range(256))
    dst, last = list(range(1, 65, 2)), slots[-32:]
    reference.swap_cache_layout(want_c, want_h, src, slots, "d2h")
    reference.swap_cache_layout(want_c, want_h, dst, last, "h2d")
    _hold(sw.stream)
    sw.swap_cache_layout_async(caches, host, src, slots, "d2h", strategy=first)
    sw.wait(sw.swap_cache_layout_async(caches, host, dst, last, "h2d", strategy=second))
    _check(rig, want_c, want_h)


@gpu
@pytest.mark.parametrize("first", ["zero_copy", "staged"])
def test_a_gather_sees_the_blocks_the_scatter_before_wrote(rig, first):
    """h2d then d2h of the same GPU blocks into other host blocks, the second at once."""
    sw, caches, host = rig
    want_c, want_h = _fill(rig, 2)
    blocks = list(range(100, 356))
    reference.swap_cache_layout(want_c, want_h, blocks, list(range(256)), "h2d")
    reference.swap_cache_layout(want_c, want_h, blocks, list(range(256, 512)), "d2h")
    _hold(sw.stream)
    sw.swap_cache_layout_async(caches, host, blocks, list(range(256)), "h2d", strategy=first)
    sw.swap_cache_layout(caches, host, blocks, list(range(256, 512)), "d2h", strategy="staged")
    _check(rig, want_c, want_h)


@gpu
def test_a_staged_read_after_wait_on_device_sees_host_memory_written_before_the_event(rig):
    """Another stream writes the host buffer late (after ~40 ms of GPU sleep) and records an
    event; the own stream waits for it on the device, then a staged h2d reads that memory."""
    import cupy as cp

    sw, caches, host = rig
    want_c, want_h = _fill(rig, 3)
    slots, blocks = list(range(64)), list(range(200, 264))
    sw.swap_cache_layout(caches, host, blocks, slots, "h2d", strategy="staged")  # the copy stream is caught up
    fresh = np.random.default_rng(4).integers(0, 2**16, (64, LAYERS) + CHUNK, dtype=np.uint16)
    want_h[:64] = fresh
    reference.swap_cache_layout(want_c, want_h, blocks, slots, "h2d")
    side = cp.cuda.Stream(non_blocking=True)
    src = cp.asarray(fresh)
    _hold(side, 80_000_000)
    with side:
        cp.cuda.runtime.memcpyAsync(host.ctypes.data, src.data.ptr, fresh.nbytes, 2, side.ptr)
        done = cp.cuda.Event()
        done.record(side)
    sw.wait_on_device(done)
    sw.swap_cache_layout(caches, host, blocks, slots, "h2d", strategy="staged")
    side.synchronize()
    _check(rig, want_c, want_h)


@gpu
def test_staged_calls_on_two_streams_share_the_staging_slots_safely(rig):
    """A staged h2d on the own stream, its kernels held back, then one on another stream: the
    second's DMAs must not refill a slot before the first's kernel has read it."""
    import cupy as cp

    sw, caches, host = rig
    want_c, want_h = _fill(rig, 5)
    a_host, a_gpu, b_host, b_gpu = list(range(128)), list(range(128)), list(range(256, 384)), list(range(256, 384))
    reference.swap_cache_layout(want_c, want_h, a_gpu, a_host, "h2d")
    reference.swap_cache_layout(want_c, want_h, b_gpu, b_host, "h2d")
    sw.swap_cache_layout(caches, host, [0], [0], "h2d", strategy="staged")  # the copy stream is caught up
    _hold(sw.stream)  # the first call's kernels wait; its DMAs (4 slots of 32 blocks) do not
    sw.swap_cache_layout_async(caches, host, a_gpu, a_host, "h2d", strategy="staged")
    other = cp.cuda.Stream(non_blocking=True)
    sw.wait(sw.swap_cache_layout_async(caches, host, b_gpu, b_host, "h2d", stream=other, strategy="staged"))
    sw.wait(sw.stream)
    _check(rig, want_c, want_h)


@gpu
def test_a_host_buffer_checked_once_is_checked_again_when_its_shape_changes():
    """A swapper remembers the checks of a binding and host buffer used together, weakly and
    by their shape: a buffer reshaped in place is refused (nothing moved), a dropped one is
    not kept alive."""
    import gc
    import warnings
    import weakref

    import cupy as cp

    from kvstate import ValidationError
    from kvstate.kernels._cuda import CudaSwapper

    with CudaSwapper() as sw:
        caches = [cp.full((8, 1, 2, 8), 7, cp.uint8) for _ in range(2)]
        host = sw.pinned((4, 2, 1, 2, 8), np.uint8)
        host[:] = 0  # page-locked memory comes uninitialised
        sw.swap_cache_layout(caches, host, [5, 1], [0, 3], "d2h")
        assert (host[[0, 3]] == 7).all() and not host[[1, 2]].any()
        host[:] = 0
        with warnings.catch_warnings():  # setting a shape is deprecated in numpy 2.5, still possible
            warnings.simplefilter("ignore", DeprecationWarning)
            host.shape = (2, 4, 1, 2, 8)  # the same memory, now a wrong layout for these caches
        with pytest.raises(ValidationError, match="host must be"):
            sw.swap_cache_layout(caches, host, [5, 1], [0, 1], "d2h")
        assert not host.any()
        view = host.reshape(4, 2, 1, 2, 8)
        sw.swap_cache_layout(caches, view, [2], [1], "d2h")
        gone = weakref.ref(view)
        del view
        gc.collect()
        assert gone() is None and (host.reshape(4, 2, 1, 2, 8)[1] == 7).all()


@gpu
def test_short_calls_back_to_back_read_what_the_one_before_wrote():
    """Pairs of short zero-copy calls with no hold and no host wait: an h2d into random GPU
    blocks, then a d2h of those blocks into other host blocks; then another library's kernel
    writes a layer on the swapper's stream just before a d2h reads it."""
    import cupy as cp

    from kvstate.kernels._cuda import CudaSwapper

    rng = np.random.default_rng(6)
    pairs, n = 24, 16
    with CudaSwapper() as sw:
        caches = [cp.zeros((N_GPU,) + CHUNK, cp.uint16) for _ in range(LAYERS)]
        src = sw.pinned((pairs * n, LAYERS) + CHUNK, np.uint16)
        src[...] = rng.integers(0, 2**16, src.shape, dtype=np.uint16)
        out = sw.pinned((pairs * n, LAYERS) + CHUNK, np.uint16)
        out[...] = 0
        for k in range(pairs):
            blocks, slots = rng.choice(N_GPU, n, replace=False).tolist(), list(range(k * n, (k + 1) * n))
            sw.swap_cache_layout_async(caches, src, blocks, slots, "h2d", strategy="zero_copy")
            sw.swap_cache_layout_async(caches, out, blocks, slots, "d2h", strategy="zero_copy")
        sw.wait(sw.stream)
        assert np.array_equal(out, src)
        with sw.stream:
            caches[0].fill(7)  # CuPy's own kernel, on the swapper's stream
        sw.swap_cache_layout(caches, out, list(range(n)), list(range(n)), "d2h", strategy="zero_copy")
        assert (out[:n, 0] == 7).all()



@gpu
def test_ids_of_a_call_held_back_outlive_uploads_on_another_stream():
    """Calls of over 128 blocks upload their ids into a ring of four slots. A staged h2d on the
    own stream (ids inline), its kernels held by a spinning kernel, fills the staging slots; a
    staged d2h on a second stream then waits for them before its gathers, its ids uploaded
    already. Four calls on a third, idle stream reuse every ring slot meanwhile: the held
    call must still gather the blocks it was given."""
    import cupy as cp

    from kvstate.kernels._cuda import CudaSwapper

    with CudaSwapper(staging_bytes=4 << 20, inline_ids=128) as sw:
        rig = (sw, [cp.zeros((N_GPU,) + CHUNK, cp.uint16) for _ in range(LAYERS)],
               sw.pinned((N_HOST, LAYERS) + CHUNK, np.uint16))
        want_c, want_h = _fill(rig, 7)
        caches, host = rig[1], rig[2]
        sw.swap_cache_layout(caches, host, [0], [0], "h2d", strategy="staged")  # the copy stream is caught up
        held = [(list(range(128)), "h2d", None), (list(range(128, 288)), "d2h", cp.cuda.Stream(non_blocking=True))]
        idle, rest = cp.cuda.Stream(non_blocking=True), list(range(288, 512))
        _hold(sw.stream, 200_000_000)  # ~100 ms
        ends = []
        for blocks, direction, stream in held:
            reference.swap_cache_layout(want_c, want_h, blocks, blocks, direction)
            ends.append(sw.swap_cache_layout_async(caches, host, blocks, blocks, direction, stream=stream,
                                                   strategy="staged"))
        reference.swap_cache_layout(want_c, want_h, rest, rest, "d2h")
        for _ in range(4):
            sw.wait(sw.swap_cache_layout_async(caches, host, rest, rest, "d2h", stream=idle, strategy="zero_copy"))
        for ev in ends:
            sw.wait(ev)
        sw.wait(sw.stream)
        _check(rig, want_c, want_h)
