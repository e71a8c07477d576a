"""Large host copies (kvstate.backends._hostcopy): the same bytes as numpy, streamed or not."""
import numpy as np
import pytest

from kvstate.backends import MemoryStore
from kvstate.backends import _hostcopy as hostcopy

SIZES = [0, 1, 15, 16, 63, 64, 65, 127, 4096 + 5, hostcopy.STREAM_BYTES - 1, hostcopy.STREAM_BYTES,
         hostcopy.STREAM_BYTES + 77, (1 << 20) + 3]


def pairs():
    """Source and destination views at every offset mod 4 (so neither is 16- or 64-byte aligned)."""
    rng = np.random.default_rng(0)
    for n in SIZES:
        for off in range(4):
            src = rng.integers(0, 256, n + 8, dtype=np.uint8)[off:off + n]
            dst = np.zeros(n + 8, np.uint8)[3 - off:3 - off + n]
            yield src, dst


@pytest.mark.parametrize("streamed", [True, False])
def test_copies_every_byte_at_every_size_and_alignment(streamed):
    if streamed and not hostcopy.STREAMING:
        pytest.skip("the C helper kvstate.backends._streamcopy was not built (no C compiler at install)")
    from kvstate.backends._hostcopy import copy_into

    stream = hostcopy.stream_copy if streamed else None
    for src, dst in pairs():
        padded = dst.base.copy()
        copy_into(dst, src, stream)
        assert np.array_equal(dst, src), len(src)
        outside = np.ones(len(padded), bool)
        start = dst.__array_interface__["data"][0] - dst.base.__array_interface__["data"][0]
        outside[start:start + len(dst)] = False
        assert np.array_equal(dst.base[outside], padded[outside])  # nothing written around it


def test_the_streaming_helper_refuses_lengths_that_differ():
    if not hostcopy.STREAMING:
        pytest.skip("the C helper kvstate.backends._streamcopy was not built (no C compiler at install)")
    dst = np.zeros(100, np.uint8)
    with pytest.raises(ValueError, match="101 bytes into 100"):
        hostcopy.stream_copy(dst, np.ones(101, np.uint8))
    with pytest.raises(TypeError):
        hostcopy.stream_copy(b"read-only", b"read-only")
    assert not dst.any()


def test_copy_into_refuses_lengths_that_differ_and_writes_nothing():
    dst = np.zeros(1 << 20, np.uint8)
    with pytest.raises(ValueError, match="1048577 bytes into 1048576"):
        hostcopy.copy_into(dst, np.ones((1 << 20) + 1, np.uint8))
    assert not dst.any()


def test_memory_store_round_trips_large_objects_through_streamed_copies():
    rng = np.random.default_rng(1)
    objs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (hostcopy.STREAM_BYTES + 1, 3 << 20, 100)]
    store = MemoryStore(1 << 26, copy_threads=2, verify=False)
    try:
        keys = [f"k{i}" for i in range(len(objs))]
        assert store.batch_put_from(keys, objs) == [0, 0, 0]
        out = [np.zeros(len(o), np.uint8) for o in objs]
        assert store.batch_get_into(keys, out) == [len(o) for o in objs]
        assert all(np.array_equal(a, b) for a, b in zip(out, objs))
    finally:
        store.close()


@pytest.mark.parametrize("batched", [True, False])
def test_copy_all_copies_every_pair_and_nothing_around_them(batched):
    if batched and not hostcopy.STREAMING:
        pytest.skip("the C helper kvstate.backends._streamcopy was not built (no C compiler at install)")
    many = hostcopy.stream_copy_many if batched else None
    got = list(pairs())
    before = [dst.base.copy() for _, dst in got]
    hostcopy.copy_all([memoryview(dst) for _, dst in got], [src for src, _ in got], many)
    for (src, dst), padded in zip(got, before):
        assert np.array_equal(dst, src), len(src)
        start = dst.__array_interface__["data"][0] - dst.base.__array_interface__["data"][0]
        outside = np.ones(len(padded), bool)
        outside[start:start + len(dst)] = False
        assert np.array_equal(dst.base[outside], padded[outside])


