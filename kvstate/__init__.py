"""kvstate: the KV-cache life of PD-disaggregated LLM serving as explicit state machines.

The core (this package) is sans-I/O: lifecycle objects consume events and emit commands.
Subpackages: :mod:`kvstate.kernels` (transfer ops), :mod:`kvstate.backends` (reference
backend, stores, drivers) and :mod:`kvstate.sim` (the SimPy timing simulator).
"""
from __future__ import annotations

from . import commands, events
from .errors import (BlockError, ConfigError, DriverError, DuplicateRequestError,
                     FenceError, InvalidTransitionError, KVStateError, OutOfBlocksError, StoreError,
                     UnknownRequestError, ValidationError)
from .keys import block_keys, rank_key
from .lifecycle import DecodeLifecycle, Lifecycle, PrefillLifecycle
from .policy import Policy
from .pool import BlockPool, PoolStats
from .spec import CacheSpec

__version__ = "0.1.0"

__all__ = [
    "CacheSpec", "BlockPool", "PoolStats", "Policy", "block_keys", "rank_key",
    "Lifecycle", "PrefillLifecycle", "DecodeLifecycle", "commands", "events",
    "KVStateError", "ValidationError", "BlockError", "OutOfBlocksError", "UnknownRequestError",
    "DuplicateRequestError", "InvalidTransitionError", "StoreError", "ConfigError", "DriverError",
    "FenceError", "__version__",
]
