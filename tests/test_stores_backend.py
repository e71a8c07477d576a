"""Embedded stores and the reference backend on real bytes."""
import numpy as np
import pytest
from rigs import small_spec

from kvstate import ConfigError, FenceError, StoreError, ValidationError
from kvstate._keys import block_keys
from kvstate.backends import FileStore, MemoryStore, ReferenceBackend
from kvstate.backends._base import TOO_LARGE


@pytest.fixture(params=["memory", "file"])
def store(request, tmp_path):
    return MemoryStore(1 << 20) if request.param == "memory" else FileStore(tmp_path / "pool")


def test_put_get_exist_roundtrip(store):
    a, b = np.arange(16, dtype=np.uint8), np.arange(8, dtype=np.float16)
    assert store.batch_put_from(["a", "b"], [a, b]) == [0, 0]
    assert store.batch_is_exist(["a", "zz", "b"]) == [1, 0, 1]
    out_a, out_b = np.zeros(16, np.uint8), np.zeros(8, np.float16)
    assert store.batch_get_into(["a", "b", "zz"], [out_a, out_b, np.zeros(4, np.uint8)]) == [16, 16, -1]
    assert (out_a == a).all() and (out_b == b).all()
    assert store.batch_get_into(["a"], [np.zeros(4, np.uint8)]) == [TOO_LARGE]  # buffer too small: not read


@pytest.mark.parametrize("call", [
    lambda s: s.batch_put_from(["a"], []),
    lambda s: s.batch_put_from([""], [b"x"]),
    lambda s: s.batch_put_from(["a" * 600], [b"x"]),
    lambda s: s.batch_put_from("ab", [b"x", b"y"]),
    lambda s: s.batch_get_into(["a"], [object()]),
    lambda s: s.batch_get_into(["a"], [np.zeros((4, 4))[:, ::2]]),
])
def test_store_validation(store, call):
    with pytest.raises(ValidationError):
        call(store)
    assert store.batch_is_exist(["a"]) == [0]


def test_memory_store_lru_eviction_is_silent():
    s = MemoryStore(100)
    for k in "abc":
        s.batch_put_from([k], [bytes(40)])
    assert s.batch_is_exist(list("abc")) == [0, 1, 1] and s.evictions == 1
    s.batch_get_into(["b"], [bytearray(40)])  # b is now most recent
    s.batch_put_from(["d"], [bytes(40)])
    assert s.batch_is_exist(list("bcd")) == [1, 0, 1] and s.used_bytes == 80
    assert s.batch_put_from(["huge"], [bytes(101)]) == [-1]
    with pytest.raises(ValidationError):
        MemoryStore(0)


def test_memory_store_recycles_dropped_objects_without_mixing_bytes():
    """Under churn of mixed sizes (evictions, overwrites, explicit evicts) every get returns
    the bytes last put under its key, and nothing exceeds the capacity."""
    rng = np.random.default_rng(3)
    store = MemoryStore(10_000)
    model: dict[str, bytes] = {}
    for step in range(400):
        key, size = f"k{rng.integers(0, 12)}", int(rng.choice([500, 1000, 1500]))
        if step % 7 == 0:
            store.evict([key])
            model.pop(key, None)
            continue
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert store.batch_put_from([key], [data]) == [0]
        model[key] = data
        assert store.used_bytes <= 10_000
    stored = set(store)
    assert stored <= set(model) and stored
    for key in stored:
        buf = bytearray(len(model[key]))
        assert store.batch_get_into([key], [buf]) == [len(buf)] and bytes(buf) == model[key]


def test_memory_store_copies_large_puts_on_threads_and_stops_them_on_close():
    """A 16 MiB batch is copied on the store's threads, while another thread puts too: every
    object holds its own bytes; close() stops the threads."""
    import threading

    store = MemoryStore(64 << 20, copy_threads=4)
    rng = np.random.default_rng(4)
    batches = {t: [rng.integers(0, 256, 1 << 20, dtype=np.uint8) for _ in range(16)] for t in "ab"}
    workers = [threading.Thread(target=store.batch_put_from, args=([f"{t}{i}" for i in range(16)], objs))
               for t, objs in batches.items()]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert len(store) == 32 and store.puts == 32
    for t, objs in batches.items():
        for i, obj in enumerate(objs):
            buf = bytearray(obj.nbytes)
            assert store.batch_get_into([f"{t}{i}"], [buf]) == [obj.nbytes] and bytes(buf) == obj.tobytes()
    assert any(th.name.startswith("kvstate-memorystore") for th in threading.enumerate())
    store.close()
    assert not any(th.name.startswith("kvstate-memorystore") for th in threading.enumerate())
    assert store.batch_put_from(["big"], [bytes(65 << 20)]) == [-1]  # over the capacity: refused


