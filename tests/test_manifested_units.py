"""A store backend's blocks as objects with manifests (``backends/_manifested.py``), part by part,
each against its rule worked by hand: the store's verify setting, one geometry per layer group,
which leading blocks count, where a piece's manifests go, and when a block read broken leaves
the store (a failed read never evicts: the object may be another writer's, in flight)."""
from __future__ import annotations

import numpy as np
import xxhash

from kvstate import CacheSpec
from kvstate.backends import MemoryStore
from kvstate.backends._base import TOO_LARGE
from kvstate.backends._integrity import FORMAT_VERSION, geometry_id
from kvstate.backends._manifested import BlockObjects

FAILED = -1  # a get that did not answer (missing object, transport error)


def spec(**kw) -> CacheSpec:
    args = dict(num_layers=4, kv_heads=2, block_size=16, head_dim=64, dtype="bfloat16", tp_size=1)
    args.update(kw)
    return CacheSpec(**args)


class Evictions:
    """A store that records what a read evicts (and has no verify setting of its own)."""

    def __init__(self) -> None:
        self.evicted: list[list[str]] = []

    def evict(self, keys) -> int:
        self.evicted.append(list(keys))
        return len(keys)


def test_a_store_without_a_verify_setting_is_verified_and_a_trusted_one_is_not():
    assert BlockObjects(spec(), Evictions()).verify is True
    trusted = MemoryStore(1 << 20)
    trusted.verify = False
    assert BlockObjects(spec(), trusted).verify is False


def test_each_layer_group_has_the_geometry_of_its_own_layers():
    s = spec(layer_groups=2)
    bo = BlockObjects(s, Evictions())
    assert bo.geometry == {None: geometry_id(s, None), 0: geometry_id(s, 0), 1: geometry_id(s, 1)}
    assert bo.geometry[0] != bo.geometry[None]  # two layers against four


def test_the_geometry_id_is_the_hash_of_its_documented_text():
    """The id is on disk in every manifest: its text is part of the format."""
    s = spec()
    kinds = ",".join(f"{k}:{s.kind_dtype(k)}:{s.object_shape(k)}" for k in s.kinds)
    text = f"kvstate/{FORMAT_VERSION}/layers 4/block 16/heads 2/{kinds}"
    assert geometry_id(s, None) == xxhash.xxh3_64_intdigest(text.encode())
    assert "," in kinds and kinds.count(":") == 4  # key and value, each dtype and shape


def test_a_block_counts_only_when_its_objects_and_every_manifest_are_ok():
    bo = BlockObjects(spec(layer_groups=2), Evictions())  # 2 kinds x 2 groups: 4 objects a block
    keys = ["a", "b", "c"]
    objects, manifests = [True] * 12, [True] * 6  # then one manifest per block and group

    def leading(o, m):
        return bo.leading_blocks(keys, None, o + m)
    assert leading(objects, manifests) == 3
    assert leading(objects, manifests[:3] + [False] + manifests[4:]) == 1  # block b's group 1 manifest
    assert leading(objects, manifests[:5] + [False]) == 2
    assert leading(objects[:5] + [False] + objects[6:], manifests) == 1  # one of block b's objects


def test_a_piece_without_sizes_stores_its_manifests_and_one_with_sizes_does_not():
    s = spec()
    views = [memoryview(np.full(64, i, np.uint8)) for i, _ in enumerate(s.kinds)]
    store = MemoryStore(1 << 22)
    bo = BlockObjects(s, store)
    assert bo.put_piece(0, ["whole"], None, views, None) == 1
    assert set(store.keys()) == set(bo.names(0, ["whole"]) + bo.manifest_names(0, ["whole"], None))
    sizes: list[int] = []
    assert bo.put_piece(0, ["bare"], None, views, sizes) == 1
    assert sizes == [v.nbytes for v in views]
    assert set(bo.names(0, ["bare"])) <= set(store.keys())
    assert not set(bo.manifest_names(0, ["bare"], None)) & set(store.keys())


def test_a_deferred_read_without_a_sum_for_every_block_counts_none():
    bo = BlockObjects(spec(), Evictions())
    deferred = [("a", [1, 2]), ("b", [3, 4])]
    assert bo.verify_deferred(0, deferred, [[1, 2]]) == 0
    assert bo.verify_deferred(0, deferred, [[1, 2], [3, 4]]) == 2
    assert bo.verify_deferred(0, deferred, [[1, 2], [3, 5]]) == 1 and bo.broken_blocks == 1


