"""``python -m kvstate.distributed rankworker CONFIG_JSON``: the processes this package starts."""
from __future__ import annotations

import sys

from ._rankworker import main

if __name__ == "__main__":  # pragma: no cover - a child process's entry
    if sys.argv[1:2] != ["rankworker"]:
        print("usage: python -m kvstate.distributed rankworker CONFIG_JSON", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[2:]))
