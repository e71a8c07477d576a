"""Contracts of the lifecycles' public calls that the mutation run of the lifecycle modules
found unchecked (docs/benchmarks.md, "Mutation testing"): refusals that name their rule,
counters that add up, notices that name their request, and defaults that mean what they say."""
from __future__ import annotations

import numpy as np
import pytest
from lifecycle_helpers import TOKS, deliver, handoff, running
from rigs import Clock, Rig, small_spec

from kvstate import (
    ConfigError,
    DecodeLifecycle,
    InvalidTransitionError,
    KVStateError,
    OutOfBlocksError,
    Policy,
    PrefillLifecycle,
    ValidationError,
)
from kvstate import commands as C
from kvstate import events as E
from kvstate._keys import KeyCache, block_keys
from kvstate._machine import CompiledMachine
from kvstate._spec import LayerGroup

LIFECYCLES = (PrefillLifecycle, DecodeLifecycle)


@pytest.mark.parametrize("cls", LIFECYCLES)
@pytest.mark.parametrize("kwargs, message", [
    ({"host_blocks": -1}, r"^host_blocks must be an int >= 0 and <= 2147483648, got -1$"),
    ({"spec": "x"}, r"^spec must be a CacheSpec, got str$"),
    ({"policy": 1}, r"^policy must be a Policy, got int$"),
    ({"clock": 5}, r"^clock must be callable$"),
    ({"namespace": 1}, r"^namespace must be a str, got int$"),
    ({"key_cache": 1}, r"^key_cache must be a KeyCache, got int$"),
])
def test_a_bad_constructor_argument_is_refused_naming_it(cls, kwargs, message):
    args = {"spec": small_spec(1), "num_blocks": 8, "clock": Clock(), **kwargs}
    with pytest.raises(ValidationError, match=message):
        cls(**args)


@pytest.mark.parametrize("cls", LIFECYCLES)
def test_a_spec_with_state_groups_and_no_state_pages_is_refused_naming_the_lifecycle(cls):
    spec = small_spec(1, groups=(LayerGroup("full", (0,)), LayerGroup("state", (1,), state_bytes=64, checkpoint=4)))
    with pytest.raises(ConfigError, match=rf"^{cls.__name__}: the spec has state groups: give num_states >= 1"):
        cls(spec, 8, clock=Clock())


@pytest.mark.parametrize("cls", LIFECYCLES)
def test_defaults_mean_no_host_tier_no_prefix_cache_and_the_plain_key_namespace(cls):
    lc = cls(small_spec(1), 8, clock=Clock())
    assert lc.host is None and lc.prefix_cache is None
    (lc.admit if cls is PrefillLifecycle else lc.reserve)("r", TOKS)
    assert list(lc.keys_of("r")) == block_keys(TOKS, 4)


class RecordingMachine(CompiledMachine):
    """A compiled machine noting each trigger it fires: proves the class given was used."""

    fired: list[str] = []

    def fire(self, req, trigger, value=None):
        RecordingMachine.fired.append(trigger)
        return super().fire(req, trigger, value)


@pytest.mark.parametrize("cls", LIFECYCLES)
def test_namespace_key_cache_and_machine_class_reach_the_lifecycle(cls):
    kc, RecordingMachine.fired = KeyCache(), []
    lc = cls(small_spec(1), 8, clock=Clock(), namespace="ns", key_cache=kc, machine_cls=RecordingMachine)
    (lc.admit if cls is PrefillLifecycle else lc.reserve)("r", TOKS)
    assert list(lc.keys_of("r")) == block_keys(TOKS, 4, namespace="ns")
    assert kc.misses == 1  # the prompt was hashed through the cache given
    lc.abort("r")
    assert "abort" in RecordingMachine.fired


def test_swap_without_a_host_tier_is_refused_as_the_docs_word_it():
    with pytest.raises(ConfigError, match=r"^Policy\.preempt='swap' needs a host tier: give DecodeLifecycle "
                                          r"host_blocks > 0$"):
        DecodeLifecycle(small_spec(1), 8, Policy(preempt="swap"), clock=Clock())


def test_complete_takes_completions_and_numpy_command_ids_and_names_what_it_refuses():
    class Answer(E.Completion):
        """A driver's own completion class."""

    rig = Rig(tp=1)
    rig.D.reserve("r", TOKS)
    rig.P.admit("r", TOKS)
    [cmd] = rig.P.pending_commands()  # the prefix lookup
    with pytest.raises(ValidationError, match=r"^complete\(\) takes a Completion, got str$"):
        rig.P.complete("x")
    with pytest.raises(ValidationError, match=r"^completion: command id 'x' is not an int$"):
        rig.P.complete(E.Completion("x", 0, 0))
    assert rig.P.complete(Answer(np.int64(cmd.command_id), 0, 0)) is True
    assert rig.P.state_of("r") == "prefilling"


