"""The lend board's entries: their format (a JSON line, the keys, the peer, two arrays), each
rule D checks an entry against, and how D reads one.

Every malformed entry is refused by its rule and released failed, so D reads the store; the
rest are the format's parts one by one (each of these failed on a mutant that survived the
rest of the suite).
"""
import json
import os

import numpy as np
import pytest

from kvstate import ProtocolError
from kvstate.backends._lends import LendBoard, fold_sums, leading_matches


def _always():
    return True


def _entry(path):
    """An entry's header (a dict), its keys' and peer's bytes, and its two arrays (lists)."""
    raw = path.read_bytes()
    cut = raw.index(b"\n")
    head = json.loads(raw[:cut])
    named, described = head.pop("keys_bytes"), head.pop("peer_bytes")  # counted again when written back
    at = cut + 1 + named + described
    n = (len(raw) - at) // 16
    body = np.frombuffer(raw[at:], np.uint64)
    parts = {"keys": raw[cut + 1:cut + 1 + named], "peer": raw[cut + 1 + named:at]}
    return head, parts, body[:n].astype(np.int64).tolist(), body[n:].tolist()


def _rewrite(path, head, parts, blocks, sums):
    """Write an entry back; the lengths count ``parts`` unless a test set them."""
    head.setdefault("keys_bytes", len(parts["keys"]))
    head.setdefault("peer_bytes", len(parts["peer"]))
    path.write_bytes(json.dumps(head).encode() + b"\n" + parts["keys"] + parts["peer"] +
                     np.asarray(blocks, "<i8").tobytes() + np.asarray(sums, "<u8").tobytes())


@pytest.mark.parametrize("change, rule", [
    (lambda d, p, b, s: d.update(version=1), "version"),
    (lambda d, p, b, s: b.__setitem__(0, -1), "block ids must be ints >= 0"),
    (lambda d, p, b, s: p.update(keys=b"a\x1fb"), "keys must be 1 non-empty"),
    (lambda d, p, b, s: d.update(n=2), "2 blocks must be followed"),
    (lambda d, p, b, s: b.append(3), "1 blocks must be followed by .* got 24 bytes"),
    (lambda d, p, b, s: d.update(rank=3), "rank must be 0"),
    (lambda d, p, b, s: d.pop("stores"), "whether P stores"),
    (lambda d, p, b, s: d.clear(), "version"), (lambda d, p, b, s: d.update(format="other"), "version"),
    (lambda d, p, b, s: p.update(keys=b""), "keys_bytes and peer_bytes must count"),
    (lambda d, p, b, s: d.update(keys_bytes="1"), "keys_bytes and peer_bytes must count"),
    (lambda d, p, b, s: d.update(keys_bytes=10**6), "keys_bytes and peer_bytes must count"),
    (lambda d, p, b, s: d.update(n=0), "0 blocks"), (lambda d, p, b, s: d.update(n="1"), "'1' blocks"),
    (lambda d, p, b, s: d.update(n=True), "True blocks"),
    (lambda d, p, b, s: d.update(pid="9"), "with a pid"), (lambda d, p, b, s: d.update(geometry=5), "a geometry"),
    (lambda d, p, b, s: p.update(peer=b"[]"), "peer description"),
    (lambda d, p, b, s: p.update(peer=b"{not json"), "peer description"),
    (lambda d, p, b, s: d.update(peer_bytes=-1), "peer_bytes must count"),
    (lambda d, p, b, s: d.update(peer_bytes=10**6), "peer_bytes must count"),
    (lambda d, p, b, s: d.update(peer_bytes=2.0), "peer_bytes must count"),
    (lambda d, p, b, s: d.update(peer_bytes=1), "blocks must be followed by .* got 17 bytes"),
])
def test_a_malformed_entry_is_refused_by_rule_and_released_failed(tmp_path, change, rule):
    board = LendBoard(tmp_path, wait=0)
    name = board.post(0, "g", ["a"], [7], [1], {})
    path = name.with_name(name.name + ".lend")
    head, parts, blocks, sums = _entry(path)
    change(head, parts, blocks, sums)
    _rewrite(path, head, parts, blocks, sums)
    with pytest.raises(ProtocolError, match=rule):
        board.take(0, ["a"], _always)
    assert board.state(name) == "fail"


def test_a_peer_description_is_parsed_once_and_its_parse_is_the_entrys(tmp_path):
    board = LendBoard(tmp_path, wait=0)
    peer = {"kind": "cuda-ipc", "tensors": {"0": {"k": [["ab" * 64, 0, 4096]]}}}
    for _ in range(3):
        board.post(0, "g", ["a"], [7], [1], peer)
        lend = board.take(0, ["a"], _always)
        assert lend.peer == peer
    assert len(board._peers) == 1
    board.post(0, "g", ["a"], [7], [1], {"other": 1})
    assert board.take(0, ["a"], _always).peer == {"other": 1} and len(board._peers) == 2


