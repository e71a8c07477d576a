"""Policies: what the lifecycle does on failure, preemption and time-outs."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ._errors import ConfigError
from ._validate import MAX_BLOCKS, check_int

__all__ = ["Policy", "READ_FAILURE_MODES", "PREEMPT_MODES", "SWAP_FALLBACKS", "SWAP_WRITES", "ERROR_READ_FAILED",
           "ERROR_WRITE_FAILED", "ERROR_ABORTED", "ERROR_TIMEOUT", "REASONS", "prefill_reason"]

READ_FAILURE_MODES = ("fail", "recompute")  #: ``Policy.read_failure``
PREEMPT_MODES = ("write", "recompute", "swap")  #: ``Policy.preempt``
SWAP_FALLBACKS = ("write", "recompute")  #: ``Policy.swap_fallback``
SWAP_WRITES = ("host", "through", "back")  #: ``Policy.swap_write``
MAX_RETRIES = 1000  #: ``Policy.write_retries`` at most
MAX_STATE_CHECKPOINTS = 64  #: ``Policy.state_checkpoints`` at most (a state page each, per prefill)

ERROR_READ_FAILED = 502  #: D could not read the cache P wrote
ERROR_WRITE_FAILED = 503  #: P could not write the cache; its first token carries this code
ERROR_ABORTED = 499  #: the client went away
ERROR_TIMEOUT = 504  #: a wait passed its deadline (P's queue for blocks, D's first token)

#: Why a request ended (``RequestEnded.reason``). P: ``done`` (cache stored, first token
#: sent), ``write_failed``, ``queue_timeout`` (no blocks within ``Policy.queue_timeout``),
#: ``aborted``. D: ``done``, ``first_token_timeout``, ``read_failed``, ``aborted``, and, when
#: P's first token carried an error, ``prefill_`` + P's reason for that code.
REASONS = ("done", "aborted", "write_failed", "queue_timeout", "first_token_timeout", "read_failed",
           "prefill_write_failed", "prefill_queue_timeout", "prefill_aborted", "prefill_failed")

_PREFILL_REASONS = {ERROR_WRITE_FAILED: "prefill_write_failed", ERROR_TIMEOUT: "prefill_queue_timeout",
                    ERROR_ABORTED: "prefill_aborted"}


def _knob(default: Any, doc: str) -> Any:
    """A policy field with the line ``kvstate scenario`` prints above it (its ``[policy]`` key)."""
    return field(default=default, metadata={"doc": doc})


def prefill_reason(error_code: int) -> str:
    """D's reason for ending a request whose first token came with ``error_code`` (not 200)."""
    return _PREFILL_REASONS.get(error_code, "prefill_failed")