def test_lost_and_late_answers_are_counted_each():
    clock = Clock()
    p = PrefillLifecycle(small_spec(2), 16, Policy(transfer_timeout=1.0, fence_grace=1.0), clock=clock)
    for rid in ("a", "b"):
        p.admit(rid, TOKS)
    cmds = p.pending_commands()
    for c in cmds:  # rank 0's process died
        p.complete(E.Completion(c.command_id, 0, 0, lost=True))
    assert p.counters["lost_answers"] == 2
    clock.advance(1.5)
    p.tick()  # past their deadlines: resolved as failed, pinned until the fence
    for c in cmds:
        p.complete(E.Completion(c.command_id, 1, 0))
    assert p.counters["late_completions"] == 2


def test_tick_counts_every_timer_it_fires_and_cancels_by_request_and_command():
    clock = Clock()
    d = DecodeLifecycle(small_spec(1), 16, Policy(first_token_timeout=1.0), clock=clock)
    d.reserve("a", TOKS)
    d.reserve("b", TOKS)
    clock.advance(2.0)
    assert d.tick() == 2 and d.counters["timed_out"] == 2
    p = PrefillLifecycle(small_spec(1), 16, Policy(transfer_timeout=1.0, fence_grace=1.0), clock=clock)
    p.admit("a", TOKS)
    p.admit("b", TOKS)
    ids = {c.request_id: c.command_id for c in p.pending_commands()}
    p.poll_commands()
    clock.advance(1.5)
    assert p.tick() == 2 and p.counters["expired"] == 2
    cancels = {(c.request_id, c.command_id) for c in p.poll_commands() if isinstance(c, C.CancelCommand)}
    assert cancels == set(ids.items())
    clock.advance(1.0)
    assert p.tick() == 2 and p.counters["forced_releases"] == 2


def test_a_lost_answer_at_its_fence_releases_its_blocks_at_once():
    clock = Clock()
    p = PrefillLifecycle(small_spec(1), 16, Policy(transfer_timeout=1.0, fence_grace=1.0), clock=clock)
    p.admit("a", TOKS)
    [cmd] = p.pending_commands()
    p.abort("a")  # the blocks it reads into stay pinned
    assert p.pool.num_used == 2
    clock.now = cmd.fence
    p.complete(E.Completion(cmd.command_id, 0, 0, lost=True))
    assert p.pool.num_used == 0 and p.pinned_blocks() == {}


def test_a_request_that_fits_the_pool_exactly_is_reserved_and_one_that_does_not_is_named():
    d = DecodeLifecycle(small_spec(1), 3, clock=Clock())
    assert len(d.reserve("fits", list(range(11)))) == 3  # 11 tokens and the first: 3 blocks of 4
    d.abort("fits")
    with pytest.raises(ValidationError, match=r"^request 'big': 12 tokens need 4 blocks of 4, more than the "
                                              r"pool's 3$"):
        d.reserve("big", list(range(12)))


def test_a_finished_request_ends_with_200_and_an_aborted_one_with_its_code():
    rig = Rig(tp=1)
    running(rig)
    rig.D.finish("r")
    rig.D.reserve("q", TOKS)
    rig.D.abort("q")
    ended = {n.request_id: n for n in rig.D.poll_commands() + rig.notices(rig.dd) if isinstance(n, C.RequestEnded)}
    assert ended["r"].error_code == 200 and ended["r"].state == "done"
    assert ended["q"].error_code == 499 and ended["q"].state == "aborted"


def test_a_prompt_behind_one_that_ended_while_waiting_starts_when_blocks_free():
    p = PrefillLifecycle(small_spec(1), 3, Policy(read_prefix=False), clock=Clock())
    for rid in ("a", "b", "c"):
        p.admit(rid, TOKS)  # 3 blocks each: only "a" fits
    assert p.state_of("b") == p.state_of("c") == "waiting"
    p.abort("b")
    p.abort("a")
    assert p.state_of("c") != "waiting"


def test_prefill_events_name_their_request_and_a_late_one_its_event():
    p = PrefillLifecycle(small_spec(1), 8, clock=Clock())
    p.admit("r", TOKS)
    with pytest.raises(ValidationError, match=r"^request 'r': token -1 is not an int"):
        p.prefill_done("r", -1)
    with pytest.raises(ValidationError, match=r"^request 'q': token"):
        p.admit("q", [1, -2])
    p.abort("r")
    p.poll_commands()
    assert p.prefill_done("r", 5) is False
    [late] = [c for c in p.poll_commands() if isinstance(c, C.LateEvent)]
    assert (late.request_id, late.event) == ("r", "prefill_done")


