"""Policies: what the lifecycle does on failure, preemption and time-outs."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["Policy", "ERROR_READ_FAILED", "ERROR_WRITE_FAILED", "ERROR_ABORTED"]

ERROR_READ_FAILED = 502  #: D could not read the cache P wrote (seed 000's code)
ERROR_WRITE_FAILED = 503  #: P could not write the cache; its first token carries this code
ERROR_ABORTED = 499  #: the client went away


@dataclass(frozen=True, slots=True)
class Policy:
    """Knobs of the lifecycle machines (all times in the clock's unit, seconds by default).

    - ``read_prefix``: P reads the longest stored prefix of its prompt before prefill.
    - ``write_retries``: extra attempts after a failed or partial write.
    - ``read_failure``: ``"fail"`` (end with 502 and recycle) or ``"recompute"`` (recompute
      from the longest prefix that was read on every rank).
    - ``preempt``: ``"write"`` (write the cache out, free after it completed, reload on
      resume) or ``"recompute"`` (free at once, recompute on resume).
    - ``transfer_timeout``: deadline of every outstanding command.
    - ``fence_grace``: after a command's deadline, how long its blocks stay pinned waiting
      for the late backend answer before they are reclaimed. Each transfer command carries
      its fence (deadline + grace); drivers and backends touch blocks only before it, so the
      grace must cover one local gather or scatter (milliseconds), not the store operation.
    - ``decode_headroom_blocks``: blocks D keeps free per running request when P asks it
      for blocks (seed 002's reservation for running requests' growth).
    """

    read_prefix: bool = True
    write_retries: int = 1
    read_failure: str = "fail"
    preempt: str = "write"
    transfer_timeout: float = 30.0
    fence_grace: float = 60.0
    decode_headroom_blocks: int = 1

    def __post_init__(self) -> None:
        if self.read_failure not in ("fail", "recompute"):
            raise ConfigError(f"Policy.read_failure must be 'fail' or 'recompute', got {self.read_failure!r}")
        if self.preempt not in ("write", "recompute"):
            raise ConfigError(f"Policy.preempt must be 'write' or 'recompute', got {self.preempt!r}")
        if not isinstance(self.write_retries, int) or self.write_retries < 0:
            raise ConfigError(f"Policy.write_retries must be an int >= 0, got {self.write_retries!r}")
        if not isinstance(self.decode_headroom_blocks, int) or self.decode_headroom_blocks < 0:
            raise ConfigError(
                f"Policy.decode_headroom_blocks must be an int >= 0, got {self.decode_headroom_blocks!r}")
        for name in ("transfer_timeout", "fence_grace"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"Policy.{name} must be a number > 0, got {v!r}")
