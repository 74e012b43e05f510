"""Real ``celery worker`` and ``celery beat`` subprocesses for tests/test_beat.py and
tests/test_fleet.py, and the run records their task bodies write.

Every process starts in a session (and so a process group) of its own, so teardown can SIGKILL
the whole group: the worker or beat and every prefork child it forked. Output goes to a log file
shown in assertion messages. Tasks record what they do with `Recorder` into Redis lists on a
harness node (never the shared Redis on 6379); timestamps are ``time.time()``, which every
process on this machine shares.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis
from celery import Celery

TESTS_DIRECTORY = Path(__file__).resolve().parent.parent


def wait_until(
    condition: Callable[[], object],
    timeout: float,
    interval: float = 0.02,
    alive: Sequence[CeleryProcess] = (),
) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds passed (False).

    Fails at once, with its log, when one of the ``alive`` processes has exited.
    """
    deadline = time.monotonic() + timeout
    while True:
        for process in alive:
            process.check_alive()
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


class Recorder:
    """JSON records in Redis lists, written by tasks in any process and read by the test."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: redis.Redis | None = None
        self._pid = 0
        self._guard = threading.Lock()

    @property
    def client(self) -> redis.Redis:
        """A client of the current process (a new one after a fork)."""
        with self._guard:
            if self._client is None or self._pid != os.getpid():
                self._client = redis.Redis.from_url(
                    self.url, decode_responses=True, socket_timeout=5, socket_connect_timeout=5
                )
                self._pid = os.getpid()
            return self._client

    def add(self, stream: str, **entry: Any) -> None:
        """Append one record to ``stream``."""
        self.client.rpush(f"record:{stream}", json.dumps(entry))

    def read(self, stream: str) -> list[dict[str, Any]]:
        """Every record of ``stream``, oldest first."""
        return [json.loads(item) for item in self.client.lrange(f"record:{stream}", 0, -1)]

    def count(self, stream: str) -> int:
        """How many records ``stream`` has."""
        return int(self.client.llen(f"record:{stream}"))


class CeleryProcess:
    """``celery -A <app_module> <arguments>`` in a process group of its own, cwd ``tests/``."""

    def __init__(self, app_module: str, arguments: Sequence[str], environment: dict[str, str]):
        self.app_module = app_module
        self.arguments = tuple(arguments)
        self.environment = environment
        self.process: subprocess.Popen[bytes] | None = None
        label = "-".join(arguments[:1]) or "celery"
        handle, name = tempfile.mkstemp(prefix=f"celery-redlock-{label}-", suffix=".log")
        os.close(handle)
        self.log_path = Path(name)

    def start(self) -> CeleryProcess:
        """Launch the process (returns at once)."""
        environment = dict(os.environ)
        environment.update(self.environment)
        environment["PYTHONPATH"] = os.pathsep.join(
            [str(TESTS_DIRECTORY), environment.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        command = [sys.executable, "-m", "celery", "-A", self.app_module, *self.arguments]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environment,
                cwd=str(TESTS_DIRECTORY),
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        """The main process id."""
        assert self.process is not None, "not started"
        return self.process.pid

    def check_alive(self) -> None:
        """Fail the test with the log when the process has exited."""
        assert self.process is not None, "not started"
        if self.process.poll() is not None:
            raise AssertionError(
                f"{' '.join(self.arguments[:1])} process exited with {self.process.returncode}:"
                f"\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 60) -> str:
        """The end of the process's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def log_text(self) -> str:
        """The whole output so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole process group (the process and its children) and reap it."""
        process = self.process
        if process is None:
            return
        # The group is the process's own (start_new_session): its pid is the group id.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(10)

    def remove_log(self) -> None:
        """Delete the log file."""
        with contextlib.suppress(OSError):
            self.log_path.unlink()


class WorkerProcess(CeleryProcess):
    """A real prefork ``celery worker`` named ``name@<host>``."""

    def __init__(
        self,
        app_module: str,
        name: str,
        environment: dict[str, str],
        concurrency: int = 2,
        extra_arguments: Sequence[str] = (),
    ) -> None:
        self.hostname = f"{name}@{socket.gethostname()}"
        super().__init__(
            app_module,
            [
                "worker",
                "-P",
                "prefork",
                "-c",
                str(concurrency),
                "-n",
                self.hostname,
                "--loglevel",
                "INFO",
                "--without-heartbeat",
                "--without-mingle",
                "--without-gossip",
                "-O",
                "fair",
                *extra_arguments,
            ],
            environment,
        )

    def wait_ready(self, app: Celery, timeout: float = 60.0) -> None:
        """Wait until the worker answers ``app.control.ping`` (fail with its log otherwise)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            replies = app.control.ping(destination=[self.hostname], timeout=0.5)
            if any(self.hostname in reply for reply in replies):
                return
        raise AssertionError(f"worker {self.hostname} never answered ping:\n{self.log_tail()}")

    def child_pids(self) -> set[int]:
        """Process ids of the worker's pool children (from /proc)."""
        children: set[int] = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == self.pid:  # fields[1] is the parent pid
                    children.add(int(entry.name))
        return children


class BeatProcess(CeleryProcess):
    """A real ``celery beat`` keeping its schedule in ``schedule_file``."""

    def __init__(
        self,
        app_module: str,
        schedule_file: Path,
        environment: dict[str, str],
    ) -> None:
        # The longest sleep between two schedule checks is the app's beat_max_loop_interval
        # (``--max-interval`` only takes whole seconds).
        super().__init__(
            app_module,
            ["beat", "-s", str(schedule_file), "--loglevel", "INFO"],
            environment,
        )


@contextlib.contextmanager
def celery_processes() -> Iterator[list[CeleryProcess]]:
    """A list to put started processes in; every one is killed (group and all) at exit.

    Logs are kept when the block fails, so they can be read after the test.
    """
    processes: list[CeleryProcess] = []
    failed = False
    try:
        yield processes
    except BaseException:
        failed = True
        raise
    finally:
        for process in reversed(processes):
            process.kill()
        if not failed:
            for process in processes:
                process.remove_log()
