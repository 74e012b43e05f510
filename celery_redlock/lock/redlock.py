"""The Redlock algorithm over N independent Redis masters.

An *attempt* sets one key with one random token on every node at once (``SET NX PX`` inside a
script) and succeeds only when a majority agreed before the ttl ran out; the lock is then valid
for ``ttl - elapsed - drift``. A failed round is released on every node, because a SET may have
landed where the reply was lost, and is retried after a jittered delay. Extension and release
compare the token inside Lua, so only the holder can extend or release.

Every attempt ends in one typed outcome (`outcomes`). Every reply is checked
against what its script can return (`replies`): a node's reply is untrusted
input, and one that is not a possible answer counts as no answer at all.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypedDict

from ..errors import ConfigurationError, LockNotAcquired, QuorumUnavailable
from ..settings import RedlockSettings, check_seconds, even_node_warning, split_urls
from . import keyspace, scripts
from .nodes import Judge, LockNode, NodeGroup, RoundResult, members_from_urls
from .nodes.cluster import ClusterNode
from .outcomes import (
    Acquired,
    Acquisition,
    Contended,
    Covered,
    Held,
    Lock,
    Outcome,
    Record,
    Tokens,
    Unavailable,
    copies_agree,
    majority_holder,
)
from .owner import lock_value
from .replies import acquire_judge, copies_in, is_integer, judge_copy, judge_one, judge_zero_or_one

if TYPE_CHECKING:
    from typing import Unpack

logger = logging.getLogger(__name__)

FENCE_SUFFIX = keyspace.FENCE_SUFFIX  # kept for callers of 0.2
DRIFT_CONSTANT_SECONDS = 0.002

SPLIT_LONGEST_PAUSE = 1.0
"""The longest random pause of a waiting caller after a split vote (the longest pause starts at
``retry_delay`` and doubles after each split in a row)."""


class AcquireOptions(TypedDict, total=False):
    """The keyword options of `Redlock.acquire` that `Redlock.lock` passes on."""

    blocking: bool
    timeout: float | None
    owner: str


def jittered(seconds: float) -> float:
    """``seconds`` times a random factor from 0.5 to 1.5, so that racing callers drift apart."""
    return random.uniform(0.5, 1.5) * seconds


class Redlock:
    """A distributed lock manager over independent Redis masters (the Redlock algorithm).

    One instance per process is meant to be shared by all its threads; connections open lazily
    and are reopened after a fork. ``urls`` (a list, or one comma-separated string) accepts
    ``redis://``, ``rediss://`` (TLS) and ``unix://`` URLs with optional ``user:password@`` and
    database number, and ``redis+cluster://`` and ``redis+sentinel://`` members
    (`nodes.urls`); ``username`` and ``password`` apply to every URL that names no
    credentials of its own. ``legacy_layout=False`` stops holding locks at their 0.2-layout
    keys too (README: Upgrading from 0.2). Invalid arguments raise `ConfigurationError` saying
    how to fix them.
    """

    def __init__(
        self,
        urls: Sequence[str] | str,
        retry_count: int = RedlockSettings.retry_count,
        retry_delay: float = RedlockSettings.retry_delay,
        clock_drift_factor: float = RedlockSettings.clock_drift_factor,
        node_timeout: float = RedlockSettings.node_timeout,
        key_prefix: str = RedlockSettings.key_prefix,
        username: str | None = None,
        password: str | None = None,
        legacy_layout: bool = RedlockSettings.legacy_layout,
    ) -> None:
        settings = RedlockSettings(
            urls=split_urls(urls),  # type: ignore[arg-type]  # checked by RedlockSettings
            retry_count=retry_count,
            retry_delay=retry_delay,
            clock_drift_factor=clock_drift_factor,
            node_timeout=node_timeout,
            key_prefix=key_prefix,
            username=username,
            password=password,
            legacy_layout=legacy_layout,
        )
        self._configure(settings)
        warning = even_node_warning(len(self._group.nodes))
        if warning:
            logger.warning(warning)

    def _configure(self, settings: RedlockSettings) -> None:
        self._settings = settings
        members = members_from_urls(
            settings.urls,
            settings.node_timeout,
            settings.username,
            settings.password,
            settings.wait_replicas,
        )
        self._group = NodeGroup(members, settings.node_timeout)
        self.quorum = self._group.quorum
        # 0.2 had no cluster nodes, and a script's keys must share a cluster node's hash slot.
        self._legacy_layout = not any(isinstance(node, ClusterNode) for node in members)
        self._holds_legacy = self._legacy_layout and settings.legacy_layout
        self._checked_ttl: float | None = None
        self._tokens = Tokens()

    @property
    def nodes(self) -> list[LockNode]:
        """The configured lock nodes (``.name`` is the URL with its password redacted)."""
        return list(self._group.nodes)

    def key_for(self, resource: str) -> str:
        """The Redis key that locks ``resource`` (see `keyspace`)."""
        return keyspace.lock_key(self._settings.key_prefix, resource)

    def _with_legacy(self, key: str) -> str:
        if not self._holds_legacy:
            return key  # the scripts read the key itself as "none"
        return legacy_key_of(self, key) or key

    def _drift(self, ttl: float) -> float:
        return ttl * self._settings.clock_drift_factor + DRIFT_CONSTANT_SECONDS

    # -- acquiring ---------------------------------------------------------------------------

    def attempt(
        self,
        resource: str,
        ttl: float,
        owner: str = "",
        *,
        wait: float | None = 0.0,
        token: str | None = None,
        replaces: str = "",
        record: Record | None = None,
        rounds: int | None = None,
    ) -> Outcome:
        """Acquire without raising: one typed outcome.

        With ``wait=0`` (the default) one non-blocking acquisition, retried (up to ``rounds``
        rounds, by default ``retry_count``, jittered) only while the outcome is `Contended` or
        `Unavailable`. With ``wait`` seconds (None: no limit), attempts until the lock is taken
        or that time has passed, sleeping until the holder releases (a notification from the
        nodes) or its lock expires, never polling; returns the first outcome that is neither
        `Held` nor `Contended`, or the last one at the end.

        ``token`` (default: a new one) lets a caller know the token before any SET is sent;
        ``replaces`` is an owner-text prefix whose holder the caller replaces (its lock counts as
        free); with ``record``, the attempt ends `Covered` when the record covers its rank. A lock
        reserved for someone else (`reserve`) is not taken while it is reserved.
        """
        key = self._checked_key(resource, ttl)
        acquisition = Acquisition(
            resource, key, ttl, owner, token or self._tokens.new(), replaces, record, rounds
        )
        if wait == 0:
            return self._attempt_at(acquisition)
        return self._wait_at(acquisition, None if wait == float("inf") else wait)

    def _checked_key(self, resource: str, ttl: float) -> str:
        # A task's runs share one (float) ttl: it is checked once, not on every run.
        if not (ttl.__class__ is float and ttl == self._checked_ttl):
            check_ttl(self, ttl)
            self._checked_ttl = ttl if ttl.__class__ is float else None
        if not isinstance(resource, str) or not resource:
            raise ConfigurationError(f"resource must be a non-empty string, got {resource!r}")
        return self.key_for(resource)

    def _attempt_at(self, acquisition: Acquisition) -> Outcome:
        key, ttl, record = acquisition.key, acquisition.ttl, acquisition.record
        # One token for every round: a SET of an earlier round that lands late on a slow node is
        # then this acquisition's own, not a stranger blocking it for a whole ttl.
        value = lock_value(acquisition.token, acquisition.owner)
        keys = [key, keyspace.fence_key(key), keyspace.reservation_key(key), self._with_legacy(key)]
        extra: list[str] = []
        if record is not None:
            keys.append(record.key)
            extra += [record.field, record.rank_text]
        ttl_ms = max(1, int(ttl * 1000))
        rounds = self._settings.retry_count if acquisition.rounds is None else acquisition.rounds
        outcome: Outcome | None = None
        for round_number in range(rounds):
            if round_number:
                time.sleep(jittered(self._settings.retry_delay))
            started = time.monotonic()
            clock = time.time_ns() // 1000
            arguments: list[str | int] = [value, ttl_ms, clock, acquisition.replaces, *extra]
            judge = acquire_judge(clock, record is not None)
            # An earlier round of this acquisition (or an earlier attempt of the same run), with
            # the same token, may have left a clean-up owed to a node that was silent: sent after
            # this round, it would remove the lock this round takes.
            self._group.forgive(key, value)
            try:
                result = self._group.run(scripts.ACQUIRE, keys, arguments, judge, grants=True)
                outcome = self._outcome(acquisition, started, result)
            except BaseException:
                self._release_value(key, value, ttl)  # an interrupted round may have set keys
                raise
            if isinstance(outcome, Acquired):
                return outcome
            # Release everywhere, including nodes that seemed to fail: a SET may have landed.
            self._release_value(key, value, ttl)
            if not isinstance(outcome, (Contended, Unavailable)):
                return outcome
        return outcome or Unavailable(QuorumUnavailable(key, 0, self.quorum))

    def _wait_at(self, acquisition: Acquisition, timeout: float | None) -> Outcome:
        deadline = None if timeout is None else time.monotonic() + timeout
        outcome = self._attempt_at(acquisition)
        if not isinstance(outcome, (Held, Contended)):
            return outcome
        splits = 0
        with self._group.listen_for_releases(acquisition.key) as listener:
            while True:
                # Listening before each attempt: a release between attempt and wait wakes us.
                outcome = self._attempt_at(acquisition)
                now = time.monotonic()
                if not isinstance(outcome, (Held, Contended)) or (
                    deadline is not None and now >= deadline
                ):
                    return outcome
                left = math.inf if deadline is None else deadline - now
                if isinstance(outcome, Contended):
                    # Callers woken by one release split the vote again if they all try again
                    # at once, and every failed attempt's release wakes them together: so after
                    # a split each sleeps a random while instead, longer after each split.
                    splits += 1
                    longest = min(
                        max(self._settings.retry_delay, 0.01) * 2 ** (splits - 1),
                        SPLIT_LONGEST_PAUSE,
                    )
                    pause = random.uniform(0, min(longest, max(outcome.retry_in, 0.001)))
                    time.sleep(min(pause, left))
                    continue
                splits = 0
                pause = max(outcome.expires_in, 0.001) + random.uniform(
                    0, self._settings.retry_delay / 4
                )
                listener.wait(min(pause, left))

    def _outcome(self, acquisition: Acquisition, started: float, result: RoundResult) -> Outcome:
        key, ttl = acquisition.key, acquisition.ttl
        if any(reply == scripts.COVERED_REPLY for reply in result.replies):
            # Records are written by every node a release reaches: one copy is proof enough.
            return Covered()
        fencing_token = self._agree_on_fencing_token(key, result, int(ttl * 1000))
        finished = time.monotonic()
        validity = ttl - (finished - started) - self._drift(ttl)
        if fencing_token is not None and validity > 0:
            lock = Lock(
                resource=acquisition.resource,
                key=key,
                token=acquisition.token,
                validity=validity,
                ttl=ttl,
                owner=acquisition.owner,
                valid_until=finished + validity,
                fencing_token=fencing_token,
            )
            return Acquired(lock)
        if result.answered < self.quorum:
            return Unavailable(self._unavailable(key, result))
        refusals = copies_in(result)
        held = majority_holder(refusals, self.quorum)
        if held is not None:
            return held
        # A split vote: the next change comes with a release or with the soonest expiry.
        soonest = min((max(left, 0) / 1000 for _, left in refusals), default=0.0)
        return Contended(min(soonest, ttl))

    def _unavailable(self, key: str, result: RoundResult) -> QuorumUnavailable:
        reasons = result.unavailable_reasons([node.name for node in self._group.nodes])
        return QuorumUnavailable(key, result.answered, self.quorum, reasons)

    def _agree_on_fencing_token(self, key: str, result: RoundResult, ttl_ms: int) -> int | None:
        """The fencing token of a round that reached a quorum, or None if it did not.

        The token is the largest a node returned; nodes that returned less (a node that missed
        acquisitions while down, or restarted empty) are raised to it first, so that any later
        majority includes a node that will hand out a larger one.
        """
        if result.successes < self.quorum:
            return None
        tokens: list[int] = [reply for reply in result.replies if is_integer(reply)]
        fencing_token = max(tokens)
        if tokens.count(fencing_token) >= self.quorum:
            return fencing_token
        raised = self._group.run(
            scripts.RAISE_FENCE, (keyspace.fence_key(key),), (fencing_token, ttl_ms), judge_one
        )
        return fencing_token if raised.successes >= self.quorum else None

    def holder_of(self, resource: str) -> Held | None:
        """Who holds the lock on ``resource`` now, when a majority of nodes agrees on one, without
        taking it; None when nobody does. Raises `QuorumUnavailable` without a quorum."""
        return self._holder_at(self.key_for(resource))

    def _holder_at(self, key: str) -> Held | None:
        result = self._group.run(scripts.READ, (key,), (), judge_copy)
        if result.answered < self.quorum:
            raise self._unavailable(key, result)
        copies = copies_in(result)
        if not copies_agree(copies, self.quorum):
            # The first copies to arrive disagree (a node that lost the lock, one that kept a
            # leftover): only every node's copy can tell whether a majority agrees.
            everyone = self._group.run(scripts.READ, (key,), (), judge_copy, every=True)
            if everyone.answered >= self.quorum:
                copies = copies_in(everyone)
        return majority_holder(copies, self.quorum)

    def acquire(
        self,
        resource: str,
        ttl: float,
        blocking: bool = False,
        timeout: float | None = None,
        owner: str = "",
    ) -> Lock | None:
        """Take the lock on ``resource`` for ``ttl`` seconds.

        Returns the `Lock`, or None when it is held by someone else (with ``blocking=True``:
        when it stayed held for ``timeout`` seconds; ``timeout=None`` waits for ever). A blocking
        acquire sleeps until the holder releases or its lock expires, instead of polling. Raises
        `QuorumUnavailable` when fewer than a majority of nodes answered.
        """
        outcome = self.attempt(resource, ttl, owner, wait=timeout if blocking else 0.0)
        if isinstance(outcome, Unavailable):
            raise outcome.error
        return outcome.lock if isinstance(outcome, Acquired) else None

    @contextmanager
    def lock(self, resource: str, ttl: float, **options: Unpack[AcquireOptions]) -> Iterator[Lock]:
        """Hold the lock on ``resource`` for the ``with`` block, taken as `acquire` takes it
        (``blocking``, ``timeout`` and ``owner`` by keyword); release it on the way out. Raises
        `LockNotAcquired` when the lock is held by someone else."""
        lock = self.acquire(resource, ttl, **options)
        if lock is None:
            raise LockNotAcquired(self.key_for(resource))
        try:
            yield lock
        finally:
            self.release(lock)

    # -- holding -----------------------------------------------------------------------------

    def extend(self, lock: Lock, ttl: float | None = None) -> bool:
        """Reset the lock's time to live to ``ttl`` seconds (default: its own ttl).

        True only if a majority of nodes extended it while it was still valid; the lock's
        ``validity`` and `remaining` are then updated. A node that lost the key (restarted
        empty) gets it back. False means the lock cannot be relied on; when a majority answered
        that another owner holds the key, `Lock.remaining` drops to zero too.
        """
        ttl = lock.ttl if ttl is None else ttl
        check_ttl(self, ttl)
        started = time.monotonic()
        if lock.valid_until <= started:
            return False
        # Every node's reply is awaited (up to node_timeout): an extension still on its way to
        # a node when the holder releases there could set the key again after the release.
        result = self._group.run(
            scripts.EXTEND,
            (lock.key, keyspace.fence_key(lock.key), self._with_legacy(lock.key)),
            (
                lock.value,
                max(1, int(ttl * 1000)),
                lock.fencing_token,
                int((time.time() + lock.valid_until - started) * 1000),
            ),
            judge_zero_or_one,
            every=True,
            grants=True,
        )
        if result.answered - result.successes >= len(self._group.nodes) - self.quorum + 1:
            lock.valid_until = 0.0  # a majority says another owner holds it: nothing to rely on
            return False
        if result.successes < self.quorum or result.finished_at >= lock.valid_until:
            return False
        lock.validity = ttl - (result.finished_at - started) - self._drift(ttl)
        lock.valid_until = result.finished_at + lock.validity
        lock.ttl = ttl
        return lock.validity > 0

    def release(
        self,
        lock: Lock,
        hold: float = 0.0,
        record: Record | None = None,
        confirm: bool = True,
    ) -> bool:
        """Release the lock on every node, only where it still holds this lock's token.

        With ``hold`` seconds, the lock is kept that much longer instead (and then expires); with
        ``record``, its rank is recorded on every node the release reaches. Returns True if a
        majority confirmed it still held the lock, False if it had already expired or been
        taken over. Never removes somebody else's lock.

        With ``confirm=False`` the release is sent to every node and the call returns at once,
        False: the replies are read by this thread's next round. Each node executes the release
        before anything this thread sends it later.
        """
        keys = [lock.key, keyspace.fence_key(lock.key), self._with_legacy(lock.key)]
        arguments: list[str | int] = [lock.value, max(0, int(hold * 1000))]
        if record is not None:
            keys.append(record.key)
            arguments += [record.field, record.rank_text, max(1, int(record.ttl * 1000))]
        result = self._group.run(
            scripts.RELEASE,
            keys,
            arguments,
            judge_zero_or_one,
            wait=confirm,
            owed_for=max(lock.ttl, hold),
        )
        lock.valid_until = 0.0
        return result.successes >= self.quorum

    def _release_value(self, key: str, value: str, ttl: float = 0.0, wait: bool = False) -> int:
        """Release ``value`` at ``key`` on every node (without waiting for the replies unless
        ``wait``); returns on how many nodes it was released (0 when not waiting). A node that
        cannot be reached gets the release once it answers again, for the ``ttl`` seconds the
        value may live."""
        keys = (key, keyspace.fence_key(key), self._with_legacy(key))
        arguments = (value, 0)
        return self._group.run(
            scripts.RELEASE, keys, arguments, judge_zero_or_one, wait=wait, every=wait, owed_for=ttl
        ).successes

    def close(self) -> None:
        """Close this process's idle connections to the nodes."""
        self._group.close()


