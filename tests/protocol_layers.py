"""The protocol machine's layer-wise rules: P reports the layers of its prefills as a GPU
would finish them, in any interleaving with answers, faults, aborts and ticks (mixed into
``Protocol``)."""
from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from protocol_support import BS, STATS

from kvstate.keys import block_keys
from kvstate.testing import fill_layers

__all__ = ["LayerRules"]

LAUNCHED = object()  # a report's stand-in device event: the core and the drivers pass it on untouched


class LayerRules:
    """A layer-wise save may store only layers P reported, so a group stored early holds stale
    bytes, which D's byte check on ``StartDecode`` reports (``self.rig``, ``self.prefills``
    and the helpers are the machine's)."""

    @precondition(lambda self: self.rig.P.layerwise and self.prefills)
    @rule(data=st.data())
    def layers(self, data):
        """The engine finished more layers of a prefill it runs: their bytes, then the report
        (as finished, or as launched with an event, which a CPU backend has no need to wait on)."""
        rig = self.rig
        n = data.draw(st.sampled_from(self.prefills))
        rid = n.request_id
        if rid not in rig.P.live_requests() or rig.P.state_of(rid) not in ("prefilling", "saved"):
            return
        done = self.reported.get(rid, 0)
        if done == rig.spec.layers:
            return
        upto = data.draw(st.integers(done + 1, rig.spec.layers))
        toks = self.tokens[rid][:self.plen[rid]]
        fill_layers(rig.pb, block_keys(toks, BS), n.block_ids, (done, upto), n.num_cached_tokens // BS)
        assert rig.P.layers_done(rid, upto, data.draw(st.sampled_from([None, LAUNCHED])))
        self.reported[rid] = upto
        STATS["layer_reports"] += 1
        self._process_notices()