def test_a_short_write_is_retried_from_where_it_stopped_as_often_as_the_policy_says():
    p = PrefillLifecycle(small_spec(1), 8, Policy(write_retries=2, read_prefix=False), clock=Clock())
    p.admit("r", list(range(12)))  # 3 full blocks
    p.prefill_done("r", 7)
    [w] = p.pending_commands()
    p.complete(E.Completion(w.command_id, 0, 1))  # one block of three stored
    [w2] = p.pending_commands()
    assert w2.keys == w.keys[1:] and w2.block_ids == w.block_ids[1:]
    p.complete(E.Completion(w2.command_id, 0, 0, error="store down"))
    [w3] = p.pending_commands()
    assert w3.keys == w.keys[1:]
    p.complete(E.Completion(w3.command_id, 0, 0, error="store down"))
    assert p.counters["retries"] == 2 and p.pending_commands() == []
    out = p.poll_commands()
    [first] = [c for c in out if isinstance(c, C.SendFirstToken)]
    [ended] = [c for c in out if isinstance(c, C.RequestEnded)]
    assert first.error_code == 503 and ended.reason == "write_failed"
    assert p.counters["failed"] == 1 and not p.is_live("r")


@pytest.mark.parametrize("code", [100, 599])
def test_every_http_status_is_taken_from_p_and_nothing_else(code):
    d = DecodeLifecycle(small_spec(1), 8, clock=Clock())
    d.reserve("r", TOKS)
    for bad in (99, 600):
        with pytest.raises(ValidationError, match=rf"error_code {bad} is not an HTTP status"):
            d.deliver_first_token("r", None, bad)
    assert d.deliver_first_token("r", None, code) is True
    assert not d.is_live("r")


def test_decode_calls_in_the_wrong_state_or_short_of_blocks_name_request_event_and_machine():
    rig = Rig(tp=1, blocks=6)
    running(rig)  # 3 blocks
    for call, event in ((rig.D.resume, "resume"), (lambda r: rig.D.append_tokens(r, [1]), "append_tokens")):
        rig.D.reserve("w", [1])
        with pytest.raises(InvalidTransitionError) as e:
            call("w")
        assert (e.value.request_id, e.value.state, e.value.event, e.value.machine) == (
            "w", "reserved", event, "decode")
        rig.D.abort("w")
    with pytest.raises(ValidationError, match=r"^request 'r': token"):
        rig.D.append_tokens("r", [-1])
    with pytest.raises(OutOfBlocksError, match=r"^request 'r': cannot grow by 4 blocks"):
        rig.D.append_tokens("r", list(range(16)))
    rig.D.preempt("r")
    rig.dd.run_until_idle()
    rig.D.reserve("hog", list(range(15)))  # 4 of the 6 blocks
    with pytest.raises(OutOfBlocksError, match=r"^request 'r': cannot resume with 3 blocks"):
        rig.D.resume("r")


def test_a_preempted_cache_is_written_under_its_prompt_and_decoded_tokens_keys():
    rig = Rig(tp=1)
    extra = {0: ["image-1"]}
    rig.D.reserve("r", TOKS, extra_keys=extra)
    rig.P.admit("r", TOKS, extra_keys=extra)
    rig.pd.run_until_idle()
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    rig.P.prefill_done("r", 7)
    rig.pd.run_until_idle()
    deliver(rig, rig.notices(rig.pd))
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running"
    rig.D.append_tokens("r", [8, 9])
    rig.D.preempt("r")
    [w] = [c for c in rig.D.poll_commands() if isinstance(c, C.WriteBlocks)]
    assert len(w.keys) == 3 and list(w.keys) == block_keys(TOKS + [7, 8], 4, extra_keys=extra)


def test_a_preempted_cache_is_hashed_through_the_key_cache():
    kc = KeyCache()
    rig = Rig(tp=1, key_cache=kc)
    running(rig)
    rig.D.append_tokens("r", [8, 9])
    misses = kc.misses
    rig.D.preempt("r")
    assert kc.misses == misses + 1


@pytest.mark.parametrize("policy", [Policy(transfer_timeout=10.0), Policy(preempt="swap", transfer_timeout=10.0)])
def test_a_preempted_request_stops_holding_decode_headroom_while_its_cache_goes_out(policy):
    rig = Rig(tp=1, blocks=4, policy=policy, host_blocks=8)
    running(rig)  # 3 blocks; the 4th is its headroom
    assert not rig.D.can_reserve(1)
    rig.D.preempt("r")
    assert any(isinstance(c, C.WriteBlocks | C.SwapOut) for c in rig.D.pending_commands())
    assert all(c.request_id == "r" for c in rig.D.pending_commands())
    assert rig.D.can_reserve(1)


