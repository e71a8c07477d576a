"""The protocol machine's host tier rules: requests preempted into the host tier and back,
with a copy failing or partial on one rank either way (mixed into ``Protocol``)."""
from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from protocol_support import BS, KIND, STATS

from kvstate import OutOfBlocksError
from kvstate._keys import block_keys

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
    @rule(data=st.data(), how=st.sampled_from(["fail", "partial"]), count=st.integers(1, 3))
    def swap_out_fault(self, data, how, count):
        """Preempt running requests into the host tier, the swap-out failing or partial on one
        rank: the fallback (store write-back or recompute) runs, no slot stays referenced."""
        if self._run_to_running():
            for rid in data.draw(st.permutations(self._running()))[:count]:
                self._swap_out_and_in(rid, how, None, data)

    @precondition(lambda self: self.rig.D.live_requests() and self.rig.policy.preempt == "swap")
    @rule(data=st.data(), back=st.sampled_from(["ok", "fail", "partial"]), count=st.integers(1, 3))
    def swap_round_trip(self, data, back, count):
        """Preempt running requests into the host tier and back, the swap-in failing or partial
        on one rank (the rest is recomputed) or whole."""
        if self._run_to_running():
            for rid in data.draw(st.permutations(self._running()))[:count]:
                self._swap_out_and_in(rid, "ok", back, data)

    def _swap_out_and_in(self, rid, out, back, data):
        """Preempt ``rid``, answer its swap-out with ``out``, then (``back`` not None) resume it
        and answer its swap-in with ``back``."""
        rig = self.rig
        self.faults["preempt"] += 1
        self.faults["preempt:running"] += 1
        rig.D.preempt(rid)
        self._process_notices()
        if rig.D.state_of(rid) == "swapping_out":
            self._answer_one_rank_with(rid, out, data)
        if rid in rig.D.live_requests() and rig.D.state_of(rid) == "preempt_writing" and out == "ok":
            self._answer_command("D", rid)  # written through to the store as well
        if back is not None and rid in rig.D.live_requests() and rig.D.state_of(rid) == "swapped":
            STATS["state_swapped"] += bool(rig.D.pages_of(rid))  # kept its state page while swapped
            try:
                rig.D.resume(rid)
            except OutOfBlocksError:
                return
            self._process_notices()
            if rig.D.state_of(rid) == "swapping_in":
                self._answer_one_rank_with(rid, back, data)

    @precondition(lambda self: self.tokens and self.rig.D.host is not None and self.rig.D.host.stats().entries)
    @rule(data=st.data(), action=st.sampled_from(["go", "cancel", "preempt"]))
    def arrive_on_host_prefix(self, data, action):
        """A prompt equal to an earlier one, whose cache may sit in D's host tier: P serves it,
        D copies the leading blocks in from host memory (``loading``), then it is cancelled,
        preempted or left to read the rest from the store."""
        rig = self.rig
        held = [r for r in sorted(self.tokens)
                if rig.D.host.ready_prefix(block_keys(self.tokens[r][:self.plen[r]], BS)[:1])]
        if not held:
            return
        drid = data.draw(st.sampled_from(held))
        toks = self.tokens[drid][:self.plen[drid]]
        rid = f"r{self.n}"
        self.n += 1
        if -(-len(toks) // BS) > rig.P.pool.num_blocks or not rig.D.can_reserve(len(toks)):
            return
        self._admit(rid, toks)
        for _ in range(6):  # P's side only: prefill, prefix read, write
            if rid not in rig.P.live_requests():
                break
            for n in [n for n in self.prefills if n.request_id == rid]:
                self.prefills.remove(n)
                self._run_prefill(n)
            for key in sorted(rig.pd.pending):
                if key in rig.pd.pending:
                    rig.pd.complete(*key)
            self._process_notices()
        if rid not in rig.D.live_requests() or rig.D.state_of(rid) != "loading" or action == "go":
            return
        if action == "cancel":
            self._cancel("D", rid)
        else:
            self.faults["preempt"] += 1
            self.faults["preempt:loading"] += 1
            rig.D.preempt(rid)
            self._process_notices()