# -- helpers of other layers, kept beside the algorithm they use -----------------------------------


def from_settings(settings: RedlockSettings, node_timeout: float | None = None) -> Redlock:
    """The lock manager a Celery app's settings describe (optionally with another per-node
    timeout, as operators' commands use). It does not log the even-node warning: a worker logs
    that once, at start, and ``celery redlock status`` reports it."""
    if node_timeout is not None:
        settings = dataclasses.replace(settings, node_timeout=node_timeout)
    redlock = Redlock.__new__(Redlock)
    redlock._configure(settings)
    return redlock


def settings_of(redlock: Redlock) -> RedlockSettings:
    """The settings ``redlock`` was made with (retry count and delay, drift, node timeout...)."""
    return redlock._settings


def drift(redlock: Redlock, ttl: float) -> float:
    """Seconds subtracted from the validity of a ``ttl``-second lock for clock drift."""
    return redlock._drift(ttl)


def check_ttl(redlock: Redlock, ttl: float, name: str = "ttl") -> None:
    """Raise `ConfigurationError` unless a ``ttl``-second lock can have positive validity."""
    check_seconds(name, ttl)
    node_timeout = redlock._settings.node_timeout
    if ttl - redlock._drift(ttl) - node_timeout <= 0:
        raise ConfigurationError(
            f"{name}={ttl!r}s leaves no validity after the clock drift allowance "
            f"({redlock._drift(ttl):.3f}s) and one node timeout ({node_timeout}s); "
            "use a ttl of at least a few tenths of a second"
        )


