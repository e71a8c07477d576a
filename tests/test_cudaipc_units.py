"""CUDA IPC sharing of caches (kvstate.backends._cudaipc) rule by rule: what a description holds,
what is refused before any GPU call, and a worker's view of it from another process."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from needs import gpu as needs_gpu

from kvstate import CacheSpec, ConfigError
from kvstate.backends._cudaipc import open_caches, share_caches

ROOT = str(Path(__file__).resolve().parent.parent)
SPEC = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16")
NB = 6
CHUNK = SPEC.chunk_bytes("key")  # one block of one layer


def description(rows: int = 2, nbytes: int = NB * CHUNK, kinds=("key", "value"), **extra) -> dict:
    return {"kind": "cuda-ipc", "device": 0,
            "tensors": {"0": {k: [["00", 0, nbytes] for _ in range(rows)] for k in kinds}}, **extra}


@pytest.mark.parametrize("cfg, rule", [
    (description(kinds=("key",)), r"must name the kinds \('key', 'value'\)"),
    (description(rows=1), "must be 2 layers of 768 bytes"),
    (description(nbytes=NB * CHUNK + 2), "must be 2 layers of 768 bytes"),
    ({"kind": "cuda-ipc", "tensors": {}}, "must name the kinds"),
    ({"kind": "cuda-ipc"}, "must name the kinds"),
])
def test_a_description_of_another_geometry_is_refused_before_any_gpu_call(cfg, rule, monkeypatch):
    from kvstate.backends import _cudaipc

    monkeypatch.setattr(_cudaipc, "load_cupy", lambda: pytest.fail("CuPy was loaded before the check"))
    with pytest.raises(ConfigError, match=rule):
        open_caches(SPEC, NB, 0, cfg, 0)


def test_a_geometry_refusal_says_the_sizes_it_wanted_in_full():
    with pytest.raises(ConfigError) as e:
        open_caches(SPEC, NB, 0, description(rows=1), 0)
    assert str(e.value) == "rank 0: caches of 'key' must be 2 layers of 768 bytes (another geometry?)"


def test_state_pages_are_taken_from_the_ranks_row_and_refused_missing_or_of_the_wrong_size(monkeypatch):
    from kvstate._layers import LayerGroup
    from kvstate.backends import _cudaipc

    spec = CacheSpec(num_layers=3, kv_heads=2, block_size=4, head_dim=8, dtype="float16",
                     groups=(LayerGroup("full", (0,)), LayerGroup("state", (1, 2), state_bytes=64, checkpoint=4)))
    size, nb = 3 * spec.state_bytes_per_rank, NB
    rows = {k: [["00", 0, nb * spec.paged().chunk_bytes(k)]] for k in spec.paged().kinds}
    good = {"kind": "cuda-ipc", "tensors": {"0": rows, "1": rows}, "states": {"0": ["aa", 0, size], "1": ["bb", 0, 1]}}
    monkeypatch.setattr(_cudaipc, "load_cupy", lambda: pytest.fail("CuPy was loaded before the check"))
    assert _cudaipc._check_shared(spec, nb, 0, good, 3) == rows
    for rank, cfg in ((1, good), (0, good | {"states": {"1": ["aa", 0, size]}}), (0, good | {"states": {}}),
                      (0, {"tensors": good["tensors"]}), (0, good | {"states": {"0": "x"}})):
        rule = rf"rank {rank}: the shared caches must give its state pages, {size} bytes"
        with pytest.raises(ConfigError, match=rule):
            _cudaipc._check_shared(spec, nb, rank, cfg, 3)
    assert _cudaipc._check_shared(spec, nb, 1, good, 0) == rows  # no pages asked for: none checked


CACHES_RULE = r"^share_caches: caches must map each rank \(an int\) to \{kind: \[per-layer tensors\]\}$"
STATES_RULE = r"^share_caches: states must map each rank \(an int\) to its state pages, or be None$"


@pytest.mark.parametrize("kw, rule", [
    ({"caches": {"0": {"key": []}}}, CACHES_RULE),
    ({"caches": {0: {1: []}}}, CACHES_RULE),
    ({"caches": {0: {"key": 5}}}, CACHES_RULE),
    ({"caches": [1]}, CACHES_RULE),
    ({"device": -1}, "^share_caches: device must be an int >= 0 and <= 1023"),
    ({"device": 1024}, "^share_caches: device must be"),
    ({"states": {"0": 1}}, STATES_RULE),
    ({"states": [1]}, STATES_RULE),
])
def test_share_caches_refuses_what_it_cannot_describe_before_any_gpu_call(kw, rule, monkeypatch):
    from kvstate.backends import _cudaipc

    monkeypatch.setattr(_cudaipc, "load_cupy", lambda: pytest.fail("CuPy was loaded before the check"))
    with pytest.raises(ConfigError, match=rule):
        share_caches(**({"caches": {0: {"key": []}}} | kw))


CHILD = """
import json, sys
import cupy as cp
from kvstate import CacheSpec
from kvstate.backends._cudaipc import open_caches
spec = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16")
caches, pages, close = open_caches(spec, 6, 0, json.loads(sys.argv[1]), 0)
assert pages is None
out = {k: [float(a[b].astype(cp.float32).sum()) for a in caches[0][k] for b in range(6)] for k in spec.kinds}
out["shapes"] = [list(a.shape) for a in caches[0]["key"]] + [str(caches[0]["key"][0].dtype)]
caches[0]["value"][1][5] = 7  # written through the mapping: the engine sees it
cp.cuda.runtime.deviceSynchronize()
close()
close()
print(json.dumps(out))
"""


@needs_gpu("torch")
@pytest.mark.gpu
def test_a_worker_of_another_process_sees_and_writes_the_engines_caches_through_one_handle_an_allocation():
    """Layers cut from one allocation share its handle, at their offsets; another process maps
    them at the spec's shapes, reads every block and writes one back; state pages ride beside."""
    import torch

    pool = torch.zeros((4, NB) + SPEC.block_shape("key"), dtype=torch.float16, device="cuda")
    for i in range(4):
        for b in range(NB):
            pool[i, b] = i * 10 + b
    caches = {0: {"key": [pool[0], pool[1]], "value": [pool[2], pool[3]]}}
    pages = torch.arange(3 * 16, dtype=torch.uint8, device="cuda").reshape(3, 16)
    cfg = share_caches(caches)
    with pytest.raises(Exception):  # noqa: B017 - CUDA refuses a process its own IPC handles
        open_caches(SPEC, NB, 0, cfg, 0)  # (and what it opened before the refusal is let go)
    rows = [r for k in ("key", "value") for r in cfg["tensors"]["0"][k]]
    assert cfg["kind"] == "cuda-ipc" and cfg["device"] == 0 and "states" not in cfg
    assert len({r[0] for r in rows}) == 1, "one allocation, one handle"
    assert [r[1] - rows[0][1] for r in rows] == [i * NB * CHUNK for i in range(4)] and all(r[2] == NB * CHUNK
                                                                                          for r in rows)
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    per = 2 * 4 * 8  # elements of a block of a layer
    assert got["key"] == [float((i * 10 + b) * per) for i in (0, 1) for b in range(NB)]
    assert got["value"] == [float((i * 10 + b) * per) for i in (2, 3) for b in range(NB)]
    assert got["shapes"][:2] == [[NB, 2, 4, 8]] * 2 and got["shapes"][2] == "float16"
    torch.cuda.synchronize()
    assert bool((pool[3, 5] == 7).all()) and bool((pool[3, 4] == 34).all())
    with pytest.raises(ConfigError, match=r"caches\[0\]\['key'\]: a layer: not contiguous"):
        share_caches({0: {"key": [pool[0].transpose(1, 2)]}})
    cfg = share_caches(caches, states={0: pages})
    assert cfg["states"]["0"][2] == pages.numel() and list(cfg["tensors"]) == ["0"]


