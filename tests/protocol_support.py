"""What the protocol tests share: the fault classes and invariants they count, the hypothesis
profiles, a store that can go down, and a snapshot of everything a lifecycle shows."""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase, MultiplexedDatabase, ReadOnlyDatabase

from kvstate import commands as C
from kvstate._errors import StoreError
from kvstate._keys import block_keys
from kvstate._layers import LayerGroup
from kvstate.backends._stores import Store
from kvstate.testing import fill_blocks, mismatched_needed

__all__ = ["BS", "KIND", "FAULT_CLASSES", "INVARIANTS", "STATS", "CORPUS", "PROFILES", "profile_settings",
           "corpus_database",
           "StoreSwitch", "fill", "snapshot"]

BS = 4


def fill(backend, toks, blocks, start):
    """Compute the blocks of prompt ``toks`` from block ``start`` on: their stand-in bytes."""
    fill_blocks(backend, block_keys(toks, BS), blocks, start)

#: the fault classes of the issue; each must be injected >= 100 times per CI run
FAULT_CLASSES = (
    "write_fail", "write_partial", "evict_between_write_and_read", "read_fail", "read_partial",
    "rank_never_answers", "rank_answers_late", "store_unavailable", "cancel", "cancel_mid_transfer",
    "preempt", "duplicate_first_token", "late_first_token", "recycled_event", "tick",
    "answer_after_fence", "swap_out_fail", "swap_out_partial", "swap_in_fail", "swap_in_partial",
)
INVARIANTS = (
    "block_owned_by_one_request_unless_a_cached_prefix", "refcount_equals_owners_plus_pins",
    "free_list_holds_exactly_the_unheld_blocks",
    "pool_counts_match_its_blocks", "every_transfer_has_a_timer_due_by_its_fence", "live_request_in_legal_state",
    "transfer_blocks_held_by_their_request_or_pinned",
    "runnable_only_after_full_read_on_every_rank_with_p_bytes", "host_refs_equal_holders_plus_copies",
    "gpu_cached_block_holds_its_keys_bytes", "drained_all_terminal_and_empty",
    "no_transfer_touches_a_block_freed_behind_the_window",
    "state_reused_only_at_its_checkpoint", "runnable_only_with_the_caches_state",
)
STATS: Counter[str] = Counter()
#: the fault-class stem of each transfer command
KIND = {C.WriteBlocks: "write", C.SaveLayers: "write", C.ReadBlocks: "read", C.LoadLayers: "read",
        C.SwapOut: "swap_out", C.SwapIn: "swap_in", C.FlushHost: "flush"}
CORPUS = Path(__file__).with_name("protocol_corpus")
LOCAL_FAILURES = Path(__file__).resolve().parents[1] / ".hypothesis" / "protocol"

PROFILES = {  # examples, steps per example
    "ci": (1200, 60),
    "deep": (2500, 60),
    "quick": (60, 40),
}


def corpus_database() -> MultiplexedDatabase:
    """The committed corpus, replayed first and never written (hypothesis prunes a database it
    may write, which would delete tracked files), beside a git-ignored database under
    ``.hypothesis/`` where new failures are saved; copy one into tests/protocol_corpus/ to keep it."""
    return MultiplexedDatabase(ReadOnlyDatabase(DirectoryBasedExampleDatabase(str(CORPUS))),
                               DirectoryBasedExampleDatabase(str(LOCAL_FAILURES)))


def profile_settings(profile: str | None = None, max_examples: int | None = None) -> settings:
    """The profile's settings (``KVSTATE_PROTOCOL_PROFILE``, "ci" by default); ``max_examples``
    overrides its count (a top-up round)."""
    name = profile or os.environ.get("KVSTATE_PROTOCOL_PROFILE", "ci")
    if name not in PROFILES:
        raise ValueError(f"KVSTATE_PROTOCOL_PROFILE must be one of {sorted(PROFILES)}, got {name!r}")
    examples, steps = PROFILES[name]
    examples = max_examples or examples
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=corpus_database(),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


class StoreSwitch(Store):
    """Wraps the shared store: while ``down`` every operation raises (store unavailable)."""

    def __init__(self, store) -> None:
        self._store = store
        self.down = False

    def _up(self):
        if self.down:
            raise StoreError("store unavailable (injected)")
        return self._store

    def batch_put_from(self, keys, buffers):
        return self._up().batch_put_from(keys, buffers)

    def batch_get_into(self, keys, buffers):
        return self._up().batch_get_into(keys, buffers)

    def batch_is_exist(self, keys):
        return self._up().batch_is_exist(keys)

    def __getattr__(self, name):  # evict, keys, ...: the wrapped store's own
        return getattr(self._store, name)

    def __len__(self) -> int:
        return len(self._store)


def snapshot(lc) -> tuple:
    """Everything observable of a lifecycle: requests, states, blocks and state pages, pins, pool,
    queued commands."""
    return (tuple(sorted((rid, lc.state_of(rid), lc.blocks_of(rid), lc.pages_of(rid)) for rid in lc.live_requests())),
            tuple(sorted(lc.pinned_blocks().items())), lc.pool.stats(),
            tuple(c.command_id for c in lc.pending_commands()), lc.queued_commands(),
            tuple(sorted(lc.counters.items())))


#: cache layouts drawn: one full group; a window group (W = 2 blocks) beside a full layer, the
#: window layer second but its group first, so the stored order (group by group) is not the
#: layers' own; every layer a window layer of one block (Mistral's pattern: D frees blocks behind it); a latent
#: (MLA) cache, one replicated head stored once; a full layer beside two state layers (Mamba) checkpointing
#: every 2 blocks; the window layout with a block table per group (D's, and P's half the time): D frees
#: the window group's blocks behind the window and keeps the full group's
LAYOUTS = {"plain": {},
           "window": {"groups": (LayerGroup("window", (1,), window=2 * BS), LayerGroup("full", (0,)))},
           "sliding": {"groups": (LayerGroup("window", (0, 1), window=BS),)},
           "latent": {"kv_heads": 1, "total_kv_heads": 1, "has_value": False,
                      "groups": (LayerGroup("latent", (0, 1)),)},
           "state": {"num_layers": 3, "groups": (LayerGroup("full", (0,)),
                                                 LayerGroup("state", (1, 2), state_bytes=16, checkpoint=2 * BS))},
           "window_state": {"num_layers": 4, "groups": (
               LayerGroup("full", (0,)), LayerGroup("window", (1,), window=2 * BS),
               LayerGroup("state", (2, 3), state_bytes=16, checkpoint=2 * BS))}}
LAYOUTS["window_tables"] = {**LAYOUTS["window"], "group_tables": True}


def decode_mismatches(backend, toks, block_ids) -> list:
    """D's blocks of prompt ``toks`` that differ from P's where its decode needs them
    (:func:`~kvstate.testing.mismatched_needed`), counting the runs that read a window apart."""
    STATS["window_runnable"] += backend.spec.window_first_block(len(toks)) > 0
    return mismatched_needed(backend, block_keys(toks, BS), block_ids, len(toks))
