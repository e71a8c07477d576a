"""The protocol machine's host tier rules: a request preempted into the host tier and back,
with a copy failing or partial on one rank either way (mixed into ``Protocol``)."""
from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from protocol_support import KIND

from kvstate import OutOfBlocksError

__all__ = ["SwapRules"]


class SwapRules:
    """Reaches swapping_out, swapped and swapping_in with their fallbacks, which one-event
    rules rarely meet (``self.rig``, ``self.faults`` and the helpers are the machine's)."""

    def _answer_one_rank_with(self, rid, how, data):
        """D's command for ``rid``: rank 0 answers ``how`` (ok, fail, partial), the others in full."""
        rig = self.rig
        cid = rig.D.waiting_for(rid)
        keys = sorted(k for k in rig.dd.pending if k[0] == cid)
        for i, key in enumerate(keys):
            cmd = rig.dd.pending[key]
            if i == 0 and how != "ok":
                self.faults[f"{KIND[type(cmd)]}_{how}"] += 1
                rig.dd.complete(*key, "fail" if how == "fail" else data.draw(st.integers(0, max(0, len(cmd.keys) - 1))))
            else:
                rig.dd.complete(*key)
        self._process_notices()

    @precondition(lambda self: self.rig.D.live_requests() and self.rig.policy.preempt == "swap")
    @rule(data=st.data(), out=st.sampled_from(["ok", "ok", "fail", "partial"]),
          back=st.sampled_from(["ok", "fail", "fail", "partial", "partial"]), count=st.integers(1, 3))
    def swap_round_trip(self, data, out, back, count):
        """Preempt running requests into the host tier and back, a copy failing or partial on
        one rank either way: swapping_out, swapped and swapping_in, with their fallbacks."""
        if not self._run_to_running():
            return
        for rid in data.draw(st.permutations(self._running()))[:count]:
            self._swap_out_and_in(rid, out, back, data)

    def _swap_out_and_in(self, rid, out, back, data):
        rig = self.rig
        self.faults["preempt"] += 1
        self.faults["preempt:running"] += 1
        rig.D.preempt(rid)
        self._process_notices()
        if rig.D.state_of(rid) == "swapping_out":
            self._answer_one_rank_with(rid, out, data)
        if rid in rig.D.live_requests() and rig.D.state_of(rid) == "swapped":
            try:
                rig.D.resume(rid)
            except OutOfBlocksError:
                return
            self._process_notices()
            if rig.D.state_of(rid) == "swapping_in":
                self._answer_one_rank_with(rid, back, data)
