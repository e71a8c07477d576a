"""A simulated D instance: reads land, requests join continuous batching, decode steps run.

Batching: at most ``decode_max_batch`` running requests decode together, oldest in the batch
first; the rest wait for a slot. A request that needs a block when none is free preempts the
running request that arrived last (possibly itself), by write-back or recompute per policy;
preempted requests resume in arrival order once their blocks and their next token's fit (into
exactly its old blocks a request would be preempted again at once). Ordering victims and
resumes by arrival guarantees progress: the oldest request is never the victim of a newer one.

The batch is simulated lazily. A request in it produces one token per step without being
touched: its progress is the number of steps since ``s0``. It is visited only at its next
*event* — the step that ends its answer, the step whose token needs a new block, or its first
step after joining or stalling (that token's gap is not one step). A step costs O(1) plus
its events, not O(batch); the batch's total context, the step time's input, is a running sum
kept exact through every join, event and preemption. The steps between two events are slept
through in one wait (:mod:`kvstate.sim._span`), cut short by anything that must see the batch
between steps; the report is the same, bit for bit, as with a wake-up per step.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

import simpy
from simpy import Timeout

from .. import commands as C
from .._decode import DecodeLifecycle
from .._errors import OutOfBlocksError
from ._instance import Instance
from ._services import Services
from ._span import StepSpan, delay_to

if TYPE_CHECKING:  # pragma: no cover
    from ._request import SimRequest

__all__ = ["DecodeInstance"]

_COPYING_OUT = ("preempt_writing", "swapping_out")  # preempted, blocks freed once the copy answers
_PARKED = ("preempted", "swapped")  # preempted, blocks freed: may resume


class DecodeInstance(Instance):
    """One D instance and its decode loop."""

    __slots__ = ("max_batch", "batch", "overflow", "preempted", "recompute", "finishing", "steps", "context",
                 "slot_seconds", "itl", "_events", "_seq", "_current", "_skipped", "_step_len", "_stepping", "_span",
                 "_span_base", "_free_seen", "spans", "cuts", "_proc")
    role = "decode"
    lifecycle_cls = DecodeLifecycle
    #: sleep through runs of event-free steps in one wait (kvstate.sim._span); off, every step
    #: wakes the loop. Both give the same report, bit for bit: a test holds them to it.
    sleep_quiet_steps = True

    def __init__(self, sv: Services, idx: int) -> None:
        super().__init__(sv, idx)
        self.lc: DecodeLifecycle
        self.max_batch = sv.scenario.cluster.decode_max_batch
        self.batch: dict[str, SimRequest] = {}  # decoding (insertion order: oldest first)
        self.overflow: dict[str, SimRequest] = {}  # running, waiting for a batch slot
        self.preempted: list[tuple[int, SimRequest]] = []  # heap by arrival index
        self.recompute: list[tuple[SimRequest, int, int]] = []  # (request, tokens, from token)
        self.finishing: list[SimRequest] = []  # answers complete at StartDecode
        self.steps = 0
        self.context = 0  #: total context of the batch
        self.slot_seconds = 0.0  #: integral of the batch size over compute time
        self.itl: dict[float, int] = {}  #: inter-token gap (s) -> tokens
        self._events: list[tuple[int, int, SimRequest, int]] = []  # (step, seq, request, version)
        self._seq = itertools.count()
        self._current: SimRequest | None = None  # the request whose event runs now
        self._skipped = 0  # batch members preempted before their event of this step ran
        self._step_len = 0.0  # the duration of the step whose events run
        self._stepping = False  # a step is running (its batch is fixed)
        self._span: StepSpan | None = None  # quiet steps being slept through
        self._span_base = (0.0, 0.0)  # busy and slot seconds before the span
        self._free_seen = 0  # free blocks at the last pump
        self.spans = self.cuts = 0  #: spans slept through, and those cut short
        self._proc = self.env.process(self._loop())

    @property
    def running(self) -> int:
        return len(self.batch) + len(self.overflow)

    def notice(self, cmd: C.Command) -> None:
        cl = self.sv
        t = cmd.__class__
        if t is not C.RequestEnded:
            self.cut_span()  # the batch changes, or the loop has work: it must see the step's end
        if t is C.StartDecode:
            req = cl.reqs[cmd.request_id]
            req.cap = len(cmd.block_ids) * cl.block_size  # type: ignore[attr-defined]  # a StartDecode
            if req.preempted_at is not None:  # back from a preemption: its round trip
                cl.round_trips.append(self.env.now - req.preempted_at)
                req.preempted_at = None
            if req.generated >= req.out:
                self.finishing.append(req)  # one-token answers: nothing left to decode
            else:
                self._add(req)
            self.wake_up()
        elif t is C.Recompute:
            req = cl.reqs[cmd.request_id]
            start = cmd.from_token  # type: ignore[attr-defined]  # a Recompute
            self.recompute.append((req, req.synced - start, start))
            self.wake_up()
        elif t is C.RequestEnded:
            cl.ended(cl.reqs[cmd.request_id], cmd)  # type: ignore[arg-type]  # a RequestEnded
        elif t is C.FreeBlocks:
            self.wake_up()  # a write-back answered: a preempted request may resume

    # -- the loop --------------------------------------------------------------------------------
    def _loop(self) -> Generator[simpy.Event, object, None]:
        cl, env, lc = self.sv, self.env, self.lc
        while True:
            while self.finishing:
                req = self.finishing.pop()
                req.finish = env.now
                lc.finish(req.rid)
                self.pump()
            if self.preempted:
                self._resume_preempted()
            work: Sequence[tuple[SimRequest, int, int]] = ()  # recomputes asked for during the step wait
            if self.recompute:
                work, self.recompute = self.recompute, []
            b = len(self.batch)
            if not b and not work:
                yield self.idle()
                continue
            quiet = 0 if work or not self.sleep_quiet_steps else self._steps_to_event()
            if quiet > 1:  # steps with no event before the next one: one wait for all of them
                t = yield from self._sleep_span(b, quiet)
            else:
                t = self.side.compute.decode_step_time(b, self.context) if b else 0.0
                if work:
                    t += self.side.compute.prefill_time((n, c) for _, n, c in work)
                if cl.timeline is not None:
                    cl.timeline.step(self.name, env.now, env.now + t, "decode", batch=b, recomputes=len(work))
                self.busy_time += t
                self.slot_seconds += t * b
                self.computing_until = env.now + t
                self._stepping = True
                yield Timeout(env, t)
                self._stepping = False
            self.steps += 1
            self.context += b  # every member made one token, until its event says otherwise
            if work:
                for req, _, _ in work:
                    if lc.is_live(req.rid) and lc.state_of(req.rid) == "recomputing":
                        lc.recompute_done(req.rid)
                self.pump()  # recomputed requests join for the next step
            self._run_events(b, t)
            self.pump()
            cl.retry_backlog()

    # -- quiet steps slept through as one span (kvstate.sim._span) ---------------------------------
    def _steps_to_event(self) -> int:
        """Steps until the batch's next event step, that one included."""
        events = self._events
        while events and events[0][3] != events[0][2].ver:
            heapq.heappop(events)  # stale: it left the batch since
        return events[0][0] - self.steps if events else 1

    def _sleep_span(self, b: int, count: int):
        """Sleep through ``count`` steps of batch ``b`` (fewer if cut); account for all but the
        last, which the loop ends as any step. Returns the last step's seconds."""
        env = self.env
        span = StepSpan(env.now, b, self.context, count, self.side.compute.decode_step_times)
        self._span, self._span_base = span, (self.busy_time, self.slot_seconds)
        self.spans += 1
        self._count_busy(span)
        self._stepping = True
        while (now := env.now) != span.ends[span.last]:  # delay_to may land just before: then once more
            try:
                yield Timeout(env, delay_to(now, span.ends[span.last]))
            except simpy.Interrupt:
                pass  # cut: the span now ends with the step that was running
        self._span = None
        self._stepping = False
        self._advance(span, span.last)
        return span.lens[span.last]

    def _count_busy(self, span: StepSpan) -> None:
        """Busy and slot time of the span's steps, added one step at a time as a step adds them."""
        busy, slots = self._span_base
        b = span.batch
        for d in span.lens[:span.last + 1]:
            busy += d
            slots += d * b
        self.busy_time, self.slot_seconds = busy, slots
        self.computing_until = span.ends[span.last]

    def _advance(self, span: StepSpan, upto: int) -> None:
        """Account for the span's steps before ``upto``: no event fell on them."""
        n = upto - span.done
        if n <= 0:
            return
        b, itl = span.batch, self.itl
        for d in span.lens[span.done:upto]:
            itl[d] = itl.get(d, 0) + b
        self.steps += n
        self.context += b * n
        span.done = upto

    def cut_span(self) -> None:
        """Something must see the batch between steps: end the span with the running step."""
        span = self._span
        if span is None:
            return
        now = self.env.now
        self._advance(span, span.over_at(now))
        if span.cut(now):
            self.cuts += 1
            self._count_busy(span)
            self._proc.interrupt()

    def pump(self) -> None:
        Instance.pump(self)  # not super(): a super object per call, thirteen thousand a run
        free = self.lc.pool.num_free
        if free > self._free_seen:  # blocks came free: the backlog is retried at each D's step end
            self.sv.blocks_freed()
            if self.preempted:  # and a preempted request may resume, even with no batch running
                self.wake_up()
        self._free_seen = free

    def _run_events(self, b: int, d: float) -> None:
        """Visit the requests whose event falls on this step; the rest made a token ``d`` apart."""
        events, step, done = self._events, self.steps, 0
        self._skipped, self._step_len = 0, d
        now = self.env.now
        while events and events[0][0] <= step:
            _, _, req, ver = heapq.heappop(events)
            if ver != req.ver:
                continue  # it left the batch since
            done += 1
            self._current = req
            self._event(req, d, now)
        self._current = None
        bulk = b - done - self._skipped
        if bulk:
            self.itl[d] = self.itl.get(d, 0) + bulk

    def _event(self, req: SimRequest, d: float, now: float) -> None:
        step = self.steps
        k = step - 1 - req.s0  # steps it advanced normally before this one
        req.generated += k
        req.ctx += k
        req.s0 = step - 1
        if req.generated + 1 >= req.out:  # this step made its last token
            req.generated += 1
            self._gap(req, d, now)
            self.context -= req.ctx + 1
            self._leave(req)
            req.finish = now
            self.lc.finish(req.rid)
            return
        if req.ctx + 1 > req.cap and not self._grow(req):
            if req.rid in self.batch:  # no block this step: it waits a step (a victim writes back)
                self.context -= 1
                if not req.explicit:
                    req.last_token, req.explicit = now - d, True
                req.s0 = step
                self._schedule(req, step + 1)
            return
        req.generated += 1
        req.ctx += 1
        self._gap(req, d, now)
        req.s0 = step
        self._schedule(req, step + min(req.out - req.generated, req.cap - req.ctx + 1))

    def _gap(self, req: SimRequest, d: float, now: float) -> None:
        gap = now - req.last_token if req.explicit else d
        self.itl[gap] = self.itl.get(gap, 0) + 1
        req.last_token, req.explicit = now, False

    def audit(self) -> list[str]:
        """Broken bookkeeping of the lazy batch, between steps (empty when sound): the running
        context sum, each member's next event, the batch bound."""
        errors = []
        ctx = sum(r.ctx + self.steps - r.s0 for r in self.batch.values())
        if ctx != self.context:
            errors.append(f"{self.name}: context sum {self.context} != members' {ctx} at step {self.steps}")
        for r in self.batch.values():
            if r.event_step <= self.steps or r.s0 > self.steps:
                errors.append(f"{self.name}: {r.rid} event at {r.event_step}, s0 {r.s0}, step {self.steps}")
        if len(self.batch) > self.max_batch or (self.overflow and len(self.batch) < self.max_batch):
            errors.append(f"{self.name}: batch {len(self.batch)} of {self.max_batch}, {len(self.overflow)} waiting")
        return errors

    # -- batch membership ----------------------------------------------------------------------
    def _schedule(self, req: SimRequest, step: int) -> None:
        req.event_step = step
        heapq.heappush(self._events, (step, next(self._seq), req, req.ver))

    def _add(self, req: SimRequest) -> None:
        if len(self.batch) < self.max_batch:
            self._join(req)
        else:
            self.overflow[req.rid] = req

    def _join(self, req: SimRequest) -> None:
        self.batch[req.rid] = req
        # a read that lands while a step runs joins the next one: that step's batch is fixed
        req.s0 = self.steps + self._stepping
        req.explicit = True  # its first token here is not one step after its last
        self.context += req.ctx
        self._schedule(req, req.s0 + 1)

    def _leave(self, req: SimRequest) -> None:
        del self.batch[req.rid]
        req.ver += 1
        req.event_step = -1
        while self.overflow and len(self.batch) < self.max_batch:
            nxt = next(iter(self.overflow.values()))
            del self.overflow[nxt.rid]
            self._join(nxt)

    # -- blocks: growth, preemption, resumption -------------------------------------------------
    def _sync(self, req: SimRequest, upto: int) -> tuple[int, ...]:
        added: tuple[int, ...] = ()
        if upto > req.synced:
            added = self.lc.append_tokens(req.rid, req.decoded(req.synced, upto))
            req.synced = upto
        return added

    def _grow(self, req: SimRequest) -> bool:
        """Give ``req`` the block its next token needs, preempting the running request that
        arrived last (possibly ``req`` itself) when none is free."""
        while True:
            try:
                added = self._sync(req, req.ctx + 1)
            except OutOfBlocksError:
                if self._writing_back():
                    return False  # blocks are on their way back: wait rather than preempt more
                victim = max(itertools.chain(self.batch.values(), self.overflow.values()),
                             key=lambda r: r.index)
                self._preempt(victim)
                if victim is req or self.lc.state_of(victim.rid) != "preempted":
                    return False  # itself, or its blocks free once its write-back answers
                continue
            req.cap += len(added) * self.sv.block_size
            return True

    def _writing_back(self) -> bool:
        live, lc = self.sv.live, self.lc
        return any(r.rid in live and lc.state_of(r.rid) in _COPYING_OUT for _, r in self.preempted)

    def _preempt(self, req: SimRequest) -> None:
        if req.rid in self.batch:
            step = self.steps
            # this step's token: made, unless its event is due now (pending, or running now)
            pending = req.event_step == step
            k = step - req.s0 - (1 if pending else 0)
            req.generated += k
            req.ctx += k
            self.context -= req.ctx + (1 if pending else 0)
            if pending and req is not self._current:
                self._skipped += 1
            if not req.explicit:  # it made a token at the end of this step, or of the last one
                req.last_token = self.env.now - (self._step_len if pending else 0.0)
            self._leave(req)
        else:
            del self.overflow[req.rid]
        req.explicit = True
        self._sync(req, req.ctx)
        req.preemptions += 1
        req.preempted_at = self.env.now
        self.sv.counters["preemptions"] += 1
        self.lc.preempt(req.rid)
        heapq.heappush(self.preempted, (req.index, req))
        self.pump()

    def _resume_preempted(self) -> None:
        lc, pre, live = self.lc, self.preempted, self.sv.live
        while pre:
            req = pre[0][1]
            state = lc.state_of(req.rid) if req.rid in live else "ended"
            if state not in _PARKED and state not in _COPYING_OUT:
                heapq.heappop(pre)
                continue
            if state not in _PARKED:
                return  # in arrival order: its write-back or swap-out is still running
            # its cache and its next token, as at reservation: resuming into exactly its old
            # blocks would leave it no room to grow, and it would be preempted again at once
            need = self.side.cache_spec.blocks_for(req.synced + 1)
            if self.running:  # room for the running requests to grow, as at reservation
                need += lc.policy.decode_headroom_blocks
            if lc.pool.num_free < need:
                return
            heapq.heappop(pre)
            lc.resume(req.rid)
            self.pump()
