"""The direct handoff: P lends its blocks on the lend board, D pulls them straight into its own.

The board's protocol (post, take, release, withdraw, sweep) and the refusal of malformed
entries; then P and D lifecycles on reference backends in one process, each over a
ThreadedDriver: pulled byte-exact, P's blocks held until D released them, the store written
beside the lend or not, and every way a pull fails falling back to the store (``both``) or
to D's read-failure policy (``direct``).
"""
import os
import threading
import time

import numpy as np
import pytest
from rigs import small_spec

from kvstate import ConfigError, DecodeLifecycle, Policy, PrefillLifecycle, ProtocolError, ValidationError
from kvstate import commands as C
from kvstate._keys import block_keys
from kvstate.backends import MemoryStore, ReferenceBackend, ThreadedDriver
from kvstate.backends._lends import LendBoard, fold_sums, leading_matches, pull_blocks
from kvstate.testing import fill_blocks, mismatched_blocks


class _Ops:
    """A stand-in backend side: fixed geometry, sums of the block id, a copy that records."""

    def __init__(self, geometry="g", bad=()):
        self.geometry, self.bad, self.copied = geometry, set(bad), []

    def lend_geometry(self):
        return self.geometry

    def lend_peer(self, rank):
        return {"kind": "test"}

    def lend_sums(self, rank, ids):
        return [fold_sums([b]) for b in ids]

    def pull_copy(self, rank, peer, src, dst, sums, guard):
        self.copied.append((list(src), list(dst)))
        return leading_matches([fold_sums([b + 1 if b in self.bad else b]) for b in src], sums)


def _always():
    return True


# -- the board -------------------------------------------------------------------------------------
def test_a_posted_lend_is_taken_once_then_released(tmp_path):
    board = LendBoard(tmp_path, wait=0)
    name = board.post(0, "g", ["a", "b", "c"], [7, 8, 9], [1, 2, 3], {"kind": "test"})
    assert board.state(name) == "lend"
    lend = board.take(0, ["b", "c"], _always)  # a suffix of the keys: a D with a prefix of its own
    assert (lend.blocks.tolist(), lend.sums.tolist(), lend.stores) == ([8, 9], [2, 3], False)
    assert board.state(name) == "taken" and board.take(0, ["b", "c"], _always) is None
    assert not board.withdraw(name)  # P cannot withdraw what D holds
    board.release(name, True)
    assert board.state(name) == "done"
    board.remove(name)
    assert board.state(name) is None and list(tmp_path.iterdir()) == []


def test_only_the_right_rank_and_keys_find_a_lend(tmp_path):
    board = LendBoard(tmp_path, wait=0)
    board.post(1, "g", ["a", "b"], [7, 8], [1, 2], {})
    assert board.take(0, ["a", "b"], _always) is None  # another rank's
    assert board.take(1, ["x", "b"], _always) is None  # the same last key after other keys: not these bytes
    assert board.take(1, ["a", "b"], _always) is not None


def test_a_withdrawn_lend_is_not_taken_and_d_waits_only_its_wait(tmp_path):
    board = LendBoard(tmp_path, wait=0.05)
    name = board.post(0, "g", ["a"], [7], [1], {})
    assert board.withdraw(name)
    t0 = time.monotonic()
    assert board.take(0, ["a"], _always) is None
    assert 0.04 <= time.monotonic() - t0 < 1.0


def test_d_finds_a_lend_posted_while_it_looks(tmp_path):
    board = LendBoard(tmp_path, wait=2.0)
    threading.Timer(0.05, lambda: board.post(0, "g", ["a"], [7], [1], {})).start()
    lend = board.take(0, ["a"], _always)
    assert lend is not None and lend.blocks.tolist() == [7]


