"""kvstate: the KV-cache life of PD-disaggregated LLM serving as explicit state machines.

The core (this package) is sans-I/O: lifecycle objects consume events and emit commands.
Subpackages: :mod:`kvstate.kernels` (transfer ops), :mod:`kvstate.backends` (reference and
CUDA backends, stores, drivers), :mod:`kvstate.sim` (the SimPy simulator) and
:mod:`kvstate.app` (the command line and the demo); :mod:`kvstate.testing` holds helpers for
tests and integrators.
"""
from __future__ import annotations

from . import commands, events
from .blocks import BlockManager, EngineBlocks
from .decode import DECODE, DecodeLifecycle
from .errors import (
    BlockError,
    ConfigError,
    DriverError,
    DuplicateRequestError,
    FenceError,
    InvalidTransitionError,
    KVStateError,
    OutOfBlocksError,
    ProtocolError,
    StoreError,
    UnknownRequestError,
    ValidationError,
)
from .keys import KeyCache, block_keys, rank_key
from .lifecycle import Lifecycle
from .machine import MachineDef
from .policy import Policy
from .pool import BlockPool, PoolStats
from .prefill import PREFILL, PrefillLifecycle
from .spec import CacheSpec

__version__ = "0.2.0"

#: Every lifecycle machine by name.
MACHINES: dict[str, MachineDef] = {PREFILL.name: PREFILL, DECODE.name: DECODE}

__all__ = [
    "CacheSpec", "BlockPool", "PoolStats", "BlockManager", "EngineBlocks", "Policy", "block_keys", "rank_key",
    "KeyCache",
    "Lifecycle", "PrefillLifecycle", "DecodeLifecycle", "MachineDef", "MACHINES", "PREFILL", "DECODE",
    "commands", "events",
    "KVStateError", "ValidationError", "BlockError", "OutOfBlocksError", "UnknownRequestError",
    "DuplicateRequestError", "InvalidTransitionError", "StoreError", "ConfigError", "DriverError",
    "FenceError", "ProtocolError", "__version__",
]
