"""The app a celery-redlock 0.2.0 worker and a worker of today both load in
tests/test_upgrade_from_0_2.py, each with its own ``celery_redlock`` first on ``PYTHONPATH``: so
it uses only what both versions have (``singleton_task``), and no harness module.

Configured by ``CRL_BROKER_URL`` (broker, result back-end, the record of runs) and
``CRL_LOCK_URLS`` (comma-separated lock nodes). Each run of `job` appends ``[key, start, end,
version]`` (``time.time()``, shared by every process on this machine) to the list `RUNS`.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

import celery_redlock
from celery_redlock import singleton_task

RUNS = "upgrade:runs"
# Neither version has __version__; AlreadyCompleted came after 0.2.0.
VERSION = "today" if hasattr(celery_redlock, "AlreadyCompleted") else "0.2.0"

app = Celery("upgrade_app", set_as_current=False)
app.conf.update(
    broker_url=os.environ["CRL_BROKER_URL"],
    result_backend=os.environ["CRL_BROKER_URL"],
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    redlock_urls=os.environ["CRL_LOCK_URLS"].split(","),
)
records = redis.Redis.from_url(os.environ["CRL_BROKER_URL"])


@singleton_task(app=app, name="upgrade.job", lock_args=("key",), lock_ttl=5)
def job(key: str, seconds: float) -> None:
    """Hold the lock on ``key`` for ``seconds``, recording the run."""
    start = time.time()
    time.sleep(seconds)
    records.rpush(RUNS, json.dumps([key, start, time.time(), VERSION]))
