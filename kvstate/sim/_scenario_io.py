"""Scenarios in and out: TOML files, plain dicts, ``section.field`` overrides, commented TOML.

A scenario file holds one table per section (``[model]``, ``[cluster]``, ...) and the top-level
keys ``seed``, ``time_limit_s``, ``sample_ms``; any key left out keeps its default. An empty
file is an error (it is more often a mistake than a wish for the defaults, which running
without a file gives). Every error names the file, the ``[section] field`` and the rule, and
is raised before anything runs.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from .._validate import check_name
from ._scenario import SECTIONS, TOP_LEVEL, Scenario, WorkloadSpec, check_scenario, doc_of

__all__ = ["load_scenario", "scenario_from_dict", "scenario_to_dict", "with_overrides", "to_toml",
           "field_names"]


#: keys renamed so that one name means one thing in the library and the scenario
RENAMED = {"model.kv_heads": "total_kv_heads (the model's KV heads; CacheSpec.kv_heads is one rank's)",
           # [policy] is the library's Policy, field for field: its times are seconds, named without a unit
           **{f"policy.{k}_s": f"{k} (the library's Policy field, in seconds)" for k in (
               "transfer_timeout", "first_token_timeout", "queue_timeout", "fence_grace", "swapped_timeout")}}


def _known(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name != "source"]


def scenario_from_dict(data: Any, source: str = "<dict>") -> Scenario:
    """Validate a parsed TOML document (or an equivalent dict) into a :class:`Scenario`."""
    check_name(source, "scenario_from_dict: source", error=ConfigError)
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a scenario is a table of sections")
    kwargs: dict[str, Any] = {}
    for key, v in data.items():
        if key in SECTIONS:
            cls = SECTIONS[key]
            if not isinstance(v, dict):
                raise ConfigError(f"{source}: [{key}] must be a table")
            unknown = sorted(set(v) - set(_known(cls)))
            if unknown:
                renamed = RENAMED.get(f"{key}.{unknown[0]}")
                hint = f": it is now {renamed}" if renamed else f" (known: {sorted(_known(cls))})"
                raise ConfigError(f"{source}: [{key}] unknown key {unknown[0]!r}{hint}")
            try:
                kwargs[key] = cls(**v)
            except ConfigError as e:
                raise ConfigError(f"{source}: [{key}] {e}") from None
        elif key in TOP_LEVEL:
            kwargs[key] = v
        else:
            raise ConfigError(f"{source}: unknown top-level key {key!r} (sections: {sorted(SECTIONS)}; "
                              f"keys: {', '.join(TOP_LEVEL)})")
    try:
        return Scenario(**kwargs, source=source)
    except ConfigError as e:
        raise ConfigError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None


def load_scenario(path: str | os.PathLike[str] | None) -> Scenario:
    """The scenario in a TOML file, or the embedded default for ``None``."""
    if path is None:
        return Scenario()
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"scenario path must be a str or a path, got {type(path).__name__}")
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{p}: scenario file not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid TOML ({e})") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the scenario ({e.strerror or e})") from None
    if not data:
        raise ConfigError(f"{p}: the scenario file is empty (run without a file for the defaults, or "
                          "start from `kvstate scenario`)")
    wl = data.get("workload")
    if isinstance(wl, dict) and isinstance(wl.get("trace"), str) and wl["trace"]:
        t = Path(wl["trace"])
        if not t.is_absolute():
            wl["trace"] = str(p.parent / t)
    return scenario_from_dict(data, str(p))


def scenario_to_dict(s: Scenario) -> dict[str, Any]:
    """The scenario as plain data (what ``--json`` prints under ``scenario``)."""
    d = dataclasses.asdict(s)
    d["tp"]["skew_ms"] = list(s.tp.skew_ms)
    return d


def field_names() -> list[str]:
    """Every field an override may name: ``seed`` ... and ``section.field``."""
    return [*TOP_LEVEL, *(f"{sec}.{name}" for sec, cls in SECTIONS.items() for name in _known(cls))]


def with_overrides(s: Scenario, overrides: dict[str, Any]) -> Scenario:
    """A copy with ``{"section.field": value}`` (or a top-level ``"seed"``...) replaced, validated again."""
    check_scenario(s, "with_overrides")
    if not isinstance(overrides, dict):
        raise ConfigError(f"overrides must be a dict of 'section.field' -> value, got {type(overrides).__name__}")
    d = scenario_to_dict(s)
    source = d.pop("source")
    for dotted, v in overrides.items():
        if not isinstance(dotted, str):
            raise ConfigError(f"scenario field {dotted!r} must be a str 'section.field'")
        sec, _, name = dotted.rpartition(".")
        target = d.get(sec) if sec else d
        if (sec and sec not in SECTIONS) or not isinstance(target, dict) or name not in target \
                or (not sec and name not in TOP_LEVEL):
            renamed = RENAMED.get(dotted)
            hint = f": it is now {sec}.{renamed}" if renamed else " (see `kvstate scenario` for the fields)"
            raise ConfigError(f"unknown scenario field {dotted!r}{hint}")
        target[name] = v
    out = scenario_from_dict(d, source)
    _check_applicable(out, overrides)
    return out


#: what a synthetic workload's field is called for a trace, and back
_TRACE_TWINS = {"rate": "trace_rate", "num_requests": "trace_requests"}
_TRACE_TWINS.update({v: k for k, v in _TRACE_TWINS.items()})


def _check_applicable(s: Scenario, overrides: dict[str, Any]) -> None:
    """An override of a workload field that means nothing for the scenario's arrivals (a rate
    for a trace, a trace's rate for Poisson arrivals) is a mistake, not a no-op."""
    arrival = s.workload.arrival
    for dotted in overrides:
        sec, _, name = dotted.rpartition(".")
        if sec == "workload" and not WorkloadSpec.applies(name, arrival):
            twin = _TRACE_TWINS.get(name)
            hint = f" (use workload.{twin})" if twin and WorkloadSpec.applies(twin, arrival) else ""
            raise ConfigError(f"{s.source}: [workload] {name} does not apply to {arrival!r} arrivals{hint}")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v)  # a TOML basic string


def to_toml(s: Scenario, title: str = "") -> str:
    """The whole scenario as TOML, each key under a comment saying what it is."""
    check_scenario(s, "to_toml")
    if not isinstance(title, str):
        raise ConfigError(f"to_toml: title must be a str, got {title!r}")
    lines = [f"# {line}" for line in title.splitlines()] + [""] if title else []
    for f in dataclasses.fields(s):
        if f.name in TOP_LEVEL:
            lines += [f"# {doc_of(f)}", f"{f.name} = {_toml_value(getattr(s, f.name))}"]
    for name, cls in SECTIONS.items():
        sec = getattr(s, name)
        lines += ["", f"[{name}]  # {(cls.__doc__ or '').splitlines()[0]}"]
        for f in dataclasses.fields(sec):
            lines += [f"# {doc_of(f)}", f"{f.name} = {_toml_value(getattr(sec, f.name))}"]
    return "\n".join(lines) + "\n"
