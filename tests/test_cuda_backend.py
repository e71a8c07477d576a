"""The CUDA backend on the GPU: the demo end to end, and a handoff over an engine's PyTorch
caches (pipelined pieces, a short read, the fence).

Marked ``gpu``: skipped with a reason where CuPy or a CUDA device is missing, run for real on
the GPU machine (docs/benchmarks.md records the run).
"""
import threading

import pytest
from needs import gpu as needs_gpu
from needs import gpu_missing, has_module

GPU = gpu_missing() is None
gpu = needs_gpu()
pytestmark = pytest.mark.gpu


@gpu
def test_demo_end_to_end_on_the_gpu():
    from kvstate.app._demo import DemoConfig, run_demo

    s = run_demo(DemoConfig(requests=48, backend="cuda"))
    assert s["integrity_ok"] and s["leaked_blocks"] == 0 and s["blocks_checked"] > 0
    assert s["preemptions"] > 0 and s["aborted"] > 0


@gpu
@pytest.mark.skipif(not has_module("torch"), reason="needs PyTorch")
def test_backend_over_engine_torch_caches_pipelined_and_short_read():
    import torch

    from kvstate import CacheSpec, FenceError
    from kvstate.backends import MemoryStore
    from kvstate.backends._cuda import CudaBackend

    spec = CacheSpec(num_layers=3, kv_heads=2, block_size=16, head_dim=64, dtype="bfloat16", tp_size=2)
    n = 32

    def torch_caches():
        return [{k: [torch.randint(-999, 999, (n,) + spec.block_shape(k), dtype=torch.int16, device="cuda")
                     .view(torch.bfloat16) for _ in range(spec.layers)] for k in spec.kinds}
                for _ in range(spec.tp_size)]

    store = MemoryStore(1 << 28)
    small = 3 * spec.bytes_per_block_per_rank * 2  # three blocks a slot: a 20-block write is 7 pieces
    p = CudaBackend(spec, n, store, caches=torch_caches(), staging_bytes=small)
    d = CudaBackend(spec, n, store, caches=torch_caches(), staging_bytes=small)
    try:
        keys = [f"k{i}" for i in range(20)]
        src, dst = list(range(5, 25)), list(range(31, 11, -1))
        for r in range(2):
            assert p.write(r, keys, src) == 20
        assert p.query(0, keys) == 20
        for r in range(2):
            assert d.read(r, keys, dst) == 20
        for r in range(2):
            for kind in spec.kinds:
                for s_id, d_id in zip(src, dst):
                    assert p.block_bytes(r, kind, s_id) == d.block_bytes(r, kind, d_id)
        store.evict(["k7_value_0"])  # block 7 lost on rank 0: the read stops there
        assert d.read(0, keys, list(range(20))) == 7
        assert d.block_bytes(0, "key", 6) == p.block_bytes(0, "key", src[6])
        assert d.read(1, keys, list(range(20))) == 20
        # past the command's fence nothing is gathered or scattered
        before = [d.block_bytes(0, "key", b) for b in range(n)]
        with pytest.raises(FenceError):
            d.read(0, keys, dst, guard=lambda: False)
        assert [d.block_bytes(0, "key", b) for b in range(n)] == before
        with pytest.raises(FenceError):
            p.write(0, [f"x{i}" for i in range(20)], src, guard=lambda: False)
        assert p.query(0, ["x0"]) == 0
        # a guard that turns mid-way stops the pipelined write at a piece boundary
        calls = iter([True, True])
        with pytest.raises(FenceError):
            p.write(1, [f"y{i}" for i in range(20)], src, guard=lambda: next(calls, False))
        assert p.query(1, [f"y{i}" for i in range(20)]) < 20
        assert p.pinned_bytes <= 2 * small * spec.tp_size
    finally:
        p.close()
        d.close()


