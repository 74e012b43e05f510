"""django-celery-beat's ``DatabaseScheduler`` sending only while it holds the beat leader lease.

Use it as ``celery -A proj beat -S celery_redlock.beat:LeaderDatabaseScheduler`` (or
``CELERY_BEAT_SCHEDULER = "celery_redlock.beat:LeaderDatabaseScheduler"``): `celery_redlock.beat`
loads this module on first use, as it needs Django and django-celery-beat
(``pip install 'celery-redlock[django]'``) and a Django project that is set up, which ``celery
beat`` does before it loads its scheduler in any project configured from Django's settings.

The database holds the schedule and every entry's state (``last_run_at``, ``total_run_count``)
for all the beats; the lock nodes hold the leaders' records of the ticks they cleared for sending
(`celery_redlock.beat.leadership.LeaderMixin`). The two are kept consistent this way:

- the leader writes each tick's state to the database right after sending it
  (django-celery-beat's own scheduler writes every three minutes), so the database trails the
  records by at most the tick in flight;
- a beat taking the lease reads the schedule from the database again, not the copy it loaded
  when it started, and continues each entry from the newer of the database's state and the
  record (the record is newer where the old leader died before writing; the database is newer
  where someone changed the row since); state taken from a record goes to the database at once;
- a beat that does not hold the lease never writes entry state: what it had not yet written when
  it lost the lease is left to the records, which carry it to the next leader;
- every write is conditional: it never moves a row's ``last_run_at`` back and never touches a
  disabled row, so a leader that was paused past its lease cannot overwrite what its successor
  wrote.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from celery.utils.time import maybe_make_aware
from django.db import DatabaseError, InterfaceError  # type: ignore[import-untyped]
from django.db.models import Q  # type: ignore[import-untyped]
from django_celery_beat.schedulers import (  # type: ignore[import-untyped]
    DatabaseScheduler,
    ModelEntry,
)

from .leadership import LeaderMixin

__all__ = ["LeaderDatabaseScheduler", "LeaderModelEntry"]

logger = logging.getLogger(__name__)


class LeaderModelEntry(ModelEntry):  # type: ignore[misc]
    """django-celery-beat's entry (a ``PeriodicTask`` row) whose state writes never go back."""

    def save(self) -> None:
        """Write ``last_run_at`` and ``total_run_count`` to the entry's row, unless the row holds
        a later ``last_run_at`` already (a newer leader wrote it) or is disabled (django-celery-beat
        keeps no run time for a disabled task). A deleted row is skipped."""
        model = self.model
        # Django's documented way to the model's manager, as ModelEntry.save uses it.
        rows = type(model)._default_manager.filter(pk=model.pk, enabled=True)
        if model.last_run_at is not None:
            rows = rows.filter(Q(last_run_at__isnull=True) | Q(last_run_at__lte=model.last_run_at))
        rows.update(last_run_at=model.last_run_at, total_run_count=model.total_run_count)


class LeaderDatabaseScheduler(LeaderMixin, DatabaseScheduler):  # type: ignore[misc]
    """django-celery-beat's ``DatabaseScheduler`` sending only while it holds the lease.

    Promises those of `leadership.LeaderMixin` (at most one beat sends; each tick is sent once;
    a new leader continues every entry from the last tick sent), and that the
    database's ``last_run_at`` and ``total_run_count`` of each entry follow the ticks sent: the
    leader writes them after each tick, a follower never writes them, and no write moves them
    back.
    """

    Entry = LeaderModelEntry

    def schedule_changed(self) -> bool:
        """Whether the schedule must be read from the database again: when django-celery-beat
        sees a change, and on every read while this beat does not lead (a leader's writes of
        entry state do not count as changes, so a follower's copy would be stale)."""
        changed = bool(super().schedule_changed())
        return changed or not self.is_leader

    def adopt_entry_state(self, entry: Any, last_run_at: datetime, total_run_count: int) -> None:
        """Continue ``entry`` from a leader's record when the record is newer than the row just
        read from the database, and write the record's state to the row at once; otherwise keep
        the row's state."""
        if not _is_later(last_run_at, entry.last_run_at):
            return
        super().adopt_entry_state(entry, last_run_at, total_run_count)
        entry.model.last_run_at = last_run_at
        entry.model.total_run_count = total_run_count
        try:
            entry.save()
        except (DatabaseError, InterfaceError) as error:
            # The records still hold the state, and the entry's next tick writes it.
            logger.warning(
                "beat leader: could not write the recorded state of %s to the database: %r",
                entry.name,
                error,
            )

    def should_sync(self) -> bool:
        """True while this beat leads: the state of each tick sent is written right away (only
        entries with ticks not yet written are written)."""
        return self.is_leader

    def sync(self) -> None:
        """Write the state of the ticks sent, only while this beat holds the lease."""
        if self.is_leader:
            super().sync()

    def close(self) -> None:
        """Write the state of the ticks sent while still leading, then release the lease and
        close the scheduler."""
        self.sync()
        super().close()


def _is_later(candidate: datetime, current: datetime | None) -> bool:
    """True when ``candidate`` is after ``current`` (naive times count as UTC, as in Celery)."""
    if current is None:
        return True
    return bool(maybe_make_aware(candidate) > maybe_make_aware(current))
