"""Measured kernel profiles: what ``kvstate profile`` writes, and their interpolation.

A profile holds, for one model's shapes at one TP degree on one GPU, the measured seconds of
each GEMM of a layer (and the LM head) over the tokens in a step, of a prefill's attention
over its length, of a decode step's attention over (batch, context), of a layer's
element-wise kernels over the tokens, and, where several GPUs were present, of an all-reduce
over its bytes. :class:`Profile` answers those times for any size: log-log interpolation
between the measured points, proportional beyond the largest (a kernel that big is
throughput-bound), the smallest point's time below the smallest (launch-bound).

A profile measured on one GPU serves another through the two datasheets: each op is found
compute- or memory-bound on the GPU it was measured on (its FLOPs and bytes against that
GPU's peak and bandwidth), and its time is scaled by the ratio of the bound that holds.
"""
from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import ConfigError
from ._scenario import WEIGHT_KINDS

__all__ = ["Profile", "Curve", "FORMAT", "SHAPE_FIELDS"]

FORMAT = "kvstate-profile"
SHIPPED = Path(__file__).with_name("profiles")  #: profiles measured on the device machine's H200
#: the model fields a profile's shapes are measured for: a scenario must match them
SHAPE_FIELDS = ("hidden", "num_heads", "total_kv_heads", "head_dim", "intermediate", "vocab", "experts",
                "experts_per_token", "shared_experts", "moe_intermediate", "weight_dtype")


class Curve:
    """Seconds over one size, from measured ``(size, seconds)`` points."""

    __slots__ = ("_x", "_y", "name")

    def __init__(self, points: Sequence[Sequence[float]], name: str) -> None:
        pts = sorted((float(x), float(y)) for x, y in points)
        if not pts or any(not (x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y)) for x, y in pts):
            raise ConfigError(f"profile: {name} needs points of size > 0 and seconds > 0")
        self._x = [math.log(x) for x, _ in pts]
        self._y = [math.log(y) for _, y in pts]
        self.name = name

    def __call__(self, size: float) -> float:
        if size <= 0:
            return 0.0
        lx, xs, ys = math.log(size), self._x, self._y
        if lx <= xs[0]:
            return math.exp(ys[0])
        if lx >= xs[-1]:
            return math.exp(ys[-1] + (lx - xs[-1]))  # proportional beyond the largest point
        i = bisect.bisect_right(xs, lx)
        f = (lx - xs[i - 1]) / (xs[i] - xs[i - 1])
        return math.exp(ys[i - 1] + f * (ys[i] - ys[i - 1]))


class Profile:
    """A loaded profile (see the module's docstring)."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != 1:
            raise ConfigError(f"{source}: not a kvstate profile (format {FORMAT!r}, version 1)")
        try:
            self.gpu = {k: float(data["gpu"][k]) for k in ("tflops", "hbm_gbps")}
            self.gpu_name = str(data["gpu"].get("name", "?"))
            self.model = dict(data["model"])
            self.tp = int(data["tp"])
            self.gemm = {name: Curve(pts, f"gemm {name}") for name, pts in data["gemm"].items()}
            self.attn_prefill = Curve(data["attn_prefill"], "attn_prefill")
            self.elementwise = Curve(data["elementwise"], "elementwise")
            decode = np.asarray(data["attn_decode"], dtype=float)
            self.allreduce = Curve(data["allreduce"], "allreduce") if data.get("allreduce") else None
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{source}: a profile field is missing or malformed ({e})") from None
        if decode.ndim != 2 or decode.shape[1] != 3 or len(decode) < 2:
            raise ConfigError(f"{source}: attn_decode needs at least two [batch, context, seconds] points")
        # a decode step's attention: a fixed part and a part proportional to the KV it reads
        tokens = decode[:, 0] * decode[:, 1]
        slope, base = np.polyfit(tokens, decode[:, 2], 1)
        self.decode_base, self.decode_per_token = max(float(base), 0.0), max(float(slope), 0.0)
        self.source = source

    @staticmethod
    def shipped(name_or_path: str) -> Path:
        """A profile shipped with kvstate (``kvstate/sim/profiles/NAME.json``, e.g.
        ``h200-llama-2-7b-tp1``: measured on the device machine's H200) if ``name_or_path`` names
        one, else the path itself."""
        p = SHIPPED / f"{name_or_path}.json"
        return p if "/" not in name_or_path and p.is_file() else Path(name_or_path)

    @staticmethod
    def shipped_names() -> list[str]:
        return sorted(p.stem for p in SHIPPED.glob("*.json"))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p = Path(path)
        try:
            return cls(json.loads(p.read_text(encoding="utf-8")), str(p))
        except FileNotFoundError:
            raise ConfigError(f"{p}: profile not found (a path, or a shipped one: "
                              f"{', '.join(Profile.shipped_names())})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: not a JSON profile ({e})") from None

    def check_matches(self, model: Any, tp: int, where: str) -> None:
        """The scenario's model and TP are the ones measured (a GEMM's shape is its time)."""
        if tp != self.tp:
            raise ConfigError(f"{where}: the profile {self.source} was measured at TP {self.tp}, the scenario runs "
                              f"TP {tp}: measure one at TP {tp} (kvstate profile --tp {tp})")
        for f in SHAPE_FIELDS:
            mine, theirs = self.model.get(f), getattr(model, f)
            if f == "weight_dtype":  # bfloat16 and float16 run alike: compare what a weight costs
                mine, theirs = (WEIGHT_KINDS.get(x, x) if x is not None else None for x in (mine, theirs))
            if f in self.model and mine != theirs:
                raise ConfigError(f"{where}: the profile {self.source} was measured for {f} = {self.model[f]}, the "
                                  f"scenario's model has {theirs}")
