"""Stateful protocol tests: hypothesis drives P and D through any order of completions,
faults, preemptions, aborts and clock ticks, and checks the invariants after every step."""
from __future__ import annotations

from collections import Counter

from conftest import Rig
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstate import InvalidTransitionError, OutOfBlocksError, Policy, UnknownRequestError
from kvstate import commands as C
from kvstate.demo import fake_block
from kvstate.keys import block_keys
from kvstate.machines import decode, prefill

BS = 4


class Protocol(RuleBasedStateMachine):
    @initialize(tp=st.integers(1, 4), read_failure=st.sampled_from(["fail", "recompute"]),
                preempt=st.sampled_from(["write", "recompute"]), retries=st.integers(0, 2),
                capacity=st.sampled_from([1 << 26, 6000]))
    def setup(self, tp, read_failure, preempt, retries, capacity):
        from kvstate.backends import MemoryStore
        self.rig = Rig(tp=tp, blocks=24, store=MemoryStore(capacity),
                       policy=Policy(read_failure=read_failure, preempt=preempt, write_retries=retries,
                                     transfer_timeout=5.0, fence_grace=3.0), first_token_timeout=12.0)
        self.tokens: dict[str, list[int]] = {}
        self.n = 0
        self.faults: Counter[str] = Counter()
        self.ended: set[str] = set()

    # -- helpers -----------------------------------------------------------------------------
    def _fill(self, backend, toks, blocks, start):
        spec = self.rig.spec
        keys = block_keys(toks, BS)
        for i in range(start, len(keys)):
            for r in range(spec.tp_size):
                for kind in spec.kinds:
                    backend.fill_block(r, kind, blocks[i], fake_block(keys[i], r, kind, spec.block_bytes(kind)))

    def _process_notices(self):
        rig = self.rig
        for _ in range(50):
            moved = False
            for drv in (rig.pd, rig.dd):
                drv.pump()
                notes, drv.notices = drv.notices, []
                for n in notes:
                    moved = True
                    self._notice(drv, n)
            if not moved:
                return

    def _notice(self, drv, n):
        rig, rid = self.rig, n.request_id
        if isinstance(n, C.StartPrefill):
            self._fill(rig.pb, self.tokens[rid][:self.plen[rid]], n.block_ids, n.num_cached_tokens // BS)
            rig.P.prefill_done(rid, 1)
        elif isinstance(n, C.SendFirstToken):
            if rid in rig.D.live_requests() and rig.D.state_of(rid) == "reserved":
                rig.D.deliver_first_token(rid, n.token, n.error_code)
                if n.error_code == 200:
                    self.tokens[rid] = self.tokens[rid][:self.plen[rid]] + [n.token]
        elif isinstance(n, C.StartDecode):
            self.faults["checked_start_decode"] += 1
            # D is runnable only with every needed block read on every rank, byte-equal to P's
            toks = self.tokens[rid][:-1]
            keys = block_keys(toks, BS)
            spec = rig.spec
            for i, k in enumerate(keys):
                for r in range(spec.tp_size):
                    for kind in spec.kinds:
                        assert rig.db.block_bytes(r, kind, n.block_ids[i]) == fake_block(
                            k, r, kind, spec.block_bytes(kind)), (rid, i, r, kind)
        elif isinstance(n, C.Recompute):
            self._fill(rig.db, self.tokens[rid][:-1], n.block_ids, n.from_token // BS)
            rig.D.recompute_done(rid)
        elif isinstance(n, C.RequestEnded) and drv is rig.dd:
            self.ended.add(rid)

    # -- rules -------------------------------------------------------------------------------
    @rule(length=st.integers(1, 14), share=st.booleans(), data=st.data())
    def arrive(self, length, share, data):
        rig = self.rig
        rid = f"r{self.n}"
        self.n += 1
        toks = [data.draw(st.integers(0, 3)) for _ in range(length)]
        if share and self.tokens:
            donor = self.tokens[data.draw(st.sampled_from(sorted(self.tokens)))]
            toks[:min(len(donor), length) - 1] = donor[:min(len(donor), length) - 1]
        if not rig.D.can_reserve(len(toks)):
            return
        rig.D.reserve(rid, toks)
        rig.P.admit(rid, toks)
        self.plen = getattr(self, "plen", {})
        self.plen[rid] = len(toks)
        self.tokens[rid] = list(toks)
        self._process_notices()

    @precondition(lambda self: self.rig.pd.pending or self.rig.dd.pending)
    @rule(data=st.data(), whole=st.booleans())
    def answer(self, data, whole):
        """Answer one (command, rank), or every rank of one command, each with its own outcome."""
        rig = self.rig
        drv = data.draw(st.sampled_from([d for d in (rig.pd, rig.dd) if d.pending]))
        cid, rank = data.draw(st.sampled_from(sorted(drv.pending)))
        keys = [k for k in sorted(drv.pending) if k[0] == cid] if whole else [(cid, rank)]
        for key in keys:
            cmd = drv.pending[key]
            kind = type(cmd).__name__
            outcome = data.draw(st.sampled_from(["ok"] * 6 + ["fail", "partial", "never"]))
            if outcome == "never":
                self.faults[f"never:{kind}"] += 1
                drv.drop(*key)
            elif outcome == "fail":
                self.faults[f"fail:{kind}"] += 1
                drv.complete(*key, "fail")
            elif outcome == "partial":
                self.faults[f"partial:{kind}"] += 1
                drv.complete(*key, data.draw(st.integers(0, len(cmd.keys))))
            else:
                drv.complete(*key)
        self._process_notices()

    @precondition(lambda self: self.rig.pd.pending or self.rig.dd.pending)
    @rule()
    def progress(self):
        """Answer every pending (command, rank) in full: lets runs get deep into the life."""
        for drv in (self.rig.pd, self.rig.dd):
            for key in sorted(drv.pending):
                if key in drv.pending:
                    drv.complete(*key)
        self._process_notices()

    @precondition(lambda self: len(self.rig.store) > 0)
    @rule(data=st.data())
    def evict(self, data):
        self.faults["evict"] += 1
        self.rig.store.evict([data.draw(st.sampled_from(sorted(self.rig.store.keys())))])

    @rule(dt=st.sampled_from([0.5, 2.0, 6.0]))
    def tick(self, dt):
        self.rig.clock.advance(dt)
        self.rig.P.tick()
        self.rig.D.tick()
        self._process_notices()

    @precondition(lambda self: self.rig.P.live_requests() or self.rig.D.live_requests())
    @rule(data=st.data(), side=st.sampled_from(["P", "D"]))
    def abort(self, data, side):
        lc = getattr(self.rig, side)
        if lc.live_requests():
            self.faults[f"abort:{side}"] += 1
            lc.abort(data.draw(st.sampled_from(sorted(lc.live_requests()))))
            self._process_notices()

    @precondition(lambda self: self.rig.D.live_requests())
    @rule(data=st.data())
    def decode_event(self, data):
        rig = self.rig
        rid = data.draw(st.sampled_from(sorted(rig.D.live_requests())))
        state = rig.D.state_of(rid)
        action = data.draw(st.sampled_from(["preempt", "resume", "append", "finish", "first_token"]))
        try:
            if action == "preempt":
                rig.D.preempt(rid)
                self.faults["preempt"] += 1
            elif action == "resume":
                rig.D.resume(rid)
            elif action == "append":
                tok = data.draw(st.integers(0, 3))
                rig.D.append_tokens(rid, [tok])
                self.tokens[rid].append(tok)
            elif action == "finish":
                rig.D.finish(rid)
            else:
                self.faults["duplicate_first_token"] += 1
                rig.D.deliver_first_token(rid, 2)
                self.tokens[rid] = self.tokens[rid][:self.plen[rid]] + [2]
        except (InvalidTransitionError, OutOfBlocksError):
            assert rig.D.state_of(rid) == state  # rejected events change nothing
        self._process_notices()

    @precondition(lambda self: self.ended)
    @rule(data=st.data())
    def event_for_recycled(self, data):
        rid = data.draw(st.sampled_from(sorted(self.ended)))
        if rid in self.rig.D.live_requests():
            return
        before = self.rig.D.pool.stats()
        self.faults["recycled_event"] += 1
        try:
            self.rig.D.deliver_first_token(rid, 1)
            raise AssertionError("an event for a recycled request was accepted")
        except UnknownRequestError:
            pass
        assert self.rig.D.pool.stats() == before

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def blocks_owned_once_and_accounted(self):
        if not hasattr(self, "rig"):
            return
        for lc in (self.rig.P, self.rig.D):
            owners = Counter(b for blocks in lc.owned_blocks().values() for b in blocks)
            assert all(c == 1 for c in owners.values()), "a block owned by two requests"
            pins = lc.pinned_blocks()
            pool = lc.pool
            for b in range(pool.num_blocks):
                assert pool._refs[b] == owners.get(b, 0) + pins.get(b, 0), (b, pool._refs[b])
            assert sorted(pool._free) == [b for b in range(pool.num_blocks) if pool._refs[b] == 0]
            st_ = pool.stats()
            assert st_.free + st_.used == st_.total
            for cmd in lc.pending_commands():
                assert cmd.deadline < float("inf")
            live = set(lc.TABLE.LIVE)
            for rid in lc.live_requests():
                assert lc.state_of(rid) in live

    def teardown(self):
        if not hasattr(self, "rig"):
            return
        rig = self.rig
        # drain: answer everything, tick past every deadline, end what the engine owns
        for _ in range(200):
            for drv in (rig.pd, rig.dd):
                drv.pump()
                for key in list(drv.pending):
                    drv.complete(*key)
            self._process_notices()
            for rid in rig.D.live_requests():
                if rig.D.state_of(rid) == "running":
                    rig.D.finish(rid)
                elif rig.D.state_of(rid) in ("preempted", "recomputing", "reserved"):
                    rig.D.abort(rid)
            for rid in rig.P.live_requests():
                if rig.P.state_of(rid) in ("prefilling", "waiting"):
                    rig.P.abort(rid)
            rig.clock.advance(20.0)
            rig.P.tick()
            rig.D.tick()
            self._process_notices()
            if not (rig.P.live_requests() or rig.D.live_requests() or rig.pd.pending or rig.dd.pending):
                break
        for lc in (rig.P, rig.D):
            assert lc.live_requests() == []
            assert lc.pool.num_used == 0, lc.pool.stats()
            assert lc.pending_commands() == []


Protocol.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestProtocol = Protocol.TestCase


def test_tables_cover_terminal_states():
    assert set(prefill.TERMINAL) == set(decode.TERMINAL) == {"done", "failed", "aborted"}