def test_many_takers_one_winner(tmp_path):
    board = LendBoard(tmp_path, wait=0)
    board.post(0, "g", ["a"], [7], [1], {})
    got = []
    threads = [threading.Thread(target=lambda: got.append(board.take(0, ["a"], _always))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(x is not None for x in got) == 1


def test_entries_of_a_dead_p_are_skipped_and_swept(tmp_path):
    board = LendBoard(tmp_path, wait=0)
    name = board.post(0, "g", ["a"], [7], [1], {})
    dead = name.with_name(name.name.replace(f"-{os.getpid()}-", "-999999999-"))
    os.rename(name.with_name(name.name + ".lend"), dead.with_name(dead.name + ".lend"))
    assert board.take(0, ["a"], _always) is None
    assert LendBoard(tmp_path).sweep() == 0 and list(tmp_path.iterdir()) == []  # the new board swept it


def test_bad_board_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="wait"):
        LendBoard(tmp_path, wait=-1)
    with pytest.raises(ConfigError, match="directory"):
        LendBoard(42)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError):
        LendBoard(tmp_path / "f")


def test_pull_checks_geometry_and_sums_and_releases(tmp_path):
    board = LendBoard(tmp_path, wait=0)
    name = board.post(0, "g", ["a", "b"], [7, 8], [fold_sums([7]), fold_sums([8])], {}, stores=True)
    assert pull_blocks(board, _Ops("other"), 0, ["a", "b"], [1, 2], _always, None) == -1  # geometry: store
    assert board.state(name) == "fail"
    board.remove(name)
    name = board.post(0, "g", ["a", "b"], [7, 8], [fold_sums([7]), fold_sums([8])], {})
    ops = _Ops(bad={8})
    assert pull_blocks(board, ops, 0, ["a", "b"], [1, 2], _always, None) == 1  # the second block differs
    assert ops.copied == [([7, 8], [1, 2])] and board.state(name) == "fail"
    board.remove(name)
    name = board.post(0, "g", ["a", "b"], [7, 8], [fold_sums([7]), fold_sums([8])], {})
    assert pull_blocks(board, _Ops(), 0, ["a", "b"], [1, 2], _always, None) == 2
    assert board.state(name) == "done"


# -- P and D lifecycles over the board ----------------------------------------------------------------
class _Pair:
    """P and D in one process, each a lifecycle, a reference backend and a ThreadedDriver,
    sharing a lend board and a store; ``serve`` runs prompts P → D and checks D's bytes."""

    def __init__(self, tmp_path, handoff, read_failure="fail", lend_timeout=5.0, d_board=True, p_backend=None,
                 d_backend=None, spec=None, wait=0.5, arm=False):
        self.spec = spec = spec or small_spec(tp=2)
        self.store = MemoryStore(1 << 24)
        board = LendBoard(tmp_path, wait=wait)
        pol = Policy(transfer_timeout=5.0, fence_grace=1.0, read_failure=read_failure)
        self.P = PrefillLifecycle(spec, 64, pol, handoff=handoff, lend_timeout=lend_timeout)
        self.D = DecodeLifecycle(spec, 64, pol, arm_reads=arm)
        self.pb = (p_backend or ReferenceBackend)(spec, 64, self.store, lends=board)
        self.db = (d_backend or ReferenceBackend)(spec, 64, self.store, pulls=board if d_board else None)
        self.on_prefill = None

    def serve(self, prompts, pull=True):
        outcome, decoded, seen = {}, {}, []
        with ThreadedDriver(self.pb, workers=4, name="p") as pd, ThreadedDriver(self.db, workers=4, name="d") as dd:
            for rid, toks in prompts.items():
                self.D.reserve(rid, toks)
                self.P.admit(rid, toks)
            end = time.monotonic() + 20
            while len(outcome) < len(prompts) or self.P.live_requests() or self.P.pool.num_used:
                assert time.monotonic() < end, (outcome, self.P.live_requests())
                for lc, drv in ((self.P, pd), (self.D, dd)):
                    for n in drv.submit_all(lc.poll_commands()):
                        seen.append(n)
                        self._notice(n, lc, prompts, decoded, outcome, pull)
                    for c in drv.poll():
                        lc.complete(c)
                    lc.tick()
                time.sleep(0.0005)
            self.armed = dd.armed_reads()
        bad = [(rid, *x) for rid, blocks in decoded.items()
               for x in mismatched_blocks(self.db, block_keys(prompts[rid], self.spec.block_size), blocks)]
        return outcome, bad, seen

    def _notice(self, n, lc, prompts, decoded, outcome, pull):
        if isinstance(n, C.StartPrefill):
            fill_blocks(self.pb, block_keys(prompts[n.request_id], self.spec.block_size), n.block_ids)
            self.P.prefill_done(n.request_id, 11)
            if self.on_prefill:
                self.on_prefill(n)
        elif isinstance(n, C.SendFirstToken) and pull:
            self.D.deliver_first_token(n.request_id, n.token, n.error_code)
        elif isinstance(n, C.SendFirstToken):
            self.D.abort(n.request_id)
        elif isinstance(n, C.StartDecode):
            decoded[n.request_id] = n.block_ids
            self.D.finish(n.request_id)
        elif isinstance(n, (C.Recompute,)):
            fill_blocks(self.db, block_keys(prompts[n.request_id], self.spec.block_size), n.block_ids)
            self.D.recompute_done(n.request_id)
        elif isinstance(n, C.RequestEnded) and lc is self.D:
            outcome[n.request_id] = n.state

    def close(self):
        for b in (self.pb, self.db):
            b.close()


