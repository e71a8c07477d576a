"""The process driver's own settings, sockets and close, without a worker: every refusal of
its settings word for word with nothing left running, the settings at their bounds and by
default, the sockets' bounds read back from the sockets, the ipc directory it makes and the
stale ones it sweeps, tcp under CURVE, a submit it refuses whole, and close, refused or
repeated."""
from __future__ import annotations

import threading
import time

import pytest

from kvstate._errors import ConfigError, DriverError
from kvstate._spec import CacheSpec
from kvstate.distributed import ProcessDriver
from kvstate.distributed import _wire as wire

SPEC1 = CacheSpec(2, 1, 4, 8)
SPEC2 = CacheSpec(2, 1, 4, 8, tp_size=2)


def _write(cid, ranks=(0, 1)):
    from kvstate import commands as C

    return C.WriteBlocks("r1", cid, ranks, time.monotonic() + 30, ("k0", "k1"), (1, 2))


def test_the_driver_s_sockets_bound_their_messages_queues_and_waits():
    """What keeps a flood or a dead peer from growing the driver or hanging it, read back from
    its sockets: the command socket takes a worker's name and nothing more, queues one frame,
    and a send to a worker gives up after ``submit_timeout``; the reply and control sockets
    take messages up to the wire's bound; nothing lingers at close; the ipc directory is the
    user's alone."""
    import os
    import stat

    import zmq

    with ProcessDriver(SPEC1, 4, restart=False, submit_timeout=7.5) as drv:
        cmd = drv._cmd
        assert (cmd.getsockopt(zmq.MAXMSGSIZE), cmd.getsockopt(zmq.RCVHWM), cmd.getsockopt(zmq.SNDHWM),
                cmd.getsockopt(zmq.SNDTIMEO), cmd.getsockopt(zmq.LINGER)) == (256, 1, 4096, 7500, 0)
        for sock in (drv._reply, drv._control):
            assert (sock.getsockopt(zmq.MAXMSGSIZE), sock.getsockopt(zmq.LINGER)) == (wire.MAX_MESSAGE_BYTES, 0)
        assert [a.split("/")[-1] for a in drv.addresses] == ["cmd", "reply", "control"]
        assert all(a.startswith(f"ipc://{drv._tmp}/") for a in drv.addresses) and drv.curve_key == ""
        assert stat.S_IMODE(os.stat(drv._tmp).st_mode) == 0o700
    assert not os.path.exists(drv._tmp)  # removed at close


def _refusal(**kw) -> str:
    args = dict(spec=SPEC1, num_blocks=4, restart=False)
    args.update(kw)
    with pytest.raises(ConfigError) as e:
        ProcessDriver(**args)
    return str(e.value)


@pytest.mark.parametrize("kw, message", [
    (dict(spec="spec"), "ProcessDriver: spec must be a CacheSpec"),
    (dict(restart=1), "ProcessDriver: restart must be a bool, got 1"),
    (dict(heartbeat_s=0), "ProcessDriver: heartbeat_s must be seconds in (0, 3600), got 0"),
    (dict(heartbeat_s=3600), "ProcessDriver: heartbeat_s must be seconds in (0, 3600), got 3600"),
    (dict(heartbeat_s=True), "ProcessDriver: heartbeat_s must be seconds in (0, 3600), got True"),
    (dict(dead_after_s="2"), "ProcessDriver: dead_after_s must be seconds in (0, 3600), got '2'"),
    (dict(submit_timeout=-1.0), "ProcessDriver: submit_timeout must be seconds in (0, 3600), got -1.0"),
    (dict(heartbeat_s=0.5, dead_after_s=1.0),
     "ProcessDriver: dead_after_s (1.0) must exceed two heartbeats (1.0), or a live rank could be declared dead"),
    (dict(spin_us=-1), "ProcessDriver: spin_us must be microseconds in [0, 100000], got -1"),
    (dict(spin_us=100001), "ProcessDriver: spin_us must be microseconds in [0, 100000], got 100001"),
    (dict(spin_us=False), "ProcessDriver: spin_us must be microseconds in [0, 100000], got False"),
    (dict(address="tcp://127.0.0.1:5555"),
     "ProcessDriver: address must be 'ipc' or 'tcp://HOST' (ports are chosen), got 'tcp://127.0.0.1:5555'"),
    (dict(address=7), "ProcessDriver: address must be 'ipc' or 'tcp://HOST' (ports are chosen), got 7"),
    (dict(num_blocks=0), f"ProcessDriver: num_blocks must be an int > 0 and <= {2**31}, got 0"),
    (dict(num_blocks=2**31 + 1), f"ProcessDriver: num_blocks must be an int > 0 and <= {2**31}, got {2**31 + 1}"),
    (dict(num_states=-1), f"ProcessDriver: num_states must be an int >= 0 and <= {2**31}, got -1"),
    (dict(num_states=2**31 + 1), f"ProcessDriver: num_states must be an int >= 0 and <= {2**31}, got {2**31 + 1}"),
    (dict(num_states=1), "ProcessDriver: num_states 1 with 0 state bytes a rank: a spec with state groups needs "
                         "state pages, one without has none"),
    (dict(name=""), "ProcessDriver: name must be a non-empty str (a label), got ''"),
])


def test_a_driver_s_settings_are_refused_before_anything_starts_naming_the_rule(kw, message):
    before = {t.name for t in threading.enumerate()}
    assert _refusal(**kw) == message
    assert {t.name for t in threading.enumerate()} == before  # no I/O thread left behind


