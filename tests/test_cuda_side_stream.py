"""The CUDA backend takes its checksums and moves its state pages on streams of its own
(kvstate.backends._cuda_sums, cuda_states).

An engine often computes on CUDA's legacy default stream. Work queued there must not hold up a
transfer: a verified write, read, swap out and swap in, and a state stored and loaded, each
return while a long kernel still runs on that stream, and move the right bytes. Work on the
legacy stream would queue behind the kernel, and each call would return only once it ended.

Marked ``gpu``: skipped with a reason where CuPy or a CUDA device is missing.
"""
import numpy as np
import pytest
from needs import gpu as needs_gpu

pytestmark = [pytest.mark.gpu, needs_gpu()]

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"""


def legacy_stream_busy(seconds: float):
    """Queue a kernel spinning ``seconds`` on the legacy default stream; the event after it."""
    import cupy as cp

    cp.cuda.Device().synchronize()
    rate = cp.cuda.Device().attributes["ClockRate"] * 1000  # cycles a second
    busy = cp.cuda.Event(block=False, disable_timing=True)
    with cp.cuda.Stream.null:
        cp.RawKernel(SPIN, "spin")((1,), (1,), (np.int64(seconds * rate),))
        busy.record()
    return busy


def test_verified_transfers_do_not_wait_for_the_legacy_default_stream():
    import cupy as cp

    from kvstate import CacheSpec
    from kvstate.backends import MemoryStore
    from kvstate.backends._cuda import CudaBackend

    spec = CacheSpec(num_layers=4, kv_heads=2, block_size=16, head_dim=64, dtype="bfloat16", tp_size=2)
    p = CudaBackend(spec, 16, MemoryStore(1 << 26), host_blocks=8)
    d = CudaBackend(spec, 16, p.store, host_blocks=8)
    rng = np.random.default_rng(7)
    try:
        assert p.verify and d.verify
        for r in range(2):
            for kind in spec.kinds:
                for blk in range(16):
                    p.fill_block(r, kind, blk, rng.integers(0, 255, spec.block_bytes(kind), dtype=np.uint8).tobytes())
        warm = [f"w{i}" for i in range(4)]  # pools, pointer tables and the kernel ready before the spin
        for r in range(2):
            assert p.write(r, warm, [0, 1, 2, 3]) == 4 and d.read(r, warm, [0, 1, 2, 3]) == 4
            assert p.swap_out(r, [0], [0]) == 1 and p.swap_in(r, [0], [15]) == 1
        keys = [f"k{i}" for i in range(6)]
        busy = legacy_stream_busy(5.0)
        for r in range(2):
            assert p.write(r, keys, [4, 5, 6, 7, 8, 9]) == 6
            assert d.read(r, keys, [10, 11, 12, 13, 14, 15]) == 6
            assert p.swap_out(r, [4, 5], [1, 2]) == 2 and p.swap_in(r, [1, 2], [0, 1]) == 2
        assert not busy.done, "a verified transfer waited for the legacy default stream"
    finally:
        cp.cuda.Device().synchronize()
    try:
        for r in range(2):
            for kind in spec.kinds:
                for src, dst in zip(range(4, 10), range(10, 16)):
                    assert d.block_bytes(r, kind, dst) == p.block_bytes(r, kind, src)
                assert [p.block_bytes(r, kind, b) for b in (0, 1)] == [p.block_bytes(r, kind, b) for b in (4, 5)]
    finally:
        p.close()
        d.close()


def test_state_pages_move_without_waiting_for_the_legacy_default_stream():
    import cupy as cp
    from state_helpers import hybrid

    from kvstate.backends import MemoryStore
    from kvstate.backends._cuda import CudaBackend

    p = CudaBackend(hybrid(), 8, MemoryStore(1 << 22), num_states=4, staging_bytes=1 << 20)
    d = CudaBackend(hybrid(), 8, p.store, num_states=4, staging_bytes=1 << 20)
    rng = np.random.default_rng(3)
    try:
        want = {r: [rng.integers(0, 256, p.state_size, dtype=np.uint8).tobytes() for _ in range(2)] for r in range(2)}
        for r in range(2):
            for page in range(2):
                p.fill_state(r, page, want[r][page])
            assert p.write_states(r, ["w"], [0]) == 1 and d.read_state(r, "w", 3)  # warm: pools, streams
        busy = legacy_stream_busy(5.0)
        for r in range(2):
            assert p.write_states(r, ["a", "b"], [0, 1]) == 2
            assert d.read_state(r, "b", 0) and d.read_state(r, "a", 1)
        assert not busy.done, "a state copy waited for the legacy default stream"
    finally:
        cp.cuda.Device().synchronize()
    try:
        for r in range(2):
            assert [d.state_bytes(r, page) for page in (1, 0)] == want[r]
    finally:
        p.close()
        d.close()
