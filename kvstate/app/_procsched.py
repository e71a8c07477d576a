"""A scheduler process of ``kvstate demo --processes``: P's or D's engine with its rank workers.

``python -m kvstate.app._procsched CONFIG_JSON`` (a :class:`~kvstate.app._procdemo.SchedulerConfig`)
runs one role: it creates its caches (as a model runner does: numpy caches in shared memory,
or with ``backend`` ``cuda`` GPU caches on its ``device`` shared through CUDA IPC), starts one
rank worker per TP rank attached to them (:class:`~kvstate.distributed.ProcessDriver`), and
loops: messages from its peers, commands out to its workers, answers in, deadlines. On
``stop`` it lets its last transfers answer (at most 30 s), reports its figures to the router
and exits; it exits at once when its parent (the router) is gone.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import deque
from typing import Any

from .._decode import DecodeLifecycle
from .._errors import KVStateError
from .._policy import Policy
from .._prefill import PrefillLifecycle
from .._spec import CacheSpec
from ..backends import MemoryStore, ReferenceBackend
from ..distributed import ProcessDriver, SharedCaches
from ..distributed._pdlink import Link
from ..distributed._supervise import die_with_parent, parent_alive
from ._demoroles import DecodeRole, Plan, PrefillRole
from ._procdemo import DEMO_SCHEMAS, SchedulerConfig

__all__ = ["Scheduler", "RankViews", "main"]


class Scheduler:
    """One role's engine loop over its rank workers and its link."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.spec = CacheSpec.from_dict(cfg.spec)
        # the engine's own view of its caches: it "computes" into them and checks what arrived
        self.view, self.worker_caches, self.worker_kw = self._caches(cfg)
        self.driver = ProcessDriver(self.spec, cfg.blocks, heartbeat_s=cfg.heartbeat_s, dead_after_s=cfg.dead_after_s,
                                    name=cfg.role)
        self.link = Link(cfg.addresses[cfg.role], DEMO_SCHEMAS)
        for peer in ("router", "prefill", "decode"):
            if peer != cfg.role:
                self.link.connect(peer, cfg.addresses[peer])
        view = self.view
        self.role: Any
        self.handoff, self.board = cfg.extra.get("handoff", "store"), cfg.extra.get("board", "")
        if cfg.role == "prefill":
            self.lc: Any = PrefillLifecycle(self.spec, cfg.blocks, Policy(), handoff=self.handoff)
            self.role = PrefillRole(self.lc, view, cfg.seed, self._first_token, lambda rid: self._send("decode",
                                                                                                        "abort", rid))
        else:
            self.lc = DecodeLifecycle(self.spec, cfg.blocks, Policy(), arm_reads=bool(cfg.extra.get("arm_reads")))
            self.role = DecodeRole(self.lc, view, cfg.seed, self._admit,
                                   lambda rid: self._send("prefill", "abort", rid),
                                   lambda rid, state, code, why: self._send("router", "result", rid, state, code, why))
        self.queued: deque[Plan] = deque()  # D: requests waiting for room

    def _caches(self, cfg: SchedulerConfig) -> tuple[Any, dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
        """This engine's caches, as a model runner makes them, and what each rank's worker
        attaches with (rank by rank): numpy caches in shared-memory files, or (``backend``
        ``cuda``) GPU caches on its ``device`` (one GPU, or a list of one a rank) shared
        through CUDA IPC; the view is a backend over them."""
        ranks = range(self.spec.tp_size)
        if cfg.extra.get("backend", "reference") != "cuda":
            shared = SharedCaches.create(self.spec, cfg.blocks)
            self._release: Any = shared.close
            host = ReferenceBackend(self.spec, cfg.blocks, MemoryStore(1 << 20), caches=shared.caches)
            return host, {r: {"kind": "shm", "paths": shared.paths} for r in ranks}, {r: {} for r in ranks}
        from ..backends._cudaipc import share_caches

        device = cfg.extra.get("device", -1)
        if device == -1:  # P on GPU 0, D on GPU 1 where there is one
            from ..kernels._cuda_launch import load_cupy

            device = int(cfg.role == "decode" and load_cupy().cuda.runtime.getDeviceCount() > 1)
        gpus = [int(g) for g in device] if isinstance(device, list) else [int(device)] * self.spec.tp_size
        views = RankViews(self.spec, cfg.blocks, gpus)
        self._release = views.close
        descs = {r: share_caches({r: {k: list(views.caches(r, k).views) for k in self.spec.kinds}}, gpus[r])
                 for r in ranks}
        return views, descs, {r: {"backend": "cuda", "device": gpus[r]} for r in ranks}

    def _send(self, peer: str, kind: str, *items: Any) -> None:
        self.link.send(peer, kind, *items)

    def _first_token(self, rid: str, token: Any, code: int) -> None:
        self._send("decode", "first_token", rid, token, code)

    def _admit(self, plan: Plan) -> None:
        self._send("prefill", "admit", plan.rid, plan.prompt, plan.abort_at)

    def start(self) -> None:
        board = self.board if self.handoff != "store" else ""
        boards = {"lends": board} if self.cfg.role == "prefill" else {"pulls": board}
        for r in range(self.spec.tp_size):
            self.driver.spawn(r, self.cfg.store, caches=self.worker_caches[r], **self.worker_kw[r], **boards)
        self.driver.wait_ready(60)
        pids = [self.driver.child(r).pid for r in range(self.spec.tp_size)]  # type: ignore[union-attr]
        self._send("router", "ready", self.cfg.role, os.getpid(), pids)

    # -- the loop -----------------------------------------------------------------------------
    def serve(self) -> int:
        """Serve until ``stop`` (0) or the parent's death (3)."""
        while True:
            if self.cfg.parent_pid and not parent_alive(self.cfg.parent_pid):
                return 3
            for kind, items in self.link.receive(0.0005):
                if kind == "stop":
                    self._drain(time.monotonic() + 30)
                    self._send("router", "report", self.cfg.role, self.figures())
                    return 0
                try:
                    self._dispatch(kind, items)
                except KVStateError:
                    self.link.counters["bad_messages"] += 1  # e.g. tokens that are not token ids
            self.turn(0.0005)

    def _dispatch(self, kind: str, items: list[Any]) -> None:
        if kind == "submit":
            self.queued.append(Plan.from_wire(items))
        elif kind == "admit":
            self.role.admit(items[0], items[1], items[2])
        elif kind == "first_token":
            self.role.first_token(items[0], items[1], items[2])
        elif kind == "abort":
            self.role.abort(items[0])

    def turn(self, wait: float) -> None:
        """One turn of the engine: admit what fits, commands out, answers in, a step, deadlines."""
        while self.queued and self.role.try_take(self.queued[0], self.cfg.concurrency):
            self.queued.popleft()
        for cmd in self.lc.poll_commands():
            if not self.driver.submit(cmd):
                self.role.on_notice(cmd)
        for c in self.driver.poll(wait):
            self.lc.complete(c)
        if self.cfg.role == "decode":
            self.role.step()
        self.lc.tick()

    def _drain(self, deadline: float) -> None:
        """Let the last transfers answer (or their fences pass), and a heartbeat carry the
        workers' last byte counts, before reporting."""
        while (self.lc.live_requests() or self.lc.pending_commands()) and time.monotonic() < deadline:
            self.turn(0.005)
        time.sleep(2.5 * self.cfg.heartbeat_s)

    def figures(self) -> dict[str, Any]:
        notices = self.driver.notices()
        faults = self.driver.store_faults()  # what the rank workers' reads and writes met
        return {"store_broken": faults["broken"], "store_short": faults["short"], "store_failed": faults["failed"],
                "expired_transfers": self.lc.counters["expired"], "leaked_blocks": self.lc.pool.num_used,
                "pending_commands": len(self.lc.pending_commands()),
                "live_requests": len(self.lc.live_requests()), "bytes_moved": self.driver.bytes_moved(),
                "blocks_checked": self.role.checked, "blocks_mismatched": self.role.mismatched,
                "preemptions": getattr(self.role, "preemptions", 0),
                "prefix_blocks_read": getattr(self.role, "prefix_blocks_read", 0),
                "rank_restarts": self.driver.counters["restarts"], "lost_answers": self.driver.counters["lost"],
                "rank_notices": len(notices), "link": dict(self.link.counters), "driver": dict(self.driver.counters),
                "lends_pulled": self.lc.counters.get("lends_pulled", 0),
                "lends_unpulled": self.lc.counters.get("lends_unpulled", 0),
                **self._armed_figures()}

    def _armed_figures(self) -> dict[str, int]:
        """Reads announced to the rank workers to arm, and those their backends armed and fired."""
        armed = self.driver.armed_reads()
        return {"reads_announced": armed["armed"], "ranks_armed": armed["ranks_armed"],
                "ranks_fired": armed["ranks_fired"]}

    def close(self) -> None:
        for close in (self.driver.close, self.link.close, self._release):
            try:
                close()
            except Exception as e:  # noqa: BLE001 - every resource gets its turn
                print(f"kvstate demo {self.cfg.role}: while closing: {e}", file=sys.stderr)


class RankViews:
    """An engine's GPU caches as one view, each TP rank on its GPU (``gpus[rank]``): a
    :class:`~kvstate.backends.CudaBackend` a GPU holding the ranks placed there, each call
    answered by the rank's. This is what the roles fill and check; the rank workers move
    the bytes."""

    def __init__(self, spec: CacheSpec, blocks: int, gpus: list[int]) -> None:
        from ..backends._cuda import CudaBackend

        self.spec = spec
        self._of: dict[int, Any] = {}
        self._parts: list[Any] = []
        try:
            for gpu in dict.fromkeys(gpus):
                ranks = [r for r, g in enumerate(gpus) if g == gpu]
                part = CudaBackend(spec, blocks, MemoryStore(1 << 20), device=gpu, ranks=ranks, staging_bytes=1 << 20)
                self._parts.append(part)
                self._of.update(dict.fromkeys(ranks, part))
        except BaseException:
            self.close()
            raise

    def caches(self, rank: int, kind: str) -> Any:
        return self._of[rank].caches(rank, kind)

    def fill_block(self, rank: int, *args: Any, **kw: Any) -> Any:
        return self._of[rank].fill_block(rank, *args, **kw)

    def block_bytes(self, rank: int, *args: Any, **kw: Any) -> Any:
        return self._of[rank].block_bytes(rank, *args, **kw)

    def close(self) -> None:
        """Close every rank's backend (each from any thread, on any device)."""
        for part in self._parts:
            part.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cfg = SchedulerConfig(**json.loads(args[0]))
    die_with_parent(cfg.parent_pid)
    signal.signal(signal.SIGTERM, _terminate)  # a stop from the router: close everything on the way out
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the router's: it stops this process, quietly
    sched = Scheduler(cfg)
    try:
        sched.start()
        return sched.serve()
    finally:
        sched.close()


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":  # pragma: no cover - a child process's entry
    sys.exit(main())
