"""Protocol assurance on every CI run: the stateful machine of ``protocol_machine.py`` under the
CI profile (1,200 examples of up to 60 steps), topped up until every quota is reached: >= 10,000
steps, every fault class injected >= 100 times, every state preempted and cancelled, every
layout drawn. ``KVSTATE_PROTOCOL_PROFILE=deep`` runs the deep profile instead."""
from __future__ import annotations

import os

import pytest
from hypothesis.stateful import run_state_machine_as_test
from protocol_machine import Protocol
from protocol_support import FAULT_CLASSES, INVARIANTS, PROFILES, STATS, profile_settings

from kvstate import DECODE, PREFILL

#: the quotas a CI run must reach: (the STATS counter, its floor)
QUOTAS: tuple[tuple[str, int], ...] = (
    ("examples", 500), ("steps", 10_000),
    *((f"fault:{f}", 100) for f in FAULT_CLASSES),
    *((f"invariant:{name}", 1) for name in INVARIANTS),
    # preemption in every decode state, cancel in every state of both sides
    *((f"fault:preempt:{s}", 1) for s in DECODE.live),
    *((f"fault:cancel:D:{s}", 1) for s in DECODE.live),
    # (P's lend is the lend machine's: tests/test_lend_machine.py; this one's P writes the store)
    *((f"fault:cancel:P:{s}", 1) for s in PREFILL.live if s != "lending"),
    # both sides shared blocks through their GPU prefix caches
    ("gpu_prefix_hit_blocks:P", 100), ("gpu_prefix_hit_blocks:D", 100),
    # layer-wise prefills reported their layers (their saves are faulted as writes)
    ("layer_reports", 100),
    # hybrid layouts were drawn, and D ran requests whose early blocks were read without their window layer
    ("layout:window", 50), ("layout:latent", 50), ("layout:sliding", 50), ("layout:state", 50),
    ("layout:window_state", 50),
    # D freed by group (a layer-wise draw makes half the window_tables examples plain)
    ("layout:window_tables", 25), ("window_tables_freed", 20),
    # hybrid prefills kept several checkpoints' states (Policy.state_checkpoints)
    ("prefills_keeping_checkpoints:2+", 50),
    ("cached_state_starts", 1),  # P started prefills from states its GPU cache kept
    ("state_swapped", 1),  # D swapped hybrid requests, keeping their pages
    ("state_host_prefix_blocks", 1),  # hybrid prompts took blocks from P's host tier
    ("state_layer_reports", 1),  # hybrid prefills reported layers to layer-wise saves
    ("window_runnable", 5),
    ("decode_steps", 500),  # running requests decoded token by token
)
TOP_UP = 200  #: examples a round, run until every quota is reached
MAX_EXAMPLES = 4_000  #: a quota still short past this many examples is a path the machine cannot reach


def shortfalls() -> dict[str, tuple[int, int]]:
    """The quotas not reached yet: name -> (count, quota)."""
    return {name: (STATS[name], n) for name, n in QUOTAS if STATS[name] < n}


@pytest.mark.slow
def test_protocol_machines_hold_every_invariant_under_faults():
    """The CI profile's examples, then rounds of :data:`TOP_UP` more while any quota is short:
    every fault class and state is scheduled until its quota is reached, so a thin draw costs
    time, never a red run. A quota short after :data:`MAX_EXAMPLES` fails: that path is lost."""
    STATS.clear()
    run_state_machine_as_test(Protocol, settings=profile_settings())
    if os.environ.get("KVSTATE_PROTOCOL_PROFILE", "ci") == "quick":
        return
    while shortfalls() and STATS["examples"] < MAX_EXAMPLES:
        run_state_machine_as_test(Protocol, settings=profile_settings(max_examples=TOP_UP))
    assert not shortfalls(), f"quotas short after {STATS['examples']} examples: {shortfalls()}"


def test_a_quick_round_of_the_protocol_holds_every_invariant():
    """The fast loop's share: the quick profile's examples (a minute's tenth of the CI run),
    every invariant checked after every step as in the full run; its quotas are the full run's
    (marked slow, run by CI and the README's test command)."""
    before = STATS["examples"]
    run_state_machine_as_test(Protocol, settings=profile_settings("quick"))
    assert STATS["examples"] - before >= PROFILES["quick"][0] // 2  # it ran, and not all was filtered away


def test_tables_cover_terminal_states():
    assert set(PREFILL.terminal) == set(DECODE.terminal) == {"done", "failed", "aborted"}
