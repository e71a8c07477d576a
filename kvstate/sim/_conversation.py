"""Synthetic multi-turn conversation traces, in the Mooncake trace format.

Sessions arrive as a Poisson process; each opens with one of a few shared system prompts and
runs a geometric number of turns, a think time apart. Turn *k*'s prompt is the session so far
(system prompt, every earlier user message and answer) plus a new user message, so each turn
re-sends its history: the blocks of that history carry the same ``hash_ids`` as before, and
the system prompt's blocks are shared across sessions. ``block_reuse`` measures the result:
the share of all ``hash_ids`` that appeared earlier in the trace: 37 % with the default shape
(the shipped Mooncake trace has 64 %).
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ._workload import TraceRecord

__all__ = ["ConversationShape", "conversation_trace", "block_reuse", "write_trace"]


@dataclass(frozen=True)
class ConversationShape:
    """What the sessions look like (lengths in tokens, times in seconds)."""

    session_rate: float = 6.0  #: new sessions per second
    turns_mean: float = 1.35  #: mean turns per session (geometric)
    think_s: float = 20.0  #: mean pause between a turn's answer and the next message
    system_prompts: int = 4  #: distinct system prompts shared by the sessions
    system_tokens: int = 512
    user_mean: float = 1800.0  #: mean user message (lognormal; documents pasted in)
    answer_mean: float = 300.0  #: mean answer (lognormal)
    max_input: int = 32768  #: a session ends when its next prompt would be longer
    hash_block: int = 512  #: tokens per hash id


def _lognormal(rng: np.random.Generator, mean: float) -> int:
    sigma = 0.8
    return max(1, int(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma)))


def _ids(stream_len: int, system: int, sys_tokens: int, session: int, hb: int) -> list[int]:
    """The hash ids of a session's first ``stream_len`` tokens: the system prompt's full blocks
    are shared (ids below 2**20), every other block is the session's own."""
    shared = sys_tokens // hb
    out = []
    for b in range(-(-stream_len // hb)):
        out.append(system * 64 + b if b < shared else (1 << 20) + session * 4096 + b)
    return out


def conversation_trace(n: int, seed: int = 0, shape: ConversationShape = ConversationShape()) -> list[TraceRecord]:
    """``n`` requests (turns) of Poisson-arriving sessions, in time order."""
    rng = np.random.default_rng(seed)
    hb = shape.hash_block
    turns: list[tuple[float, int, int, list[int]]] = []  # (time, input, output, hash ids)
    t, session = 0.0, 0
    while len(turns) < n:
        t += rng.exponential(1.0 / shape.session_rate)
        system = int(rng.integers(shape.system_prompts))
        stream, when = shape.system_tokens, t
        for _ in range(int(rng.geometric(1.0 / shape.turns_mean))):
            user, answer = _lognormal(rng, shape.user_mean), _lognormal(rng, shape.answer_mean)
            prompt = stream + user
            if prompt > shape.max_input or len(turns) >= n:
                break
            turns.append((when, prompt, answer, _ids(prompt, system, shape.system_tokens, session, hb)))
            stream = prompt + answer
            when += rng.exponential(shape.think_s) + answer * 0.02  # its answer streams, then a pause
        session += 1
    order = sorted(range(len(turns)), key=lambda i: (turns[i][0], i))
    t0 = turns[order[0]][0]
    return [TraceRecord(round((turns[i][0] - t0) * 1000.0, 3), turns[i][1], turns[i][2], tuple(turns[i][3]))
            for i in order]


def block_reuse(records: Iterable[TraceRecord]) -> float:
    """The share of ``hash_ids`` that appeared earlier in the trace."""
    seen: set[int] = set()
    total = reused = 0
    for r in records:
        for h in r.hash_ids:
            total += 1
            reused += h in seen
            seen.add(h)
    return reused / total if total else 0.0


def write_trace(records: Iterable[TraceRecord], path: str | os.PathLike[str]) -> None:
    """Write records as a Mooncake-format JSONL trace."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")
