"""P and D of different TP degrees through one store: the rank-neutral layout moves each D rank
exactly its heads, byte for byte as a monolithic cache holds them; pairs that cannot be served
are refused at configuration."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvstate._errors import ConfigError, KVStateError
from kvstate._keys import block_keys, rank_key
from kvstate._spec import CacheSpec, check_pair, paired
from kvstate.backends import MemoryStore, ReferenceBackend

LAYERS, BLOCK, DIM, NUM_BLOCKS = 4, 4, 8, 12
P_IDS, D_IDS = [5, 0, 9], [2, 7, 11]


def spec_for(heads: int, tp: int, **kw) -> CacheSpec:
    """One rank's spec of a model with ``heads`` KV heads at TP ``tp`` (replicated past ``heads``)."""
    return CacheSpec(num_layers=LAYERS, kv_heads=max(1, heads // tp), block_size=BLOCK, head_dim=DIM,
                     tp_size=tp, total_kv_heads=heads, **kw)


def monolithic(spec: CacheSpec, seed: int = 0) -> dict[str, list[np.ndarray]]:
    """The whole model's cache: per kind, per layer ``[NUM_BLOCKS, heads, block, dim]``."""
    rng = np.random.default_rng(seed)
    return {kind: [rng.integers(0, 1 << 16, (NUM_BLOCKS, spec.heads_total) + spec.block_shape(kind)[1:],
                                dtype=np.uint16).view(spec.kind_dtype(kind)) if spec.kind_dtype(kind).itemsize == 2
                   else rng.random((NUM_BLOCKS, spec.heads_total) + spec.block_shape(kind)[1:]).astype(
                       spec.kind_dtype(kind)) for _ in range(spec.layers)] for kind in spec.kinds}


def heads_of(spec: CacheSpec, rank: int) -> slice:
    first = rank // spec.replicas * spec.kv_heads
    return slice(first, first + spec.kv_heads)


def shard(full: dict[str, list[np.ndarray]], spec: CacheSpec) -> dict[int, dict[str, list[np.ndarray]]]:
    """Each rank's caches cut from the monolithic one (copies, as a rank's own memory)."""
    return {r: {kind: [np.ascontiguousarray(layer[:, heads_of(spec, r)]) for layer in layers]
                for kind, layers in full.items()} for r in range(spec.tp_size)}


def handoff(p_spec: CacheSpec, d_spec: CacheSpec, store=None, layer_wise: bool = False):
    """P writes three blocks from every rank; D reads them into other blocks on every rank."""
    store = store if store is not None else MemoryStore(1 << 26)
    full = monolithic(p_spec)
    p = ReferenceBackend(p_spec, NUM_BLOCKS, store, caches=shard(full, p_spec))
    d = ReferenceBackend(d_spec, NUM_BLOCKS, store)
    keys = block_keys(list(range(3 * BLOCK)), BLOCK)
    ready = (lambda end, wait=True: True) if layer_wise else None
    arrivals: list[tuple[int, int]] = []
    for r in range(p_spec.tp_size):
        assert p.write(r, keys, P_IDS, layers=ready) == 3
    for r in range(d_spec.tp_size):
        assert d.query(r, keys) == 3
        report = (lambda end, ev, r=r: arrivals.append((r, end))) if layer_wise else None
        assert d.read(r, keys, D_IDS, arrived=report) == 3
    d.p = p  # the writer, for its byte count
    return full, d, store, keys, arrivals


def assert_exact(full, d: ReferenceBackend, spec: CacheSpec) -> None:
    """Every D rank holds exactly its heads of P's blocks, bytes equal to the monolithic cache."""
    for r in range(spec.tp_size):
        for kind in spec.kinds:
            for layer, mine in zip(full[kind], d.caches[r][kind]):
                np.testing.assert_array_equal(mine[D_IDS].view(np.uint8),
                                              layer[P_IDS][:, heads_of(spec, r)].view(np.uint8))


PAIRS = [(8, 4, 2), (8, 2, 2), (4, 1, 8), (8, 8, 1), (4, 8, 1), (8, 2, 4)]  # (heads, P TP, D TP)


@pytest.mark.parametrize("heads,p_tp,d_tp", PAIRS)
@pytest.mark.parametrize("groups", [1, 2])
def test_each_d_rank_reads_exactly_its_heads(heads, p_tp, d_tp, groups):
    p_spec, d_spec = paired(spec_for(heads, p_tp, layer_groups=groups), spec_for(heads, d_tp, layer_groups=groups))
    full, d, store, keys, _ = handoff(p_spec, d_spec)
    assert_exact(full, d, d_spec)
    # the store holds one object per head group, kind and layer group: no replica wrote twice
    per_block = heads // p_spec.object_heads * len(p_spec.kinds) * groups
    assert len([n for n in store if "_sum_" not in n]) == 3 * per_block
    assert d.broken_blocks == 0
    # and only the first replica of each head moved its bytes
    assert d.p.bytes_moved == 3 * p_spec.bytes_per_block_per_rank * (p_tp // p_spec.replicas)


@pytest.mark.parametrize("heads,p_tp,d_tp", [(8, 4, 2), (4, 1, 8), (8, 8, 1)])
def test_layer_wise_loads_report_layers_once_every_head_group_has_them(heads, p_tp, d_tp):
    p_spec, d_spec = paired(spec_for(heads, p_tp, layer_groups=2), spec_for(heads, d_tp, layer_groups=2))
    full, d, _, _, arrivals = handoff(p_spec, d_spec, layer_wise=True)
    assert_exact(full, d, d_spec)
    assert arrivals == [(r, end) for r in range(d_tp) for end in (LAYERS // 2, LAYERS)]


def test_fp8_caches_with_scales_cross_tp_degrees():
    kw = {"dtype": "uint8", "fp8_scales": True}
    p_spec, d_spec = paired(spec_for(8, 4, **kw), spec_for(8, 2, **kw))
    full, d, _, _, _ = handoff(p_spec, d_spec)
    assert_exact(full, d, d_spec)


def test_a_corrupt_head_group_fails_only_its_block_and_leaves_the_store():
    p_spec, d_spec = paired(spec_for(8, 4), spec_for(8, 2))
    store = MemoryStore(1 << 26)
    full = monolithic(p_spec)
    p = ReferenceBackend(p_spec, NUM_BLOCKS, store, caches=shard(full, p_spec))
    d = ReferenceBackend(d_spec, NUM_BLOCKS, store)
    keys = block_keys(list(range(3 * BLOCK)), BLOCK)
    for r in range(4):
        p.write(r, keys, P_IDS)
    name = rank_key(keys[1], "value", 3)  # head group 3: D rank 1's second group
    buf = bytearray(1 << 16)
    n = store.batch_get_into([name], [buf])[0]
    buf[7] ^= 0xFF
    store.evict([name])
    store.batch_put_from([name], [buf[:n]])
    assert d.read(0, keys, D_IDS) == 3  # rank 0's heads are untouched
    assert d.read(1, keys, D_IDS) == 1 and d.broken_blocks == 1
    assert store.batch_is_exist([name, rank_key(keys[1], "value", 2)]) == [0, 1]  # only the broken group left
    assert d.query(1, keys) == 1
    assert p.write(3, keys, P_IDS) == 3 and d.read(1, keys, D_IDS) == 3  # P's next write heals it
    assert_exact(full, d, d_spec)


def test_host_tier_flushes_each_head_group():
    p_spec, d_spec = paired(spec_for(8, 1), spec_for(8, 4))
    store = MemoryStore(1 << 26)
    full = monolithic(p_spec)
    p = ReferenceBackend(p_spec, NUM_BLOCKS, store, caches=shard(full, p_spec), host_blocks=4)
    d = ReferenceBackend(d_spec, NUM_BLOCKS, store)
    keys = block_keys(list(range(3 * BLOCK)), BLOCK)
    assert p.swap_out(0, P_IDS, [3, 0, 2]) == 3
    assert p.flush_host(0, keys, [3, 0, 2]) == 3
    for r in range(4):
        assert d.read(r, keys, D_IDS) == 3
    assert_exact(full, d, d_spec)


@pytest.mark.parametrize("change,rule", [
    ({"block_size": 16}, "block_size"),
    ({"head_dim": 16}, "head_dim"),
    ({"dtype": "float16"}, "dtype"),
    ({"layer_groups": 2}, "layer_groups"),
])
def test_pairs_that_cannot_share_objects_are_refused_naming_the_rule(change, rule):
    p = spec_for(8, 2)
    d = CacheSpec(**{**{f: getattr(p, f) for f in ("num_layers", "kv_heads", "block_size", "head_dim", "dtype",
                                                    "tp_size", "total_kv_heads", "layer_groups")}, **change})
    with pytest.raises(ConfigError, match=rule) as err:
        check_pair(p, d)
    assert isinstance(err.value, KVStateError)
    with pytest.raises(ConfigError, match=rule):
        paired(p, d)


def test_block_size_pairs_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="keys chain over a block's tokens"):
        check_pair(spec_for(8, 2), replace(spec_for(8, 2), block_size=16))


def test_head_groups_of_different_sizes_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="store_heads to 2 on both"):
        check_pair(spec_for(8, 4), spec_for(8, 2))
    with pytest.raises(ConfigError, match="heads_total"):
        check_pair(spec_for(8, 2), spec_for(4, 2))


@pytest.mark.parametrize("kw,rule", [
    ({"kv_heads": 3, "tp_size": 2, "total_kv_heads": 8}, "not kv_heads 3"),
    ({"kv_heads": 2, "tp_size": 8, "total_kv_heads": 4}, "kv_heads must be 1"),
    ({"kv_heads": 1, "tp_size": 6, "total_kv_heads": 4}, "multiple of 4"),
    ({"kv_heads": 4, "store_heads": 3}, "must divide"),
    ({"kv_heads": 4, "store_heads": -1}, "store_heads"),
])
def test_impossible_head_layouts_are_refused(kw, rule):
    with pytest.raises(ConfigError, match=rule):
        CacheSpec(num_layers=2, block_size=4, head_dim=8, **kw)


def test_the_default_layout_is_one_object_per_rank():
    spec = CacheSpec(num_layers=2, kv_heads=4, block_size=4, head_dim=8, tp_size=2)
    assert [list(spec.parts(r)) for r in range(2)] == [[0], [1]] and spec.head_groups == 1
    assert spec.heads_total == 8 and spec.replicas == 1 and all(spec.writes(r) for r in range(2))
    rep = spec_for(4, 8)
    assert [list(rep.parts(r)) for r in range(8)] == [[h] for h in range(4) for _ in range(2)]
    assert [rep.writes(r) for r in range(8)] == [True, False] * 4
