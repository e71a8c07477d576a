"""The zero-copy embedded store (kvstate.backends._arena): a Store like the others, shared by
the processes of a host, safe against a writer killed mid-put and a reader overtaken by a later
put. Its file (made, opened, bounded, removed): ``tests/test_arena_file.py``."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from rigs import ARENA_SLOT as SLOT
from rigs import blob

from kvstate import ValidationError
from kvstate.backends._arena import ArenaStore, Place
from kvstate.backends._base import MISSING, TOO_LARGE


def test_objects_round_trip_by_size_class_and_the_too_large_are_refused(arena):
    assert arena.batch_put_from(["a", "m", "huge"], [blob(1), b"manifest", bytes(SLOT + 1)]) == [0, 0, TOO_LARGE]
    out = [bytearray(SLOT), bytearray(64), bytearray(8)]
    assert arena.batch_get_into(["a", "m", "a"], out) == [SLOT, 8, TOO_LARGE]
    assert bytes(out[0]) == blob(1).tobytes() and bytes(out[1][:8]) == b"manifest"
    assert arena.batch_is_exist(["a", "m", "huge", "b"]) == [1, 1, 0, 0]
    assert arena.evict(["a", "b"]) == 1 and arena.batch_get_into(["a"], [bytearray(SLOT)]) == [MISSING]
    assert len(arena) == 1 and arena.used_bytes == 8


def test_a_full_class_evicts_its_least_recently_used_object(arena):
    arena.batch_put_from([f"k{i}" for i in range(4)], [blob(i) for i in range(4)])
    arena.batch_get_into(["k0"], [bytearray(SLOT)])  # k0 used: k1 is the oldest now
    assert arena.batch_put_from(["k4"], [blob(4)]) == [0]
    assert arena.batch_is_exist([f"k{i}" for i in range(5)]) == [1, 0, 1, 1, 1]
    assert arena.evictions == 1


def test_a_put_of_a_key_replaces_its_object(arena):
    arena.batch_put_from(["k"], [blob(1)])
    arena.batch_put_from(["k"], [blob(2)])
    out = bytearray(SLOT)
    assert arena.batch_get_into(["k"], [out]) == [SLOT] and bytes(out) == blob(2).tobytes()
    assert len(arena) == 1


def test_a_claimed_slot_filled_in_place_is_put_without_a_copy_and_a_stray_claim_is_let_go(arena):
    slot = arena.claim(["k"])[0]
    view = arena.slots()[slot]
    view[:] = blob(3)
    assert arena.batch_is_exist(["k"]) == [0]  # claimed is not stored
    assert arena.batch_put_from(["k"], [view]) == [0]
    assert arena.locate(["k"])[0].slot == slot  # the object is where it was gathered
    out = bytearray(SLOT)
    arena.batch_get_into(["k"], [out])
    assert bytes(out) == blob(3).tobytes()
    claimed = arena.claim(["x", "y", "z"])
    arena.release(["x", "y", "z"])
    assert arena.batch_put_from([f"n{i}" for i in range(3)], [blob(i) for i in range(3)]) == [0, 0, 0]
    assert set(claimed) <= set(range(4)) and arena.evictions == 0


def test_a_reader_overtaken_by_a_later_put_is_told_so(arena):
    arena.batch_put_from([f"k{i}" for i in range(4)], [blob(i) for i in range(4)])
    place = arena.locate(["k1"])[0]
    assert arena.unchanged([place]) == [True]
    arena.evict(["k1"])
    arena.batch_put_from(["new"], [blob(9)])  # may take k1's slot
    assert arena.unchanged([place]) == [False]


def test_every_slot_claimed_by_a_live_writer_fails_a_put_at_once(arena):
    arena.claim([f"c{i}" for i in range(4)])
    t = time.monotonic()
    assert arena.batch_put_from(["late"], [blob(1)]) == [MISSING]
    assert time.monotonic() - t < 1.0


WRITER = f"""
import sys, time
import numpy as np
from kvstate.backends._arena import ArenaStore, Place
a = ArenaStore.open(sys.argv[1])
if sys.argv[2] == "put":
    print(a.batch_put_from(["from-child"], [np.full({SLOT}, 7, np.uint8)]), flush=True)
