"""The protocol machine's layer-wise rules: P reports the layers of its prefills as a GPU
would finish them, in any interleaving with answers, faults, aborts and ticks (mixed into
``Protocol``)."""
from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from protocol_support import BS, STATS

from kvstate._keys import block_keys
from kvstate.testing import fill_layers

__all__ = ["LayerRules"]

LAUNCHED = object()  # a report's stand-in device event: the core and the drivers pass it on untouched


def stored_layers(spec, k: int) -> int:
    """Of the model's first ``k`` layers, those whose blocks are stored (a state layer has none)."""
    return k - sum(i < k for g in spec.groups if g.kind == "state" for i in g.layers)


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
        if not done:  # the layers start from the prefill's state (with state groups), checked as it starts
            self._start_from_state(rig.pb, n.state_pages, toks, n.num_cached_tokens, f"{rid}'s prefill", n.state_from)
            self.started.add(rid)
        span = (stored_layers(rig.spec, done), stored_layers(rig.spec, upto))
        fill_layers(rig.pb, block_keys(toks, BS), n.block_ids, span, n.num_cached_tokens // BS)
        if upto == rig.spec.layers:  # every layer computed: the states too
            self._compute_state(rig.pb, n.state_pages, toks, n.checkpoints)
        assert rig.P.layers_done(rid, upto, data.draw(st.sampled_from([None, LAUNCHED])))
        self.reported[rid] = upto
        STATS["layer_reports"] += 1
        STATS["state_layer_reports"] += bool(n.state_pages)  # a hybrid prefill's (the state layout's)
        self._process_notices()