def test_blocks_arrive_by_their_own_group_s_manifest():
    bo = BlockObjects(spec(layer_groups=2), Evictions())
    # objects in names' order (block, kind, group): block 0 is [k g0, k g1, v g0, v g1]
    got = [10, 11, 10, 11, 12, 13, 12, 13]
    vouched = [(0, [(n, 0), (n, 0)]) for n in (10, 11, 12, 13)]  # block 0 g0, g1, block 1 g0, g1
    assert bo.arrived(["a", "b"], [0, 1], got, vouched) == 2
    assert bo.arrived(["a", "b"], [0, 1], got[:7] + [99], vouched) == 1
    assert bo.arrived(["a", "b"], [0, 1], got, vouched[:3]) == 1


def test_a_block_read_broken_is_evicted_and_one_that_failed_to_read_is_not():
    s = spec()  # one group: 2 objects a block, one manifest
    keys = ["a", "b", "c"]

    def evicted(got, read, i):
        store = Evictions()
        BlockObjects(s, store).evict_if_broken(0, keys, None, got, read, i)
        return store.evicted
    whole = [5] * 6
    bo = BlockObjects(s, Evictions())
    names_b = bo.names(0, ["b"]) + bo.manifest_names(0, ["b"], None)
    assert evicted(whole, [5, 5, 5], 1) == [names_b]  # came whole but failed its check: broken
    assert evicted(whole[:2] + [0] + whole[3:], [5, 5, 5], 1) == [names_b]  # came empty: broken
    assert evicted(whole[:2] + [TOO_LARGE] + whole[3:], [5, 5, 5], 1) == [names_b]  # stored too large
    assert evicted(whole[:2] + [FAILED] + whole[3:], [5, 5, 5], 1) == []  # an object's get failed
    assert evicted(whole, [5, FAILED, 5], 1) == []  # its manifest's get failed
    assert evicted(whole, [FAILED, 5, 5], 1) == [names_b]  # another block's manifest: not its own
    assert evicted(whole, [5, 5, FAILED], 1) == [names_b]
    assert evicted(whole, [5, 5, 5], 3) == []  # past the last block: nothing to evict


class Puts:
    """A store whose puts answer the statuses given (0: stored), recording the names put."""

    def __init__(self, statuses: list[int], verify: bool = True) -> None:
        self.statuses, self.verify, self.names = statuses, verify, []

    def batch_put_hashed(self, names, views):
        self.names += list(names)
        return list(self.statuses), [1] * len(names)

    def batch_put_from(self, names, views):
        self.names += list(names)
        return list(self.statuses) if len(names) == len(self.statuses) else [0] * len(names)


def two_groups() -> tuple[CacheSpec, list[memoryview]]:
    s = spec(layer_groups=2)
    return s, [memoryview(bytes([i]) * 8) for i in range(4)]  # 2 blocks of group 1: key and value each


def test_a_put_of_one_group_counts_blocks_by_that_group_s_objects():
    s, views = two_groups()
    for verify, put in ((True, "put"), (False, "put"), (False, "put_bare")):
        store = Puts([0, 0, 0, 1], verify)  # block b's value object failed
        bo = BlockObjects(s, store)
        assert getattr(bo, put)(0, ["a", "b"], [1], views) == 1
        assert store.names[:4] == bo.names(0, ["a", "b"], [1])
    assert BlockObjects(s, Puts([1, 0, 0, 0])).put(0, ["a", "b"], [1], views) == 0  # the first failed: none


def test_a_piece_of_one_group_is_named_for_that_group():
    s, views = two_groups()
    store = MemoryStore(1 << 20)
    bo = BlockObjects(s, store)
    assert bo.put_piece(0, ["a", "b"], [1], views, None) == 2
    assert set(store.keys()) == set(bo.names(0, ["a", "b"], [1]) + bo.manifest_names(0, ["a", "b"], [1]))


def test_a_trusted_store_s_get_counts_leading_blocks_whose_objects_all_came_whole():
    s = spec()
    store = MemoryStore(1 << 20)
    store.verify = False
    bo = BlockObjects(s, store)
    views = [memoryview(bytes([i]) * 8) for i in range(4)]  # 2 blocks, key and value
    assert bo.put(0, ["a", "b"], None, views) == 2
    landed: list[int] = []
    out = [memoryview(bytearray(8)) for _ in range(4)]
    assert bo.get(0, ["a", "b"], None, out, scatter=landed.append) == 2 and landed == [2]
    assert [bytes(v) for v in out] == [bytes(v) for v in views]
    store.evict(bo.names(0, ["a"])[:1])  # block a's key object gone
    landed.clear()
    assert bo.get(0, ["a", "b"], None, [memoryview(bytearray(8)) for _ in range(4)], scatter=landed.append) == 0
    assert landed == []  # nothing counted: nothing scattered
    store.evict(bo.names(0, ["b"])[1:])  # and block b's value object
    assert bo.get(0, ["b"], None, [memoryview(bytearray(8)) for _ in range(2)]) == 0
