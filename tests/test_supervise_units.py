"""Process supervision (kvstate.distributed._supervise) rule by rule, on real child processes:
a stop always ends within its deadline, a child never outlives its parent, bad arguments start
nothing."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstate import ConfigError
from kvstate.distributed import _supervise
from kvstate.distributed._supervise import ChildProcess, die_with_parent, parent_alive, pid_alive

ROOT = str(Path(__file__).resolve().parent.parent)
#: ``python -m timeit`` runs a statement once after a setup: a child any test can shape
SLEEP = ["-n", "1", "-r", "1", "import time; time.sleep(60)"]


def timeit(setup: str, stmt: str = "pass") -> list[str]:
    return ["-n", "1", "-r", "1", "-s", setup, stmt]


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not pid_alive(pid)


@pytest.fixture
def children():
    made: list[ChildProcess] = []
    yield made
    for c in made:
        c.kill()


def test_a_stop_asks_with_sigterm_and_the_child_is_reaped_and_forgotten(children):
    c = ChildProcess("timeit", SLEEP, "sleeper")
    children.append(c)
    assert c.alive() and c.returncode is None and c in _supervise._LIVE and c.name == "sleeper"
    assert os.getsid(c.pid) == os.getsid(0), "the child stays in its parent's session (Ctrl-C reaches it)"
    t = time.monotonic()
    assert c.stop(10) == -signal.SIGTERM
    assert time.monotonic() - t < 5
    assert not c.alive() and not pid_alive(c.pid) and c not in _supervise._LIVE


def test_a_child_deaf_to_sigterm_is_killed_at_the_stops_deadline(children):
    c = ChildProcess("timeit", timeit("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)",
                                      "time.sleep(60)"), "deaf")
    children.append(c)
    time.sleep(0.5)  # its handler is set
    t = time.monotonic()
    assert c.stop(0.4) == -signal.SIGKILL
    assert 0.35 <= time.monotonic() - t < 0.98  # not a second: the deadline is the one given


def test_a_stopped_child_is_killed_and_a_negative_deadline_kills_at_once(children):
    c = ChildProcess("timeit", SLEEP, "frozen")
    children.append(c)
    c.signal(signal.SIGSTOP)
    assert c.kill() == -signal.SIGKILL and c.returncode == -signal.SIGKILL
    c.signal(signal.SIGTERM)  # a dead child is not signalled (nor its pid, perhaps someone else's now)
    d = ChildProcess("timeit", SLEEP, "impatient")
    children.append(d)
    t = time.monotonic()
    assert d.stop(-1) in (-signal.SIGTERM, -signal.SIGKILL) and time.monotonic() - t < 5


def test_wait_answers_none_while_the_child_runs_and_its_status_once_it_exits(children):
    c = ChildProcess("timeit", timeit("import time; time.sleep(0.5)"), "brief", quiet=True)
    children.append(c)
    t = time.monotonic()
    assert c.wait(0.1) is None and 0.08 <= time.monotonic() - t < 0.5
    assert c.wait(10) == 0 and c.returncode == 0


def test_output_goes_to_the_log_file_or_nowhere_when_quiet(children, tmp_path, capfd):
    stmt = "import sys; print('out-line'); print('err-line', file=sys.stderr)"
    log = tmp_path / "child.log"
    log.write_text("before\n")
    for kw in ({"log_path": log}, {"quiet": True}, {}):
        c = ChildProcess("timeit", timeit(stmt), "talker", **kw)
        children.append(c)
        assert c.wait(20) == 0
    text = log.read_text()
    assert text.startswith("before\n") and "out-line" in text and "err-line" in text  # appended, both streams
    out, err = capfd.readouterr()
    assert out.count("out-line") == 1 and err.count("err-line") == 2  # quiet drops stdout only
    d = ChildProcess("json.tool", ["--help"], "dotted", quiet=True)  # a dotted module runs
    children.append(d)
    assert d.wait(20) == 0


def test_the_childs_environment_is_the_one_given(children, tmp_path):
    f = tmp_path / "env"
    c = ChildProcess("timeit", timeit(f"import os; open({str(f)!r}, 'w').write(os.environ.get('KVX', '-') + "
                                      "os.environ.get('HOME', '-'))"), "env", env={"KVX": "seen"})
    children.append(c)
    assert c.wait(20) == 0 and f.read_text() == "seen-"


@pytest.mark.parametrize("kw, rule", [
    ({"module": "-m os"}, "module must be a dotted module name"),
    ({"module": 3}, "module must be a dotted module name"),
    ({"args": "abc"}, "args must be a sequence of str"),
    ({"args": ["a\0b"]}, "args must be a sequence of str"),
    ({"args": [1]}, "args must be a sequence of str"),
    ({"env": {"A": 1}}, "env must be a dict of str to str"),
    ({"env": [("A", "b")]}, "env must be a dict of str to str"),
    ({"quiet": 1}, "quiet must be a bool"),
    ({"log_path": 5}, "log_path must be a path or None"),
    ({"log_path": "/nonexistent-dir/x.log"}, "cannot open its log file '/nonexistent-dir/x.log'"),
    ({"name": ""}, "^ChildProcess: name must be"),
    ({"module": "os path"}, "module must be a dotted module name"),
])
def test_bad_arguments_are_refused_by_name_and_start_nothing(kw, rule, monkeypatch):
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    args = {"module": "timeit", "args": SLEEP, "name": "bad"} | kw
    with pytest.raises(ConfigError, match=rule):
        ChildProcess(**args)
    assert not started


def test_parent_alive_compares_the_parent_pid_and_refuses_bad_ones():
    assert parent_alive(os.getppid())
    assert not parent_alive(os.getppid() + 1)
    assert not parent_alive(0) and not parent_alive(2**31 - 1)  # the bounds themselves are pids
    for bad in (-1, 2**31, "1", 1.0, True):
        with pytest.raises(Exception, match=r"^parent_alive: parent_pid must be an int >= 0 and <= 2147483647"):
            parent_alive(bad)


class FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def prctl(self, *args) -> int:
        self.calls.append(args)
        return 0


@pytest.mark.parametrize("alive", [True, False])
def test_die_with_parent_asks_the_kernel_for_sigkill_and_exits_3_if_the_parent_is_gone(alive, monkeypatch):
    """In this process, with the kernel call and the exit recorded instead of made."""
    libc, exits = FakeLibc(), []
    monkeypatch.setattr(_supervise.ctypes, "CDLL", lambda name, use_errno: libc if name is None and use_errno else 0)
    monkeypatch.setattr(_supervise.sys, "platform", "linux")
    monkeypatch.setattr(_supervise.os, "_exit", exits.append)
    die_with_parent(os.getppid() if alive else os.getppid() + 1)
    assert libc.calls == [(1, signal.SIGKILL, 0, 0, 0)]
    assert exits == ([] if alive else [3])
    monkeypatch.setattr(_supervise.sys, "platform", "darwin")
    die_with_parent(os.getppid())
    assert len(libc.calls) == 1, "PR_SET_PDEATHSIG is asked for on Linux only"


def run_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)


def test_a_child_whose_parent_is_already_gone_exits_and_one_whose_parent_lives_goes_on():
    gone = run_child("from kvstate.distributed._supervise import die_with_parent\n"
                     "import os; die_with_parent(os.getppid() + 1); print('ran on')")
    assert gone.returncode == 3 and "ran on" not in gone.stdout
    kept = run_child("from kvstate.distributed._supervise import die_with_parent\n"
                     "import os; die_with_parent(os.getppid()); die_with_parent(0); print('ran on')")
    assert kept.returncode == 0 and "ran on" in kept.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_kernel_kills_a_child_when_its_parent_dies():
    """A parent starts a grandchild that calls die_with_parent, then is killed: the grandchild
    dies with it, though it was sleeping and never checked."""
    code = ("import subprocess, sys, os, time\n"
            "g = subprocess.Popen([sys.executable, '-c', 'import os, time\\n"
            "from kvstate.distributed._supervise import die_with_parent\\n"
            "die_with_parent(os.getppid()); print(\"armed\", flush=True); time.sleep(60)'], stdout=subprocess.PIPE,"
            " text=True)\n"
            "assert g.stdout.readline().strip() == 'armed'\n"
            "print(g.pid, flush=True); time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(parent.stdout.readline())
        assert pid_alive(grandchild)
        parent.kill()
        parent.wait(10)
        assert gone_within(grandchild, 5), "the grandchild outlived its parent"
    finally:
        parent.kill()
        parent.wait(10)


def test_children_an_owner_forgot_are_killed_at_exit(children):
    forgotten = ChildProcess("timeit", SLEEP, "forgotten")
    children.append(forgotten)
    _supervise._stop_forgotten_children()
    assert not forgotten.alive() and forgotten.returncode == -signal.SIGKILL
    assert forgotten not in _supervise._LIVE


def test_die_with_parent_is_a_no_op_without_a_parent_pid():
    assert die_with_parent(0) is None


def test_pid_running_asks_the_kernel_once_and_pid_alive_falls_back_to_it_without_proc(monkeypatch):
    import builtins

    from kvstate.backends import _hostfiles

    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # reaped: its pid is free
    assert _hostfiles.pid_running(os.getpid()) and not _hostfiles.pid_running(done.pid)
    assert not _hostfiles.pid_running(0) and not _hostfiles.pid_running(-1)  # never a process group
    assert _hostfiles.pid_running(1)  # init: there, whoever may signal it

    def no_proc(path, *a, **k):
        raise PermissionError(path)
    monkeypatch.setattr(builtins, "open", no_proc)
    assert _hostfiles.pid_alive(os.getpid()) and not _hostfiles.pid_alive(done.pid)
