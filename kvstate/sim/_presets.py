"""Shipped scenarios, as overrides of the embedded default (``kvstate scenario NAME`` prints one)."""
from __future__ import annotations

import dataclasses
from typing import Any

from .._errors import ConfigError
from ._models import MODELS
from ._scenario import Scenario
from ._scenario_io import with_overrides

__all__ = ["PRESETS", "preset", "describe"]

_H200 = {"gpu.name": "H200", "gpu.mem_gib": 141.0, "gpu.hbm_gbps": 4800.0, "gpu.price_per_hour": 4.54}


def _model(name: str) -> dict[str, Any]:
    return {f"model.{k}": v for k, v in dataclasses.asdict(MODELS[name]).items()}


#: name -> (what it is, its overrides of the default)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "default": ("Llama-3-8B on 2 P + 2 D instances at TP 2 (H100), Poisson arrivals at 40 req/s, "
                "2,048-token prompts sharing 16 prefixes", {}),
    "llama-3-70b-h200": ("Llama-3-70B on 1 P + 2 D instances at TP 4 (H200), bursty arrivals (gamma, "
                         "cv 2) at 6 req/s of 4,096-token prompts and 512-token answers: about twice "
                         "what P can prefill", {
                             **_model("llama-3-70b"), **_H200, "cluster.n_prefill": 1, "cluster.n_decode": 2,
                             "cluster.tp": 4, "workload.arrival": "gamma", "workload.cv": 2.0,
                             "workload.rate": 6.0, "workload.num_requests": 600, "workload.input_dist": "fixed",
                             "workload.input_mean": 4096.0, "workload.output_dist": "fixed",
                             "workload.output_mean": 512.0}),
    "long-prompts": ("Llama-3-8B with 16k-token prompts that share 8 system prefixes of 4,096 "
                     "tokens, short answers: prefill- and storage-bound", {
                         "cluster.n_prefill": 3, "cluster.n_decode": 1, "workload.rate": 3.0,
                         "workload.num_requests": 500, "workload.input_mean": 16384.0,
                         "workload.input_sigma": 0.3, "workload.input_max": 32768,
                         "workload.output_mean": 64.0, "workload.output_max": 512,
                         "workload.prefix_groups": 8, "workload.prefix_tokens": 4096}),
    "deepseek-v3-h200": ("DeepSeek-V3 (MLA, 256 experts, fp8) on 1 P + 1 D instance at TP 8 (H200), 4,096-token "
                         "prompts and 512-token answers at 1.5 req/s: its latent cache is stored once, not "
                         "once a rank", {
                             **_model("deepseek-v3"), **_H200, "cluster.n_prefill": 1, "cluster.n_decode": 1,
                             "cluster.tp": 8, "workload.rate": 1.5, "workload.num_requests": 300,
                             "workload.input_mean": 4096.0, "workload.output_mean": 512.0,
                             "workload.prefix_tokens": 1024}),
    "gemma-3-27b-h200": ("Gemma-3-27B (52 sliding-window layers of 1,024 tokens, 10 full) on 2 P + 2 D "
                         "instances at TP 1 (H200), 8,192-token prompts at 4 req/s: more than 2 P prefill within "
                         "the TTFT SLO", {
                             **_model("gemma-3-27b"), **_H200, "cluster.tp": 1, "workload.rate": 4.0,
                             "workload.num_requests": 600, "workload.input_mean": 8192.0,
                             "workload.input_max": 32768, "workload.prefix_tokens": 2048}),
}


def preset(name: str) -> Scenario:
    """The shipped scenario ``name``."""
    if name not in PRESETS:
        raise ConfigError(f"no scenario preset {name!r} (presets: {', '.join(PRESETS)})")
    s = with_overrides(Scenario(), PRESETS[name][1])
    return dataclasses.replace(s, source=f"<preset {name}>")


def describe(name: str) -> str:
    return PRESETS[name][0]
