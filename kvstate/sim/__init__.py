"""The SimPy simulator: the production lifecycle machines on a simulated PD cluster.

- :mod:`~kvstate.sim.scenario` — validated scenarios (the embedded default included);
  :mod:`~kvstate.sim.scenario_io` — TOML files, overrides; :mod:`~kvstate.sim.models` — model
  presets and Hugging Face configs; :mod:`~kvstate.sim.presets` — shipped scenarios;
- :mod:`~kvstate.sim.workload` — Poisson / gamma arrivals and Mooncake-format traces;
- :mod:`~kvstate.sim.compute` — the roofline compute model;
- :mod:`~kvstate.sim.storage` — the storage pool (LRU capacity, aggregate bandwidth);
- :mod:`~kvstate.sim.tp` — TP ranks' worker pools, barrier protocols, the deadlock search;
- :mod:`~kvstate.sim.instance`, :mod:`~kvstate.sim.prefill`, :mod:`~kvstate.sim.decode` — the
  SimPy drivers of the P and D lifecycles; :mod:`~kvstate.sim.router` — routing;
- :mod:`~kvstate.sim.cluster` — one run wired together; :mod:`~kvstate.sim.run` — its entry point;
- :mod:`~kvstate.sim.metrics` — metrics; :mod:`~kvstate.sim.report` — text and JSON;
  :mod:`~kvstate.sim.capacity` — capacity planning; :mod:`~kvstate.sim.plot` — PNG charts.
"""
from .capacity import plan
from .cluster import Cluster
from .report import format_report, to_json
from .run import simulate
from .scenario import Scenario
from .scenario_io import load_scenario, scenario_from_dict, to_toml, with_overrides
from .tp import search_deadlocks
from .workload import load_trace

__all__ = ["Cluster", "Scenario", "load_scenario", "scenario_from_dict", "with_overrides", "to_toml", "simulate",
           "format_report", "to_json", "plan", "search_deadlocks", "load_trace"]
