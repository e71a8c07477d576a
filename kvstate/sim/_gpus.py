"""GPU presets for ``--gpu``: datasheet figures and published all-reduce links.

Peaks are the vendors' dense (no sparsity) figures; HBM is the datasheet bandwidth. Each link
has two all-reduce algorithms (see :mod:`~kvstate.sim._compute`):

- the one-shot kernel an engine uses for small messages (vLLM's custom all-reduce over NVLink):
  on an H100 SXM at TP 2, 5 µs and ~200 GB/s, as published for vLLM's kernel with the RMSNorm
  after it (vllm-project/vllm#22086, hidden 8192: 10 µs at 512 KB, 12 µs at 1 MB, 17 µs at
  2 MB) and for CUDA-graph one-shot kernels (flagos-ai/FlagGems-vllm#773: 7 µs at 74 KB, 13 µs
  at 1.7 MB);
- NCCL's ring for large ones: its latency as Vidur's H100 profile measured it through
  ``torch.distributed`` (~35 µs up to a few MB, ``data/profiling/network/h100_dgx``), and the
  NVLink 4 bus bandwidth nccl-tests reports (~360 GB/s; Vidur's 64 MB points give 320-370).

Without NVLink (PCIe parts) both algorithms cross PCIe: its bus bandwidth (PCIe 4.0 ~20 GB/s,
PCIe 5.0 ~40 GB/s as NCCL reaches it through a switch). Kernel efficiencies (``mfu``, ``mbu``,
...) keep the scenario's values: they are properties of the kernels, measured on one GPU
(``kvstate profile``) and carried to another through these figures (docs/benchmarks.md).

Prices are public on-demand list prices per GPU-hour, USD, for the plan's cost: one vendor's
where it lists the part (Modal's pricing page, as reported on 2026-05-07: H100 3.95, A100 80GB
2.50, L40S 1.95; H200 4.54 from the same page), Lambda's for the PCIe H100 (2.86). They move;
a scenario sets its own (``gpu.price_per_hour``, ``cluster.d_price_per_hour``).
"""
from __future__ import annotations

from typing import Any

from .._errors import ConfigError

__all__ = ["GPUS", "gpu_overrides", "gpu_fields"]

_NVLINK4 = {"allreduce_us": 5.0, "allreduce_ll_gbps": 200.0, "allreduce_ring_us": 35.0, "allreduce_gbps": 360.0,
            "calibration": "h100"}


def _pcie(busbw: float) -> dict[str, Any]:
    """A PCIe link: both algorithms at its bus bandwidth."""
    return {"allreduce_us": 15.0, "allreduce_ll_gbps": busbw, "allreduce_ring_us": 35.0, "allreduce_gbps": busbw,
            "calibration": "h100"}


#: name -> the GpuSpec fields it sets
GPUS: dict[str, dict[str, Any]] = {
    "H100-SXM": {"tflops": 989.0, "fp8_tflops": 1979.0, "hbm_gbps": 3350.0, "mem_gib": 80.0, **_NVLINK4,
                 "price_per_hour": 3.95},
    "H200": {"tflops": 989.0, "fp8_tflops": 1979.0, "hbm_gbps": 4800.0, "mem_gib": 141.0, **_NVLINK4,
             "price_per_hour": 4.54},
    "H100-PCIe": {"tflops": 756.0, "fp8_tflops": 1513.0, "hbm_gbps": 2000.0, "mem_gib": 80.0,
                  **_pcie(40.0), "price_per_hour": 2.86},
    "A100-SXM-80G": {"tflops": 312.0, "fp8_tflops": 312.0, "hbm_gbps": 2039.0, "mem_gib": 80.0,
                     "allreduce_us": 6.0, "allreduce_ll_gbps": 130.0, "allreduce_ring_us": 35.0,
                     "allreduce_gbps": 230.0, "calibration": "h100", "price_per_hour": 2.50},
    "L40S": {"tflops": 362.0, "fp8_tflops": 733.0, "hbm_gbps": 864.0, "mem_gib": 48.0, **_pcie(20.0),
             "price_per_hour": 1.95},
}


def gpu_overrides(name: str) -> dict[str, Any]:
    """``{"gpu.field": value}`` of preset ``name``."""
    return {f"gpu.{k}": v for k, v in gpu_fields(name, "--gpu").items()}


def gpu_fields(name: str, option: str) -> dict[str, Any]:
    """The GpuSpec fields preset ``name`` sets, its name among them (``option``: what named it)."""
    if name not in GPUS:
        raise ConfigError(f"{option} {name!r}: not a preset ({', '.join(GPUS)}); set gpu.* fields instead")
    return {"name": name, **GPUS[name]}