_HEAD = b'{"format": "kvstate-lend", "version": 2}'


@pytest.mark.parametrize("raw", [b"", b"{}", b"not json\n", b"[1]\n" + bytes(16), b"\n" + bytes(16),
                                 _HEAD + b"x\n" + bytes(16), b" " + _HEAD + b"\n" + bytes(16),
                                 _HEAD.replace(b"format", b"f\xffrmat") + b"\n" + bytes(16)])
def test_an_entry_that_is_not_one_is_refused(tmp_path, raw):
    board = LendBoard(tmp_path, wait=0)
    name = board.post(0, "g", ["a"], [7], [1], {})
    name.with_name(name.name + ".lend").write_bytes(raw)
    with pytest.raises(ProtocolError, match="not a kvstate-lend version 2 entry"):
        board.take(0, ["a"], _always)
    assert board.state(name) == "fail"


def test_keys_holding_the_separator_are_refused_at_post(tmp_path):
    with pytest.raises(ProtocolError, match="may not hold"):
        LendBoard(tmp_path, wait=0).post(0, "g", ["a\x1fb"], [7], [1], {})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("keys", [["a", "", "c"], ["", "b", "c"], ["a", "c", ""]])
def test_an_entry_with_an_empty_key_is_refused(tmp_path, keys):
    board = LendBoard(tmp_path, wait=0)
    name = board.post(0, "g", ["x", "y", "c"], [7, 8, 9], [1, 2, 3], {})  # found by its last key, "c"
    path = name.with_name(name.name + ".lend")
    head, parts, blocks, sums = _entry(path)
    parts["keys"] = "\x1f".join(keys).encode()
    _rewrite(path, head, parts, blocks, sums)
    with pytest.raises(ProtocolError, match="keys must be 3 non-empty strings"):
        board.take(0, ["c"], _always)
    assert board.state(name) == "fail"


def test_a_take_with_keys_prepared_before_takes_what_a_plain_take_would(tmp_path):
    """An armed pull prepares D's keys when D reserves its blocks; a preparation of other keys
    or another rank is not used."""
    board = LendBoard(tmp_path, wait=0)
    board.post(0, "g", ["p", "a", "b"], [7, 8, 9], [1, 2, 3], {})
    ready = board.prepare(0, ["a", "b"])
    assert ready.keys == ("a", "b") and ready.ok and ready.mine == b"a\x1fb"
    lend = board.take(0, ["a", "b"], _always, ready)
    assert lend.blocks.tolist() == [8, 9] and lend.sums.tolist() == [2, 3]
    board.post(0, "g", ["a", "b"], [4, 5], [6, 7], {})
    assert board.take(0, ["a", "b"], _always, board.prepare(1, ["a", "b"])).blocks.tolist() == [4, 5]
    board.post(0, "g", ["c"], [1], [1], {})
    assert board.take(0, ["c"], _always, ready).blocks.tolist() == [1]


def test_keys_with_an_empty_one_are_refused_at_post_and_take_nothing(tmp_path):
    board = LendBoard(tmp_path, wait=0)
    with pytest.raises(ProtocolError, match="non-empty"):
        board.post(0, "g", ["a", "", "c"], [7, 8, 9], [1, 2, 3], {})
    assert list(tmp_path.iterdir()) == []
    name = board.post(0, "g", ["x", "y", "c"], [7, 8, 9], [1, 2, 3], {})
    path = name.with_name(name.name + ".lend")
    head, parts, blocks, sums = _entry(path)
    parts["keys"] = b"a\x1f\x1fc"  # an entry of exactly the keys D asks for, one empty
    _rewrite(path, head, parts, blocks, sums)
    assert not board.prepare(0, ["a", "", "c"]).ok
    assert board.take(0, ["a", "", "c"], _always) is None and board.state(name) == "lend"


def test_an_entry_of_exactly_ds_keys_but_another_count_is_still_refused(tmp_path):
    """The scan of an entry's separators is skipped only where its keys are D's own and its
    count theirs: keys "a" with two blocks and two checksums are refused by rule."""
    board = LendBoard(tmp_path, wait=0)
    name = board.post(0, "g", ["a"], [7], [1], {})
    path = name.with_name(name.name + ".lend")
    head, parts, blocks, sums = _entry(path)
    head["n"] = 2
    _rewrite(path, head, parts, blocks + [8], sums + [2])
    with pytest.raises(ProtocolError, match="keys must be 2 non-empty strings"):
        board.take(0, ["a"], _always)
    assert board.state(name) == "fail"


