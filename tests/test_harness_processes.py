"""The harness's one process manager (celery_redlock.testing.ManagedProcess) and the Redis server
as a kind of it: start, pause and resume, stop, kill, start again, log tail, clean-up at exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis
from redlock_support import wait_until
from topologies.servers import free_port, role

from celery_redlock.testing import (
    ManagedProcess,
    ProcessExitedError,
    RedisServer,
    stop_processes,
)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _state(pid: int) -> str:
    """The one-letter state of a process in /proc (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_a_process_with_a_child_is_paused_resumed_and_killed_as_a_group(tmp_path: Path) -> None:
    child_pid_file = tmp_path / "child.pid"
    parent = ManagedProcess(
        _python(
            f"""
            import subprocess, sys, time
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            open({str(child_pid_file)!r}, "w").write(str(child.pid))
            print("started", flush=True)
            time.sleep(60)
            """
        ),
        label="parent",
    )
    with parent:
        assert wait_until(lambda: "started" in parent.log_text(), timeout=20, alive=[parent])
        child = int(child_pid_file.read_text())
        parent.pause()
        assert parent.is_paused
        assert wait_until(lambda: _state(parent.pid) == "T" and _state(child) == "T")
        parent.resume()
        assert parent.is_running and not parent.is_paused
        assert wait_until(lambda: _state(parent.pid) != "T" and _state(child) != "T")
        parent.kill()
        assert parent.returncode == -signal.SIGKILL
        assert not _process_exists(parent.pid)
        assert wait_until(lambda: not _process_exists(child))
    parent.remove_log()


def test_stop_ends_a_paused_process_gracefully_and_reports_its_status() -> None:
    process = ManagedProcess(
        _python(
            """
            import signal, sys, time
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
            print("ready", flush=True)
            time.sleep(60)
            """
        )
    )
    process.start()
    assert wait_until(lambda: "ready" in process.log_text(), timeout=20, alive=[process])
    process.pause()
    assert process.stop(timeout=10) == 3  # SIGTERM, acted on once resumed
    assert not process.is_running
    process.remove_log()


def test_an_exited_process_starts_again_appending_to_its_log() -> None:
    process = ManagedProcess(_python("import os; print('run', os.getpid()); raise SystemExit(4)"))
    process.start()
    assert process.wait(20) == 4
    first_pid = process.pid
    process.start()
    assert process.wait(20) == 4
    assert process.pid != first_pid
    assert process.log_text().splitlines() == [f"run {first_pid}", f"run {process.pid}"]
    assert process.log_tail(1) == f"run {process.pid}"
    with pytest.raises(ProcessExitedError, match=f"run {process.pid}"):
        process.check_alive()
    process.remove_log()


def test_a_running_process_refuses_a_second_start() -> None:
    with (
        ManagedProcess(_python("import time; time.sleep(60)")) as process,
        pytest.raises(RuntimeError, match="already running"),
    ):
        process.start()
    process.remove_log()


def test_a_redis_server_is_a_managed_process_whose_run_directory_goes_with_it() -> None:
    server = RedisServer()
    assert isinstance(server, ManagedProcess)
    server.start()
    first_log = server.log_path
    assert "Ready to accept connections" in server.log_text()
    server.pause()
    stop_processes([server], timeout=10)  # the helper every group of servers uses
    assert not server.is_running
    assert not first_log.parent.exists()
    server.start()
    try:
        assert server.log_path != first_log
        assert role(server) == "master"
    finally:
        server.stop()
    assert not server.log_path.parent.exists()


def test_a_redis_server_that_dies_is_reported_with_its_log() -> None:
    with RedisServer() as server:
        os.kill(server.pid, signal.SIGKILL)
        assert wait_until(lambda: not server.is_running)
        with pytest.raises(ProcessExitedError, match="exited with status -9"):
            server.check_alive()
        with pytest.raises(redis.ConnectionError), server.client(socket_timeout=0.2) as client:
            client.ping()


def test_processes_left_running_are_killed_when_the_interpreter_exits(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = f"""
        from celery_redlock.testing import ManagedProcess, RedisServer
        server = RedisServer().start()
        sleeper = ManagedProcess(["sleep", "60"], log_path={str(tmp_path / "sleep.log")!r}).start()
        open({str(pids)!r}, "w").write(f"{{server.pid}} {{sleeper.pid}} {{server.log_path.parent}}")
        """
    subprocess.run(_python(script), check=True, timeout=60)
    server_pid, sleeper_pid, directory = pids.read_text().split()
    assert not _process_exists(int(server_pid))
    assert not _process_exists(int(sleeper_pid))
    assert not Path(directory).exists()


def test_free_port_with_its_cluster_bus_port_free_too() -> None:
    port = free_port(also_free_at_offset=10000)
    assert 1024 < port <= 65535 - 10000