def test_memory_store_gets_never_see_a_recycled_array_torn():
    """One thread keeps putting (evicting, recycling arrays) while another gets large batches
    on the copy threads: every object a get returns holds its key's bytes."""
    import threading
    import time

    store = MemoryStore(20 << 20, copy_threads=4)
    content = {f"k{i}": np.full(1 << 20, i, np.uint8) for i in range(40)}
    stop, bad = threading.Event(), []

    def writer():
        i = 0
        while not stop.is_set():
            names = [f"k{(i + j) % 40}" for j in range(10)]
            store.batch_put_from(names, [content[n] for n in names])
            i += 7

    def reader():
        i = 0
        while not stop.is_set():
            names = [f"k{(i + j) % 40}" for j in range(10)]
            bufs = [np.zeros(1 << 20, np.uint8) for _ in names]
            for n, got, buf in zip(names, store.batch_get_into(names, bufs), bufs):
                if got == buf.nbytes and not (buf == content[n]).all():
                    bad.append(n)
            i += 3

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(30)
    store.close()
    assert store.gets > 0 and bad == []


def test_file_store_survives_restart_and_writes_atomically(tmp_path):
    s = FileStore(tmp_path)
    s.batch_put_from(["k:partial:3"], [b"hello"])
    again = FileStore(tmp_path)
    buf = bytearray(5)
    assert again.batch_get_into(["k:partial:3"], [buf]) == [5] and bytes(buf) == b"hello"
    assert not [p for p in tmp_path.rglob(".tmp-*")]  # no torn temp files left
    assert again.evict(["k:partial:3"]) == 1 and again.batch_is_exist(["k:partial:3"]) == [0]


def test_file_store_keeps_each_clients_objects_within_its_capacity(tmp_path):
    """Two clients of one directory, 100 bytes each: a client removes the objects it wrote
    first (a re-put counting as new), never another's; the directory holds at most both
    capacities, and every object still there reads back as written."""
    a, b = FileStore(tmp_path, capacity_bytes=100), FileStore(tmp_path, capacity_bytes=100)
    data = {f"k{i}": bytes([i]) * 40 for i in range(8)}
    assert a.batch_put_from(["k0", "k1"], [data["k0"], data["k1"]]) == [0, 0]
    assert b.batch_put_from(["k4", "k5"], [data["k4"], data["k5"]]) == [0, 0]
    assert a.batch_put_from(["k0"], [data["k0"]]) == [0]  # k0 is a's newest now
    assert a.batch_put_from(["k2"], [data["k2"]]) == [0]  # 120 bytes: k1, a's oldest, goes
    assert a.batch_is_exist([f"k{i}" for i in range(6)]) == [1, 0, 1, 0, 1, 1] and a.evictions == 1
    assert b.batch_put_from(["k6", "k7"], [data["k6"], data["k7"]]) == [0, 0]  # b's k4, k5 go
    assert b.batch_is_exist(["k0", "k2", "k4", "k5", "k6", "k7"]) == [1, 1, 0, 0, 1, 1] and b.evictions == 2
    assert sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) <= 200
    for k in ("k0", "k2", "k6", "k7"):
        buf = bytearray(40)
        assert a.batch_get_into([k], [buf]) == [40] and bytes(buf) == data[k]
    assert a.evict(["k0"]) == 1  # evicted by hand: no longer counted
    assert a.batch_put_from(["k3"], [data["k3"]]) == [0] and a.batch_is_exist(["k2", "k3"]) == [1, 1]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "100", True])
def test_file_store_refuses_a_capacity_that_is_not_a_positive_int(tmp_path, bad):
    with pytest.raises(ValidationError, match="capacity_bytes"):
        FileStore(tmp_path / "pool", capacity_bytes=bad)
    assert not (tmp_path / "pool").exists()


