"""The beat leader's lease (`LeaderMixin`) and its schedule records; `celery_redlock.beat` is the
public module that offers the schedulers built on them.

One ``celery beat`` leader among several: a Redlock lease decides which beat sends the ticks.

Run as many ``celery beat`` processes as availability asks for, each with the scheduler
``celery_redlock.beat:LeaderScheduler`` (or `LeaderMixin` in front of any other scheduler class).
The beat holding the lease (the *leader*) sends the due tasks; the others (*followers*) send
nothing and wait for the lease to free up. The leader extends the lease while it lives, releases
it when it shuts down, and stops sending as soon as an extension is not confirmed by a majority of
the lock nodes.

Every beat keeps its own schedule state, so a new leader must learn what the old one sent. Before
the leader sends a tick it records the entry's new ``last_run_at`` and run count on the lock nodes,
in a write that lands only where the lease key still holds its own token and that must reach a
majority; only then does it publish. A new leader reads those records from a majority before
sending anything and continues every entry from there: a tick is never sent by two leaders, and
interval schedules keep their phase across a hand-over (crontab schedules too). The records live in
one string key beside the lease (`celery_redlock.lock.keyspace.schedule_key`), without expiry.

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

SCHEDULE_SUFFIX = keyspace.SCHEDULE_SUFFIX  # kept for callers of 0.2


@dataclass(frozen=True)
class EntryRecord:
    """What a leader recorded about one schedule entry before sending its tick.

    ``version`` orders records: the leadership term first (each new leader takes one above every
    term it read), then the lease's fencing token, then the order of writes within the term.
    """

    last_run_at: datetime
    total_run_count: int
    term: int
    fencing_token: int
    sequence: int

    @property
    def version(self) -> tuple[int, int, int]:
        """The record's place in the order of writes (larger is newer)."""
        return (self.term, self.fencing_token, self.sequence)

    def to_text(self) -> str:
        """The record as stored on the lock nodes (compact JSON)."""
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
            return cls(
                last_run_at=datetime.fromisoformat(fields["last_run_at"]),
                total_run_count=int(fields["total_run_count"]),
                term=int(fields["term"]),
                fencing_token=int(fields["fence"]),
                sequence=int(fields["sequence"]),
            )
        except (ValueError, TypeError, KeyError):
            return None


