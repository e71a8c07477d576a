"""The co-located instance step by step: small cases worked by hand from the module's rules
(kvstate/sim/_colocated.py), each run on a compute model whose steps all take one second,
and every figure the instance keeps compared exactly: the steps' chunks, decode batch and
context; each request's first token, end, tokens and preemptions; the inter-token gaps, the
round trips, and the busy, slot and block seconds."""
from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import pytest
import simpy

from kvstate.sim._colocated import ColocatedInstance
from kvstate.sim._request import SimRequest
from kvstate.sim._workload import Arrival


class Rig:
    """One instance on its own clock; ``steps`` lists what each step asked the compute model."""

    def __init__(self, *, blocks: int = 64, budget: int = 64, seqs: int = 4, chunked: bool = True,
                 prefix: bool = False, lookahead: bool = False, bs: int = 4, dt: float = 1.0) -> None:
        self.dt = dt
        self.env = simpy.Environment()
        sch = SimpleNamespace(max_num_batched_tokens=budget, max_num_seqs=seqs, chunked_prefill=chunked,
                              prefix_caching=prefix, async_scheduling=lookahead)
        s = SimpleNamespace(scheduler=sch, model=SimpleNamespace(block_size=bs, name="m"),
                            cache_spec=lambda: SimpleNamespace(groups=()))
        self.steps: list[tuple[list[Any], int, int]] = []
        self.ended: list[SimRequest] = []
        self.counters = {"preemptions": 0, "rejected_too_long": 0}
        compute = SimpleNamespace(step_time=self._step_time)
        self.c = ColocatedInstance(self.env, s, compute, 0, blocks, self.counters, self.ended.append)

    def _step_time(self, prompts: Any, batch: int, context: int) -> float:
        self.steps.append((list(prompts), batch, context))
        return self.dt

    def run(self, *reqs: SimRequest) -> None:
        for r in reqs:
            self.env.process(self._arrive(r))
        self.env.run(until=1000)
        assert not self.c.running and not self.c.waiting and self.c.ndecode == 0 and self.c.context == 0
        assert self.c.pool.num_used == 0

    def _arrive(self, r: SimRequest) -> Any:
        yield self.env.timeout(r.arrival)
        self.c.add(r)


def req(i: int, n_in: int, n_out: int, t: float = 0.0, tokens: Any = None) -> SimRequest:
    ids = tokens if tokens is not None else range(1000 * i, 1000 * i + n_in)
    return SimRequest(Arrival(i, t, n_in, n_out, array("I", ids)))


def times(*reqs: SimRequest) -> list[tuple[float | None, float | None, int]]:
    return [(r.first_token, r.finish, r.generated) for r in reqs]


def test_a_prompt_runs_whole_then_decodes_a_token_a_step():
    rig = Rig()
    a = req(0, 10, 3)
    rig.run(a)
    # 10 tokens in 3 blocks of 4 hold the 2 decoded tokens' cache too: no block is added
    assert rig.steps == [([(10, 0, True)], 0, 0), ([], 1, 11), ([], 1, 12)]
    assert times(a) == [(1.0, 3.0, 3)] and a.state == "done" and a.reason == "done"
    assert rig.c.itl == {1.0: 2}
    assert (rig.c.busy_time, rig.c.slot_seconds, rig.c.block_seconds, rig.c.computing_until) == (3.0, 3.0, 9.0, 3.0)
    assert rig.ended == [a]


def test_chunked_prefill_takes_what_the_budget_leaves():
    rig = Rig(budget=4)
    a = req(0, 10, 2)
    rig.run(a)
    assert rig.steps == [([(4, 0, False)], 0, 0), ([(4, 4, False)], 0, 0), ([(2, 8, True)], 0, 0), ([], 1, 11)]
    assert times(a) == [(3.0, 4.0, 2)]
    assert rig.c.block_seconds == 1 + 2 + 3 + 3  # the blocks cover the tokens computed so far


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    rig = Rig(budget=5, chunked=False)
    a, b = req(0, 3, 1), req(1, 3, 1)
    rig.run(a, b)
    assert rig.steps == [([(3, 0, True)], 0, 0), ([(3, 0, True)], 0, 0)]
    assert times(a, b) == [(1.0, 1.0, 1), (2.0, 2.0, 1)]


def test_a_prompt_an_empty_instance_cannot_take_is_refused_as_too_long():
    rig = Rig(budget=8, chunked=False)
    a, b = req(0, 10, 2), req(1, 4, 1, t=3.0)
    rig.run(a, b)
    assert (a.state, a.error, a.reason, a.finish, a.first_token) == ("rejected", 413, "rejected_too_long", 0.0, None)
    assert rig.counters == {"preemptions": 0, "rejected_too_long": 1}
    assert rig.ended == [a, b] and times(b) == [(4.0, 4.0, 1)]
    assert rig.steps == [([(4, 0, True)], 0, 0)]


