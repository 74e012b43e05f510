"""The demo's Celery app: a reporting back-end whose tasks must never run twice at once.

Five tasks, five reasons duplicates happen in real fleets:

- ``rebuild_report(account_id, day, requested_by=None)``: several people press "rebuild" on
  the same report. The lock is keyed on ``(account_id, day)`` only, so requests from different
  users for the same report are duplicates; a duplicate is *skipped* (the running rebuild does
  the work everyone asked for).
- ``import_catalog(source_url)``: an expensive import a user triggers twice. The second click
  *waits* for the first import to finish (woken by the release, no polling), then runs, so the
  newest data is imported once more, never concurrently with the first import.
- ``sync_account(account_id, full=False)``: called by name (``send_task``) from another
  service; keyed on the account only. A duplicate *retries* later with back-off.
- ``refresh_search_index(storefront)``: every product save triggers a refresh of the
  storefront's search index, and editors save in bursts. A trigger arriving while a refresh
  runs must not be dropped (that refresh may have read the products before the save) nor run
  once per save: it is *coalesced*. The first such trigger becomes the one pending refresh,
  woken by the release; every later one merges into it. A burst costs at most one extra run.
- ``refresh_exchange_rates()``: a beat job every 2 seconds whose run sometimes takes longer
  than 2 seconds; keyed on the task name alone (``lock_args=()``), the overlapping tick is
  *skipped*.

Configuration (environment variables, read at import, or any Celery settings module):

- ``DEMO_BROKER_URL``: the broker (else ``broker_url`` / ``CELERY_BROKER_URL`` as usual);
- ``DEMO_REDLOCK_URLS``: comma-separated independent Redis masters for the locks (else
  ``redlock_urls``);
- ``DEMO_CELERY_CONFIG``: a module name handed to ``app.config_from_object`` first, e.g. one
  that sets ``broker_url`` and ``redlock_urls``.

``python -m example_project`` sets the first two for its workers and beat when it starts its own
Redis servers. The task bodies call `example_project.recording.recorded_run` only to feed the
demo's timeline; a real application would not.
"""

from __future__ import annotations

import os
import random
import time

import redis
from celery import Celery

from celery_redlock import singleton_task
from celery_redlock.fencing.redis import fenced_set

from . import recording

QUEUE = "redlock_demo"
"""The demo's own queue, so it never consumes another application's tasks on a shared broker."""

BEAT_PERIOD = 2.0
"""Seconds between two ``refresh_exchange_rates`` runs sent by beat."""

app = Celery("example_project")

_config_module = os.environ.get("DEMO_CELERY_CONFIG")
if _config_module:
    app.config_from_object(_config_module)

app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,  # the demo reads its timeline from recording, not from results
    # A worker takes a message only when a pool process is free to run it (the message is
    # acknowledged once the run ends): a burst of duplicates never waits behind busy processes
    # while another worker's process is idle.
    worker_prefetch_multiplier=1,
    task_acks_late=True,
    broker_connection_retry_on_startup=True,
    timezone="UTC",
    redlock_ttl=10,  # short: a lock left by a killed demo worker frees itself quickly
    beat_schedule={
        "refresh-exchange-rates": {
            "task": "example_project.tasks.refresh_exchange_rates",
            "schedule": BEAT_PERIOD,
        }
    },
)
if os.environ.get("DEMO_BROKER_URL"):
    app.conf.broker_url = os.environ["DEMO_BROKER_URL"]
if os.environ.get("DEMO_REDLOCK_URLS"):
    app.conf.redlock_urls = [
        url.strip() for url in os.environ["DEMO_REDLOCK_URLS"].split(",") if url.strip()
    ]


REPORT_KEYS = "redlock_demo:report:"
"""Where ``rebuild_report`` stores reports: the Redis of the demo's events (data, no lock node)."""
_reports: redis.Redis | None = None


def report_store() -> redis.Redis:
    """The Redis client of the reports, made on first use in each process."""
    global _reports
    if _reports is None:
        _reports = redis.Redis.from_url(recording.events_url(app), socket_timeout=5)
    return _reports


def _work(low: float, high: float, steps: int = 4) -> None:
    """Stand-in for real work: ``steps`` chunks lasting ``low``..``high`` seconds in all."""
    total = random.uniform(low, high)
    for _ in range(steps):
        time.sleep(total / steps)


@singleton_task(app=app, bind=True, lock_args=("account_id", "day"), on_duplicate="skip")
def rebuild_report(self, account_id: int, day: str, requested_by: str | None = None) -> str:
    """Recompute one account's daily report; whoever asked, one rebuild at a time per report."""
    with recording.recorded_run(self):
        _work(0.8, 2.2)
        # Refused (StaleFence) if this run was paused past its lock and a later run wrote.
        report = f"rebuilt by {self.request.hostname}"
        fenced_set(report_store(), f"{REPORT_KEYS}{account_id}:{day}", report, self.lock)
    return f"report {account_id}/{day} rebuilt"


@singleton_task(app=app, bind=True, on_duplicate="wait", lock_wait=15)
def import_catalog(self, source_url: str) -> int:
    """Import a product catalog; a second click waits for the running import, then runs."""
    rows = 0
    with recording.recorded_run(self):
        for _ in range(5):
            _work(0.3, 0.6, steps=1)
            rows += 1000
            self.extend_lock()  # raises LockLost if the lock is gone: stop before writing more
    return rows


@singleton_task(
    app=app,
    bind=True,
    lock_args=("account_id",),
    on_duplicate="retry",
    max_retries=12,
)
def sync_account(self, account_id: int, full: bool = False) -> str:
    """Sync one account with the billing system; a duplicate retries with back-off."""
    with recording.recorded_run(self):
        _work(1.0, 2.4 if full else 1.6)
    return f"account {account_id} synced"


@singleton_task(
    app=app,
    bind=True,
    on_duplicate="coalesce",
    # The pending run publishes a safety copy of itself that comes back after lock_ttl + 1 s
    # (acknowledged then, as it already ran). Longer than a wait plus a run (at most about
    # 5.5 s), so the copy never finds its original still running; short, so the demo does not
    # wait long for the last copy before it stops the workers.
    lock_ttl=6,
)
def refresh_search_index(self, storefront: str) -> None:
    """Re-index a storefront's products; triggers during a refresh collapse into one more run."""
    with recording.recorded_run(self):
        _work(1.8, 2.6)


@singleton_task(app=app, bind=True, lock_args=(), on_duplicate="skip")
def refresh_exchange_rates(self) -> None:
    """Beat job every 2 s; one run in three or so takes longer than that."""
    with recording.recorded_run(self):
        if random.random() < 0.35:
            _work(2.2, 3.2)
        else:
            _work(0.6, 1.5)


def _short_source(source_url: str) -> str:
    return source_url.rstrip("/").rsplit("/", 1)[-1].removesuffix(".csv")


recording.setup(
    app,
    {
        rebuild_report.name: lambda a: f"report acct {a['account_id']} {a['day']}",
        import_catalog.name: lambda a: f"import {_short_source(a['source_url'])}",
        sync_account.name: lambda a: f"sync acct {a['account_id']}",
        refresh_search_index.name: lambda a: f"search index {a['storefront']}",
        refresh_exchange_rates.name: lambda a: "exchange rates (beat)",
    },
)
