"""The protocol machine's invariants: the pool's and transfers', checked after every step, and
the drained state, checked at the end of every example.

Each is counted in ``STATS`` only when it checked something, and names itself when it fails."""
from __future__ import annotations

from collections import Counter

from hypothesis.stateful import invariant
from protocol_support import BS, STATS, fill

from kvstate._pool import FREED
from kvstate._tables import rows
from kvstate.testing import mismatched_blocks

__all__ = ["PoolInvariants", "DrainedAtTeardown"]


class PoolInvariants:
    """Mixed into the protocol machine (``self.rig`` holds P and D once it is set up)."""

    def _sides(self):
        return (self.rig.P, self.rig.D) if hasattr(self, "rig") else ()

    @invariant()
    def block_owned_by_one_request_unless_a_cached_prefix(self):
        """Only a block published in the GPU prefix cache is shared, and each of its owners
        reached it through its own prompt's key for that block."""
        STATS["steps"] += hasattr(self, "rig")
        for lc in self._sides():
            owned = lc.owned_blocks()
            owners = Counter(b for blocks in owned.values() for b in blocks if b != FREED)
            if owners:
                STATS["invariant:block_owned_by_one_request_unless_a_cached_prefix"] += 1
                twice = {b for b, c in owners.items() if c > 1}
                cached = {b: k for k, b in lc.prefix_cache.cached_blocks().items()} if lc.prefix_cache else {}
                assert twice <= cached.keys(), \
                    f"block_owned_by_one_request_unless_a_cached_prefix: blocks {twice - cached.keys()} owned twice"
                for rid, blocks in owned.items():
                    keys = lc.keys_of(rid)
                    bad = [i for i, b in enumerate(blocks) if b in twice and (i >= len(keys) or keys[i] != cached[b])]
                    assert not bad, f"block_owned_by_one_request_unless_a_cached_prefix: {rid} shares block " \
                                    f"{blocks[bad[0]]} under another key"

    @invariant()
    def gpu_cached_block_holds_its_keys_bytes(self):
        """Every block the GPU prefix cache publishes holds its key's bytes on every rank, its
        index agrees both ways, and exactly its unheld blocks are idle (counted free)."""
        for lc, backend in ((self.rig.P, self.rig.pb), (self.rig.D, self.rig.db)) if self._sides() else ():
            cache = lc.prefix_cache
            if cache is None or not cache.cached_blocks():
                continue
            STATS["invariant:gpu_cached_block_holds_its_keys_bytes"] += 1
            entries = cache.cached_blocks()
            assert len(set(entries.values())) == len(entries), "gpu_cached_block_holds_its_keys_bytes: a block twice"
            for key, b in entries.items():
                bad = mismatched_blocks(backend, [key], [b])
                assert not bad, f"gpu_cached_block_holds_its_keys_bytes: block {b} (rank, kind) {bad[0][1:]}"
            refs = cache.refcounts()
            assert cache.prefix_stats().idle == sum(1 for b in entries.values() if not refs[b]), \
                "gpu_cached_block_holds_its_keys_bytes: idle count disagrees with the refcounts"

    @invariant()
    def refcount_equals_owners_plus_pins(self):
        for lc in self._sides():
            refs = lc.pool.refcounts()
            if any(refs):
                STATS["invariant:refcount_equals_owners_plus_pins"] += 1
                owners = Counter(b for blocks in lc.owned_blocks().values() for b in blocks if b != FREED)
                pins = lc.pinned_blocks()
                bad = [b for b, r in enumerate(refs) if r != owners.get(b, 0) + pins.get(b, 0)]
                assert not bad, f"refcount_equals_owners_plus_pins: block {bad[0]} has {refs[bad[0]]}"

    @invariant()
    def free_list_holds_exactly_the_unheld_blocks(self):
        for lc in self._sides():
            refs, free = lc.pool.refcounts(), lc.pool.free_ids()
            if any(refs) and free:  # both kinds present: a mix-up between them would show
                STATS["invariant:free_list_holds_exactly_the_unheld_blocks"] += 1
                assert sorted(free) == [b for b, r in enumerate(refs) if r == 0], \
                    "free_list_holds_exactly_the_unheld_blocks: the free list and the refcounts disagree"

    @invariant()
    def pool_counts_match_its_blocks(self):
        for lc in self._sides():
            refs, st_ = lc.pool.refcounts(), lc.pool.stats()
            if any(refs):
                STATS["invariant:pool_counts_match_its_blocks"] += 1
                held = sum(1 for r in refs if r)
                assert (st_.used, st_.free) == (held, len(refs) - held) and st_.peak_used >= held, \
                    f"pool_counts_match_its_blocks: stats {st_} against {held} blocks held"

    @invariant()
    def every_transfer_has_a_timer_due_by_its_fence(self):
        for lc in self._sides():
            cmds = lc.pending_commands()
            if cmds:  # a transfer no timer covers could hold its blocks forever
                STATS["invariant:every_transfer_has_a_timer_due_by_its_fence"] += 1
                due = lc.next_deadline()
                assert due is not None and due <= min(c.fence for c in cmds), \
                    f"every_transfer_has_a_timer_due_by_its_fence: next tick {due}, fences {[c.fence for c in cmds]}"

    @invariant()
    def live_request_in_legal_state(self):
        for lc in self._sides():
            live = lc.live_requests()
            if live:
                STATS["invariant:live_request_in_legal_state"] += 1
                bad = [(r, lc.state_of(r)) for r in live if lc.state_of(r) not in lc.DEFINITION.live]
                assert not bad, f"live_request_in_legal_state: {bad}"

    @invariant()
    def transfer_blocks_held_by_their_request_or_pinned(self):
        """A transfer's blocks stay held: by its request, which has not let go of the block list
        the transfer was cut from, or by the transfer's own pin."""
        for lc in self._sides():
            views = lc.transfers()
            if views:
                STATS["invariant:transfer_blocks_held_by_their_request_or_pinned"] += 1
                refs = lc.pool.refcounts()
                for cmd, blocks, pinned, held in views:  # (a flush from host memory touches no GPU block)
                    assert not blocks or (pinned or held) and all(refs[b] >= 1 for b in blocks), \
                        f"transfer_blocks_held_by_their_request_or_pinned: command {cmd.command_id}"

    @invariant()
    def no_transfer_touches_a_block_freed_behind_the_window(self):
        """Blocks a decoding request freed behind its window (``FREED`` in a table: a layout
        whose every layer is a window layer, or a window group's own table) lead the table, and
        are in no transfer; a full group's table frees none."""
        d = self.rig.D if hasattr(self, "rig") else None
        tables = {rid: list(zip(*d.rows_of(rid))) if d.spec.group_tables else [d.blocks_of(rid)]
                  for rid in d.live_requests()} if d is not None else {}
        freed = [rid for rid, ts in tables.items() if any(FREED in t for t in ts)]
        if freed:
            STATS["invariant:no_transfer_touches_a_block_freed_behind_the_window"] += 1
            STATS["window_tables_freed"] += d.spec.group_tables
            windows = d.blocks.window_tables
            for rid in freed:
                for i, table in enumerate(tables[rid]):
                    k = table.count(FREED)
                    assert table[:k] == (FREED,) * k and (not k or i in windows), \
                        f"no_transfer_touches_a_block_freed_behind_the_window: {rid} table {i} {table}"
            for cmd, blocks, _, _ in d.transfers():
                assert FREED not in blocks, \
                    f"no_transfer_touches_a_block_freed_behind_the_window: command {cmd.command_id} {blocks}"

    @invariant()
    def host_refs_equal_holders_plus_copies(self):
        """Each host tier entry is referenced once per request holding it (D's swapped ones)
        and once per swap still in flight over it (so no slot is reused under a copy, even a
        late one)."""
        for lc in self._sides():
            if lc.host is None:
                continue
            holdings = lc.host_holdings() if hasattr(lc, "host_holdings") else {}
            want = Counter(k for keys in holdings.values() for k in keys)
            want.update(k for c in lc.pending_commands() if c.__class__.__name__ in ("SwapOut", "SwapIn", "FlushHost")
                        for k in c.keys)
            if want:
                STATS["invariant:host_refs_equal_holders_plus_copies"] += 1
            bad = [k for k in want if lc.host.refcount(k) != want[k]]
            assert not bad, f"host_refs_equal_holders_plus_copies: {bad[0][:12]} has {lc.host.refcount(bad[0])}"
            assert lc.host.stats().referenced == len(want), "host_refs_equal_holders_plus_copies: extra references"