@dataclass(frozen=True, slots=True)
class Policy:
    """Knobs of the lifecycle machines (all times in the clock's unit, seconds by default).

    - ``read_prefix``: P reads the longest stored prefix of its prompt before prefill.
    - ``write_retries``: extra attempts after a failed or partial write.
    - ``read_failure``: ``"fail"`` (end with 502 and recycle) or ``"recompute"`` (recompute
      from the longest prefix that was read on every rank).
    - ``preempt``: ``"write"`` (write the cache out, free after it completed, reload on
      resume), ``"recompute"`` (free at once, recompute on resume) or ``"swap"`` (copy the
      cache into the host tier, free after it completed, copy it back on resume; D needs a
      host tier).
    - ``swap_fallback``: when the host tier cannot take a cache (full) or its swap-out
      fails: ``"write"`` (write it to the store as ``preempt="write"`` does) or
      ``"recompute"``.
    - ``swap_write``: ``"host"`` (a swapped cache lives in host memory only; lost there, it is
      recomputed), ``"through"`` (also written to the store before the GPU blocks are freed)
      or ``"back"`` (written to the store from host memory after they are freed, while the
      request waits swapped). A cache in the store that host memory lost is reloaded from it.
    - ``swapped_timeout``: how long a swapped-out request may wait for ``resume`` before its
      host copy is let go (it then recomputes on resume), so an engine that forgets a
      request cannot hold the host tier forever.
    - ``transfer_timeout``: deadline of every outstanding command.
    - ``first_token_timeout``: how long D waits, from reserving blocks, for P's first token;
      past it the request fails (reason ``first_token_timeout``, 504) and its blocks are free.
    - ``queue_timeout``: how long an admitted prompt may wait for P's blocks; past it the
      request fails (reason ``queue_timeout``) and its first token carries 504, so D learns
      at once instead of at its own first-token deadline.
    - ``fence_grace``: after a command's deadline, how long its blocks stay pinned waiting
      for the late backend answer before they are reclaimed. Each transfer command carries
      its fence (deadline + grace); drivers and backends touch blocks only before it, so the
      grace must cover one local gather or scatter (milliseconds), not the store operation.
    - ``decode_headroom_blocks``: blocks D keeps free per running request when P asks it
      for blocks (room for running requests to grow).
    - ``state_checkpoints`` (models with state layers): how many of its prompt's checkpoints
      P stores a state at, the last ones (:mod:`kvstate._statepages`). Each takes a state page
      during the prefill; more let later prompts that share only the prompt's beginning (a
      system prompt) start from a state.
    """

    read_prefix: bool = _knob(True, "P reads the longest stored prefix of a prompt before prefill")
    write_retries: int = _knob(1, "extra attempts after a failed or partial write")
    read_failure: str = _knob("fail", f"one of {list(READ_FAILURE_MODES)}: end with 502, or recompute")
    preempt: str = _knob("write", f"one of {list(PREEMPT_MODES)}: write the cache out, recompute it, or swap it to "
                         "the host tier (needs a host tier: a scenario's cluster.host_blocks)")
    swap_fallback: str = _knob("write", f"one of {list(SWAP_FALLBACKS)}: when the host tier is full or a swap fails")
    swap_write: str = _knob("host", f"one of {list(SWAP_WRITES)}: a swapped cache in host memory only, also written "
                            "to the store before (through) or after (back) its GPU blocks go")
    swapped_timeout: float = _knob(600.0, "seconds a swapped request keeps its host entries")
    transfer_timeout: float = _knob(30.0, "seconds: the deadline of every transfer")
    first_token_timeout: float = _knob(60.0, "seconds D waits for P's first token, from its reservation")
    queue_timeout: float = _knob(30.0, "seconds a prompt waits for P's blocks")
    fence_grace: float = _knob(60.0, "seconds a timed-out transfer's blocks stay pinned")
    decode_headroom_blocks: int = _knob(1, "blocks D keeps free per running request when it reserves")
    state_checkpoints: int = _knob(1, "a model with state layers: how many of its prompt's checkpoints P stores a "
                                   "state at, the last ones (a state page each while it prefills)")

    def __post_init__(self) -> None:
        if self.read_failure not in READ_FAILURE_MODES:
            raise ConfigError(f"Policy.read_failure must be 'fail' or 'recompute', got {self.read_failure!r}")
        if self.preempt not in PREEMPT_MODES:
            raise ConfigError(f"Policy.preempt must be one of {PREEMPT_MODES}, got {self.preempt!r}")
        if self.swap_write not in SWAP_WRITES:
            raise ConfigError(f"Policy.swap_write must be one of {SWAP_WRITES}, got {self.swap_write!r}")
        if self.swap_fallback not in SWAP_FALLBACKS:
            raise ConfigError(f"Policy.swap_fallback must be one of {SWAP_FALLBACKS}, got {self.swap_fallback!r}")
        if not isinstance(self.read_prefix, bool):
            raise ConfigError(f"Policy.read_prefix must be a bool, got {self.read_prefix!r}")
        check_int(self.write_retries, "Policy.write_retries", minimum=0, maximum=MAX_RETRIES, error=ConfigError)
        check_int(self.decode_headroom_blocks, "Policy.decode_headroom_blocks", minimum=0, maximum=MAX_BLOCKS,
                  error=ConfigError)
        check_int(self.state_checkpoints, "Policy.state_checkpoints", minimum=1, maximum=MAX_STATE_CHECKPOINTS,
                  error=ConfigError)
        for name in ("transfer_timeout", "first_token_timeout", "queue_timeout", "fence_grace", "swapped_timeout"):
            v = getattr(self, name)  # a bool is no time, and every wait must end: finite
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ConfigError(f"Policy.{name} must be a finite number > 0, got {v!r}")
