"""Prometheus metrics of a serving instance, read from the lifecycles and backends on scrape.

The lifecycle core keeps counters and does no I/O; this module turns what it and the backends
already count into Prometheus families when a scrape asks (:class:`KVStateCollector`), and
times transfers from the engine loop, which sees every command go out and every answer come
back (:class:`TransferMetrics`). Names follow Prometheus' conventions: a ``kvstate_`` prefix,
base units (seconds, bytes), ``_total`` on counters, labels for role, state, tier and kind.

- ``kvstate_requests{role,state}``: live requests by machine state;
- ``kvstate_requests_ended_total{role,outcome}``: ``done``, ``failed``, ``aborted``;
- ``kvstate_deadlines_fired_total{role}``: waits and transfers whose deadline fired;
- ``kvstate_blocks{role,tier,use}``: GPU blocks ``used``/``free``/``cached`` (prefix cache), host
  tier slots ``used``/``free``;
- ``kvstate_pinned_transfers{role}``: transfer commands outstanding (each pins its blocks);
- ``kvstate_bytes_moved_total{role,tier}``: bytes a backend moved to and from the store
  (``store``) and the host tier (``host``);
- ``kvstate_store_faults_total{role,kind}``: store faults a process driver's rank workers
  reported (``broken`` blocks, ``short`` reads, ``failed`` operations; pass the driver among
  ``backends``);
- ``kvstate_transfers_total{role,kind,outcome}`` and ``kvstate_transfer_seconds{role,kind}``:
  each rank's answer to a transfer command by outcome (``ok``, ``partial``, ``error``, ``lost``)
  and the time from the command's submission to it.

It needs ``prometheus_client`` (the ``metrics`` extra).
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from . import commands as C
from ._errors import ConfigError
from .events import Completion

try:
    from prometheus_client import CollectorRegistry, Histogram
    from prometheus_client import Counter as PromCounter
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError as e:  # pragma: no cover - the extra is installed wherever the tests run it
    raise ImportError("kvstate.prometheus needs prometheus_client: pip install 'kvstate[metrics]'") from e

__all__ = ["KVStateCollector", "TransferMetrics", "ENDED"]

ENDED = ("done", "failed", "aborted")  #: the outcomes a request ends with, as the lifecycles count them


class KVStateCollector:
    """A Prometheus collector over ``lifecycles`` (role name -> lifecycle) and, optionally, their
    ``backends`` (role name -> backend with ``bytes_moved``/``bytes_swapped``); register it in a
    ``CollectorRegistry``. Reading happens at scrape time, from the caller's thread: scrape from
    the engine's loop thread (or hold its lock), as the lifecycles are not thread-safe."""

    def __init__(self, lifecycles: Mapping[str, Any], backends: Mapping[str, Any] | None = None) -> None:
        if not isinstance(lifecycles, Mapping) or not lifecycles:
            raise ConfigError("KVStateCollector: lifecycles must map role names to lifecycles")
        for role, lc in lifecycles.items():
            if not isinstance(role, str) or not callable(getattr(lc, "stats", None)):
                raise ConfigError(f"KVStateCollector: {role!r} must name a lifecycle")
        self.lifecycles, self.backends = dict(lifecycles), dict(backends or {})

    def collect(self) -> Iterator[Any]:
        states = GaugeMetricFamily("kvstate_requests", "Live requests by machine state", labels=["role", "state"])
        ended = CounterMetricFamily("kvstate_requests_ended", "Requests ended, by outcome", labels=["role", "outcome"])
        fired = CounterMetricFamily("kvstate_deadlines_fired", "Deadlines that fired", labels=["role"])
        blocks = GaugeMetricFamily("kvstate_blocks", "Blocks by tier and use", labels=["role", "tier", "use"])
        pinned = GaugeMetricFamily("kvstate_pinned_transfers", "Transfer commands outstanding", labels=["role"])
        for role, lc in self.lifecycles.items():
            for state, n in sorted(Counter(lc.state_of(r) for r in lc.live_requests()).items()):
                states.add_metric([role, state], n)
            for outcome in ENDED:
                ended.add_metric([role, outcome], lc.counters.get(outcome, 0))
            fired.add_metric([role], lc.counters.get("expired", 0) + lc.counters.get("timed_out", 0))
            self._blocks(blocks, role, lc)
            pinned.add_metric([role], len(lc.pending_commands()))
        yield from (states, ended, fired, blocks, pinned)
        moved = CounterMetricFamily("kvstate_bytes_moved", "Bytes moved by tier", labels=["role", "tier"], unit="bytes")
        for role, b in self.backends.items():
            moved.add_metric([role, "store"], getattr(b, "bytes_moved", 0))
            moved.add_metric([role, "host"], getattr(b, "bytes_swapped", 0))
        yield moved
        faults = CounterMetricFamily("kvstate_store_faults", "Store faults rank workers reported, by kind",
                                     labels=["role", "kind"])
        for role, b in self.backends.items():
            if callable(getattr(b, "store_faults", None)):  # a process driver: its workers' reports
                for kind, n in b.store_faults().items():
                    faults.add_metric([role, kind], n)
        yield faults

    @staticmethod
    def _blocks(family: GaugeMetricFamily, role: str, lc: Any) -> None:
        st = lc.pool.stats()
        family.add_metric([role, "gpu", "used"], st.used)
        family.add_metric([role, "gpu", "free"], st.free)
        family.add_metric([role, "gpu", "cached"], st.cached)
        if lc.host is not None:
            hs = lc.host.stats()
            family.add_metric([role, "host", "used"], hs.entries)
            family.add_metric([role, "host", "free"], hs.free)


class TransferMetrics:
    """Transfer answers by kind and outcome, and their latency, as the engine loop sees them:
    call :meth:`submitted` with the commands it hands the driver and :meth:`completed` with
    the completions it feeds the lifecycle."""

    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.answers = PromCounter("kvstate_transfers", "Ranks' answers to transfer commands",
                                   ["role", "kind", "outcome"], registry=registry)
        self.latency = Histogram("kvstate_transfer_seconds", "From a transfer's submission to a rank's answer",
                                 ["role", "kind"], registry=registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        #: (role, command id) -> [kind, keys, submitted at, ranks yet to answer]; gone when all have
        self._open: dict[tuple[str, int], list[Any]] = {}

    def submitted(self, role: str, cmds: Iterable[C.Command]) -> None:
        now = self.clock()
        for cmd in cmds:
            if isinstance(cmd, C.TransferCommand):
                self._open[(role, cmd.command_id)] = [type(cmd).__name__, len(cmd.keys), now, len(cmd.ranks)]

    def completed(self, role: str, completions: Iterable[Completion]) -> None:
        now = self.clock()
        for c in completions:
            known = self._open.get((role, c.command_id))
            if known is None:
                continue  # a command submitted before these metrics, or answered stale
            kind, n, start, left = known
            outcome = "lost" if c.lost else "error" if c.error else "ok" if c.count == n else "partial"
            self.answers.labels(role, kind, outcome).inc()
            self.latency.labels(role, kind).observe(max(0.0, now - start))
            if left <= 1:
                del self._open[(role, c.command_id)]
            else:
                known[3] = left - 1

    @property
    def open_commands(self) -> int:
        """Commands some rank has yet to answer (a command a driver never answers stays here:
        every driver answers each, if only as cancelled or lost)."""
        return len(self._open)
