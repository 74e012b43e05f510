"""Helpers shared by the tests/test_celery_*.py modules.

- `make_app`: a Celery app whose broker and result back-end are a harness Redis node and whose
  lock nodes are other harness nodes (never the shared Redis on 6379).
- `embedded_worker`: Celery's own embedded worker thread (``start_worker``), threads or solo pool.
- `RunLog`: every task run appends (key, start, end, pid, thread, task id) to a Redis list on a
  harness node, so a test can assert that no two runs of one key ever overlapped, across
  threads and processes alike.
- what the lock nodes hold (`lock_keys`, `key_held`, ...).

Real worker subprocesses are `celery_apps.subprocesses.WorkerProcess`.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu.asynchronous import set_event_loop
from redlock_support import collect_results_while_the_broker_is_up, values_on, wait_until

from celery_apps.subprocesses import Recorder
from celery_redlock import signals as lock_signals_module
from celery_redlock.integration.run import LAST_RETRIES
from celery_redlock.lock import keyspace
from celery_redlock.lock.scripts import RANK_FORMAT
from celery_redlock.testing import RedisNodes, RedisServer, free_port

LOCK_EVENTS = "lock-events"  # the `RunLog` stream where celery_apps.prefork_app records signals


def documented_key(
    task_name: str, arguments: dict[str, Any] | None, prefix: str = "redlock:"
) -> str:
    """The Redis key the README documents, computed independently of celery_redlock's own code:
    prefix + task name + ':' + sha256 of the canonical JSON of the bound arguments (None:
    ``lock_args=()``, the task name alone)."""
    if arguments is None:
        return prefix + "{" + task_name + "}"
    text = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return f"{prefix}{{{task_name}:{hashlib.sha256(text.encode()).hexdigest()}}}"


def template_key(rendered: str, prefix: str = "redlock:") -> str:
    """The key of a ``lock_key`` template or callable that rendered ``rendered``."""
    return f"{prefix}{{key:{hashlib.sha256(rendered.encode()).hexdigest()}}}"


def make_app(
    broker: RedisServer,
    lock_nodes: RedisNodes | Sequence[str] | None = None,
    **conf: Any,
) -> Celery:
    """A fresh Celery app on harness nodes: ``broker`` is broker and result back-end.

    ``lock_nodes`` become ``redlock_urls`` (None: leave the setting unset, so it defaults to the
    broker). ``conf`` overrides anything.
    """
    app = Celery(f"crl_{uuid.uuid4().hex[:10]}", set_as_current=False)
    app.conf.update(
        broker_url=broker.url,
        result_backend=broker.url,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_prefetch_multiplier=1,
        task_store_errors_even_if_ignored=True,
        # BRPOP times out every 0.1 s instead of 1 s: the embedded worker stops in ~0.2 s.
        broker_transport_options={"polling_interval": 0.1},
        # A result collected after its test's server stopped gives up at once (Celery before 5.7
        # retried 20 times, 1 s apart, in whatever thread collected it).
        result_backend_transport_options={
            "retry_policy": {"max_retries": 1, "interval_start": 0, "interval_step": 0.1}
        },
        # The 50 ms default per-node timeout counts a reply delayed by a busy CI machine as a
        # node failure; these tests are about Celery, not about slow nodes.
        redlock_node_timeout=0.5,
    )
    if lock_nodes is not None:
        urls = lock_nodes.urls if isinstance(lock_nodes, RedisNodes) else list(lock_nodes)
        app.conf.redlock_urls = urls
    app.conf.update(conf)
    return app


def make_app_publishing_nowhere(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    monkeypatch: pytest.MonkeyPatch,
    **conf: Any,
) -> Celery:
    """`make_app`, but for what it publishes: its ``broker_write_url`` is an address where
    nothing listens, and a publish fails at once (every deferral or retry its worker publishes
    fails); the embedded worker still consumes from ``broker``, which its start-up check is
    pointed at. Publish the tasks with ``apply_async(...,
    connection=app.connection_for_read())``."""
    monkeypatch.setenv("TEST_BROKER", broker.url)  # start_worker's check of the broker
    return make_app(
        broker,
        lock_nodes,
        broker_write_url=f"redis://127.0.0.1:{free_port()}/0",
        task_publish_retry=False,
        broker_transport_options={"polling_interval": 0.1, "max_retries": 0},
        **conf,
    )


@contextlib.contextmanager
def embedded_worker(
    app: Celery, pool: str = "threads", concurrency: int = 4, **options: Any
) -> Iterator[Any]:
    """Celery's embedded worker thread on ``app`` (tasks must be defined before it starts)."""
    try:
        with start_worker(
            app,
            pool=pool,
            concurrency=concurrency,
            perform_ping_check=False,
            loglevel="WARNING",
            shutdown_timeout=30.0,
            **options,
        ) as worker:
            yield worker
    finally:
        # kombu before 5.6 keeps the stopped worker's hub as the process's event loop, and the
        # next embedded worker's ETA timers never fire on it (celery#9983, kombu#2404).
        set_event_loop(None)
        collect_results_while_the_broker_is_up()  # the worker threads' result back-ends


