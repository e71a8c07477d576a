"""Rigs for the tests: a settable clock, small specs, random objects for stores, and P and D
lifecycles with reference backends over one store and step drivers, which run a request end
to end."""
from __future__ import annotations

import dataclasses

import numpy as np

from kvstate import CacheSpec, DecodeLifecycle, Policy, PrefillLifecycle
from kvstate.backends import MemoryStore, ReferenceBackend, StepDriver

__all__ = ["Clock", "small_spec", "Rig", "ARENA_SLOT", "blob"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


def small_spec(tp: int = 2, **kw) -> CacheSpec:
    args = dict(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=tp)
    args.update(kw)
    return CacheSpec(**args)


class Rig:
    """P and D lifecycles with reference backends over one MemoryStore and StepDrivers."""

    def __init__(self, tp: int = 2, blocks: int = 64, policy: Policy | None = None, spec=None,
                 store=None, first_token_timeout: float = 100.0, p_blocks: int | None = None,
                 host_blocks: int = 0, layerwise: bool = False, p_host_blocks: int | None = None,
                 d_spec=None, **lifecycle_kwargs) -> None:
        """``p_host_blocks``: P's host tier when it differs from D's (``host_blocks``); ``d_spec``:
        D's spec when it differs from P's (``spec``), in a layout both store alike."""
        self.clock = Clock()
        self.spec = spec or small_spec(tp)
        self.policy = dataclasses.replace(policy or Policy(transfer_timeout=10.0, fence_grace=5.0),
                                          first_token_timeout=first_token_timeout)
        self.store = store if store is not None else MemoryStore(1 << 26)
        p_blocks = p_blocks or blocks
        p_host = host_blocks if p_host_blocks is None else p_host_blocks
        self.P = PrefillLifecycle(self.spec, p_blocks, self.policy, clock=self.clock, host_blocks=p_host,
                                  layerwise=layerwise, **lifecycle_kwargs)
        self.d_spec = d_spec or self.spec
        self.D = DecodeLifecycle(self.d_spec, blocks, self.policy, clock=self.clock, host_blocks=host_blocks,
                                 layerwise=layerwise, **lifecycle_kwargs)
        states = lifecycle_kwargs.get("num_states", 0)
        self.pb = ReferenceBackend(self.spec, p_blocks, self.store, host_blocks=p_host, num_states=states)
        self.db = ReferenceBackend(self.d_spec, blocks, self.store, host_blocks=host_blocks, num_states=states)
        self.pd = StepDriver(self.P, self.pb)
        self.dd = StepDriver(self.D, self.db)

    def notices(self, drv: StepDriver, cls=None):
        drv.pump()
        out = [n for n in drv.notices if cls is None or isinstance(n, cls)]
        drv.notices = [n for n in drv.notices if n not in out]
        return out


#: the big slot of the arena the ``arena`` fixture makes (conftest.py)
ARENA_SLOT = 4096


def blob(seed: int, n: int = ARENA_SLOT) -> np.ndarray:
    """``n`` random bytes, the same for the same seed: an object to put."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
