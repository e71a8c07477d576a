"""Transfer ops moving paged KV blocks between GPU caches and host buffers.

One semantics (:mod:`kvstate.kernels._plan`), two implementations: the numpy reference
(:mod:`kvstate.kernels._reference`) and CUDA kernels compiled at run time through CuPy
(:mod:`kvstate.kernels._cuda`, imported on demand: CuPy is optional). The ops exported here
dispatch on where the caches live.
"""
from ._ops import swap_cache_all_layers, swap_cache_layout, swap_cache_per_layer
from ._plan import DIRECTIONS, LayerSet, TransferPlan, coalesce_runs
from ._reference import as_numpy

__all__ = ["DIRECTIONS", "TransferPlan", "LayerSet", "coalesce_runs", "as_numpy", "swap_cache_layout",
           "swap_cache_per_layer", "swap_cache_all_layers"]
