"""The scheduler's side of an engine connector without an engine: kvstate's lifecycles over an
engine's blocks, answers given by hand (kvstate.integrations._handoff)."""
from __future__ import annotations

import pytest
from rigs import Clock

from kvstate import CacheSpec, ValidationError, rank_key
from kvstate._policy import Policy
from kvstate.backends._objects import MANIFEST_KIND
from kvstate.backends._stores import MemoryStore
from kvstate.events import Completion
from kvstate.integrations._handoff import Handoff

PROMPT = list(range(1, 42))  # 40 cached tokens: 3 blocks of 16, the last partial


def make(role: str = "both", tp: int = 2, **policy):
    spec = CacheSpec(num_layers=2, kv_heads=1, block_size=16, head_dim=8, tp_size=tp)
    clock = Clock()
    store = MemoryStore(1 << 20)
    h = Handoff(spec, 32, role, store, policy=Policy(**policy), namespace="m", clock=clock)
    return h, store, clock


def fill(h: Handoff, store: MemoryStore, ranks=(0, 1)) -> None:
    """Mark every block of PROMPT's cache stored on ``ranks`` (objects and manifests present)."""
    for key in h.cache_keys(PROMPT):
        for r in ranks:
            for kind in ("key", "value", MANIFEST_KIND):
                store.batch_put_from([rank_key(key, kind, r)], [b"x"])


def test_a_cache_loads_only_when_every_block_is_stored_on_every_rank():
    h, store, _ = make()
    assert h.lookup("a", PROMPT) == 0
    fill(h, store, ranks=(0,))
    assert h.lookup("a", PROMPT) == 0  # rank 1 lacks it
    fill(h, store, ranks=(1,))
    assert h.lookup("a", PROMPT) == len(PROMPT)
    assert make("producer")[0].lookup("a", PROMPT) == 0


def test_a_block_one_rank_could_not_read_rewinds_to_it_on_every_rank():
    h, store, _ = make()
    fill(h, store)
    h.load("a", PROMPT, [5, 6, 7])
    read = h.step().commands["load"]
    assert len(read) == 1 and read[0].block_ids == (5, 6, 7)
    cid = read[0].command_id
    h.completed("load", [Completion(cid, 0, 3), Completion(cid, 1, 1)])  # rank 1 read one block whole
    orders = h.step()
    assert orders.received == {"a"} and orders.invalid == {6, 7}
    assert h.counters["load_partial"] == 1
    assert h.step().received == set() and h.counters["loaded"] == 0  # named once, counted once
    assert not h.finished("a")  # running: the engine frees its own blocks
    assert h.live() == 0
    removed = h.take_events()
    assert [e.stored for e in removed] == [False] and len(removed[0].keys) == 2


def test_a_save_holds_the_engines_blocks_until_it_lands_and_says_so():
    h, store, _ = make(tp=1)
    assert h.save("a", PROMPT, [3, 4, 9, 11], first_token=7)  # 4 blocks held, 3 are the cache's
    write = h.step().commands["save"]
    assert write[0].block_ids == (3, 4, 9)
    h.completed("save", [Completion(write[0].command_id, 0, 3)])
    orders = h.step()
    assert orders.sent == {"a"} and h.counters["saved"] == 1
    stored = h.take_events()
    assert stored[0].stored and stored[0].token_ids == tuple(PROMPT[:-1])
    assert h.step().sent == set()  # named once


def test_an_unanswered_save_frees_nothing_before_its_fence_then_frees_everything():
    h, store, clock = make(tp=1, transfer_timeout=1.0, fence_grace=2.0, write_retries=0)
    h.save("a", PROMPT, [3, 4, 9], first_token=7)
    h.step()
    clock.advance(1.5)  # past the deadline: failed, but a stalled rank may still read the blocks
    assert h.step().sent == set() and h.counters["save_failed"] == 1
    clock.advance(2.0)  # past the fence
    assert h.step().sent == {"a"}
    assert h.live() == 0