def test_the_batch_copy_checks_every_pair_before_moving_a_byte():
    if not hostcopy.STREAMING:
        pytest.skip("the C helper kvstate.backends._streamcopy was not built (no C compiler at install)")
    dsts = [np.zeros(8, np.uint8), np.zeros(100, np.uint8)]
    with pytest.raises(ValueError, match="pair 1: 101 bytes into 100"):
        hostcopy.stream_copy_many(dsts, [np.ones(8, np.uint8), np.ones(101, np.uint8)], 0)
    with pytest.raises(BufferError):
        hostcopy.stream_copy_many([dsts[0], b"read-only"], [np.ones(8, np.uint8), b"read-onlx"], 0)
    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        hostcopy.stream_copy_many(dsts, [np.ones(8, np.uint8)], 0)
    assert not any(d.any() for d in dsts)


def test_copy_sum64_copies_every_pair_and_sums_each_object_across_its_pairs():
    """Objects of one to three pairs, of whole groups of eight words and not, destinations
    16-byte aligned (streamed) and not: every byte copied and nothing around it; each SUM64 is
    :func:`sum64` of the object's bytes."""
    if hostcopy.copy_sum64 is None:
        pytest.skip("the C helper kvstate.backends._streamcopy was not built (no C compiler at install)")
    from kvstate.backends._integrity import sum64

    rng = np.random.default_rng(2)
    sizes = [[8], [16 << 10, 8, (40 << 10) + 24], [(3 << 20) + 8, 24], [64, 128], [72]]
    srcs, dsts, starts, whole = [], [], [], []
    at = []
    for obj in sizes:
        starts.append(len(srcs))
        for n in obj:
            off, at_ = int(rng.integers(0, 8)), 16 * int(rng.integers(0, 2)) + 5 * (len(srcs) % 2)
            srcs.append(rng.integers(0, 256, n + 8, dtype=np.uint8)[off:off + n])
            base = np.zeros(n + 64, np.uint8)
            base = base[(-base.__array_interface__["data"][0]) % 16:]  # 16-byte aligned
            dsts.append(base[at_:at_ + n])
            at.append(at_)
        whole.append(np.concatenate(srcs[starts[-1]:]))
    assert {a % 16 for a in at} == {0, 5}
    before = [d.base.copy() for d in dsts]
    assert hostcopy.copy_sum64(dsts, srcs, starts) == [sum64(w) for w in whole]
    for s, d, b, a in zip(srcs, dsts, before, at):
        assert np.array_equal(s, d)
        assert np.array_equal(d.base[:a], b[:a]) and np.array_equal(d.base[a + len(d):], b[a + len(d):])
    assert hostcopy.copy_sum64([], [], []) == []


@pytest.mark.parametrize("dsts, srcs, starts, rule", [
    ([np.zeros(8, np.uint8)], [np.ones(16, np.uint8)], [0], "16 bytes into 8"),
    ([np.zeros(12, np.uint8)], [np.ones(12, np.uint8)], [0], "12 bytes, not whole 64-bit words"),
    ([np.zeros(8, np.uint8)] * 2, [np.ones(8, np.uint8)] * 2, [1], "rise from 0"),
    ([np.zeros(8, np.uint8)] * 2, [np.ones(8, np.uint8)] * 2, [0, 0], "rise from 0"),
    ([np.zeros(8, np.uint8)] * 2, [np.ones(8, np.uint8)] * 2, [0, 2], "each below the 2 pairs"),
    ([np.zeros(8, np.uint8)], [np.ones(8, np.uint8)], [], "without an object"),
    ([np.zeros(8, np.uint8)], [], [0], "1 destinations for 0 sources"),
])
def test_copy_sum64_refuses_what_it_cannot_copy_and_writes_nothing(dsts, srcs, starts, rule):
    if hostcopy.copy_sum64 is None:
        pytest.skip("the C helper kvstate.backends._streamcopy was not built (no C compiler at install)")
    with pytest.raises(ValueError, match=rule):
        hostcopy.copy_sum64(dsts, srcs, starts)
    assert not any(d.any() for d in dsts)
    with pytest.raises(BufferError):
        hostcopy.copy_sum64([b"read-only"], [b"read-only"], [0])
