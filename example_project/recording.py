"""Demo instrumentation: every submission, run and duplicate, as JSON events in one Redis list.

Events are pushed (``RPUSH``) by whichever process sees them, to the list
``redlock-demo:<run id>:events`` on the events server (``DEMO_EVENTS_URL``, else the broker when
it is Redis, else the first lock node); the demo runner reads the list while the demo runs.

====================  =================================================  ====================
event ``e``           sent from                                          means
====================  =================================================  ====================
``submit``            Celery's ``after_task_publish`` (client or beat)   a new task message
                                                                         (``burst``: the
                                                                         burst it belongs to)
``again``             Celery's ``after_task_publish`` (a worker)         the same task id
                                                                         published again: a
                                                                         retry, or deferred
``start`` / ``run``   the task body (`recorded_run`)                     the body ran, with
                                                                         start and end times
``acquired``          celery_redlock's ``lock_acquired``                 lock taken (``waited``)
``dup``               celery_redlock's ``lock_duplicate``                lock held by another
                                                                         run; ``policy`` says
                                                                         skip/retry/wait/
                                                                         coalesce/coalesced
``lost``              celery_redlock's ``lock_lost``                     a run lost its lock
``done``              Celery's ``task_postrun`` (any state)              a delivery finished
====================  =================================================  ====================

Every event carries ``id`` (the task id), ``task``, ``key`` (a readable label of the lock key,
e.g. ``report acct 17 2024-06-01``) and ``t`` (``time.time()``). A message is finished once
its deliveries (``done``) catch up with its publications (``submit`` plus ``again``). Recording
never breaks a task: errors are logged once and ignored.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import redis
from celery import signals as celery_signals

from celery_redlock import signals as lock_signals
from celery_redlock.integration.messages import DEFERRED_HEADER

logger = logging.getLogger(__name__)

RUN_ID_VARIABLE = "DEMO_RUN_ID"
EVENTS_URL_VARIABLE = "DEMO_EVENTS_URL"
BURST_HEADER = "demo_burst"
"""Message header naming the burst of triggers a call belongs to (demo bookkeeping only)."""

Label = Callable[[dict[str, Any]], str]

_app: Any = None
_labels: dict[str, tuple[inspect.Signature, Label]] = {}
_publisher = "client"
_client: redis.Redis | None = None
_client_pid = 0
_client_lock = threading.Lock()
_warned = False


def setup(app: Any, labels: Mapping[str, Label]) -> None:
    """Record the tasks of ``app`` named in ``labels`` (task name -> label of bound arguments)."""
    global _app
    _app = app
    for name, label in labels.items():
        _labels[name] = (inspect.signature(app.tasks[name].run), label)


def events_key(run_id: str | None = None) -> str:
    """The Redis list holding one demo run's events."""
    return f"redlock-demo:{run_id or os.environ.get(RUN_ID_VARIABLE) or 'manual'}:events"


def events_url(app: Any = None) -> str:
    """Where events go: DEMO_EVENTS_URL, else a Redis broker, else the first lock node."""
    app = app or _app
    configured = os.environ.get(EVENTS_URL_VARIABLE)
    if configured:
        return configured
    broker = (app.conf.broker_url or "").split(";")[0]
    if broker.startswith(("redis://", "rediss://", "unix://")):
        return str(broker)
    urls = app.conf.get("redlock_urls") or []
    if isinstance(urls, str):
        urls = [url.strip() for url in urls.split(",") if url.strip()]
    if not urls:
        raise RuntimeError("no Redis server to record demo events on: set DEMO_EVENTS_URL")
    return str(urls[0])


def key_label(task_name: str, args: Any, kwargs: Any) -> str:
    """A readable label of the lock key of one call, e.g. ``report acct 17 2024-06-01``."""
    signature, label = _labels[task_name]
    try:
        bound = signature.bind(*(args or ()), **(kwargs or {}))
        bound.apply_defaults()
        return label(dict(bound.arguments))
    except (TypeError, KeyError, ValueError):
        return task_name.rsplit(".", 1)[-1]


def worker_name(task: Any) -> str:
    """The short node name of the worker running ``task`` (``demo1`` of ``demo1@host``)."""
    hostname = getattr(task.request, "hostname", None) or "local"
    return str(hostname).split("@", 1)[0]


