"""Events: what the outside world tells the lifecycle.

Every engine-facing method of :class:`~kvstate._prefill.PrefillLifecycle` and
:class:`~kvstate._decode.DecodeLifecycle` has a typed event here, so a driver, a test or
a log replay can feed the machines through one entry point, ``lifecycle.handle(event)``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Event", "Completion", "Admit", "LayersDone", "PrefillDone", "Reserve", "FirstToken", "AppendTokens",
    "Preempt", "Resume", "RecomputeDone", "Finish", "Abort", "Tick",
]


@dataclass(slots=True)
class Event:
    pass


@dataclass(slots=True)
class Completion(Event):
    """One rank's answer to a transfer command.

    ``count`` is the number of leading blocks done (a write: stored, whether this rank wrote
    them or found them stored; a read: read whole); ``error`` is a short reason when the rank
    failed.

    ``lost`` says the rank will never answer (a driver declared its process dead, or it
    stopped answering): the count must be 0, the transfer resolves as if that rank failed, and
    its blocks stay pinned until the command's fence, since a rank that is only stopped could
    still touch them until then.
    """

    command_id: int
    rank: int
    count: int
    error: str | None = None
    lost: bool = False


@dataclass(slots=True)
class Admit(Event):
    request_id: str
    token_ids: Sequence[int]
    extra_keys: Mapping[int, Sequence[str]] | None = None


@dataclass(slots=True)
class LayersDone(Event):
    request_id: str
    layers: int
    event: Any = None


@dataclass(slots=True)
class PrefillDone(Event):
    request_id: str
    first_token: int


@dataclass(slots=True)
class Reserve(Event):
    request_id: str
    token_ids: Sequence[int]
    extra_keys: Mapping[int, Sequence[str]] | None = None


@dataclass(slots=True)
class FirstToken(Event):
    request_id: str
    token: int | None
    error_code: int = 200


@dataclass(slots=True)
class AppendTokens(Event):
    request_id: str
    token_ids: Sequence[int] = field(default_factory=tuple)


@dataclass(slots=True)
class Preempt(Event):
    request_id: str


@dataclass(slots=True)
class Resume(Event):
    request_id: str


@dataclass(slots=True)
class RecomputeDone(Event):
    request_id: str


@dataclass(slots=True)
class Finish(Event):
    request_id: str


@dataclass(slots=True)
class Abort(Event):
    request_id: str


@dataclass(slots=True)
class Tick(Event):
    """The clock moved: expire every command whose deadline passed."""
