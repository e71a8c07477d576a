"""The simulated D instance's books and rules (kvstate.sim._decode): tokens, gaps,
preemptions, spans and the audit, held to identities that any run must satisfy, and the
module's rules of preemption, growth and resumption checked as a run goes.

The lazy batch visits a request only at its events, so its counts come out of arithmetic
on step numbers rather than from one increment per token. These tests check that
arithmetic against what the requests themselves record, on runs that preempt by every
policy, preempt the same request twice, and preempt a member whose event is due in the
step that preempts it. One case is worked by hand to its numbers: a victim chosen, its
cache recomputed alone once the older request ends, its tokens, gaps and round trip; and a
second from it: a parked request aborted ahead of another, which still resumes; and a
request that preempts itself at a block boundary, which resumes only with room for its next
token.
"""
from __future__ import annotations

import copy
import json
import math

import pytest

from kvstate._timeline import Timeline
from kvstate.sim import Cluster, Scenario, _decode, with_overrides
from kvstate.sim._compute import ComputeModel
from kvstate.sim._decode import DecodeInstance
from kvstate.sim._metrics import summarize
from kvstate.sim._span import StepSpan

SMALL = {"workload.num_requests": 150, "workload.input_mean": 600.0, "workload.input_max": 4096,
         "workload.output_mean": 300.0, "workload.output_max": 600, "workload.prefix_tokens": 256}
RUNS = {
    "write": {"cluster.gpu_blocks": 120, "workload.rate": 200.0, "policy.preempt": "write"},
    "recompute": {"cluster.gpu_blocks": 100, "workload.rate": 200.0, "policy.preempt": "recompute"},
    "swap": {"cluster.gpu_blocks": 120, "workload.rate": 300.0, "policy.preempt": "swap", "cluster.host_blocks": 40},
    "small_batch": {"cluster.gpu_blocks": 120, "workload.rate": 200.0, "policy.preempt": "write",
                    "cluster.decode_max_batch": 8},
    "short_answers": {"workload.output_mean": 2.0, "workload.output_max": 6},
    "full_batches": {"cluster.gpu_blocks": 90, "workload.rate": 300.0, "policy.preempt": "write",
                     "cluster.decode_max_batch": 6},
}


def run(extra: dict) -> tuple[Cluster, dict]:
    cl = Cluster(with_overrides(Scenario(), {**SMALL, **extra}))
    return cl, summarize(cl, cl.run())


@pytest.mark.parametrize("name", sorted(RUNS))
def test_tokens_gaps_and_preemptions_add_up(name):
    cl, r = run(RUNS[name])
    reqs = list(cl.reqs.values())
    assert r["states"] == {"done": len(reqs)}
    itl: dict[float, int] = {}
    for d in cl.decode:
        for gap, n in d.itl.items():
            itl[gap] = itl.get(gap, 0) + n
    assert all(q.generated == q.out for q in reqs)  # each made its whole answer, and no token more
    # one gap per token after the first (P's): a one-token answer has none
    assert sum(itl.values()) == sum(q.out - 1 for q in reqs)
    # a request's gaps sum to its time from first token to finish
    assert math.isclose(sum(g * n for g, n in itl.items()),
                        sum(q.finish - q.first_token for q in reqs if q.out > 1), rel_tol=1e-9)
    # each preemption counted once, on the run and on its request, and resumed once
    assert r["preemptions"] == sum(q.preemptions for q in reqs) == len(cl.round_trips)
    assert all(0.0 < t <= r["duration_s"] for t in cl.round_trips)
    if name == "short_answers":
        assert any(q.out == 1 for q in reqs) and r["preemptions"] == 0
    else:
        assert r["preemptions"] > 0
    if name in ("recompute", "swap"):
        assert any(q.preemptions > 1 for q in reqs)


