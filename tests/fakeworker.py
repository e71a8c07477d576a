"""A rank worker's three sockets and nothing else, for tests of the process driver.

:class:`FakeWorker` says hello on the driver's control channel, takes what the driver sends
on one lane, and answers, reports layer arrivals or says goodbye when the test says: the
driver's side runs for real, the worker's is the test's."""
from __future__ import annotations

import time
from typing import Any

import zmq

from kvstate import commands as C
from kvstate.distributed import ProcessDriver
from kvstate.distributed import _wire as wire

__all__ = ["FakeWorker", "answers", "write_command"]


class FakeWorker:
    """One rank's worker as the driver sees it: welcomed before the constructor returns."""

    def __init__(self, drv: ProcessDriver, rank: int = 0, inc: int = 5, num_states: int = 0) -> None:
        self.drv, self.rank, self.inc = drv, rank, inc
        self.ctx = zmq.Context()
        self.lane = self.ctx.socket(zmq.DEALER)
        self.lane.setsockopt(zmq.IDENTITY, f"r{rank}:0".encode())
        self.lane.setsockopt(zmq.LINGER, 0)
        self.lane.connect(drv.addresses[0])
        self.reply, self.control = (self.ctx.socket(zmq.PUSH) for _ in range(2))
        for sock, at in ((self.reply, drv.addresses[1]), (self.control, drv.addresses[2])):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(at)
        geometry = wire.geometry(drv.spec, drv.num_blocks, num_states)
        deadline = time.monotonic() + 10
        while not self.lane.poll(100):  # a hello may go before the lane's route is known: say it again
            assert time.monotonic() < deadline, "no welcome"
            self.control.send(wire.pack(wire.HELLO, rank, inc, 4242, drv.spec.tp_size, geometry, 1, drv.secret))
        assert wire.unpack(self.lane.recv()) == [wire.WELCOME, inc]
        while drv.control.ranks.incarnation(rank) != inc:  # the driver marks the rank up after its welcome
            assert time.monotonic() < deadline, "welcomed but never up"
            time.sleep(0.001)

    def take(self) -> list[Any]:
        assert self.lane.poll(5000), "nothing sent to the lane"
        return wire.unpack(self.lane.recv())

    def answer(self, cid: int, count: int, error: str | None = None, inc: int | None = None) -> None:
        self.reply.send(wire.pack(wire.DONE, self.rank, self.inc if inc is None else inc, cid, count, error))

    def arrived(self, cid: int, layers: int) -> None:
        self.control.send(wire.pack(wire.ARRIVED, self.rank, self.inc, cid, layers))

    def bye(self, reason: str) -> None:
        self.control.send(wire.pack(wire.BYE, self.rank, self.inc, reason))

    def close(self) -> None:
        for sock in (self.lane, self.reply, self.control):
            sock.close(0)
        self.ctx.term()

    def __enter__(self) -> FakeWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_command(cid: int, ranks: tuple[int, ...] = (0, 1), fence_s: float = 60.0) -> C.WriteBlocks:
    """A two-block write of request ``r1``, its deadline 30 s away, its fence ``fence_s``."""
    now = time.monotonic()
    return C.WriteBlocks("r1", cid, ranks, now + min(30.0, fence_s), ("k0", "k1"), (1, 2), fence=now + fence_s)


def answers(drv: ProcessDriver, n: int, timeout: float = 5.0) -> list[Any]:
    """Up to ``n`` completions, polled for at most ``timeout`` seconds."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += drv.poll(0.2)
    return got
