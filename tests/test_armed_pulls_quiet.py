"""``ArmedPulls.quiet`` (kvstate.backends._cuda_armed) without a GPU: its bookkeeping alone.

Before a call that may wait for the whole device (mapping a lender's caches), every armed pull
is let go (its flag raised over its own scratch row), nothing is armed until the call returns,
and an arm already past its check is waited for first. The GPU's side (the pull then running
unarmed) is in ``test_cuda_armed.py``. The stream wait is stubbed: no CUDA driver is needed.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvstate.backends import _cuda_armed
from kvstate.backends._cuda_armed import Armed, ArmedPulls

SCRATCH = 0x5000


def _slot(rank: int, keys: tuple[str, ...], gen: int) -> Armed:
    """An armed slot as ``ArmedPulls`` keeps it: one kind of two layers, three blocks."""
    slot = Armed.__new__(Armed)
    slot.kinds, slot.layers, slot.size, slot.gen = 1, 2, 4, gen
    slot.host = np.full(2 + 2 * 2 + 3 * 4 + 1, 7, np.uint64)
    slot.host[0] = gen - 1  # the flag still down
    slot.dst, slot.rank, slot.keys = np.arange(3, dtype=np.int64), rank, keys
    slot.scratch = SimpleNamespace(data=SimpleNamespace(ptr=SCRATCH))
    return slot


@pytest.fixture
def pulls(monkeypatch):
    monkeypatch.setattr(_cuda_armed, "stream_wait_value", lambda: lambda stream, addr, value: True)
    p = ArmedPulls(cp=None)
    p._armed = {(0, ("a",)): _slot(0, ("a",), 5), (1, ("b",)): _slot(1, ("b",), 9)}
    return p


def test_quiet_lets_every_armed_pull_go_over_its_scratch_row_and_arms_nothing_meanwhile(pulls):
    slots = list(pulls._armed.values())
    with pulls.quiet():
        assert len(pulls) == 0 and pulls.counts["disarmed"] == 2
        for s in slots:
            assert s.host[0] == s.gen  # the flag up: the queued work runs
            assert (s.host[2:6] == SCRATCH).all() and (s.host[6:12] == 0).all()  # pointers, then ids
        assert pulls.arm(0, None, [], ("c",), np.arange(1), time.monotonic() + 5) is False
    assert pulls._quiet == 0 and pulls.counts["armed"] == 0


def test_quiet_waits_for_an_arm_past_its_check_then_lets_it_go_too(pulls):
    pulls._armed.clear()
    pulls._arming = 1  # an arm between its check and its entry in the table
    inside = threading.Event()

    def call():
        with pulls.quiet():
            inside.set()

    t = threading.Thread(target=call)
    t.start()
    assert not inside.wait(0.2)  # quiet waits for the arm in flight
    late = _slot(0, ("late",), 3)
    with pulls._cv:
        pulls._armed[(0, ("late",))] = late  # the arm finishes: its entry, then the count
        pulls._arming = 0
        pulls._cv.notify_all()
    t.join(5)
    assert inside.is_set() and late.host[0] == late.gen and len(pulls) == 0


def test_quiet_gives_up_waiting_for_a_stuck_arm_after_its_timeout(pulls):
    pulls._arming = 1
    t0 = time.monotonic()
    with pulls.quiet(timeout=0.1):
        assert len(pulls) == 0
    assert 0.1 <= time.monotonic() - t0 < 2
