"""The app a celery-redlock 0.2.0 worker and a worker of today both load in
tests/test_upgrade_from_0_2.py, each with its own ``celery_redlock`` first on ``PYTHONPATH``: so
it uses only what both versions have (``singleton_task``), and no harness module.

Configured by ``CRL_BROKER_URL`` (broker, result back-end, the record of runs) and
``CRL_LOCK_URLS`` (comma-separated lock nodes). Each run of `job` appends ``[key, start, end,
version]`` (``time.time()``, shared by every process on this machine) to the list `RUNS`; each
tick a ``celery beat`` of this app publishes (`TICK_TASK`, every `TICK` seconds, by the beat
leader: ``celery_redlock.beat:LeaderScheduler``) appends ``[time, version, pid]`` to `SENT`.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery, signals

import celery_redlock
from celery_redlock import singleton_task

RUNS = "upgrade:runs"
SENT = "upgrade:sent"
TICK = 0.5
TICK_TASK = "upgrade.tick"
# Neither version has __version__; AlreadyCompleted came after 0.2.0.
VERSION = "today" if hasattr(celery_redlock, "AlreadyCompleted") else "0.2.0"

app = Celery("upgrade_app", set_as_current=False)
app.conf.update(
    broker_url=os.environ["CRL_BROKER_URL"],
    result_backend=os.environ["CRL_BROKER_URL"],
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    redlock_urls=os.environ["CRL_LOCK_URLS"].split(","),
    beat_scheduler="celery_redlock.beat:LeaderScheduler",
    beat_schedule={"tick": {"task": TICK_TASK, "schedule": TICK}},
    beat_max_loop_interval=0.1,
    redlock_beat_lease_ttl=2.0,
)
records = redis.Redis.from_url(os.environ["CRL_BROKER_URL"])


@singleton_task(app=app, name="upgrade.job", lock_args=("key",), lock_ttl=5)
def job(key: str, seconds: float) -> None:
    """Hold the lock on ``key`` for ``seconds``, recording the run."""
    start = time.time()
    time.sleep(seconds)
    records.rpush(RUNS, json.dumps([key, start, time.time(), VERSION]))


@signals.after_task_publish.connect(weak=False)
def record_tick(sender: str | None = None, **_: object) -> None:
    """In a beat: record each tick it publishes."""
    if sender == TICK_TASK:
        records.rpush(SENT, json.dumps([time.time(), VERSION, os.getpid()]))
