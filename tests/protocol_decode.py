"""The protocol machine's decode steps: a running request grows token by token, as an engine's
decode steps grow it, so a cache outgrows its window and frees the blocks behind it (mixed
into ``Protocol``)."""
from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from protocol_support import BS, STATS, fill

from kvstate import OutOfBlocksError

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
            fill(rig.db, toks, rig.D.blocks_of(rid), (len(toks) - 1) // BS)
            STATS["decode_steps"] += 1
        self._process_notices()
