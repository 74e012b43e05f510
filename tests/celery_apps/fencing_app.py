"""The app that ``celery -A celery_apps.fencing_app worker`` runs in
tests/test_fencing_storages.py: one singleton task writing to a store of `fencing_stores`.

Configured from the environment of `celery_apps.subprocesses.app_environment` (read at import):
broker, result back-end and `Recorder` (a harness node), lock nodes.

Stream ``holding``: a body began, holding its lock (its ``value`` and fencing ``token``).
"""

from __future__ import annotations

import time
from pathlib import Path

from celery import Task
from fencing_stores import open_store

from celery_apps.subprocesses import Recorder, subprocess_app
from celery_redlock import singleton_task

LOCK_TTL = 1.0
"""Short: the holder paused by the test loses its lock within a second."""

app = subprocess_app("celery_apps.fencing_app", redlock_node_timeout=0.3)
recorder = Recorder(app.conf.broker_url)


@singleton_task(
    app=app,
    name="fencing.write",
    bind=True,
    lock_key="fenced:{resource}",
    lock_ttl=LOCK_TTL,
    on_duplicate="wait",
    lock_wait=30,
)
def write(self: Task, storage: str, address: str, resource: str, value: str, go: str = "") -> int:
    """Write ``value`` to ``resource``, fenced by this run's lock; with ``go``, first wait for
    that file to exist. Returns the run's fencing token; a refused write raises StaleFence."""
    recorder.add("holding", value=value, token=self.lock.fencing_token)
    deadline = time.monotonic() + 60
    while go and not Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    store = open_store(storage, address)
    try:
        store.write(resource, self.lock, value)
    finally:
        store.close()
    return int(self.lock.fencing_token)