def test_a_driver_takes_its_settings_at_their_bounds_and_starts_counting_from_zero():
    with ProcessDriver(SPEC1, 4, restart=False, heartbeat_s=0.5, dead_after_s=1.01, spin_us=0, name="edge") as drv:
        assert drv.spin_us == 0.0 and drv.heartbeat_s == 0.5 and drv.num_states == 0
        assert drv.counters == dict.fromkeys(("stale", "bad_messages", "refused", "foreign_hellos",
                                              "unauthenticated_hellos", "lost", "restarts"), 0)
        assert len(drv.secret) == 32 and int(drv.secret, 16) >= 0
        assert drv._io.name == "edge-driver-io" and drv._io.daemon and drv._io.is_alive()
        assert drv.control.restart is False and drv.control.dead_after_s == 1.01
    assert not drv._io.is_alive()
    with ProcessDriver(SPEC1, 4, spin_us=100000, submit_timeout=3599.0, dead_after_s=3599.0) as drv:
        assert drv.spin_us == 100000.0 and drv.control.restart is True
    assert drv._ctx.closed


def test_closing_twice_is_once_and_its_timeout_is_checked():
    from kvstate._errors import ValidationError

    drv = ProcessDriver(SPEC1, 1, restart=False)  # one block: the least a driver takes
    with pytest.raises(ValidationError) as e:
        drv.close(-1)
    assert str(e.value) == "ProcessDriver.close: timeout must be a finite number of seconds >= 0, got -1"
    assert drv._io.is_alive() and not drv.control.stopping  # a refused close changed nothing
    drv.close(5.0)
    assert not drv._io.is_alive() and drv._ctx.closed and drv._cmd.closed and drv._reply.closed
    assert drv.control.stopping is True and drv.control.running is False
    drv.close(5.0)  # again: nothing to do


def test_a_driver_s_defaults_and_its_ipc_directory_which_close_removes_even_if_gone():
    import os
    import shutil
    import tempfile

    import zmq

    stale = tempfile.mkdtemp(prefix="kvstate-ipc-999999999-")  # a driver of a process long gone
    with ProcessDriver(SPEC1, 4, restart=False) as drv:
        assert not os.path.exists(stale)  # swept when a driver binds
        assert os.path.basename(drv._tmp).startswith(f"kvstate-ipc-{os.getpid()}-")
        assert os.path.dirname(drv._tmp) == tempfile.gettempdir()
        assert drv.control.dead_after_s == 2.0 and drv.heartbeat_s == 0.2 and drv.spin_us == 200.0
        assert drv._cmd.getsockopt(zmq.SNDTIMEO) == 30000 and drv.name == "kvstate"
        shutil.rmtree(drv._tmp)
    assert drv._ctx.closed  # a directory already gone does not stop close


def test_a_tcp_driver_listens_on_chosen_ports_under_curve():
    import zmq

    if not zmq.has("curve"):
        pytest.skip("this pyzmq has no CURVE")
    with ProcessDriver(SPEC1, 4, restart=False, address="tcp://127.0.0.1") as drv:
        assert drv._tmp is None and len(drv.curve_key) == 40
        assert all(a.startswith("tcp://127.0.0.1:") for a in drv.addresses) and len(set(drv.addresses)) == 3
        assert drv._cmd.getsockopt(zmq.MAXMSGSIZE) == 1024  # a CURVE handshake's INITIATE is larger
        assert all(sock.curve_server for sock in (drv._cmd, drv._reply, drv._control))


def test_an_address_it_cannot_listen_on_is_refused_naming_it():
    with pytest.raises(ConfigError) as e:
        ProcessDriver(SPEC1, 4, restart=False, address="tcp://256.256.256.256")
    assert str(e.value).startswith("ProcessDriver: cannot listen on 'tcp://256.256.256.256' (")


@pytest.mark.parametrize("ranks", [(2,), (), (-1,), (True,), (0, 1.0), [0]])
def test_a_command_naming_ranks_this_driver_lacks_is_refused_whole(ranks):
    from kvstate._errors import ValidationError

    with ProcessDriver(SPEC2, 4, restart=False) as drv:
        with pytest.raises(ValidationError) as e:
            drv.submit(_write(9, ranks))
        assert str(e.value) == (f"ProcessDriver.submit: command 9 of request 'r1' names ranks {ranks!r}; this "
                                "driver's are 0..1")
        assert drv.inflight == 0 and drv.poll(0.05) == []  # nothing taken, nothing failed


def test_a_submit_after_close_is_refused():
    drv = ProcessDriver(SPEC1, 4, restart=False)
    drv.close(5.0)
    with pytest.raises(DriverError) as e:
        drv.submit(_write(1, (0,)))
    assert str(e.value) == "ProcessDriver: submit after close"


def test_spawn_starts_the_rank_s_worker_with_its_config_and_log_and_never_after_close(tmp_path):
    import os

    drv = ProcessDriver(SPEC2, 4, restart=False)
    started = []
    drv.control.spawn = lambda cfg, log: started.append((cfg, log)) or "child"
    try:
        assert drv.spawn(1, {"kind": "file", "root": str(tmp_path)}, log_path=tmp_path / "w1.log", lanes=2) == "child"
        assert drv.spawn(0, {"kind": "file", "root": str(tmp_path)}) == "child"
        (cfg, log), (cfg0, log0) = started
        assert (cfg.rank, cfg.lanes, cfg.parent_pid, cfg.secret, log) == (1, 2, os.getpid(), drv.secret,
                                                                          str(tmp_path / "w1.log"))
        assert (cfg0.rank, log0) == (0, None)
    finally:
        drv.close()
    with pytest.raises(DriverError) as e:
        drv.spawn(0, {"kind": "file", "root": str(tmp_path)})
    assert str(e.value) == "ProcessDriver: spawn after close" and len(started) == 2
