"""A rank worker's store configuration (kvstate.distributed._rankworker.build_store), rule by
rule: each kind a worker may open, what each takes, and every refusal word for word."""
import pytest
from needs import gpu
from workerfields import SPEC, worker_fields

from kvstate import ConfigError
from kvstate.backends import FileStore
from kvstate.backends._arena import ArenaStore
from kvstate.distributed._rankworker import build_store


def test_a_file_store_opens_at_its_root_with_its_capacity(tmp_path):
    s = build_store({"kind": "file", "root": str(tmp_path / "pool"), "capacity_bytes": 4096})
    try:
        assert type(s) is FileStore and s.capacity_bytes == 4096
        assert s.batch_put_from(["k"], [b"x" * 8]) == [0] and (tmp_path / "pool").is_dir()
    finally:
        s.close()
    s = build_store({"kind": "file", "root": str(tmp_path / "other")})
    assert s.capacity_bytes is None
    s.close()


def test_an_arena_opens_by_path_and_checks_the_slot_size_and_tag_it_is_given():
    made = ArenaStore.create(4096, 4, small_bytes=512, tag="geo")
    try:
        s = build_store({"kind": "arena", "path": made.path, "slot_bytes": 4096, "tag": "geo"})
        assert type(s) is ArenaStore and s.path == made.path and s.tag == "geo" and not s.owner
        s.close()
        build_store({"kind": "arena", "path": made.path}).close()
        with pytest.raises(ConfigError, match="has 4096-byte slots, 8192 were asked for"):
            build_store({"kind": "arena", "path": made.path, "slot_bytes": 8192})
        with pytest.raises(ConfigError, match="was made for geometry 'geo', not 'other'"):
            build_store({"kind": "arena", "path": made.path, "tag": "other"})
    finally:
        made.close()


@pytest.mark.parametrize("cfg, message", [
    ({"kind": "file"}, "a file store takes a root and a capacity_bytes only, got ['kind']"),
    ({"kind": "file", "root": "/x", "size": 1},
     "a file store takes a root and a capacity_bytes only, got ['kind', 'root', 'size']"),
    ({"kind": "arena"}, "an arena store takes a path (and the slot_bytes and tag it must have) only, got ['kind']"),
    ({"kind": "arena", "path": "/x", "root": "/y"},
     "an arena store takes a path (and the slot_bytes and tag it must have) only, got ['kind', 'path', 'root']"),
    ({"kind": "memory"}, "no store of kind 'memory' reaches across processes (use 'arena', 'file' or 'mooncake')"),
    ({}, "no store of kind None reaches across processes (use 'arena', 'file' or 'mooncake')"),
])
def test_a_store_a_worker_cannot_open_is_refused_word_for_word_and_nothing_is_made(cfg, message, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        build_store(cfg)
    assert str(e.value) == message
    assert not any(tmp_path.iterdir())


def test_a_mooncake_store_is_configured_from_every_field_but_the_kind(monkeypatch):
    from kvstate.backends import _mooncake

    seen = []
    monkeypatch.setattr(_mooncake, "MooncakeStore", lambda config: seen.append(config) or "store")
    assert build_store({"kind": "mooncake", "master": "127.0.0.1:50051", "metadata": "P2PHANDSHAKE",
                        "local_hostname": "h"}) == "store"
    (config,) = seen
    assert type(config) is _mooncake.MooncakeConfig and config.master == "127.0.0.1:50051"
    assert config.metadata == "P2PHANDSHAKE" and config.local_hostname == "h"
    assert build_store({"kind": "mooncake", "master": "m:1", "metadata": "P2PHANDSHAKE"}) == "store"  # these alone
    assert (seen[1].master, seen[1].metadata) == ("m:1", "P2PHANDSHAKE")
    del seen[1]
    for bad in ({"master": "m", "metadata": "d", "no_such_field": 1}, {"master": "m"}):
        with pytest.raises(ConfigError, match=r"^a mooncake store takes master and metadata \(and \[.*'protocol'"):
            build_store({"kind": "mooncake", **bad})
    assert len(seen) == 1


def _worker(tmp_path, **kw):
    """A worker whose backend a test builds (no sockets: ``_backend`` alone)."""
    from kvstate.distributed._rankworker import RankWorker, WorkerConfig

    return SPEC, RankWorker(WorkerConfig(**worker_fields(store={"kind": "file", "root": str(tmp_path / "pool")},
                                                      **kw)))


def _close(w):
    for close in reversed(w._resources):
        close()


def test_a_worker_s_own_caches_host_tier_and_lend_boards_are_built_for_its_rank_alone(tmp_path):
    from kvstate.backends import ReferenceBackend

    _, w = _worker(tmp_path, host_blocks=3, lends=str(tmp_path / "lends"), pulls=str(tmp_path / "pulls"),
                   pull_wait=0.25)
    backend = w._backend()
    try:
        assert type(backend) is ReferenceBackend and backend.ranks == (1,) and backend.host_blocks == 3
        assert list(backend.caches) == [1] and backend.caches[1]["key"][0].shape[0] == 8
        assert backend.store is w._store and type(w._store) is FileStore
        assert (backend.lends.root, backend.lends.wait) == (tmp_path / "lends", 0.25)
        assert (backend.pulls.root, backend.pulls.wait) == (tmp_path / "pulls", 0.25)
        assert len(w._resources) == 2  # the store and the backend, closed in reverse
    finally:
        _close(w)
    _, bare = _worker(tmp_path)
    backend = bare._backend()
    try:
        assert backend.lends is None and backend.pulls is None and backend.host_blocks == 0
    finally:
        _close(bare)


def test_shared_caches_are_attached_for_the_worker_s_rank_and_refused_without_its_file(tmp_path):
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("needs Linux (/dev/shm)")
    from kvstate.distributed import SharedCaches

    spec, w = _worker(tmp_path)
    shared = SharedCaches.create(spec, 8)
    try:
        _, w = _worker(tmp_path, caches={"kind": "shm", "paths": {"0": shared.paths[0]}})
        with pytest.raises(ConfigError) as e:
            w._backend()
        assert str(e.value) == "rank 1: the shared caches name no file for this rank"
        _close(w)
        _, w = _worker(tmp_path, caches={"kind": "shm", "paths": {str(r): p for r, p in shared.paths.items()}})
        backend = w._backend()
        try:
            shared.caches[1]["value"][1][5] = 7  # the worker's caches are the shared file's
            assert backend.caches[1]["value"][1][5].min() == 7 and list(backend.caches) == [1]
            assert len(w._resources) == 3  # the store, the attached file, the backend
        finally:
            _close(w)
    finally:
        shared.close()


@gpu()
def test_a_cuda_worker_builds_its_backend_on_its_device_with_its_tier_and_boards(tmp_path):
    from kvstate.backends._cuda import CudaBackend

    _, w = _worker(tmp_path, backend="cuda", device=0, host_blocks=2, lends=str(tmp_path / "lends"),
                   pulls=str(tmp_path / "pulls"), pull_wait=0.125)
    backend = w._backend()
    try:
        assert type(backend) is CudaBackend and backend.device == 0 and backend.ranks == (1,)
        assert backend.host_blocks == 2 and backend.num_blocks == 8 and backend.store is w._store
        assert (backend.lends.root, backend.pulls.root, backend.pulls.wait) == (tmp_path / "lends",
                                                                                tmp_path / "pulls", 0.125)
        assert len(w._resources) == 2
        peer = backend.lend_peer(1)  # its own caches, shared for a puller by the backend itself
        assert peer["kind"] == "cuda-ipc" and list(peer["tensors"]) == ["1"] and peer["device"] == 0
    finally:
        _close(w)


def test_shared_caches_with_state_pages_give_the_worker_its_rank_s_shared_pages(tmp_path):
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("needs Linux (/dev/shm)")
    from kvstate._layers import LayerGroup
    from kvstate._spec import CacheSpec
    from kvstate.distributed import SharedCaches

    groups = (LayerGroup("full", (0,)), LayerGroup("state", (1,), state_bytes=64, checkpoint=4))
    spec = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=2, groups=groups)
    shared = SharedCaches.create(spec, 8, num_states=3)
    try:
        _, w = _worker(tmp_path, spec={f: getattr(spec, f) for f in spec.__dataclass_fields__}, num_states=3,
                       caches={"kind": "shm", "paths": {str(r): p for r, p in shared.paths.items()}})
        backend = w._backend()
        try:
            shared.states[1][2] = 9  # page 2 of rank 1, written by the process that made the file
            assert backend.state_pages[1].shape == (3, 64) and backend.state_pages[1][2].min() == 9
            assert list(backend.state_pages) == [1]
        finally:
            _close(w)
    finally:
        shared.close()


