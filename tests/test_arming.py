"""Reads armed at reservation (kvstate.backends._arming), without a GPU.

D's lifecycle announces the read its first token will send (``ArmRead``), exactly as that
read goes out; the threaded and process drivers arm it on a backend that can, and let it go
when the request ends unread, when its read differs, or when they close; the wire's ``ARM``
and ``DISARM`` are checked item by item. The GPU's side (the pull fired) is in
``test_cuda_armed.py`` and ``test_direct_handoff_cuda.py``.
"""
from __future__ import annotations

import math
import time

import pytest
from rigs import small_spec

from kvstate import ConfigError, DecodeLifecycle, Policy, ProtocolError, ValidationError
from kvstate import commands as C
from kvstate.backends import MemoryStore, ReferenceBackend, StepDriver, ThreadedDriver
from kvstate.backends._arming import ArmedReads
from kvstate.distributed import _wire as wire

SPEC = small_spec(tp=2)
PROMPT = list(range(1, 19))  # 18 tokens: 5 blocks of 4 with the first token


def _decode(now, **kw):
    return DecodeLifecycle(SPEC, 64, Policy(first_token_timeout=30.0), clock=lambda: now[0], **kw)


def _arms(cmds):
    return [c for c in cmds if isinstance(c, C.ArmRead)]


# -- the lifecycle's announcement ---------------------------------------------------------------------
def test_reserve_announces_the_read_the_first_token_sends():
    now = [100.0]
    d = _decode(now, arm_reads=True)
    blocks = d.reserve("r", PROMPT)
    [arm] = _arms(d.poll_commands())
    assert arm.ranks == (0, 1) and arm.deadline == 130.0  # the first token's deadline
    assert arm.block_ids == blocks[:len(arm.keys)] and len(arm.keys) == 5
    now[0] = 101.0
    d.deliver_first_token("r", 7)
    [read] = [c for c in d.poll_commands() if isinstance(c, C.ReadBlocks)]
    assert (read.keys, read.block_ids) == (arm.keys, arm.block_ids)


def test_the_announcement_leaves_out_the_blocks_the_prefix_cache_holds():
    now = [0.0]
    d = _decode(now, arm_reads=True, prefix_cache=True)
    d.reserve("a", PROMPT)
    d.deliver_first_token("a", 7)
    read = next(c for c in d.poll_commands() if isinstance(c, C.ReadBlocks))
    d.complete(_whole(read, 0))
    d.complete(_whole(read, 1))
    d.finish("a")
    d.poll_commands()
    d.reserve("b", PROMPT + [50, 51, 52, 53])  # its first four blocks are a's, on the GPU
    [arm] = _arms(d.poll_commands())
    d.deliver_first_token("b", 9)
    [read] = [c for c in d.poll_commands() if isinstance(c, C.ReadBlocks)]
    assert d.counters["gpu_read_blocks"] == 4 and len(arm.keys) == 2
    assert (read.keys, read.block_ids) == (arm.keys, arm.block_ids)


def _whole(cmd, rank):
    from kvstate.events import Completion
    return Completion(cmd.command_id, rank, len(cmd.keys))


@pytest.mark.parametrize("kw", [{}, {"arm_reads": False}, {"arm_reads": True, "layerwise": True}])
def test_nothing_is_announced_unless_asked_or_for_a_layer_wise_read(kw):
    d = _decode([0.0], **kw)
    d.reserve("r", PROMPT)
    assert _arms(d.poll_commands()) == []


def test_arm_reads_must_be_a_bool():
    with pytest.raises(ConfigError, match="arm_reads must be True or False"):
        _decode([0.0], arm_reads=1)


# -- the threaded driver ----------------------------------------------------------------------------------
class _Arming(ReferenceBackend):
    """A reference backend that says it armed (or not: ``can``) and records both calls."""

    def __init__(self, can=True):
        super().__init__(SPEC, 64, MemoryStore(1 << 20))
        self.can, self.calls = can, []

    def arm_pull(self, rank, keys, block_ids, timeout=60.0):
        self.calls.append(("arm", rank, tuple(keys), tuple(block_ids), timeout))
        return self.can

    def disarm_pull(self, rank, keys):
        self.calls.append(("disarm", rank, tuple(keys)))
        return True


def _arm(rid="r", keys=("a", "b"), blocks=(3, 4), deadline=None, ranks=(0, 1)):
    return C.ArmRead(rid, ranks, time.monotonic() + 20 if deadline is None else deadline, keys, blocks)


def _read(arm, cid=1, keys=None, blocks=None):
    return C.ReadBlocks(arm.request_id, cid, arm.ranks, time.monotonic() + 10, keys or arm.keys,
                        blocks or arm.block_ids)


def _run(backend, cmds):
    with ThreadedDriver(backend, workers=1) as drv:
        notices = drv.submit_all(cmds)
        end = time.monotonic() + 10
        while drv.inflight and time.monotonic() < end:
            drv.poll(0.05)
        counts = drv.armed_reads()
    return notices, counts


def test_the_threaded_driver_arms_each_rank_until_the_deadline_and_a_matching_read_fires_it():
    be, arm = _Arming(), _arm()
    notices, counts = _run(be, [arm, _read(arm)])
    assert notices == [] and counts == {"armed": 1, "matched": 1, "let_go": 0}
    assert [c[:4] for c in be.calls] == [("arm", 0, ("a", "b"), (3, 4)), ("arm", 1, ("a", "b"), (3, 4))]
    assert all(19 < c[4] <= 20 for c in be.calls)  # seconds left to the deadline


