"""A simulated co-located instance: prefill and decode on the same GPUs, scheduled as vLLM v1.

Rules (first come, first served):

- A step has a token budget (``max_num_batched_tokens``) and a seat cap (``max_num_seqs``).
  Running requests come first: each decoding one spends one token of the budget; each one still
  prefilling, in the order they were admitted, takes the next chunk of its prompt that the
  budget leaves (without chunked prefill it runs whole or waits). Then waiting requests are
  admitted in order while budget and seats remain and their blocks fit; the first that does
  not fit ends admission for the step, and a step that preempted admits none.
- A request's blocks cover the tokens computed so far and the step's; a decoding request takes
  a block when its next token crosses into a new one. When none is free, the running request
  admitted last is preempted (it may be the one asking): its blocks are released and it waits
  at the head of the queue to recompute its prompt and the tokens it had generated.
- With prefix caching the pool is a :class:`~kvstate._prefixcache.PrefixCachingPool`: a
  prompt's full blocks are published as its chunks are computed, an admitted prompt claims
  the cached blocks of its longest cached prefix (leaving its last token to compute: the
  step must sample), and a finished request's blocks stay cached, idle, until evicted least
  recently used. Generated tokens' blocks are not published (no later prompt repeats them).
  A model with state layers takes a cached prefix back from its last checkpoint only (its
  states are kept at block-aligned checkpoints); each seat's state page is memory taken from
  the blocks (:meth:`Scenario.state_pages`).
- A step computes its chunks and one token of every decoding request together; its time is
  :meth:`~kvstate.sim._compute.ComputeModel.step_time`. A prompt whose last chunk ran samples a
  token at the step's end (its first token: TTFT); a decoding request makes one a step.

Decoding requests are simulated lazily, as on a D instance (:mod:`kvstate.sim._decode`): a
request is visited only at its events, the step whose token needs a block and the step
that ends its answer, so a step costs O(1) plus its chunks and events. The batch's context,
the step time's input, is a running sum kept exact through joins, finishes and preemptions.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

import simpy

from .._keys import full_blocks, keys_of_packed
from .._layers import checkpoint_floor
from .._pool import BlockPool
from .._prefixcache import PrefixCachingPool
from ._request import SimRequest

__all__ = ["ColocatedInstance", "Seq"]


class Seq:
    """A request's place on a co-located instance: its blocks and progress."""

    __slots__ = ("req", "keys", "blocks", "computed", "target", "published", "ver", "j0", "g0", "decoding", "queued")

    def __init__(self, req: SimRequest, keys: list[str], queued: float) -> None:
        self.req, self.keys = req, keys
        self.queued = queued  #: when it joined the waiting queue (-inf: back from a preemption)
        self.blocks: list[int] = []
        self.computed = 0  #: tokens whose cache is computed (prefill progress)
        self.target = req.input_len  #: tokens to compute before it samples (prompt + generated, after preemption)
        self.published = 0  #: prompt blocks published in the prefix cache
        self.ver = 0  #: bumped when it leaves the batch: its scheduled events are stale
        self.j0 = self.g0 = 0  #: the step it began decoding at, and its tokens then
        self.decoding = False

    def fed(self, step: int) -> int:
        """Tokens whose cache the decode step ``step`` needs (prompt + generated before it)."""
        return self.req.input_len + self.g0 + step - self.j0