@pytest.mark.parametrize("name", ["full_batches", "recompute", "swap"])
def test_preemption_and_resumption_follow_the_modules_rules(name, monkeypatch):
    """The victim is the running request that arrived last, in the batch or waiting for a
    slot; a request grows by a block at the token its blocks cannot hold, and the lifecycle
    learns of that token then, not before; the oldest parked request resumes as soon as its
    cache, its next token and (with requests running) the headroom fit, and not before."""
    seen = {"victims": 0, "waiting_victims": 0, "resumed": 0, "held": 0}
    grow, preempt, resume = DecodeInstance._grow, DecodeInstance._preempt, DecodeInstance._resume_preempted

    def checked_preempt(self: DecodeInstance, req) -> None:
        running = [*self.batch.values(), *self.overflow.values()]
        assert req.index == max(r.index for r in running)
        seen["victims"] += 1
        seen["waiting_victims"] += req.rid in self.overflow
        preempt(self, req)

    def checked_grow(self: DecodeInstance, req) -> bool:
        assert req.ctx == req.cap  # a block is taken for the token that does not fit, not before
        grown = grow(self, req)
        assert not grown or req.synced == req.ctx + 1
        return grown

    def checked_resume(self: DecodeInstance) -> None:
        lc, live = self.lc, self.sv.live
        held = [r for _, r in self.preempted if r.rid in live]
        parked = sorted((r for r in held if lc.state_of(r.rid) in ("preempted", "swapped")), key=lambda r: r.index)
        copying = [r for r in held if lc.state_of(r.rid) in ("preempt_writing", "swapping_out")]
        head = parked[0] if parked and not any(r.index < parked[0].index for r in copying) else None
        need = None
        if head is not None:
            need = self.side.cache_spec.blocks_for(head.synced + 1)
            need += lc.policy.decode_headroom_blocks if self.running else 0
            fits = lc.pool.num_free >= need
        resume(self)
        if head is not None:
            went = lc.state_of(head.rid) not in ("preempted", "swapped")
            assert went == fits, (head.rid, lc.pool.num_free, need)
            seen["resumed" if went else "held"] += 1

    monkeypatch.setattr(DecodeInstance, "_preempt", checked_preempt)
    monkeypatch.setattr(DecodeInstance, "_grow", checked_grow)
    monkeypatch.setattr(DecodeInstance, "_resume_preempted", checked_resume)
    _, r = run(RUNS[name])
    assert r["states"] == {"done": 150} and seen["victims"] == r["preemptions"] > 0
    assert seen["resumed"] > 0 and seen["held"] > 0
    if name == "full_batches":
        assert seen["waiting_victims"] > 0


def test_preempting_a_member_whose_event_is_due_still_counts_its_tokens(monkeypatch):
    """The swap run preempts members whose event falls on the preempting step while another
    member's event runs: their token of that step is counted once, as the bulk's."""
    seen = {"due": 0}
    real = DecodeInstance._preempt

    def preempt(self: DecodeInstance, req) -> None:
        if req.rid in self.batch and req.event_step == self.steps and req is not self._current:
            seen["due"] += 1
        real(self, req)

    monkeypatch.setattr(DecodeInstance, "_preempt", preempt)
    cl, r = run(RUNS["swap"])
    assert seen["due"] > 0
    assert sum(sum(d.itl.values()) for d in cl.decode) == sum(q.out - 1 for q in cl.reqs.values())


def test_every_span_slept_and_every_cut_is_counted_once(monkeypatch):
    made, cut = [0], [0]

    class Counted(StepSpan):
        __slots__ = ()

        def __init__(self, *args) -> None:
            super().__init__(*args)
            made[0] += 1

        def cut(self, now: float) -> bool:
            shorter = super().cut(now)
            cut[0] += shorter
            return shorter

    monkeypatch.setattr(_decode, "StepSpan", Counted)
    cl, _ = run({"workload.rate": 50.0, "workload.output_mean": 200.0})
    assert made[0] > 1 and cut[0] > 1
    assert sum(d.spans for d in cl.decode) == made[0]
    assert sum(d.cuts for d in cl.decode) == cut[0]


