"""Transfer ops moving paged KV blocks between GPU caches and host buffers.

One semantics (:mod:`kvstate.kernels.plan`), executed by the numpy reference
(:mod:`kvstate.kernels.reference`, exported here). The CUDA implementation belongs to the
kernels issue and is not exported until it exists.
"""
from .plan import DIRECTIONS, TransferPlan, coalesce_runs
from .reference import as_numpy, swap_cache_all_layers, swap_cache_layout, swap_cache_per_layer

__all__ = ["DIRECTIONS", "TransferPlan", "coalesce_runs", "as_numpy", "swap_cache_layout",
           "swap_cache_per_layer", "swap_cache_all_layers"]
