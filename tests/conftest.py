"""The suite's fixtures (a clock, a P+D rig, a small arena store) and its session checks; the
helpers themselves live in ``rigs.py`` and ``needs.py``, which tests import."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from rigs import ARENA_SLOT, Clock, Rig

ROOT = Path(__file__).resolve().parents[1]


def _tracked_changes() -> str | None:
    """``git status`` of the checkout's tracked files (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_TREE] = _tracked_changes()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The suite leaves the checkout as it found it: a run that changed a tracked file fails."""
    before, after = session.config.stash.get(_TREE, None), _tracked_changes()
    if before is not None and after is not None and after != before:
        changed = sorted(set(after.splitlines()) ^ set(before.splitlines()))
        print(f"\nthe test run changed tracked files of the checkout: {changed[:10]}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_TREE = pytest.StashKey[str | None]()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def rig() -> Rig:
    return Rig()


@pytest.fixture
def arena(tmp_path):
    """An arena store of four ``ARENA_SLOT``-byte slots and four 64-byte ones, tag "geo", in
    the test's own directory, closed (and its file removed) after the test."""
    from kvstate.backends._arena import ArenaStore

    a = ArenaStore.create(ARENA_SLOT, 4, small_bytes=64, small_slots=4, tag="geo", directory=tmp_path)
    yield a
    a.close()