PROMPTS = {f"r{i}": [(i * 7 + j) % 13 for j in range(5 + 3 * i)] for i in range(8)}


class _Arms(ReferenceBackend):
    """D's backend saying it armed each announced read, and recording what it was asked."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.asked, self.pulled, self.let_go = [], [], []

    def arm_pull(self, rank, keys, block_ids, timeout=60.0):
        self.asked.append((rank, tuple(keys), tuple(block_ids)))
        return True

    def disarm_pull(self, rank, keys):
        self.let_go.append((rank, tuple(keys)))
        return True

    def pull(self, rank, keys, block_ids, until, guard=None):
        self.pulled.append((rank, tuple(keys), tuple(block_ids)))
        return super().pull(rank, keys, block_ids, until, guard)


def test_each_read_is_armed_at_reservation_as_the_pull_after_the_first_token_asks(tmp_path):
    """The chain a GPU's armed pull hangs on: D's lifecycle announces, the driver arms each
    rank, and the pull after the first token names the very keys and blocks armed."""
    pair = _Pair(tmp_path, "direct", d_backend=_Arms, arm=True)
    try:
        outcome, bad, _ = pair.serve(PROMPTS)
        assert outcome == {rid: "done" for rid in PROMPTS} and bad == []
        assert sorted(pair.db.asked) == sorted(pair.db.pulled) and len(pair.db.asked) == 2 * len(PROMPTS)
        assert pair.db.let_go == [] and pair.armed == {"armed": len(PROMPTS), "matched": len(PROMPTS), "let_go": 0}
    finally:
        pair.close()


@pytest.mark.parametrize("handoff", ["direct", "both"])
def test_d_pulls_every_cache_byte_exact_and_p_frees_after(tmp_path, handoff):
    pair = _Pair(tmp_path, handoff)
    try:
        outcome, bad, seen = pair.serve(PROMPTS)
        assert outcome == {rid: "done" for rid in PROMPTS} and bad == []
        assert pair.db.lend_counts["pulls"] == 2 * len(PROMPTS)  # every rank of every request
        assert pair.db.lend_counts["no_lend"] == pair.db.lend_counts["pull_failed"] == 0
        assert pair.P.counters["lends_pulled"] == len(PROMPTS) and pair.P.counters["lends_unpulled"] == 0
        stored = sum(pair.pb.query(r, block_keys(t, pair.spec.block_size)) for t in PROMPTS.values() for r in (0, 1))
        assert (stored > 0) == (handoff == "both")  # "direct" stores nothing
        # the first token went with the lend, before any answer: D decoded while P still lent
        first = [i for i, n in enumerate(seen) if isinstance(n, C.SendFirstToken)]
        assert len(first) == len(PROMPTS)
        assert pair.P.pool.num_used == pair.D.pool.num_used == 0
        assert list(tmp_path.iterdir()) == []  # every lend removed
    finally:
        pair.close()


def test_a_lend_nobody_pulls_ends_at_its_timeout_and_frees_the_blocks(tmp_path):
    pair = _Pair(tmp_path, "direct", lend_timeout=0.3)
    try:
        t0 = time.monotonic()
        outcome, _, _ = pair.serve({"r0": PROMPTS["r3"]}, pull=False)
        assert outcome == {"r0": "aborted"} and time.monotonic() - t0 >= 0.3
        assert pair.P.counters["lends_unpulled"] == 1 and pair.P.pool.num_used == 0
        assert list(tmp_path.iterdir()) == []
    finally:
        pair.close()


class _Reusing(ReferenceBackend):
    """A P whose blocks change after it posted them (what a bug freeing them early would do)."""

    def lend_sums(self, rank, ids):
        sums = super().lend_sums(rank, ids)
        for kind in self.spec.kinds:
            self.caches[rank][kind][0].view(np.uint8)[list(ids)[-1]] ^= 0xFF
        return sums


@pytest.mark.parametrize("handoff, read_failure, want", [("both", "fail", "done"), ("direct", "fail", "failed"),
                                                         ("direct", "recompute", "done")])
def test_a_pull_that_does_not_match_falls_back(tmp_path, handoff, read_failure, want):
    pair = _Pair(tmp_path, handoff, read_failure, p_backend=_Reusing)
    try:
        prompts = {"r0": PROMPTS["r5"]}
        outcome, bad, _ = pair.serve(prompts)
        assert outcome == {"r0": want}
        assert pair.db.lend_counts["pull_failed"] == 2  # a pull on each rank, each refused by the sums
        if handoff == "both":
            # the store's copy came from the changed blocks too: D refused nothing it could not check,
            # and every byte it kept is what P's blocks held when they were stored
            assert pair.db.lend_counts["pulls"] + pair.db.lend_counts["pull_failed"] == 2
        if want == "done" and handoff == "direct":
            assert bad == []  # recomputed
        assert pair.P.pool.num_used == pair.D.pool.num_used == 0
    finally:
        pair.close()


def test_a_d_without_a_lend_from_a_storing_p_reads_the_store(tmp_path):
    pair = _Pair(tmp_path, "store")
    try:
        outcome, bad, _ = pair.serve({"r0": PROMPTS["r4"]})
        assert outcome == {"r0": "done"} and bad == []
        assert pair.db.lend_counts["no_lend"] == 2 and pair.db.lend_counts["pulls"] == 0
    finally:
        pair.close()


def test_p_aborted_while_it_lends_holds_its_blocks_until_the_lend_ends(tmp_path):
    pair = _Pair(tmp_path, "direct", lend_timeout=2.0)
    pair.on_prefill = lambda n: pair.P.abort(n.request_id)
    try:
        outcome, _, _ = pair.serve({"r0": PROMPTS["r4"]}, pull=False)
        assert pair.P.counters["aborted"] == 1 and pair.P.pool.num_used == 0
        assert list(tmp_path.iterdir()) == []
    finally:
        pair.close()


@pytest.mark.parametrize("kw, rule", [
    ({"handoff": "nvlink"}, "handoff must be one of"),
    ({"handoff": "direct", "lend_timeout": 0}, "lend_timeout"),
    ({"handoff": "direct", "lend_timeout": float("inf")}, "lend_timeout"),
    ({"handoff": "both", "layerwise": True}, "not with"),
])
def test_bad_handoff_settings_are_refused(kw, rule):
    with pytest.raises(ConfigError, match=rule):
        PrefillLifecycle(small_spec(tp=1), 8, **kw)


def test_a_backend_without_a_board_refuses_to_lend(tmp_path):
    be = ReferenceBackend(small_spec(tp=1), 8, MemoryStore(1 << 20))
    with pytest.raises(Exception, match="no lend board"):
        be.lend(0, ["a"], [0], _always)
    with pytest.raises(ConfigError, match="LendBoard"):
        ReferenceBackend(small_spec(tp=1), 8, MemoryStore(1 << 20), lends=str(tmp_path))


def test_a_reference_backend_maps_a_lenders_shared_caches_and_no_other_file(tmp_path):
    """Across processes a reference D maps P's shared-memory cache file; a lend naming a file
    outside kvstate's shared-memory caches is refused by rule and nothing is copied."""
    from kvstate.backends._shm import SharedCaches

    spec = small_spec(tp=1)
    shared = SharedCaches.create(spec, 8)
    try:
        p = ReferenceBackend(spec, 8, MemoryStore(1 << 20), caches=shared, lends=LendBoard(tmp_path, wait=0))
        d = ReferenceBackend(spec, 8, MemoryStore(1 << 20), pulls=LendBoard(tmp_path, wait=0))
        keys = block_keys(list(range(12)), spec.block_size)
        fill_blocks(p, keys, [5, 6, 7])
        peer = dict(p.lend_peer(0), pid=1)  # as another process would see it: its file, not its token
        assert peer["kind"] == "shm" and peer["path"] == shared.paths[0]
        want = p.lend_sums(0, [5, 6, 7])
        assert d.pull_copy(0, peer, [5, 6, 7], [0, 1, 2], want, None) == 3
        assert mismatched_blocks(d, keys, [0, 1, 2]) == []
        assert d.pull_copy(0, peer, [5, 6, 7], [0, 1, 2], [want[0], want[1] ^ 1, want[2]], None) == 1
        for src, dst, sums in (([5, 6], [0, 1, 2], want), ([5, 6, 7], [0, 1, 2], want[:2])):
            with pytest.raises(ProtocolError, match="as many lender's blocks, own blocks and checksums"):
                d.pull_copy(0, peer, src, dst, sums, None)
        for bad in ({**peer, "path": "/etc/passwd"}, {**peer, "path": str(tmp_path / "kvstate-x")},
                    {**peer, "kind": "cuda-ipc"}):
            with pytest.raises(ProtocolError, match="shared-memory"):
                d.pull_copy(0, bad, [5], [3], want[:1], None)
        p.close()
        d.close()
    finally:
        shared.close()


