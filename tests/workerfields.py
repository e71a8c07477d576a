"""The fields of a rank worker's configuration, for tests that build one: what every
``WorkerConfig`` needs in one place, each test overriding what it is about."""
from __future__ import annotations

from typing import Any

from kvstate import CacheSpec

__all__ = ["SPEC", "worker_fields"]

#: TP 2, two layers: the smallest geometry a worker of rank 1 serves
SPEC = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=2)


def worker_fields(of: CacheSpec = SPEC, **kw: Any) -> dict[str, Any]:
    """Rank 1 of ``of``'s TP ranks, eight blocks, ipc addresses nothing listens on, a file
    store; ``kw`` replaces any of them (``spec`` too, as a dict)."""
    fields: dict[str, Any] = dict(rank=1, spec={f: getattr(of, f) for f in of.__dataclass_fields__}, num_blocks=8,
                                  command_address="ipc:///run/c", reply_address="ipc:///run/r",
                                  control_address="ipc:///run/x", store={"kind": "file", "root": "/tmp/pool"})
    fields.update(kw)
    return fields
