"""The integrity module's parts, each against an independent statement of its rule: SUM64 by
plain integer arithmetic, manifests byte by byte, the geometry id's inputs, and the hasher's
threads (started only for large batches, stopped by close)."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from kvstate import CacheSpec, paired
from kvstate.backends._integrity import (
    FORMAT_VERSION,
    MAGIC,
    PARALLEL_BYTES,
    SUM64,
    XXH3,
    Hasher,
    ManifestError,
    geometry_id,
    manifest_size,
    pack_manifest,
    sum64,
    sum64_weights,
    unpack_manifest,
)


def sum64_by_hand(data: bytes) -> int:
    """Σ w_i (2i + 1) mod 2**64 over little-endian 64-bit words, the last zero-padded."""
    data = data + bytes(-len(data) % 8)
    words = struct.unpack(f"<{len(data) // 8}Q", data)
    return sum(w * (2 * i + 1) for i, w in enumerate(words)) % 2**64


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 17, 64, 1001])
def test_sum64_is_the_weighted_word_sum(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert sum64(data) == sum64_by_hand(data)


def test_sum64_sees_a_change_in_any_one_byte_and_pads_with_zeros():
    data = bytearray(np.random.default_rng(3).integers(0, 256, 40, dtype=np.uint8).tobytes())
    base = sum64(bytes(data))
    for i in range(len(data)):
        changed = bytearray(data)
        changed[i] ^= 0x80
        assert sum64(bytes(changed)) != base
    assert sum64(b"\x05") == sum64(b"\x05" + bytes(7)) == 5


def test_sum64_weights_are_the_odd_numbers_from_the_first_position():
    assert sum64_weights(np, 3).tolist() == [1, 3, 5]
    assert sum64_weights(np, 2, first=4).tolist() == [9, 11]
    assert sum64_weights(np, 1).dtype == np.uint64


def test_a_manifest_is_its_head_then_each_object_s_length_and_sum():
    m = pack_manifest(0xABC, [(10, 1), (20, 2)], SUM64)
    assert len(m) == manifest_size(2) == struct.calcsize("<4sHHHxxQ") + 2 * 16
    assert m[:4] == MAGIC and struct.unpack_from("<HHH", m, 4) == (FORMAT_VERSION, 2, SUM64)
    assert unpack_manifest(m, len(m), 0xABC, 2) == (SUM64, [(10, 1), (20, 2)])
    assert unpack_manifest(pack_manifest(7, [(1, 2)]), manifest_size(1), 7, 1) == (XXH3, [(1, 2)])


def _with(m: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(m)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


@pytest.mark.parametrize("make,got,rule", [
    (lambda m: m, 40, "manifest of 40 bytes, expected 36"),
    (lambda m: b"XXXX" + m[4:], None, "manifest of format b'XXXX' version 1"),
    (lambda m: _with(m, 4, "<H", FORMAT_VERSION + 1), None, f"version {FORMAT_VERSION + 1}"),
    (lambda m: _with(m, 8, "<H", 9), None, "(checksum 9)"),
    (lambda m: _with(m, 6, "<H", 2), None, "manifest of 2 objects of geometry 0x5, expected 1 of 0x5"),
    (lambda m: _with(m, 12, "<Q", 6), None, "manifest of 1 objects of geometry 0x6, expected 1 of 0x5"),
])
def test_a_manifest_of_another_format_size_or_geometry_is_refused(make, got, rule):
    m = make(pack_manifest(5, [(1, 2)]))
    with pytest.raises(ManifestError) as e:
        unpack_manifest(m, len(m) if got is None else got, 5, 1)
    assert rule in str(e.value)


def spec(**kw) -> CacheSpec:
    args = dict(num_layers=4, kv_heads=2, block_size=16, head_dim=64, dtype="bfloat16", tp_size=1, layer_groups=2)
    args.update(kw)
    return CacheSpec(**args)


def test_the_geometry_id_changes_with_everything_the_bytes_depend_on():
    base = geometry_id(spec(), None)
    others = [geometry_id(spec(num_layers=5, layer_groups=1), None), geometry_id(spec(block_size=32), None),
              geometry_id(spec(head_dim=128), None), geometry_id(spec(dtype="float16"), None),
              geometry_id(spec(kv_heads=4), None), geometry_id(spec(), 0), geometry_id(spec(has_value=False), None)]
    assert len({base, *others}) == len(others) + 1
    assert geometry_id(spec(), 0) == geometry_id(spec(), 1)  # two groups of two layers each: alike
    p, d = paired(spec(tp_size=2), spec(kv_heads=4))  # P at TP 2 and D at TP 1 store alike
    assert geometry_id(p, None) == geometry_id(d, None)


def test_the_hasher_starts_threads_only_for_large_batches_and_close_stops_them():
    big = [np.full(PARALLEL_BYTES // 2, i, np.uint8) for i in range(3)]  # 1.5 x the threshold
    small = [b"a", b"bc"]
    want = [xxhash.xxh3_64_intdigest(v) for v in big]
    h = Hasher(4)
    assert h(small) == [xxhash.xxh3_64_intdigest(v) for v in small] and h._pool is None
    assert h(big[:1] * 3) == want[:1] * 3 and h._pool is not None  # large together: on its threads
    assert h(big) == want
    h.close()
    assert h._pool is None
    h.close()  # again: nothing to stop
    one = Hasher(1)
    assert one(big) == want and one._pool is None  # one thread: never a pool
    assert Hasher(4)([big[0]]) == want[:1]  # one buffer: never a pool
    under = [np.zeros(PARALLEL_BYTES // 2 - 1, np.uint8)] * 2  # just under the threshold together
    h2 = Hasher(4)
    h2(under)
    assert h2._pool is None
    h2([np.zeros(PARALLEL_BYTES // 2, np.uint8)] * 2)  # exactly the threshold
    assert h2._pool is not None
    h2.close()


def test_the_hasher_s_threads_are_its_own_named_and_at_most_its_count():
    import threading

    before = set(threading.enumerate())  # other hashers of this process keep theirs
    h = Hasher(2)
    views = [np.full(PARALLEL_BYTES // 4, i, np.uint8) for i in range(8)]
    assert h(views) == [xxhash.xxh3_64_intdigest(v) for v in views] and h._pool is not None
    mine = [t for t in set(threading.enumerate()) - before]
    assert 1 <= len(mine) <= 2 and all(t.name.startswith("kvstate-hash_") for t in mine)  # two asked for
    h.close()
    assert not any(t.is_alive() for t in mine)