def test_keys_are_matched_as_utf8_bytes(tmp_path):
    board = LendBoard(tmp_path, wait=0)
    board.post(0, "g", ["préfixe", "clé-ü"], [7, 8], [1, 2], {})
    assert board.take(0, ["cle-u"], _always) is None
    assert board.take(0, ["clé-ü"], _always).blocks.tolist() == [8]


def test_fold_rows_is_fold_sums_of_each_row_and_order_matters():
    from kvstate.backends._lends import fold_rows

    rows = np.random.default_rng(3).integers(0, 2**63, (7, 4), dtype=np.uint64) * 2 + 1
    assert fold_rows(rows) == [fold_sums([int(x) for x in r]) for r in rows]
    assert fold_rows(np.zeros((0, 2), np.uint64)) == []
    assert len({fold_sums([1, 2]), fold_sums([2, 1]), fold_sums([3]), fold_sums([1, 3])}) == 4


@pytest.mark.parametrize("keys, blocks, sums", [(["a", "b"], [1], [1]), (["a"], [1], [1, 2]), ([], [], [])])
def test_a_post_needs_as_many_keys_blocks_and_checksums(tmp_path, keys, blocks, sums):
    with pytest.raises(ProtocolError, match="as many keys, blocks and checksums"):
        LendBoard(tmp_path, wait=0).post(0, "g", keys, blocks, sums, {})
    assert list(tmp_path.iterdir()) == []


def test_a_taken_lend_carries_every_field(tmp_path):
    board = LendBoard(tmp_path, wait=0)
    board.post(2, "geo", ["a", "b"], [7, 8], [0, (1 << 64) - 1], {"x": 1}, stores=True)  # sums at both ends
    lend = board.take(2, ["b"], _always)
    assert (lend.pid, lend.rank, lend.geometry, lend.keys, lend.blocks.tolist(), lend.sums.tolist(), lend.peer,
            lend.stores) == (os.getpid(), 2, "geo", ("b",), [8], [(1 << 64) - 1], {"x": 1}, True)
    assert lend.blocks.dtype == np.int64 and lend.sums.dtype == np.uint64


@pytest.mark.parametrize("first", [16, 64, 1 << 18])
def test_an_entry_is_read_whole_in_any_number_of_reads_and_one_past_the_bound_refused(tmp_path, monkeypatch, first):
    import kvstate.backends._lends as lends

    monkeypatch.setattr(lends, "_FIRST_READ", first)
    board = LendBoard(tmp_path, wait=0)
    keys = [f"k{i}" for i in range(40)]
    name = board.post(0, "g", keys, list(range(40)), list(range(1, 41)), {"x": "y" * 100})
    size = name.with_name(name.name + ".lend").stat().st_size
    lend = board.take(0, keys, _always)
    assert lend.blocks.tolist() == list(range(40)) and lend.sums.tolist() == list(range(1, 41))
    board.remove(name)
    monkeypatch.setattr(lends, "_MAX_ENTRY", size - 1)
    name = board.post(0, "g", keys, list(range(40)), list(range(1, 41)), {"x": "y" * 100})
    with pytest.raises(ProtocolError, match="not a kvstate-lend version 2 entry"):
        board.take(0, keys, _always)
    assert board.state(name) == "fail"


@pytest.mark.parametrize("got, want, n", [([1, 2, 3], [1, 2, 3], 3), ([1, 9, 3], [1, 2, 3], 1), ([9], [1], 0),
                                          ([1, 2], [1, 2, 3], 2), ([1, 2, 3], [1, 2], 2), ([], [1], 0),
                                          ([(1 << 64) - 1], np.array([(1 << 64) - 1], np.uint64), 1)])
def test_leading_matches_counts_up_to_the_first_difference(got, want, n):
    assert leading_matches(got, want) == n


def test_a_d_key_holding_the_separator_takes_nothing(tmp_path):
    """P's keys "x", "a", "b" join as D's "x\x1fa", "b" would: D must not take the entry and get
    "a"'s block for its first key."""
    board = LendBoard(tmp_path, wait=0)
    name = board.post(0, "g", ["x", "a", "b"], [6, 7, 8], [1, 2, 3], {})
    assert board.take(0, ["x\x1fa", "b"], _always) is None
    assert board.state(name) == "lend"
    assert board.take(0, ["a", "b"], _always).blocks.tolist() == [7, 8]