def test_the_audit_names_each_broken_rule(monkeypatch):
    """Mid-run, with a batch of several requests: sound books pass, and each rule broken on
    purpose (then mended) is reported by name and numbers."""
    checked: list[str] = []
    real = DecodeInstance._run_events

    def check(self: DecodeInstance, b: int, d: float) -> None:
        real(self, b, d)
        if checked or len(self.batch) < 2:
            return
        assert self.audit() == []
        name, step = self.name, self.steps
        self.context += 5
        assert self.audit() == [f"{name}: context sum {self.context} != members' {self.context - 5} at step {step}"]
        self.context -= 5
        r = next(iter(self.batch.values()))
        event, s0 = r.event_step, r.s0
        r.event_step = step  # due now: it should have run
        assert self.audit() == [f"{name}: {r.rid} event at {step}, s0 {s0}, step {step}"]
        r.event_step, r.s0 = event, step + 1  # counted from a step not yet run
        assert self.audit()[-1] == f"{name}: {r.rid} event at {event}, s0 {step + 1}, step {step}"
        r.s0 = s0
        bound, n = self.max_batch, len(self.batch)
        self.max_batch = n - 1
        assert self.audit() == [f"{name}: batch {n} of {n - 1}, 0 waiting"]
        self.max_batch = n + 1
        self.overflow["waiting"] = r  # a request waits for a slot while one is free
        assert self.audit() == [f"{name}: batch {n} of {n + 1}, 1 waiting"]
        del self.overflow["waiting"]
        self.max_batch = bound
        assert self.audit() == []
        checked.append(name)

    monkeypatch.setattr(DecodeInstance, "_run_events", check)
    _, r = run({"workload.rate": 50.0})
    assert checked and r["states"] == {"done": 150}


def test_a_fixed_step_time_makes_the_busy_and_slot_integrals_plain_sums(monkeypatch):
    """With every decode step taking ``STEP`` seconds, D's busy time is ``STEP`` a step and its
    batch-slot integral ``STEP`` a token made in a step (no preemption: no member stalls)."""
    step = 0.004
    monkeypatch.setattr(ComputeModel, "decode_step_time", lambda self, batch, context: step)
    monkeypatch.setattr(ComputeModel, "decode_step_times", lambda self, batch, context, count: [step] * count)
    cl, r = run({"workload.rate": 50.0, "workload.output_mean": 120.0})
    assert r["states"] == {"done": 150} and r["preemptions"] == 0
    assert all(math.isclose(d.busy_time, step * d.steps, rel_tol=1e-9) for d in cl.decode)
    made = sum(q.out - 1 for q in cl.reqs.values())
    assert math.isclose(sum(d.slot_seconds for d in cl.decode), step * made, rel_tol=1e-9)
    assert set(sum((list(d.itl) for d in cl.decode), [])) >= {step}  # most gaps are one step


def test_each_d_step_takes_its_decode_and_its_recomputes_time(monkeypatch):
    """With fixed times (a decode step ``STEP``, a prefill ``PREFILL`` whatever its tokens) and
    every step woken for, each D step lasts its decode (when a batch ran) plus its recomputes'
    prefill (when any ran), is recorded with its batch and recomputes, and the steps sum to
    the instance's busy time, slot integral and step count."""
    step, prefill = 0.004, 0.05
    monkeypatch.setattr(ComputeModel, "decode_step_time", lambda self, batch, context: step)
    monkeypatch.setattr(ComputeModel, "decode_step_times", lambda self, batch, context, count: [step] * count)
    monkeypatch.setattr(ComputeModel, "prefill_time", lambda self, work: [*work] and prefill)
    monkeypatch.setattr(DecodeInstance, "sleep_quiet_steps", False)
    seen: list[tuple[str, float, float, dict]] = []
    real = Timeline.step

    def recorded(self: Timeline, instance: str, start: float, end: float, name: str = "step", **args) -> None:
        if name == "decode":
            seen.append((instance, start, end, args))
        real(self, instance, start, end, name, **args)

    monkeypatch.setattr(Timeline, "step", recorded)
    cl = Cluster(with_overrides(Scenario(), {**SMALL, **RUNS["recompute"]}))
    cl.sv.timeline = Timeline(clock=lambda: cl.env.now)
    cl.run()
    assert any(a["recomputes"] and a["batch"] for *_, a in seen)  # recomputes beside a batch
    for d in cl.decode:
        mine = [(end - start, a) for inst, start, end, a in seen if inst == d.name]
        for took, a in mine:
            assert math.isclose(took, (step if a["batch"] else 0.0) + (prefill if a["recomputes"] else 0.0),
                                rel_tol=1e-9), a
            assert 0 <= a["batch"] <= d.max_batch
        assert len(mine) == d.steps
        assert math.isclose(sum(t for t, _ in mine), d.busy_time, rel_tol=1e-9)
        assert math.isclose(sum(t * a["batch"] for t, a in mine), d.slot_seconds, rel_tol=1e-9)


