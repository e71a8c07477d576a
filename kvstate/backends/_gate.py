"""Layer gates: how far a layer-wise save may go, and how far a layer-wise load has come.

A :class:`~kvstate.commands.SaveLayers` is sent as the prefill starts, so a rank running it
must not store a layer group before the prefill computed its layers. The lifecycle says how
many are computed in :class:`~kvstate.commands.LayersReady` notices; the driver advances the
command's :class:`LayerGate` with them, and the backend asks the gate, before each group,
to wait until its layers are ready. Layers reported as launched come with a device event:
the gate hands it to the backend, whose copies wait for it on the device.

Every wait ends: when the layers are ready (True), when the gate is closed because the
command was cancelled (False), or when the command's fence passes on the lifecycle's clock
(False). A backend that gets False stops and answers what it stored whole so far.

A :class:`~kvstate.commands.LoadLayers` runs the other way: the backend reports each layer
group it has scattered (with the event that marks it on the device) into the command's
:class:`LayerArrivals`, which the engine's decode step waits on before each layer.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LayerGate", "LayerArrivals"]

_SLICE = 0.05  # seconds between fence checks while waiting (the clock may not be wall time)


class LayerGate:
    """The computed-layer count of one :class:`~kvstate.commands.SaveLayers`, thread-safe."""

    __slots__ = ("_cond", "layers", "closed", "fence", "clock", "_events")

    def __init__(self, fence: float = math.inf, clock: Callable[[], float] = time.monotonic) -> None:
        self._cond = threading.Condition()
        self.layers = 0  #: layers reported computed so far
        self.closed = False  #: cancelled: waits answer False at once
        self.fence, self.clock = fence, clock
        self._events: list[tuple[int, Any]] = []  # (layers, device event after them or None) per report

    def advance(self, layers: int, event: Any = None) -> None:
        """The first ``layers`` layers are computed (a smaller count than before is ignored):
        finished, or launched with ``event`` recorded after them."""
        with self._cond:
            if layers > self.layers:
                self.layers = layers
                self._events.append((layers, event))
                self._cond.notify_all()

    def close(self) -> None:
        """The command was cancelled: every wait, now or later, answers False."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def ready(self, layers: int, block: bool = True) -> Any:
        """Whether the first ``layers`` layers are computed, waiting for them when ``block``
        (until they are, the gate closes, or the fence passes): False if not; else True, or
        the device event of the report that covered them, which the copies must wait for."""
        with self._cond:
            while not self.closed and self.layers < layers:
                if not block or self.clock() >= self.fence:
                    return False
                self._cond.wait(_SLICE)
            if self.closed:
                return False
            ev = next((ev for n, ev in self._events if n >= layers), None)  # the first report covering them
            return True if ev is None else ev


class LayerArrivals:
    """The layers of one rank's :class:`~kvstate.commands.LoadLayers` that arrived, thread-safe."""

    __slots__ = ("_cond", "layers", "closed", "_events", "_on_arrive")

    def __init__(self, on_arrive: Callable[[int, Any], None] | None = None) -> None:
        self._cond = threading.Condition()
        self.layers = 0  #: leading layers scattered so far (enqueued on the device)
        self.closed = False  #: the load ended: no more layers will come
        self._events: list[tuple[int, Any]] = []  # (layers, the device event after their scatter)
        self._on_arrive = on_arrive  # also told of each arrival (a rank worker forwards them)

    def arrive(self, layers: int, event: Any = None) -> None:
        """The first ``layers`` layers are scattered; ``event`` (a device event, when the
        backend has one) completes once they are in place on the device."""
        with self._cond:
            self._events.append((layers, event))
            self.layers = max(self.layers, layers)
            self._cond.notify_all()
        if self._on_arrive is not None:
            self._on_arrive(layers, event)

    def close(self) -> None:
        """The load ended (answered, failed or cancelled): waits for missing layers give up."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def wait(self, layers: int, timeout: float) -> tuple[bool, Any]:
        """Wait until the first ``layers`` layers arrived: ``(True, event)``, the event to make
        the device wait on before using them (None: already in place); ``(False, None)`` if
        the load ended without them or ``timeout`` seconds passed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.layers >= layers or self.closed, timeout) \
                    or self.layers < layers:
                return False, None
            return True, next(ev for n, ev in self._events if n >= layers)
