"""Files a process leaves on its host: where shared memory lives, and clearing what dead processes left.

Shared caches (:mod:`kvstate.backends._shm`), arena stores (:mod:`kvstate.backends._arena`),
sockets and logs are named ``PREFIX<pid>-...`` after the process that made them, so a later
process can tell a dead creator's entries from a live one's: a process killed with SIGKILL
cannot clean up after itself; its parent, or the next process to make such an entry, does.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["pid_alive", "pid_running", "remove_orphans", "shm_directory"]


def shm_directory() -> Path:
    """Where shared memory files live: ``/dev/shm`` where it can be written, else the temp dir."""
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(tempfile.gettempdir())


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel (a zombie then counts as running)
        return pid_running(pid)


def pid_running(pid: int) -> bool:
    """Whether a process ``pid`` exists, asked with one system call (a zombie counts as
    running): for paths where a zombie's files fail later anyway, and each system call counts."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans(directory: str | os.PathLike[str], prefix: str) -> int:
    """Remove what processes that died left in ``directory``: entries named ``PREFIX<pid>-...``
    whose pid no longer runs. Returns how many went."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for e in entries:
        rest = e.name[len(prefix):] if e.name.startswith(prefix) else ""
        pid = rest.split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        try:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                os.unlink(e.path)
            removed += 1
        except OSError:
            pass
    return removed