def record(event: dict[str, Any]) -> None:
    """Append one event to the run's list; never raises."""
    global _warned
    event.setdefault("t", time.time())
    try:
        _events_client().rpush(events_key(), json.dumps(event, separators=(",", ":")))
    except Exception as error:
        if not _warned:
            _warned = True
            logger.warning("demo recording is failing (%s); the demo timeline is incomplete", error)


def _events_client() -> redis.Redis:
    """One client per process, created after fork (prefork children never share sockets)."""
    global _client, _client_pid
    with _client_lock:
        if _client is None or _client_pid != os.getpid():
            _client = redis.Redis.from_url(
                events_url(), socket_timeout=2.0, socket_connect_timeout=2.0
            )
            _client_pid = os.getpid()
        return _client


@contextmanager
def recorded_run(task: Any) -> Iterator[None]:
    """Record the body of a run: where it ran, from when to when, and how it ended."""
    request = task.request
    base = {
        "id": request.id,
        "task": task.name,
        "key": key_label(task.name, request.args, request.kwargs),
        "worker": worker_name(task),
        "pid": os.getpid(),
        "attempt": request.retries or 0,
    }
    start = time.time()
    record({"e": "start", **base, "t": start})
    outcome = "error"
    try:
        yield
        outcome = "ok"
    finally:
        end = time.time()
        record({"e": "run", **base, "start": start, "end": end, "outcome": outcome, "t": end})


# -- signal handlers: connected at import, active once `setup` named the tasks -----------------


def _on_beat_init(**_: Any) -> None:
    global _publisher
    _publisher = "beat"


def _on_published(
    sender: str | None = None, body: Any = None, headers: dict[str, Any] | None = None, **_: Any
) -> None:
    headers = headers or {}
    name = sender or headers.get("task")
    if name not in _labels:
        return
    args, kwargs = (body[0], body[1]) if isinstance(body, (tuple, list)) else ((), {})
    event = {"id": headers.get("id"), "task": name, "key": key_label(name, args, kwargs)}
    if headers.get(DEFERRED_HEADER) or headers.get("retries"):
        # The same task id again (a retry, a deferral, a coalescing run's safety copy): one
        # more delivery to wait for, not a new call.
        record({"e": "again", **event})
    else:
        burst = headers.get(BURST_HEADER)
        record({"e": "submit", **event, "via": _publisher, **({"burst": burst} if burst else {})})


def _task_event(kind: str, task: Any, task_id: str | None, **fields: Any) -> None:
    if task is None or getattr(task, "name", None) not in _labels:
        return
    request = task.request
    record(
        {
            "e": kind,
            "id": task_id or request.id,
            "task": task.name,
            "key": key_label(task.name, request.args, request.kwargs),
            "worker": worker_name(task),
            "pid": os.getpid(),
            "attempt": request.retries or 0,
            **fields,
        }
    )


def _on_duplicate(
    sender: Any = None,
    task_id: str | None = None,
    policy: str = "",
    holder: dict[str, Any] | None = None,
    **_: Any,
) -> None:
    holder = holder or {}
    _task_event(
        "dup",
        sender,
        task_id,
        policy=policy,
        holder_id=holder.get("id"),
        holder_pid=holder.get("pid"),
    )


def _on_acquired(
    sender: Any = None, task_id: str | None = None, waited: float = 0.0, **_: Any
) -> None:
    _task_event("acquired", sender, task_id, waited=round(float(waited or 0.0), 4))


def _on_lost(sender: Any = None, task_id: str | None = None, reason: Any = None, **_: Any) -> None:
    _task_event("lost", sender, task_id, reason=str(reason))


def _on_postrun(
    sender: Any = None, task_id: str | None = None, task: Any = None, state: str = "", **_: Any
) -> None:
    _task_event("done", task or sender, task_id, state=state)


celery_signals.beat_init.connect(_on_beat_init, weak=False)
celery_signals.after_task_publish.connect(_on_published, weak=False)
celery_signals.task_postrun.connect(_on_postrun, weak=False)
lock_signals.lock_duplicate.connect(_on_duplicate, weak=False)
lock_signals.lock_acquired.connect(_on_acquired, weak=False)
lock_signals.lock_lost.connect(_on_lost, weak=False)
