"""The ``kvstate arena`` command: make a shared-memory arena store and hold it for a host's engines."""
from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from ._argtypes import POSITIVE_INT

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("arena", help="make a shared-memory arena store, print its path, and hold it until stopped "
                                     "(P's and D's engines on this host name the path)")
    p.add_argument("--slot-bytes", type=POSITIVE_INT, required=True,
                   help="one object: one block of one kind, every layer, one rank "
                        "(layers x heads/TP x block size x head dim x dtype bytes)")
    p.add_argument("--slots", type=POSITIVE_INT, required=True,
                   help="objects it holds (its memory: slots x slot bytes)")
    p.add_argument("--small-bytes", type=POSITIVE_INT, default=1024, help="a manifest slot (default 1024)")
    p.add_argument("--tag", default="", help="the geometry it is for; an opener naming another is refused")
    p.add_argument("--directory", help="where the file goes (default /dev/shm)")


def run(args: argparse.Namespace) -> int:
    """Make the arena (every page touched now), print its path, hold it until SIGTERM or
    SIGINT, then remove it; the engines' mappings stay valid until they exit."""
    from ..backends._arena import ArenaStore

    store = ArenaStore.create(args.slot_bytes, args.slots, small_bytes=args.small_bytes, tag=args.tag,
                              directory=args.directory)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(store.path, flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        store.close()
    return 0
