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

__all__ = ["creator_pid", "pid_alive", "pid_running", "remove_orphans", "shm_directory"]


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


def creator_pid(name: str | os.PathLike[str], prefix: str) -> int:
    """The pid in an entry's name, ``PREFIX<pid>-...`` (its directory ignored); 0 when the name
    is not one."""
    base = os.path.basename(name)
    pid = base[len(prefix):].split("-", 1)[0] if base.startswith(prefix) else ""
    return int(pid) if pid.isdigit() else 0


def remove_orphans(directory: str | os.PathLike[str], prefix: str) -> int:
    """Remove what processes that died left in ``directory``: entries named ``PREFIX<pid>-...``
    whose pid no longer runs. Returns how many went."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for e in entries:
        pid = creator_pid(e.name, prefix)
        if not pid or pid_alive(pid):
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