def newest_records(stored_copies: Iterable[object]) -> dict[str, EntryRecord]:
    """Per entry name, the newest record among the copies read from the nodes.

    Each copy is the stored JSON object (bytes or text; empty when a node has none); copies or
    records that cannot be read are skipped.
    """
    newest: dict[str, EntryRecord] = {}
    for copy in stored_copies:
        text = copy.decode() if isinstance(copy, bytes) else copy
        if not isinstance(text, str) or not text:
            continue
        try:
            records = json.loads(text)
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

    Put it first among the bases of any `celery.beat.Scheduler` subclass::

        class LeaderCustomScheduler(LeaderMixin, CustomScheduler): ...

    (`LeaderScheduler` and django-celery-beat's `LeaderDatabaseScheduler` are made so.)

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
        self.lease_redlock_settings = settings
        self._leader_redlock = redlock
        self._leader_lease: Lock | None = None
        self._leader_extend_at = 0.0
        self._leader_term = 0
        self._leader_sequence = 0
        self._leader_cleared: str | None = None  # the entry recorded and not yet published
        self._leader_standing_by = False
        self._leader_unavailable = False
        super().__init__(*args, **kwargs)

    # -- what a scheduler subclass may use or override -------------------------------------

    @property
    def is_leader(self) -> bool:
        """True while this beat holds the lease (it may send ticks)."""
        return self._leader_lease is not None

    @property
    def lease_key(self) -> str:
        """The Redis key of the lease on the lock nodes."""
        return str(self._leader_redlock.key_for(self.lease_name))

    @property
    def schedule_records_key(self) -> str:
        """The Redis key holding the leaders' records of the entries they sent."""
        return keyspace.schedule_key(self.lease_key)

    @property
    def safety_margin(self) -> float:
        """Seconds of lease validity a leader must have left to send a tick."""
        return self.lease_ttl / 3

    @property
    def follower_wait(self) -> float:
        """The longest one `tick` of a follower waits for the lease to free up."""
        return float(min(self.lease_ttl / 3, self.max_interval))

    def adopt_entry_state(self, entry: Any, last_run_at: datetime, total_run_count: int) -> None:
        """Continue ``entry`` from the last tick a leader recorded for it.

        Sets ``last_run_at`` and ``total_run_count`` on the entry in place. Override it for a
        scheduler whose entries keep them elsewhere too, as `LeaderDatabaseScheduler` does for
        django-celery-beat's rows (``entry.model``).
        """
        entry.last_run_at = last_run_at
        entry.total_run_count = total_run_count

    # -- celery.beat.Scheduler hooks --------------------------------------------------------

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One pass of beat: keep or seek the lease, and send due tasks only as the leader.

        Returns the seconds beat may sleep before the next pass: for the leader never past the
        moment its lease must be extended; for a follower 0 after it waited for the lease.
        """
        if self._leader_lease is not None and time.monotonic() >= self._leader_extend_at:
            self._extend_lease()
        if self._leader_lease is None:
            pause = self._seek_lease()
            if self._leader_lease is None:
                return pause
        delay = float(super().tick(*args, **kwargs))
        return max(0.0, min(delay, self._leader_extend_at - time.monotonic()))

    def reserve(self, entry: Any) -> Any:
        """Advance ``entry`` and, as the leader, record the advance on the lock nodes.

        The tick is cleared for sending only when a majority stored the record under this
        beat's lease; otherwise leadership is given up and the tick is not sent.
        """
        new_entry = super().reserve(entry)
        self._leader_cleared = new_entry.name if self._record_sent(new_entry) else None
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
        try:
            self._release_at_shutdown()
        finally:
            super().close()

    @property
    def info(self) -> str:
        """The scheduler's start-up description, with the lease."""
        nodes = len(self.lease_redlock_settings.urls)
        return (
            f"{super().info}\n    . leader lease -> {self.lease_key} "
            f"(ttl {self.lease_ttl:g}s, {nodes} lock nodes)"
        )

    # -- the lease --------------------------------------------------------------------------

    def _seek_lease(self) -> float:
        """Wait up to `follower_wait` for the lease; take office if it comes. Returns the pause
        before the next pass."""
        try:
            lease = self._leader_redlock.acquire(
                self.lease_name,
                self.lease_ttl,
                blocking=True,
                timeout=self.follower_wait,
                owner=_owner_text(),
            )
        except QuorumUnavailable as error:
            if not self._leader_unavailable:
                logger.warning(
                    "beat leader: cannot seek lease %r on %s pid %d: %s; no beat sends until a "
                    "majority of lock nodes answers",
                    self.lease_name,
                    socket.gethostname(),
                    os.getpid(),
                    error,
                )
                self._leader_unavailable = True
            return self.follower_wait
        self._leader_unavailable = False
        if lease is None:
            if not self._leader_standing_by:
                logger.info(
                    "beat leader: standing by on %s pid %d; another beat holds lease %r",
                    socket.gethostname(),
                    os.getpid(),
                    self.lease_name,
                )
                self._leader_standing_by = True
            return 0.0
        if not self._take_office(lease):
            return self.follower_wait
        return 0.0

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
        # Read once: a database-backed scheduler queries its database on every access.
        schedule = self.schedule
        continued = 0
        for name, entry in list(schedule.items()):
            record = records.get(name)
            if record is not None:
                self.adopt_entry_state(entry, record.last_run_at, record.total_run_count)
                continued += 1
        self._leader_lease = lease
        if not self._write_records(list(schedule.values())):
            self._leader_lease = None
            self._give_up(lease, "the schedule records could not be written to a majority")
            return False
        self._leader_extend_at = time.monotonic() + lease.remaining() / 3
        self._leader_standing_by = False
        self.populate_heap()
        logger.info(
            "beat leader: acquired lease %r on %s pid %d (ttl %gs, term %d); %d of %d entries "
            "continue from the last recorded tick",
            self.lease_name,
            socket.gethostname(),
            os.getpid(),
            self.lease_ttl,
            self._leader_term,
            continued,
            len(schedule),
        )
        return True

    def _extend_lease(self) -> None:
        lease = self._leader_lease
        assert lease is not None
        try:
            extended = self._leader_redlock.extend(lease, self.lease_ttl)
        except RedlockError as error:
            self._lose("extension failed: " + str(error))
            return
        if not extended:
            self._lose("a majority of lock nodes did not confirm the extension in time")
            return
        self._leader_extend_at = time.monotonic() + lease.remaining() / 3

    def _record_sent(self, entry: Any) -> bool:
        """Record ``entry`` (just advanced) as sent; False if this beat may not send it."""
        lease = self._leader_lease
        if lease is None:
            return False
        if lease.remaining() <= self.safety_margin:
            self._lose(f"only {lease.remaining():.3f}s of validity left before sending")
            return False
        if not self._write_records([entry]):
            self._lose(f"a majority of lock nodes did not record the tick of {entry.name!r}")
            return False
        return True

    def _write_records(self, entries: Iterable[Any]) -> bool:
        """Store records of ``entries`` under the lease; True if a majority stored them."""
        lease = self._leader_lease
        assert lease is not None
        arguments: list[str | int] = [lease.value]
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
        result = run_script(
            self._leader_redlock,
            RECORD_BEAT_ENTRIES,
            (lease.key, self.schedule_records_key),
            arguments,
            judge_zero_or_one,
        )
        return result.successes >= self._leader_redlock.quorum

    def _may_send(self, entry: Any) -> bool:
        lease = self._leader_lease
        if lease is None or self._leader_cleared != entry.name:
            return False
        if lease.remaining() <= self.safety_margin:
            self._lose(f"only {lease.remaining():.3f}s of validity left when sending")
            return False
        return True

    def _lose(self, reason: str) -> None:
        """Stop being the leader (the lease cannot be relied on any more)."""
        lease = self._leader_lease
        self._leader_lease = None
        self._leader_cleared = None
        logger.warning(
            "beat leader: lost lease %r on %s pid %d: %s; no longer sending",
            self.lease_name,
            socket.gethostname(),
            os.getpid(),
            reason,
        )
        if lease is not None:
            # Where the lease is still ours, freeing it lets any beat (this one too) take over
            # without waiting for it to expire.
            self._leader_redlock.release(lease)

    def _give_up(self, lease: Lock, reason: str) -> None:
        logger.warning(
            "beat leader: not taking office with lease %r on %s pid %d: %s",
            self.lease_name,
            socket.gethostname(),
            os.getpid(),
            reason,
        )
        self._leader_redlock.release(lease)

    def _release_at_shutdown(self) -> None:
        lease = self._leader_lease
        self._leader_lease = None
        self._leader_cleared = None
        if lease is None:
            return
        # close() runs in beat's SIGTERM handler, possibly in the middle of a round on this
        # scheduler's own connections: release over connections of its own.
        redlock = from_settings(self.lease_redlock_settings)
        try:
            released = redlock.release(lease)
        finally:
            redlock.close()
        logger.info(
            "beat leader: released lease %r on %s pid %d%s",
            self.lease_name,
            socket.gethostname(),
            os.getpid(),
            "" if released else " (it had already expired)",
        )
        self._leader_redlock.close()


class LeaderScheduler(LeaderMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default scheduler (a shelve file per beat) sending only while it leads.

    Use it with ``celery beat -S celery_redlock.beat:LeaderScheduler`` or
    ``app.conf.beat_scheduler = "celery_redlock.beat:LeaderScheduler"``.
    """


def _owner_text() -> str:
    """Who holds the lease, stored beside its token: role, host and process."""
    return Owner.here(task=None, task_id=None, role="beat leader").to_text()