def test_a_failed_write_back_is_retried_as_the_policy_says_and_counted_once_per_retry():
    rig = Rig(tp=1, policy=Policy(transfer_timeout=10.0, write_retries=1))
    running(rig)
    rig.D.preempt("r")
    for _ in range(2):
        [w] = rig.D.pending_commands()
        rig.D.complete(E.Completion(w.command_id, 0, 0, error="store down"))
    assert rig.D.counters["retries"] == 1 and rig.D.pending_commands() == []


def test_recompute_done_reports_that_it_was_taken():
    rig = Rig(tp=1, policy=Policy(transfer_timeout=10.0, preempt="recompute"))
    running(rig)
    rig.D.append_tokens("r", [8])  # the store no longer holds its whole cache
    rig.D.preempt("r")
    [free] = [c for c in rig.D.poll_commands() if isinstance(c, C.FreeBlocks)]
    assert free.request_id == "r"
    rig.D.resume("r")
    [rc] = [c for c in rig.D.poll_commands() if isinstance(c, C.Recompute)]
    assert rc.request_id == "r" and rig.D.recompute_done("r") is True
    assert rig.D.state_of("r") == "running"


def test_first_tokens_unknown_requests_and_cancels_name_their_request():
    rig = Rig(tp=1)
    rig.D.reserve("r", TOKS)
    with pytest.raises(ValidationError, match=r"^request 'r': token -1 is not an int"):
        rig.D.deliver_first_token("r", -1)
    with pytest.raises(KVStateError, match=r"^request 'nope' is unknown on the decode side$"):
        rig.D.state_of("nope")
    rig.D.deliver_first_token("r", 7)
    [read] = rig.D.pending_commands()
    assert read.request_id == "r"
    rig.D.abort("r")
    [cancel] = [c for c in rig.D.poll_commands() if isinstance(c, C.CancelCommand)]
    assert (cancel.request_id, cancel.command_id) == ("r", read.command_id)


def test_the_gpu_prefix_cache_keeps_decode_headroom_and_counts_every_hit():
    rig = Rig(tp=1, blocks=16, prefix_cache=True)
    for rid in ("a", "b", "c"):
        handoff(rig, rid)  # P's prefix cache keeps the prompt's 2 full blocks
        rig.P.poll_commands()
    assert rig.P.counters["gpu_prefix_blocks"] == 4  # "b" and "c" found both of "a"'s
    d = DecodeLifecycle(small_spec(1), 6, Policy(preempt="recompute"), clock=Clock(), prefix_cache=True)
    d.reserve("a", TOKS)
    d.deliver_first_token("a", 7)
    [read] = d.pending_commands()
    d.complete(E.Completion(read.command_id, 0, 3))
    assert d.state_of("a") == "running"  # 3 blocks, its headroom 1
    d.finish("a")  # its 2 full blocks stay cached, idle
    for rid in ("b", "c"):
        d.reserve(rid, TOKS[:8])  # 2 cached blocks and 1 new one each
    assert d.counters["gpu_read_blocks"] == 4
    d.deliver_first_token("b", 7)  # its prompt's blocks all came from the cache: nothing to read
    assert d.state_of("b") == "running"
    with pytest.raises(OutOfBlocksError, match=r"^request 'x': cannot reserve 2 blocks keeping 1 free"):
        d.reserve("x", [1, 2, 3, 4, 5])
    d.append_tokens("b", [8])
    d.preempt("b")  # publishes its full blocks: the first token's among them
    assert list(d.keys_of("b")) == block_keys(TOKS[:8] + [7], 4)
    d.abort("c")
    d.reserve("hog", list(range(19)))  # 5 of the 6 blocks
    with pytest.raises(OutOfBlocksError, match=r"^request 'b': cannot resume with 3 blocks: 1 are free$"):
        d.resume("b")


def test_ending_a_recomputing_request_cancels_no_other_requests_transfer():
    rig = Rig(tp=1, policy=Policy(transfer_timeout=10.0, preempt="recompute"))
    rig.D.reserve("a", TOKS)
    rig.D.deliver_first_token("a", 7)
    [read_a] = rig.D.pending_commands()  # the first command: id 1
    for rid in ("b", "c"):
        rig.D.reserve(rid, TOKS)
        rig.D.deliver_first_token(rid, 7)
        rig.D.complete(E.Completion(rig.D.pending_commands()[-1].command_id, 0, 3))
        rig.D.append_tokens(rid, [8])
        rig.D.preempt(rid)  # recompute: its blocks go at once
    rig.D.resume("c")  # a recompute, no transfer
    rig.D.poll_commands()
    rig.D.abort("b")
    rig.D.abort("c")
    assert not [c for c in rig.D.poll_commands() if isinstance(c, C.CancelCommand)]
    rig.D.complete(E.Completion(read_a.command_id, 0, 3))
    assert rig.D.state_of("a") == "running"
