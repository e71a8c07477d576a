"""``kvstate demo``: requests through P -> storage -> D on real bytes, every byte checked.

A prefill instance and a decode instance (each with ``tp`` ranks and its own caches) share one
store; their engines are :mod:`~kvstate.app._demoroles`' roles, wired here by plain calls in one
process, on a deterministic clock, each command answered in order by a
:class:`~kvstate.backends._drivers.StepDriver`. ``kvstate demo --processes``
(:mod:`~kvstate.app._procdemo`) runs the same roles as separate processes.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._decode import DecodeLifecycle
from .._errors import ConfigError
from .._policy import Policy
from .._prefill import HANDOFFS, PrefillLifecycle
from .._spec import CacheSpec
from ..backends import FileStore, MemoryStore, ReferenceBackend, StepDriver, Store
from ._demoroles import DecodeRole, PrefillRole, make_plans

__all__ = ["DemoConfig", "Outcome", "run_demo", "format_summary", "summary"]

#: how a request ended: its end state, HTTP code and reason (``RequestEnded``'s)
Outcome = tuple[str, int, str]


@dataclass
class DemoConfig:
    requests: int = 64
    seed: int = 0
    tp: int = 2
    store: str = "memory"
    store_dir: str | None = None
    block_size: int = 16
    layers: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "bfloat16"
    blocks_per_instance: int = 256
    concurrency: int = 8
    backend: str = "reference"  #: "reference" (numpy, CPU) or "cuda" (GPU caches, P and D on one GPU)
    #: how caches reach D (``PrefillLifecycle(handoff=)``): through the store, or pulled straight from
    #: P's caches ("direct", "both": with ``--processes``, whose instances run side by side)
    handoff: str = "store"
    #: D arms each direct pull when it reserves the blocks (``DecodeLifecycle(arm_reads=True)``,
    #: :mod:`kvstate.backends._cuda_armed`; ``docs/engine.md`` says when it is safe): ``kvstate
    #: demo`` turns it on with ``--processes --backend cuda`` and the direct handoff
    arm_reads: bool = False
    #: with ``--processes --backend cuda``: P's and D's GPU, each one index (all the role's ranks
    #: there) or a tuple of one index a TP rank; None: P on GPU 0, D on GPU 1 where there is one
    devices: tuple[int | tuple[int, ...], int | tuple[int, ...]] | None = None
    store_factory: Callable[[CacheSpec], Store] | None = field(default=None, repr=False)

    def validate(self) -> None:
        if not isinstance(self.requests, int) or self.requests <= 0:
            raise ConfigError(f"--requests must be an int > 0, got {self.requests!r}")
        if not isinstance(self.tp, int) or not 1 <= self.tp <= 16:
            raise ConfigError(f"--tp must be an int in 1..16, got {self.tp!r}")
        if self.store not in ("memory", "file", "arena", "custom"):
            raise ConfigError(f"--store must be 'memory', 'file' or 'arena', got {self.store!r}")
        if self.store == "file" and not self.store_dir:
            raise ConfigError("--store file needs --store-dir DIR")
        if self.backend not in ("reference", "cuda"):
            raise ConfigError(f"--backend must be 'reference' or 'cuda', got {self.backend!r}")
        if not isinstance(self.concurrency, int) or self.concurrency <= 0:
            raise ConfigError(f"--concurrency must be an int > 0, got {self.concurrency!r}")
        if self.devices is not None and (not isinstance(self.devices, tuple) or len(self.devices) != 2 or
                                         not all(map(self._gpus_of_a_role, self.devices))):
            raise ConfigError(f"--devices must be P,D: each a GPU index, or one a TP rank ({self.tp}), got "
                              f"{self.devices!r}")
        if self.handoff not in HANDOFFS:
            raise ConfigError(f"--handoff must be one of {list(HANDOFFS)}, got {self.handoff!r}")
        if self.arm_reads is not False and (self.arm_reads is not True or self.handoff == "store"):
            raise ConfigError(f"--arm-reads arms direct pulls: it goes with --handoff direct or both, got "
                              f"arm_reads={self.arm_reads!r} with --handoff {self.handoff}")


    def _gpus_of_a_role(self, gpus: Any) -> bool:
        """One GPU index, or a tuple of one a TP rank."""
        def index(g: Any) -> bool:
            return g.__class__ is int and 0 <= g < 1024
        return index(gpus) or isinstance(gpus, tuple) and len(gpus) == self.tp and all(map(index, gpus))


def arena_store(spec: CacheSpec, blocks: int) -> Store:
    """An :class:`~kvstate.backends._arena.ArenaStore` whose slots are ``spec``'s objects (one
    block of one kind, every layer, one rank), room for ``blocks`` blocks of every rank."""
    from ..backends._arena import ArenaStore

    slot = max(spec.block_bytes(k) for k in spec.kinds)
    return ArenaStore.create(slot, blocks * len(spec.kinds) * spec.tp_size, small_bytes=min(1024, slot // 2),
                             small_slots=blocks * spec.tp_size, tag="kvstate-demo")


class _Demo:
    """P and D in this process, their roles wired by plain calls, commands answered in order."""

    def __init__(self, cfg: DemoConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.spec = CacheSpec(num_layers=cfg.layers, kv_heads=cfg.kv_heads, block_size=cfg.block_size,
                              head_dim=cfg.head_dim, dtype=cfg.dtype, tp_size=cfg.tp)
        self.now = 0.0
        clock = lambda: self.now  # noqa: E731 - a deterministic clock
        policy = Policy()
        if cfg.store_factory is not None:
            self.store = cfg.store_factory(self.spec)
        elif cfg.store == "file":
            self.store = FileStore(cfg.store_dir)  # type: ignore[arg-type]
        elif cfg.store == "arena":
            self.store = arena_store(self.spec, 2 * cfg.blocks_per_instance)
        else:
            self.store = MemoryStore(1 << 30)
        if cfg.handoff != "store":
            raise ConfigError("--handoff direct or both needs --processes: a lend waits for D to pull while P and D "
                              "run side by side, which the one-process demo's answers in turn cannot")
        nb = cfg.blocks_per_instance
        self.P = PrefillLifecycle(self.spec, nb, policy, clock=clock)
        self.D = DecodeLifecycle(self.spec, nb, policy, clock=clock)
        self.pb: Any = None  # set just below; None only while a failed start closes
        self.db: Any = None
        try:
            self.pb = self._backend(nb)
            self.db = self._backend(nb)
        except BaseException:
            self.close()
            raise
        self.outcome: dict[str, Outcome] = {}
        self.p = PrefillRole(self.P, self.pb, cfg.seed + 1, self._first_token, self._abort_at_d)
        self.d = DecodeRole(self.D, self.db, cfg.seed + 2, lambda plan: self.p.admit(plan.rid, plan.prompt,
                                                                                      plan.abort_at),
                            self.p.abort, lambda rid, *end: self.outcome.__setitem__(rid, end))
        self.pd = StepDriver(self.P, self.pb, on_notice=self.p.on_notice)
        self.dd = StepDriver(self.D, self.db, on_notice=self.d.on_notice)

    def _first_token(self, rid: str, token: Any, code: int) -> None:
        self.d.first_token(rid, token, code)

    def _abort_at_d(self, rid: str) -> None:
        self.d.abort(rid)

    def _backend(self, nb: int) -> Any:
        if self.cfg.backend == "cuda":
            from ..backends._cuda import CudaBackend

            return CudaBackend(self.spec, nb, self.store, staging_bytes=1 << 20)
        return ReferenceBackend(self.spec, nb, self.store)

    def close(self) -> None:
        for b in (self.pb, self.db):
            if b is not None:
                b.close()
        self.store.close()

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        todo = make_plans(self.cfg.requests, self.cfg.seed, self.cfg.block_size)
        todo.reverse()
        steps = 0
        while todo or self.P.live_requests() or self.D.live_requests():
            while todo and self.d.try_take(todo[-1], self.cfg.concurrency):
                todo.pop()
            for drv in (self.pd, self.dd):
                drv.pump()
                for _ in range(len(drv.pending)):
                    if drv.pending:
                        cid, rank = next(iter(drv.pending))
                        drv.complete(cid, rank)
                        drv.pump()
            self.d.step()
            self.now += 0.001
            self.P.tick()
            self.D.tick()
            steps += 1
            if steps > 1_000_000:
                raise RuntimeError("demo did not converge")
        self.pd.pump()
        self.dd.pump()  # deliver the last RequestEnded notices
        return summary(self.cfg, self.outcome, {
            "preemptions": self.d.preemptions, "prefix_blocks_read": self.p.prefix_blocks_read,
            "store": type(self.store).__name__, "transport": _transport(self.store),
            "leaked_blocks": self.P.pool.num_used + self.D.pool.num_used,
            "pending_commands": len(self.P.pending_commands()) + len(self.D.pending_commands()),
            "bytes_moved": self.pb.bytes_moved + self.db.bytes_moved,
            "blocks_checked": self.p.checked + self.d.checked,
            "blocks_mismatched": self.p.mismatched + self.d.mismatched, "processes": 1}, t0)


def _transport(store: Any) -> str:
    """How bytes reach the store: the Mooncake client's protocol, or "" (in process, files)."""
    config = getattr(store, "config", None)
    return str(getattr(config, "protocol", "")) if config is not None else ""