@pytest.mark.parametrize("field, value, rule", [
    ("lends", "relative/dir", "absolute directory"), ("pulls", 5, "absolute directory"),
    ("pull_wait", -1, "pull_wait"), ("pull_wait", float("nan"), "pull_wait"),
])
def test_worker_boards_are_checked(field, value, rule):
    from kvstate.distributed import WorkerConfig

    spec = small_spec(tp=1)
    kw = {"rank": 0, "spec": {f: getattr(spec, f) for f in spec.__dataclass_fields__}, "num_blocks": 8,
          "command_address": "ipc:///tmp/a",
          "reply_address": "ipc:///tmp/b", "control_address": "ipc:///tmp/c", "store": {"kind": "file", "root": "/"},
          field: value}
    with pytest.raises(ConfigError, match=rule):
        WorkerConfig(**kw)


def test_a_step_driver_answers_a_lend_as_told_and_never_waits(tmp_path):
    """A step driver runs commands in the caller's thread: a lend there would wait for a D
    that cannot run. The caller's outcome is the lend's answer instead."""
    from kvstate.backends import StepDriver

    spec = small_spec(tp=1)
    P = PrefillLifecycle(spec, 8, Policy(read_prefix=False), handoff="direct")
    drv = StepDriver(P, ReferenceBackend(spec, 8, MemoryStore(1 << 20), lends=LendBoard(tmp_path, wait=0)))
    P.admit("a", list(range(9)))
    drv.pump()
    assert [type(n) for n in drv.notices] == [C.StartPrefill]
    P.prefill_done("a", 3)
    drv.pump()
    [(cid, rank)] = list(drv.pending)
    assert isinstance(drv.pending[(cid, rank)], C.LendBlocks) and P.state_of("a") == "lending"
    t0 = time.monotonic()
    assert drv.complete(cid, rank, 0).count == 0 and time.monotonic() - t0 < 1.0
    assert P.counters["lends_unpulled"] == 1 and P.pool.num_used == 0 and list(tmp_path.iterdir()) == []


