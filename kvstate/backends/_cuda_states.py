"""State pages on the GPU: the CUDA backend's side of :mod:`~kvstate.backends._stateobjects`.

Each rank holds its state pages as one device array ``[num_states, state bytes]`` of uint8:
zeroed CuPy memory, or the engine's own (any CUDA array CuPy takes: a PyTorch or Paddle tensor
viewed as bytes). A state moves between its page and a host buffer with one copy, under the
rank's lock on the backend's device; the store puts and gets it as the stateobjects rules say (the backend's
:class:`~kvstate.backends._stateobjects.StateObjects` part, handed :class:`DevicePages`' copies).
A state is a few MiB at most, so it is copied whole, without the blocks' staging ring, on the
rank's side stream (never CUDA's legacy default stream, where an engine's queued work would
hold the copy), and waited for there, within the swapper's timeout, before the call returns.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from .._errors import ValidationError

__all__ = ["DevicePages"]


class DevicePages:
    """A CUDA backend's state pages, a device array a rank, and their copies to and from the
    host. Given the backend's ``on(rank)`` (its rank's lock, its device current), ``stream(rank)``
    (the rank's side stream) and ``wait(rank)`` (for that stream, within the timeout)."""

    def __init__(self, cp: Any, ranks: tuple[int, ...], on: Callable[[int], Any], stream: Callable[[int], Any],
                 wait: Callable[[int], None]) -> None:
        self.cp, self.ranks = cp, ranks
        self._on, self._stream, self._wait = on, stream, wait
        self.pages: dict[int, Any] = {}  #: pages[rank] -> [num_states, state bytes] uint8 on the device

    def bind(self, owner: str, shape: tuple[int, int], pages: Mapping[int, Any] | None, device: int) -> None:
        """``shape`` pages a rank on ``device``: ``pages[rank]`` when given (checked), else zeroed."""
        if pages is not None and not isinstance(pages, Mapping):
            raise ValidationError(f"{owner}: states must map each rank to its state pages")
        for r in self.ranks:
            if pages is None:
                with self.cp.cuda.Device(device):
                    self.pages[r] = self.cp.zeros(shape, self.cp.uint8)
                continue
            a = self.cp.asarray(pages[r]) if r in pages else None
            if a is None or a.shape != shape or a.dtype != np.uint8 or not a.flags.c_contiguous:
                raise ValidationError(f"{owner}: state pages of rank {r} must be a contiguous "
                                      f"uint8 device array of shape {shape}")
            self.pages[r] = a

    @contextlib.contextmanager
    def _page(self, rank: int, page: int) -> Iterator[tuple[Any, Any]]:
        with self._on(rank):
            yield self.pages[rank][page], self._stream(rank)

    def gather(self, rank: int, page: int, out: np.ndarray) -> None:
        """Copy the rank's page ``page`` into host buffer ``out``."""
        with self._page(rank, page) as (p, stream):
            self._wait(rank)  # the stream's earlier work, within the timeout
            p.get(stream=stream, out=out)  # then the copy, which the get waits for

    def scatter(self, rank: int, page: int, data: np.ndarray) -> None:
        """Copy host bytes ``data`` into the rank's page ``page``, in place before it returns."""
        with self._page(rank, page) as (p, stream):
            p.set(data, stream=stream)
            self._wait(rank)  # in place before the caller counts it
