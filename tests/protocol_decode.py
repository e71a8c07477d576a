"""The protocol machine's decode rules: a running request grows token by token, as an engine's
decode steps grow it, so a cache outgrows its window and frees the blocks behind it; and a
running request is preempted, then taken deeper (mixed into ``Protocol``)."""
from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from protocol_support import BS, STATS, fill, snapshot

from kvstate import InvalidTransitionError, OutOfBlocksError

__all__ = ["DecodeRules"]


class DecodeRules:
    """``self.rig``, ``self.tokens`` and the helpers are the machine's."""

    @precondition(lambda self: self.rig.D.live_requests())
    @rule(data=st.data(), steps=st.integers(1, 12))
    def decode_steps(self, data, steps):
        """Run the engine until a request runs, then decode ``steps`` tokens of it: each step
        computes the cache of the token before the one it appends."""
        rig = self.rig
        if not self._run_to_running():
            return
        rid = data.draw(st.sampled_from(self._running()))
        for _ in range(steps):
            tok = data.draw(st.integers(0, 3))
            try:
                rig.D.append_tokens(rid, [tok])
            except OutOfBlocksError:
                break
            self.tokens[rid].append(tok)
            toks = self.tokens[rid][:-1]
            fill(rig.db, toks, rig.D.rows_of(rid), (len(toks) - 1) // BS)
            self._compute_state(rig.db, rig.D.pages_of(rid), toks)
            STATS["decode_steps"] += 1
        self._process_notices()

    def _running(self) -> list[str]:
        return sorted(r for r in self.rig.D.live_requests() if self.rig.D.state_of(r) == "running")

    def _run_to_running(self) -> bool:
        """Run the engine a little until some request is running on D; whether one is."""
        rig = self.rig
        for _ in range(4):
            if self._running() or not (self.prefills or rig.pd.pending or rig.dd.pending):
                break
            self.progress()
        return bool(self._running())

    @precondition(lambda self: self.rig.D.live_requests())
    @rule(data=st.data(), stage=st.sampled_from([0, 1, 2, 2, 2]), action=st.sampled_from(["cancel", "preempt"]))
    def deep_preempt(self, data, stage, action):
        """Preempt a running request (running the engine until one is), then take it deeper
        (write-back answered, resumed) before a cancel or a second preemption: reaches
        preempt_writing, preempted and reloading, which one-event rules rarely meet."""
        rig = self.rig
        if not self._run_to_running():
            return
        rid = data.draw(st.sampled_from(self._running()))
        self.faults["preempt"] += 1
        self.faults["preempt:running"] += 1
        rig.D.preempt(rid)
        self._process_notices()
        if stage >= 1 and rig.D.state_of(rid) in ("preempt_writing", "swapping_out"):
            self._answer_command("D", rid)
        if stage >= 2 and rid in rig.D.live_requests() and rig.D.state_of(rid) in ("preempted", "swapped"):
            try:
                rig.D.resume(rid)
            except OutOfBlocksError:
                pass
            self._process_notices()
        if rid not in rig.D.live_requests():
            return
        state = rig.D.state_of(rid)
        if state in ("preempt_writing", "swapping_out"):  # a second preemption while the copy runs: rejected
            self.faults["preempt"] += 1
            self.faults[f"preempt:{state}"] += 1
            snap = snapshot(rig.D)
            try:
                rig.D.preempt(rid)
                raise AssertionError(f"{rid} preempted twice")
            except InvalidTransitionError:
                assert snapshot(rig.D) == snap
        if action == "cancel":
            self._cancel("D", rid)
        else:
            self.faults["preempt"] += 1
            self.faults[f"preempt:{state}"] += 1
            try:
                rig.D.preempt(rid)
            except InvalidTransitionError:
                assert rig.D.state_of(rid) == state
        self._process_notices()
