"""One ``celery beat`` leader among several: the beat holding a Redlock lease sends the ticks, the
others wait for it (how: `celery_redlock.beat.leadership`). Run each beat with one of:

- ``celery_redlock.beat:LeaderScheduler`` — Celery's default scheduler (a shelve file per beat);
- ``celery_redlock.beat:LeaderDatabaseScheduler`` — django-celery-beat's ``DatabaseScheduler``
  (`celery_redlock.beat.django`), loaded on first use, so that this module imports without Django;
- `LeaderMixin` in front of any other scheduler class.
"""

from __future__ import annotations

from typing import Any

from ..lock.keyspace import SCHEDULE_SUFFIX  # kept for callers of 0.2
from .leadership import EntryRecord, LeaderMixin, LeaderScheduler, newest_records

# LeaderDatabaseScheduler is left out of __all__: it needs Django (see __getattr__).
__all__ = ["SCHEDULE_SUFFIX", "EntryRecord", "LeaderMixin", "LeaderScheduler", "newest_records"]


def __getattr__(name: str) -> Any:
    if name != "LeaderDatabaseScheduler":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from .django import LeaderDatabaseScheduler
    except ModuleNotFoundError as error:
        missing = (error.name or "").partition(".")[0]
        if missing not in {"django", "django_celery_beat"}:
            raise
        raise ImportError(
            f"celery_redlock.beat:LeaderDatabaseScheduler needs Django and django-celery-beat, "
            f"and {missing} is not installed: pip install 'celery-redlock[django]'",
            name=missing,
        ) from error
    return LeaderDatabaseScheduler
