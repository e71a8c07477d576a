"""The ``kvstate profile`` command: measure a model's kernels on this GPU into a profile file."""
from __future__ import annotations

import argparse
import json
from typing import Any

from ._argtypes import POSITIVE_INT
from ._simcmds import check_output_file, write_json

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("profile", help="time a model's GEMMs, attention, element-wise kernels and all-reduce on "
                                       "this GPU; a scenario given the file (gpu.profile) interpolates it")
    p.add_argument("--model", required=True, metavar="NAME_OR_CONFIG",
                   help="a model preset (llama-3-8b, ...) or a Hugging Face config.json")
    p.add_argument("--tp", type=POSITIVE_INT, default=1, help="the TP degree whose per-rank shapes are timed "
                                                              "(all-reduce too, where that many GPUs are present)")
    p.add_argument("--out", required=True, help="the profile file to write (JSON)")
    p.add_argument("--quick", action="store_true", help="half the token sizes (a quicker, coarser profile)")


def run(args: argparse.Namespace) -> int:
    from ..sim._models import resolve_model
    from ._gpuprofile import measure_profile

    out = check_output_file(args.out, "--out")
    model = resolve_model(args.model)
    profile = measure_profile(model, args.tp, quick=args.quick)
    write_json(out, profile, "--out")
    gemm = profile["gemm"]
    print(f"kvstate profile: {model.name} at TP {args.tp} on {profile['gpu']['name']}: {len(gemm)} GEMMs over "
          f"{len(next(iter(gemm.values())))} sizes, attention, element-wise"
          + (", all-reduce" if profile["allreduce"] else "") + f"; wrote {out}")
    print(json.dumps({"gpu": profile["gpu"], "tp": args.tp}))
    return 0
