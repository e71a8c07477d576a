"""The transfer cost model: how long a :class:`~kvstate.kernels._plan.TransferPlan` takes.

The model is a calibrated table, per direction, of the wall time of one synchronous
``swap_cache_layout`` call (``auto`` strategy) for a grid of chunk sizes and chunk counts,
measured on a GPU by ``benchmarks/calibrate.py`` and shipped as JSON in
``kvstate/kernels/calibration/``. A transfer of ``chunks`` (layer, block) chunks of
``chunk_bytes`` costs:

- at a calibrated chunk size: the piecewise-linear interpolation over chunk count of the
  measured times (extrapolated with the nearest segment's slope outside the grid);
- between two calibrated sizes: the geometric interpolation of their times, linear in
  log2(chunk size);
- beyond the largest size: its time scaled by bytes; below the smallest: its time.

A table rather than a formula, because the kernels' cost is not smooth: ``auto`` switches
strategy (zero-copy kernel, staged pipeline, strided DMA) with the size of a call, and
each has its own fixed cost. The calibration script reports the error on held-out points.
"""
from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import ConfigError, ValidationError
from ._plan import DIRECTIONS, TransferPlan

__all__ = ["DirectionCost", "TransferCostModel", "fit_cost_model", "CALIBRATION_DIR"]

CALIBRATION_DIR = Path(__file__).with_name("calibration")


@dataclass(frozen=True)
class DirectionCost:
    """The calibration table of one direction: ``table[i]`` is the ascending
    ``((chunks, seconds), ...)`` curve measured at ``chunk_sizes[i]``."""

    bandwidth_Bps: float  #: one large pinned copy (reported, and used beyond the largest size)
    chunk_sizes: tuple[int, ...]
    table: tuple[tuple[tuple[int, float], ...], ...]

    def __post_init__(self) -> None:
        if not self.bandwidth_Bps > 0:
            raise ConfigError("cost model: bandwidth_Bps must be > 0")
        if not self.chunk_sizes or len(self.chunk_sizes) != len(self.table):
            raise ConfigError("cost model: chunk_sizes and table need the same, non-zero length")
        if list(self.chunk_sizes) != sorted(set(self.chunk_sizes)) or self.chunk_sizes[0] <= 0:
            raise ConfigError("cost model: chunk_sizes must be positive and strictly ascending")
        for size, curve in zip(self.chunk_sizes, self.table):
            xs = [c for c, _ in curve]
            if len(xs) < 2 or xs != sorted(set(xs)) or xs[0] <= 0 or any(not t > 0 for _, t in curve):
                raise ConfigError(f"cost model: the curve of chunk size {size} needs >= 2 points with "
                                  "ascending chunk counts > 0 and times > 0")
        object.__setattr__(self, "_logs", tuple(math.log2(s) for s in self.chunk_sizes))

    def _at(self, i: int, chunks: int) -> float:
        curve = self.table[i]
        j = bisect.bisect_right([c for c, _ in curve], chunks) - 1
        j = min(max(j, 0), len(curve) - 2)
        (x0, y0), (x1, y1) = curve[j], curve[j + 1]
        return max(y0 + (y1 - y0) * (chunks - x0) / (x1 - x0), y0 * 0.5 if chunks < x0 else 0.0, 1e-9)

    def seconds(self, chunks: int, chunk_bytes: int) -> float:
        sizes = self.chunk_sizes
        if chunk_bytes <= sizes[0]:
            return self._at(0, chunks)
        if chunk_bytes >= sizes[-1]:
            return self._at(len(sizes) - 1, chunks) * chunk_bytes / sizes[-1]
        i = bisect.bisect_right(sizes, chunk_bytes) - 1
        if sizes[i] == chunk_bytes:
            return self._at(i, chunks)
        logs = self._logs  # type: ignore[attr-defined]
        f = (math.log2(chunk_bytes) - logs[i]) / (logs[i + 1] - logs[i])
        return math.exp((1 - f) * math.log(self._at(i, chunks)) + f * math.log(self._at(i + 1, chunks)))


class TransferCostModel:
    """Seconds a transfer takes on the calibrated GPU: see the module docstring."""

    def __init__(self, directions: Mapping[str, DirectionCost], gpu: str = "", source: str = "") -> None:
        if set(directions) != set(DIRECTIONS):
            raise ConfigError(f"cost model: needs exactly the directions {DIRECTIONS}, got {sorted(directions)}")
        self.directions = dict(directions)
        self.gpu = gpu
        self.source = source

    def time(self, plan: TransferPlan) -> float:
        """Seconds to execute ``plan`` (one call of a swap op)."""
        return self.time_of(plan.direction, plan.chunks, plan.chunk_bytes)

    def time_of(self, direction: str, chunks: int, chunk_bytes: int) -> float:
        """Seconds to move ``chunks`` chunks of ``chunk_bytes`` in one call (0 chunks: free)."""
        d = self.directions.get(direction)
        if d is None:
            raise ValidationError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if chunks <= 0:
            return 0.0
        return d.seconds(chunks, chunk_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "source": self.source, "directions": {
            k: {"bandwidth_Bps": d.bandwidth_Bps, "chunk_sizes": list(d.chunk_sizes),
                "table": [[list(p) for p in curve] for curve in d.table]}
            for k, d in sorted(self.directions.items())}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "<dict>") -> TransferCostModel:
        try:
            dirs = {k: DirectionCost(float(v["bandwidth_Bps"]), tuple(int(s) for s in v["chunk_sizes"]),
                                     tuple(tuple((int(c), float(t)) for c, t in curve) for curve in v["table"]))
                    for k, v in data["directions"].items()}
            return cls(dirs, str(data.get("gpu", "")), str(data.get("source", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"{where}: not a cost-model calibration ({type(e).__name__}: {e})") from None
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    @classmethod
    def load(cls, name_or_path: str = "h100") -> TransferCostModel:
        """A shipped calibration by name (``"h100"``) or a JSON file written by the calibration script."""
        p = Path(name_or_path)
        if not p.suffix:
            p = CALIBRATION_DIR / f"{name_or_path}.json"
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            shipped = sorted(q.stem for q in CALIBRATION_DIR.glob("*.json"))
            raise ConfigError(f"calibration {name_or_path!r} not found (shipped: {shipped}, or a JSON path)") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not JSON ({e})") from None
        return cls.from_dict(data.get("model", data), str(p))


def fit_cost_model(samples: Iterable[Mapping[str, Any]], limits_Bps: Mapping[str, float],
                   gpu: str = "", source: str = "") -> TransferCostModel:
    """The table of measurements ``{"direction", "chunk_bytes", "chunks", "seconds"}``
    (repeated points: their median)."""
    groups: dict[tuple[str, int, int], list[float]] = {}
    for s in samples:
        groups.setdefault((s["direction"], int(s["chunk_bytes"]), int(s["chunks"])), []).append(float(s["seconds"]))
    dirs: dict[str, DirectionCost] = {}
    for direction in DIRECTIONS:
        sizes = sorted({c for (d, c, _) in groups if d == direction})
        table = []
        for c in sizes:
            curve = []
            for (d, cc, n), ts in sorted(groups.items()):
                if d == direction and cc == c:
                    ts = sorted(ts)
                    curve.append((n, ts[len(ts) // 2]))
            table.append(tuple(curve))
        dirs[direction] = DirectionCost(float(limits_Bps[direction]), tuple(sizes), tuple(table))
    return TransferCostModel(dirs, gpu, source)
