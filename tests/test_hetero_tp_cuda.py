"""P and D of different TP degrees on the GPU: the CUDA backend moves each D rank exactly its
heads, byte for byte as a monolithic cache holds them, across staging pieces and layer groups,
and crosses with the numpy reference backend both ways (GPU checksums verified on the host).

Marked ``gpu``: skipped with a reason where CuPy or a CUDA device is missing.
"""
from __future__ import annotations

import numpy as np
import pytest
from needs import gpu as needs_gpu
from needs import gpu_missing
from test_hetero_tp import BLOCK, D_IDS, NUM_BLOCKS, P_IDS, heads_of, monolithic, shard, spec_for

from kvstate._keys import block_keys
from kvstate._spec import paired
from kvstate.backends import MemoryStore, ReferenceBackend

GPU = gpu_missing() is None
pytestmark = [pytest.mark.gpu, needs_gpu()]


def backend(kind: str, spec, store, full=None):
    """A backend of ``kind`` ("cuda" or "ref") over ``store``, holding ``full``'s shards if given."""
    caches = None if full is None else shard(full, spec)
    if kind == "ref":
        return ReferenceBackend(spec, NUM_BLOCKS, store, caches=caches)
    import cupy as cp

    from kvstate.backends._cuda import CudaBackend

    if caches is not None:
        caches = {r: {k: [cp.asarray(a) for a in layers] for k, layers in by.items()} for r, by in caches.items()}
    # staging for two blocks a slot: a three-block transfer runs in pieces
    return CudaBackend(spec, NUM_BLOCKS, store, caches=caches, staging_bytes=4 * spec.bytes_per_block_per_rank)


def d_layers(d, r: int, kind: str) -> list[np.ndarray]:
    if isinstance(d, ReferenceBackend):
        return d.caches[r][kind]
    return [v.get() for v in d.caches(r, kind).views]


@pytest.mark.parametrize("heads,p_tp,d_tp", [(8, 4, 2), (8, 2, 2), (4, 1, 8), (8, 8, 1), (4, 8, 1)])
@pytest.mark.parametrize("sides", [("cuda", "cuda"), ("cuda", "ref"), ("ref", "cuda")])
@pytest.mark.parametrize("layer_wise", [False, True])
def test_cuda_moves_each_d_rank_exactly_its_heads(heads, p_tp, d_tp, sides, layer_wise):
    groups = 2 if layer_wise else 1
    p_spec, d_spec = paired(spec_for(heads, p_tp, dtype="bfloat16", layer_groups=groups),
                            spec_for(heads, d_tp, dtype="bfloat16", layer_groups=groups))
    store = MemoryStore(1 << 26)
    full = monolithic(p_spec)
    p, d = backend(sides[0], p_spec, store, full), backend(sides[1], d_spec, store)
    keys = block_keys(list(range(3 * BLOCK)), BLOCK)
    arrivals = []
    try:
        for r in range(p_tp):
            assert p.write(r, keys, P_IDS, layers=(lambda end, wait=True: True) if layer_wise else None) == 3
        for r in range(d_tp):
            report = (lambda end, ev, r=r: arrivals.append((r, end))) if layer_wise else None
            assert d.read(r, keys, D_IDS, arrived=report) == 3
            for kind in d_spec.kinds:
                for layer, mine in zip(full[kind], d_layers(d, r, kind)):
                    np.testing.assert_array_equal(mine[D_IDS].view(np.uint16),
                                                  layer[P_IDS][:, heads_of(d_spec, r)].view(np.uint16))
        assert d.broken_blocks == 0
        if layer_wise:
            assert [e for _, e in arrivals] == [2, 4] * d_tp
    finally:
        for b in (p, d):
            b.close()


@pytest.mark.parametrize("fault", ["flipped", "missing"])
@pytest.mark.parametrize("group", [0, 1])
def test_a_bad_object_of_one_head_group_stops_the_read_at_its_block(fault, group):
    """D at TP 2 reads each block from two head groups' objects (P at TP 4 wrote them). One
    object of block 1 in one group is spoiled or gone: the read counts block 0 only, whatever
    the group, evicts a spoiled object, and block 0 holds exactly its heads."""
    from kvstate._keys import rank_key

    p_spec, d_spec = paired(spec_for(8, 4, dtype="bfloat16"), spec_for(8, 2, dtype="bfloat16"))
    assert d_spec.head_groups == 2
    store = MemoryStore(1 << 26)
    full = monolithic(p_spec)
    p, d = backend("cuda", p_spec, store, full), backend("cuda", d_spec, store)
    keys = block_keys(list(range(3 * BLOCK)), BLOCK)
    try:
        for r in range(4):
            assert p.write(r, keys, P_IDS) == 3
        name = rank_key(keys[1], "value", group)  # D rank 0's group ``group``
        if fault == "missing":
            store.evict([name])
        else:
            buf = bytearray(1 << 22)
            [size] = store.batch_get_into([name], [buf])
            assert size > 0
            buf[size // 2] ^= 0x40  # full length, one bit wrong
            store.batch_put_from([name], [bytes(buf[:size])])
        assert d.read(0, keys, D_IDS) == 1
        assert d.broken_blocks == (fault == "flipped") and store.batch_is_exist([name]) == [0]
        assert d.read(1, keys, D_IDS) == 3  # rank 1's groups are whole
        for kind in d_spec.kinds:
            for layer, mine in zip(full[kind], d_layers(d, 0, kind)):
                np.testing.assert_array_equal(mine[D_IDS[:1]].view(np.uint16),
                                              layer[P_IDS[:1]][:, heads_of(d_spec, 0)].view(np.uint16))
    finally:
        for b in (p, d):
            b.close()