@gpu
def test_host_tier_swaps_bytes_between_gpu_blocks_and_pinned_slots():
    from kvstate import CacheSpec, ValidationError
    from kvstate.backends import MemoryStore
    from kvstate.backends._cuda import CudaBackend

    spec = CacheSpec(num_layers=3, kv_heads=2, block_size=16, head_dim=64, dtype="bfloat16", tp_size=2)
    b = CudaBackend(spec, 16, MemoryStore(1 << 24), host_blocks=8)
    try:
        rng = __import__("numpy").random.default_rng(0)
        for r in range(2):
            for kind in spec.kinds:
                for blk in range(16):
                    b.fill_block(r, kind, blk, rng.integers(0, 255, spec.block_bytes(kind), dtype="uint8").tobytes())
        orig = {(r, k, blk): b.block_bytes(r, k, blk) for r in range(2) for k in spec.kinds for blk in range(16)}
        for r in range(2):
            assert b.swap_out(r, [3, 9, 14], [7, 0, 4]) == 3
            assert b.host_slot_bytes(r, "key", 0) == orig[(r, "key", 9)]
            for kind in spec.kinds:  # the GPU blocks are reused for something else
                for blk in (3, 9, 14):
                    b.fill_block(r, kind, blk, bytes(spec.block_bytes(kind)))
            assert b.swap_in(r, [7, 0, 4], [1, 2, 3]) == 3
            for kind in spec.kinds:
                assert [b.block_bytes(r, kind, x) for x in (1, 2, 3)] == [orig[(r, kind, x)] for x in (3, 9, 14)]
        before = b.host_slot_bytes(0, "value", 7)
        with pytest.raises(ValidationError):
            b.swap_out(0, [1, 2], [7, 8])  # slot 8 is past the arena: nothing moves
        assert b.host_slot_bytes(0, "value", 7) == before
        assert b.pinned_bytes >= 8 * spec.bytes_per_block_per_rank * 2
    finally:
        b.close()


@gpu
@pytest.mark.parametrize("swap_write", ["host", "through", "back"])
def test_a_preempted_request_swaps_through_the_cuda_host_tier_and_back(swap_write):
    from kvstate import CacheSpec, DecodeLifecycle, Policy
    from kvstate._keys import block_keys
    from kvstate.backends import MemoryStore, StepDriver
    from kvstate.backends._cuda import CudaBackend
    from kvstate.testing import fill_blocks, mismatched_blocks

    spec = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=32, dtype="bfloat16", tp_size=2)
    lc = DecodeLifecycle(spec, 24, Policy(preempt="swap", read_failure="recompute", swap_write=swap_write),
                         host_blocks=12)
    b = CudaBackend(spec, 24, MemoryStore(1 << 24), host_blocks=12)
    drv = StepDriver(lc, b)
    try:
        toks = list(range(30))
        lc.reserve("r", toks)
        lc.deliver_first_token("r", 5)
        drv.run_until_idle()  # nothing stored: the read misses and the cache is recomputed
        lc.recompute_done("r")
        full = toks + [5]
        blocks = lc.blocks_of("r")
        fill_blocks(b, block_keys(full[:-1], 4), blocks)
        lc.preempt("r")
        drv.run_until_idle()
        assert lc.state_of("r") == "swapped" and lc.pool.num_used == 0
        stored = b.query(0, block_keys(full[:-1], 4)) == b.query(1, block_keys(full[:-1], 4)) == 8
        assert stored == (swap_write != "host")  # written through, or back from the pinned slots
        for blk in blocks:  # the freed blocks are overwritten by other requests
            for r in range(2):
                for kind in spec.kinds:
                    b.fill_block(r, kind, blk, bytes(spec.block_bytes(kind)))
        new = lc.resume("r")
        drv.run_until_idle()
        assert lc.state_of("r") == "running"
        assert not mismatched_blocks(b, block_keys(full[:-1], 4), new)
        lc.finish("r")
        assert lc.host.stats().referenced == 0 and lc.pool.num_used == 0
    finally:
        b.close()