# -- a case worked by hand --------------------------------------------------------------------
STEP, PREFILL = 0.01, 0.5  # every decode step, and every prefill or recompute, whatever its tokens


def _two_requests_on_a_small_d(tmp_path, monkeypatch) -> tuple[Cluster, list, list, list]:
    """The worked case's run (see the test): what D asked of its compute model, whom it
    preempted when, and its steps as the timeline records them."""
    monkeypatch.setattr(ComputeModel, "decode_step_time", lambda self, batch, context: STEP)
    monkeypatch.setattr(ComputeModel, "decode_step_times", lambda self, batch, context, count: [STEP] * count)
    monkeypatch.setattr(ComputeModel, "prefill_time", lambda self, work: [*work] and PREFILL)
    trace = tmp_path / "two.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 200, "output_length": 300, "hash_ids": [h]})
                             + "\n" for t, h in ((0, 1), (1, 2))))
    cl = Cluster(with_overrides(Scenario(), {
        "workload.arrival": "trace", "workload.trace": str(trace), "cluster.n_prefill": 1, "cluster.n_decode": 1,
        "cluster.tp": 1, "cluster.gpu_blocks": 12, "policy.preempt": "recompute"}))
    d = cl.decode[0]
    d.side = copy.copy(d.side)  # D's own compute: what it asks of the model is recorded apart from P's
    recomputed: list[list[tuple[int, int]]] = []
    model = d.side.compute

    class Recorded:
        def __getattr__(self, name: str):
            return getattr(model, name)

        def prefill_time(self, work) -> float:
            recomputed.append(list(work))
            return model.prefill_time(recomputed[-1])

    d.side.compute = Recorded()
    preempted: list[tuple[str, int, int, int, float]] = []
    real = DecodeInstance._preempt

    def preempt(self: DecodeInstance, req) -> None:
        real(self, req)  # brings the victim's lazily kept counts up to date
        preempted.append((req.rid, self.sv.reqs["r0"].ctx, req.ctx, req.generated, self.env.now))

    monkeypatch.setattr(DecodeInstance, "_preempt", preempt)
    monkeypatch.setattr(DecodeInstance, "sleep_quiet_steps", False)
    steps: list[tuple[float, float, dict]] = []
    record = Timeline.step

    def recorded(self: Timeline, instance: str, start: float, end: float, name: str = "step", **args) -> None:
        if name == "decode":
            steps.append((start, end, args))
        record(self, instance, start, end, name, **args)

    monkeypatch.setattr(Timeline, "step", recorded)
    cl.sv.timeline = Timeline(clock=lambda: cl.env.now)
    cl.run()
    return cl, recomputed, preempted, steps


def test_a_victim_recomputed_alone_once_the_older_request_ends(tmp_path, monkeypatch):
    """Two requests of 200 prompt tokens and 300 answer tokens, 1 ms apart, one P and one D of
    12 blocks of 64 tokens (768), preempting by recompute. Worked from the module's rules:

    - P prefills A, then B, half a second each: their first tokens come 0.5 s apart, and D
      decodes both one token a step from then on; A's cache and B's grow by a block every
      64 tokens;
    - A, having made 184 tokens, holds 384 tokens in 6 blocks and needs a seventh for its
      next; B, 50 steps behind but for its first gap, holds 335 tokens (135 made) in the
      other 6: none is free, and the victim is B, the later arrival;
    - B may resume when its 335 tokens and its next fit (6 blocks; with A running, a block
      of headroom too). A's growing cache holds 7 and then 8 of the 12 until it ends: B
      resumes when A ends, and its recompute is the only work of that step: B's whole cache
      from token 0 (nothing of it was stored), one prefill long, with no batch beside it;
    - B then makes its other 165 tokens a step each: it ends 165 steps after the recompute,
      and its gap across the preemption runs from its last token before it to its first
      after the recompute."""
    cl, recomputed, preempted, steps = _two_requests_on_a_small_d(tmp_path, monkeypatch)
    d = cl.decode[0]
    a, b = cl.reqs["r0"], cl.reqs["r1"]
    assert (a.state, b.state, a.generated, b.generated) == ("done", "done", 300, 300)
    assert b.first_token - a.first_token == pytest.approx(PREFILL)
    assert len(preempted) == 1
    rid, a_ctx, b_ctx, b_made, at = preempted[0]
    assert (rid, a_ctx, b_ctx, b_made) == ("r1", 384, 335, 135)
    assert (a.preemptions, b.preemptions) == (0, 1)
    assert recomputed == [[(335, 0)]]  # B's whole cache, from its first token
    alone = [(start, end) for start, end, s in steps if s["recomputes"]]
    assert len(alone) == 1 and [s for *_, s in steps if s["recomputes"]] == [{"batch": 0, "recomputes": 1}]
    start, end = alone[0]
    assert start == pytest.approx(a.finish) and end - start == pytest.approx(PREFILL)
    assert cl.round_trips == [pytest.approx(end - at)]
    assert b.finish == pytest.approx(end + 165 * STEP)
    gaps = d.itl
    assert sum(gaps.values()) == 2 * 299
    assert gaps[STEP] == 2 * 299 - 3  # all but each request's first gap on D, and B's across its preemption
    assert max(gaps) == pytest.approx(end + STEP - at)


