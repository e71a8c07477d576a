"""GPU presets for ``--gpu``: datasheet figures and published all-reduce links.

Peaks are the vendors' dense (no sparsity) figures; HBM is the datasheet bandwidth. The
all-reduce figures are NCCL's bus bandwidth for large messages and its latency for small ones
between two GPUs, as nccl-tests publishes them for each link (NVLink 4 through NVSwitch with
multicast off, NVLink 3, PCIe 4 and 5). Kernel efficiencies (``mfu``, ``mbu``, ...) keep the
scenario's values: they are properties of the kernels, measured on one GPU (``kvstate
profile``) and carried to another through these figures (docs/benchmarks.md).
"""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError

__all__ = ["GPUS", "gpu_overrides"]

#: name -> the GpuSpec fields it sets
GPUS: dict[str, dict[str, Any]] = {
    "H100-SXM": {"tflops": 989.0, "fp8_tflops": 1979.0, "hbm_gbps": 3350.0, "mem_gib": 80.0,
                 "allreduce_gbps": 360.0, "allreduce_us": 8.0, "calibration": "h100"},
    "H200": {"tflops": 989.0, "fp8_tflops": 1979.0, "hbm_gbps": 4800.0, "mem_gib": 141.0,
             "allreduce_gbps": 360.0, "allreduce_us": 8.0, "calibration": "h100"},
    "H100-PCIe": {"tflops": 756.0, "fp8_tflops": 1513.0, "hbm_gbps": 2000.0, "mem_gib": 80.0,
                  "allreduce_gbps": 40.0, "allreduce_us": 12.0, "calibration": "h100"},
    "A100-SXM-80G": {"tflops": 312.0, "fp8_tflops": 312.0, "hbm_gbps": 2039.0, "mem_gib": 80.0,
                     "allreduce_gbps": 230.0, "allreduce_us": 10.0, "calibration": "h100"},
    "L40S": {"tflops": 362.0, "fp8_tflops": 733.0, "hbm_gbps": 864.0, "mem_gib": 48.0,
             "allreduce_gbps": 20.0, "allreduce_us": 15.0, "calibration": "h100"},
}


def gpu_overrides(name: str) -> dict[str, Any]:
    """``{"gpu.field": value}`` of preset ``name``."""
    if name not in GPUS:
        raise ConfigError(f"--gpu {name!r}: not a preset ({', '.join(GPUS)}); set gpu.* fields instead")
    return {"gpu.name": name, **{f"gpu.{k}": v for k, v in GPUS[name].items()}}