class DrainedAtTeardown:
    """At the end of an example: answer and finish everything, then P and D must be empty
    (``drained_all_terminal_and_empty``); the machine's fault counts go to ``STATS``."""

    def _run_recompute(self, n) -> bool:
        """The engine's recompute, if the request still wants it (as the command said)."""
        rig, rid = self.rig, n.request_id
        wanted = rid in rig.D.live_requests() and rig.D.state_of(rid) == "recomputing"
        if wanted and rig.D.rows_of(rid) == rows(n.block_ids, n.tables):
            toks = self.tokens[rid][:-1]
            self._start_from_state(rig.db, n.state_pages, toks, n.from_token, f"{rid}'s recompute")
            fill(rig.db, toks, rows(n.block_ids, n.tables), n.from_token // BS)
            self._compute_state(rig.db, n.state_pages, toks)
            rig.D.recompute_done(rid)
            return True
        return False

    def _drain_round(self) -> bool:
        """Answer everything, run the engine's work, end what it owns, tick past the deadlines;
        True once nothing is left."""
        rig = self.rig
        for drv in (rig.pd, rig.dd):
            drv.pump()
            for key in list(drv.pending):
                drv.complete(*key)
        self._process_notices()
        while self.prefills:
            self._run_prefill(self.prefills.pop())
        while self.recomputes:
            self._run_recompute(self.recomputes.pop())
        self._process_notices()
        for rid in rig.D.live_requests():
            state = rig.D.state_of(rid)
            if state == "running":
                rig.D.finish(rid)
            elif state in ("preempted", "recomputing", "reserved", "swapped"):
                rig.D.abort(rid)
        for rid in rig.P.live_requests():
            if rig.P.state_of(rid) in ("prefilling", "saved", "waiting"):
                rig.P.abort(rid)
        rig.clock.advance(20.0)
        rig.P.tick()
        rig.D.tick()
        self._process_notices()
        return not (rig.P.live_requests() or rig.D.live_requests() or rig.pd.pending or rig.dd.pending)

    def teardown(self):
        if not hasattr(self, "rig"):
            return
        for _ in range(200):
            if self._drain_round():
                break
        for lc in (self.rig.P, self.rig.D) if self.CHECK_DRAINED else ():
            pages = lc.states.pool.num_used if lc.states.pool is not None else 0  # state pages, with state groups
            left = (lc.live_requests(), lc.pool.num_used, lc.pending_commands(), pages)
            assert left == ([], 0, [], 0), f"drained_all_terminal_and_empty: {lc.DEFINITION.name} left {left}"
        for lc in (self.rig.P, self.rig.D) if self.CHECK_DRAINED else ():
            if lc.host is not None:
                host = lc.host.stats()
                assert host.referenced == 0, f"drained_all_terminal_and_empty: {lc.DEFINITION.name} host {host}"
        STATS["invariant:drained_all_terminal_and_empty"] += 1
        for side, lc in (("P", self.rig.P), ("D", self.rig.D)):  # shared GPU blocks the run produced
            if lc.prefix_cache is not None:
                STATS[f"gpu_prefix_hit_blocks:{side}"] += lc.prefix_cache.prefix_stats().hit_blocks
        if self.rig.P.states:  # blocks a hybrid prompt took from P's host tier
            STATS["state_host_prefix_blocks"] += self.rig.P.counters["host_prefix_blocks"]
        STATS.update({f"fault:{k}": v for k, v in self.faults.items()})