def legacy_layout(redlock: Redlock) -> bool:
    """Whether 0.2 workers can share ``redlock``'s nodes (0.2 could not use a cluster node), so
    that locks may live at 0.2 keys (`legacy_key_of`). Its own locks are held there too unless
    ``redlock_legacy_layout`` is off."""
    return redlock._legacy_layout


def legacy_key_of(redlock: Redlock, key: str) -> str | None:
    """Where 0.2 workers lock what ``key`` locks (`keyspace.legacy_key`): locks taken here are
    held there too, and a lock held there is in the way (with ``redlock_legacy_layout`` on, the
    default). None for a group with a cluster node (0.2 could not use one) or a key that is no
    lock key."""
    if not redlock._legacy_layout:
        return None
    return keyspace.legacy_key(redlock._settings.key_prefix, key)


def reserve(redlock: Redlock, resource: str, ttl: float, owner: str = "", *, token: str) -> Outcome:
    """Reserve the lock on ``resource`` for its next holder (``on_duplicate="coalesce"``): while
    the reservation is held, nobody but an attempt with the same ``token`` and ``owner`` takes
    the lock once it is free. The reservation is a lock itself (`Acquired` holds it;
    `Redlock.release` gives it up); one attempt, like `Redlock.attempt`."""
    key = keyspace.reservation_key(redlock._checked_key(resource, ttl))
    return redlock._attempt_at(Acquisition(resource, key, ttl, owner, token))


