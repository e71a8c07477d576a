"""State pages on the GPU: the CUDA backend's side of :mod:`~kvstate.backends.stateobjects`.

Each rank holds its state pages as one device array ``[num_states, state bytes]`` of uint8:
zeroed CuPy memory, or the engine's own (any CUDA array CuPy takes: a PyTorch or Paddle tensor
viewed as bytes). A state moves between its page and a host buffer with one copy, under the
rank's lock on the backend's device; the store puts and gets it as the stateobjects rules say.
A state is a few MiB at most, so it is copied whole, without the blocks' staging ring, on the
rank's side stream (never CUDA's legacy default stream, where an engine's queued work would
hold the copy), and waited for there, within the swapper's timeout, before the call returns.
"""
from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from ..errors import ValidationError
from ..spec import CacheSpec
from .stateobjects import StateObjects

__all__ = ["DeviceStates"]


class DeviceStates(StateObjects):
    """Mixed into :class:`~kvstate.backends.cuda.CudaBackend`, which gives ``cp``, its ranks and ``_on``."""

    cp: Any
    ranks: tuple[int, ...]
    _side_stream: Callable[[int], Any]  # the backend's (DeviceSums'): a rank's own stream
    _side_wait: Callable[[int], None]  # the backend's (DeviceSums'): wait for it, with a timeout

    @abstractmethod
    def _on(self, rank: int) -> contextlib.AbstractContextManager[None]:
        """The rank's lock with the backend's device current (the CUDA backend's)."""

    def _bind_states(self, spec: CacheSpec, num_states: int, pages: Mapping[int, Any] | None, device: int) -> None:
        """``num_states`` pages a rank on ``device``: ``pages[rank]`` when given (checked), else zeroed."""
        self._setup_states(spec, num_states)
        shape = (num_states, self.state_size)
        self.state_pages: dict[int, Any] = {}
        if pages is not None and not isinstance(pages, Mapping):
            raise ValidationError(f"{type(self).__name__}: states must map each rank to its state pages")
        for r in self.ranks:
            if pages is None:
                with self.cp.cuda.Device(device):
                    self.state_pages[r] = self.cp.zeros(shape, self.cp.uint8)
                continue
            a = self.cp.asarray(pages[r]) if r in pages else None
            if a is None or a.shape != shape or a.dtype != np.uint8 or not a.flags.c_contiguous:
                raise ValidationError(f"{type(self).__name__}: state pages of rank {r} must be a contiguous "
                                      f"uint8 device array of shape {shape}")
            self.state_pages[r] = a

    @contextlib.contextmanager
    def _page(self, rank: int, page: int) -> Iterator[tuple[Any, Any]]:
        with self._on(rank):
            yield self.state_pages[rank][page], self._side_stream(rank)

    def _gather_state(self, rank: int, page: int, out: np.ndarray) -> None:
        with self._page(rank, page) as (p, stream):
            self._side_wait(rank)  # the stream's earlier work, within the timeout
            p.get(stream=stream, out=out)  # then the copy, which the get waits for

    def _scatter_state(self, rank: int, page: int, data: np.ndarray) -> None:
        with self._page(rank, page) as (p, stream):
            p.set(data, stream=stream)
            self._side_wait(rank)  # in place before the caller counts it
