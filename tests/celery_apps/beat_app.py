"""The app that ``celery -A celery_apps.beat_app beat|worker`` runs in tests/test_beat.py.

Configured from environment variables (read at import): those of
`celery_apps.subprocesses.app_environment` (broker and result back-end, a harness node, never
6379, where task bodies record their runs too; lock nodes), and

- ``CRL_BEAT_SCENARIO``: which beat schedule to run:

  - ``"overlap"``: ``beat.slow`` every second, a run lasts `SLOW_RUN_SECONDS` (longer than the
    interval); keyed on the task name alone with ``on_duplicate="skip"``;
  - ``"double"``: ``beat.fast_held`` (a 0.1 s run keeping its lock `HOLD_SECONDS` after it
    ends) and ``beat.fast_unheld`` (the same without ``lock_hold``, the control) every
    `DOUBLE_PERIOD` seconds on wall-clock slots;

- ``CRL_BEAT_OFFSET``: seconds by which this beat process's slots are shifted, so that two beat
  processes tick in the same slot at a known distance apart (like two beats started at different
  moments with the same interval).
"""

from __future__ import annotations

import math
import os
import time
from datetime import datetime
from typing import Any

from celery import signals
from celery.schedules import schedstate, schedule

from celery_apps.subprocesses import Recorder, subprocess_app
from celery_redlock import signals as lock_signals
from celery_redlock import singleton_task

SLOW_INTERVAL = 1.0
SLOW_RUN_SECONDS = 2.5
DOUBLE_PERIOD = 2.0
FAST_RUN_SECONDS = 0.1
HOLD_SECONDS = 1.3


class aligned_every(schedule):
    """Due once in every wall-clock slot ``floor((time - offset) / seconds)``.

    Beat processes using it tick at known moments (``offset`` seconds into every slot) instead
    of at an interval counted from each one's start-up; named like Celery's ``crontab``.
    """

    def __init__(self, seconds: float, offset: float = 0.0) -> None:
        self.period = float(seconds)
        self.offset = float(offset)
        super().__init__(run_every=self.period)

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.period, self.offset))

    def is_due(self, last_run_at: datetime) -> schedstate:
        now = time.time() - self.offset
        slot = math.floor(now / self.period)
        to_next_slot = (slot + 1) * self.period - now
        last_slot = math.floor((last_run_at.timestamp() - self.offset) / self.period)
        return schedstate(is_due=last_slot < slot, next=to_next_slot)


def slot_of(timestamp: float) -> int:
    """The `aligned_every(DOUBLE_PERIOD)` slot (offset 0) a time falls in."""
    return math.floor(timestamp / DOUBLE_PERIOD)


SCENARIO = os.environ.get("CRL_BEAT_SCENARIO", "overlap")
OFFSET = float(os.environ.get("CRL_BEAT_OFFSET", "0"))

app = subprocess_app(
    "celery_apps.beat_app",
    timezone="UTC",
    beat_max_loop_interval=0.5,
    redlock_node_timeout=0.3,
    beat_schedule=(
        {"slow": {"task": "beat.slow", "schedule": SLOW_INTERVAL}}
        if SCENARIO == "overlap"
        else {
            "fast-held": {
                "task": "beat.fast_held",
                "schedule": aligned_every(DOUBLE_PERIOD, OFFSET),
            },
            "fast-unheld": {
                "task": "beat.fast_unheld",
                "schedule": aligned_every(DOUBLE_PERIOD, OFFSET),
            },
        }
    ),
)

recorder = Recorder(app.conf.broker_url)


def _recorded_run(name: str, seconds: float) -> None:
    start = time.time()
    recorder.add(f"{name}:started", pid=os.getpid(), start=start)
    time.sleep(seconds)
    recorder.add(f"{name}:runs", pid=os.getpid(), start=start, end=time.time())


@singleton_task(app=app, name="beat.slow", lock_args=(), lock_ttl=10, on_duplicate="skip")
def slow() -> None:
    """A periodic job whose run outlasts its interval."""
    _recorded_run("slow", SLOW_RUN_SECONDS)


@singleton_task(
    app=app,
    name="beat.fast_held",
    lock_args=(),
    lock_ttl=10,
    on_duplicate="skip",
    lock_hold=HOLD_SECONDS,
)
def fast_held() -> None:
    """A quick periodic job: at most one run per `HOLD_SECONDS` window."""
    _recorded_run("fast_held", FAST_RUN_SECONDS)


@singleton_task(app=app, name="beat.fast_unheld", lock_args=(), lock_ttl=10, on_duplicate="skip")
def fast_unheld() -> None:
    """The same quick job without `lock_hold`: shows what two beats do without it."""
    _recorded_run("fast_unheld", FAST_RUN_SECONDS)


@signals.task_prerun.connect
def _record_delivery(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    """Every message a worker starts on, before the lock is even tried."""
    if getattr(sender, "app", None) is not app:  # connected in the test process too
        return
    recorder.add("deliveries", task=getattr(sender, "name", None), id=task_id, at=time.time())


@lock_signals.lock_duplicate.connect
def _record_duplicate(sender: Any = None, policy: str = "", **_: Any) -> None:
    if getattr(sender, "app", None) is not app:  # connected in the test process too
        return
    recorder.add("duplicates", task=getattr(sender, "name", None), policy=policy, at=time.time())
