"""The app that ``celery -A celery_apps.leader_app beat`` runs in tests/test_beat_leader.py.

Configured from environment variables (read at import): those of
`celery_apps.subprocesses.app_environment` (broker and record store on a harness node, never
6379; lock nodes), and

- ``CRL_LEASE_TTL``: ``redlock_beat_lease_ttl`` in seconds (default `LEASE_TTL`);
- ``CRL_BEAT_SCHEDULER``: ``beat_scheduler`` (default ``celery_redlock.beat:LeaderScheduler``;
  ``celery beat -S`` overrides it).

Two entries every `INTERVAL` seconds, so both kinds of Celery schedule are covered: ``interval``
(a plain interval, due `INTERVAL` after its last run, so its phase is that of whoever sent last)
and ``slots`` (due once per wall-clock slot, like a crontab: its ticks fall at fixed moments). No
worker runs: every beat records each task it *published* (``after_task_publish``, in the beat
process) in the `Recorder` stream ``sent``, with the entry's task name, the process id and the time.
"""

from __future__ import annotations

import math
import os
import time
from datetime import datetime
from typing import Any

from celery import signals
from celery.beat import Scheduler
from celery.schedules import schedstate, schedule

from celery_apps.subprocesses import Recorder, subprocess_app
from celery_redlock.beat import LeaderMixin

INTERVAL = 1.0
LEASE_TTL = 1.0
INTERVAL_TASK = "leader.interval"
SLOT_TASK = "leader.slot"
CUSTOM_TASK = "leader.custom"
SENT = "sent"


class every_slot(schedule):
    """Due once in every wall-clock slot ``floor(time / seconds)``, the way a crontab is due once
    per matching minute whoever started when (named like Celery's ``crontab``)."""

    def __init__(self, seconds: float) -> None:
        self.period = float(seconds)
        super().__init__(run_every=self.period)

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.period,))

    def is_due(self, last_run_at: datetime) -> schedstate:
        now = time.time()
        slot = math.floor(now / self.period)
        last_slot = math.floor(last_run_at.timestamp() / self.period)
        return schedstate(is_due=last_slot < slot, next=(slot + 1) * self.period - now)


def slot_of(timestamp: float) -> int:
    """The `every_slot(INTERVAL)` slot a time falls in."""
    return math.floor(timestamp / INTERVAL)


class MemoryScheduler(Scheduler):
    """A custom scheduler standing in for django-celery-beat's and the like: its own storage (in
    memory: every start forgets what was sent) and an entry of its own beside ``beat_schedule``."""

    def setup_schedule(self) -> None:
        super().setup_schedule()
        self.update_from_dict({"custom": {"task": CUSTOM_TASK, "schedule": INTERVAL}})


class LeaderMemoryScheduler(LeaderMixin, MemoryScheduler):
    """`MemoryScheduler` sending only while it holds the beat leader lease."""


app = subprocess_app(
    "celery_apps.leader_app",
    timezone="UTC",
    # Replies from the lock nodes of a busy 2-core test machine may take longer than 50 ms.
    redlock_node_timeout=0.3,
    redlock_beat_lease_ttl=float(os.environ.get("CRL_LEASE_TTL", LEASE_TTL)),
    beat_scheduler=os.environ.get("CRL_BEAT_SCHEDULER", "celery_redlock.beat:LeaderScheduler"),
    beat_schedule={
        "interval": {"task": INTERVAL_TASK, "schedule": INTERVAL},
        "slots": {"task": SLOT_TASK, "schedule": every_slot(INTERVAL)},
    },
)

recorder = Recorder(app.conf.broker_url)


def _record_published(sender: str | None = None, headers: Any = None, **_: Any) -> None:
    """Every task this process published (beat publishes by task name: no task is defined)."""
    task_id = headers.get("id") if isinstance(headers, dict) else None
    recorder.add(SENT, task=sender, id=task_id, pid=os.getpid(), at=time.time())


@signals.beat_init.connect
def _record_what_beat_publishes(sender: Any = None, **_: Any) -> None:
    """Only in a beat process of this app: the test process imports the module for its
    constants and publishes tasks of its own."""
    if getattr(sender, "app", None) is app:
        signals.after_task_publish.connect(_record_published)