def test_abort_while_loading_releases_only_once_the_read_answers():
    h, store, _ = make(tp=1)
    fill(h, store, ranks=(0,))
    h.load("a", PROMPT, [1, 2, 3])
    cid = h.step().commands["load"][0].command_id
    assert h.finished("a")  # the engine must keep the blocks
    assert h.step().received == set()
    h.completed("load", [Completion(cid, 0, 3)])
    orders = h.step()
    assert orders.received == {"a"} and orders.invalid == {1, 2, 3}
    assert h.counters["aborted"] == 1 and h.live() == 0


@pytest.mark.parametrize("call, rule", [
    (lambda h: h.load("a", PROMPT, [1]), "needs 3 blocks"),
    (lambda h: h.save("a", PROMPT, [1, 2], 5), "needs 3 blocks"),
    (lambda h: h.lookup("", PROMPT), "request id"),
    (lambda h: h.completed("load", ["x"]), "expected Completions"),
    (lambda h: h.completed("sideways", []), "side must be one of"),
])
def test_bad_input_is_refused_and_changes_nothing(call, rule):
    h, _, _ = make(tp=1)
    with pytest.raises(ValidationError, match=rule):
        call(h)
    assert h.live() == 0 and h.step().commands == {"save": [], "load": []}
    with pytest.raises(ValidationError, match="role must be one of"):
        Handoff(h.spec, 32, "relay", MemoryStore(1 << 10))


def _state(h: Handoff) -> tuple:
    """Everything a refused call must leave as it was."""
    return (h.live(), dict(h.counters), sorted(h._tracked), h.prefill.pool.num_free, h.decode.pool.num_free,
            len(h._events))


def test_bad_arguments_at_every_public_call_are_refused_and_change_nothing():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvstate import KVStateError

    h, store, _ = make(tp=1)
    fill(h, store, ranks=(0,))
    h.load("loading", PROMPT, [1, 2, 3])  # one request of each side live
    h.save("saving", PROMPT, [4, 5, 6], first_token=3)
    h.step()
    before = _state(h)
    bad_id = st.one_of(st.none(), st.just(""), st.integers(), st.just(["a"]))
    bad_prompt = st.one_of(st.none(), st.integers(), st.text(max_size=3), st.just([1, -2, 3]), st.just([1.5, 2]),
                           st.just([True, 2]), st.just([2**33, 1]))
    bad_blocks = st.one_of(st.none(), st.integers(), st.just("abc"), st.just([1, "x", 3]), st.just([1.0, 2.0, 3.0]),
                           st.just([1, 2]), st.just([1, 1, 1]), st.just([-1, 2, 3]), st.just([10**6, 2, 3]),
                           st.just([True, 2, 3]))
    bad_token = st.one_of(st.none(), st.just(-1), st.just(2**32), st.just(1.5), st.just("7"), st.just(True))
    bad_side = st.one_of(st.none(), st.just("saves"), st.integers())
    bad_answers = st.one_of(st.none(), st.integers(), st.just("x"),
                            st.just([Completion(1, 0, 1), "not an answer"]))
    calls = st.one_of(
        st.tuples(st.just("lookup"), bad_id, st.just(PROMPT)), st.tuples(st.just("lookup"), st.just("q"), bad_prompt),
        st.tuples(st.just("load"), bad_id, st.just(PROMPT), st.just([7, 8, 9])),
        st.tuples(st.just("load"), st.just("n"), bad_prompt, st.just([7, 8, 9])),
        st.tuples(st.just("load"), st.just("n"), st.just(PROMPT), bad_blocks),
        st.tuples(st.just("load"), st.just("loading"), st.just(PROMPT), st.just([7, 8, 9])),  # tracked already
        st.tuples(st.just("save"), st.just("s"), st.just(PROMPT), bad_blocks, st.just(3)),
        st.tuples(st.just("save"), st.just("s"), st.just(PROMPT), st.just([7, 8, 9]), bad_token),
        st.tuples(st.just("save"), st.just("s"), bad_prompt, st.just([7, 8, 9]), st.just(3)),
        st.tuples(st.just("finished"), bad_id), st.tuples(st.just("completed"), bad_side, st.just([])),
        st.tuples(st.just("completed"), st.just("save"), bad_answers))

    @settings(max_examples=150, deadline=None, database=None)
    @given(call=calls)
    def check(call):
        name, *args = call
        with pytest.raises(KVStateError):
            getattr(h, name)(*args)
        assert _state(h) == before, call

    check()