else:
    slots = a.claim(["half-0", "half-1", "half-2", "half-3"])
    a.slots()[slots[0]][:100] = 9  # half written when killed
    print("claimed", flush=True)
    time.sleep(60)
"""


def test_an_object_another_process_put_is_read_here(arena):
    out = subprocess.run([sys.executable, "-c", WRITER, arena.path, "put"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[0]"
    buf = bytearray(SLOT)
    assert arena.batch_get_into(["from-child"], [buf]) == [SLOT] and set(buf) == {7}


def test_a_writer_killed_mid_put_leaves_nothing_visible_and_its_slots_return(arena):
    arena.batch_put_from(["kept"], [b"m" * 8])
    p = subprocess.Popen([sys.executable, "-c", WRITER, arena.path, "claim"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "claimed"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    assert arena.batch_is_exist([f"half-{i}" for i in range(4)]) == [0, 0, 0, 0]
    assert arena.batch_put_from([f"k{i}" for i in range(4)], [blob(i) for i in range(4)]) == [0, 0, 0, 0]
    assert arena.reclaimed == 4
    assert arena.batch_is_exist(["kept", "k3"]) == [1, 1]


def test_keys_sharing_a_hash_are_told_apart_by_their_bytes(arena, monkeypatch):
    import kvstate.backends._arena as arena_module

    monkeypatch.setattr(arena_module.xxhash, "xxh3_64_intdigest", lambda b: 42)
    names = ["key-a", "key-b", "a-longer-key-c"]
    assert arena.batch_put_from(names, [blob(i) for i in range(3)]) == [0, 0, 0]
    for i, k in enumerate(names[::-1]):
        out = bytearray(SLOT)
        assert arena.batch_get_into([k], [out]) == [SLOT] and bytes(out) == blob(2 - i).tobytes()
    assert arena.batch_is_exist(["key-", "key-b", ""[:0] or "x"]) == [0, 1, 0]
    assert arena.evict(["key-b"]) == 1 and arena.batch_is_exist(names) == [1, 0, 1]


def test_empty_batches_change_nothing(arena):
    assert arena.batch_put_from([], []) == [] and arena.batch_get_into([], []) == []
    assert arena.claim([]) == [] and arena.locate([]) == [] and arena.evict([]) == 0 and len(arena) == 0


def test_a_key_twice_in_a_batch_stores_its_last_buffer_and_claims_nothing_more(arena):
    assert arena.batch_put_from(["k", "j", "k"], [blob(1), blob(2), blob(3)]) == [0, 0, 0]
    out = bytearray(SLOT)
    assert arena.batch_get_into(["k"], [out]) == [SLOT] and bytes(out) == blob(3).tobytes()
    assert int((arena.big.state == 1).sum()) == 0 and len(arena) == 2


def test_staged_objects_are_invisible_until_published_and_a_stale_claim_publishes_nothing(arena):
    assert arena.stage(["m", "n"], [b"manifest", blob(1)]) == [0, 0]
    assert arena.batch_is_exist(["m", "n"]) == [0, 0]
    assert arena.publish(["m", "n", "never-staged"]) == [0, 0, MISSING]
    assert arena.batch_is_exist(["m", "n"]) == [1, 1]
    slot = arena.claim(["x"])[0]
    arena.big.gen[slot] += 1  # as if its writer had been thought dead and the slot taken back
    assert arena.publish(["x"]) == [MISSING] and arena.lost_puts == 1


def test_a_key_that_is_a_prefix_of_a_stored_one_is_not_found_even_sharing_its_hash(arena, monkeypatch):
    import kvstate.backends._arena as arena_module

    monkeypatch.setattr(arena_module.xxhash, "xxh3_64_intdigest", lambda b: 42)
    arena.batch_put_from(["key-long"], [blob(1)])
    assert arena.batch_is_exist(["key", "key-long"]) == [0, 1]
    assert arena.locate(["key"]) == [Place(-1, 0, 0)]


def test_filled_in_place_means_the_claims_own_slot_and_generation_at_its_own_length(arena):
    slots = arena.claim(["a", "b"])
    gens = [int(arena.big.gen[s]) for s in slots]
    for s in slots:
        arena.slots()[s][:100] = 5
    assert arena.batch_put_from(["a", "b"], [arena.slots()[s][:100] for s in slots]) == [0, 0]
    assert [(p.slot, p.gen, p.length) for p in arena.locate(["a", "b"])] == \
        [(slots[0], gens[0], 100), (slots[1], gens[1], 100)]  # no second claim, no copy
    assert arena.batch_get_into(["a", "b"], [bytearray(SLOT), bytearray(SLOT)]) == [100, 100]


def test_a_place_is_judged_by_its_slot_state_and_generation_and_bad_places_are_refused(arena):
    arena.batch_put_from([f"k{i}" for i in range(4)], [blob(i) for i in range(4)])
    places = arena.locate([f"k{i}" for i in range(4)])
    assert sorted(p.slot for p in places) == [0, 1, 2, 3]
    assert arena.unchanged(places) == [True] * 4  # slot 0 too
    assert arena.unchanged([Place(-1, 0, 0)]) == [False]
    for bad in ([Place(4, 0, 0)], [Place(-2, 0, 0)], [(0, 1, 2)], "x"):
        with pytest.raises(ValidationError, match="unchanged"):
            arena.unchanged(bad)


def test_locate_marks_slot_zero_used_too_so_eviction_spares_it(arena):
    arena.batch_put_from([f"k{i}" for i in range(4)], [blob(i) for i in range(4)])
    first = arena.locate(["k0"])[0]
    assert first.slot == 0
    arena.batch_put_from(["new"], [blob(9)])
    assert arena.batch_is_exist(["k0", "k1"]) == [1, 0]  # k1, not k0, was the least recently used


def test_evictions_take_only_what_a_put_lacks_and_count_up(arena):
    arena.batch_put_from(["a", "b", "c"], [blob(i) for i in range(3)])  # one slot still free
    assert arena.batch_put_from(["d", "e"], [blob(3), blob(4)]) == [0, 0]
    assert arena.evictions == 1 and arena.batch_is_exist(["a", "b", "c"]) == [0, 1, 1]
    arena.batch_put_from(["f"], [blob(5)])
    assert arena.evictions == 2


def test_claiming_a_key_again_lets_the_first_claim_go_and_releasing_the_unclaimed_is_harmless(arena):
    arena.claim(["k"])
    arena.claim(["k"])
    assert int((arena.big.state == 1).sum()) == 1
    arena.release(["k", "never-claimed"])
    assert int((arena.big.state == 1).sum()) == 0


def test_a_live_writers_claims_are_never_taken_from_it(arena):
    p = subprocess.Popen([sys.executable, "-c", WRITER, arena.path, "claim"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "claimed"  # it holds all four slots, alive
        assert arena.batch_put_from(["mine"], [blob(1)]) == [MISSING]
        assert arena.reclaimed == 0
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    assert arena.batch_put_from(["mine", "again"], [blob(1), blob(2)]) == [0, 0] and arena.reclaimed == 4


def test_a_large_batch_of_keys_of_every_length_is_found_exactly(tmp_path):
    """The index is searched once per batch (the batch's hashes sorted, the slots' looked up in
    them): across 300 keys of lengths 1 to 40, stored or not, asked in any order, each answer
    is that key's own."""
    rng = np.random.default_rng(5)
    a = ArenaStore.create(64, 8, small_bytes=32, small_slots=400, directory=tmp_path)
    try:
        keys = [f"k{i}" + "x" * int(rng.integers(0, 38)) for i in range(300)]
        stored = set(keys[::3])
        assert a.batch_put_from(sorted(stored), [bytes([i % 256]) * 8 for i in range(len(stored))]) == \
            [0] * len(stored)
        order = list(rng.permutation(len(keys)))
        asked = [keys[i] for i in order]
        assert a.batch_is_exist(asked) == [int(k in stored) for k in asked]
        outs = [bytearray(8) for _ in stored]
        assert a.batch_get_into(sorted(stored)[::-1], outs) == [8] * len(stored)
        assert [bytes(o) for o in outs[::-1]] == [bytes([i % 256]) * 8 for i in range(len(stored))]
        assert a.evict(asked) == len(stored) and len(a) == 0
    finally:
        a.close()