def test_seats_cap_the_running_requests():
    rig = Rig(seqs=1)
    a, b = req(0, 4, 2), req(1, 4, 2)
    rig.run(a, b)
    assert rig.steps == [([(4, 0, True)], 0, 0), ([], 1, 5), ([(4, 0, True)], 0, 0), ([], 1, 5)]
    assert times(a, b) == [(1.0, 2.0, 2), (3.0, 4.0, 2)]
    assert rig.c.slot_seconds == 4.0
    assert rig.c.block_seconds == 1 + 2 + 1 + 2  # each takes its second block for its last token


def test_the_instances_seconds_are_the_steps_seconds():
    rig = Rig(dt=2.0)
    a = req(0, 10, 3)
    rig.run(a)
    assert times(a) == [(2.0, 6.0, 3)] and rig.c.itl == {2.0: 2}
    assert (rig.c.busy_time, rig.c.slot_seconds, rig.c.block_seconds, rig.c.computing_until) == (6.0, 6.0, 18.0, 6.0)
    idle = Rig()
    idle.run()
    assert (idle.c.busy_time, idle.c.computing_until, idle.c.step, idle.steps) == (0.0, 0.0, 0, [])


def test_admission_takes_the_chunk_the_budget_leaves_down_to_one_token():
    rig = Rig(budget=5)
    a, b = req(0, 4, 1), req(1, 4, 1)
    rig.run(a, b)
    assert rig.steps == [([(4, 0, True), (1, 0, False)], 0, 0), ([(3, 1, True)], 0, 0)]


def test_chunks_inside_a_block_already_held_take_no_new_one():
    rig = Rig(budget=2)
    rig.run(req(0, 4, 1))
    assert rig.steps == [([(2, 0, False)], 0, 0), ([(2, 2, True)], 0, 0)]
    assert rig.c.block_seconds == 1 + 1


def test_a_prompt_as_long_as_the_budget_runs_unchunked_and_each_refusal_is_counted():
    rig = Rig(budget=4, chunked=False)
    a, x, y = req(0, 4, 1), req(1, 9, 1, t=2.0), req(2, 9, 1, t=3.0)
    rig.run(a, x, y)
    assert rig.steps == [([(4, 0, True)], 0, 0)]
    assert rig.counters["rejected_too_long"] == 2 and [r.state for r in (a, x, y)] == ["done", "rejected", "rejected"]


def test_a_growing_request_takes_the_last_free_block_without_preempting_itself():
    rig = Rig(blocks=3)
    a = req(0, 8, 4)
    rig.run(a)
    assert rig.steps == [([(8, 0, True)], 0, 0), ([], 1, 9), ([], 1, 10), ([], 1, 11)]
    assert a.preemptions == 0 and rig.c.block_seconds == 2 + 3 + 3 + 3


def test_a_request_queued_during_the_last_step_is_scheduled_when_the_instance_empties():
    rig = Rig(lookahead=True)
    a, b = req(0, 4, 1), req(1, 4, 1, t=0.5)
    rig.run(a, b)
    assert rig.steps == [([(4, 0, True)], 0, 0), ([(4, 0, True)], 0, 0)]
    assert times(a, b) == [(1.0, 1.0, 1), (2.0, 2.0, 1)]


def test_with_async_scheduling_a_request_queued_during_a_step_joins_the_one_after_next():
    eager, ahead = Rig(), Rig(lookahead=True)
    a, b = req(0, 4, 3), req(1, 4, 2, t=0.5)
    eager.run(a, b)
    assert eager.steps == [([(4, 0, True)], 0, 0), ([(4, 0, True)], 1, 5), ([], 2, 11)]
    assert times(a, b) == [(1.0, 3.0, 3), (2.0, 3.0, 2)]
    a, b = req(0, 4, 3), req(1, 4, 2, t=0.5)
    ahead.run(a, b)
    assert ahead.steps == [([(4, 0, True)], 0, 0), ([], 1, 5), ([(4, 0, True)], 1, 6), ([], 1, 5)]
    assert times(a, b) == [(1.0, 3.0, 3), (3.0, 4.0, 2)]
    assert (ahead.c.computing_until, ahead.c.itl) == (4.0, {1.0: 3})


def test_a_cached_prefix_is_claimed_and_not_computed_again():
    rig = Rig(prefix=True)
    a = req(0, 9, 2, tokens=range(9))
    b = req(1, 10, 2, t=5.0, tokens=[*range(8), 77, 78])  # shares a's two full blocks
    rig.run(a, b)
    assert rig.steps == [([(9, 0, True)], 0, 0), ([], 1, 10), ([(2, 8, True)], 0, 0), ([], 1, 11)]
    assert (a.cached_tokens, b.cached_tokens) == (0, 8)
    assert times(a, b) == [(1.0, 2.0, 2), (6.0, 7.0, 2)]
    assert rig.c.block_seconds == 3 + 3 + 3 + 3  # b holds a's two cached blocks and one of its own


def test_a_prompt_cached_whole_still_computes_its_last_token():
    rig = Rig(prefix=True)
    a, b = req(0, 9, 1, tokens=range(9)), req(1, 9, 1, t=3.0, tokens=range(9))
    rig.run(a, b)
    assert rig.steps == [([(9, 0, True)], 0, 0), ([(1, 8, True)], 0, 0)]  # two of its three blocks claimed
    assert b.cached_tokens == 8


