"""A simulated P instance: prompts queue for batched prefill; the first token crosses to D.

``StartPrefill`` queues the prompt (its tokens past the stored prefix) on the compute loop,
which runs one forward over as many queued prompts as fit the token budget. A prompt whose
request ends while it waits (D gave up, and the router aborted it here) leaves the queue
uncomputed, as an engine's scheduler drops an aborted request; one that ends during its
forward is skipped when the forward finishes. ``SendFirstToken`` reaches D after the network
latency.

Layer-wise (``cluster.layerwise``), the ``SaveLayers`` sent with ``StartPrefill`` waits until
its prompt's forward starts (a real save waits on its layer gate), then runs as a
:class:`~kvstate.sim._instance.LayerSave`. Its deadline counts from ``StartPrefill``, as the
lifecycle sets it: a prompt queued longer than ``policy.transfer_timeout`` sees its save
expire and is written after its forward instead.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Generator
from typing import TYPE_CHECKING, cast

from simpy import Event, Timeout

from .. import commands as C
from .._prefill import PrefillLifecycle
from ._instance import Instance, LayerSave
from ._services import Services

if TYPE_CHECKING:  # pragma: no cover
    from ._request import SimRequest

__all__ = ["PrefillInstance", "FIRST_TOKEN"]

FIRST_TOKEN = 1  #: the token id every simulated prefill samples


class PrefillInstance(Instance):
    """One P instance and its prefill loop."""

    __slots__ = ("queue", "queued_tokens", "waiting", "saves", "assigned")
    role = "prefill"
    lifecycle_cls = PrefillLifecycle

    def __init__(self, sv: Services, idx: int) -> None:
        super().__init__(sv, idx)
        self.lc: PrefillLifecycle
        self.queue: deque[tuple[SimRequest, int, int]] = deque()  # (request, new tokens, cached)
        self.queued_tokens = 0  #: new tokens waiting in ``queue``
        self.waiting: dict[str, int] = {}  #: new tokens of each prompt in ``queue`` still to compute
        self.saves: dict[str, C.TransferCommand] = {}  #: layer-wise saves waiting for their forward
        self.assigned = 0  #: requests the router sent here
        self.env.process(self._loop())

    @property
    def load(self) -> tuple[int, int]:
        """The router's key: tokens queued for prefill plus prompts waiting for blocks."""
        return (self.queued_tokens + self.lc.num_waiting, self.assigned)

    def notice(self, cmd: C.Command) -> None:
        cl = self.sv
        t = cmd.__class__
        if t is C.StartPrefill:
            cached = cmd.num_cached_tokens  # type: ignore[attr-defined]  # with state groups: from a state (the lifecycle's)
            req = cl.reqs[cmd.request_id]
            req.cached_tokens = cached
            new = req.input_len - cached
            self.queue.append((req, new, cached))
            self.queued_tokens += new
            self.waiting[req.rid] = new
            self.wake_up()
        elif t is C.SaveLayers:
            self.saves[cmd.request_id] = cast(C.TransferCommand, cmd)
        elif t is C.SendFirstToken:
            ev = Timeout(self.env, cl.net_latency)
            ev.callbacks.append(lambda _e: cl.first_token(cmd))  # type: ignore[arg-type]  # a SendFirstToken
        elif t is C.RequestEnded and cmd.request_id in self.waiting:  # aborted while queued
            self.queued_tokens -= self.waiting.pop(cmd.request_id)
            cl.counters["prompts_dropped"] += 1
            save = self.saves.pop(cmd.request_id, None)
            if save is not None:  # its forward will not run: the save answers at once
                self.write_pool.submit(LayerSave(self, save, 0.0), save.ranks)
        # otherwise RequestEnded, FreeBlocks: the pool took the blocks back; D's end is the request's end

    def _loop(self) -> Generator[Event, object, None]:
        cl, env, q, lc = self.sv, self.env, self.queue, self.lc
        budget = cl.scenario.cluster.prefill_token_budget
        while True:
            if not q:
                yield self.idle()
                continue
            batch: list[tuple[SimRequest, int, int]] = []
            tokens, waiting = 0, self.waiting
            while q:
                item = q[0]
                if item[0].rid not in waiting:  # it ended while queued: dropped, not computed
                    q.popleft()
                    continue
                if batch and tokens + item[1] > budget:
                    break
                q.popleft()
                del waiting[item[0].rid]
                batch.append(item)
                tokens += item[1]
            if not batch:
                continue
            self.queued_tokens -= tokens
            t = self.side.compute.prefill_time((n, c) for _, n, c in batch)
            if cl.timeline is not None:
                cl.timeline.step(self.name, env.now, env.now + t, "prefill", prompts=len(batch))
            self.busy_time += t
            self.computing_until = env.now + t
            if self.saves:
                self._start_saves(batch, t)
            yield Timeout(env, t)
            for req, _, _ in batch:
                if lc.is_live(req.rid) and lc.state_of(req.rid) in ("prefilling", "saved"):
                    lc.prefill_done(req.rid, FIRST_TOKEN)
            self.pump()

    def _start_saves(self, batch: list[tuple[SimRequest, int, int]], forward: float) -> None:
        """The forward of ``batch`` starts: its prompts' layer-wise saves start with it."""
        for req, _, _ in batch:
            cmd = self.saves.pop(req.rid, None)
            if cmd is not None and cmd.command_id not in self.cancelled:
                self.write_pool.submit(LayerSave(self, cmd, forward), cmd.ranks)
            elif cmd is not None:  # expired or aborted: its ranks answer at once
                self.write_pool.submit(LayerSave(self, cmd, 0.0), cmd.ranks)
