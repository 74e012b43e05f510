"""The beat leader's lease (`LeaderMixin`) and its schedule records (`celery_redlock.beat` offers
the schedulers built on them). The beat holding the lease (the *leader*) sends the due tasks; the
others (*followers*) wait for it to free up.

Before sending a tick the leader records the entry's new ``last_run_at`` and run count on a
majority of lock nodes, written only where the lease key still holds its token. A new leader reads
those records from a majority and continues every entry from there: no tick is sent by two
leaders, and schedules keep their phase across a hand-over. The records live in one key beside the
lease (`celery_redlock.lock.keyspace.schedule_key`), without expiry.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery.beat import PersistentScheduler, Scheduler

from ..errors import QuorumUnavailable, RedlockError
from ..lock import keyspace
from ..lock.outcomes import Lock
from ..lock.owner import Owner
from ..lock.redlock import check_ttl, from_settings, run_script
from ..lock.replies import judge_text, judge_zero_or_one
from ..lock.scripts import READ_BEAT_ENTRIES, RECORD_BEAT_ENTRIES
from ..settings import RedlockSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EntryRecord:
    """What a leader recorded about one schedule entry before sending its tick."""

    last_run_at: datetime
    total_run_count: int
    term: int
    fencing_token: int
    sequence: int

    @property
    def version(self) -> tuple[int, int, int]:
        """The record's place in the order of writes (larger is newer): the leadership term
        (each new leader takes one above every term it read), the lease's fencing token, then
        the order of writes within the term."""
        return (self.term, self.fencing_token, self.sequence)

    def to_text(self) -> str:
        return json.dumps(
            {
                "last_run_at": self.last_run_at.isoformat(),
                "total_run_count": self.total_run_count,
                "term": self.term,
                "fence": self.fencing_token,
                "sequence": self.sequence,
            },
            separators=(",", ":"),
        )

    @classmethod
    def parse(cls, text: object) -> EntryRecord | None:
        """The record stored as ``text``, or None when it is not one."""
        if not isinstance(text, str):
            return None
        try:
            fields = json.loads(text)
            numbers = [
                int(fields[name]) for name in ("total_run_count", "term", "fence", "sequence")
            ]
            return cls(datetime.fromisoformat(fields["last_run_at"]), *numbers)
        except (ValueError, TypeError, KeyError):
            return None


def newest_records(stored_copies: Iterable[object]) -> dict[str, EntryRecord]:
    """Per entry name, the newest record among the copies read from the nodes (stored JSON, as
    bytes or text; empty when a node has none); what cannot be read is skipped."""
    newest: dict[str, EntryRecord] = {}
    for copy in stored_copies:
        try:
            records = json.loads(copy) if isinstance(copy, (str, bytes)) else None
        except ValueError:
            continue
        if not isinstance(records, dict):
            continue
        for name, record_text in records.items():
            record = EntryRecord.parse(record_text)
            if record is not None and (name not in newest or record.version > newest[name].version):
                newest[name] = record
    return newest


class LeaderMixin(Scheduler):  # type: ignore[misc]
    """Makes a beat scheduler send ticks only while it holds the beat leader lease.

    Put it first among the bases of any `celery.beat.Scheduler` subclass
    (``class LeaderCustomScheduler(LeaderMixin, CustomScheduler)``).

    Promises: at most one beat of those sharing the lease name sends at any time (as far as
    Redlock's timing assumptions hold); each tick is sent by one beat only, and a new leader
    continues every entry from the last tick any leader recorded; a leader that dies is replaced
    about one lease ttl after its last extension, one that shuts down at once; a leader whose
    lease a majority of lock nodes cannot confirm stops sending.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        app = kwargs["app"] if "app" in kwargs else args[0]
        settings = RedlockSettings.from_conf(app.conf)
        redlock = from_settings(settings)
        check_ttl(redlock, settings.beat_lease_ttl, name="redlock_beat_lease_ttl")
        self.lease_ttl = settings.beat_lease_ttl
        self.lease_name = settings.beat_lease_name
        self.lease_key = redlock.key_for(self.lease_name)
        self.schedule_records_key = keyspace.schedule_key(self.lease_key)
        self.safety_margin = self.lease_ttl / 3  # the lease validity a leader needs left to send
        self.lease_redlock_settings = settings
        self._leader_redlock = redlock
        self._leader_lease: Lock | None = None
        self._leader_extend_at = 0.0
        self._leader_term = 0
        self._leader_sequence = 0
        self._leader_cleared: str | None = None  # the entry recorded and not yet published
        self._leader_recorded: dict[str, EntryRecord] = {}  # this term's last record of each
        self._leader_standing_by = False
        self._leader_unavailable = False
        super().__init__(*args, **kwargs)

    @property
    def is_leader(self) -> bool:
        """True while this beat holds the lease (it may send ticks)."""
        return self._leader_lease is not None

    @property
    def follower_wait(self) -> float:
        """The longest one `tick` of a follower waits for the lease to free up."""
        return float(min(self.lease_ttl / 3, self.max_interval))

    def adopt_entry_state(self, entry: Any, last_run_at: datetime, total_run_count: int) -> None:
        """Continue ``entry`` from the last tick a leader recorded for it (sets its
        ``last_run_at`` and ``total_run_count``); override it where entries keep them elsewhere
        too, as `LeaderDatabaseScheduler` does."""
        entry.last_run_at = last_run_at
        entry.total_run_count = total_run_count

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One pass of beat: keep or seek the lease, and send due tasks only as the leader.
        Returns the seconds to sleep: for the leader never past its lease's next extension."""
        if self._leader_lease is not None and time.monotonic() >= self._leader_extend_at:
            self._extend_lease(self._leader_lease)
        if self._leader_lease is None:
            pause = self._seek_lease()
            if self._leader_lease is None:
                return pause
        delay = float(super().tick(*args, **kwargs))
        return max(0.0, min(delay, self._leader_extend_at - time.monotonic()))

    def reserve(self, entry: Any) -> Any:
        """Advance ``entry`` and, as the leader, record the advance on the lock nodes; unless a
        majority stored it under this beat's lease, leadership is given up and nothing sent."""
        new_entry = super().reserve(entry)
        lease = self._lease_with_margin("before")
        if lease is not None and not self._write_records(lease, [new_entry]):
            self._lose(f"a majority of lock nodes did not record the tick of {new_entry.name!r}")
            lease = None
        self._leader_cleared = new_entry.name if lease is not None else None
        return new_entry

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Send ``entry``'s tick if it was recorded under a lease that is still valid."""
        if not self._may_send(entry):
            logger.info(
                "beat leader: not sending due task %s (%s): this beat does not hold the lease",
                entry.name,
                entry.task,
            )
            return
        super().apply_entry(entry, producer=producer)

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        """Publish ``entry``'s task only if it was recorded under a lease that is still valid."""
        if advance:
            entry = self.reserve(entry)
        if not self._may_send(entry):
            return None
        self._leader_cleared = None
        return super().apply_async(entry, producer=producer, advance=False, **kwargs)

    def close(self) -> None:
        """Release the lease (a follower takes over at once), then close the scheduler."""
        lease = self._leader_lease
        self._leader_lease = None
        self._leader_cleared = None
        try:
            if lease is not None:
                # close() runs in beat's SIGTERM handler, possibly in the middle of a round on
                # this scheduler's own connections: release over connections of its own.
                redlock = from_settings(self.lease_redlock_settings)
                try:
                    released = redlock.release(lease)
                finally:
                    redlock.close()
                self._log(logging.INFO, "released", "" if released else " (it had already expired)")
                self._leader_redlock.close()
        finally:
            super().close()

    @property
    def info(self) -> str:
        nodes = len(self.lease_redlock_settings.urls)
        return (
            f"{super().info}\n    . leader lease -> {self.lease_key} "
            f"(ttl {self.lease_ttl:g}s, {nodes} lock nodes)"
        )

    def _seek_lease(self) -> float:
        """Wait up to `follower_wait` for the lease and take office; the pause till next pass."""
        try:
            lease = self._leader_redlock.acquire(
                self.lease_name,
                self.lease_ttl,
                blocking=True,
                timeout=self.follower_wait,
                owner=Owner.here(task=None, task_id=None, role="beat leader").to_text(),
            )
        except QuorumUnavailable as error:
            if not self._leader_unavailable:
                detail = ": %s; no beat sends until a majority of lock nodes answers"
                self._log(logging.WARNING, "cannot seek", detail, error)
                self._leader_unavailable = True
            return self.follower_wait
        self._leader_unavailable = False
        if lease is None:
            if not self._leader_standing_by:
                self._log(logging.INFO, "standing by for", "; another beat holds it")
                self._leader_standing_by = True
            return 0.0
        return 0.0 if self._take_office(lease) else self.follower_wait

    def _take_office(self, lease: Lock) -> bool:
        """Continue the schedule from the records, then record it under this lease."""
        redlock = self._leader_redlock
        read = run_script(redlock, READ_BEAT_ENTRIES, (self.schedule_records_key,), (), judge_text)
        if read.successes < redlock.quorum:
            self._give_up(lease, "the schedule records could not be read from a majority")
            return False
        records = newest_records(reply for reply in read.replies if isinstance(reply, bytes))
        self._leader_term = max((record.term for record in records.values()), default=0) + 1
        self._leader_sequence = 0
        self._leader_recorded = {}
        # Read once: a database-backed scheduler queries its database on every access.
        schedule = self.schedule
        continued = [(entry, records[name]) for name, entry in schedule.items() if name in records]
        for entry, record in continued:
            self.adopt_entry_state(entry, record.last_run_at, record.total_run_count)
        self._leader_lease = lease  # a shutdown during the write releases it
        if not self._write_records(lease, list(schedule.values())):
            self._leader_lease = None
            self._give_up(lease, "the schedule records could not be written to a majority")
            return False
        self._leader_extend_at = time.monotonic() + lease.remaining() / 3
        self._leader_standing_by = False
        self.populate_heap()
        self._log(
            logging.INFO,
            "acquired",
            " (ttl %gs, term %d); %d of %d entries continue from the last recorded tick",
            self.lease_ttl,
            self._leader_term,
            len(continued),
            len(schedule),
        )
        return True

    def _extend_lease(self, lease: Lock) -> None:
        try:
            extended = self._leader_redlock.extend(lease, self.lease_ttl)
        except RedlockError as error:
            self._lose("extension failed: " + str(error))
            return
        if not extended:
            self._lose("a majority of lock nodes did not confirm the extension in time")
            return
        self._leader_extend_at = time.monotonic() + lease.remaining() / 3

    def _write_records(self, lease: Lock, entries: Iterable[Any]) -> bool:
        arguments: list[str | int] = [lease.value]
        written: dict[str, EntryRecord] = {}
        for entry in entries:
            last_run_at = getattr(entry, "last_run_at", None)
            if not isinstance(last_run_at, datetime):
                continue
            self._leader_sequence += 1
            record = EntryRecord(
                last_run_at,
                int(getattr(entry, "total_run_count", 0) or 0),
                self._leader_term,
                lease.fencing_token,
                self._leader_sequence,
            )
            arguments += [entry.name, record.to_text()]
            written[entry.name] = record
        result = run_script(
            self._leader_redlock,
            RECORD_BEAT_ENTRIES,
            (lease.key, self.schedule_records_key),
            arguments,
            judge_zero_or_one,
        )
        if result.successes < self._leader_redlock.quorum:
            return False
        self._leader_recorded.update(written)
        return True

    def _may_send(self, entry: Any) -> bool:
        return self._leader_cleared == entry.name and self._lease_with_margin("when") is not None

    def _lease_with_margin(self, when: str) -> Lock | None:
        """The lease, unless it has `safety_margin` of validity left or less: then it is lost."""
        lease = self._leader_lease
        if lease is not None and lease.remaining() <= self.safety_margin:
            self._lose(f"only {lease.remaining():.3f}s of validity left {when} sending")
            return None
        return lease

    def _lose(self, reason: str) -> None:
        lease = self._leader_lease
        self._leader_lease = None
        self._leader_cleared = None
        self._log(logging.WARNING, "lost", ": %s; no longer sending", reason)
        if lease is not None:
            # Where the lease is still ours, freeing it lets any beat (this one too) take over
            # without waiting for it to expire.
            self._leader_redlock.release(lease)

    def _give_up(self, lease: Lock, reason: str) -> None:
        self._log(logging.WARNING, "not taking office with", ": %s", reason)
        self._leader_redlock.release(lease)

    def _log(self, level: int, event: str, detail: str = "", *args: object) -> None:
        where = "beat leader: " + event + " lease %r on %s pid %d" + detail
        logger.log(level, where, self.lease_name, socket.gethostname(), os.getpid(), *args)


class LeaderScheduler(LeaderMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default scheduler (a shelve file per beat) sending only while it leads:
    ``celery beat -S celery_redlock.beat:LeaderScheduler``."""