def test_a_key_whose_hash_is_zero_is_stored_and_found_all_the_same(arena, monkeypatch):
    import kvstate.backends._arena as arena_module

    monkeypatch.setattr(arena_module.xxhash, "xxh3_64_intdigest", lambda b: 0)  # 0 marks an empty slot
    assert arena.batch_put_from(["zero", "nil"], [blob(1), b"m"]) == [0, 0]
    assert arena.batch_is_exist(["nil", "zero", "none"]) == [1, 1, 0]
    out = bytearray(SLOT)
    assert arena.batch_get_into(["zero"], [out]) == [SLOT] and bytes(out) == blob(1).tobytes()


def test_a_hash_shared_inside_a_batch_of_other_hashes_is_resolved_by_the_bytes(arena, monkeypatch):
    """Colliding keys sit between others in the sorted index: a key is looked for from the
    first of its hash on, and a key of that hash that is not stored is a miss."""
    import kvstate.backends._arena as arena_module

    monkeypatch.setattr(arena_module.xxhash, "xxh3_64_intdigest", lambda b: {b"a": 7, b"c": 9}.get(b[:1], 11))
    assert arena.batch_put_from(["a-x", "c-one", "c-two", "e-y"], [b"1", b"2", b"3", b"4"]) == [0, 0, 0, 0]
    assert arena.batch_is_exist(["c-two", "c-zzz", "e-y", "c-one", "a-x", "a-q"]) == [1, 0, 1, 1, 1, 0]
    outs = [bytearray(8) for _ in range(3)]
    assert arena.batch_get_into(["c-two", "c-zzz", "c-one"], outs) == [1, MISSING, 1]
    assert bytes(outs[0][:1]) == b"3" and bytes(outs[2][:1]) == b"2"


