"""Protocol assurance on every CI run: the stateful machine of ``protocol_machine.py`` under the
CI profile (1,200 examples of up to 60 steps), then the quotas: >= 10,000 steps and every fault
class injected >= 100 times. ``KVSTATE_PROTOCOL_PROFILE=deep`` runs the deep profile instead."""
from __future__ import annotations

import os

from hypothesis.stateful import run_state_machine_as_test
from protocol_machine import Protocol
from protocol_support import FAULT_CLASSES, INVARIANTS, STATS, profile_settings

from kvstate import DECODE, PREFILL


def test_protocol_machines_hold_every_invariant_under_faults():
    STATS.clear()
    run_state_machine_as_test(Protocol, settings=profile_settings())
    if os.environ.get("KVSTATE_PROTOCOL_PROFILE", "ci") == "quick":
        return
    assert STATS["examples"] >= 500, STATS["examples"]
    assert STATS["steps"] >= 10_000, STATS["steps"]
    short = {f: STATS[f"fault:{f}"] for f in FAULT_CLASSES if STATS[f"fault:{f}"] < 100}
    assert not short, f"fault classes injected fewer than 100 times: {short}"
    for name in INVARIANTS:
        assert STATS[f"invariant:{name}"] > 0, name
    # preemption in every decode state, cancel in every state of both sides
    # (per-state counts: benchmarks/protocol.py; each is >= 20 in a typical CI run)
    missing = [f"preempt:{s}" for s in DECODE.live if not STATS[f"fault:preempt:{s}"]]
    missing += [f"cancel:D:{s}" for s in DECODE.live if not STATS[f"fault:cancel:D:{s}"]]
    missing += [f"cancel:P:{s}" for s in PREFILL.live if not STATS[f"fault:cancel:P:{s}"]]
    assert not missing, f"never tried: {missing}"
    # both sides shared blocks through their GPU prefix caches
    assert STATS["gpu_prefix_hit_blocks:P"] >= 100 and STATS["gpu_prefix_hit_blocks:D"] >= 100, STATS
    # layer-wise prefills reported their layers (their saves are faulted as writes; P's "saved" was cancelled)
    assert STATS["layer_reports"] >= 100, STATS
    # hybrid layouts were drawn, and D ran requests whose early blocks were read without their
    # window layer (16 in one CI-profile run, 20 and more in others: the floor proves only that
    # the path is reached, far below what the drawn examples give)
    assert STATS["layout:window"] >= 50 and STATS["layout:latent"] >= 50 and STATS["layout:sliding"] >= 50, STATS
    assert STATS["layout:state"] >= 50 and STATS["layout:window_state"] >= 50, STATS
    # D freed by group (43-87 window_tables examples a CI-profile run: a layer-wise draw makes half plain)
    assert STATS["layout:window_tables"] >= 25 and STATS["window_tables_freed"] >= 20, STATS
    # hybrid prefills kept several checkpoints' states (Policy.state_checkpoints)
    assert STATS["prefills_keeping_checkpoints:2+"] >= 50, STATS  # 85-251 in CI-profile runs
    assert STATS["cached_state_starts"] >= 1, STATS  # P started prefills from states its GPU cache kept (~12)
    assert STATS["state_swapped"] >= 1, STATS  # D swapped hybrid requests, keeping their pages (~100)
    assert STATS["state_host_prefix_blocks"] >= 1, STATS  # hybrid prompts took blocks from P's host tier (~200)
    assert STATS["state_layer_reports"] >= 1, STATS  # hybrid prefills reported layers to layer-wise saves
    assert STATS["window_runnable"] >= 5, STATS
    # running requests decoded token by token (the window-only layout frees blocks behind it)
    assert STATS["decode_steps"] >= 500, STATS


def test_tables_cover_terminal_states():
    assert set(PREFILL.terminal) == set(DECODE.terminal) == {"done", "failed", "aborted"}
