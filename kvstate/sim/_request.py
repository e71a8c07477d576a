"""The simulator's record of one request: what the workload asked, where it ran, when things happened."""
from __future__ import annotations

from array import array
from typing import Any

from ._workload import Arrival, unique_start, unique_tokens

__all__ = ["SimRequest"]


class SimRequest:
    """One request of a run: its arrival, timestamps, decode progress and end.

    Decode progress is lazy while the request sits in a D batch (see
    :mod:`kvstate.sim._decode`): ``generated`` and ``ctx`` hold their values as of step ``s0``.
    """

    __slots__ = ("rid", "index", "arrival", "input_len", "out", "tokens", "d", "p", "first_token",
                 "finish", "last_token", "state", "error", "reason", "generated", "ctx", "synced", "cap",
                 "base", "_decoded", "preemptions", "cached_tokens", "s0", "ver", "event_step", "explicit",
                 "preempted_at")

    def __init__(self, a: Arrival) -> None:
        self.rid = f"r{a.index}"
        self.index = a.index
        self.arrival = a.time
        self.input_len = a.input_len
        self.out = a.output_len  #: tokens to generate, the first (from P) included
        self.tokens: array | None = a.tokens  # handed to the lifecycles, then dropped
        self.d: Any = None  #: the D instance it runs on (a DecodeInstance; typed loosely: no import circle)
        self.p: Any = None  #: the P instance it was admitted on
        self.first_token: float | None = None
        self.finish: float | None = None
        self.last_token = 0.0  #: when its latest token came out (inter-token gaps)
        self.state = "arrived"
        self.error = 200
        self.reason = ""  #: why it ended (kvstate._policy.REASONS, or "rejected_too_long")
        self.generated = 0
        self.ctx = 0  #: tokens whose cache D holds
        self.synced = 0  #: tokens D's lifecycle knows of
        self.cap = 0  #: tokens its D blocks can hold
        self.base = unique_start(a.index, salt=1)  #: where the run of its decoded tokens starts
        self._decoded: array | None = None  # that run's tokens from the prompt's end, made at first use
        self.preemptions = 0
        self.preempted_at: float | None = None  #: when its pending preemption began
        self.cached_tokens = 0  #: prompt tokens P found cached (GPU, host memory or storage)
        self.s0 = 0  #: the D step its progress is counted from
        self.ver = 0  #: bumped when it leaves a batch: its scheduled event is stale
        self.event_step = -1  #: the D step of its next event (-1: none)
        self.explicit = False  #: its next token's gap is not one step (it joined, or stalled)

    def decoded(self, lo: int, hi: int) -> array:
        """Its tokens ``lo .. hi-1`` past the prompt (``lo > input_len``): its own run from
        ``base``, made once for every token it can decode, then sliced (a numpy call each
        time would cost ten slices)."""
        start = self.input_len + 1
        run = self._decoded
        if run is None:
            run = self._decoded = unique_tokens(self.base, start, start + self.out)
        if lo < start or hi > start + len(run):
            return unique_tokens(self.base, lo, hi)  # past what it decodes: not in the run
        return run[lo - start:hi - start]

    def drop_tokens(self) -> None:
        """Let go of its decoded tokens' run once it has ended: a run's records outlive their
        requests (the report reads them), its token arrays need not."""
        self._decoded = None
