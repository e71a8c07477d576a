"""Shared helpers: a settable clock, small specs, a P+D rig that runs a request end to end."""
from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
from pathlib import Path

import pytest

from kvstate import CacheSpec, DecodeLifecycle, Policy, PrefillLifecycle
from kvstate.backends import MemoryStore, ReferenceBackend, StepDriver

ROOT = Path(__file__).resolve().parents[1]


def _tracked_changes() -> str | None:
    """``git status`` of the checkout's tracked files (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_TREE] = _tracked_changes()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The suite leaves the checkout as it found it: a run that changed a tracked file fails."""
    before, after = session.config.stash.get(_TREE, None), _tracked_changes()
    if before is not None and after is not None and after != before:
        changed = sorted(set(after.splitlines()) ^ set(before.splitlines()))
        print(f"\nthe test run changed tracked files of the checkout: {changed[:10]}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_TREE = pytest.StashKey[str | None]()


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


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def rig() -> Rig:
    return Rig()


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def mooncake_missing() -> str | None:
    """Why the Mooncake tests cannot run here (the package, or a library it loads), or None."""
    if not has_module("mooncake"):
        return "mooncake-transfer-engine is not installed (pip install '.[mooncake]')"
    from kvstate import StoreError
    from kvstate.backends.mooncake import load_mooncake

    try:
        load_mooncake()
    except StoreError as e:
        return str(e)
    return None