def test_a_claim_past_the_free_slots_takes_the_first_keys_and_answers_minus_one_for_the_rest(tmp_path):
    a = ArenaStore.create(SLOT, 4, small_bytes=64, small_slots=4, directory=tmp_path)
    try:
        slots = a.claim(["k0", "k1", "k2", "k3", "k4", "k5"])
        assert sorted(slots[:4]) == [0, 1, 2, 3] and slots[4:] == [-1, -1]
        for i, s in enumerate(slots[:4]):
            a.slots()[s][:] = i
        assert a.batch_put_from([f"k{i}" for i in range(4)], [a.slots()[s] for s in slots[:4]]) == [0] * 4
        out = bytearray(SLOT)
        assert a.batch_get_into(["k2"], [out]) == [SLOT] and set(out) == {2}
        assert a.locate(["k9"]) == [Place(-1, 0, 0)]  # a miss is no place, however the last slot is used
        assert a.puts == 4
    finally:
        a.close()


def test_a_claimed_slot_filled_whole_is_published_in_place_and_a_claim_put_from_elsewhere_moves(arena):
    s = arena.claim(["whole"])[0]
    arena.slots()[s][:] = 7
    assert arena.stage(["whole"], [arena.slots()[s]]) == [0]  # exactly a slot: filled in place, no copy
    assert arena.publish(["whole"]) == [0] and arena.locate(["whole"])[0].slot == s
    assert arena.claim(["moved"])[0] >= 0
    assert arena.stage(["moved"], [blob(3)]) == [0]  # put from another buffer: the claim is let go
    assert arena.publish(["moved"]) == [0]
    out = bytearray(SLOT)
    assert arena.batch_get_into(["moved"], [out]) == [SLOT] and bytes(out) == blob(3).tobytes()
    assert int((arena.big.state == 1).sum()) == 0 and arena.puts == 2