class ColocatedInstance:
    """One co-located instance and its step loop (see the module's rules)."""

    role = "colocated"

    def __init__(self, env: simpy.Environment, s: Any, compute: Any, idx: int, gpu_blocks: int,
                 counters: dict[str, int], ended: Callable[[SimRequest], None]) -> None:
        sch = s.scheduler
        self.env, self.compute, self.name = env, compute, f"C{idx}"
        self.bs, self.namespace = s.model.block_size, s.model.name
        self.budget, self.max_seqs, self.chunked = sch.max_num_batched_tokens, sch.max_num_seqs, sch.chunked_prefill
        self.prefix = sch.prefix_caching
        #: a hybrid model's state groups: a cached prefix is taken back from a checkpoint only
        self.state_groups = tuple(g for g in s.cache_spec().groups if g.kind == "state")
        self.pool: BlockPool = PrefixCachingPool(gpu_blocks) if self.prefix else BlockPool(gpu_blocks)
        self.counters, self._ended = counters, ended
        self.key_cache: Any = None
        self.waiting: deque[Seq] = deque()
        self.running: dict[str, Seq] = {}  # admission order
        self.prefilling: dict[str, Seq] = {}
        self.ndecode = 0
        self.context = 0  #: tokens the decoding requests feed at step ``self.step``
        self.step = 0
        self.busy_time = self.block_seconds = self.slot_seconds = 0.0
        self.computing_until = 0.0
        self.itl: dict[float, int] = {}
        self.round_trips: list[float] = []
        self._grow: list[tuple[int, int, int, Seq]] = []  # (step, seq no, version, seq)
        self._finish: list[tuple[int, int, int, Seq]] = []
        self._no = itertools.count()
        self._wake: simpy.Event | None = None
        self._preempted_now = False
        #: with async scheduling, a step's schedule is made as the step before it starts: only
        #: requests queued by then can join it (+inf: the instance was idle, nothing was scheduled ahead)
        self.lookahead = sch.async_scheduling
        self._cutoff = math.inf
        env.process(self._loop())

    @property
    def load(self) -> int:
        """Requests on it (the router's measure)."""
        return len(self.waiting) + len(self.running)

    def add(self, req: SimRequest) -> None:
        """A request routed here: it waits for admission."""
        tokens = req.tokens
        assert tokens is not None  # handed over once, then dropped
        keys = keys_of_packed(tokens, self.bs, None, self.namespace, self.key_cache) if self.prefix else []
        req.tokens = None
        self.waiting.append(Seq(req, keys, self.env.now))
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> Generator[simpy.Event, object, None]:
        env = self.env
        while True:
            if not self.running and not self.waiting:
                self._wake = env.event()
                yield self._wake
                self._wake = None
                self._cutoff = math.inf
            chunks = self._schedule()
            b = self.ndecode
            if not chunks and not b:
                if self.waiting and self.waiting[0].queued > self._cutoff:  # it joins the next schedule
                    self._cutoff = math.inf
                    continue
                self._refuse(self.waiting.popleft())  # it cannot fit an empty instance: refused (as too long)
                continue
            dt = self.compute.step_time([(n, q.computed, q.computed + n == q.target) for q, n in chunks],
                                        b, self.context)
            self.busy_time += dt
            self.block_seconds += self.pool.num_used * dt
            self.slot_seconds += len(self.running) * dt
            self.computing_until = env.now + dt
            if self.lookahead:
                self._cutoff = env.now
            yield env.timeout(dt)
            if b:
                self.itl[dt] = self.itl.get(dt, 0) + b
            self._end_step(chunks, b)

    def _schedule(self) -> list[tuple[Seq, int]]:
        """The step's prompt chunks (decoding requests run without being listed)."""
        self._preempted_now = False
        grow = self._grow
        while grow and grow[0][0] <= self.step:
            _, _, ver, q = heapq.heappop(grow)
            if ver == q.ver and self._make_room(q, 1):
                q.blocks += self.pool.allocate(1)
                self._plan(q)
        budget = self.budget - self.ndecode
        chunks: list[tuple[Seq, int]] = []
        for q in list(self.prefilling.values()):
            if budget <= 0:
                break
            if q.req.rid not in self.prefilling:  # preempted while this loop ran
                continue
            n = min(q.target - q.computed, budget)
            if self._make_room(q, self._blocks_short(q, n)):
                q.blocks += self.pool.allocate(self._blocks_short(q, n))
                chunks.append((q, n))
                budget -= n
        if not self._preempted_now:
            self._admit(budget, chunks)
        return chunks

    def _admit(self, budget: int, chunks: list[tuple[Seq, int]]) -> None:
        """Waiting requests in order while budget, seats and blocks allow."""
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            q = self.waiting[0]
            if q.queued > self._cutoff:  # queued after this step's schedule was made
                return
            hits = 0
            if self.prefix:
                pool: Any = self.pool
                hits = pool.cached_prefix(q.keys[:min(full_blocks(q.keys), (q.target - 1) // self.bs)])[0]
                if self.state_groups:
                    hits = checkpoint_floor(self.state_groups, hits, self.bs)
            n = q.target - hits * self.bs
            if n > budget and not self.chunked:
                return
            n = min(n, budget)
            need = -(-(hits * self.bs + n) // self.bs)
            if self.prefix:
                got = pool.allocate_after(q.keys[:hits], need)
                if got is None:
                    return
                q.blocks = got[0]
            elif self.pool.can_allocate(need):
                q.blocks = self.pool.allocate(need)
            else:
                return
            self.waiting.popleft()
            q.computed = q.published = hits * self.bs if self.prefix else 0
            q.published //= self.bs
            if q.req.preemptions == 0:
                q.req.cached_tokens = q.computed
            self.running[q.req.rid] = q
            self.prefilling[q.req.rid] = q
            chunks.append((q, n))
            budget -= n

    def _blocks_short(self, q: Seq, n: int) -> int:
        return max(0, -(-(q.computed + n) // self.bs) - len(q.blocks))

    def _make_room(self, q: Seq, n: int) -> bool:
        """Free blocks for ``n`` more, preempting from the last admitted; False if ``q`` itself went."""
        while not self.pool.can_allocate(n):
            victim = self.running[next(reversed(self.running))]
            self._preempt(victim)
            if victim is q:
                return False
        return True

    # -- a step's end --------------------------------------------------------------------------
    def _end_step(self, chunks: list[tuple[Seq, int]], b: int) -> None:
        """Account for the step just run: chunks computed, tokens made, answers ended."""
        now, done = self.env.now, self.step
        self.step += 1
        self.context += b  # every decoding request fed one more token
        fin = self._finish
        while fin and fin[0][0] <= done:
            _, _, ver, q = heapq.heappop(fin)
            if ver == q.ver:
                self.context -= q.fed(self.step)
                self.ndecode -= 1
                self._end(q, now)
        for q, n in chunks:
            if self.prefilling.get(q.req.rid) is not q:  # preempted in the step's scheduling
                continue
            q.computed += n
            if self.prefix:
                self._publish(q)
            if q.computed == q.target:
                self._sampled(q, now)

    def _publish(self, q: Seq) -> None:
        k = min(q.computed, q.req.input_len) // self.bs
        if k > q.published:
            pool: Any = self.pool
            pool.publish(q.keys[q.published:k], q.blocks[q.published:k])
            q.published = k

    def _sampled(self, q: Seq, now: float) -> None:
        """A prompt (or a preempted request's recompute) ended: its token comes out."""
        req = q.req
        del self.prefilling[req.rid]
        req.generated += 1
        if req.first_token is None:
            req.first_token = now
        else:
            self.itl[now - req.last_token] = self.itl.get(now - req.last_token, 0) + 1
            if req.preempted_at is not None:
                self.round_trips.append(now - req.preempted_at)
                req.preempted_at = None
        req.last_token = now
        if req.generated >= req.out:
            self._end(q, now)
            return
        q.decoding, q.j0, q.g0 = True, self.step, req.generated
        self.ndecode += 1
        self.context += q.fed(self.step)
        self._plan(q)

    def _plan(self, q: Seq) -> None:
        """Schedule its next event: the step needing a block, or the one ending its answer."""
        cap = len(q.blocks) * self.bs
        last = q.j0 + q.req.out - q.g0 - 1  # its final token comes out at this step's end
        grow = q.j0 + cap - q.req.input_len - q.g0 + 1 if cap < q.req.input_len + q.req.out - 1 else last + 1
        heapq.heappush(self._grow if grow <= last else self._finish,
                       (grow if grow <= last else last, next(self._no), q.ver, q))

    def _end(self, q: Seq, now: float) -> None:
        req = q.req
        req.finish = req.last_token = now
        req.generated = req.out
        req.state, req.reason = "done", "done"
        del self.running[req.rid]
        self.pool.release(q.blocks)
        q.blocks = []
        q.ver += 1
        self._ended(req)

    def _preempt(self, q: Seq) -> None:
        """Recompute preemption: its blocks go, it waits at the head of the queue."""
        req = q.req
        self._preempted_now = True
        self.counters["preemptions"] += 1
        req.preemptions += 1
        if q.decoding:
            req.generated = q.g0 + self.step - q.j0
            req.last_token = self.env.now  # its last token came out as the previous step ended
            self.context -= q.fed(self.step)
            self.ndecode -= 1
            q.decoding = False
        else:
            del self.prefilling[req.rid]  # out of this step's chunks
        req.preempted_at = self.env.now
        del self.running[req.rid]
        self.pool.release(q.blocks)
        q.blocks, q.computed, q.published = [], 0, 0
        q.target = req.input_len + req.generated
        q.ver += 1  # its scheduled events are stale
        q.queued = -math.inf
        self.waiting.appendleft(q)

    def _refuse(self, q: Seq) -> None:
        req = q.req
        self.counters["rejected_too_long"] += 1
        req.state, req.error, req.finish, req.reason = "rejected", 413, self.env.now, "rejected_too_long"
        self._ended(req)
