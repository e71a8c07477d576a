"""The arena store's file (kvstate.backends._arena): how it is made, opened, bounded and
removed. An opener of another geometry, version or size is refused by name; the creator owns
the file and removes it, a dead creator's file goes at the next create, and ``kvstate arena``
holds one for a host's engines. What a store does with the objects in it:
``tests/test_arena_store.py``."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rigs import ARENA_SLOT as SLOT
from rigs import blob

from kvstate import ConfigError, ValidationError
from kvstate.backends._arena import ArenaStore


def test_another_geometry_version_or_file_is_refused_by_name(arena, tmp_path):
    with pytest.raises(ConfigError, match="geometry 'geo', not 'other'"):
        ArenaStore.open(arena.path, tag="other")
    with pytest.raises(ConfigError, match="4096-byte slots, 8192 were asked for: it was made for another geometry$"):
        ArenaStore.open(arena.path, slot_bytes=8192)
    bad = tmp_path / "kvstate-arena-x"
    bad.write_bytes(b"\0" * 8192)
    with pytest.raises(ConfigError, match="not an arena"):
        ArenaStore.open(bad)
    copy = tmp_path / "v2"
    copy.write_bytes(Path(arena.path).read_bytes())
    with open(copy, "r+b") as f:
        f.seek(8)
        f.write((99).to_bytes(4, "little"))
    with pytest.raises(ConfigError, match="format version 99"):
        ArenaStore.open(copy)
    with pytest.raises(ValidationError, match="keys must be"):
        arena.batch_put_from("k", [b"x"])
    with pytest.raises(ConfigError, match="cannot open"):
        ArenaStore.open(tmp_path / "absent")


def test_the_creator_removes_its_file_and_a_dead_creators_file_goes_at_the_next_create(tmp_path):
    a = ArenaStore.create(SLOT, 2, directory=tmp_path)
    b = ArenaStore.open(a.path)
    b.close()
    assert os.path.exists(a.path)
    a.close()
    assert not os.path.exists(a.path)
    child = subprocess.run([sys.executable, "-c", (
        "import os, sys\nfrom kvstate.backends._arena import ArenaStore\n"
        f"a = ArenaStore.create({SLOT}, 2, directory={str(tmp_path)!r})\nprint(a.path)\nos._exit(0)")],
        capture_output=True, text=True, check=True)
    left = child.stdout.strip()
    assert os.path.exists(left)
    ArenaStore.create(SLOT, 2, directory=tmp_path).close()
    assert not os.path.exists(left)


def test_kvstate_arena_makes_the_arena_prints_its_path_and_removes_it_when_stopped(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "kvstate", "arena", "--slot-bytes", str(SLOT), "--slots", "2",
                          "--small-bytes", "64", "--directory", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        path = p.stdout.readline().strip()
        other = ArenaStore.open(path, slot_bytes=SLOT)
        assert other.batch_put_from(["k"], [blob(1)]) == [0]
        other.close()
    finally:
        p.terminate()
        assert p.wait(30) == 0
    assert not os.path.exists(path)
    bad = subprocess.run([sys.executable, "-m", "kvstate", "arena", "--slot-bytes", "64", "--slots", "2",
                          "--small-bytes", "64"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "small_bytes" in bad.stderr


@pytest.mark.parametrize("kw, rule", [
    (dict(slot_bytes=7, slots=1), "ArenaStore: slot_bytes"), (dict(slot_bytes=64, slots=0), "ArenaStore: slots"),
    (dict(slot_bytes=64, slots=1, small_bytes=7), "ArenaStore: small_bytes"),
    (dict(slot_bytes=64, slots=1, small_bytes=64), "ArenaStore: small_bytes"),
    (dict(slot_bytes=64, slots=1, small_slots=0), "ArenaStore: small_slots"),
    (dict(slot_bytes=64, slots=1, tag="t" * 65), "tag must be a str of at most 64 bytes"),
    (dict(slot_bytes=64, slots=1, tag=b"geo"), "tag must be a str of at most 64 bytes"),
])
def test_create_refuses_each_bound_past_its_limit_by_name_and_makes_nothing(tmp_path, kw, rule):
    with pytest.raises(ValidationError, match=rule):
        ArenaStore.create(**{"small_bytes": 8, **kw}, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_create_takes_every_bound_at_its_limit(tmp_path):
    b = ArenaStore.create(9, 1, small_bytes=8, small_slots=1, tag="t" * 64, directory=tmp_path)
    try:
        assert (b.big.slots, b.big.size, b.small.slots, b.small.size, b.tag) == (1, 9, 1, 8, "t" * 64)
        assert b.batch_put_from(["big", "small"], [b"x" * 9, b"y" * 8]) == [0, 0]
    finally:
        b.close()
    assert list(tmp_path.iterdir()) == []


def test_create_in_a_path_that_is_not_a_directory_names_it(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(ConfigError, match=f"{str(f)!r} is not a directory"):
        ArenaStore.create(64, 1, small_bytes=8, directory=f)


def test_a_store_made_on_an_existing_file_verifies_unless_told_not_to(arena):
    for other, want in ((ArenaStore(arena.path), True), (ArenaStore(arena.path, verify=False), False)):
        try:
            assert other.verify is want and other.owner is False
        finally:
            other.close()
    assert Path(arena.path).exists()  # only the creator removes the file


@pytest.mark.parametrize("kw", [dict(owner=1), dict(verify=1), dict(owner=None, verify=True)])
def test_owner_and_verify_must_each_be_bools(arena, kw):
    with pytest.raises(ConfigError, match="owner and verify must be bools"):
        ArenaStore(arena.path, **kw)


def test_a_short_or_cut_file_is_refused_with_its_size(arena, tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"\0" * 100)
    with pytest.raises(ConfigError, match=r"is not an arena \(100 bytes\)"):
        ArenaStore.open(short)
    cut = tmp_path / "cut"
    cut.write_bytes(Path(arena.path).read_bytes()[:-4096])
    with pytest.raises(ConfigError, match="its header needs"):
        ArenaStore.open(cut)


def test_an_opener_verifies_by_default_and_the_use_counter_leaves_the_header_alone(arena):
    other = ArenaStore.open(arena.path)
    try:
        assert other.verify is True and arena.verify is True
        for i in range(300):  # stamps: every put and locate counts up the shared use counter
            other.batch_put_from([f"s{i % 3}"], [blob(i)])
            other.locate([f"s{i % 3}"])
        again = ArenaStore.open(arena.path, slot_bytes=SLOT, tag="geo")  # the header still reads right
        again.close()
    finally:
        other.close()


@pytest.mark.parametrize("kw, name", [(dict(slot_bytes=7), "slot_bytes"), (dict(slots=0), "slots"),
                                      (dict(small_bytes=7), "small_bytes"), (dict(small_slots=0), "small_slots")])
def test_create_names_the_bound_at_the_start_of_its_refusal(tmp_path, kw, name):
    with pytest.raises(ValidationError, match=rf"^ArenaStore: {name} "):
        ArenaStore.create(**{"slot_bytes": 64, "slots": 1, "small_bytes": 8, **kw}, directory=tmp_path)


def test_create_defaults_and_settings_carry_to_the_store(tmp_path):
    a = ArenaStore.create(64, 1, small_bytes=8, verify=False, tag="geoX", directory=tmp_path)
    try:
        assert a.verify is False and a.tag == "geoX"
        assert ArenaStore.open(a.path, verify=False).verify is False
    finally:
        a.close()
    b = ArenaStore.create(64, 1, small_bytes=8)  # the host's shared-memory directory
    try:
        assert b.tag == "" and Path(b.path).exists() and b.verify is True
    finally:
        b.close()
    assert not Path(b.path).exists()


def test_an_arena_past_the_free_space_is_refused_with_both_sizes(tmp_path, monkeypatch):
    real = os.statvfs

    class Tiny:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, 1
    monkeypatch.setattr(os, "statvfs", lambda d: Tiny(real(d)))
    with pytest.raises(ConfigError, match=rf"bytes do not fit in {re.escape(repr(str(tmp_path)))} \(\d[\d,]* free\)$"):
        ArenaStore.create(1 << 20, 4, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_closing_twice_closes_nothing_else(tmp_path):
    a = ArenaStore.create(64, 1, small_bytes=8, directory=tmp_path)
    probe = os.open(os.devnull, os.O_RDONLY)  # a descriptor the second close must leave alone
    try:
        a.close()
        a.close()
        os.fstat(probe)
        os.fstat(1)
    finally:
        os.close(probe)


def test_a_file_that_cannot_be_made_is_refused_by_its_directory_and_left_nowhere(tmp_path, monkeypatch):
    import kvstate.backends._arena as arena_module

    def no_map(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(arena_module.mmap, "mmap", no_map)
    with pytest.raises(ConfigError, match=rf"cannot make [\d,]+ bytes in {re.escape(repr(str(tmp_path)))} "):
        ArenaStore.create(64, 1, small_bytes=8, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_find_arena_names_the_one_live_arena_of_a_directory_with_the_slots_asked_for(tmp_path):
    """How engines on one host meet without a path: the one arena whose creator runs, whose
    format this kvstate reads and whose slots (and tag, when asked) fit; none or several is
    refused, naming the command that makes one or the paths to choose from."""
    from kvstate.backends._arena import find_arena

    with pytest.raises(ConfigError, match=f"no kvstate arena .* has {SLOT}-byte slots: start one .*"
                                          f"kvstate arena --slot-bytes {SLOT} --slots N"):
        find_arena(SLOT, directory=tmp_path)
    other = ArenaStore.create(SLOT * 2, 2, directory=tmp_path, tag="big")  # other slots: passed over
    a = ArenaStore.create(SLOT, 2, directory=tmp_path, tag="geo")
    try:
        dead = tmp_path / f"kvstate-arena-{2 ** 22 + 7}-gone"  # a pid that does not run
        dead.write_bytes(Path(a.path).read_bytes()[:4096])
        (tmp_path / f"kvstate-arena-{os.getpid()}-short").write_bytes(b"KVSARENA")  # a header cut short
        assert find_arena(SLOT, directory=tmp_path) == a.path
        assert find_arena(SLOT, tag="geo", directory=tmp_path) == a.path
        assert find_arena(SLOT * 2, directory=tmp_path) == other.path
        with pytest.raises(ConfigError, match="tag 'llama'"):
            find_arena(SLOT, tag="llama", directory=tmp_path)
        b = ArenaStore.create(SLOT, 2, directory=tmp_path, tag="geo")
        with pytest.raises(ConfigError, match=re.escape(f"2 kvstate arenas in {str(tmp_path)!r} have {SLOT}-byte "
                                                        f"slots: name one by its path")):
            find_arena(SLOT, directory=tmp_path)
        b.close()
        assert find_arena(SLOT, directory=tmp_path) == a.path  # its creator closed it: gone
        with pytest.raises(ValidationError, match="slot_bytes"):
            find_arena(0, directory=tmp_path)
    finally:
        a.close()
        other.close()