def test_file_store_unwritable_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StoreError, match="not writable"):
        FileStore(f / "sub")


def test_backend_roundtrip_two_ranks_and_partial_read():
    spec = small_spec(tp=2)
    store = MemoryStore(1 << 22)
    p, d = ReferenceBackend(spec, 8, store), ReferenceBackend(spec, 8, store)
    rng = np.random.default_rng(1)
    for rank in range(2):
        for kind in spec.kinds:
            for layer in p.caches[rank][kind]:
                layer[:] = rng.integers(0, 1000, layer.shape)
    keys = block_keys(list(range(11)), 4)
    assert d.query(0, keys) == 0
    assert p.write(0, keys, [5, 1, 2]) == 3 and p.write(1, keys, [5, 1, 2]) == 3
    assert d.query(1, keys) == 3
    assert d.read(1, keys, [0, 3, 7]) == 3
    for kind in spec.kinds:
        assert d.block_bytes(1, kind, 3) == p.block_bytes(1, kind, 1)
    store.evict([f"{keys[1]}_value_0"])
    assert d.query(0, keys) == 1
    before = d.block_bytes(0, "key", 6)
    assert d.read(0, keys, [4, 6, 7]) == 1  # block 1 is missing: only the leading block is scattered
    assert d.block_bytes(0, "key", 6) == before
    assert d.block_bytes(0, "key", 4) == p.block_bytes(0, "key", 5)


def test_a_query_asks_for_the_first_block_alone_and_the_rest_only_when_it_is_stored():
    """Most writes are of new prompts: a query whose first block is missing answers 0 from
    one block's objects and manifest; a stored first block is followed by the whole batch."""
    spec = small_spec(tp=1)
    store = MemoryStore(1 << 22)
    p = ReferenceBackend(spec, 8, store)
    asked: list[int] = []
    real = store.batch_is_exist
    store.batch_is_exist = lambda names: asked.append(len(names)) or real(names)  # type: ignore[method-assign]
    keys = block_keys(list(range(16)), 4)
    assert p.query(0, keys) == 0 and asked == [3]  # key, value and manifest of block 0
    assert p.write(0, keys[:3], [1, 2, 3]) == 3
    asked.clear()
    assert p.query(0, keys) == 3 and asked == [3, 12]
    asked.clear()
    assert p.query(0, keys[:1]) == 1 and asked == [3]


