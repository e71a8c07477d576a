"""``kvstate demo --processes``: P and D as separate instances, each a scheduler process plus
``tp`` rank-worker processes, joined by a store that works across processes (by default a
shared-memory arena this process makes) and by messages.

Processes and messages (every channel ZeroMQ; :mod:`~kvstate.distributed._pdlink`)::

    router (this process) --submit--> D scheduler --admit--> P scheduler
                          <--result--              <--first_token, abort-->
    each scheduler: a ProcessDriver --commands--> its rank workers (one per TP rank), which
                    attach to the scheduler's caches (shared memory) and reach the store

The router hands each request to D, which reserves blocks and asks P to admit it (as a
FastDeploy D reserves when P asks for blocks); P computes, writes the cache to the store
through its rank workers, then sends the first token to D; D reads it through its own, checks
every byte, decodes and reports the result. The engines are :mod:`~kvstate.app._demoroles`'
roles, as in the one-process demo. Every process watches its parent, so none outlives the
router; the router stops the schedulers when every request has a result, or when one of them
died (the requests it held are then counted ``unfinished``).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .._errors import ConfigError, DriverError
from ..backends._shm import shm_directory
from ..distributed._supervise import remove_orphans
from ._demo import DemoConfig, Outcome, arena_store, summary
from ._demoroles import make_plans

__all__ = ["SchedulerConfig", "run_processes", "DEMO_SCHEMAS"]

_ROLES = ("prefill", "decode")
_LIST, _INT, _STR, _OPT_INT, _OPT_STR = (list,), (int,), (str,), (int, type(None)), (str, type(None))
#: the demo's own messages, beside the P/D kinds every link knows
DEMO_SCHEMAS = {
    "submit": (("request_id", _STR), ("prompt", _LIST), ("output_len", _INT), ("preempt_at", _OPT_INT),
               ("abort_at", _OPT_STR)),
    "admit": (("request_id", _STR), ("prompt", _LIST), ("abort_at", _OPT_STR)),
    "result": (("request_id", _STR), ("state", _STR), ("error_code", _INT), ("reason", _STR)),
    "ready": (("role", _STR), ("pid", _INT), ("workers", _LIST)),
    "stop": (),
    "report": (("role", _STR), ("figures", (dict,))),
}


@dataclass
class SchedulerConfig:
    """What a scheduler process needs (JSON: it crosses a process boundary)."""

    role: str
    spec: dict[str, Any]
    blocks: int
    store: dict[str, Any]
    addresses: dict[str, str]  #: router, prefill, decode mailboxes
    seed: int = 0
    concurrency: int = 8
    parent_pid: int = 0
    heartbeat_s: float = 0.2
    dead_after_s: float = 2.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _spec(cfg: DemoConfig) -> dict[str, Any]:
    """The demo's cache geometry as CacheSpec's fields (JSON: the schedulers get it)."""
    return {"num_layers": cfg.layers, "kv_heads": cfg.kv_heads, "block_size": cfg.block_size,
            "head_dim": cfg.head_dim, "dtype": cfg.dtype, "tp_size": cfg.tp}


def _start(role: str, cfg: DemoConfig, store: dict[str, Any], addresses: dict[str, str],
           extra: dict[str, Any]) -> Any:
    from ..distributed._supervise import ChildProcess

    gpus = -1 if cfg.devices is None else cfg.devices[_ROLES.index(role)]  # -1: the scheduler picks
    device = list(gpus) if isinstance(gpus, tuple) else gpus  # a list: one GPU a TP rank
    sc = SchedulerConfig(role, _spec(cfg), cfg.blocks_per_instance, store, addresses, cfg.seed + 1 + _ROLES.index(role),
                         cfg.concurrency, os.getpid(), extra={**extra, "device": device})
    return ChildProcess("kvstate.app._procsched", [sc.to_json()], f"demo {role} scheduler")


def run_processes(cfg: DemoConfig, store: dict[str, Any] | None = None, timeout: float = 300.0,
                  on_start: Any = None) -> dict[str, Any]:
    """Run the demo as processes (see the module's docstring); the summary of ``run_demo``
    plus ``processes``. ``store``: a worker store configuration (default: an ArenaStore in
    shared memory, made here and removed at the end). ``on_start(children)`` sees the scheduler processes once every one
    is ready (tests kill them)."""
    from ..distributed._pdlink import Link

    cfg.validate()
    t0 = time.perf_counter()
    remove_orphans(tempfile.gettempdir(), "kvstate-demo-")
    tmp = tempfile.mkdtemp(prefix=f"kvstate-demo-{os.getpid()}-")
    children: dict[str, Any] = {}
    closers: list[Any] = []
    try:
        if store is None:  # a shared-memory arena this process owns, sized for both instances' blocks
            from .._spec import CacheSpec

            arena = arena_store(CacheSpec(**_spec(cfg)), 2 * cfg.blocks_per_instance)
            closers.append(arena.close)
            store = {"kind": "arena", "path": arena.path}  # type: ignore[attr-defined]
        addresses = {name: f"ipc://{tmp}/{name}" for name in ("router", *_ROLES)}
        # the direct handoff: P's rank workers lend on a board in this run's directory, D's pull there
        extra = {"handoff": cfg.handoff, "board": os.path.join(tmp, "lends") if cfg.handoff != "store" else "",
                 "backend": cfg.backend, "arm_reads": cfg.arm_reads}
        with Link(addresses["router"], DEMO_SCHEMAS) as link:
            for role in _ROLES:
                link.connect(role, addresses[role])
                children[role] = _start(role, cfg, store, addresses, extra)
            workers = _wait_ready(link, children, deadline=time.monotonic() + 120)
            pids = {role: [children[role].pid, *workers[role]] for role in _ROLES}
            if on_start is not None:
                on_start(children)
            plans = make_plans(cfg.requests, cfg.seed, cfg.block_size)
            for plan in plans:
                link.send("decode", "submit", *plan.to_wire())
            outcome = _collect(link, children, {p.rid for p in plans}, time.monotonic() + timeout)
            figures = _reports(link, children)
        figures["processes"] = 1 + sum(len(p) for p in pids.values())
        figures["pids"] = pids
        figures.setdefault("store", store["kind"])
        return summary(cfg, outcome, figures, t0)
    finally:
        for child in children.values():
            child.stop(10.0)
        for close in closers:
            close()
        shutil.rmtree(tmp, ignore_errors=True)
        # what a scheduler killed with SIGKILL could not remove (its shared caches, its sockets)
        remove_orphans(shm_directory(), "kvstate-")
        remove_orphans(tempfile.gettempdir(), "kvstate-ipc-")


def _wait_ready(link: Any, children: dict[str, Any], deadline: float) -> dict[str, list[int]]:
    """Wait for both schedulers' ``ready``; returns the pids of their rank workers."""
    ready: dict[str, list[int]] = {}
    while len(ready) < len(children):
        for role, child in children.items():
            if not child.alive():
                raise ConfigError(f"demo: the {role} scheduler exited with status {child.returncode} before it was "
                                  "ready (see its stderr)")
        if time.monotonic() > deadline:
            raise DriverError(f"demo: schedulers {sorted(set(children) - set(ready))} not ready in time")
        for kind, items in link.receive(0.05):
            if kind == "ready":
                ready[items[0]] = items[2]
    return ready


def _collect(link: Any, children: dict[str, Any], rids: set[str], deadline: float) -> dict[str, Outcome]:
    """Results until every request has one, a scheduler died, or ``deadline``."""
    outcome: dict[str, Outcome] = {}
    while len(outcome) < len(rids) and time.monotonic() < deadline:
        if any(not c.alive() for c in children.values()):
            break
        for kind, items in link.receive(0.05):
            if kind == "result" and items[0] in rids:
                outcome[items[0]] = (items[1], items[2], items[3])
    return outcome


def _reports(link: Any, children: dict[str, Any]) -> dict[str, Any]:
    """Stop the live schedulers and add up what they report (a dead one reports nothing)."""
    live = [role for role, c in children.items() if c.alive()]
    for role in live:
        link.send(role, "stop")
    got: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 60
    while len(got) < len(live) and time.monotonic() < deadline:
        for kind, items in link.receive(0.05):
            if kind == "report":
                got[items[0]] = items[1]
        if any(not children[r].alive() and r not in got for r in live):
            break
    out: dict[str, Any] = {"leaked_blocks": 0, "pending_commands": 0, "bytes_moved": 0, "blocks_checked": 0,
                           "blocks_mismatched": 0, "preemptions": 0, "prefix_blocks_read": 0,
                           "schedulers_reported": sorted(got), "rank_restarts": 0, "lost_answers": 0,
                           "live_requests": 0, "lends_pulled": 0, "lends_unpulled": 0, "store_broken": 0,
                           "store_short": 0, "store_failed": 0, "expired_transfers": 0, "reads_announced": 0,
                           "ranks_armed": 0, "ranks_fired": 0}
    for figures in got.values():
        for k in out:
            if k in figures and k != "schedulers_reported":
                out[k] += figures[k]
    return out
