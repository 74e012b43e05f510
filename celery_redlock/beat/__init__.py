"""One ``celery beat`` leader among several: a Redlock lease decides which beat sends the ticks.

Run as many ``celery beat`` processes as availability asks for, each with one of these schedulers;
the beat holding the lease sends the due tasks, the others send nothing until the lease frees up
(how: `celery_redlock.beat.leadership`):

- ``celery_redlock.beat:LeaderScheduler`` — Celery's default scheduler (a shelve file per beat);
- ``celery_redlock.beat:LeaderDatabaseScheduler`` — django-celery-beat's ``DatabaseScheduler``
  (`celery_redlock.beat.django`), loaded on first use, so that this module imports without Django;
- `LeaderMixin` in front of any other scheduler class.
"""

from __future__ import annotations

from typing import Any

from .leadership import SCHEDULE_SUFFIX, EntryRecord, LeaderMixin, LeaderScheduler, newest_records

# LeaderDatabaseScheduler is left out of __all__: it needs Django (see __getattr__).
__all__ = [
    "SCHEDULE_SUFFIX",
    "EntryRecord",
    "LeaderMixin",
    "LeaderScheduler",
    "newest_records",
]

DJANGO_EXTRA_HINT = "pip install 'celery-redlock[django]'"


def __getattr__(name: str) -> Any:
    """``LeaderDatabaseScheduler`` (`celery_redlock.beat.django`), imported on first use.

    Raises:
        ImportError: django-celery-beat is not installed (the message names the extra).
    """
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
            f"and {missing} is not installed: {DJANGO_EXTRA_HINT}",
            name=missing,
        ) from error
    return LeaderDatabaseScheduler