@needs_gpu("torch")
@pytest.mark.gpu
def test_bfloat16_caches_are_shared_as_their_16_bit_words():
    import torch

    spec = CacheSpec(num_layers=1, kv_heads=2, block_size=4, head_dim=8, dtype="bfloat16")
    layer = torch.full((NB,) + spec.block_shape("key"), 1.5, dtype=torch.bfloat16, device="cuda")
    cfg = share_caches({0: {"key": [layer], "value": [layer.clone()]}})
    assert cfg["tensors"]["0"]["key"][0][2] == layer.numel() * 2


class FakeCupy:
    """The CuPy calls that sharing and mapping make, recorded with the device current at each:
    the module's bookkeeping (one handle an allocation, offsets, devices, the lazy peer flag,
    each mapping closed once) checked on a CPU, over PyTorch CPU tensors as the engine's."""

    uint8 = "uint8"

    def __init__(self, refuse_open: str | None = None):
        self.calls: list[tuple] = []
        self.current = 0
        self.refuse_open = refuse_open
        runtime = SimpleNamespace(ipcGetMemHandle=self._get, ipcOpenMemHandle=self._open,
                                  ipcCloseMemHandle=self._close)
        self.cuda = SimpleNamespace(Device=self._device, runtime=runtime,
                                    UnownedMemory=lambda *a: ("mem", a), MemoryPointer=lambda m, o: (m, o))

    @contextlib.contextmanager
    def _device(self, device):
        before, self.current = self.current, device
        try:
            yield
        finally:
            self.current = before

    def from_dlpack(self, t):
        if str(getattr(t, "dtype", "")).endswith("bfloat16"):
            raise TypeError("bfloat16 is not supported through DLPack")  # as CuPy before 14
        return SimpleNamespace(flags=SimpleNamespace(c_contiguous=t.is_contiguous()),
                               data=SimpleNamespace(ptr=t.data_ptr()), nbytes=t.numel() * t.element_size())

    def _get(self, base):
        self.calls.append(("get", base, self.current))
        return base.to_bytes(8, "little")

    def _open(self, handle, *flags):
        self.calls.append(("open", handle.hex(), flags, self.current))
        if handle.hex() == self.refuse_open:
            raise RuntimeError("cudaErrorInvalidResourceHandle")
        return 1000 * len(self.calls)

    def _close(self, ptr):
        self.calls.append(("close", ptr, self.current))
        raise RuntimeError("a close that fails is let go")

    def ndarray(self, shape, dtype, memptr):
        return (shape, dtype, memptr)