def test_layer_groups_store_a_block_as_one_object_per_group():
    """With layer groups each (block, kind) is several objects of consecutive layers; a block
    counts as stored only with every group, and its bytes come back whole."""
    spec = small_spec(tp=1, num_layers=6, layer_groups=3)
    store = MemoryStore(1 << 22)
    p, d = ReferenceBackend(spec, 8, store, host_blocks=4), ReferenceBackend(spec, 8, store)
    rng = np.random.default_rng(2)
    for kind in spec.kinds:
        for layer in p.caches[0][kind]:
            layer[:] = rng.integers(0, 1000, layer.shape)
    keys = block_keys(list(range(12)), 4)
    assert p.write(0, keys, [3, 1, 6]) == 3
    assert len(store) == 3 * (len(spec.kinds) + 1) * 3  # and a manifest per block and group
    assert len(store.batch_get_into([f"{keys[0]}_key_0_g1"], [bytearray(spec.block_bytes() // 3)])) == 1
    assert store.batch_is_exist([f"{keys[0]}_key_0"]) == [0]  # no whole-block object
    assert d.read(0, keys, [0, 2, 4]) == 3
    for kind in spec.kinds:
        assert d.block_bytes(0, kind, 2) == p.block_bytes(0, kind, 1)
    store.evict([f"{keys[1]}_value_0_g2"])  # one group of one kind gone: the block is not stored
    assert d.query(0, keys) == 1
    assert d.read(0, keys, [5, 6, 7]) == 1
    assert p.swap_out(0, [1], [2]) == 1 and p.flush_host(0, keys[1:2], [2]) == 1  # put back from host
    assert d.query(0, keys) == 3


@pytest.mark.parametrize("groups", [0, 4, -1])
def test_layer_groups_must_divide_the_layers(groups):
    with pytest.raises(ConfigError, match="layer_groups"):
        small_spec(tp=1, num_layers=6, layer_groups=groups)


def test_backend_touches_no_block_once_the_fence_passed():
    spec = small_spec(tp=1)
    store = MemoryStore(1 << 22)
    p, d = ReferenceBackend(spec, 8, store), ReferenceBackend(spec, 8, store)
    for kind in spec.kinds:
        for layer in p.caches[0][kind]:
            layer[:] = 7
    keys = block_keys(list(range(8)), 4)
    with pytest.raises(FenceError, match=r"rank 0: .*fence passed before it could gather blocks \[1, 2\]"):
        p.write(0, keys, [1, 2], guard=lambda: False)
    assert len(store) == 0  # nothing gathered, nothing stored
    assert p.write(0, keys, [1, 2], guard=lambda: True) == 2
    with pytest.raises(FenceError, match="scatter into blocks"):
        d.read(0, keys, [3, 4], guard=lambda: False)
    assert all(not layer.any() for kind in spec.kinds for layer in d.caches[0][kind])
    assert d.read(0, keys, [3, 4], guard=lambda: True) == 2
    assert d.block_bytes(0, "key", 4) == p.block_bytes(0, "key", 2)


def test_backend_fp8_mla_spec_roundtrip():
    spec = small_spec(tp=1, dtype="uint8", has_value=False, fp8_scales=True)
    store = MemoryStore(1 << 20)
    p, d = ReferenceBackend(spec, 4, store), ReferenceBackend(spec, 4, store)
    p.caches[0]["key_scale"][1][2] = 0.5
    keys = block_keys([1, 2, 3], 4)
    p.write(0, keys, [2])
    assert d.read(0, keys, [0]) == 1
    assert d.caches[0]["key_scale"][1][0].tolist() == p.caches[0]["key_scale"][1][2].tolist()
    assert set(spec.kinds) == {"key", "key_scale"}


def test_backend_validation():
    spec = small_spec(tp=2)
    b = ReferenceBackend(spec, 4, MemoryStore(1 << 20))
    with pytest.raises(ValidationError):
        b.write(2, ["k"], [0])
    with pytest.raises(ValidationError):
        b.read(0, ["k", "j"], [0])
    with pytest.raises(ValidationError):
        ReferenceBackend(spec, 0, MemoryStore(1 << 20))


def test_each_transfer_thread_reuses_its_own_host_rows_and_a_transfer_past_the_cap_gets_fresh_ones(monkeypatch):
    """A read's copy into freshly mapped rows page-faults on every page (a seventh of the speed
    measured): each thread keeps its rows between transfers, another thread has its own (they
    run at once), and rows past KEEP_STAGING_BYTES are not kept. The bytes stay exact."""
    import threading

    import kvstate.backends._reference as reference

    spec = small_spec()
    store = MemoryStore(1 << 24)
    p, d = ReferenceBackend(spec, 16, store), ReferenceBackend(spec, 16, store)
    for layers in p.caches[0].values():
        for i, layer in enumerate(layers):
            layer[...] = np.arange(layer.size, dtype=np.int64).reshape(layer.shape).astype(layer.dtype) + i
    keys = block_keys(list(range(1, 4 * spec.block_size + 1)), spec.block_size, namespace="rows")
    assert p.write(0, keys, [1, 2, 3, 4]) == 4
    first = d._buffers(4, None)[0]
    assert d.read(0, keys, [5, 6, 7, 8]) == 4
    again = d._buffers(4, None)[0]
    assert all(np.shares_memory(first[k], again[k]) for k in first)  # the same rows, reused
    other: dict = {}
    t = threading.Thread(target=lambda: other.update(d._buffers(4, None)[0]))
    t.start()
    t.join()
    assert not any(np.shares_memory(first[k], other[k]) for k in first)  # another thread's own
    for kind in spec.kinds:
        for src, dst in zip(p.caches[0][kind], d.caches[0][kind]):
            assert (src[[1, 2, 3, 4]] == dst[[5, 6, 7, 8]]).all()
    monkeypatch.setattr(reference, "KEEP_STAGING_BYTES", 1)
    big = d._buffers(4, None)[0]
    assert not any(np.shares_memory(first[k], big[k]) for k in first)  # past the cap: rows of its own
    assert d.read(0, keys, [9, 10, 11, 12]) == 4
    d.close()
    assert not getattr(d._staging, "rows", None)  # closing lets every thread's rows go
    p.close()
