"""django-celery-beat's ``DatabaseScheduler`` sending only while it holds the beat leader lease:
``celery -A proj beat -S celery_redlock.beat:LeaderDatabaseScheduler``. The database holds the
schedule and every entry's state for all beats; the lock nodes hold the leaders' records of the
ticks they sent (`celery_redlock.beat.leadership`).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from celery.utils.time import maybe_make_aware
from django.core.exceptions import ObjectDoesNotExist  # type: ignore[import-untyped]
from django.db import (  # type: ignore[import-untyped]
    DatabaseError,
    InterfaceError,
    close_old_connections,
)
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

    Promises those of `LeaderMixin`, and that each row's ``last_run_at`` and ``total_run_count``
    follow the ticks sent: the leader writes them after each tick, a follower never writes them,
    and no write moves them back.
    """

    Entry = LeaderModelEntry

    def all_as_schedule(self) -> dict[str, Any]:
        """The rows as entries. While leading, each continues from the newer of its row and this
        beat's last record of it: a row whose write failed (django-celery-beat logs a database
        error and drops it) is behind the tick sent, which would be due again."""
        schedule: dict[str, Any] = super().all_as_schedule()
        for name, entry in schedule.items():
            record = self._leader_recorded.get(name) if self.is_leader else None
            if record is not None:
                self.adopt_entry_state(entry, record.last_run_at, record.total_run_count)
        return schedule

    def schedule_changed(self) -> bool:
        """Whether to read the schedule again: on a change django-celery-beat sees, and always
        while following (a leader's state writes are no changes, so a follower's copy is stale)."""
        return bool(super().schedule_changed()) or not self.is_leader

    def adopt_entry_state(self, entry: Any, last_run_at: datetime, total_run_count: int) -> None:
        """Continue ``entry`` from a leader's record newer than its row, and write it to the row."""
        current = entry.last_run_at
        # Naive times count as UTC, as in Celery.
        if current is not None and maybe_make_aware(last_run_at) <= maybe_make_aware(current):
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

    def reserve(self, entry: Any) -> Any:
        """Advance ``entry`` (see `LeaderMixin.reserve`) and keep the advanced entry in the
        schedule, as Celery's own scheduler does."""
        new_entry = super().reserve(entry)
        # django-celery-beat leaves the entry it advanced in its schedule and rebuilds the heap
        # from there after a change it saw mid-pass: that stale copy would make the tick due again.
        current = self._schedule.get(new_entry.name)
        if current is not None and current.model is new_entry.model:
            self._schedule[new_entry.name] = new_entry
        return new_entry

    def should_sync(self) -> bool:
        """True while this beat leads: each tick's state is written right away."""
        return self.is_leader

    def sync(self) -> None:
        """As the leader, write the state of each entry advanced since the last write to its row
        (django-celery-beat's ``sync``, with its handling of database errors). An entry stays
        among those to write until its row is written: beat's SIGTERM handler writes them again
        (`close`) wherever it interrupts the main thread, this write included."""
        if not self.is_leader:
            return
        try:
            close_old_connections()
            for name in list(self._dirty):
                try:
                    self._schedule[name].save()
                except (KeyError, TypeError, ObjectDoesNotExist):
                    continue  # tried again at the next write, as django-celery-beat does
                self._dirty.discard(name)
        except DatabaseError as error:
            logger.exception("beat leader: database error while writing the schedule: %r", error)
        except InterfaceError:
            logger.warning("beat leader: database interface error while writing the schedule")

    def close(self) -> None:
        """Write the state of the ticks sent while still leading, then release the lease."""
        self.sync()
        super().close()