@pytest.fixture
def fake_cupy(monkeypatch):
    from kvstate.backends import _cudaipc

    fake = FakeCupy()
    monkeypatch.setattr(_cudaipc, "load_cupy", lambda: fake)
    return fake


def test_sharing_exports_each_allocation_once_on_its_device_at_its_offsets(fake_cupy, monkeypatch):
    from kvstate.backends import _cudaipc

    torch = pytest.importorskip("torch")
    pool, pages = torch.zeros((4, 16), dtype=torch.float16), torch.zeros((2, 8), dtype=torch.uint8)
    bases = {pool.data_ptr() + i * 32: (pool.data_ptr(), 128) for i in range(4)} | {pages.data_ptr(): (7, 16)}
    monkeypatch.setattr(_cudaipc, "_address_range", lambda ptr: bases[ptr])
    cfg = share_caches({2: {"key": [pool[0], pool[1]], "value": [pool[2], pool[3]]}}, device=3, states={2: pages})
    handle = pool.data_ptr().to_bytes(8, "little").hex()
    assert cfg == {"kind": "cuda-ipc", "device": 3,
                   "tensors": {"2": {"key": [[handle, 0, 32], [handle, 32, 32]],
                                     "value": [[handle, 64, 32], [handle, 96, 32]]}},
                   "states": {"2": [(7).to_bytes(8, "little").hex(), pages.data_ptr() - 7, 16]}}
    assert fake_cupy.calls == [("get", pool.data_ptr(), 3), ("get", 7, 3)]
    with pytest.raises(ConfigError, match=r"^states\[2\]: not contiguous$"):
        share_caches({2: {"key": [pool[0]]}}, states={2: pages.t()})
    with pytest.raises(ConfigError, match=r"^caches\[2\]\['value'\]: a layer: not contiguous$"):
        share_caches({2: {"value": [pool.t()]}})


def test_bfloat16_tensors_are_exported_as_their_16_bit_words(fake_cupy, monkeypatch):
    from kvstate.backends import _cudaipc

    torch = pytest.importorskip("torch")
    layer = torch.zeros(8, dtype=torch.bfloat16)
    monkeypatch.setattr(_cudaipc, "_address_range", lambda ptr: (ptr, 16))
    cfg = share_caches({0: {"key": [layer]}})
    assert cfg["tensors"]["0"]["key"][0][1:] == [0, 16]
    assert cfg["device"] == 0 and "states" not in cfg and fake_cupy.calls == [("get", layer.data_ptr(), 0)]

    class DLPackOnly:  # a tensor-like that names no dtype is handed to CuPy as it is
        def __init__(self, t):
            self.is_contiguous, self.data_ptr, self.numel, self.element_size = (
                t.is_contiguous, t.data_ptr, t.numel, t.element_size)
    cfg = share_caches({0: {"key": [DLPackOnly(torch.zeros(4, dtype=torch.float16))]}})
    assert cfg["tensors"]["0"]["key"][0][1:] == [0, 8]