@gpu
def test_a_layerwise_save_through_the_cuda_backend_stores_each_group_once_computed():
    """Layer groups in one-object-per-group format: a gate short of the last group stores only
    the first (no block whole); with every layer reported the bytes read back equal P's."""
    from kvstate import CacheSpec
    from kvstate._keys import block_keys
    from kvstate.backends import MemoryStore
    from kvstate.backends._cuda import CudaBackend
    from kvstate.testing import fill_blocks, mismatched_blocks

    spec = CacheSpec(num_layers=4, kv_heads=2, block_size=4, head_dim=32, dtype="bfloat16", tp_size=1,
                     layer_groups=2)
    store = MemoryStore(1 << 24)
    keys, blocks = block_keys(list(range(26)), 4), [9, 3, 0, 7, 5, 1, 11]
    # a staging slot of 2 blocks: group writes of 7 blocks run in several pieces
    p = CudaBackend(spec, 12, store, staging_bytes=4 * spec.bytes_per_block_per_rank)
    d = CudaBackend(spec, 12, store)
    try:
        fill_blocks(p, keys, blocks)
        asked = []
        assert p.write(0, keys, blocks, layers=lambda n, block=True: asked.append(n) or n <= 2) == 0
        assert asked == [2, 4] and len(store) == len(keys) * (len(spec.kinds) + 1)  # group 0 only, and manifests
        assert all(name.endswith("_g0") for name in store)
        got: list[int] = []  # from a thread with no current device, as a driver's worker
        every = lambda n, block=True: True  # noqa: E731
        worker = threading.Thread(target=lambda: got.append(p.write(0, keys, blocks, layers=every)))
        worker.start()
        worker.join(60)
        assert got == [len(keys)]
        assert d.read(0, keys, list(range(len(keys)))) == len(keys)
        assert not mismatched_blocks(d, keys, list(range(len(keys))))
        for staging in (4, 64):  # pieces per group, or a whole group per slot (pipelined)
            e = CudaBackend(spec, 12, store, staging_bytes=staging * spec.bytes_per_block_per_rank)
            try:
                reports: list = []
                assert e.read(0, keys, blocks, arrived=lambda n, ev, add=reports.append: add((n, ev))) == len(keys)
                assert [n for n, _ in reports] == [2, 4]
                for _, ev in reports:
                    if ev is not None:
                        ev.synchronize()
                assert not mismatched_blocks(e, keys, blocks)
                store.evict([f"{keys[3]}_value_0_g0"])  # block 3's first group is gone
                reports.clear()
                assert e.read(0, keys, list(range(len(keys))), arrived=lambda n, ev, add=reports.append: add(n)) == 3
                assert reports == [] and not mismatched_blocks(e, keys[:3], [0, 1, 2])
                assert p.write(0, keys[3:4], blocks[3:4]) == 1  # put it back
            finally:
                e.close()
    finally:
        p.close()
        d.close()


