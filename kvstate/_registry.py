"""Requests: the live ones, as cheap records, and the memory of those that recently ended.

A request is a slotted record (no per-request ``Machine``): its state, tokens, keys, blocks
and the transfer it waits for. The registry answers "which request is this id", and for an
id it no longer has, whether it ended recently (an event for it is late, not a bug) or was
never seen (a caller's bug): the last ``memory`` ended ids are kept for that.
"""
from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

from ._errors import DuplicateRequestError, UnknownRequestError, ValidationError

__all__ = ["Request", "PrefillRequest", "DecodeRequest", "Registry", "ENDED_MEMORY"]

ENDED_MEMORY = 4096  #: ended ids remembered, so late events for them are told from unknown ids


class Request:
    """A live request's record: what both sides keep. P's and D's own fields are their
    records' (:class:`PrefillRequest`, :class:`DecodeRequest`); code both sides share reads the
    other side's fields as the class defaults below, and cannot set them."""

    __slots__ = ("id", "state", "tokens", "keys", "extra_keys", "blocks", "tables", "cmd", "base", "retries",
                 "error_code", "reason", "wait_seq", "inflight", "hits", "window_from", "deferred", "pages")

    # one side's fields, as the other side's records answer them
    token: int | None = None
    layers = 0
    saved = 0
    snaps: tuple[int, ...] = ()
    from_page = -1
    stored_keys: list[str] | None = None
    host_keys: list[str] | None = None
    host_fresh: Sequence[str] = ()

    def __init__(self, request_id: str, state: str, tokens: array[int], keys: list[str],
                 extra_keys: Mapping[int, Sequence[str]] | None) -> None:
        self.id = request_id
        self.state = state
        self.tokens = tokens
        self.keys = keys
        self.extra_keys = extra_keys
        self.blocks: list[int] = []
        #: with group tables, the other paged groups' block tables (:mod:`kvstate._tables`)
        self.tables: list[list[int]] = []
        self.cmd = 0  #: the command whose answer the request waits for (0: none)
        self.base = 0  #: the first key of its current write
        self.retries = 0
        self.error_code = 200
        self.reason = ""  #: why it ended, set by the action that fails it (else its end state)
        self.wait_seq = 0  #: identifies its current wait timer (0: none)
        #: its transfers not yet retired (:class:`kvstate._pins.Transfer`: pins stands on this module)
        self.inflight: list[Any] = []
        self.hits = 0  #: its leading blocks claimed from the GPU prefix cache
        #: D: its blocks before this one hold no window layers (read without them): never shared
        self.window_from = 0
        #: D: a Recompute held back while an abandoned read or swap-in may still land in its blocks
        self.deferred: Any = None
        self.pages: list[int] = []  #: its state pages (:mod:`kvstate._statepages`): the running state first


class PrefillRequest(Request):
    """A P request's record."""

    __slots__ = ("token", "layers", "saved", "snaps", "from_page")

    def __init__(self, request_id: str, state: str, tokens: array[int], keys: list[str],
                 extra_keys: Mapping[int, Sequence[str]] | None) -> None:
        Request.__init__(self, request_id, state, tokens, keys, extra_keys)  # not super(): a hot path
        self.token = None  #: the first token, sent once the cache is stored
        self.layers = 0  #: layer-wise: layers of its prefill reported computed
        self.saved = 0  #: layer-wise: leading keys its save stored, when it answered before the prefill ended
        #: the checkpoints (in blocks) its prefill copies into pages[1:], in order
        self.snaps = ()
        self.from_page = -1  #: a cached state page it claimed, its prefill's start (-1: none)


class DecodeRequest(Request):
    """A D request's record."""

    __slots__ = ("stored_keys", "host_keys", "host_fresh")

    def __init__(self, request_id: str, state: str, tokens: array[int], keys: list[str],
                 extra_keys: Mapping[int, Sequence[str]] | None) -> None:
        Request.__init__(self, request_id, state, tokens, keys, extra_keys)  # not super(): a hot path
        self.stored_keys = None  #: the keys a read brings back
        self.host_keys = None  #: keys it references in the host tier (swapped out)
        self.host_fresh = ()  #: the keys its swap-out fills


#: a side's request record
R = TypeVar("R", bound=Request)


class Registry(Generic[R]):
    """Live requests by id, and the states of the last :data:`ENDED_MEMORY` ended ones."""

    __slots__ = ("live", "side", "_ended")

    def __init__(self, side: str) -> None:
        self.live: dict[str, R] = {}  #: read directly on hot paths
        self.side = side
        self._ended: dict[str, str] = {}  # insertion-ordered: the oldest goes first

    def __len__(self) -> int:
        return len(self.live)

    def check_new(self, request_id: str) -> None:
        """Raise :class:`DuplicateRequestError` if ``request_id`` is live."""
        live = self.live.get(request_id)
        if live is not None:
            raise DuplicateRequestError(f"request {request_id!r} is already live on the {self.side} side "
                                        f"(state {live.state!r})")

    def get(self, request_id: Any) -> R:
        """The live request, or an error saying whether the id ended or was never seen."""
        req = self.live.get(request_id) if request_id.__class__ is str else None
        if req is not None:
            return req
        if not isinstance(request_id, str):
            raise ValidationError(f"request id must be a str, got {type(request_id).__name__} {request_id!r}")
        ended = self._ended.get(request_id)
        if ended:
            raise UnknownRequestError(f"request {request_id!r} already ended ({ended}) and was recycled on the "
                                      f"{self.side} side: no further events are accepted for it")
        raise UnknownRequestError(f"request {request_id!r} is unknown on the {self.side} side")

    def ended(self, request_id: Any) -> str | None:
        """The terminal state of a recently ended request (None: live, forgotten or never seen)."""
        return self._ended.get(request_id) if request_id.__class__ is str else None

    def end(self, req: R) -> None:
        """Forget the live request, remembering how it ended."""
        del self.live[req.id]
        ended = self._ended
        ended[req.id] = req.state
        if len(ended) > ENDED_MEMORY:
            del ended[next(iter(ended))]