def test_mapping_opens_each_allocation_once_lazily_on_its_device_and_closes_each_once(fake_cupy):
    from kvstate._layers import LayerGroup

    spec = CacheSpec(num_layers=3, kv_heads=2, block_size=4, head_dim=8, dtype="float16",
                     groups=(LayerGroup("full", (0, 1)), LayerGroup("state", (2,), state_bytes=64, checkpoint=4)))
    want = NB * spec.paged().chunk_bytes("key")
    rows = [["aa", 0, want], ["aa", want, want]]
    cfg = {"kind": "cuda-ipc", "device": 3, "tensors": {"1": {"key": rows, "value": [["bb", 8, want]] * 2}},
           "states": {"1": ["aa", 4 * want, 2 * spec.state_bytes_per_rank]}}
    caches, states, close = open_caches(spec, NB, 1, cfg, 3, num_states=2)
    opened = [c for c in fake_cupy.calls if c[0] == "open"]
    assert opened == [("open", "aa", (1,), 3), ("open", "bb", (1,), 3)]
    a, b = 1000, 2000  # where the fake mapped each allocation
    shape = (NB,) + spec.paged().block_shape("key")
    assert caches == {1: {"key": [(shape, "float16", (("mem", (a, want, None, 3)), 0)),
                                  (shape, "float16", (("mem", (a + want, want, None, 3)), 0))],
                          "value": [(shape, "float16", (("mem", (b + 8, want, None, 3)), 0))] * 2}}
    assert states == {1: ((2, spec.state_bytes_per_rank), "uint8",
                          (("mem", (a + 4 * want, 2 * spec.state_bytes_per_rank, None, 3)), 0))}
    close()
    assert fake_cupy.calls[2:] == [("close", a, 3), ("close", b, 3)] and caches[1] == {}
    close()  # a second close closes nothing again
    assert len(fake_cupy.calls) == 4
    cfg = {"kind": "cuda-ipc", "tensors": {"1": {"key": rows, "value": rows}}}
    assert open_caches(spec, NB, 1, cfg, 0)[1] is None  # no pages asked for, none mapped


def test_a_mapping_that_fails_part_way_lets_go_of_what_it_opened_and_says_why(fake_cupy):
    fake_cupy.refuse_open = "bb"
    cfg = description() | {"device": 2}
    cfg["tensors"]["0"]["value"] = [["bb", 0, NB * CHUNK]] * 2
    with pytest.raises(RuntimeError, match="cudaErrorInvalidResourceHandle"):
        open_caches(SPEC, NB, 0, cfg, 2)
    assert fake_cupy.calls == [("open", "00", (1,), 2), ("open", "bb", (1,), 2), ("close", 1000, 2)]


class FakeDriver:
    """libcuda's ``cuMemGetAddressRange_v2``, answering ``rc`` and writing both outputs."""

    def __init__(self, rc: int = 0):
        self.rc = rc

    def cuMemGetAddressRange_v2(self, base, size, ptr):  # noqa: N802 - the driver's name
        base._obj.value, size._obj.value = ptr.value - 16, 4096
        return self.rc


def test_the_allocation_of_a_pointer_is_the_drivers_answer_and_its_failures_are_named(monkeypatch):
    from kvstate.backends import _cudaipc

    monkeypatch.setattr(_cudaipc.ctypes, "CDLL", lambda name: FakeDriver())
    assert _cudaipc._address_range(0x1010) == (0x1000, 4096)
    monkeypatch.setattr(_cudaipc.ctypes, "CDLL", lambda name: FakeDriver(rc=1))
    with pytest.raises(ConfigError) as e:
        _cudaipc._address_range(0x1010)
    assert str(e.value) == "cuMemGetAddressRange failed for device pointer 0x1010 (CUresult 1)"

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(_cudaipc.ctypes, "CDLL", missing)
    with pytest.raises(ConfigError) as e:
        _cudaipc._address_range(0x1010)
    assert str(e.value) == ("CUDA IPC needs the CUDA driver library (libcuda.so.1): "
                            "libcuda.so.1: cannot open shared object file")
