"""Helpers of the state group tests: a hybrid spec (a full layer, two state layers), stand-in
states, and P's engine computing blocks and states."""
from __future__ import annotations

import hashlib

import numpy as np
from lifecycle_helpers import fill_p
from rigs import Rig, small_spec

from kvstate import commands as C
from kvstate._keys import block_keys
from kvstate._layers import LayerGroup
from kvstate._policy import Policy
from kvstate._spec import CacheSpec

__all__ = ["BS", "STEP", "TOKS", "hybrid", "fake_state", "state_rig", "assert_state", "prefill"]

BS, STEP = 4, 8  # blocks of 4 tokens, a state checkpoint every 8 tokens (2 blocks)
TOKS = list(range(100, 123))  # 23 tokens: 5 full blocks and a partial one; checkpoints after blocks 2 and 4


def hybrid(tp: int = 2, checkpoint: int = STEP, **kw) -> CacheSpec:
    """Layer 0 full attention, layers 1-2 a state group of 48 bytes a layer and rank."""
    return small_spec(tp, num_layers=3, groups=(LayerGroup("full", (0,)),
                                                LayerGroup("state", (1, 2), state_bytes=48, checkpoint=checkpoint)),
                      **kw)


def fake_state(key: str, rank: int, nbytes: int = 96) -> bytes:
    """The stand-in state after the prefix ending with block ``key`` (keys chain over the prefix)."""
    seed = int.from_bytes(hashlib.sha256(f"state|{key}|{rank}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def state_rig(backend=None, **kw) -> Rig:
    """P and D over one store with 4 state pages; ``backend(spec, blocks, store)`` replaces the
    reference backends (the CUDA tests')."""
    kw.setdefault("policy", Policy(transfer_timeout=10.0, fence_grace=5.0, read_failure="recompute"))
    rig = Rig(spec=hybrid(), num_states=4, **kw)
    if backend is not None:
        rig.pb = rig.pd.backend = backend(rig.spec, 64, rig.store)
        rig.db = rig.dd.backend = backend(rig.spec, 64, rig.store)
    return rig


def assert_state(backend, page: int, key: str | None) -> None:
    """Every rank's ``page`` holds the state after block ``key``."""
    for r in range(backend.spec.tp_size):
        assert backend.state_bytes(r, page) == fake_state(key, r), (page, key, r)


def prefill(rig: Rig, rid: str, toks=TOKS, first: int = 7) -> C.StartPrefill:
    """P's engine: admit, read, check the page holds the state it starts from, compute blocks
    and states (the checkpoint's into pages[1]; from a cached page, ``state_from``), report;
    returns the StartPrefill."""
    rig.P.admit(rid, toks)
    rig.pd.run_until_idle()
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    keys, start = block_keys(toks, BS), sp.num_cached_tokens // BS
    if start:  # reused only at a checkpoint: read into the running page, or a page the GPU cache kept
        assert_state(rig.pb, sp.state_pages[0] if sp.state_from < 0 else sp.state_from, keys[start - 1])
    fill_p(rig, rid, toks, sp.block_ids, start)
    for r in range(2):
        for page, checkpoint in zip(sp.state_pages[1:], sp.checkpoints):
            rig.pb.fill_state(r, page, fake_state(keys[checkpoint // BS - 1], r))
        rig.pb.fill_state(r, sp.state_pages[0], fake_state(keys[-1], r))
    rig.P.prefill_done(rid, first)
    rig.pd.run_until_idle()
    return sp
