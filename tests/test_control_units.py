"""The process driver's control side without processes: the restart back-off and the rank
report, every figure exact."""
from __future__ import annotations

import threading
import time

import pytest

from kvstate._errors import DriverError
from kvstate._spec import CacheSpec
from kvstate.distributed import ProcessDriver
from kvstate.distributed._control import RankControl, RestartBackoff
from kvstate.distributed._liveness import RankTable


@pytest.mark.parametrize("starts, delay", [(0, 0.25), (1, 0.25), (2, 0.5), (3, 1.0), (4, 2.0), (5, 4.0), (6, 5.0),
                                           (40, 5.0)])
def test_a_worker_that_never_says_hello_is_started_again_later_each_time_up_to_5_s(starts, delay):
    b = RestartBackoff()
    for i in range(starts):
        b.started(0, 100.0 + i)
    assert b.delay(0) == delay and b.delay(1) == 0.25
    last = 100.0 + max(starts - 1, 0) if starts else 0.0
    assert b.may_start(0, last + delay) and not b.may_start(0, last + delay - 1e-6)


def test_a_hello_ends_the_back_off_but_the_last_start_still_counts():
    b = RestartBackoff()
    for t in (10.0, 11.0, 13.0):
        b.started(3, t)
    assert b.delay(3) == 1.0
    b.hello(3)
    assert b.delay(3) == 0.25 and b.may_start(3, 13.25) and not b.may_start(3, 13.2)
    b.started(3, 20.0)
    assert b.delay(3) == 0.25  # one start since the hello
    assert b.may_start(7, 0.25) and not b.may_start(7, 0.2)  # never started: from time 0


def test_the_rank_report_names_up_and_down_ranks():
    ranks = RankTable(3)
    ranks.up(1, 5, 4242, 0.0, 1)
    ctl = RankControl(CacheSpec(2, 1, 4, 8), "g", heartbeat_s=0.1, dead_after_s=1.0, restart=False, ranks=ranks,
                      lock=threading.Lock(), counters={}, send=lambda *a: True, on_down=lambda *a: None,
                      on_up=lambda r: None, on_arrived=lambda *a: None, name="test")
    assert ctl.info() == {"up": [1], "down": [0, 2], "pids": {}}  # it started no worker itself


def test_a_hello_from_a_rank_never_started_here_waits_from_time_0():
    b = RestartBackoff()
    b.hello(2)  # a worker the engine started itself
    assert b.delay(2) == 0.25 and b.may_start(2, 0.25) and not b.may_start(2, 0.24)


def test_waiting_for_ranks_that_never_say_hello_names_them_at_the_deadline():
    with ProcessDriver(CacheSpec(2, 1, 4, 8, tp_size=2), 4) as drv:
        t = time.monotonic()
        with pytest.raises(DriverError) as e:
            drv.wait_ready(0.2)
        assert 0.2 <= time.monotonic() - t < 1.0  # it looks often, not once a second
    assert str(e.value) == "ProcessDriver kvstate: ranks [0, 1] did not say hello within 0.2 s"