def test_a_parked_request_that_ends_holds_back_none_parked_behind_it(tmp_path, monkeypatch):
    """Three requests as in the worked case (A, B, C 1 ms apart), D of 14 blocks: A's growth
    preempts C, then B; both park, B ahead of C (arrival order). B is aborted while parked
    (a client gave up): its entry is dropped when it reaches the head, and C resumes when A
    ends, as it would behind a live B. Resumption stopping at an ended head would leave C
    parked for good, and the run undrained."""
    monkeypatch.setattr(ComputeModel, "decode_step_time", lambda self, batch, context: STEP)
    monkeypatch.setattr(ComputeModel, "decode_step_times", lambda self, batch, context, count: [STEP] * count)
    monkeypatch.setattr(ComputeModel, "prefill_time", lambda self, work: [*work] and PREFILL)
    trace = tmp_path / "three.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 200, "output_length": 300, "hash_ids": [t]})
                             + "\n" for t in (0, 1, 2)))
    cl = Cluster(with_overrides(Scenario(), {
        "workload.arrival": "trace", "workload.trace": str(trace), "cluster.n_prefill": 1, "cluster.n_decode": 1,
        "cluster.tp": 1, "cluster.gpu_blocks": 14, "policy.preempt": "recompute"}))
    d = cl.decode[0]
    parked_at_abort: list[list[str]] = []

    def abort_b():
        yield cl.env.timeout(3.2)  # B parked at 2.98 s behind C (1.57 s); A ends at 3.49 s
        parked_at_abort.append([r.rid for _, r in sorted(d.preempted)])
        assert d.lc.state_of("r1") == "preempted"
        d.lc.abort("r1")
        d.pump()

    cl.env.process(abort_b())
    cl.run()
    a, b, c = (cl.reqs[r] for r in ("r0", "r1", "r2"))
    assert parked_at_abort == [["r1", "r2"]]
    assert (a.state, b.state, c.state) == ("done", "aborted", "done")
    assert c.generated == 300 and c.preemptions == 1 and b.finish == pytest.approx(3.2)
    assert len(cl.round_trips) == 1 and cl.round_trips[0] == pytest.approx(a.finish + PREFILL - 1.573, abs=0.01)
    assert d.lc.pool.num_used == 0 and not d.preempted


