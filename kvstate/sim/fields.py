"""The base of every scenario section: typed fields with a default and a line of doc, checked
when built, and the rule helpers sections state their own rules with.

A section is a frozen dataclass deriving :class:`Section`; each field is a :func:`setting`.
Building one checks each field's type against its default's (ints pass for floats, lists for
tuples, bools never for numbers), then calls its ``check()``: a section that exists is valid.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any

from ..errors import ConfigError

__all__ = ["Section", "setting", "doc_of", "type_ok"]


def setting(default: Any, doc: str) -> Any:
    """A field with its default and the line ``kvstate scenario`` prints above it."""
    return field(default=default, metadata={"doc": doc})


def doc_of(f: dataclasses.Field) -> str:
    return f.metadata.get("doc", "")


def type_ok(default: Any, v: Any) -> tuple[bool, Any]:
    """Whether ``v`` has the type of ``default`` (ints pass for floats, lists for tuples)."""
    if isinstance(default, bool):
        return isinstance(v, bool), v
    if isinstance(default, int):
        return isinstance(v, int) and not isinstance(v, bool), v
    if isinstance(default, float):
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return ok, float(v) if ok else v
    if isinstance(default, str):
        return isinstance(v, str), v
    if isinstance(default, tuple):
        return isinstance(v, (list, tuple)), tuple(v) if isinstance(v, (list, tuple)) else v
    return True, v


class Section:
    """What every section does when built: check each field's type, then its own rules."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            ok, v = type_ok(f.default, v)
            if not ok:
                raise ConfigError(f"{f.name}: expected {type(f.default).__name__}, got {v!r}")
            object.__setattr__(self, f.name, v)
        self.check()

    def check(self) -> None:
        """The section's rules (raise ConfigError('field: rule'))."""

    def positive(self, *names: str) -> None:
        for n in names:
            if not getattr(self, n) > 0:
                raise ConfigError(f"{n}: must be > 0, got {getattr(self, n)!r}")

    def non_negative(self, *names: str) -> None:
        for n in names:
            if not getattr(self, n) >= 0:
                raise ConfigError(f"{n}: must be >= 0, got {getattr(self, n)!r}")

    def at_most(self, **limits: int) -> None:
        """Bounds that keep a run within memory, each stated when broken."""
        for n, limit in limits.items():
            if getattr(self, n) > limit:
                raise ConfigError(f"{n}: at most {limit:,}, got {getattr(self, n):,}")

    def fraction(self, *names: str) -> None:
        for n in names:
            if not 0 <= getattr(self, n) <= 1:
                raise ConfigError(f"{n}: must be within 0..1, got {getattr(self, n)!r}")

    def choice(self, name: str, options: tuple[str, ...]) -> None:
        if getattr(self, name) not in options:
            raise ConfigError(f"{name}: must be one of {list(options)}, got {getattr(self, name)!r}")
