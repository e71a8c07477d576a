"""The simulation entry point: run a scenario and return its metrics."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .._errors import ConfigError
from .._timeline import Timeline
from .._validate import check_callable
from ._cluster import Cluster
from ._colocated_cluster import ColocatedCluster
from ._metrics import summarize
from ._scenario import Scenario, check_scenario

__all__ = ["simulate"]


def simulate(s: Scenario, progress: Callable[[int, int], None] | None = None,
             timeline: Timeline | None = None) -> dict[str, Any]:
    """Run ``s`` to its end; returns :func:`~kvstate.sim._metrics.summarize`'s object plus
    ``wall_s`` (left out of ``--json``, so equal seeds give equal bytes). ``progress(done,
    total)`` is called as requests end. ``timeline`` (a PD run's) records every request's
    states, transfers and steps on the simulated clock."""
    check_scenario(s, "simulate")
    check_callable(progress, "simulate: progress", optional=True, error=ConfigError)
    if timeline is not None and not isinstance(timeline, Timeline):
        raise ConfigError(f"simulate: timeline must be a kvstate Timeline or None, got {timeline!r}")
    t = time.perf_counter()
    cl: Cluster | ColocatedCluster
    if s.cluster.mode == "colocated":
        if timeline is not None:
            raise ConfigError("--timeline: recorded for PD runs (cluster.mode = \"pd\") only")
        cl = ColocatedCluster(s, on_end=progress)
    else:
        cl = Cluster(s, on_end=progress)
        if timeline is not None:
            timeline.clock = lambda: cl.env.now
            cl.sv.timeline = timeline
    out = summarize(cl, cl.run())
    out["wall_s"] = time.perf_counter() - t
    return out
