"""The SimPy simulator: the production lifecycle machines on a simulated PD cluster.

- :mod:`~kvstate.sim._scenario` — validated scenarios (the embedded default included);
  :mod:`~kvstate.sim._scenario_io` — TOML files, overrides; :mod:`~kvstate.sim._models` — model
  presets and Hugging Face configs; :mod:`~kvstate.sim._presets` — shipped scenarios;
- :mod:`~kvstate.sim._workload` — Poisson / gamma arrivals and Mooncake-format traces;
- :mod:`~kvstate.sim._compute` — the roofline compute model;
- :mod:`~kvstate.sim._storage` — the storage pool (LRU capacity, aggregate bandwidth);
- :mod:`~kvstate.sim._tp` — TP ranks' worker pools, barrier protocols, the deadlock search;
- :mod:`~kvstate.sim._instance`, :mod:`~kvstate.sim._prefill`, :mod:`~kvstate.sim._decode` — the
  SimPy drivers of the P and D lifecycles; :mod:`~kvstate.sim._router` — routing;
- :mod:`~kvstate.sim._cluster` — one run wired together; :mod:`~kvstate.sim._run` — its entry point;
- :mod:`~kvstate.sim._metrics` — metrics; :mod:`~kvstate.sim._report` — text and JSON;
  :mod:`~kvstate.sim._capacity` — capacity planning and the highest rate held; :mod:`~kvstate.sim._plot` — PNG charts.
"""
from ._capacity import plan
from ._cluster import Cluster
from ._report import format_report, to_json
from ._run import simulate
from ._scenario import Scenario
from ._scenario_io import load_scenario, scenario_from_dict, to_toml, with_overrides
from ._tp import search_deadlocks
from ._workload import load_trace

__all__ = ["Cluster", "Scenario", "load_scenario", "scenario_from_dict", "with_overrides", "to_toml", "simulate",
           "format_report", "to_json", "plan", "search_deadlocks", "load_trace"]