# -- names: plain where it can be, opened by name by a D that knows the P ---------------------------
def test_a_lend_is_posted_under_its_plain_name_unless_this_process_lends_under_it(tmp_path):
    board = LendBoard(tmp_path, wait=0)
    first = board.post(0, "g", ["a", "b"], [7, 8], [1, 2], {})
    again = board.post(0, "g", ["x", "b"], [5, 6], [3, 4], {})  # the same last key and rank, at once
    other_rank = board.post(1, "g", ["a", "b"], [7, 8], [1, 2], {})
    assert first.name == f"lend-{os.getpid()}-{board._tag('b')}.r0"
    assert again.name.startswith(f"lend-{os.getpid()}-{board._tag('b')}-") and again.name.endswith(".r0")
    assert other_rank.name == f"lend-{os.getpid()}-{board._tag('b')}.r1"
    taken = [board.take(0, ["b"], _always), board.take(0, ["b"], _always)]  # D finds both, by either name
    assert sorted(t.blocks.tolist() for t in taken) == [[6], [8]]
    for name in (first, again, other_rank):
        board.remove(name)
    assert list(tmp_path.iterdir()) == []  # every file of each, whatever its state (other_rank's still posted)
    assert board.post(0, "g", ["b"], [1], [1], {}) == first  # free again once removed


def test_a_post_that_fails_leaves_nothing_and_frees_its_name(tmp_path, monkeypatch):
    import kvstate.backends._lends as lends

    board = LendBoard(tmp_path, wait=0)

    def refuse(src, dst):
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(lends.os, "rename", refuse)
        with pytest.raises(OSError):
            board.post(0, "g", ["a"], [7], [1], {})
    assert list(tmp_path.iterdir()) == []
    assert board.post(0, "g", ["a"], [7], [1], {}).name == f"lend-{os.getpid()}-{board._tag('a')}.r0"


def test_a_d_opens_a_known_ps_entry_by_name_and_lists_only_for_another(tmp_path, monkeypatch):
    board = LendBoard(tmp_path, wait=0)
    import kvstate.backends._lends as lends

    listings = []
    scandir = os.scandir
    monkeypatch.setattr(lends.os, "scandir", lambda p: listings.append(p) or scandir(p))
    board.take(0, ["a"], _always)
    assert len(listings) == 1  # nothing to open by name yet
    board.post(0, "g", ["a"], [7], [1], {})
    assert board.take(0, ["a"], _always).blocks.tolist() == [7] and len(listings) == 2  # listed, P learned
    board.post(0, "g", ["b"], [8], [2], {})
    assert board.take(0, ["b"], _always).blocks.tolist() == [8] and len(listings) == 2  # opened by name
    other = board.post(0, "g", ["c"], [9], [3], {})
    parent = other.with_name(other.name.replace(f"-{os.getpid()}-", f"-{os.getppid()}-"))  # a P alive, not known
    os.rename(f"{other}.lend", f"{parent}.lend")
    assert board.take(0, ["c"], _always).blocks.tolist() == [9] and len(listings) == 3  # not known: listed
    assert list(board._lenders) == [os.getpid(), os.getppid()]  # the latest last


def test_lends_of_one_last_key_posted_and_taken_at_once(tmp_path):
    """Threads of one process lend and pull prompts that end alike (one plain name, the rest
    numbered) on one board, as P's and D's ranks do: each takes its own, nothing is left."""
    import threading

    board, errors = LendBoard(tmp_path, wait=1), []

    def rank(r):
        try:
            for i in range(100):
                keys = [f"t{r}-{i}", "shared"]
                board.post(0, "g", keys, [r, i], [r, i], {})
                got = board.take(0, keys, _always)
                assert got is not None and got.blocks.tolist() == [r, i]
                board.release(got.name, True)
                board.remove(got.name)
        except Exception as e:  # noqa: BLE001 - reported below, with the thread
            errors.append((r, e))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and list(tmp_path.iterdir()) == []
    assert board.post(0, "g", ["shared"], [1], [1], {}).name == f"lend-{os.getpid()}-{board._tag('shared')}.r0"