def test_counters_count_each_get_put_and_eviction(arena):
    arena.batch_put_from(["a", "b"], [blob(1), blob(2)])
    arena.batch_put_from(["a"], [blob(3)])
    arena.batch_get_into(["a", "b", "zz"], [bytearray(SLOT) for _ in range(3)])
    arena.batch_get_into(["b"], [bytearray(SLOT)])
    assert arena.evict(["a", "b", "zz"]) == 2
    assert arena.evict(["b"]) == 0
    assert (arena.puts, arena.gets, arena.evictions) == (3, 3, 2)


def test_a_miss_before_a_hit_in_one_batch_does_not_end_the_batch(arena):
    arena.batch_put_from(["there"], [blob(4)])
    outs = [bytearray(SLOT), bytearray(SLOT)]
    assert arena.batch_get_into(["absent", "there"], outs) == [MISSING, SLOT]
    assert bytes(outs[1]) == blob(4).tobytes()


def test_a_get_whose_slot_is_taken_back_while_it_copies_answers_missing(arena, monkeypatch):
    arena.batch_put_from(["k"], [blob(5)])
    real = arena._copy

    def copy_then_evict(pairs):
        real(pairs)
        arena.evict(["k"])  # between the copy and the check: what was copied may be torn
    monkeypatch.setattr(arena, "_copy", copy_then_evict)
    assert arena.batch_get_into(["k"], [bytearray(SLOT)]) == [MISSING]


def test_releasing_lets_go_of_its_own_claim_only(arena):
    arena.batch_put_from(["kept"], [blob(6)])
    s = arena.claim(["mine"])[0]
    arena.release(["mine"])
    assert int(arena.big.state[s]) == 0 and arena.batch_is_exist(["kept"]) == [1]
    t = arena.claim(["again"])[0]
    arena.big.gen[t] += 1  # the slot was taken back and claimed anew by another writer
    arena.release(["again"])
    assert int(arena.big.state[t]) == 1 and arena.batch_is_exist(["kept"]) == [1]


def test_a_batch_past_the_parallel_size_is_copied_on_the_threads_byte_for_byte(tmp_path):
    a = ArenaStore.create(1 << 20, 12, small_bytes=64, small_slots=2, directory=tmp_path)
    try:
        data = [blob(i, 1 << 20) for i in range(10)]  # 10 MiB: past PARALLEL_BYTES
        assert a.batch_put_from([f"p{i}" for i in range(10)], data) == [0] * 10
        outs = [bytearray(1 << 20) for _ in range(10)]
        assert a.batch_get_into([f"p{i}" for i in range(10)], outs) == [1 << 20] * 10
        assert all(bytes(o) == d.tobytes() for o, d in zip(outs, data))
    finally:
        a.close()


ENTRIES = ["claim", "release", "locate", "publish", "batch_is_exist", "evict"]


@pytest.mark.parametrize("entry", ENTRIES + ["stage", "batch_get_into"])
def test_each_entry_names_itself_when_it_refuses_keys(arena, entry):
    call = getattr(arena, entry)
    with pytest.raises(ValidationError, match=rf"^ArenaStore\.{entry}: keys must be a sequence of str$"):
        call("k") if entry in ENTRIES else call("k", [b"x"])
    assert len(arena) == 0


def test_a_buffer_too_small_for_one_object_does_not_stop_the_next(arena):
    arena.batch_put_from(["a", "b"], [blob(1), blob(2)])
    outs = [bytearray(8), bytearray(SLOT)]
    assert arena.batch_get_into(["a", "b"], outs) == [TOO_LARGE, SLOT] and bytes(outs[1]) == blob(2).tobytes()


