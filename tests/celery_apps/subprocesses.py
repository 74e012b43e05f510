"""Real ``celery worker`` and ``celery beat`` subprocesses for tests/test_beat.py,
tests/test_fleet.py and tests/test_celery_prefork.py, the apps they load, and the records their
task bodies write.

Every process starts in a session (and so a process group) of its own, so teardown can SIGKILL
the whole group: the worker or beat and every prefork child it forked. Output goes to a log file
shown in assertion messages. Tasks record what they do with `Recorder` into Redis lists on a
harness node (never the shared Redis on 6379); timestamps are ``time.time()``, which every
process on this machine shares.

The apps (`celery_apps.beat_app`, `fleet_app`, `prefork_app`) are made by `subprocess_app`, which
reads the environment `app_environment` gives the processes.
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from redlock_support import wait_until

from celery_redlock.testing import RedisNodes, RedisServer

TESTS_DIRECTORY = Path(__file__).resolve().parent.parent

BROKER_VARIABLE = "CRL_BROKER_URL"
LOCK_URLS_VARIABLE = "CRL_LOCK_URLS"
VISIBILITY_TIMEOUT_VARIABLE = "CRL_VISIBILITY_TIMEOUT"
UNREACHABLE_BROKER = "redis://127.0.0.1:1/0"  # the test process imports the apps for constants


def app_environment(broker: RedisServer, locks: RedisNodes, **extra: str) -> dict[str, str]:
    """The environment of a subprocess whose app (`subprocess_app`) uses ``broker`` as broker,
    result back-end and record store, and ``locks`` as lock nodes; ``extra`` adds variables."""
    return {BROKER_VARIABLE: broker.url, LOCK_URLS_VARIABLE: ",".join(locks.urls), **extra}


def subprocess_app(main: str, **conf: Any) -> Celery:
    """The app a ``celery -A`` subprocess loads, configured from its environment.

    - ``CRL_BROKER_URL``: broker and result back-end (unset: an unreachable placeholder);
    - ``CRL_LOCK_URLS``: comma-separated lock nodes, ``redlock_urls`` (unset: the broker);
    - ``CRL_VISIBILITY_TIMEOUT``: when set, the Redis transport's ``visibility_timeout`` in
      seconds, with the unacked-message sweep (``restore_visible``) run every second so that an
      ``acks_late`` message past it is redelivered promptly.

    ``conf`` adds or overrides settings.
    """
    broker_url = os.environ.get(BROKER_VARIABLE, UNREACHABLE_BROKER)
    lock_urls = os.environ.get(LOCK_URLS_VARIABLE, broker_url)
    app = Celery(main)
    app.conf.update(
        broker_url=broker_url,
        result_backend=broker_url,
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        redlock_urls=[url for url in lock_urls.split(",") if url],
    )
    if visibility_timeout := os.environ.get(VISIBILITY_TIMEOUT_VARIABLE):
        app.conf.broker_transport_options = {
            "visibility_timeout": float(visibility_timeout),
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        }
    app.conf.update(conf)
    return app


def control_app(broker: RedisServer, **conf: Any) -> Celery:
    """The test's own client app: sends tasks to, and pings, the workers on ``broker``."""
    app = Celery("test_control", set_as_current=False)
    app.conf.update(broker_url=broker.url, broker_connection_retry_on_startup=True, **conf)
    return app


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

    def add(self, stream: str, /, **entry: Any) -> None:
        """Append one record to ``stream`` (values JSON cannot hold are stored as text)."""
        self.client.rpush(f"record:{stream}", json.dumps(entry, default=str))

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

        def answers() -> bool:
            replies = app.control.ping(destination=[self.hostname], timeout=0.5)
            return any(self.hostname in reply for reply in replies)

        # The ping itself waits up to 0.5 s for replies: no sleep between two pings.
        if not wait_until(answers, timeout, interval=0, alive=[self]):
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