def test_a_read_of_other_blocks_lets_the_armed_one_go_first():
    be, arm = _Arming(), _arm()
    _, counts = _run(be, [arm, _read(arm, blocks=(5, 6))])
    assert [c[0] for c in be.calls] == ["arm", "arm", "disarm", "disarm"]
    assert counts == {"armed": 1, "matched": 0, "let_go": 1}


def test_a_request_that_ends_unread_lets_its_armed_read_go_and_its_end_still_reaches_the_caller():
    be, arm = _Arming(), _arm()
    ended = C.RequestEnded("r", "failed", 504, (3, 4), "first_token_timeout")
    notices, _ = _run(be, [arm, C.SwapIn("r", 1, (0, 1), time.monotonic() + 5, (), ()), ended])
    assert notices == [ended]
    assert be.calls[2:] == [("disarm", 0, ("a", "b")), ("disarm", 1, ("a", "b"))]


def test_closing_lets_every_armed_read_go():
    be = _Arming()
    _run(be, [_arm("x"), _arm("y", keys=("c",), blocks=(9,))])
    assert sorted(c for c in be.calls if c[0] == "disarm") == [
        ("disarm", 0, ("a", "b")), ("disarm", 0, ("c",)), ("disarm", 1, ("a", "b")), ("disarm", 1, ("c",))]


def test_a_backend_that_cannot_arm_is_asked_once_and_never_told_to_let_go():
    be = _Arming(can=False)
    arm = _arm()
    _, counts = _run(be, [arm, _read(arm, blocks=(5, 6)), C.RequestEnded("r", "done", 200)])
    assert [c[0] for c in be.calls] == ["arm", "arm"] and counts["armed"] == 0


def test_a_request_armed_again_lets_the_older_arm_go_first():
    be = _Arming()
    _, counts = _run(be, [_arm(), _arm(keys=("c",), blocks=(9,))])
    assert [c[:3] for c in be.calls] == [("arm", 0, ("a", "b")), ("arm", 1, ("a", "b")), ("disarm", 0, ("a", "b")),
                                         ("disarm", 1, ("a", "b")), ("arm", 0, ("c",)), ("arm", 1, ("c",)),
                                         ("disarm", 0, ("c",)), ("disarm", 1, ("c",))]  # the last, at close
    assert counts == {"armed": 2, "matched": 0, "let_go": 1}  # counted before the close


def test_an_announcement_already_late_arms_nothing():
    be = _Arming()
    _run(be, [_arm(deadline=time.monotonic() - 1)])
    assert be.calls == []


@pytest.mark.parametrize("arm, needle", [
    (_arm(ranks=(2,)), "names ranks"),
    (_arm(ranks=()), "names ranks"),
    (_arm(blocks=(3,)), "as many block ids as keys"),
    (_arm(keys=(), blocks=()), "as many block ids as keys"),
    (_arm(keys=["a", "b"]), "as tuples"),
])
def test_a_bad_announcement_is_refused_naming_its_request_and_arms_nothing(arm, needle):
    be = _Arming()
    with ThreadedDriver(be, workers=1) as drv:
        with pytest.raises(ValidationError, match=needle) as e:
            drv.submit(arm)
        assert "'r'" in str(e.value) and drv.armed_reads()["armed"] == 0
    assert be.calls == []


def test_the_step_driver_takes_an_announcement_and_arms_nothing():
    be = _Arming()
    drv = StepDriver(_decode([0.0]), be)
    assert drv.submit(_arm()) is True and be.calls == [] and drv.pending == {}


def test_a_swap_in_keeps_the_note_and_the_read_after_it_decides():
    armed, arm = ArmedReads(), _arm()
    armed.note(arm, (0,))
    swap = C.SwapIn("r", 1, (0,), 1.0, ("a",), (3,), host_slots=(0,))
    assert armed.read(swap) is None and len(armed) == 1
    assert armed.read(_read(arm, keys=("b",), blocks=(4,))).keys == ("a", "b") and len(armed) == 0
    assert armed.ended("r") is None and armed.counts == {"armed": 1, "matched": 0, "let_go": 1}


# -- the wire ---------------------------------------------------------------------------------------------
def test_arm_and_disarm_cross_the_wire_for_the_receiving_rank_alone():
    arm = _arm(deadline=123.5)
    got = wire.arm_of(wire.unpack(wire.arm_message(arm, 77)), 1)
    assert got == C.ArmRead("r", (1,), 123.5, ("a", "b"), (3, 4))
    assert wire.disarm_of(wire.unpack(wire.disarm_message(("a", "b"), 77))) == ("a", "b")


@pytest.mark.parametrize("items, needle", [
    ([wire.ARM, 1, "r", ["a"], [3]], "5 items after its type"),
    ([wire.ARM, 1, "", ["a"], [3], 1.0], "request id"),
    ([wire.ARM, 1, "r", "a", [3], 1.0], "keys must be a list"),
    ([wire.ARM, 1, "r", ["a", 2], [3, 4], 1.0], "a key"),
    ([wire.ARM, 1, "r", ["a"], [3, 4], 1.0], "do not fit a read"),
    ([wire.ARM, 1, "r", [], [], 1.0], "do not fit a read"),
    ([wire.ARM, 1, "r", ["a"], [-1], 1.0], "block ids"),
    ([wire.ARM, 1, "r", ["a"], [3], math.nan], "deadline"),
    ([wire.DISARM, 1, ["a", None]], "a key"),
    ([wire.DISARM, 1], "2 items after its type"),
])
def test_a_bad_arm_or_disarm_message_is_refused(items, needle):
    with pytest.raises(ProtocolError, match=needle):
        (wire.arm_of(items, 0) if items[0] == wire.ARM else wire.disarm_of(items))