def test_a_cuda_worker_on_shared_caches_maps_its_rank_s_on_its_device_and_lets_them_go(tmp_path, monkeypatch):
    """The wiring alone (CUDA IPC and the CUDA backend recorded, so it runs on a CPU): the
    engine's caches and state pages are mapped for this rank on its device and handed to the
    backend with the description; their release is the worker's. tests/test_cuda_ipc.py moves
    bytes through the same path on a GPU."""
    from kvstate.backends import _cuda, _cudaipc

    shared = {"kind": "cuda-ipc", "device": 2, "tensors": {"1": {}}, "states": {"1": ["aa", 0, 1]}}
    opened, released, built = [], [], []
    monkeypatch.setattr(_cudaipc, "open_caches",
                        lambda *a: opened.append(a) or ("caches", "pages", lambda: released.append(1)))

    class Backend:
        def __init__(self, *a, **kw):
            built.append((a, kw))

        def close(self):
            released.append(2)
    monkeypatch.setattr(_cuda, "CudaBackend", Backend)
    from kvstate._layers import LayerGroup
    from kvstate._spec import CacheSpec

    groups = (LayerGroup("full", (0,)), LayerGroup("state", (1,), state_bytes=64, checkpoint=4))
    spec = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=2, groups=groups)
    _, w = _worker(tmp_path, spec={f: getattr(spec, f) for f in spec.__dataclass_fields__}, backend="cuda", device=2,
                   caches=shared, num_states=3, host_blocks=1)
    backend = w._backend()
    assert type(backend) is Backend
    assert opened == [(spec, 8, 1, shared, 2, 3)]
    ((args, kw),) = built
    assert args[:2] == (spec, 8) and args[2] is w._store
    assert kw == {"caches": "caches", "device": 2, "host_blocks": 1, "ranks": (1,), "num_states": 3,
                  "states": "pages", "lends": None, "pulls": None, "shared": shared}
    _close(w)
    assert released == [2, 1]
