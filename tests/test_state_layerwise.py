"""State layer groups with layer-wise transfers, on real bytes: a save stores its last paged layer
group, and the states, only once every layer is computed (a state layer may come last); a load
reads the whole cache's state before its first layer group arrives."""
from __future__ import annotations

import pytest
from rigs import Clock, small_spec
from state_helpers import TOKS, fake_state, hybrid

from kvstate import ConfigError, Policy, PrefillLifecycle
from kvstate import commands as C
from kvstate._layers import LayerGroup
from kvstate.backends import MemoryStore, ReferenceBackend, StepDriver
from kvstate.backends._runner import execute
from kvstate.testing import fill_blocks, mismatched_blocks

#: layers 0 and 2 full attention (stored as two layer groups), 1 and 3 state layers: one comes last
SPEC = small_spec(2, num_layers=4, layer_groups=2, groups=(LayerGroup("full", (0, 2)),
                                                           LayerGroup("state", (1, 3), state_bytes=48, checkpoint=8)))


def test_paged_layers_count_stored_layers_and_hold_the_last_back_until_every_layer_is_done():
    assert [SPEC.paged_layers_done(n) for n in range(5)] == [0, 1, 1, 1, 2]
    assert [hybrid().paged_layers_done(n) for n in range(4)] == [0, 0, 0, 1]
    assert [small_spec(2).paged_layers_done(n) for n in range(3)] == [0, 1, 2]  # no state group: the count
    with pytest.raises(ConfigError, match="layer_groups 2 must divide the 1 layers whose blocks are stored"):
        hybrid(layer_groups=2)


def test_a_layerwise_save_stores_the_last_group_and_the_states_once_every_layer_is_done():
    store = MemoryStore(1 << 24)
    lc = PrefillLifecycle(SPEC, 16, Policy(read_prefix=False, transfer_timeout=10.0, fence_grace=5.0),
                          clock=Clock(), layerwise=True, num_states=4)
    be = ReferenceBackend(SPEC, 16, store, num_states=4)
    drv = StepDriver(lc, be)
    lc.admit("r", TOKS)
    drv.pump()
    [sp] = [n for n in drv.notices if isinstance(n, C.StartPrefill)]
    [save] = {c.command_id: c for c in drv.pending.values()}.values()
    keys, ids = lc.keys_of("r"), lc.blocks_of("r")
    fill_blocks(be, keys, ids)
    for n in (1, 2, 3):
        lc.layers_done("r", n)
        drv.pump()
        assert drv.layers[save.command_id] == 1  # group 1 (layer 2) waits for layer 3, a state layer
    for r in range(2):  # layer 3 computed the states
        be.fill_state(r, sp.state_pages[1], fake_state(keys[3], r))
        be.fill_state(r, sp.state_pages[0], fake_state(keys[-1], r))
    lc.prefill_done("r", 7)
    drv.run_until_idle()
    assert lc.stats()["done"] == 1 and lc.stats()["retries"] == 0
    d = ReferenceBackend(SPEC, 16, store, num_states=4)
    for r in range(2):
        assert d.read(r, keys, list(range(len(keys)))) == len(keys)
        for key in (keys[3], keys[-1]):
            assert d.read_state(r, key, 0) and d.state_bytes(r, 0) == fake_state(key, r)
    assert mismatched_blocks(d, keys, list(range(len(keys)))) == []


def test_a_layerwise_load_reads_the_state_before_its_first_group_arrives():
    store = MemoryStore(1 << 24)
    p, d = (ReferenceBackend(SPEC, 16, store, num_states=4) for _ in range(2))
    keys, now = tuple(f"k{i}" for i in range(3)), 0.0
    fill_blocks(p, keys, [0, 1, 2])
    for r in range(2):
        p.fill_state(r, 1, fake_state(keys[-1], r))
        assert execute(p, C.WriteBlocks("w", 1, (0, 1), now + 9, keys, (0, 1, 2), states=((3, 1),)), r).count == 3
    for r in range(2):
        seen = []
        load = C.LoadLayers("r", 2, (0, 1), now + 9, keys, (5, 6, 7), states=((3, 2),))
        done = execute(d, load, r, arrived=lambda n, ev, r=r, seen=seen: seen.append((n, d.state_bytes(r, 2))))
        assert done.count == 3 and [n for n, _ in seen] == [1, 2]
        assert all(page == fake_state(keys[-1], r) for _, page in seen)  # there from the first group on


@pytest.mark.parametrize("layer_groups", [1, 2])
def test_a_save_whose_blocks_are_stored_keeps_no_state_its_layers_have_not_computed(layer_groups):
    """Every block of the save is stored already (another prompt wrote them), so its blocks
    answer at once; its states exist only once every layer is computed. A gate that closes
    first (its fence passed, or a step driver answering before the report) stores none and
    answers 0: the protocol suite found a save storing its pages' leftovers as the states."""
    spec = SPEC if layer_groups == 2 else hybrid()
    store = MemoryStore(1 << 24)
    be = ReferenceBackend(spec, 16, store, num_states=4)
    keys = tuple(f"k{i}" for i in range(3))
    fill_blocks(be, keys, [0, 1, 2])
    assert execute(be, C.WriteBlocks("w", 1, (0, 1), 9.0, keys, (0, 1, 2)), 0).count == 3  # blocks, no state
    for r in range(2):
        be.fill_state(r, 1, b"\x07" * be.state_size)  # an earlier request's leftovers
    save = C.SaveLayers("s", 2, (0, 1), 9.0, keys, (0, 1, 2), states=((3, 1),))
    for r in range(2):
        assert execute(be, save, r, layers=lambda n, block=True: False).count == 0
        assert not be.read_state(r, keys[-1], 2)
        assert execute(be, save, r, layers=lambda n, block=True: True).count == 3  # computed: stored
        assert be.read_state(r, keys[-1], 2) and be.state_bytes(r, 2) == b"\x07" * be.state_size
