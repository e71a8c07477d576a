"""The numpy backend through an arena whose slot is one object: straight into and out of the
slots, checksummed as it copies, interchangeable with the staged path."""
import threading

import numpy as np
import pytest
from rigs import small_spec

from kvstate import FenceError
from kvstate._keys import block_keys
from kvstate.backends import ReferenceBackend, _reference
from kvstate.backends._arena import ArenaStore
from kvstate.backends._integrity import SUM64, XXH3
from kvstate.backends._stores import PARALLEL_BYTES


def arena_for(spec, slots: int = 64) -> ArenaStore:
    """An arena whose big slot is one (block, kind) object of ``spec`` (one layer group's)."""
    slot = spec.group_layers * spec.chunk_bytes("key")
    return ArenaStore.create(slot, slots, small_bytes=min(1024, slot // 2))


def filled(spec, store, blocks: int = 16, seed: int = 0) -> ReferenceBackend:
    b = ReferenceBackend(spec, blocks, store)
    rng = np.random.default_rng(seed)
    for kind in spec.kinds:
        for layer in b.caches[0][kind]:
            layer[:] = rng.standard_normal(layer.shape)
    return b


def rows_taken(backend: ReferenceBackend) -> list[int]:
    """The block counts of each use of the staged path (host rows), recorded as it runs."""
    taken: list[int] = []
    real = backend._buffers
    backend._buffers = lambda m, g: taken.append(m) or real(m, g)
    return taken


def no_rows(backend: ReferenceBackend) -> None:
    """Make the staged path (host rows) fail if it is taken."""
    def refuse(*_a, **_k):
        raise AssertionError("the staged path was taken")
    backend._buffers = refuse


@pytest.fixture
def spec():
    return small_spec(tp=1, num_layers=3)


def without_helper(monkeypatch) -> None:
    """As where the C helper was not built: XXH3 chunk by chunk, numpy's copies."""
    monkeypatch.setattr(_reference, "stream_copy", None)
    monkeypatch.setattr(_reference, "copy_sum64", None)


@pytest.fixture(params=["C helper", "numpy copies"])
def copies(request, monkeypatch):
    """Both ways a chunk is copied: the C helper's (SUM64 as it copies), or numpy's (XXH3)."""
    if request.param == "numpy copies":
        without_helper(monkeypatch)
    elif _reference.copy_sum64 is None:
        pytest.skip("the C helper was not built here")
    return request.param


def test_blocks_go_straight_into_and_out_of_the_slots_byte_exact(spec, copies):
    store = arena_for(spec)
    try:
        p, d = filled(spec, store), ReferenceBackend(spec, 16, store)
        no_rows(p)
        no_rows(d)
        keys = block_keys(list(range(20)), 4)
        assert p.write(0, keys, [3, 1, 7, 0, 9]) == 5
        assert len(store) == 5 * 3  # two kinds and a manifest a block
        assert d.read(0, keys, [2, 4, 6, 8, 10]) == 5
        for kind in spec.kinds:
            for a, b in zip([3, 1, 7, 0, 9], [2, 4, 6, 8, 10]):
                assert d.block_bytes(0, kind, b) == p.block_bytes(0, kind, a)
        assert not d.block_bytes(0, "key", 5).strip(b"\0")  # nothing else written
        assert p._zero_copy() and d._zero_copy()
    finally:
        store.close()


@pytest.mark.parametrize("writer_staged", [True, False])
def test_the_zero_copy_and_the_staged_paths_read_each_others_blocks(spec, writer_staged, copies):
    """Same objects, same XXH3 manifests: a block stored one way is read the other way."""
    store = arena_for(spec)
    try:
        p, d = filled(spec, store, seed=1), ReferenceBackend(spec, 16, store)
        (p if writer_staged else d)._in_place = False
        no_rows(d if writer_staged else p)
        keys = block_keys(list(range(12)), 4)
        assert p.write(0, keys, [5, 6, 2]) == 3
        assert d.read(0, keys, [0, 1, 3]) == 3
        assert all(d.block_bytes(0, k, b) == p.block_bytes(0, k, a)
                   for k in spec.kinds for a, b in zip([5, 6, 2], [0, 1, 3]))
    finally:
        store.close()


def test_a_flipped_byte_stops_the_read_at_its_block_and_evicts_that_block_only(spec, copies):
    store = arena_for(spec)
    try:
        p, d = filled(spec, store, seed=2), ReferenceBackend(spec, 16, store)
        keys = block_keys(list(range(16)), 4)
        assert p.write(0, keys, [0, 1, 2, 3]) == 4
        name = p.objects.names(0, keys[2:3])[1]  # block 2's value object
        store.slots()[store.locate([name])[0].slot][-1] ^= 0x10
        assert d.read(0, keys, [4, 5, 6, 7]) == 2
        assert d.broken_blocks == 1
        assert d.query(0, keys) == 2  # block 2 evicted, so the next write stores it again
        assert all(d.block_bytes(0, k, 4 + i) == p.block_bytes(0, k, i) for k in spec.kinds for i in range(2))
        assert p.write(0, keys[2:], [2, 3]) == 2 and d.read(0, keys, [4, 5, 6, 7]) == 4
        assert d.block_bytes(0, "value", 6) == p.block_bytes(0, "value", 2)
    finally:
        store.close()


def test_a_slot_taken_back_while_the_read_copies_ends_the_pass_there_without_evicting(spec, monkeypatch):
    """A block whose slot changed hands during the copy was scattered but is not counted by
    that pass, and nothing is evicted: the bytes were not proven wrong, they were overtaken.
    Its key still stored, the read goes on from it (as ``copies`` were: the pass after counts)."""
    store = arena_for(spec)
    try:
        p, d = filled(spec, store, seed=3), ReferenceBackend(spec, 16, store)
        keys = block_keys(list(range(16)), 4)
        assert p.write(0, keys, [0, 1, 2, 3]) == 4
        real, passes = store.unchanged, []

        def first_pass_overtaken(places):
            passes.append(len(places))
            ok = real(places)
            return [i != 3 for i in range(len(ok))] if len(passes) == 1 else ok
        monkeypatch.setattr(store, "unchanged", first_pass_overtaken)
        assert d.read(0, keys, [4, 5, 6, 7]) == 4  # place 3 is one of block 1's objects
        assert passes == [8, 6]  # two objects a block: the first pass counted block 0, the second 1-3
        assert d.broken_blocks == 0 and d.query(0, keys) == 4
    finally:
        store.close()


def test_a_write_past_the_slots_stores_the_blocks_that_fit_and_keeps_no_claim(spec):
    store = ArenaStore.create(spec.chunk_bytes("key") * spec.layers, 6, small_bytes=128, small_slots=8)
    try:
        p = filled(spec, store, seed=4)
        store.claim(["held"])  # a live writer's claim: five big slots left for this write
        keys = block_keys(list(range(16)), 4)
        assert p.write(0, keys[:3], [0, 1, 2]) == 2  # block 2 got a slot for its keys only
        assert sorted(store.big.state.tolist()) == [0, 1, 2, 2, 2, 2]  # "held" WRITING, 4 objects STORED
        assert int((store.small.state == 1).sum()) == 0
    finally:
        store.close()


def test_a_fence_passed_before_the_gather_stores_nothing_and_frees_every_claim(spec):
    store = arena_for(spec)
    try:
        p = filled(spec, store)
        keys = block_keys(list(range(8)), 4)
        with pytest.raises(FenceError, match=r"gather blocks \[1, 2\]"):
            p.write(0, keys, [1, 2], guard=lambda: False)
        assert len(store) == 0 and not store.big.state.any() and not store.small.state.any()
        d = ReferenceBackend(spec, 16, store)
        assert p.write(0, keys, [1, 2]) == 2
        with pytest.raises(FenceError, match="scatter into blocks"):
            d.read(0, keys, [3, 4], guard=lambda: False)
        assert all(not layer.any() for k in spec.kinds for layer in d.caches[0][k])
    finally:
        store.close()


def test_layer_group_objects_move_in_place_whole_and_group_by_group():
    spec = small_spec(tp=1, num_layers=6, layer_groups=3)
    store = arena_for(spec)
    try:
        p, d = filled(spec, store, seed=5), ReferenceBackend(spec, 16, store)
        no_rows(p)
        no_rows(d)
        keys = block_keys(list(range(12)), 4)
        assert p.write(0, keys, [3, 1, 6]) == 3
        assert len(store) == 3 * 3 * 3  # (two kinds and a manifest) a group a block
        seen: list[int] = []
        assert d.read(0, keys, [0, 2, 4], arrived=lambda layers, _: seen.append(layers)) == 3
        assert seen == [2, 4, 6]
        assert all(d.block_bytes(0, k, b) == p.block_bytes(0, k, a) for k in spec.kinds
                   for a, b in zip([3, 1, 6], [0, 2, 4]))
        reported: list[int] = []
        lw = block_keys(list(range(100, 112)), 4)
        assert p.write(0, lw, [7, 8, 9], layers=lambda n: reported.append(n) or True) == 3
        assert reported == [2, 4, 6] and d.read(0, lw, [10, 11, 12]) == 3
        assert d.block_bytes(0, "key", 12) == p.block_bytes(0, "key", 9)
    finally:
        store.close()


@pytest.mark.parametrize("writer, reader", [("helper", "none"), ("none", "helper")])
def test_a_block_summed_by_either_algorithm_is_read_by_a_reader_with_or_without_the_helper(spec, writer, reader,
                                                                                            monkeypatch):
    """A writer with the C helper stores SUM64 manifests, one without XXH3. A reader without
    the helper reads SUM64 through the host rows; a reader with it reads XXH3 in place."""
    if _reference.copy_sum64 is None:
        pytest.skip("the C helper was not built here")
    store = arena_for(spec)
    try:
        p, d = filled(spec, store, seed=6), ReferenceBackend(spec, 16, store)
        keys = block_keys(list(range(8)), 4)
        with monkeypatch.context() as m:
            if writer == "none":
                without_helper(m)
            assert p.write(0, keys, [1, 2]) == 2
        algorithm = SUM64 if writer == "helper" else XXH3
        assert all(alg == algorithm for alg, _ in p.objects.read_manifests(0, keys, None)[1])
        taken = rows_taken(d)
        if reader == "none":
            without_helper(monkeypatch)
        assert d.read(0, keys, [5, 6]) == 2
        assert taken == ([2] if reader == "none" else [])
        assert all(d.block_bytes(0, k, b) == p.block_bytes(0, k, a) for k in spec.kinds for a, b in ((1, 5), (2, 6)))
    finally:
        store.close()


def test_blocks_under_two_algorithms_in_one_read_go_through_the_host_rows(spec, monkeypatch):
    if _reference.copy_sum64 is None:
        pytest.skip("the C helper was not built here")
    store = arena_for(spec)
    try:
        p, d = filled(spec, store, seed=8), ReferenceBackend(spec, 16, store)
        keys = block_keys(list(range(8)), 4)
        assert p.write(0, keys[:1], [1]) == 1  # SUM64
        with monkeypatch.context() as m:
            without_helper(m)
            assert p.write(0, keys[1:], [2]) == 1  # XXH3
        taken = rows_taken(d)
        assert d.read(0, keys, [5, 6]) == 2 and taken == [2]
        assert d.block_bytes(0, "value", 6) == p.block_bytes(0, "value", 2)
    finally:
        store.close()


def test_dense_caches_of_whole_words_are_summed_by_the_helper_and_others_are_not(spec):
    store = arena_for(spec)
    try:
        b = ReferenceBackend(spec, 8, store)
        assert b._summable(0) == (_reference.copy_sum64 is not None)
        b.caches[0]["key"][1] = np.zeros((16,) + spec.block_shape("key"), spec.kind_dtype("key"))[::2]
        assert not b._summable(0)
    finally:
        store.close()


def test_a_batch_past_the_parallel_size_moves_on_the_copy_threads_and_they_end_at_close():
    spec = small_spec(tp=1, num_layers=4, kv_heads=8, block_size=16, head_dim=128)
    n = PARALLEL_BYTES // spec.block_bytes() + 4
    store = arena_for(spec, slots=2 * n + 4)
    try:
        p, d = filled(spec, store, blocks=n, seed=7), ReferenceBackend(spec, n, store)
        keys = block_keys(list(range(n * 16)), 16)
        ids = list(range(n))[::-1]
        assert p.write(0, keys, ids) == n
        assert any(t.name.startswith("kvstate-move") for t in threading.enumerate())
        assert d.read(0, keys, list(range(n))) == n
        assert all(d.block_bytes(0, k, i) == p.block_bytes(0, k, ids[i])
                   for k in spec.kinds for i in (0, n // 2, n - 1))
        for b in (p, d):
            b.close()
        assert not any(t.name.startswith("kvstate-move") for t in threading.enumerate())
    finally:
        store.close()


def test_scales_of_another_size_keep_the_staged_path():
    spec = small_spec(tp=1, dtype="uint8", has_value=False, fp8_scales=True)
    store = arena_for(spec)
    try:
        assert not ReferenceBackend(spec, 4, store)._zero_copy()
    finally:
        store.close()


def _during_reads(store: ArenaStore, act) -> list[int]:
    """Run ``act()`` inside each check a zero-copy read makes after copying (between its copy
    and its count): the moment another put or an eviction lands mid-read. Returns the calls."""
    calls: list[int] = []
    real = store.unchanged

    def unchanged(places):
        calls.append(len(places))
        act(len(calls))
        return real(places)
    store.unchanged = unchanged
    return calls


def test_a_block_another_put_replaced_mid_read_is_read_again(spec, copies):
    """P puts the same blocks again while D reads them (two prompts sharing a prefix, written
    at once): the slots D copied from are taken back, so its first pass counts nothing, and it
    reads them again from the new slots, whole and byte exact, instead of failing the request."""
    from kvstate.backends._arena import ARENA_REREADS

    store = arena_for(spec)
    try:
        p, d = filled(spec, store, seed=3), ReferenceBackend(spec, 16, store)
        keys, ids = block_keys(list(range(20)), 4), [3, 1, 7, 0, 9]
        assert p.write(0, keys, ids) == 5
        calls = _during_reads(store, lambda i: i == 1 and p.write(0, keys, ids))
        assert d.read(0, keys, [2, 4, 6, 8, 10]) == 5
        assert len(calls) == 2 and ARENA_REREADS >= 1  # the first pass lost the race, the second counted
        assert all(d.block_bytes(0, k, b) == p.block_bytes(0, k, a)
                   for k in spec.kinds for a, b in zip(ids, [2, 4, 6, 8, 10]))
    finally:
        store.close()


def test_an_evicted_block_stays_a_miss_and_rereads_are_bounded(spec, copies):
    """A block gone from the arena mid-read is a miss (no read again); one replaced on every
    pass is given up after ARENA_REREADS more passes, short, never waited on forever."""
    from kvstate.backends._arena import ARENA_REREADS

    store = arena_for(spec)
    try:
        p, d = filled(spec, store, seed=4), ReferenceBackend(spec, 16, store)
        keys, ids = block_keys(list(range(20)), 4), [3, 1, 7, 0, 9]
        assert p.write(0, keys, ids) == 5
        names = p.objects.names(0, keys[2:3], None)
        calls = _during_reads(store, lambda i: i == 1 and store.evict(names))
        assert d.read(0, keys, [2, 4, 6, 8, 10]) == 2 and len(calls) == 1
        assert p.write(0, keys, ids) == 5
        calls = _during_reads(store, lambda i: p.write(0, keys, ids))
        assert d.read(0, keys, [2, 4, 6, 8, 10]) == 0
        assert len(calls) == 1 + ARENA_REREADS
    finally:
        store.close()


def test_a_staged_read_of_a_block_another_put_replaced_mid_read_copies_it_again(spec, copies):
    """The same race on the staged path (host rows, as a reader without the in-place path
    takes): the arena's get copies the replaced objects again from their new slots."""
    store = arena_for(spec)
    try:
        p, d = filled(spec, store, seed=5), ReferenceBackend(spec, 16, store)
        d._in_place = False
        keys, ids = block_keys(list(range(20)), 4), [3, 1, 7, 0, 9]
        assert p.write(0, keys, ids) == 5
        real, seen = store._copy, []

        def copy(pairs):
            seen.append(len(pairs))
            store._copy = real
            if len(seen) == 1:
                assert p.write(0, keys, ids) == 5
            store._copy = copy
            real(pairs)
        store._copy = copy
        assert d.read(0, keys, [2, 4, 6, 8, 10]) == 5
        assert len(seen) >= 2  # copied again
        assert all(d.block_bytes(0, k, b) == p.block_bytes(0, k, a)
                   for k in spec.kinds for a, b in zip(ids, [2, 4, 6, 8, 10]))
    finally:
        store.close()