def reservation_of(redlock: Redlock, resource: str) -> Held | None:
    """Who holds the reservation of the lock on ``resource`` (`reserve`), like
    `Redlock.holder_of`."""
    return redlock._holder_at(keyspace.reservation_key(redlock.key_for(resource)))


def run_script(
    redlock: Redlock,
    script: scripts.Script,
    keys: Sequence[str],
    arguments: Sequence[str | int],
    judge: Judge,
) -> RoundResult:
    """Run ``script`` on every node at once, over the lock manager's connections, and return each
    node's reply once the outcome is known (a quorum of replies that ``judge`` calls successes,
    or too few left). ``judge`` checks each reply against what the script can return
    (`nodes.Judge`). For records kept beside a lock (the beat leader's
    schedule)."""
    return redlock._group.run(script, keys, arguments, judge)


def release_stored(redlock: Redlock, key: str, value: str) -> int:
    """Delete the lock at ``key`` on every node where it still holds exactly ``value`` (a stored
    value read earlier: token and owner); returns on how many nodes it did. For operators'
    tools that free a lock they did not take, and never anybody else's."""
    return redlock._release_value(key, value, wait=True)


def release_if_owner(redlock: Redlock, resource: str, owner_prefix: str) -> int:
    """Delete the lock on ``resource`` where its owner text starts with ``owner_prefix``
    (`owner.run_prefix`); returns on how many nodes. For freeing the lock of a
    process that is gone, and nobody else's."""
    key = redlock.key_for(resource)
    keys = (key, redlock._with_legacy(key))
    result = redlock._group.run(
        scripts.RELEASE_IF_OWNER, keys, (owner_prefix,), judge_zero_or_one, every=True
    )
    return result.successes