def test_a_full_pool_preempts_the_last_admitted_which_recomputes_its_tokens_when_room_comes():
    """5 blocks of 4 tokens; two 6-token prompts each making 8 tokens. At step 3 both need a
    third block and one is free: the first takes it, the second (admitted last) is preempted
    with 3 tokens made, waits until the first ends, and recomputes 9 tokens."""
    rig = Rig(blocks=5)
    a, b = req(0, 6, 8), req(1, 6, 8)
    rig.run(a, b)
    assert rig.steps == [([(6, 0, True), (6, 0, True)], 0, 0), ([], 2, 14), ([], 2, 16),
                         *[([], 1, c) for c in range(9, 14)],
                         ([(9, 0, True)], 0, 0), *[([], 1, c) for c in range(10, 14)]]
    assert times(a, b) == [(1.0, 8.0, 8), (1.0, 13.0, 8)]
    assert (a.preemptions, b.preemptions, b.preempted_at, b.last_token) == (0, 1, None, 13.0)
    assert rig.counters["preemptions"] == 1
    assert rig.c.round_trips == [6.0]  # preempted as step 3 began, its next token after step 8
    assert rig.c.itl == {1.0: 13, 6.0: 1}
    assert (rig.c.busy_time, rig.c.slot_seconds, rig.c.block_seconds) == (13.0, 16.0, 44.0)


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_prefilling_request_short_of_a_block_preempts_itself_and_starts_again(lookahead):
    """4 blocks of 4, a budget of 4: a (4 tokens, making 8) decodes while b (12) prefills in
    chunks of 3. Each time b's next chunk needs a block and none is free, b, admitted last,
    is preempted, before it made a token: three times, then it runs once a has ended."""
    rig = Rig(blocks=4, budget=4, lookahead=lookahead)
    a, b = req(0, 4, 8), req(1, 12, 2)
    rig.run(a, b)
    assert rig.steps == [([(4, 0, True)], 0, 0), ([(3, 0, False)], 1, 5), ([(3, 3, False)], 1, 6), ([], 1, 7),
                         ([(3, 0, False)], 1, 8), ([], 1, 9), ([(3, 0, False)], 1, 10), ([], 1, 11),
                         ([(4, 0, False)], 0, 0), ([(4, 4, False)], 0, 0), ([(4, 8, True)], 0, 0), ([], 1, 13)]
    assert times(a, b) == [(1.0, 8.0, 8), (11.0, 12.0, 2)]
    assert (a.preemptions, b.preemptions, rig.counters["preemptions"]) == (0, 3, 3)
    assert rig.c.round_trips == [] and rig.c.itl == {1.0: 8}  # b had made no token when preempted
    assert (rig.c.block_seconds, rig.c.slot_seconds) == (33.0, 16.0)


def test_decoding_requests_spend_the_budget_first_and_a_prompt_takes_what_is_left():
    rig = Rig(budget=4, seqs=8)
    rs = [req(0, 1, 3), req(1, 1, 3), req(2, 1, 3), req(3, 6, 1)]
    rig.run(*rs)
    assert rig.steps == [([(1, 0, True), (1, 0, True), (1, 0, True), (1, 0, False)], 0, 0),
                         ([(1, 1, False)], 3, 6), ([(1, 2, False)], 3, 9), ([(3, 3, True)], 0, 0)]
    assert times(*rs) == [(1.0, 3.0, 3)] * 3 + [(4.0, 4.0, 1)]


def test_a_request_preempted_while_decoding_and_again_while_recomputing_counts_its_tokens_once():
    """3 blocks of 4, a budget of 2. b (2 tokens, making 4) is preempted at step 5 while
    decoding (3 tokens made), re-admitted for a 5-token recompute, and preempted again at step
    7 while recomputing, by a's growth; after a ends it recomputes in chunks and makes its last
    token. Its round trip counts from the later preemption, its gap from its last token."""
    rig = Rig(blocks=3, budget=2)
    a, b = req(0, 2, 8), req(1, 2, 4)
    rig.run(a, b)
    assert rig.steps == [([(2, 0, True)], 0, 0), ([(1, 0, False)], 1, 3), ([(1, 1, True)], 1, 4), ([], 2, 8),
                         ([], 2, 10), ([], 1, 7), ([(1, 0, False)], 1, 8), ([], 1, 9),
                         ([(2, 0, False)], 0, 0), ([(2, 2, False)], 0, 0), ([(1, 4, True)], 0, 0)]
    assert times(a, b) == [(1.0, 8.0, 8), (3.0, 11.0, 4)]
    assert (b.preemptions, rig.counters["preemptions"], b.last_token) == (2, 2, 11.0)
    assert rig.c.round_trips == [4.0] and rig.c.itl == {1.0: 9, 6.0: 1}
    assert (rig.c.block_seconds, rig.c.slot_seconds) == (23.0, 16.0)
