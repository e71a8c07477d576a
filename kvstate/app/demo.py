"""``kvstate demo``: requests through P -> storage -> D on real bytes, every byte checked.

A prefill instance and a decode instance (each with ``tp`` ranks and its own numpy caches)
share one store. "Compute" writes a deterministic pattern derived from each block's
storage key, so whatever D reads — after the handoff, after a preemption's write-back and
reload, from a prefix another request stored — can be checked against what P (or D
itself) wrote. Some requests share a stored prefix, some are preempted, some aborted.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import commands as C
from ..backends import FileStore, MemoryStore, ReferenceBackend, StepDriver, Store
from ..decode import DecodeLifecycle
from ..errors import ConfigError, OutOfBlocksError
from ..keys import block_keys
from ..policy import Policy
from ..prefill import PrefillLifecycle
from ..spec import CacheSpec
from ..testing import fill_blocks, mismatched_blocks

__all__ = ["DemoConfig", "run_demo", "format_summary"]


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
    store_factory: Callable[[CacheSpec], Store] | None = field(default=None, repr=False)

    def validate(self) -> None:
        if not isinstance(self.requests, int) or self.requests <= 0:
            raise ConfigError(f"--requests must be an int > 0, got {self.requests!r}")
        if not isinstance(self.tp, int) or not 1 <= self.tp <= 16:
            raise ConfigError(f"--tp must be an int in 1..16, got {self.tp!r}")
        if self.store not in ("memory", "file", "custom"):
            raise ConfigError(f"--store must be 'memory' or 'file', got {self.store!r}")
        if self.store == "file" and not self.store_dir:
            raise ConfigError("--store file needs --store-dir DIR")
        if self.backend not in ("reference", "cuda"):
            raise ConfigError(f"--backend must be 'reference' or 'cuda', got {self.backend!r}")
        if not isinstance(self.concurrency, int) or self.concurrency <= 0:
            raise ConfigError(f"--concurrency must be an int > 0, got {self.concurrency!r}")


@dataclass
class _Plan:
    rid: str
    prompt: list[int]
    output_len: int
    preempt_at: int | None
    abort_at: str | None
    tokens: list[int] = field(default_factory=list)  # D's prompt + outputs
    running: bool = False
    preempted: bool = False
    reloads: int = 0


class _Demo:
    def __init__(self, cfg: DemoConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.spec = CacheSpec(num_layers=cfg.layers, kv_heads=cfg.kv_heads, block_size=cfg.block_size,
                              head_dim=cfg.head_dim, dtype=cfg.dtype, tp_size=cfg.tp)
        self.now = 0.0
        clock = lambda: self.now  # noqa: E731 - a deterministic clock
        policy = Policy()
        if cfg.store_factory is not None:
            self.store = cfg.store_factory(self.spec)
        elif cfg.store == "file":
            self.store = FileStore(cfg.store_dir)  # type: ignore[arg-type]
        else:
            self.store = MemoryStore(1 << 30)
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
        self.pd = StepDriver(self.P, self.pb)
        self.dd = StepDriver(self.D, self.db)
        self.plans: dict[str, _Plan] = {}
        self.outcome: dict[str, tuple[str, int]] = {}
        self.checked = self.mismatched = 0
        self.preemptions = self.prefix_blocks_read = 0

    def _backend(self, nb: int) -> Any:
        if self.cfg.backend == "cuda":
            from ..backends.cuda import CudaBackend

            return CudaBackend(self.spec, nb, self.store, staging_bytes=1 << 20)
        return ReferenceBackend(self.spec, nb, self.store)

    def close(self) -> None:
        for b in (self.pb, self.db):
            if b is not None:
                b.close()
        self.store.close()

    # -- workload -------------------------------------------------------------------------
    def make_plans(self) -> list[_Plan]:
        rng, bs = self.rng, self.cfg.block_size
        plans: list[_Plan] = []
        for i in range(self.cfg.requests):
            n = rng.randint(bs + 1, 12 * bs)
            if rng.random() < 0.25:
                n = (n // bs) * bs  # exactly full blocks
            prompt = [rng.randrange(50_000) for _ in range(n)]
            if plans and rng.random() < 0.3:  # share a stored prefix with an earlier request
                donor = rng.choice(plans).prompt
                k = rng.randint(1, max(1, (len(donor) - 1) // bs)) * bs
                prompt[:min(k, n - 1)] = donor[:min(k, n - 1)]
            abort_at = rng.choice(["prefill", "reading", "running"]) if rng.random() < 0.1 else None
            out_len = rng.randint(2, 3 * bs)
            preempt = rng.randint(1, out_len - 1) if rng.random() < 0.2 else None
            plans.append(_Plan(f"req-{i:04d}", prompt, out_len, preempt, abort_at))
        return plans

    # -- fake compute and checks ----------------------------------------------------------------
    def _check(self, backend: Any, keys: list[str], blocks: tuple[int, ...], upto: int) -> None:
        self.checked += upto * self.spec.tp_size * len(self.spec.kinds)
        self.mismatched += len(mismatched_blocks(backend, keys, blocks, upto))

    # -- notices ----------------------------------------------------------------------------
    def on_prefill_notice(self, cmd: C.Command) -> None:
        plan = self.plans[cmd.request_id]
        if isinstance(cmd, C.StartPrefill):
            keys = block_keys(plan.prompt, self.cfg.block_size)
            cached = cmd.num_cached_tokens // self.cfg.block_size
            self.prefix_blocks_read += cached
            self._check(self.pb, keys, cmd.block_ids, cached)  # the prefix read from storage
            if plan.abort_at == "prefill":
                self.P.abort(plan.rid)
                self.D.abort(plan.rid)
                return
            fill_blocks(self.pb, keys, cmd.block_ids, cached)
            self.P.prefill_done(plan.rid, self.rng.randrange(50_000))
        elif isinstance(cmd, C.SendFirstToken):
            if plan.rid in self.D.live_requests():
                self.D.deliver_first_token(plan.rid, cmd.token, cmd.error_code)
                if cmd.error_code == 200 and cmd.token is not None:
                    plan.tokens = plan.prompt + [cmd.token]
                if plan.abort_at == "reading":
                    self.D.abort(plan.rid)  # mid-transfer: the read still pins its blocks
        elif isinstance(cmd, C.RequestEnded) and cmd.state != "done":
            self.outcome.setdefault(plan.rid, ("p_" + cmd.state, cmd.error_code))

    def on_decode_notice(self, cmd: C.Command) -> None:
        plan = self.plans[cmd.request_id]
        if isinstance(cmd, C.StartDecode):
            keys = block_keys(plan.tokens[:-1], self.cfg.block_size)
            self._check(self.db, keys, cmd.block_ids, len(keys))
            if plan.abort_at == "running":
                self.D.abort(plan.rid)
                return
            plan.running = True
        elif isinstance(cmd, C.Recompute):
            keys = block_keys(plan.tokens[:-1], self.cfg.block_size)
            fill_blocks(self.db, keys, cmd.block_ids, cmd.from_token // self.cfg.block_size)
            self.D.recompute_done(plan.rid)
        elif isinstance(cmd, C.RequestEnded):
            plan.running = False
            self.outcome[plan.rid] = (cmd.state, cmd.error_code)

    # -- decode steps ---------------------------------------------------------------------------
    def decode_step(self) -> None:
        for plan in list(self.plans.values()):
            if plan.preempted and self.D.state_of(plan.rid) == "preempted":
                try:
                    self.D.resume(plan.rid)
                    plan.preempted = False
                    plan.reloads += 1
                except OutOfBlocksError:
                    pass
                continue
            if not plan.running:
                continue
            produced = len(plan.tokens) - len(plan.prompt)
            if produced >= plan.output_len:
                plan.running = False
                self.D.finish(plan.rid)
                continue
            tok = self.rng.randrange(50_000)
            try:
                self.D.append_tokens(plan.rid, [tok])
            except OutOfBlocksError:
                continue
            plan.tokens.append(tok)
            if plan.preempt_at is not None and produced + 1 == plan.preempt_at:
                plan.preempt_at = None
                # materialize the cache D computed so far, then preempt (write-back, free)
                keys = block_keys(plan.tokens[:-1], self.cfg.block_size)
                fill_blocks(self.db, keys, self.D.blocks_of(plan.rid), 0)
                plan.running = False
                plan.preempted = True
                self.preemptions += 1
                self.D.preempt(plan.rid)

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        todo = self.make_plans()
        self.pd.on_notice = self.on_prefill_notice
        self.dd.on_notice = self.on_decode_notice
        for p in todo:
            self.plans[p.rid] = p
        todo.reverse()
        steps = 0
        while todo or self.P.live_requests() or self.D.live_requests():
            while todo and len(self.D.live_requests()) < self.cfg.concurrency:
                plan = todo[-1]
                if not self.D.can_reserve(len(plan.prompt)):
                    break
                todo.pop()
                self.D.reserve(plan.rid, plan.prompt)
                self.P.admit(plan.rid, plan.prompt)
            for drv in (self.pd, self.dd):
                drv.pump()
                for _ in range(len(drv.pending)):
                    if drv.pending:
                        cid, rank = next(iter(drv.pending))
                        drv.complete(cid, rank)
                        drv.pump()
            self.decode_step()
            self.now += 0.001
            self.P.tick()
            self.D.tick()
            steps += 1
            if steps > 1_000_000:
                raise RuntimeError("demo did not converge")
        self.pd.pump()
        self.dd.pump()  # deliver the last RequestEnded notices
        leaked = self.P.pool.num_used + self.D.pool.num_used
        states = [s for s, _ in self.outcome.values()]
        return {
            "requests": self.cfg.requests,
            "finished": states.count("done"),
            "failed": sum(1 for s in states if s.endswith("failed")),
            "aborted": sum(1 for s in states if s.endswith("aborted")),
            "preemptions": self.preemptions,
            "prefix_blocks_read": self.prefix_blocks_read,
            "tp": self.cfg.tp,
            "store": type(self.store).__name__,
            "leaked_blocks": leaked,
            "pending_commands": len(self.P.pending_commands()) + len(self.D.pending_commands()),
            "bytes_moved": self.pb.bytes_moved + self.db.bytes_moved,
            "blocks_checked": self.checked,
            "blocks_mismatched": self.mismatched,
            "integrity_ok": self.mismatched == 0 and self.checked > 0,
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
        f"kvstate demo: {s['requests']} requests, P -> {s['store']} -> D, TP {s['tp']}",
        f"  finished {s['finished']}, failed {s['failed']}, aborted {s['aborted']}, "
        f"preemptions {s['preemptions']}, prefix blocks reused {s['prefix_blocks_read']}",
        f"  moved {s['bytes_moved'] / 2**20:.1f} MiB; checked {s['blocks_checked']} blocks, "
        f"{s['blocks_mismatched']} mismatched",
        f"  leaked blocks {s['leaked_blocks']}, pending commands {s['pending_commands']}",
        f"  integrity: {ok}  ({s['seconds']} s)",
    ])
