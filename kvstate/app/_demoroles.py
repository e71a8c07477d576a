"""The demo's two engines, P and D, each wired to its peer through callables.

The same role objects run in one process (``kvstate demo``: the callables are plain calls)
and in separate processes (``kvstate demo --processes``: the callables send messages). Each
role holds its lifecycle and a *view* of its caches (a backend whose ``fill_block`` and
``block_bytes`` reach the very bytes the transfers move): "compute" writes a pattern fixed by
each block's storage key (:mod:`kvstate.testing`), so whatever is read back — after the
handoff, after a preemption's write-back and reload, from a prefix another request stored —
is checked against what was written.

The workload (:func:`make_plans`): prompts of 1–12 blocks, a quarter exactly whole blocks, 30 %
sharing a stored prefix with an earlier prompt, 10 % aborted (in prefill, while D reads, or
while it decodes), 20 % preempted once while decoding.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import commands as C
from .._errors import OutOfBlocksError
from .._keys import block_keys
from .._tables import rows
from ..testing import fill_blocks, mismatched_blocks, mismatched_needed

__all__ = ["Plan", "make_plans", "PrefillRole", "DecodeRole"]

ABORT_STAGES = ("prefill", "reading", "running")


@dataclass
class Plan:
    """One request of the demo and what will happen to it."""

    rid: str
    prompt: list[int]
    output_len: int
    preempt_at: int | None  #: preempted after this many output tokens (None: never)
    abort_at: str | None  #: one of :data:`ABORT_STAGES` (None: not aborted)
    tokens: list[int] = field(default_factory=list)  #: D's prompt + outputs
    running: bool = False
    preempted: bool = False

    def to_wire(self) -> list[Any]:
        return [self.rid, self.prompt, self.output_len, self.preempt_at, self.abort_at]

    @classmethod
    def from_wire(cls, items: list[Any]) -> Plan:
        rid, prompt, output_len, preempt_at, abort_at = items
        return cls(rid, list(prompt), output_len, preempt_at, abort_at)


def make_plans(requests: int, seed: int, block_size: int) -> list[Plan]:
    """The demo's workload (see the module's docstring), fixed by ``seed``."""
    rng, bs = random.Random(seed), block_size
    plans: list[Plan] = []
    for i in range(requests):
        n = rng.randint(bs + 1, 12 * bs)
        if rng.random() < 0.25:
            n = (n // bs) * bs  # exactly full blocks
        prompt = [rng.randrange(50_000) for _ in range(n)]
        if plans and rng.random() < 0.3:  # share a stored prefix with an earlier request
            donor = rng.choice(plans).prompt
            k = rng.randint(1, max(1, (len(donor) - 1) // bs)) * bs
            prompt[:min(k, n - 1)] = donor[:min(k, n - 1)]
        abort_at = rng.choice(ABORT_STAGES) if rng.random() < 0.1 else None
        out_len = rng.randint(2, 3 * bs)
        preempt = rng.randint(1, out_len - 1) if rng.random() < 0.2 else None
        plans.append(Plan(f"req-{i:04d}", prompt, out_len, preempt, abort_at))
    return plans


class _Role:
    def __init__(self, lifecycle: Any, view: Any, seed: int) -> None:
        self.lc, self.view = lifecycle, view
        self.block_size = lifecycle.spec.block_size
        self.rng = random.Random(seed)
        self.checked = self.mismatched = 0

    def check(self, keys: list[str], blocks: Sequence[Any], upto: int, tokens: int = 0) -> None:
        """Count the bytes of the first ``upto`` logical blocks (:func:`kvstate._tables.rows`)
        that differ from the writer's; with
        ``tokens`` (D's whole cache), only where continuing it needs them (window groups)."""
        spec = self.lc.spec
        self.checked += upto * spec.tp_size * len(spec.kinds)
        bad = mismatched_needed(self.view, keys, blocks, tokens) if tokens else \
            mismatched_blocks(self.view, keys, blocks, upto)
        self.mismatched += len(bad)


class PrefillRole(_Role):
    """P: admits prompts, computes them, checks the prefix it read, sends first tokens.

    ``send_first_token(rid, token, code)`` and ``abort_peer(rid)`` reach D."""

    def __init__(self, lifecycle: Any, view: Any, seed: int, send_first_token: Callable[[str, Any, int], None],
                 abort_peer: Callable[[str], None]) -> None:
        super().__init__(lifecycle, view, seed)
        self.send_first_token, self.abort_peer = send_first_token, abort_peer
        self.prompts: dict[str, tuple[list[int], str | None]] = {}
        self.prefix_blocks_read = 0

    def admit(self, rid: str, prompt: list[int], abort_at: str | None) -> None:
        self.prompts[rid] = (prompt, abort_at)
        self.lc.admit(rid, prompt)

    def abort(self, rid: str) -> None:
        """D gave up on ``rid`` (a late abort, once P is done with it, changes nothing)."""
        if rid in self.prompts:
            self.lc.abort(rid)

    def on_notice(self, cmd: C.Command) -> None:
        if isinstance(cmd, C.StartPrefill):
            prompt, abort_at = self.prompts[cmd.request_id]
            keys = block_keys(prompt, self.block_size)
            cached = cmd.num_cached_tokens // self.block_size
            self.prefix_blocks_read += cached
            self.check(keys, rows(cmd.block_ids, cmd.tables), cached)  # the prefix read from storage
            if abort_at == "prefill":
                self.lc.abort(cmd.request_id)
                self.abort_peer(cmd.request_id)
                return
            fill_blocks(self.view, keys, rows(cmd.block_ids, cmd.tables), cached)
            self.lc.prefill_done(cmd.request_id, self.rng.randrange(50_000))
        elif isinstance(cmd, C.SendFirstToken):
            self.send_first_token(cmd.request_id, cmd.token, cmd.error_code)
        elif isinstance(cmd, C.RequestEnded):
            self.prompts.pop(cmd.request_id, None)


class DecodeRole(_Role):
    """D: reserves, takes P's first token, checks what it read, decodes, preempts, resumes.

    ``admit_peer(plan)`` and ``abort_peer(rid)`` reach P; ``report(rid, state, code, reason)`` is told
    of each request's end."""

    def __init__(self, lifecycle: Any, view: Any, seed: int, admit_peer: Callable[[Plan], None],
                 abort_peer: Callable[[str], None], report: Callable[[str, str, int, str], None]) -> None:
        super().__init__(lifecycle, view, seed)
        self.admit_peer, self.abort_peer, self.report = admit_peer, abort_peer, report
        self.plans: dict[str, Plan] = {}
        self.preemptions = 0

    def try_take(self, plan: Plan, concurrency: int) -> bool:
        """Reserve blocks for ``plan`` and hand it to P, if D has room; False otherwise."""
        if len(self.lc.live_requests()) >= concurrency or not self.lc.can_reserve(len(plan.prompt)):
            return False
        self.plans[plan.rid] = plan
        self.lc.reserve(plan.rid, plan.prompt)
        self.admit_peer(plan)
        return True

    def first_token(self, rid: str, token: Any, code: int) -> None:
        plan = self.plans.get(rid)
        if plan is None or not self.lc.is_live(rid):
            return
        self.lc.deliver_first_token(rid, token, code)
        if code == 200 and token is not None:
            plan.tokens = plan.prompt + [token]
        if plan.abort_at == "reading":
            self.lc.abort(rid)  # mid-transfer: the read still pins its blocks

    def abort(self, rid: str) -> None:
        """P aborted ``rid`` (a late abort changes nothing)."""
        if self.lc.is_live(rid):
            self.lc.abort(rid)

    def on_notice(self, cmd: C.Command) -> None:
        plan = self.plans.get(cmd.request_id)
        if plan is None:  # a late event for a request that ended
            return
        if isinstance(cmd, C.StartDecode):
            keys = block_keys(plan.tokens[:-1], self.block_size)
            self.check(keys, rows(cmd.block_ids, cmd.tables), len(keys), len(plan.tokens) - 1)
            if plan.abort_at == "running":
                self.lc.abort(plan.rid)
                return
            plan.running = True
        elif isinstance(cmd, C.Recompute):
            keys = block_keys(plan.tokens[:-1], self.block_size)
            fill_blocks(self.view, keys, rows(cmd.block_ids, cmd.tables), cmd.from_token // self.block_size)
            self.lc.recompute_done(plan.rid)
        elif isinstance(cmd, C.RequestEnded):
            plan.running = False
            del self.plans[plan.rid]
            if cmd.state != "done":
                self.abort_peer(plan.rid)  # as an engine's router does: P may still have it
            self.report(plan.rid, cmd.state, cmd.error_code, cmd.reason)

    def step(self) -> None:
        """One decode step of every running request; resume the preempted ones that fit."""
        for plan in list(self.plans.values()):
            if plan.preempted and self.lc.state_of(plan.rid) in ("preempted", "swapped"):
                try:
                    self.lc.resume(plan.rid)
                    plan.preempted = False
                except OutOfBlocksError:
                    pass
            elif plan.running:
                self._decode(plan)

    def _decode(self, plan: Plan) -> None:
        produced = len(plan.tokens) - len(plan.prompt)
        if produced >= plan.output_len:
            plan.running = False
            self.lc.finish(plan.rid)
            return
        tok = self.rng.randrange(50_000)
        try:
            self.lc.append_tokens(plan.rid, [tok])
        except OutOfBlocksError:
            return
        plan.tokens.append(tok)
        if plan.preempt_at is not None and produced + 1 == plan.preempt_at:
            plan.preempt_at = None
            # materialize the cache D computed so far, then preempt (write-back, free)
            keys = block_keys(plan.tokens[:-1], self.block_size)
            fill_blocks(self.view, keys, self.lc.rows_of(plan.rid), 0)
            plan.running = False
            plan.preempted = True
            self.preemptions += 1
            self.lc.preempt(plan.rid)