def test_lends_nobody_pulls_never_hold_back_other_transfers(tmp_path):
    """A lend waits for D on a thread of its own: with every worker thread's worth of lends
    waiting, a read still runs at once; closing the driver ends the waiting lends."""
    spec = small_spec(tp=1)
    store = MemoryStore(1 << 20)
    be = ReferenceBackend(spec, 16, store, lends=LendBoard(tmp_path, wait=0))
    now = time.monotonic()
    with ThreadedDriver(be, workers=2) as d:
        for i in range(4):  # twice the workers
            d.submit(C.LendBlocks(f"l{i}", i + 1, (0,), now + 60, (f"k{i}",), (i,), fence=now + 120))
        d.submit(C.ReadBlocks("r", 9, (0,), now + 60, ("absent",), (9,), fence=now + 120))
        got = []
        end = time.monotonic() + 5
        while not got and time.monotonic() < end:
            got = d.poll(0.05)
        assert [(c.command_id, c.count) for c in got] == [(9, 0)]  # the read answered; the lends still wait
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 5 and list(tmp_path.iterdir()) == []  # closing ended them


def test_an_unfenced_lend_taken_by_a_d_that_died_ends_after_its_hold(tmp_path, monkeypatch):
    """A lend run without a fence, taken by a D that never releases it (it died): P's rank
    waits past the lend's deadline at most UNFENCED_HOLD seconds, then answers."""
    import kvstate.backends._lends as L

    monkeypatch.setattr(L, "UNFENCED_HOLD", 0.3)
    board = LendBoard(tmp_path, wait=2)
    end = time.monotonic() + 0.2
    taken = threading.Thread(target=lambda: board.take(0, ["a"], _always))  # takes, never releases
    taken.start()
    t0 = time.monotonic()
    assert L.lend_blocks(board, _Ops(), 0, ["a"], [7], lambda: time.monotonic() < end, None) == 0
    taken.join()
    assert 0.45 <= time.monotonic() - t0 < 3 and list(tmp_path.iterdir()) == []


