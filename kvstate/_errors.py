"""The error hierarchy: everything kvstate raises derives from :class:`KVStateError`.

Each error names the request or block it concerns and the rule that was broken, and is
raised *before* any state changes or any byte moves.
"""
from __future__ import annotations

__all__ = [
    "KVStateError",
    "ValidationError",
    "BlockError",
    "OutOfBlocksError",
    "HostTierFullError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "InvalidTransitionError",
    "StoreError",
    "ConfigError",
    "DriverError",
    "FenceError",
    "ProtocolError",
]


class KVStateError(Exception):
    """Base class of every error kvstate raises."""


class ValidationError(KVStateError, ValueError):
    """An argument broke a documented rule (shape, range, type, length)."""


class BlockError(ValidationError):
    """A block id is negative, out of range, duplicated, foreign or already free."""


class OutOfBlocksError(KVStateError):
    """The block pool cannot satisfy an allocation (nothing was allocated)."""


class HostTierFullError(OutOfBlocksError):
    """The host tier cannot give every key a slot: each unreferenced entry is already
    evictable and still too few (nothing was acquired)."""


class UnknownRequestError(KVStateError, LookupError):
    """An event names a request that was never admitted or was already recycled."""


class DuplicateRequestError(ValidationError):
    """A request id is admitted while a request with that id is still alive."""


class InvalidTransitionError(KVStateError):
    """An event is not legal in the request's current state (the state is unchanged)."""

    def __init__(self, request_id: str, state: str, event: str, machine: str) -> None:
        self.request_id, self.state, self.event, self.machine = request_id, state, event, machine
        super().__init__(
            f"request {request_id!r} is in state {state!r} of the {machine} machine: "
            f"event {event!r} is not allowed there"
        )


class StoreError(KVStateError):
    """A storage backend could not be set up or used as configured."""


class ConfigError(KVStateError):
    """A configuration value (policy, spec, scenario, CLI option) is invalid."""


class DriverError(KVStateError):
    """A driver was used after close, or a wait ran past its deadline."""


class FenceError(KVStateError):
    """A transfer reached its command's fence (deadline plus grace): from then on the
    lifecycle may have recycled the blocks, so the transfer touches none of them."""


class ProtocolError(KVStateError):
    """A message from another process broke the wire protocol: it did not parse, named an
    unknown command or rank, or came from an older incarnation of a restarted rank. Such a
    message is refused and counted, never applied."""
