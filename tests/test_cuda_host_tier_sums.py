"""The CUDA backend's host tier checks its slots on the GPU (kvstate.backends._cuda_sums).

A swap-out notes each slot's SUM64, taken from its block on the GPU; a swap-in compares the
SUM64 of what landed; a write-back from host memory checks its slots on the host against the
same sums. Each layout below (one head group, two head groups a rank, window layers stored
group by group) must verify intact slots on both paths and stop at a slot whose host memory
went bad.

Marked ``gpu``: skipped with a reason where CuPy or a CUDA device is missing.
"""
import numpy as np
import pytest
from needs import gpu as needs_gpu

pytestmark = [pytest.mark.gpu, needs_gpu()]


def spec_of(layout: str):
    from kvstate import CacheSpec
    from kvstate._layers import LayerGroup

    kw = dict(num_layers=4, kv_heads=2, block_size=16, head_dim=64, dtype="bfloat16", tp_size=2)
    if layout == "head groups":
        kw.update(store_heads=1, total_kv_heads=4)
    if layout == "window groups":  # interleaved: stored group by group, not in the layers' order
        kw["groups"] = (LayerGroup("window", (0, 2), window=32), LayerGroup("full", (1, 3)))
    return CacheSpec(**kw)


@pytest.fixture(params=["plain", "head groups", "window groups"])
def backend(request):
    from kvstate.backends import MemoryStore
    from kvstate.backends._cuda import CudaBackend

    spec = spec_of(request.param)
    b = CudaBackend(spec, 16, MemoryStore(1 << 26), host_blocks=8)
    rng = np.random.default_rng(0)
    for r in range(2):
        for kind in spec.kinds:
            for blk in range(16):
                b.fill_block(r, kind, blk, rng.integers(0, 255, spec.block_bytes(kind), dtype=np.uint8).tobytes())
    yield b
    b.close()


def test_slots_are_checked_on_the_gpu_and_on_the_host_alike(backend):
    from kvstate._keys import block_keys

    spec = backend.spec
    want = {(r, k, x): backend.block_bytes(r, k, x) for r in range(2) for k in spec.kinds for x in (3, 9, 14)}
    for r in range(2):
        assert backend.swap_out(r, [3, 9, 14], [7, 0, 4]) == 3
        assert backend.swap_in(r, [7, 0, 4], [1, 2, 5]) == 3  # every slot verified on the GPU
        for kind in spec.kinds:
            assert [backend.block_bytes(r, kind, x) for x in (1, 2, 5)] == [want[(r, kind, x)] for x in (3, 9, 14)]
    keys = block_keys(list(range(48)), spec.block_size)
    assert [backend.flush_host(r, keys, [7, 0, 4]) for r in range(2)] == [3, 3]  # and on the host
    assert backend.broken_slots == 0


def test_a_slot_whose_host_memory_went_bad_ends_the_count(backend):
    from kvstate._keys import block_keys

    spec = backend.spec
    assert backend.swap_out(1, [3, 9, 14], [7, 0, 4]) == 3
    arena = backend._arena  # the pinned arena itself: the fault is injected into host memory
    arena(1, spec.kinds[-1])[0].view(np.uint8).reshape(-1)[77] ^= 0x10  # under slot 0
    assert backend.swap_in(1, [7, 0, 4], [1, 2, 5]) == 1  # slot 7 verified, slot 0 not: stop there
    assert backend.broken_slots == 1
    assert backend.swap_in(1, [0], [2]) == 0  # its sums are forgotten: it never counts again
    keys = block_keys(list(range(48)), spec.block_size)
    assert backend.swap_out(0, [3, 9], [7, 0]) == 2
    arena(0, "key")[0].view(np.uint8).reshape(-1)[5] ^= 0x01
    assert backend.flush_host(0, keys[:2], [7, 0]) == 1  # a broken slot is never stored
    assert backend.broken_slots == 2
