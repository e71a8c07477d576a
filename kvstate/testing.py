"""Helpers for tests and integrators: deterministic stand-in KV bytes, written and checked.

A block's stand-in bytes are fixed by (storage key, rank, kind), so whoever reads a block back
-- D after the handoff, a reload after preemption, a request sharing a stored prefix -- can
check every byte against what the writer put there.
"""
from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["fake_block"]


def fake_block(key: str, rank: int, kind: str, nbytes: int) -> bytes:
    """``nbytes`` stand-in bytes of one block: a pattern fixed by (key, rank, kind)."""
    seed = int.from_bytes(hashlib.sha256(f"{key}|{rank}|{kind}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
