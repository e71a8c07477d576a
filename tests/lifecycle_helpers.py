"""Helpers of the lifecycle tests: one request's handoff and checks on real bytes."""
from __future__ import annotations

import dataclasses

from rigs import Rig

from kvstate import commands as C
from kvstate._keys import block_keys
from kvstate._policy import Policy
from kvstate.testing import fill_blocks, mismatched_blocks

__all__ = ["TOKS", "handoff", "fill_p", "d_matches", "serve", "deliver", "assert_clean", "running", "answer_only",
           "SWAP", "swapping_rig"]

TOKS = list(range(100, 110))  # 10 tokens: 2 full blocks of 4 and a partial one


def handoff(rig: Rig, rid: str, toks=TOKS, first=7):
    """Reserve on D, admit on P, prefill, run P's transfers; returns P's notices."""
    rig.D.reserve(rid, toks)
    rig.P.admit(rid, toks)
    rig.pd.run_until_idle()
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    fill_p(rig, rid, toks, sp.block_ids, sp.num_cached_tokens // rig.spec.block_size)
    rig.P.prefill_done(rid, first)
    rig.pd.run_until_idle()
    return rig.notices(rig.pd)


def fill_p(rig, rid, toks, blocks, start=0):
    fill_blocks(rig.pb, block_keys(toks, rig.spec.block_size), blocks, start)


def d_matches(rig, toks, blocks):
    return not mismatched_blocks(rig.db, block_keys(toks, rig.spec.block_size), blocks)


def serve(rig, rid, toks=TOKS):
    """A whole P -> store -> D life with every transfer answered in full."""
    deliver(rig, handoff(rig, rid, toks))
    rig.dd.run_until_idle()
    rig.D.finish(rid)


def deliver(rig, notices):
    for n in notices:
        if isinstance(n, C.SendFirstToken):
            rig.D.deliver_first_token(n.request_id, n.token, n.error_code)


def assert_clean(rig):
    for lc in (rig.P, rig.D):
        assert lc.live_requests() == []
        assert lc.pending_commands() == []
        assert lc.pool.num_used == 0, lc.pool.stats()


def running(rig, rid="r"):
    """``rid`` handed off and decoding on D."""
    deliver(rig, handoff(rig, rid))
    rig.dd.run_until_idle()
    rig.notices(rig.dd)
    assert rig.D.state_of(rid) == "running"


def answer_only(drv, cls) -> None:
    """Answer in full every pending (command, rank) of class ``cls``, nothing else."""
    drv.pump()
    for key in [k for k, c in drv.pending.items() if isinstance(c, cls)]:
        drv.complete(*key)


SWAP = Policy(preempt="swap", transfer_timeout=10.0, fence_grace=5.0)  #: preemption into the host tier


def swapping_rig(host_blocks: int = 16, store=None, **policy) -> Rig:
    """A rig whose P and D have a host tier of ``host_blocks`` slots, D swapping on preemption
    (over ``store`` when given: another rig's, say)."""
    return Rig(policy=dataclasses.replace(SWAP, **policy), host_blocks=host_blocks, store=store)