def test_the_blocks_a_failed_pull_brought_whole_are_kept(tmp_path):
    """P's last block changed after it posted: D keeps the leading blocks that matched, reads
    the rest from the store (nothing there with ``direct``), and recomputes only from there."""
    pair = _Pair(tmp_path, "direct", "recompute", p_backend=_Reusing)
    try:
        toks = PROMPTS["r5"]
        lent = len(block_keys(toks, pair.spec.block_size))  # P's changed block is the last of these
        outcome, bad, seen = pair.serve({"r0": toks})
        assert outcome == {"r0": "done"} and bad == []
        [rec] = [n for n in seen if isinstance(n, C.Recompute)]
        assert rec.from_token == (lent - 1) * pair.spec.block_size  # from the changed block, not from 0
        assert pair.db.lend_counts["pull_failed"] == 2  # both ranks pulled, and each found the change
    finally:
        pair.close()


# -- the board's rules, one by one (each of these failed on a mutant that survived the rest) -------


def _lend_in_thread(board, ops, stores=False):
    from kvstate.backends._lends import lend_blocks

    out = []
    t = threading.Thread(target=lambda: out.append(lend_blocks(board, ops, 0, ["a", "b"], [7, 8], _always, None,
                                                               stores)))
    t.start()
    return t, out


@pytest.mark.parametrize("stores", [False, True])
def test_a_lend_answers_what_d_did(tmp_path, stores):
    board = LendBoard(tmp_path, wait=5)
    t, out = _lend_in_thread(board, _Ops(), stores)
    assert pull_blocks(board, _Ops(), 0, ["a", "b"], [1, 2], _always, None) == 2  # pulled whole
    t.join(5)
    assert out == [2]
    t, out = _lend_in_thread(board, _Ops(), stores)
    assert pull_blocks(board, _Ops(bad={7}), 0, ["a", "b"], [1, 2], _always, None) == (-1 if stores else 0)
    t.join(5)
    assert out == [0] and list(tmp_path.iterdir()) == []


def test_a_lend_nobody_takes_answers_zero_at_its_deadline(tmp_path):
    from kvstate.backends._lends import lend_blocks

    end = time.monotonic() + 0.1
    assert lend_blocks(LendBoard(tmp_path, wait=0), _Ops(), 0, ["a"], [7], lambda: time.monotonic() < end, None) == 0
    with pytest.raises(ValidationError):
        lend_blocks(LendBoard(tmp_path, wait=0), _Ops(), -1, ["a"], [7], _always, None)
    assert list(tmp_path.iterdir()) == []


