"""Commands: what the lifecycle asks the outside world to do.

Commands are slotted dataclasses, treated as immutable (not frozen: a frozen dataclass
costs about 1 µs more to build, and the lifecycle builds ~10 per request).

Transfer commands (:class:`ReadBlocks`, :class:`LoadLayers`, :class:`WriteBlocks`,
:class:`SaveLayers`, :class:`LendBlocks`, :class:`SwapOut`, :class:`SwapIn`, :class:`FlushHost`) carry a
``command_id``, the TP ``ranks`` that must each answer with a
:class:`~kvstate.events.Completion`, an absolute ``deadline`` on the lifecycle's clock, and a
``fence`` (the deadline plus ``Policy.fence_grace``): from the fence on the lifecycle may
recycle the blocks, so no driver or backend may touch them after it (they check it just
before gathering or scattering blocks). Notices (:class:`SendFirstToken`,
:class:`StartPrefill`, :class:`StartDecode`, :class:`Recompute`, :class:`FreeBlocks`,
:class:`CancelCommand`, :class:`RequestEnded`, :class:`LateEvent`, :class:`LayersReady`)
need no answer. :class:`ArmRead` is a hint a driver may act on and never answers.

:data:`KINDS` is the one vocabulary every driver and the simulator dispatch on: each command
class's kind (``read``, ``write``, ``swap``, ``lend``, ``arm``, ``layers``, ``cancel``, ``notice``), and
:func:`kind_of` reads it. A transfer's kind (:data:`TRANSFER_KINDS`) is what its ranks do:
``read`` scatters stored bytes into GPU blocks, ``write`` stores blocks (from the GPU, or
from the host tier: :class:`FlushHost`), ``swap`` copies between GPU blocks and the host
tier, ``lend`` holds GPU blocks for a D on the same host to pull. ``arm`` prepares a read
before it is sent; a driver that cannot prepare it drops it. :data:`LAYERWISE` names
the transfers that move one layer group at a time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ._errors import ValidationError

__all__ = [
    "Command", "TransferCommand", "ReadBlocks", "LoadLayers", "WriteBlocks", "SaveLayers", "LayersReady", "LendBlocks",
    "SwapOut", "SwapIn", "FlushHost", "ArmRead", "SendFirstToken",
    "StartPrefill", "StartDecode", "Recompute", "FreeBlocks", "CancelCommand", "RequestEnded",
    "LateEvent", "KINDS", "TRANSFER_KINDS", "LAYERWISE", "kind_of",
]


@dataclass(slots=True)
class Command:
    request_id: str


@dataclass(slots=True)
class TransferCommand(Command):
    """Moves ``block_ids[i]`` under ``keys[i]`` (see :class:`ReadBlocks`, :class:`WriteBlocks`),
    and with state groups the ``states`` after some of them: a write stores each state whose
    blocks it stored, a read loads into its page the last candidate whose blocks it read, and
    either answers the ``end`` of the last state it moved (:mod:`kvstate._statepages`)."""

    command_id: int
    ranks: tuple[int, ...]
    deadline: float
    keys: tuple[str, ...]
    block_ids: tuple[int, ...]
    fence: float = field(default=math.inf, kw_only=True)
    #: state groups (:mod:`kvstate._statepages`): ``(end, page)``, the request's states after the
    #: command's leading ``end`` blocks, in state page ``page``; stored with ``keys[end - 1]``
    states: tuple[tuple[int, int], ...] = field(default=(), kw_only=True)
    #: with group tables (:mod:`kvstate._tables`): the other layer groups' blocks, a tuple per
    #: group aligned with ``block_ids`` (whose blocks are group 0's)
    tables: tuple[tuple[int, ...], ...] = field(default=(), kw_only=True)


@dataclass(slots=True)
class ReadBlocks(TransferCommand):
    """Read ``keys[i]`` into GPU block ``block_ids[i]``; answer the leading count read whole.

    A key the store lacks ends the count, so a read is also how P looks for a stored prefix.
    ``window_from``: the cache's window groups (:mod:`kvstate._layers`) are needed only from
    ``keys[window_from]`` on; a backend may read them from there (then it answers the leading
    blocks the cache can be continued from) or read every block whole, which is always right."""

    window_from: int = field(default=0, kw_only=True)


@dataclass(slots=True)
class LoadLayers(ReadBlocks):
    """A layer-wise read: as :class:`ReadBlocks`, but a rank reads and scatters one layer group
    (``CacheSpec.layer_groups``) at a time and signals each group's arrival to the engine
    (the driver's ``arrivals(command_id, rank)``), which may run the request's next decode
    step meanwhile, waiting per layer. The step counts only once ``StartDecode`` follows.
    With state groups a rank loads the whole cache's state before its first group, so a
    group's arrival says the state arrived too (and counts the paged layers)."""


@dataclass(slots=True)
class WriteBlocks(TransferCommand):
    """Store GPU block ``block_ids[i]`` under ``keys[i]``; answer the leading count stored.

    Keys are content hashes, so a key already stored holds these very bytes: a rank first
    asks the store how many leading keys it holds and gathers and writes only the rest
    (a full hit moves nothing). ``window_from`` (with group tables, :mod:`kvstate._tables`):
    the window groups' blocks before ``keys[window_from]`` were freed behind the window, so
    only the other groups are stored there; a block counts as stored when every group that
    holds it is."""

    window_from: int = field(default=0, kw_only=True)


@dataclass(slots=True)
class SaveLayers(WriteBlocks):
    """A layer-wise write, sent as the prefill starts: as :class:`WriteBlocks`, but a rank
    stores a layer group (``CacheSpec.layer_groups``) only once a :class:`LayersReady` for
    this command says the prefill computed its layers. Its deadline counts from the
    prefill's start."""


@dataclass(slots=True)
class LayersReady(Command):
    """The prefill computed the first ``layers`` layers of :class:`SaveLayers`
    ``command_id``'s blocks: their groups may be stored. ``event`` None: finished on the
    GPU; otherwise only launched, and ``event`` (a device event recorded after them) is what
    the save's copies wait for on the device. With state groups ``layers`` counts the layers
    whose blocks are stored (the backends' paged layers:
    :meth:`~kvstate._spec.CacheSpec.paged_layers_done`)."""

    command_id: int
    layers: int
    event: Any = None


@dataclass(slots=True)
class LendBlocks(TransferCommand):
    """Lend GPU blocks ``block_ids`` (holding ``keys``) to a D instance on this host, which
    pulls them straight into its own blocks (:mod:`kvstate.backends._lends`): each rank posts
    them with their checksums, and holds them until D released them, or until the deadline
    when nobody took them (until the fence when D still copies); answer the count D pulled
    whole (all or none). ``stores``: P writes them to the store as well (a
    :class:`WriteBlocks` beside this one), so a D whose pull failed waits for the store."""

    stores: bool = field(default=False, kw_only=True)


@dataclass(slots=True)
class SwapOut(TransferCommand):
    """Copy GPU block ``block_ids[i]`` into host tier slot ``host_slots[i]`` (the slot
    granted to ``keys[i]``); answer the leading count copied. Keys already in the host tier
    are not in the command: their bytes are there."""

    host_slots: tuple[int, ...] = field(default=(), kw_only=True)


@dataclass(slots=True)
class SwapIn(TransferCommand):
    """Copy host tier slot ``host_slots[i]`` (holding ``keys[i]``) into GPU block
    ``block_ids[i]``; answer the leading count copied."""

    host_slots: tuple[int, ...] = field(default=(), kw_only=True)


@dataclass(slots=True)
class FlushHost(TransferCommand):
    """Store host tier slot ``host_slots[i]`` (holding ``keys[i]``) under ``keys[i]``: a
    write-back from host memory, the GPU blocks long gone (``block_ids`` is empty). Like a
    write, a rank first skips the leading keys already stored; answer the leading count stored."""

    host_slots: tuple[int, ...] = field(default=(), kw_only=True)


@dataclass(slots=True)
class ArmRead(Command):
    """D reserved ``block_ids`` for ``keys`` and will read them there once P's first token
    comes: a driver whose backend pulls from a P on this host may prepare that pull now
    (``TransferBackend.arm_pull``), so that it starts with nothing left to launch, until
    ``deadline`` (the first token's, on the lifecycle's clock). A hint: nobody answers it, and
    a read that differs from it, or none at all, is right. The driver lets the prepared pull
    go when the request ends before its read, or reads other keys or blocks."""

    ranks: tuple[int, ...]
    deadline: float
    keys: tuple[str, ...]
    block_ids: tuple[int, ...]


@dataclass(slots=True)
class SendFirstToken(Command):
    """P tells D the first token (``error_code`` 200) or that the cache is missing (!= 200)."""

    token: int | None
    error_code: int


@dataclass(slots=True)
class StartPrefill(Command):
    """Blocks are ready: compute the prompt from token ``num_cached_tokens`` on.

    With state groups, ``state_pages[0]`` holds the running state (the state after
    ``num_cached_tokens`` tokens, or nothing yet at 0), and ``checkpoints`` are token counts
    the prefill passes, in order: copy the state after ``checkpoints[i]`` into
    ``state_pages[1 + i]`` (a prefill in chunks cut there does it between chunks). A
    ``state_from`` page (-1: none) holds the state after ``num_cached_tokens`` instead, one
    the GPU prefix cache kept and shares: copy it into ``state_pages[0]`` first. ``tables``
    are the other layer groups' blocks, with group tables (:mod:`kvstate._tables`)."""

    block_ids: tuple[int, ...]
    num_cached_tokens: int
    state_pages: tuple[int, ...] = field(default=(), kw_only=True)
    tables: tuple[tuple[int, ...], ...] = field(default=(), kw_only=True)
    checkpoints: tuple[int, ...] = field(default=(), kw_only=True)
    state_from: int = field(default=-1, kw_only=True)


@dataclass(slots=True)
class StartDecode(Command):
    """Every needed block holds its cache on every rank: the request may decode (with state
    groups, from the state in ``state_pages[0]``; with group tables, the other groups' blocks
    in ``tables``)."""

    block_ids: tuple[int, ...]
    state_pages: tuple[int, ...] = field(default=(), kw_only=True)
    tables: tuple[tuple[int, ...], ...] = field(default=(), kw_only=True)


@dataclass(slots=True)
class Recompute(Command):
    """Recompute the cache from token ``from_token`` on, then report ``recompute_done`` (with
    state groups, from the state in ``state_pages[0]``: the state after ``from_token`` tokens,
    or none at 0; with group tables, the other groups' blocks in ``tables``)."""

    block_ids: tuple[int, ...]
    from_token: int
    state_pages: tuple[int, ...] = field(default=(), kw_only=True)
    tables: tuple[tuple[int, ...], ...] = field(default=(), kw_only=True)


@dataclass(slots=True)
class FreeBlocks(Command):
    """A live request released these blocks (preempted; they are free once no transfer pins
    them). A request that ends reports its blocks in :class:`RequestEnded` instead."""

    block_ids: tuple[int, ...]


@dataclass(slots=True)
class CancelCommand(Command):
    """The command's answer is no longer awaited; a backend may skip work not yet started."""

    command_id: int


@dataclass(slots=True)
class RequestEnded(Command):
    """The request reached a terminal state (``done``, ``failed`` or ``aborted``) and released
    ``block_ids`` (free once no transfer pins them): no :class:`FreeBlocks` precedes it.

    ``reason`` says why, one of :data:`kvstate._policy.REASONS` (``"done"``,
    ``"first_token_timeout"``, ``"read_failed"``, ...)."""

    state: str
    error_code: int
    block_ids: tuple[int, ...] = ()
    reason: str = ""


@dataclass(slots=True)
class LateEvent(Command):
    """An event arrived for a request that had already ended (``ended``: its terminal state):
    it was dropped and changed nothing. ``event`` is ``"first_token"``, ``"layers_done"``,
    ``"prefill_done"``, ``"recompute_done"`` or ``"abort"``. A late first token means D gave up waiting: the
    cache P stored for it is not needed any more."""

    event: str
    ended: str


#: each command class's kind: the vocabulary drivers and the simulator dispatch on
KINDS: dict[type[Command], str] = {
    ReadBlocks: "read", LoadLayers: "read", WriteBlocks: "write", SaveLayers: "write", FlushHost: "write",
    SwapOut: "swap", SwapIn: "swap", LendBlocks: "lend", ArmRead: "arm",
    LayersReady: "layers", CancelCommand: "cancel",
    SendFirstToken: "notice", StartPrefill: "notice", StartDecode: "notice", Recompute: "notice",
    FreeBlocks: "notice", RequestEnded: "notice", LateEvent: "notice",
}
#: the kinds of transfer commands, each answered by a Completion from every rank it names
TRANSFER_KINDS = frozenset({"read", "write", "swap", "lend"})
#: transfers that move one layer group at a time (a save waits for its layers to be reported)
LAYERWISE = frozenset({LoadLayers, SaveLayers})


def kind_of(cmd: Command) -> str:
    """The kind of ``cmd`` (:data:`KINDS`); a subclass of a command has its parent's kind."""
    kind = KINDS.get(cmd.__class__)
    if kind is not None:
        return kind
    base = next((k for k in type(cmd).__mro__ if k in KINDS), None)
    if base is None:
        raise ValidationError(f"{type(cmd).__name__} is not a kvstate command")
    return KINDS[base]