@gpu
@pytest.mark.skipif(not has_module("torch"), reason="needs PyTorch")
def test_a_save_reported_at_launch_waits_for_its_layers_on_the_device():
    """Layers reported with a device event as soon as they are launched: every group's gather
    waits for its event on the device, so the save stores what the (slow) layers wrote, not
    what the cache held before; piece by piece, or pipelined (group g + 1 gathered while g is
    stored). A pipelined save whose gate stops short stores the first group only."""
    import torch

    from kvstate import CacheSpec
    from kvstate._keys import block_keys
    from kvstate.backends import MemoryStore
    from kvstate.backends._cuda import CudaBackend

    spec = CacheSpec(num_layers=4, kv_heads=2, block_size=4, head_dim=32, dtype="bfloat16", layer_groups=2)
    keys, blocks = block_keys(list(range(26)), 4), [9, 3, 0, 7, 5, 1, 11]

    def caches():
        return [{k: [torch.zeros((12,) + spec.block_shape(k), dtype=torch.bfloat16, device="cuda")
                     for _ in range(spec.layers)] for k in spec.kinds}]

    p_caches, d_caches, store = caches(), caches(), MemoryStore(1 << 24)
    for staging in (4, 64):  # a group in pieces of 2 blocks, or a whole group per slot
        p = CudaBackend(spec, 12, store, caches=p_caches, staging_bytes=staging * spec.bytes_per_block_per_rank)
        d = CudaBackend(spec, 12, store, caches=d_caches)
        side, events = torch.cuda.Stream(), []
        try:
            with torch.cuda.stream(side):
                for layer in range(spec.layers):  # each layer ~20 ms late on the device
                    torch.cuda._sleep(40_000_000)
                    for kind in spec.kinds:
                        p_caches[0][kind][layer].fill_(staging + layer)
                    events.append(torch.cuda.Event())
                    events[-1].record(side)
            assert p.write(0, keys, blocks, layers=lambda n, block=True, ev=events: ev[n - 1]) == len(keys)
            assert d.read(0, keys, list(range(len(keys)))) == len(keys)
            for kind in spec.kinds:
                for layer in range(spec.layers):
                    assert bool((d_caches[0][kind][layer][:len(keys)] == staging + layer).all()), (staging, layer)
        finally:
            p.close()
            d.close()
    short = MemoryStore(1 << 24)
    p = CudaBackend(spec, 12, short, caches=p_caches)
    try:
        asked: list = []
        assert p.write(0, keys, blocks, layers=lambda n, block=True: asked.append((n, block)) or n <= 2) == 0
        assert asked[0] == (2, True) and (4, True) in asked
        assert len(short) == len(keys) * (len(spec.kinds) + 1) and all(name.endswith("_g0") for name in short)
    finally:
        p.close()


