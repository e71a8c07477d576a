"""The protocol state machine: hypothesis drives P and D through any order of completions,
faults, preemptions, aborts and clock ticks, and checks the invariants after every step.

Shared by ``tests/test_protocol.py`` (the CI profile, with fault quotas) and
``benchmarks/protocol.py`` (the report; ``KVSTATE_PROTOCOL_PROFILE=deep`` for the deep run).
Every run adds to :data:`~protocol_support.STATS`: examples, steps, faults per class, invariant checks.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from protocol_decode import DecodeRules
from protocol_invariants import DrainedAtTeardown, PoolInvariants
from protocol_layers import LayerRules
from protocol_states import StateRules
from protocol_support import BS, KIND, LAYOUTS, STATS, StoreSwitch, decode_mismatches, fill, snapshot
from protocol_swaps import SwapRules
from rigs import Rig, small_spec

from kvstate import InvalidTransitionError, OutOfBlocksError, Policy, UnknownRequestError
from kvstate import commands as C
from kvstate._tables import per_block, rows
from kvstate.backends import MemoryStore


class Protocol(StateRules, SwapRules, LayerRules, DecodeRules, PoolInvariants, DrainedAtTeardown,
               RuleBasedStateMachine):
    CHECK_DRAINED = True  #: teardown checks the drained state (tests of single invariants turn it off)
    LAYOUTS_ONLY: tuple[str, ...] = ()  #: draw only these layouts (a hunt for one layout's bug); () all

    @initialize(tp=st.integers(1, 4), read_failure=st.sampled_from(["fail", "recompute"]),
                preempt=st.sampled_from(["write", "recompute", "swap", "swap", "swap"]), retries=st.integers(0, 2),
                capacity=st.sampled_from([1 << 26, 6000]), p_blocks=st.sampled_from([24, 6]),
                host_blocks=st.sampled_from([24, 24, 3]), swap_fallback=st.sampled_from(["write", "recompute"]),
                swap_write=st.sampled_from(["host", "through", "back"]), prefix_cache=st.booleans(),
                layerwise=st.booleans(), groups=st.sampled_from([1, 2]),
                layout=st.sampled_from(["plain", "plain", "plain", "window", "sliding", "latent", "state",
                                        "window_state", "window_tables"]))
    def setup(self, tp, read_failure, preempt, retries, capacity, p_blocks, host_blocks, swap_fallback, swap_write,
              prefix_cache, layerwise, groups, layout):  # a small P pool makes requests queue for blocks ("waiting")
        STATS["examples"] += 1
        if self.LAYOUTS_ONLY:  # a hunt for one layout's bug: every draw becomes one of them
            layout = self.LAYOUTS_ONLY[sorted(LAYOUTS).index(layout) % len(self.LAYOUTS_ONLY)]
        if layerwise and layout in ("window", "sliding", "window_state", "window_tables"):  # stored by group
            layout = "plain"
        if layout == "window_tables":  # group tables: no GPU prefix cache or host tier (kvstate._tables)
            prefix_cache, host_blocks = False, 0
            preempt = "write" if preempt == "swap" else preempt
        STATS[f"layout:{layout}"] += 1
        keep = 1 + groups  # the groups draw (only plain layouts use it): the checkpoints P keeps, 2 or 3
        STATS[f"state_checkpoints:{keep}"] += "state" in layout
        layerwise = layerwise or (layout == "state" and keep == 3)  # 3 in 4: a hybrid's layer reports are few
        groups = 1 if layout != "plain" and layout != "latent" else groups
        if "state" in layout:  # state pages: no write-back from host memory
            swap_write = swap_write.replace("back", "through")
        self.switch = StoreSwitch(MemoryStore(capacity))  # a 3-slot host tier is too small: the swap fallback runs
        spec = small_spec(tp, layer_groups=groups, **LAYOUTS[layout])
        # with group tables, P keeps one table half the time: the store's layout is the same
        p_spec = dataclasses.replace(spec, group_tables=False) if spec.group_tables and keep == 2 else spec
        p_blocks *= per_block(p_spec)  # as many logical blocks whatever P's tables
        self.rig = Rig(tp=tp, blocks=24, p_blocks=p_blocks, store=self.switch, host_blocks=host_blocks,
                       policy=Policy(read_failure=read_failure, preempt=preempt, write_retries=retries,
                                     transfer_timeout=5.0, fence_grace=3.0, queue_timeout=8.0,
                                     swap_fallback=swap_fallback, swap_write=swap_write, swapped_timeout=15.0,
                                     state_checkpoints=keep),
                       first_token_timeout=12.0, prefix_cache=prefix_cache, layerwise=layerwise,
                       num_states=6 if "state" in layout else 0,
                       spec=p_spec, d_spec=spec)
        #: prompts of state layouts are drawn twice over (up to half P's pool: others still fit beside
        #: them), so they pass several checkpoints
        self.stretch = 2 if "state" in layout else 1
        self.reported: dict[str, int] = {}  # layers each layer-wise prefill reported
        self.started: set[str] = set()  # prefills whose starting state was checked
        self.tokens: dict[str, list[int]] = {}
        self.plen: dict[str, int] = {}  # prompt length per request
        self.n = 0
        self.faults: Counter[str] = Counter()
        self.ended: set[str] = set()
        self.recomputes: list = []
        self.prefills: list = []

    # -- helpers -----------------------------------------------------------------------------
    def _admit(self, rid, toks):
        """D reserves, P admits, the harness records the prompt; then the notices run."""
        self.rig.D.reserve(rid, toks)
        self.rig.P.admit(rid, toks)
        self.plen[rid] = len(toks)
        self.tokens[rid] = list(toks)
        self._process_notices()

    def _answer_command(self, side, rid):
        """Every rank answers the command ``rid`` waits for on ``side``, in full."""
        lc, drv = (self.rig.P, self.rig.pd) if side == "P" else (self.rig.D, self.rig.dd)
        cid = lc.waiting_for(rid)
        for key in sorted(k for k in drv.pending if k[0] == cid):
            drv.complete(*key)
        self._process_notices()

    def _cancel(self, side, rid):
        """Abort ``rid`` on ``side``, counted per state (and whether a transfer was in flight)."""
        lc = getattr(self.rig, side)
        self.faults["cancel"] += 1
        self.faults[f"cancel:{side}:{lc.state_of(rid)}"] += 1
        if lc.waiting_for(rid):
            self.faults["cancel_mid_transfer"] += 1
        lc.abort(rid)
        self._process_notices()

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
            self.prefills.append(n)  # the engine computes it later (rule prefill)
        elif isinstance(n, C.SendFirstToken):
            if rid in rig.D.live_requests() and rig.D.state_of(rid) == "reserved":
                rig.D.deliver_first_token(rid, n.token, n.error_code)
                if n.error_code == 200:
                    self.tokens[rid] = self.tokens[rid][:self.plen[rid]] + [n.token]
            else:  # it arrives after D gave up waiting (or was told by another message)
                self.faults["late_first_token"] += 1
                snap = snapshot(rig.D)
                if rid in rig.D.live_requests():  # live in another state: a protocol error
                    try:
                        rig.D.deliver_first_token(rid, n.token, n.error_code)
                        raise AssertionError(f"a second first token for live {rid} was accepted")
                    except InvalidTransitionError:
                        pass
                    assert snapshot(rig.D) == snap
                else:  # ended: dropped, counted, reported; nothing else changes
                    late = rig.D.stats()["late_events"]
                    assert rig.D.deliver_first_token(rid, n.token, n.error_code) is False
                    assert rig.D.stats()["late_events"] == late + 1
                    assert snapshot(rig.D)[:4] == snap[:4]
        elif isinstance(n, C.StartDecode):
            # D is runnable only with every needed block read on every rank, byte-equal to P's
            toks = self.tokens[rid][:-1]
            STATS["invariant:runnable_only_after_full_read_on_every_rank_with_p_bytes"] += bool(toks)
            bad = decode_mismatches(rig.db, toks, rows(n.block_ids, n.tables))
            assert not bad, \
                f"runnable_only_after_full_read_on_every_rank_with_p_bytes: {rid} (block, rank, kind) {bad[:3]}"
            self._check_decode_state(rid, n.state_pages)
        elif isinstance(n, C.Recompute):
            self.recomputes.append(n)  # the engine computes it later (rule recompute)
        elif isinstance(n, C.RequestEnded) and drv is rig.dd:
            self.ended.add(rid)

    # -- rules -------------------------------------------------------------------------------
    @rule(length=st.integers(1, 14), share=st.booleans(), data=st.data())
    def arrive(self, length, share, data):
        rig = self.rig
        rid = f"r{self.n}"
        self.n += 1
        toks = [data.draw(st.integers(0, 3)) for _ in range(length)]
        if self.stretch > 1:
            toks = (toks * self.stretch)[:rig.P.pool.num_blocks * BS // 2]
        if share and self.tokens:
            donor = self.tokens[data.draw(st.sampled_from(sorted(self.tokens)))]
            toks[:min(len(donor), len(toks)) - 1] = donor[:min(len(donor), len(toks)) - 1]
        if not rig.D.can_reserve(len(toks)):
            return
        self._admit(rid, toks)

    @precondition(lambda self: self.tokens and len(self.rig.store) > 0)
    @rule(data=st.data(), cancel=st.booleans())
    def arrive_on_stored_prefix(self, data, cancel):
        """A prompt extending an earlier one: P's prefix read (state reading_prefix) finds the
        stored blocks; the request is cancelled there or left to go on."""
        rig = self.rig
        drid = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[drid][:self.plen[drid]] + [data.draw(st.integers(0, 3))
                                                       for _ in range(data.draw(st.integers(1, 5)))]
        rid = f"r{self.n}"
        self.n += 1
        if -(-len(toks) // BS) > rig.P.pool.num_blocks or not rig.D.can_reserve(len(toks)):
            return
        self._admit(rid, toks)
        if cancel and rid in rig.P.live_requests():
            self._cancel("P", rid)

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
            kind = KIND[type(cmd)]
            outcome = data.draw(st.sampled_from(["ok"] * 4 + ["fail", "partial", "never", "store_down"]))
            if outcome == "never":
                self.faults["rank_never_answers"] += 1
                drv.drop(*key)
            elif outcome == "fail":
                self.faults[f"{kind}_fail"] += 1
                drv.complete(*key, "fail")
            elif outcome == "partial":
                self.faults[f"{kind}_partial"] += 1
                drv.complete(*key, data.draw(st.integers(0, len(cmd.keys))))
            elif outcome == "store_down":
                self.faults["store_unavailable"] += 1
                self.switch.down = True
                try:
                    drv.complete(*key)
                finally:
                    self.switch.down = False
            else:
                drv.complete(*key)
        self._process_notices()

    @precondition(lambda self: self.rig.pd.pending or self.rig.dd.pending)
    @rule()
    def progress(self):
        """Run queued prefills and answer every pending (command, rank) in full: lets runs get
        deep into the life."""
        while self.prefills:
            self._run_prefill(self.prefills.pop(0))
        for drv in (self.rig.pd, self.rig.dd):
            for key in sorted(drv.pending):
                if key in drv.pending:
                    drv.complete(*key)
        self._process_notices()

    def _io_pending(self):  # store transfers (swaps are faulted by the swap rules and `answer`)
        return [(drv, key) for drv in (self.rig.pd, self.rig.dd) for key, cmd in sorted(drv.pending.items())
                if isinstance(cmd, (C.WriteBlocks, C.ReadBlocks))]

    @precondition(lambda self: self._io_pending())
    @rule(data=st.data(), how=st.sampled_from(["fail", "partial"]))
    def fault_io(self, data, how):
        """A write or read fails on one rank, or moves only its leading blocks there."""
        pending = self._io_pending()
        reads = [(d, k) for d, k in pending if isinstance(d.pending[k], C.ReadBlocks)]
        if reads:  # reads are rarer (they need a write first): fault them whenever there is one
            pending = reads
        drv, key = data.draw(st.sampled_from(pending))
        cmd = drv.pending[key]
        kind = KIND[type(cmd)]
        self.faults[f"{kind}_{how}"] += 1
        drv.complete(*key, "fail" if how == "fail" else data.draw(st.integers(0, max(0, len(cmd.keys) - 1))))
        self._process_notices()

    def _run_prefill(self, n) -> None:
        rig, rid = self.rig, n.request_id
        if rid in rig.P.live_requests() and rig.P.state_of(rid) in ("prefilling", "saved"):
            toks = self.tokens[rid][:self.plen[rid]]
            STATS["cached_state_starts"] += n.state_from >= 0  # from a state P's GPU prefix cache kept
            if rid not in self.started:  # (checked when its first layers were reported, if they were)
                self._start_from_state(rig.pb, n.state_pages, toks, n.num_cached_tokens, f"{rid}'s prefill",
                                       n.state_from)
            fill(rig.pb, toks, rows(n.block_ids, n.tables), n.num_cached_tokens // BS)
            self._compute_state(rig.pb, n.state_pages, toks, n.checkpoints)
            rig.P.prefill_done(rid, 1)

    @precondition(lambda self: self.prefills)
    @rule(data=st.data())
    def prefill(self, data):
        """The engine finished a prefill it was asked for."""
        self._run_prefill(self.prefills.pop(data.draw(st.integers(0, len(self.prefills) - 1))))
        self._process_notices()

    @precondition(lambda self: self.recomputes)
    @rule(data=st.data())
    def recompute(self, data):
        """The engine finished a recompute it was asked for (if the request still wants it)."""
        n = self.recomputes.pop(data.draw(st.integers(0, len(self.recomputes) - 1)))
        if self._run_recompute(n):
            self._process_notices()

    @precondition(lambda self: self.rig.pd.pending or self.rig.dd.pending)
    @rule(data=st.data())
    def late_answer(self, data):
        """A rank answers after its command's deadline (and the fence grace, sometimes) passed."""
        rig = self.rig
        drv = data.draw(st.sampled_from([d for d in (rig.pd, rig.dd) if d.pending]))
        key = data.draw(st.sampled_from(sorted(drv.pending)))
        cmd = drv.pending[key]
        rig.clock.advance(max(0.0, cmd.deadline - rig.clock()) + data.draw(st.sampled_from([0.1, 4.0])))
        rig.P.tick()
        rig.D.tick()
        self.faults["rank_answers_late"] += 1
        c = drv.complete(*key)
        if c.error and c.error.startswith("FenceError"):
            self.faults["answer_after_fence"] += 1  # it moved nothing: the blocks may be recycled
        self._process_notices()

    @precondition(lambda self: len(self.rig.store) > 0)
    @rule(data=st.data())
    def evict(self, data):
        self.faults["evict_between_write_and_read"] += 1
        self.rig.store.evict([data.draw(st.sampled_from(sorted(self.rig.store.keys())))])

    @rule(dt=st.sampled_from([0.5, 2.0, 6.0]))
    def tick(self, dt):
        self.faults["tick"] += 1
        self.rig.clock.advance(dt)
        self.rig.P.tick()
        self.rig.D.tick()
        self._process_notices()

    @precondition(lambda self: self.rig.P.live_requests() or self.rig.D.live_requests())
    @rule(data=st.data(), side=st.sampled_from(["P", "D"]))
    def abort(self, data, side):
        lc = getattr(self.rig, side)
        if lc.live_requests():
            self._cancel(side, data.draw(st.sampled_from(sorted(lc.live_requests()))))

    @precondition(lambda self: self.rig.D.live_requests())
    @rule(data=st.data())
    def decode_event(self, data):
        rig = self.rig
        rid = data.draw(st.sampled_from(sorted(rig.D.live_requests())))
        state = rig.D.state_of(rid)
        action = data.draw(st.sampled_from(["preempt", "resume", "append", "finish", "first_token"]))
        try:
            if action == "preempt":
                self.faults["preempt"] += 1
                self.faults[f"preempt:{state}"] += 1
                rig.D.preempt(rid)
            elif action == "resume":
                rig.D.resume(rid)
            elif action == "append":
                tok = data.draw(st.integers(0, 3))
                rig.D.append_tokens(rid, [tok])
                self.tokens[rid].append(tok)
                # the decode step that produced ``tok`` computed the cache of the token before it
                # (keys of every block but the newest token's change with it): as an engine would
                toks = self.tokens[rid][:-1]
                fill(rig.db, toks, rig.D.rows_of(rid), (len(toks) - 1) // BS)
                self._compute_state(rig.db, rig.D.pages_of(rid), toks)
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
        before = snapshot(self.rig.D)
        self.faults["recycled_event"] += 1
        event = data.draw(st.sampled_from(["first_token", "abort", "recompute_done", "finish"]))
        if event == "finish":  # the scheduler's own action on an ended request is its bug: raises
            try:
                self.rig.D.finish(rid)
                raise AssertionError("finish of a recycled request was accepted")
            except UnknownRequestError:
                pass
        else:  # a late answer or abort is normal: dropped
            call = {"first_token": lambda: self.rig.D.deliver_first_token(rid, 1),
                    "abort": lambda: self.rig.D.abort(rid),
                    "recompute_done": lambda: self.rig.D.recompute_done(rid)}[event]
            assert call() is False
        assert snapshot(self.rig.D)[:4] == before[:4]


__all__ = ["Protocol"]
