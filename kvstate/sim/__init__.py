"""The SimPy simulator: the production lifecycle machines on a simulated PD cluster.

- :mod:`~kvstate.sim.scenario` — validated TOML scenarios (the embedded default included);
- :mod:`~kvstate.sim.workload` — Poisson / gamma arrivals and Mooncake-format traces;
- :mod:`~kvstate.sim.compute` — the roofline compute model;
- :mod:`~kvstate.sim.storage` — the storage pool (LRU capacity, aggregate bandwidth);
- :mod:`~kvstate.sim.tp` — TP ranks' worker pools, barrier protocols, the deadlock search;
- :mod:`~kvstate.sim.cluster` — the SimPy driver of the P and D lifecycles;
- :mod:`~kvstate.sim.metrics` — metrics, report, JSON; :mod:`~kvstate.sim.plan` — capacity
  search; :mod:`~kvstate.sim.plot` — PNG charts.
"""
from .cluster import Cluster
from .metrics import format_report, simulate, to_json
from .plan import plan
from .scenario import Scenario, load_scenario, scenario_from_dict, with_overrides
from .tp import search_deadlocks
from .workload import load_trace

__all__ = ["Cluster", "Scenario", "load_scenario", "scenario_from_dict", "with_overrides", "simulate",
           "format_report", "to_json", "plan", "search_deadlocks", "load_trace"]