def test_d_reads_the_entry_it_took_though_p_lent_under_its_name_again(tmp_path, monkeypatch):
    """A P that withdraws an entry and posts again under its name, between D's look and D's
    take: D pulls what it took, not what it looked at."""
    import kvstate.backends._lends as lends

    board = LendBoard(tmp_path / "board", wait=0)
    name = board.post(0, "g", ["a"], [7], [1], {})
    elsewhere = LendBoard(tmp_path / "other", wait=0)
    newer = (tmp_path / "other" / f"{elsewhere.post(0, 'g', ['a'], [9], [2], {}).name}.lend").read_bytes()
    rename = os.rename

    def again_first(src, dst):
        if str(src).endswith(".lend") and str(dst).endswith(".taken"):
            os.unlink(src)  # P withdrew it, then posted again under the same name
            (tmp_path / "board" / os.path.basename(src)).write_bytes(newer)
        rename(src, dst)
    monkeypatch.setattr(lends.os, "rename", again_first)
    lend = board.take(0, ["a"], _always)
    assert (lend.blocks.tolist(), lend.sums.tolist()) == ([9], [2]) and board.state(name) == "taken"


def test_an_entry_not_ds_goes_back_as_it_was(tmp_path):
    board = LendBoard(tmp_path, wait=0)
    name = board.post(0, "g", ["a", "b"], [7, 8], [1, 2], {})
    assert board.take(0, ["x", "b"], _always) is None and board.state(name) == "lend"
    dead = name.with_name(name.name.replace(f"-{os.getpid()}-", "-999999999-"))
    os.rename(f"{name}.lend", f"{dead}.lend")
    assert board.take(0, ["a", "b"], _always) is None and board.state(dead) == "lend"


@pytest.mark.parametrize("theirs, raises", [(["x", "b"], False), (["a", "b"], True)])
def test_p_removing_an_entry_in_the_middle_of_ds_take_leaves_nothing(tmp_path, monkeypatch, theirs, raises):
    """P removes its lend (its fence passed) after D's take renamed it and before D gives it
    back or marks it failed: D's rename finds nothing, D takes nothing (a malformed entry still
    raises its rule) and no file comes back."""
    import kvstate.backends._lends as lends

    board = LendBoard(tmp_path, wait=0)
    name = board.post(0, "g", theirs, [7, 8], [1, 2], {})
    if raises:  # a malformed entry: its version is not this format's
        path = name.with_name(name.name + ".lend")
        head, parts, blocks, sums = _entry(path)
        _rewrite(path, {**head, "version": 1}, parts, blocks, sums)
    read = lends._read_entry

    def then_p_removes(path):
        raw = read(path)
        board.remove(name)
        return raw
    monkeypatch.setattr(lends, "_read_entry", then_p_removes)
    if raises:
        with pytest.raises(ProtocolError, match="version"):
            board.take(0, ["a", "b"], _always)
    else:
        assert board.take(0, ["a", "b"], _always) is None
    assert list(tmp_path.iterdir()) == [] and board.state(name) is None


def test_a_name_held_past_ps_fence_is_not_lent_under_again(tmp_path):
    from kvstate.backends._lends import lend_blocks

    class Ops:
        def lend_geometry(self):
            return "g"

        def lend_peer(self, rank):
            return {}

        def lend_sums(self, rank, ids):
            return list(ids)

    board = LendBoard(tmp_path, wait=0)
    took = []
    deadline = iter([True, True, False])  # D takes it while the lend is open; then the deadline passes

    def until():
        if not took:
            took.append(board.take(0, ["a"], _always))
        return next(deadline, False)
    assert lend_blocks(board, Ops(), 0, ["a"], [7], until, guard=lambda: False) == 0  # the fence passed, D holds it
    assert list(tmp_path.iterdir()) == []
    later = board.post(0, "g", ["a"], [9], [2], {})
    assert str(later) != took[0].name and later.name.endswith(".r0")  # numbered: the held name stays retired
    board.release(took[0].name, True)  # D's copy ends at last: the later lend is not touched
    assert board.state(later) == "lend"
    board.remove(later)
    assert lend_blocks(board, Ops(), 0, ["b"], [7], lambda: False, guard=lambda: False) == 0  # withdrawn
    assert board.post(0, "g", ["b"], [9], [2], {}).name == f"lend-{os.getpid()}-{board._tag('b')}.r0"  # lent again


def test_a_d_remembers_its_latest_ps_only(tmp_path, monkeypatch):
    import kvstate.backends._lends as lends

    monkeypatch.setattr(lends, "pid_running", lambda pid: True)  # Ps of made-up pids, alive
    board = LendBoard(tmp_path, wait=0)
    for pid in range(1000, 1000 + lends._LENDERS + 3):
        name = board.post(0, "g", [f"k{pid}"], [7], [1], {})
        theirs = name.with_name(name.name.replace(f"-{os.getpid()}-", f"-{pid}-"))
        os.rename(f"{name}.lend", f"{theirs}.lend")
        board.remove(name)
        assert board.take(0, [f"k{pid}"], _always) is not None
    assert list(board._lenders) == list(range(1003, 1000 + lends._LENDERS + 3))
