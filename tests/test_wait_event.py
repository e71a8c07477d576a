"""Host waits on CUDA events are bounded (kvstate.kernels._cuda_launch.wait_event).

The swapper's transfers, a rank worker's reads and a process driver's layer reports all wait
through it: an event that never completes (a hung GPU) fails the wait after its timeout
instead of keeping the thread forever. Runs without a GPU: the events are stand-ins with
CuPy's ``done`` and PyTorch's ``query()``.
"""
import time

import pytest

from kvstate._errors import DriverError, KVStateError
from kvstate.kernels._cuda_launch import wait_event


class CupyLike:
    def __init__(self, after: int) -> None:
        self.polls, self.after = 0, after

    @property
    def done(self) -> bool:
        self.polls += 1
        return self.polls > self.after


class TorchLike:
    def __init__(self, after: int) -> None:
        self.polls, self.after = 0, after

    def query(self) -> bool:
        self.polls += 1
        return self.polls > self.after


@pytest.mark.parametrize("kind", [CupyLike, TorchLike])
def test_an_event_that_completes_ends_the_wait(kind, monkeypatch):
    """An event that completes well into the sleeping phase ends the wait at its first look
    after that, however many looks it took."""
    ev = kind(after=10**12)
    sleeps: list[float] = []

    def sleep(s: float) -> None:  # the event completes at the tenth sleep past the spin phase
        if s:
            sleeps.append(s)
            if len(sleeps) == 10:
                ev.after = ev.polls
        real_sleep(s)
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", sleep)
    wait_event(ev, 10.0)
    assert len(sleeps) == 10 and ev.polls == ev.after + 1


@pytest.mark.parametrize("kind", [CupyLike, TorchLike])
def test_an_event_that_never_completes_fails_the_wait_after_its_timeout(kind):
    t = time.monotonic()
    with pytest.raises(DriverError, match="rank 1's read of command 7 did not finish within 0.2 s") as e:
        wait_event(kind(after=10**12), 0.2, "rank 1's read of command 7")
    assert 0.2 <= time.monotonic() - t < 5.0
    assert isinstance(e.value, KVStateError)


@pytest.mark.parametrize("kind", [CupyLike, TorchLike])
def test_a_wait_yields_between_looks_rather_than_sleeps_while_its_end_is_near(kind, monkeypatch):
    """Within the spin phase every pause is ``sleep(0)`` (the GIL and the core yielded, no
    timer slack added); past it the sleeps grow to 1 ms and no further."""
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    ev = kind(after=50)
    wait_event(ev, 10.0)
    assert set(slept) == {0} and len(slept) >= ev.polls - 3  # a pause between looks (hasattr looks at done too)
    clock = iter(range(10**6))
    monkeypatch.setattr(time, "monotonic", lambda: next(clock) * 1e-3)  # a millisecond a look
    slept.clear()
    wait_event(kind(after=40), 10.0)
    assert slept[:5] == [0, 0, 0, 0, 5e-5] and max(slept) == 1e-3
    assert slept[4:] == sorted(slept[4:])
