"""CUDA IPC sharing of caches (kvstate.backends._cudaipc) rule by rule: what a description holds,
what is refused before any GPU call, and a worker's view of it from another process."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