def test_a_slot_filled_whole_in_place_keeps_its_claim_and_generation(arena):
    s = arena.claim(["whole"])[0]
    gen = int(arena.big.gen[s])
    arena.slots()[s][:] = 9
    assert arena.stage(["whole"], [arena.slots()[s]]) == [0] and int(arena.big.gen[s]) == gen
    assert arena.publish(["whole"]) == [0] and arena.locate(["whole"])[0] == Place(s, gen, SLOT)


def test_a_put_whose_publish_fails_answers_the_failure(arena, monkeypatch):
    monkeypatch.setattr(arena, "publish", lambda keys: [MISSING] * len(keys))
    assert arena.batch_put_from(["a", "huge"], [blob(1), bytes(SLOT + 1)]) == [MISSING, TOO_LARGE]


def test_the_use_order_is_shared_by_every_handle_of_the_file(arena):
    other = ArenaStore.open(arena.path)
    try:
        arena.batch_put_from([f"k{i}" for i in range(4)], [blob(i) for i in range(4)])
        other.locate(["k0"])  # used last, through the other handle
        arena.batch_put_from(["new"], [blob(9)])
        assert arena.batch_is_exist(["k0", "k1", "k2", "k3"]) == [1, 0, 1, 1]  # k1 was least recently used
    finally:
        other.close()


def test_lost_puts_add_up_and_a_closed_arena_names_itself(arena):
    for k in ("x", "y"):
        slot = arena.claim([k])[0]
        arena.big.gen[slot] += 1
        assert arena.publish([k]) == [MISSING]
    assert arena.lost_puts == 2
    arena.close()
    with pytest.raises(ValidationError, match=rf"ArenaStore {arena.path!r} is closed"):
        arena.locate(["x"])


def test_slots_of_dead_writers_are_taken_back_one_put_at_a_time_and_counted(arena):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    slots = arena.claim([f"w{i}" for i in range(4)])  # every big slot claimed by this live writer
    for n, s in enumerate(slots[:2], start=1):
        arena.big.owner[s] = dead.pid  # as if its writer had died mid-put
        assert arena.batch_put_from([f"new{n}"], [blob(n)]) == [0]
        assert arena.reclaimed == n and arena.locate([f"new{n}"])[0].slot == s


def test_a_get_whose_slot_another_put_of_its_key_replaced_copies_again_from_the_new_slot(arena):
    """A put of a key already stored (two prompts sharing a prefix, written at once) takes the old
    slot back while a get copies out of it: the get copies again from the key's new slot, and
    answers its bytes. A key evicted meanwhile stays a miss, and a key replaced on every copy is
    given up after ARENA_REREADS more copies."""
    from kvstate.backends._arena import ARENA_REREADS

    a, b = blob(1), blob(1)  # equal bytes: a key names its content
    assert arena.batch_put_from(["k", "j"], [a, blob(2)]) == [0, 0]
    real, copies = arena._copy, []

    def during_gets(act):
        """``act()`` inside each copy a get makes (the put it may do copies unwatched)."""
        def copy(pairs):
            copies.append(len(pairs))
            arena._copy = real
            act()
            arena._copy = copy
            real(pairs)
        arena._copy = copy
    during_gets(lambda: len(copies) == 1 and arena.batch_put_from(["k"], [b]))
    out = [np.zeros(SLOT, np.uint8) for _ in range(2)]
    assert arena.batch_get_into(["k", "j"], out) == [SLOT, SLOT]
    assert copies == [2, 1] and (out[0] == a).all() and (out[1] == blob(2)).all()
    copies.clear()
    during_gets(lambda: len(copies) == 1 and arena.evict(["k"]))
    assert arena.batch_get_into(["k", "j"], out) == [MISSING, SLOT] and copies == [2]
    assert arena.batch_put_from(["k"], [a]) == [0]
    copies.clear()
    during_gets(lambda: arena.batch_put_from(["k"], [b]))
    assert arena.batch_get_into(["k"], out[:1]) == [MISSING] and len(copies) == 1 + ARENA_REREADS