def test_two_members_due_in_one_step_both_preempted_count_each_token_once(tmp_path, monkeypatch):
    """Six prompts of 60 tokens prefilled together join D's batch in one step and need their
    second block in one step; D of 8 blocks has two free. The first two members' events take
    them, the third's preempts the last arrival and the fourth's the one before it, both due
    in that step and not yet visited: each one's token of the step is counted as the bulk's,
    once (counting only one of them would lose a gap), and every answer adds up."""
    monkeypatch.setattr(ComputeModel, "decode_step_time", lambda self, batch, context: STEP)
    monkeypatch.setattr(ComputeModel, "decode_step_times", lambda self, batch, context, count: [STEP] * count)
    monkeypatch.setattr(ComputeModel, "prefill_time", lambda self, work: [*work] and PREFILL)
    trace = tmp_path / "six.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0, "input_length": 60, "output_length": 200, "hash_ids": [i]})
                             + "\n" for i in range(6)))
    cl = Cluster(with_overrides(Scenario(), {
        "workload.arrival": "trace", "workload.trace": str(trace), "cluster.n_prefill": 1, "cluster.n_decode": 1,
        "cluster.tp": 1, "cluster.gpu_blocks": 8, "policy.preempt": "recompute"}))
    skipped: list[tuple[int, int]] = []
    real = DecodeInstance._run_events

    def run_events(self: DecodeInstance, b: int, d: float) -> None:
        real(self, b, d)
        if self._skipped:
            skipped.append((self.steps, self._skipped))

    monkeypatch.setattr(DecodeInstance, "_run_events", run_events)
    cl.run()
    reqs = list(cl.reqs.values())
    assert skipped[0][1] == 2  # the step where both were due
    assert all(q.state == "done" and q.generated == q.out == 200 for q in reqs)
    assert sum(cl.decode[0].itl.values()) == sum(q.out - 1 for q in reqs)
    assert math.isclose(sum(g * n for g, n in cl.decode[0].itl.items()),
                        sum(q.finish - q.first_token for q in reqs), rel_tol=1e-9)


def test_a_request_preempted_at_a_block_boundary_resumes_only_with_room_for_its_next_token(tmp_path, monkeypatch):
    """Prompts of 200 and 260 tokens 1 ms apart, D of 10 blocks of 64, no headroom, preempting
    by recompute. B, 10 tokens ahead of A, fills its fifth block first (320 tokens) with none
    free: the victim is B itself, its cache exactly five blocks. It resumes when its 320 tokens
    *and its next* fit, six blocks: not while A holds the other five (resumed into exactly its
    old blocks, it would be preempted again at its next token), but when A ends; then it
    recomputes and makes its other 240 tokens."""
    monkeypatch.setattr(ComputeModel, "decode_step_time", lambda self, batch, context: STEP)
    monkeypatch.setattr(ComputeModel, "decode_step_times", lambda self, batch, context, count: [STEP] * count)
    monkeypatch.setattr(ComputeModel, "prefill_time", lambda self, work: [*work] and PREFILL)
    trace = tmp_path / "boundary.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 300, "hash_ids": [t]})
                             + "\n" for t, n in ((0, 200), (1, 260))))
    cl = Cluster(with_overrides(Scenario(), {
        "workload.arrival": "trace", "workload.trace": str(trace), "cluster.n_prefill": 1, "cluster.n_decode": 1,
        "cluster.tp": 1, "cluster.gpu_blocks": 10, "policy.preempt": "recompute", "policy.decode_headroom_blocks": 0}))
    preempted: list[tuple[str, int, int]] = []
    real = DecodeInstance._preempt

    def preempt(self: DecodeInstance, req) -> None:
        real(self, req)
        preempted.append((req.rid, req.ctx, req.synced))

    monkeypatch.setattr(DecodeInstance, "_preempt", preempt)
    cl.run()
    a, b = cl.reqs["r0"], cl.reqs["r1"]
    assert preempted == [("r1", 320, 320)]  # itself, at the boundary of its fifth block
    assert (a.state, b.state, a.preemptions, b.preemptions) == ("done", "done", 0, 1)
    assert b.finish == pytest.approx(a.finish + PREFILL + 240 * STEP)


def test_the_hot_objects_hold_their_fields_in_slots():
    """The objects every simulated event reads (instances, their lifecycles, the run's services,
    the compute model) are slotted all the way up: none carries a per-instance dictionary,
    through which each attribute read would take CPython's slower lookup, and a field a
    method sets without declaring it fails at once rather than growing one."""
    cl = Cluster(with_overrides(Scenario(), {"workload.num_requests": 5}))
    hot = [cl.sv, cl.sv.compute, *(i for i in cl.instances), *(i.lc for i in cl.instances)]
    assert {type(o).__name__ for o in hot} >= {"Services", "ComputeModel", "PrefillInstance", "DecodeInstance",
                                               "PrefillLifecycle", "DecodeLifecycle"}
    assert [type(o).__name__ for o in hot if hasattr(o, "__dict__")] == []
    with pytest.raises(AttributeError):
        cl.decode[0].undeclared_field = 1
