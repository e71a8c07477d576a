"""The protocol machine's state pages: with the ``state`` layout, the engine keeps a recurrent state
per request (Mamba layers) in its state pages, and every computation that starts from one is
checked to start from the right one (mixed into ``Protocol``)."""
from __future__ import annotations

import hashlib

import numpy as np
from protocol_support import BS, STATS

from kvstate._keys import block_keys

__all__ = ["StateRules", "STEP", "fake_state"]

STEP = 2 * BS  #: the state layout's checkpoint: every 2 blocks


def fake_state(toks, rank: int, nbytes: int) -> bytes:
    """The stand-in state after tokens ``toks`` on ``rank`` (a function of them alone)."""
    key = block_keys(toks, BS)[-1]
    seed = int.from_bytes(hashlib.sha256(f"state|{key}|{rank}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


class StateRules:
    """``self.rig`` and ``self.tokens`` are the machine's; each hook does nothing without state pages."""

    def _start_from_state(self, backend, pages, toks, start: int, what: str, cached: int = -1) -> None:
        if pages and start:
            self.state_reused_only_at_its_checkpoint(backend, pages[0] if cached < 0 else cached, toks, start, what)

    def state_reused_only_at_its_checkpoint(self, backend, page: int, toks, start: int, what: str) -> None:
        """A prefill or recompute starts at token ``start``: a checkpoint, whose state every
        rank's ``page`` holds (its running page, or a page the GPU prefix cache kept)."""
        STATS["invariant:state_reused_only_at_its_checkpoint"] += 1
        assert start % STEP == 0, f"state_reused_only_at_its_checkpoint: {what} starts at token {start}"
        for r in range(backend.spec.tp_size):
            assert backend.state_bytes(r, page) == fake_state(toks[:start], r, backend.state_size), \
                f"state_reused_only_at_its_checkpoint: {what} at token {start}, rank {r}: not the state there"

    def _compute_state(self, backend, pages, toks, checkpoints=()) -> None:
        """The engine ran the request's layers over ``toks``: the running page holds the state
        after them, and ``pages[1 + i]`` the state after token ``checkpoints[i]`` (P's copies)."""
        STATS["prefills_keeping_checkpoints:2+"] += len(checkpoints) > 1
        for r in range(backend.spec.tp_size if pages else 0):
            for page, checkpoint in zip(pages[1:], checkpoints):
                backend.fill_state(r, page, fake_state(toks[:checkpoint], r, backend.state_size))
            backend.fill_state(r, pages[0], fake_state(toks, r, backend.state_size))

    def _check_decode_state(self, rid: str, pages) -> None:
        if pages:
            self.runnable_only_with_the_caches_state(rid, pages)

    def runnable_only_with_the_caches_state(self, rid: str, pages) -> None:
        """D decodes only from the state of its whole cache on every rank."""
        toks, db = self.tokens[rid][:-1], self.rig.db
        STATS["invariant:runnable_only_with_the_caches_state"] += 1
        for r in range(db.spec.tp_size):
            assert db.state_bytes(r, pages[0]) == fake_state(toks, r, db.state_size), \
                f"runnable_only_with_the_caches_state: {rid} rank {r}"
