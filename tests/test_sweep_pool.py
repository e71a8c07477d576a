"""A sweep's jobs on local processes (kvstate.sim._sweep): every result comes back under its
index, and the pool's workers end with the pool whatever signal handlers the host program set."""
from __future__ import annotations

import signal
import sys

import pytest

from kvstate.sim._sweep import run_all

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _signals(job: int) -> tuple[int, bool, bool, bool]:
    """In a worker: the job back, whether SIGTERM kills it and Ctrl-C is ignored there, and
    whether neither is blocked any more (a worker is born with both blocked)."""
    return job * 10, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, \
        signal.getsignal(signal.SIGINT) is signal.SIG_IGN, \
        not {signal.SIGTERM, signal.SIGINT} & signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_workers_die_of_sigterm_though_the_host_program_handles_it():
    """``Pool.terminate`` ends its workers with SIGTERM, then joins them with no timeout: a
    handler inherited from the host program (Ray's driver sets one) that returns would leave a
    worker waiting on the pool's queue, and the sweep hung at its end."""
    def own(*_):
        return None
    saved = signal.signal(signal.SIGTERM, own)
    try:
        got = dict(run_all(_signals, [0, 1, 2, 3], workers=2))
        assert signal.getsignal(signal.SIGTERM) is own  # the host's handler, untouched here
    finally:
        signal.signal(signal.SIGTERM, saved)
    assert got == {i: (i * 10, True, True, True) for i in range(4)}


@pytest.mark.skipif(sys.platform == "darwin", reason="the slow start is patched into forked workers")
def test_a_worker_still_starting_when_the_pool_ends_dies_of_sigterm(monkeypatch):
    """A short sweep can end while a worker is still starting: ``Pool.terminate``'s SIGTERM then
    reaches it before its initializer set SIGTERM's default, and the host's handler (inherited)
    used to swallow it; the worker went on to wait on the queue and the pool's join hung. Born
    with the signal blocked, the worker takes it once its initializer ran, and dies of it."""
    import multiprocessing
    import threading
    import time

    from kvstate.sim import _sweep

    first = multiprocessing.get_context("fork").Value("i", 0)
    initializer = _sweep._ignore_interrupts

    def slow_start():
        with first.get_lock():
            late, first.value = first.value == 0, 1
        if late:
            time.sleep(1.5)  # the other worker runs every job meanwhile, and the pool ends
        initializer()
    monkeypatch.setattr(_sweep, "_ignore_interrupts", slow_start)
    saved = signal.signal(signal.SIGTERM, lambda *_: None)
    done: list = []
    sweep = threading.Thread(target=lambda: done.append(dict(run_all(_signals, [0, 1, 2, 3], workers=2))),
                             daemon=True)
    try:
        sweep.start()
        sweep.join(20)
        hung = sweep.is_alive()
    finally:
        signal.signal(signal.SIGTERM, saved)
        for p in multiprocessing.active_children():  # a hung pool's worker: ended, so the test ends
            p.kill()
        sweep.join(10)
    assert not hung and done == [{i: (i * 10, True, True, True) for i in range(4)}]


def test_a_ray_connection_puts_back_the_signal_handlers_ray_set(monkeypatch):
    """Ray's ``init`` installs a SIGTERM handler in the calling process and its ``shutdown``
    leaves it there (with it, that process's next local pool could hang at its end)."""
    import types

    from kvstate.sim import _sweep

    def ray_handler(*_):
        return None
    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or signal.signal(signal.SIGTERM, ray_handler),
                                 shutdown=lambda: calls.append("shutdown"))
    monkeypatch.setitem(sys.modules, "ray", fake)
    before = signal.getsignal(signal.SIGTERM)
    with _sweep._connected("auto") as ray:
        assert ray is fake and signal.getsignal(signal.SIGTERM) is ray_handler
    assert signal.getsignal(signal.SIGTERM) is before and calls[-1] == "shutdown" and calls[0]["address"] == "auto"