def test_a_pull_past_its_fence_moves_nothing(tmp_path):
    """D's guard reaches the copy: past the fence the backend refuses before a byte moves."""
    spec = small_spec(tp=1)
    board = LendBoard(tmp_path, wait=5)
    p = ReferenceBackend(spec, 8, MemoryStore(1 << 20), lends=board)
    d = ReferenceBackend(spec, 8, MemoryStore(1 << 20), pulls=board)
    keys = block_keys(list(range(8)), spec.block_size)
    fill_blocks(p, keys, [3, 4])
    before = [d.block_bytes(0, k, b) for k in spec.kinds for b in (0, 1)]
    t = threading.Thread(target=lambda: p.lend(0, keys, [3, 4], _always, None, True))
    t.start()
    assert d.pull(0, keys, [0, 1], _always, lambda: False) == -1  # P stores too: read the store
    t.join(5)
    assert [d.block_bytes(0, k, b) for k in spec.kinds for b in (0, 1)] == before


def test_sweep_counts_what_it_removed_and_keeps_the_living(tmp_path):
    board = LendBoard(tmp_path, wait=0)
    live = board.post(0, "g", ["a"], [7], [1], {})
    for i, state in enumerate(("lend", "taken")):
        (tmp_path / f"lend-999999999-ab-{i}.r0.{state}").write_text("{}")
    (tmp_path / "unrelated.txt").write_text("x")
    assert board.sweep() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name + ".lend", "unrelated.txt"])


def test_a_token_that_is_no_int_finds_no_backend():
    from kvstate.backends._lends import local_peer

    with pytest.raises(ProtocolError, match="no backend of this process lends under token 'x'"):
        local_peer(None, "x")


class _Broken(_Ops):
    def pull_copy(self, rank, peer, src, dst, sums, guard):
        raise ProtocolError("the lender's caches could not be mapped")


@pytest.mark.parametrize("stores", [False, True])
def test_a_pull_that_raises_or_meets_a_bad_entry_answers_by_whether_p_stores(tmp_path, stores):
    board = LendBoard(tmp_path, wait=0)
    name = board.post(0, "g", ["a"], [7], [fold_sums([7])], {}, stores=stores)
    assert pull_blocks(board, _Broken(), 0, ["a"], [1], _always, None) == (-1 if stores else 0)
    assert board.state(name) == "fail"
    board.remove(name)
    name = board.post(0, "g", ["a"], [7], [fold_sums([7])], {}, stores=stores)
    path = name.with_name(name.name + ".lend")
    path.write_bytes(path.read_bytes().replace(b"\"version\": 2", b"\"version\": 7"))
    assert pull_blocks(board, _Ops(), 0, ["a"], [1], _always, None) == 0  # unreadable: whether P stores is unknown




def test_a_backend_that_cannot_arm_a_pull_says_so_and_its_pull_runs_as_before(tmp_path):
    """Arming is the CUDA backend's (tests/test_cuda_armed.py); the others answer False, hold
    nothing, and pull as they always do."""
    spec = small_spec(tp=1)
    p = ReferenceBackend(spec, 8, MemoryStore(1 << 20), lends=LendBoard(tmp_path, wait=0))
    d = ReferenceBackend(spec, 8, MemoryStore(1 << 20), pulls=LendBoard(tmp_path, wait=0))
    keys = block_keys(list(range(2 * spec.block_size)), spec.block_size)
    assert d.arm_pull(0, keys, [1, 2]) is False and d.disarm_pull(0, keys) is False
    fill_blocks(p, keys, [3, 4])
    t = threading.Thread(target=p.lend, args=(0, keys, [3, 4], lambda: True), daemon=True)
    t.start()
    d.pulls.wait = 5.0
    assert d.pull(0, keys, [1, 2], lambda: True) == 2
    t.join(10)
    assert mismatched_blocks(d, keys, [1, 2]) == []
    p.close()
    d.close()