@gpu
def test_checksums_taken_on_the_gpu_catch_corruption_and_cross_with_the_host():
    """The CUDA backend's SUM64 (taken on the GPU) vouch for its objects: a corrupt one is a
    failed read on the GPU and on the host alike, and is evicted; what the reference backend
    writes (XXH3), the CUDA backend verifies; with layer groups too."""
    from kvstate import CacheSpec
    from kvstate.backends import MemoryStore, ReferenceBackend
    from kvstate.backends._cuda import CudaBackend
    from kvstate.testing import fill_blocks, mismatched_blocks

    for groups in (1, 2):
        spec = CacheSpec(num_layers=4, kv_heads=2, block_size=16, head_dim=64, dtype="bfloat16", tp_size=1,
                         layer_groups=groups)
        store = MemoryStore(1 << 28)
        small = 3 * spec.bytes_per_block_per_rank * 2  # three blocks a slot: pieces
        p, d = CudaBackend(spec, 32, store, staging_bytes=small), CudaBackend(spec, 32, store, staging_bytes=small)
        host = ReferenceBackend(spec, 32, store)
        try:
            keys = [f"g{groups}-k{i}" for i in range(10)]
            fill_blocks(p, keys, list(range(10)))
            assert p.write(0, keys, list(range(10))) == 10
            assert d.read(0, keys, list(range(20, 30))) == 10 and d.broken_blocks == 0
            assert not mismatched_blocks(d, keys, list(range(20, 30)))
            assert host.read(0, keys, list(range(10))) == 10 and not mismatched_blocks(host, keys, list(range(10)))
            name = f"{keys[4]}_value_0" + ("" if groups == 1 else "_g1")
            buf = bytearray(spec.bytes_per_block_per_rank)
            n = store.batch_get_into([name], [buf])[0]
            buf[n // 2] ^= 0x40  # one bit of block 4 goes bad in the pool
            store.evict([name])
            store.batch_put_from([name], [buf[:n]])
            assert d.read(0, keys, list(range(20, 30))) == 4 and d.broken_blocks == 1  # caught on the GPU
            assert p.query(0, keys) == 4  # evicted: the next write stores it again
            assert p.write(0, keys, list(range(10))) == 10 and host.read(0, keys, list(range(10))) == 10
            other = [f"host-{k}" for k in keys]
            fill_blocks(host, other, list(range(10)))
            assert host.write(0, other, list(range(10))) == 10  # XXH3 manifests
            assert d.read(0, other, list(range(20, 30))) == 10 and not mismatched_blocks(d, other, list(range(20, 30)))
        finally:
            p.close()
            d.close()


@gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_interleaved_window_groups_move_as_the_reference_backend_moves_them(tp):
    """Gemma 3's pattern (full at layers 5 and 11 of 12) stored group by group: P's CUDA write,
    the reference backend's read of it, D's CUDA read of the window groups from their last
    window on, and a write-back from P's host tier all agree byte for byte."""
    import numpy as np

    from kvstate import CacheSpec
    from kvstate._layers import LayerGroup
    from kvstate.backends import MemoryStore, ReferenceBackend
    from kvstate.backends._cuda import CudaBackend
    from kvstate.testing import fill_blocks

    full = (5, 11)
    spec = CacheSpec(num_layers=12, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=tp,
                     total_kv_heads=2 * tp, groups=(LayerGroup("window", tuple(i for i in range(12) if i not in full),
                                                               window=8), LayerGroup("full", full)))
    store, keys = MemoryStore(1 << 24), [f"w{i}" for i in range(6)]
    p, d = CudaBackend(spec, 16, store, host_blocks=4), CudaBackend(spec, 16, store)
    ref = ReferenceBackend(spec, 16, store)
    try:
        fill_blocks(p, keys, list(range(6)))
        for r in range(tp):
            assert p.write(r, keys, list(range(6))) == 6
            assert ref.read(r, keys, list(range(6))) == 6  # one stored layout for both backends
            assert all(ref.block_bytes(r, k, i) == p.block_bytes(r, k, i) for k in spec.kinds for i in range(6))
            assert d.read(r, keys, list(range(10, 16)), window_from=4) == 6  # 24 tokens: the window is blocks 4, 5
            for kind in spec.kinds:
                for layer in range(12):
                    got = d.caches(r, kind).views[layer][10:16].get().view(np.uint8)  # bytes: NaN != NaN
                    want = p.caches(r, kind).views[layer][0:6].get().view(np.uint8)
                    first = 0 if layer in full else 4
                    assert np.array_equal(got[first:], want[first:]), (r, kind, layer)
                    assert not got[:first].any()  # the early window blocks were never read
            assert p.swap_out(r, [2], [1]) == 1 and p.flush_host(r, ["from-host"], [1]) == 1
            assert ref.read(r, ["from-host"], [9]) == 1
            assert all(ref.block_bytes(r, k, 9) == p.block_bytes(r, k, 2) for k in spec.kinds)
    finally:
        p.close()
        d.close()


@gpu
def test_a_piecewise_handoff_puts_and_gets_its_manifests_once():
    """A write of several pieces puts its SUM64 manifests in one batch after every object (the
    GPU sums while the host copies); a read gets them in one batch before any object; a
    manifest that did not store leaves its block, and those after it, unstored."""
    from kvstate import CacheSpec
    from kvstate.backends import MemoryStore
    from kvstate.backends._cuda import CudaBackend
    from kvstate.testing import fill_blocks, mismatched_blocks

    class Recording(MemoryStore):
        def __init__(self) -> None:
            super().__init__(1 << 28)
            self.log: list[tuple[str, bool]] = []
            self.refuse: set[str] = set()

        def batch_put_from(self, keys, buffers):
            self.log += [("put", all("_sum_" in k for k in keys))]
            out = super().batch_put_from(keys, buffers)
            return [-1 if k in self.refuse else st for k, st in zip(keys, out)]

        def batch_get_into(self, keys, buffers):
            self.log += [("get", all("_sum_" in k for k in keys))]
            return super().batch_get_into(keys, buffers)

    spec = CacheSpec(num_layers=4, kv_heads=2, block_size=16, head_dim=64, dtype="bfloat16", tp_size=1)
    store = Recording()
    small = 3 * spec.bytes_per_block_per_rank * 2  # three blocks a slot: four pieces for ten blocks
    p, d = CudaBackend(spec, 32, store, staging_bytes=small), CudaBackend(spec, 32, store, staging_bytes=small)
    try:
        keys = [f"m{i}" for i in range(10)]
        fill_blocks(p, keys, list(range(10)))
        assert p.write(0, keys, list(range(10))) == 10
        assert store.log == [("put", False)] * 4 + [("put", True)]
        store.log.clear()
        assert d.read(0, keys, list(range(20, 30))) == 10 and not mismatched_blocks(d, keys, list(range(20, 30)))
        assert store.log == [("get", True)] + [("get", False)] * 4
        store.refuse = {"m6_sum_0"}
        other = [f"n{i}" for i in range(10)]
        assert p.write(0, other[:6] + keys[6:], list(range(10))) == 6
    finally:
        p.close()
        d.close()


@gpu
def test_a_backend_on_the_second_gpu_closes_from_a_thread_whose_device_is_the_first():
    """A backend on device 1 closed from a thread whose current device is 0 used to fail with
    cudaErrorInvalidResourceHandle: its streams and buffers are freed with its own device current."""
    from kvstate import CacheSpec
    from kvstate.backends import MemoryStore
    from kvstate.backends._cuda import CudaBackend
    from kvstate.kernels._cuda import load_cupy

    cp = load_cupy()
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 CUDA devices")
    spec = CacheSpec(num_layers=2, kv_heads=2, block_size=16, head_dim=64, dtype="bfloat16", tp_size=1)
    store = MemoryStore(1 << 24)
    with cp.cuda.Device(0):
        b = CudaBackend(spec, 8, store, device=1)
        assert b.write(0, ["k0", "k1"], [3, 5]) == 2 and b.read(0, ["k0", "k1"], [6, 7]) == 2
        assert cp.cuda.runtime.getDevice() == 0  # the caller's thread is still on its own GPU
    errors: list[BaseException] = []

    def close_on_device_0() -> None:
        try:
            cp.cuda.runtime.setDevice(0)
            b.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=close_on_device_0)
    t.start()
    t.join(60)
    assert not t.is_alive() and not errors, errors


