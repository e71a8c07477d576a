"""Option types the command line's commands share: numbers with a bound, refused in one line."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["number", "POSITIVE_INT", "NON_NEGATIVE_INT", "POSITIVE_FLOAT"]


def number(kind: Callable[[str], float], low: float, inclusive: bool, what: str) -> Callable[[str], float]:
    """An argparse type: ``kind(text)``, finite and above ``low`` (or at it, ``inclusive``)."""
    def parse(text: str) -> float:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(v) or not (v >= low if inclusive else v > low):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return v
    return parse


POSITIVE_INT = number(int, 0, False, "an integer > 0")
NON_NEGATIVE_INT = number(int, 0, True, "an integer >= 0")
POSITIVE_FLOAT = number(float, 0, False, "a number > 0")


