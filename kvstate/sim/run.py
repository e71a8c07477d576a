"""The simulation entry point: run a scenario and return its metrics."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .cluster import Cluster
from .colocated_cluster import ColocatedCluster
from .metrics import summarize
from .scenario import Scenario

__all__ = ["simulate"]


def simulate(s: Scenario, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Run ``s`` to its end; returns :func:`~kvstate.sim.metrics.summarize`'s object plus
    ``wall_s`` (left out of ``--json``, so equal seeds give equal bytes). ``progress(done,
    total)`` is called as requests end."""
    t = time.perf_counter()
    cl: Cluster | ColocatedCluster = (ColocatedCluster(s, on_end=progress) if s.cluster.mode == "colocated"
                                      else Cluster(s, on_end=progress))
    out = summarize(cl, cl.run())
    out["wall_s"] = time.perf_counter() - t
    return out