@gpu
def test_a_store_that_takes_registered_memory_gets_the_staging_and_lets_it_go_at_close():
    """A store whose transport reads registered memory (Mooncake) is offered the backend's
    pinned staging and host tier, and asked to let every piece go before the backend frees it."""
    import numpy as np

    from kvstate import CacheSpec
    from kvstate.backends import MemoryStore
    from kvstate.backends._cuda import CudaBackend

    class Registering(MemoryStore):
        def __init__(self) -> None:
            super().__init__(1 << 24)
            self.held: dict[int, int] = {}

        def register_memory(self, buffer) -> bool:
            a = np.asarray(buffer)
            self.held[a.ctypes.data] = a.nbytes
            return True

        def unregister_memory(self, buffer) -> None:
            del self.held[np.asarray(buffer).ctypes.data]

    spec = CacheSpec(num_layers=2, kv_heads=2, block_size=16, head_dim=64, dtype="bfloat16", tp_size=2)
    store = Registering()
    b = CudaBackend(spec, 8, store, host_blocks=4)
    assert len(store.held) == 2 * (2 * 2 + 2)  # per rank: two staging slots and the host tier, per kind
    assert sum(store.held.values()) == b.pinned_bytes
    assert b.write(0, ["k0", "k1"], [3, 5]) == 2 and b.read(0, ["k0", "k1"], [6, 7]) == 2
    b.close()
    assert store.held == {}
