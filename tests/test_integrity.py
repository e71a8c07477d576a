"""Never serve wrong bytes: checksummed block objects, reads that verify, objects that heal."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from lifecycle_helpers import TOKS, assert_clean, d_matches, deliver, handoff
from rigs import Rig, small_spec

from kvstate import commands as C
from kvstate._errors import ValidationError
from kvstate._keys import block_keys, rank_key
from kvstate._policy import Policy
from kvstate._spec import CacheSpec
from kvstate.backends import MemoryStore, ReferenceBackend, Store
from kvstate.backends._integrity import FORMAT_VERSION, geometry_id, manifest_size, pack_manifest
from kvstate.backends._objects import MANIFEST_KIND
from kvstate.testing import fill_blocks, mismatched_blocks

ROOT = Path(__file__).resolve().parents[1]


def pair(spec: CacheSpec | None = None, store=None, host_blocks: int = 0):
    spec = spec or small_spec(2)
    store = store if store is not None else MemoryStore(1 << 24)
    p, d = ReferenceBackend(spec, 16, store, host_blocks=host_blocks), ReferenceBackend(spec, 16, store)
    keys = block_keys(list(range(12)), spec.block_size)  # 3 full blocks of 4
    fill_blocks(p, keys, [3, 1, 6])
    return spec, store, p, d, keys


def rank0_mismatches(d: ReferenceBackend, keys: list[str], blocks: list[int]) -> list:
    return [m for m in mismatched_blocks(d, keys, blocks) if m[1] == 0]


def corrupt(store: MemoryStore, name: str, at: int = 5) -> None:
    """Flip one byte of a stored object, keeping its length."""
    buf = bytearray(4096)
    n = store.batch_get_into([name], [buf])[0]
    assert n > at
    buf[at] ^= 0xFF
    store.evict([name])
    assert store.batch_put_from([name], [buf[:n]]) == [0]


def test_every_block_carries_a_manifest_and_a_clean_read_verifies():
    spec, store, p, d, keys = pair()
    assert p.write(0, keys, [3, 1, 6]) == 3 and p.write(1, keys, [3, 1, 6]) == 3
    assert store.batch_is_exist([rank_key(k, MANIFEST_KIND, r) for k in keys for r in (0, 1)]) == [1] * 6
    assert d.read(0, keys, [0, 2, 4]) == 3 and d.broken_blocks == 0
    assert not rank0_mismatches(d, keys, [0, 2, 4])


def test_corrupt_bytes_at_full_length_are_a_failed_read_and_leave_the_store():
    spec, store, p, d, keys = pair()
    assert p.write(0, keys, [3, 1, 6]) == 3
    corrupt(store, rank_key(keys[1], "value", 0))
    assert d.read(0, keys, [0, 2, 4]) == 1  # block 0 verified, block 1 broken: the read stops there
    assert d.broken_blocks == 1
    assert store.batch_is_exist([rank_key(keys[1], "value", 0), rank_key(keys[1], MANIFEST_KIND, 0)]) == [0, 0]
    assert p.query(0, keys) == 1  # P's skip-if-stored no longer trusts it: the next write stores it again
    assert p.write(0, keys, [3, 1, 6]) == 3 and d.read(0, keys, [0, 2, 4]) == 3
    assert not rank0_mismatches(d, keys, [0, 2, 4])


def test_a_truncated_object_stored_as_a_success_is_caught_and_healed():
    spec, store, p, d, keys = pair()
    assert p.write(0, keys, [3, 1, 6]) == 3
    name = rank_key(keys[2], "key", 0)
    buf = bytearray(4096)
    n = store.batch_get_into([name], [buf])[0]
    store.evict([name])
    store.batch_put_from([name], [buf[:n // 2]])  # the pool kept half and said it was whole
    assert p.query(0, keys) == 3  # still looks stored
    assert d.read(0, keys, [0, 2, 4]) == 2 and d.broken_blocks == 1
    assert p.query(0, keys) == 2 and p.write(0, keys, [3, 1, 6]) == 3 and d.read(0, keys, [0, 2, 4]) == 3


def test_bytes_of_another_geometry_or_format_are_never_read_as_this_ones():
    spec, store, p, d, keys = pair()
    assert p.write(0, keys, [3, 1, 6]) == 3
    other = CacheSpec(num_layers=spec.num_layers, kv_heads=spec.kv_heads, block_size=spec.block_size,
                      head_dim=spec.head_dim, dtype="bfloat16", tp_size=spec.tp_size)  # same sizes, another dtype
    assert geometry_id(other, None) != geometry_id(spec, None)
    foreign = ReferenceBackend(other, 16, store)
    assert foreign.read(0, keys, [0, 1, 2]) == 0 and foreign.broken_blocks == 1  # refused, and evicted
    assert d.read(0, keys, [0, 2, 4]) == 0  # gone for this geometry too: it will be written again
    assert p.write(0, keys, [3, 1, 6]) == 3
    kinds = len(spec.kinds)
    future = struct.pack("<4sHHQ", b"KVSM", FORMAT_VERSION + 1, kinds, geometry_id(spec, None))
    name = rank_key(keys[0], MANIFEST_KIND, 0)
    store.evict([name])
    store.batch_put_from([name], [future + b"\0" * (manifest_size(kinds) - len(future))])
    assert d.read(0, keys, [0, 2, 4]) == 0 and d.broken_blocks == 1  # an unknown version: a failed read
    assert pack_manifest(1, [(1, 2)])[:4] == b"KVSM"


def test_corruption_on_one_rank_recomputes_from_the_prefix_verified_on_every_rank():
    rig = Rig(policy=Policy(read_failure="recompute", transfer_timeout=10.0, fence_grace=5.0))
    notices = handoff(rig, "r")
    keys = block_keys(TOKS, rig.spec.block_size)
    corrupt(rig.store, rank_key(keys[1], "key", 1))  # rank 1 only, block 1
    deliver(rig, notices)
    rig.dd.run_until_idle()
    [rc] = rig.notices(rig.dd, C.Recompute)
    assert rc.from_token == rig.spec.block_size  # block 0 verified on both ranks: recompute from block 1
    assert rig.db.broken_blocks == 1
    assert not mismatched_blocks(rig.db, keys[:1], rc.block_ids[:1])  # block 0 came verified: P's bytes
    rig.D.recompute_done("r")
    assert rig.D.state_of("r") == "running"
    rig.D.finish("r")
    assert_clean(rig)


def test_a_storage_fault_stops_poisoning_the_prompt_once_it_clears():
    """Puts that store truncated objects while reporting success: every request of the prompt
    fails while the fault lasts (never with wrong bytes), and the first one after it succeeds."""

    class Truncating(MemoryStore):
        broken = True

        batch_put_hashed = Store.batch_put_hashed  # hashes what it was given, then stores it badly

        def batch_put_from(self, keys, buffers):
            if self.broken:
                buffers = [memoryview(b).cast("B")[:max(1, memoryview(b).nbytes // 2)] if "_value_" in k else b
                           for k, b in zip(keys, buffers)]
            return super().batch_put_from(keys, buffers)

    store = Truncating(1 << 24)
    rig = Rig(store=store, policy=Policy(read_failure="fail", transfer_timeout=10.0, fence_grace=5.0))
    for i in range(3):
        deliver(rig, handoff(rig, f"bad{i}"))
        rig.dd.run_until_idle()
        [end] = rig.notices(rig.dd, C.RequestEnded)
        assert (end.state, end.error_code) == ("failed", 502)  # never decoded on wrong bytes
    assert rig.db.broken_blocks == 3 * 2  # each request's first block, on both ranks
    store.broken = False
    notices = handoff(rig, "good")
    deliver(rig, notices)
    rig.dd.run_until_idle()
    assert rig.D.state_of("good") == "running"
    [start] = rig.notices(rig.dd, C.StartDecode)
    assert d_matches(rig, TOKS, start.block_ids) and rig.db.broken_blocks == 6
    rig.D.finish("good")
    assert_clean(rig)


def test_corruption_in_the_host_tier_is_caught_before_it_reaches_the_gpu():
    spec, store, p, d, keys = pair(host_blocks=4)
    ids = [3, 1, 6]
    assert p.swap_out(0, ids, [0, 1, 2]) == 3
    arena = p.host[0]["value"]
    arena[1].view(np.uint8).reshape(-1)[3] ^= 0xFF  # host memory went bad under slot 1
    before = p.block_bytes(0, "value", 9)
    assert p.swap_in(0, [0, 1, 2], [8, 9, 10]) == 1  # slot 0 verified; slot 1 broken: stop there
    assert p.broken_slots == 1 and p.block_bytes(0, "value", 9) == before  # nothing scattered from it
    assert p.block_bytes(0, "key", 8) == p.block_bytes(0, "key", 3)
    assert p.flush_host(0, keys, [0, 1, 2]) == 1  # and a broken slot is never written to the store


def test_a_trusted_store_skips_manifests():
    spec, store, p, d, keys = pair(store=MemoryStore(1 << 24, verify=False))
    assert p.write(0, keys, [3, 1, 6]) == 3
    assert len(store) == 3 * len(spec.kinds)
    assert d.read(0, keys, [0, 2, 4]) == 3
    with pytest.raises(ValidationError, match="verify must be True or False"):
        MemoryStore(verify="yes")  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_fault_injection_soak_serves_no_wrong_bytes():
    """Corrupt, short and missing objects on random ranks (benchmarks/integrity_soak.py, 10,000
    requests in docs/benchmarks.md): every request that decodes holds exactly P's bytes, and
    nothing leaks."""
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from integrity_soak import soak
    r = soak(600, 0.05, seed=3, distinct=300)
    assert sum(r["faults_injected"].values()) > 100 and r["broken_blocks_found_serving"] > 30
    assert r["outcomes"]["recomputed"] > 0 and r["outcomes"]["read"] > 0
    assert r["wrong_blocks_in_decoding_requests"] == 0 and r["wrong_blocks_passing_verification_at_the_audit"] == 0
    assert r["leaked_blocks_or_requests"] == 0


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_the_embedded_stores_hash_what_they_copy(kind, tmp_path):
    """Fused copy and hash, a piece at a time, on the copy threads for a large batch: the
    checksums are XXH3-64 of the bytes stored and of the bytes read back."""
    import xxhash

    from kvstate.backends import FileStore
    store = MemoryStore(1 << 26, copy_threads=3) if kind == "memory" else FileStore(tmp_path, io_threads=3)
    rng = np.random.default_rng(0)
    objs = [rng.integers(0, 255, n, dtype=np.uint8) for n in (1, 1000, 300_000, 3 << 20, 3 << 20, 5 << 20)]
    keys = [f"o{i}" for i in range(len(objs))]
    status, sums = store.batch_put_hashed(keys, objs)  # 11 MiB together: the threaded path
    assert status == [0] * len(objs) and sums == [xxhash.xxh3_64_intdigest(o) for o in objs]
    back = [np.zeros(o.nbytes + 7, np.uint8) for o in objs]
    got, back_sums = store.batch_get_hashed([*keys, "absent"], [*back, bytearray(8)])
    assert got == [o.nbytes for o in objs] + [-1] and back_sums[:-1] == sums and back_sums[-1] == 0
    assert all((b[:o.nbytes] == o).all() for b, o in zip(back, objs))
    store.close()


def test_a_block_vouched_for_by_a_device_checksum_is_verified_on_the_host():
    """What the CUDA backend writes (SUM64, taken on the GPU) the host reads and verifies."""
    from kvstate.backends._integrity import SUM64, sum64
    spec, store, p, d, keys = pair()
    names, manifests = [], []
    for i, b in enumerate([3, 1, 6]):
        objects = [p.block_bytes(0, kind, b) for kind in spec.kinds]
        names += [rank_key(keys[i], kind, 0) for kind in spec.kinds]
        store.batch_put_from([rank_key(keys[i], kind, 0) for kind in spec.kinds], objects)
        entries = [(len(o), sum64(o)) for o in objects]
        manifests.append(pack_manifest(geometry_id(spec, None), entries, SUM64))
    store.batch_put_from([rank_key(k, MANIFEST_KIND, 0) for k in keys], manifests)
    assert d.read(0, keys, [0, 2, 4]) == 3 and not rank0_mismatches(d, keys, [0, 2, 4])
    corrupt(store, rank_key(keys[2], "key", 0), at=11)
    assert d.read(0, keys, [0, 2, 4]) == 2 and d.broken_blocks == 1


class FlakyStore(MemoryStore):
    """A pool whose next get of ``fail`` answers an error though the object is stored (a
    transport fault, or an object another writer is storing this instant)."""

    fail: set[str] = set()

    def _failing(self, keys, got):
        hit = [k in self.fail for k in keys]
        self.fail = self.fail - set(keys)
        return [-900 if h else n for h, n in zip(hit, got)]

    def batch_get_into(self, keys, buffers):
        return self._failing(keys, super().batch_get_into(keys, buffers))

    def batch_get_hashed(self, keys, buffers):
        got, sums = super().batch_get_hashed(keys, buffers)
        return self._failing(keys, got), sums


def test_a_get_that_failed_is_a_failed_read_that_evicts_nothing():
    """Only a block whose every object came (or was stored too large) and did not verify is
    evicted: a failed get says nothing of the object, and other requests may be reading it."""
    store = FlakyStore(1 << 24)
    spec, store, p, d, keys = pair(store=store)
    assert p.write(0, keys, [3, 1, 6]) == 3
    store.fail = {rank_key(keys[1], "key", 0)}
    assert d.read(0, keys, [0, 2, 4]) == 1 and d.broken_blocks == 0
    assert p.query(0, keys) == 3  # still stored: the next read succeeds
    assert d.read(0, keys, [0, 2, 4]) == 3
    assert not rank0_mismatches(d, keys, [0, 2, 4])


def test_an_object_stored_too_large_is_broken_and_evicted():
    spec, store, p, d, keys = pair()
    assert p.write(0, keys, [3, 1, 6]) == 3
    name = rank_key(keys[0], "value", 0)
    store.evict([name])
    assert store.batch_put_from([name], [bytes(spec.block_bytes("value") + 8)]) == [0]
    assert d.read(0, keys, [0, 2, 4]) == 0 and d.broken_blocks == 1
    assert p.query(0, keys) == 0 and p.write(0, keys, [3, 1, 6]) == 3  # healed by the next write
    assert d.read(0, keys, [0, 2, 4]) == 3
