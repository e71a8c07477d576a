"""A P and a D engine in the test process, each with rank worker *processes* (ProcessDriver).

The engines are the demo's roles (fake compute, every byte checked); the rig runs their loop
on the real clock until every request ended, and lets a test act on the commands as they are
submitted (``on_submit``): stop a worker, kill it, drop a message.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstate import CacheSpec, DecodeLifecycle, Policy, PrefillLifecycle
from kvstate import commands as C
from kvstate.app._demoroles import DecodeRole, PrefillRole, make_plans
from kvstate.backends import MemoryStore, ReferenceBackend
from kvstate.distributed import ProcessDriver, SharedCaches

__all__ = ["ProcRig", "SPEC", "FAST", "alive"]

SPEC = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=2)
#: deadlines short enough for a test to wait them out
FAST = Policy(transfer_timeout=3.0, fence_grace=2.0, first_token_timeout=20.0, queue_timeout=20.0,
              swapped_timeout=20.0)


class _Side:
    def __init__(self, lifecycle: Any, driver: ProcessDriver, caches: SharedCaches) -> None:
        self.lc, self.driver, self.caches = lifecycle, driver, caches


class ProcRig:
    """P and D (TP 2), their caches in shared memory, two rank workers each, and a store: a
    FileStore in the directory ``store``, or a worker store configuration (Mooncake)."""

    def __init__(self, store: str | dict, blocks: int = 96, policy: Policy = FAST,
                 d_host_blocks: int = 0, restart: bool = True, dead_after_s: float = 1.0,
                 d_policy: Policy | None = None, spec: CacheSpec = SPEC, log_dir: Path | None = None) -> None:
        self.spec, self.blocks, self.log_dir = spec, blocks, log_dir
        self.store = store if isinstance(store, dict) else {"kind": "file", "root": store}
        self.sides: dict[str, _Side] = {}
        self.outcome: dict[str, tuple[str, int, str]] = {}  # state, code, reason
        self.ended_at: dict[str, float] = {}
        self.started_at: dict[str, float] = {}
        d_policy = d_policy or policy
        try:
            for name, cls, pol, host in (("P", PrefillLifecycle, policy, 0), ("D", DecodeLifecycle, d_policy,
                                                                                d_host_blocks)):
                caches = SharedCaches.create(spec, blocks)
                drv = ProcessDriver(spec, blocks, heartbeat_s=0.1, dead_after_s=dead_after_s, restart=restart,
                                    name=name)
                self.sides[name] = _Side(cls(spec, blocks, pol, host_blocks=host), drv, caches)
                for r in range(spec.tp_size):
                    drv.spawn(r, self.store, caches={"kind": "shm", "paths": caches.paths}, host_blocks=host,
                              log_path=None if log_dir is None else log_dir / f"{name}-rank{r}.log")
            for side in self.sides.values():
                side.driver.wait_ready(60)
        except BaseException:
            self.close()
            raise
        view = {n: ReferenceBackend(spec, blocks, MemoryStore(1 << 20), caches=s.caches.caches)
                for n, s in self.sides.items()}
        self.P, self.D = self.sides["P"].lc, self.sides["D"].lc
        self.p = PrefillRole(self.P, view["P"], 1, lambda rid, tok, code: self.d.first_token(rid, tok, code),
                             lambda rid: self.d.abort(rid))
        self.d = DecodeRole(self.D, view["D"], 2, lambda plan: self.p.admit(plan.rid, plan.prompt, plan.abort_at),
                            self.p.abort, self._ended)

    def _ended(self, rid: str, state: str, code: int, reason: str) -> None:
        self.outcome[rid] = (state, code, reason)
        self.ended_at[rid] = time.monotonic()

    def log_tails(self, lines: int = 6) -> str:
        """The last lines of every rank worker's log (with ``log_dir``), for a failure's message."""
        if self.log_dir is None:
            return ""
        out = []
        for f in sorted(self.log_dir.glob("*-rank*.log")):
            tail = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def driver(self, side: str) -> ProcessDriver:
        return self.sides[side].driver

    def run(self, requests: int = 16, seed: int = 0, timeout: float = 60.0, concurrency: int = 6,
            on_submit: Callable[[str, C.Command], None] | None = None, plans: list | None = None) -> dict[str, Any]:
        """Run the requests until each ended and every transfer retired (or ``timeout``)."""
        todo = list(reversed(plans if plans is not None else make_plans(requests, seed, self.spec.block_size)))
        n = len(todo)
        deadline = time.monotonic() + timeout
        while (todo or len(self.outcome) < n or self.P.pending_commands() or self.D.pending_commands()) \
                and time.monotonic() < deadline:
            while todo and self.d.try_take(todo[-1], concurrency):
                self.started_at[todo[-1].rid] = time.monotonic()
                todo.pop()
            self.turn(on_submit)
        return {"requests": n, "ended": len(self.outcome), "outcome": dict(self.outcome),
                "mismatched": self.p.mismatched + self.d.mismatched, "checked": self.p.checked + self.d.checked,
                "leaked": self.P.pool.num_used + self.D.pool.num_used,
                "pending": len(self.P.pending_commands()) + len(self.D.pending_commands()),
                "live": len(self.P.live_requests()) + len(self.D.live_requests())}

    def turn(self, on_submit: Callable[[str, C.Command], None] | None = None) -> None:
        for name, role in (("P", self.p), ("D", self.d)):
            side = self.sides[name]
            for cmd in side.lc.poll_commands():
                if on_submit is not None:
                    on_submit(name, cmd)
                if not side.driver.submit(cmd):
                    role.on_notice(cmd)
            for c in side.driver.poll(0.001):
                side.lc.complete(c)
            side.lc.tick()
        self.d.step()

    def worker_pids(self) -> list[int]:
        return [s.driver.child(r).pid for s in self.sides.values() for r in range(self.spec.tp_size)
                if s.driver.child(r) is not None]

    def close(self) -> None:
        for side in self.sides.values():
            side.driver.close()
            side.caches.close()


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False