def summary(cfg: DemoConfig, outcome: dict[str, Outcome], figures: dict[str, Any], t0: float) -> dict[str, Any]:
    """The demo's summary (``--json``): requests by end, those that did not finish by reason
    (a failure in a healthy run is the first thing to look into), the figures both wirings
    measure."""
    states = [s for s, _, _ in outcome.values()]
    reasons: dict[str, int] = {}
    for state, _, reason in outcome.values():
        if state != "done":
            reasons[reason] = reasons.get(reason, 0) + 1
    return {
        "requests": cfg.requests, "finished": states.count("done"),
        "failed": sum(1 for s in states if s.endswith("failed")),
        "aborted": sum(1 for s in states if s.endswith("aborted")),
        "ended_by": dict(sorted(reasons.items())),
        "unfinished": cfg.requests - len(outcome), "tp": cfg.tp, **figures,
        "integrity_ok": figures["blocks_mismatched"] == 0 and figures["blocks_checked"] > 0
        and len(outcome) == cfg.requests,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def run_demo(cfg: DemoConfig | None = None) -> dict[str, Any]:
    """Run the demo and return its summary (see ``kvstate demo --json``)."""
    demo = _Demo(cfg or DemoConfig())
    try:
        return demo.run()
    finally:
        demo.close()


def format_summary(s: dict[str, Any]) -> str:
    ok = "OK" if s["integrity_ok"] and s["leaked_blocks"] == 0 else "FAILED"
    return "\n".join([
        f"kvstate demo: {s['requests']} requests, P -> {s['store']}"
        + (f" over {s['transport']}" if s.get("transport") else "") + f" -> D, TP {s['tp']}"
        + (f", {s['processes']} processes" if s["processes"] > 1 else ""),
        f"  finished {s['finished']}, failed {s['failed']}, aborted {s['aborted']}"
        + (" (" + ", ".join(f"{why} {n}" for why, n in s["ended_by"].items()) + ")" if s["ended_by"] else "")
        + f", preemptions {s['preemptions']}, prefix blocks reused {s['prefix_blocks_read']}",
        f"  moved {s['bytes_moved'] / 2**20:.1f} MiB; checked {s['blocks_checked']} blocks, "
        f"{s['blocks_mismatched']} mismatched",
        f"  leaked blocks {s['leaked_blocks']}, pending commands {s['pending_commands']}"
        + (f", {s['unfinished']} requests never ended" if s["unfinished"] else ""),
        f"  integrity: {ok}  ({s['seconds']} s)",
    ])
