"""A sweep's jobs on local processes (kvstate.sim._sweep): every result comes back under its
index, and the pool's workers end with the pool whatever signal handlers the host program set."""
from __future__ import annotations

import signal
import sys

import pytest

from kvstate.sim._sweep import run_all

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _signals(job: int) -> tuple[int, bool, bool]:
    """In a worker: the job back, and whether SIGTERM kills it and Ctrl-C is ignored there."""
    return job * 10, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, \
        signal.getsignal(signal.SIGINT) is signal.SIG_IGN


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
    assert got == {i: (i * 10, True, True) for i in range(4)}


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