class LockSignals:
    """Records the `celery_redlock.signals` sent in this process (embedded workers run here)."""

    NAMES = (
        "lock_acquired",
        "lock_duplicate",
        "lock_extended",
        "lock_lost",
        "lock_released",
        "lock_unavailable",
    )

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._receivers: list[tuple[Any, Callable[..., None]]] = []

    def connect(self) -> LockSignals:
        """Start recording."""
        for name in self.NAMES:
            signal_object = getattr(lock_signals_module, name)

            def receive(sender: Any = None, _name: str = name, **fields: Any) -> None:
                fields.pop("signal", None)
                event = {"signal": _name, "task": getattr(sender, "name", None), **fields}
                event["at"] = time.time()
                with self._changed:
                    self.events.append(event)
                    self._changed.notify_all()

            signal_object.connect(receive, weak=False)
            self._receivers.append((signal_object, receive))
        return self

    def disconnect(self) -> None:
        """Stop recording."""
        for signal_object, receive in self._receivers:
            signal_object.disconnect(receive)
        self._receivers.clear()

    def of(self, name: str, **match: Any) -> list[dict[str, Any]]:
        """The recorded events of signal ``name`` whose fields equal ``match``."""
        with self._changed:
            return [
                event
                for event in self.events
                if event["signal"] == name
                and all(event.get(field) == value for field, value in match.items())
            ]

    def wait(
        self, name: str, count: int = 1, timeout: float = 10.0, **match: Any
    ) -> list[dict[str, Any]]:
        """Wait for ``count`` events of signal ``name`` matching ``match``; fail at timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self.of(name, **match)) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"fewer than {count} {name} signal(s) matching {match}: {self.events}"
                    )
                self._changed.wait(left)
            return self.of(name, **match)


class RunLog(Recorder):
    """Task runs recorded (as `Recorder` streams) on a harness node, readable from any process.

    A task body wraps its work in ``with log.run(key):``; ``started`` is appended when the body
    begins, ``runs`` when it ends (with both timestamps). Timestamps are ``time.time()``, which
    every process on this machine shares.
    """

    STARTED = "runlog:started"
    RUNS = "runlog:runs"

    @contextlib.contextmanager
    def run(self, key: str, **extra: Any) -> Iterator[dict[str, Any]]:
        """Record one run of ``key`` around the block."""
        entry: dict[str, Any] = {
            "run": uuid.uuid4().hex,
            "key": key,
            "pid": os.getpid(),
            "thread": threading.get_ident(),
            "start": time.time(),
            **extra,
        }
        self.add(self.STARTED, **entry)
        try:
            yield entry
        finally:
            entry["end"] = time.time()
            self.add(self.RUNS, **entry)

    def started(self, key: str | None = None) -> list[dict[str, Any]]:
        """Runs that began, in order (finished or not)."""
        return [entry for entry in self.read(self.STARTED) if key is None or entry["key"] == key]

    def runs(self, key: str | None = None) -> list[dict[str, Any]]:
        """Runs that ended, in order of their end."""
        return [entry for entry in self.read(self.RUNS) if key is None or entry["key"] == key]

    def wait_started(
        self, count: int = 1, key: str | None = None, timeout: float = 10.0
    ) -> list[dict[str, Any]]:
        """Wait until ``count`` runs (of ``key``) began; fail the test after ``timeout``."""
        if not wait_until(lambda: len(self.started(key)) >= count, timeout):
            raise AssertionError(f"{count} run(s) of {key!r} did not start: {self.started()}")
        return self.started(key)

    def wait_runs(
        self, count: int = 1, key: str | None = None, timeout: float = 10.0
    ) -> list[dict[str, Any]]:
        """Wait until ``count`` runs (of ``key``) ended; fail the test after ``timeout``."""
        if not wait_until(lambda: len(self.runs(key)) >= count, timeout):
            raise AssertionError(f"{count} run(s) of {key!r} did not end: {self.runs()}")
        return self.runs(key)

    def wait_task_started(self, task_id: str, timeout: float = 10.0) -> dict[str, Any]:
        """Wait for the run of task ``task_id`` (recorded with ``task_id=``) to begin."""

        def found() -> list[dict[str, Any]]:
            return [entry for entry in self.started() if entry.get("task_id") == task_id]

        if not wait_until(found, timeout):
            raise AssertionError(f"task {task_id} did not start: {self.started()}")
        return found()[0]

    def record_signal(self, kind: str, **fields: Any) -> None:
        """Append a signal this process received to the ``LOCK_EVENTS`` stream."""
        entry = {"signal": kind, "pid": os.getpid(), "at": time.time()}
        entry.update({name: value for name, value in fields.items() if name != "signal"})
        self.add(LOCK_EVENTS, **entry)

    def mark_ended(self, run: dict[str, Any], end: float) -> None:
        """Record the end of a run whose process was killed (it never records one itself)."""
        self.add(self.RUNS, **{**run, "end": end, "killed": True})

    def intervals(self) -> dict[str, list[tuple[float, float]]]:
        """Per key, the (start, end) of every run; a run still going ends at infinity."""
        ended = {entry["run"]: entry["end"] for entry in self.runs()}
        by_key: dict[str, list[tuple[float, float]]] = {}
        for entry in self.started():
            end = ended.get(entry["run"], float("inf"))
            by_key.setdefault(entry["key"], []).append((entry["start"], end))
        return by_key

    def assert_no_overlap(self) -> None:
        """No two runs of one key were ever under way at the same time."""
        for key, spans in self.intervals().items():
            spans.sort()
            for (_, previous_end), (start, _) in itertools.pairwise(spans):
                assert start >= previous_end, (
                    f"runs of {key!r} overlapped: one started at {start:.3f} before the "
                    f"previous one ended at {previous_end:.3f} ({spans})"
                )


def lock_keys(nodes: RedisNodes, prefix: str = "redlock:") -> list[set[str]]:
    """The lock keys on each lock node (fencing counters and completion records left out)."""
    return [{key for key in keys if keyspace.is_lock_key(prefix, key)} for keys in all_keys(nodes)]


ENDED_FOR_GOOD = RANK_FORMAT.format(0, LAST_RETRIES)
"""The rank a run records when its message ended for good (success or failure, no retry asked
for): it covers every later attempt of the message."""


def completion_ranks(nodes: RedisNodes, task_id: str) -> list[set[str]]:
    """Per lock node, the attempts ("nesting:retries") recorded as completed for ``task_id``,
    over every message and lock key it ran under."""
    suffix = keyspace.records_key("", task_id)
    ranks = []
    for server in nodes:
        with server.client(decode_responses=True, socket_timeout=2) as client:
            found: set[str] = set()
            for key in client.scan_iter(match="*" + suffix):
                found.update(client.hvals(key))
            ranks.append(found)
    return ranks


def all_keys(nodes: RedisNodes) -> list[set[str]]:
    """Every key on each lock node."""
    found = []
    for server in nodes:
        with server.client(decode_responses=True, socket_timeout=2) as client:
            found.append(set(client.scan_iter()))
    return found


def stored_text(nodes: RedisNodes) -> list[str]:
    """Every key on every lock node, and every value of whatever type, as text."""
    texts: list[str] = []
    for server in nodes:
        with server.client(decode_responses=True, socket_timeout=2) as client:
            for key in client.scan_iter():
                texts.append(key)
                kind = client.type(key)
                if kind == "string":
                    texts.append(client.get(key) or "")
                elif kind == "hash":
                    texts.extend(f"{k}={v}" for k, v in client.hgetall(key).items())
                elif kind == "list":
                    texts.extend(client.lrange(key, 0, -1))
                elif kind in ("set", "zset"):
                    texts.extend(
                        client.zrange(key, 0, -1) if kind == "zset" else client.smembers(key)
                    )
                else:
                    texts.append(f"<{kind}>")
    return texts


def key_held(nodes: RedisNodes, key: str) -> bool:
    """Whether a majority of the lock nodes hold ``key``."""
    return sum(value is not None for value in values_on(nodes, key)) * 2 > len(nodes)


def key_gone(nodes: RedisNodes, key: str) -> bool:
    """Whether no lock node holds ``key``."""
    return all(value is None for value in values_on(nodes, key))
