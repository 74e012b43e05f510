"""The Redlock algorithm over N independent Redis masters.

An attempt sets one key with one random token on every node at once (in a script) and succeeds
only when a majority agreed before the ttl ran out; the lock is then valid for ``ttl - elapsed -
drift``. A failed round is released on every node, because a SET may have landed where the reply
was lost, and retried after a jittered delay. Only the token's holder can extend or release. A
node's reply is untrusted: one its script cannot return (`replies`) counts as no answer.
"""

from __future__ import annotations

import logging
import math
import random
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypedDict

from ..errors import ConfigurationError, LockNotAcquired, QuorumUnavailable
from ..settings import RedlockSettings, check_seconds, even_node_warning, renamed_value, split_urls
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
    Unavailable,
    copies_agree,
    majority_holder,
)
from .owner import Tokens, lock_value
from .replies import acquire_judge, copies_in, is_integer, judge_copy, judge_one, judge_zero_or_one

if TYPE_CHECKING:
    from typing import Unpack

logger = logging.getLogger(__name__)

FENCE_SUFFIX = keyspace.FENCE_SUFFIX  # kept for callers of 0.2
DRIFT_CONSTANT_SECONDS = 0.002

SPLIT_LONGEST_PAUSE = 1.0  # the cap of a waiter's random pause after split votes in a row


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
    and are reopened after a fork. ``urls`` (a list, or one comma-separated string) takes
    ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://`` and ``redis+sentinel://``
    URLs (`nodes.urls`); ``username`` and ``password`` apply to every URL without credentials.
    ``compat_0_2`` (default True): also take and hold each lock at its 0.2-layout key, so that
    celery-redlock 0.2 workers on the same nodes are excluded; False once none runs (README:
    Upgrading from 0.2), and no 0.2-layout key is read or written. ``legacy_layout`` is its
    deprecated name. Invalid arguments raise `ConfigurationError` saying how to fix them.
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
        compat_0_2: bool | None = None,
        *,
        legacy_layout: bool | None = None,
    ) -> None:
        if legacy_layout is not None:
            warnings.warn(
                "Redlock(legacy_layout=...) is deprecated: pass compat_0_2=... (the same option)",
                DeprecationWarning,
                stacklevel=2,
            )
            compat_0_2 = renamed_value("compat_0_2", compat_0_2, "legacy_layout", legacy_layout)
        settings = RedlockSettings(
            urls=split_urls(urls),  # type: ignore[arg-type]  # checked by RedlockSettings
            retry_count=retry_count,
            retry_delay=retry_delay,
            clock_drift_factor=clock_drift_factor,
            node_timeout=node_timeout,
            key_prefix=key_prefix,
            username=username,
            password=password,
            compat_0_2=RedlockSettings.compat_0_2 if compat_0_2 is None else compat_0_2,
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
        self._holds_legacy = self._legacy_layout and settings.compat_0_2
        self._last_legacy = ("", "")
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
        # The last key asked for, and its 0.2 key: a lock's release asks for what its
        # acquisition did (one tuple, read and replaced whole by any thread).
        last_key, last_legacy = self._last_legacy
        if last_key == key:
            return last_legacy
        legacy = legacy_key_of(self, key) or key
        self._last_legacy = (key, legacy)
        return legacy

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

        ``wait=0``: one acquisition, retried (up to ``rounds``, default ``retry_count``, jittered)
        only while `Contended` or `Unavailable`. ``wait`` seconds (None: no limit): attempts until
        taken or the time is up, sleeping until the holder releases (a notification) or its lock
        expires, never polling; returns the first outcome neither `Held` nor `Contended`, else
        the last. ``token`` (default: a new one) is known before any SET is sent; ``replaces`` is
        an owner-text prefix whose lock counts as free; with ``record``, ends `Covered` when the
        record covers its rank. A lock reserved for someone else (`reserve`) is not taken.
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
            extra += [record.field, scripts.RANK_FORMAT.format(*record.rank)]
        ttl_ms = max(1, int(ttl * 1000))
        rounds = self._settings.retry_count if acquisition.rounds is None else acquisition.rounds
        outcome: Outcome | None = None
        reached: frozenset[int] = frozenset()  # members an earlier round may have set it on
        for round_number in range(rounds):
            if round_number:
                time.sleep(jittered(self._settings.retry_delay))
            self._group.confirm()
            started = time.monotonic()
            clock = time.time_ns() // 1000
            arguments: list[str | int] = [value, ttl_ms, clock, acquisition.replaces, *extra]
            judge = acquire_judge(clock, record is not None)
            # An earlier round of this acquisition (or an earlier attempt of the same run), with
            # the same token, may have left a clean-up owed to a node that was silent: sent after
            # this round, it would remove the lock this round takes.
            reached |= self._group.forgive(key, value)
            try:
                result = self._group.run(scripts.ACQUIRE, keys, arguments, judge, grants=True)
                outcome = self._outcome(acquisition, started, result)
            except BaseException:
                self._release_value(key, value, ttl)  # an interrupted round may have set keys
                raise
            # Members this round never went to hold nothing of it (unless an earlier one did).
            unreached = result.unsent - reached
            if isinstance(outcome, Acquired):
                outcome.lock.unreached = unreached
                return outcome
            # Release everywhere, including nodes that seemed to fail: a SET may have landed.
            self._release_value(key, value, ttl, spared=unreached)
            if not isinstance(outcome, (Contended, Unavailable)):
                return outcome
        return outcome or Unavailable(QuorumUnavailable(key, 0, self.quorum))

    def _wait_at(self, acquisition: Acquisition, timeout: float | None) -> Outcome:
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        delay = self._settings.retry_delay
        outcome = self._attempt_at(acquisition)
        if not isinstance(outcome, (Held, Contended)):
            return outcome
        splits = 0
        with self._group.listen_for_releases(acquisition.key) as listener:
            while True:
                # Listening before each attempt: a release between attempt and wait wakes us.
                outcome = self._attempt_at(acquisition)
                now = time.monotonic()
                if not isinstance(outcome, (Held, Contended)) or now >= deadline:
                    return outcome
                left = deadline - now
                if isinstance(outcome, Contended):
                    # Callers woken by one release split the vote again if they all try again
                    # at once, and every failed attempt's release wakes them together: so after
                    # a split each sleeps a random while instead, longer after each split.
                    splits += 1
                    longest = min(max(delay, 0.01) * 2 ** (splits - 1), SPLIT_LONGEST_PAUSE)
                    pause = random.uniform(0, min(longest, max(outcome.retry_in, 0.001)))
                    time.sleep(min(pause, left))
                    continue
                splits = 0
                pause = max(outcome.expires_in, 0.001) + random.uniform(0, delay / 4)
                listener.wait(min(pause, left))

    def _outcome(self, acquisition: Acquisition, started: float, result: RoundResult) -> Outcome:
        key, ttl = acquisition.key, acquisition.ttl
        if any(reply == scripts.COVERED_REPLY for reply in result.replies):
            # Records are written by every node a release reaches: one copy is proof enough.
            return Covered()
        fencing_token = self._agree_on_fencing_token(key, result, int(ttl * 1000))
        finished = time.monotonic()
        validity = ttl - (finished - started) - drift(self, ttl)
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
        # The largest token a node returned; nodes that returned less (they missed acquisitions
        # while down, or restarted empty) are raised to it, so that any later majority includes
        # a node that will hand out a larger one.
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
        taking it; None when nobody does. With ``compat_0_2``, a 0.2 worker's lock counts, as it
        does for `attempt`. Raises `QuorumUnavailable` without a quorum."""
        return self._holder_at(self.key_for(resource))

    def _holder_at(self, key: str) -> Held | None:
        keys = (key, self._with_legacy(key))
        result = self._group.run(scripts.READ, keys, (), judge_copy)
        if result.answered < self.quorum:
            raise self._unavailable(key, result)
        copies = copies_in(result)
        if not copies_agree(copies, self.quorum):
            # The first copies to arrive disagree (a node that lost the lock, one that kept a
            # leftover): only every node's copy can tell whether a majority agrees.
            everyone = self._group.run(scripts.READ, keys, (), judge_copy, every=True)
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

        Returns the `Lock`, or None when someone else holds it (with ``blocking=True``: for
        ``timeout`` seconds, None: for ever; it sleeps until a release or expiry, never polls).
        Raises `QuorumUnavailable` when fewer than a majority of nodes answered.
        """
        outcome = self.attempt(resource, ttl, owner, wait=timeout if blocking else 0.0)
        if isinstance(outcome, Unavailable):
            raise outcome.error
        return outcome.lock if isinstance(outcome, Acquired) else None

    @contextmanager
    def lock(self, resource: str, ttl: float, **options: Unpack[AcquireOptions]) -> Iterator[Lock]:
        """Hold the lock on ``resource`` for the ``with`` block, taken as `acquire` takes it
        (``blocking``, ``timeout`` and ``owner`` by keyword); release it on the way out. Raises
        `LockNotAcquired` when someone else holds it."""
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

        True only if a majority extended it while still valid (``validity`` and `remaining` are
        updated); a node that lost the key (restarted empty) gets it back. False: the lock cannot
        be relied on; when a majority says another owner holds it, `remaining` drops to zero.
        """
        ttl = lock.ttl if ttl is None else ttl
        check_ttl(self, ttl)
        if lock.valid_until <= time.monotonic():
            return False
        self._group.confirm(extension=True)
        started = time.monotonic()
        if lock.valid_until <= started:
            return False
        keys = (lock.key, keyspace.fence_key(lock.key), self._with_legacy(lock.key))
        until = int((time.time() + lock.valid_until - started) * 1000)  # on the wall clock
        value = lock_value(lock.token, lock.owner)
        args = (value, max(1, int(ttl * 1000)), lock.fencing_token, until)
        # Every node's reply is awaited (up to node_timeout): an extension still on its way to
        # a node when the holder releases there could set the key again after the release.
        # An extension sets the lock again where it is missing: a member it reaches may hold it
        # from now on, and the release owes it a clean-up (all of them, if this is cut short).
        unreached, lock.unreached = lock.unreached, frozenset()
        result = self._group.run(
            scripts.EXTEND, keys, args, judge_zero_or_one, every=True, grants=True
        )
        lock.unreached = unreached & result.unsent
        if result.answered - result.successes >= len(self._group.nodes) - self.quorum + 1:
            lock.valid_until = 0.0  # a majority says another owner holds it: nothing to rely on
            return False
        if result.successes < self.quorum or result.finished_at >= lock.valid_until:
            return False
        lock.validity = ttl - (result.finished_at - started) - drift(self, ttl)
        lock.valid_until = result.finished_at + lock.validity
        lock.ttl = ttl
        return lock.validity > 0

    def release(
        self, lock: Lock, hold: float = 0.0, record: Record | None = None, confirm: bool = True
    ) -> bool:
        """Release the lock on every node where it still holds this lock's token (never anybody
        else's); True if a majority confirmed, False if it had expired or been taken over, or if
        no majority answered within ``node_timeout`` (a node reached runs the release anyway).

        With ``hold`` seconds the lock is kept that much longer instead; with ``record`` its rank
        is recorded on every node reached. ``confirm=False`` sends and returns False at once (this
        thread's next round reads the replies); each node runs the release before anything this
        thread sends it later.
        """
        keys = [lock.key, keyspace.fence_key(lock.key), self._with_legacy(lock.key)]
        arguments: list[str | int] = [lock_value(lock.token, lock.owner), max(0, int(hold * 1000))]
        if record is not None:
            keys.append(record.key)
            rank = scripts.RANK_FORMAT.format(*record.rank)
            arguments += [record.field, rank, max(1, int(record.ttl * 1000))]
        result = self._group.run(
            scripts.RELEASE,
            keys,
            arguments,
            judge_zero_or_one,
            wait=confirm,
            owed_for=max(lock.ttl, hold),
            spared=lock.unreached,
        )
        lock.valid_until = 0.0
        return result.successes >= self.quorum

    def _release_value(
        self,
        key: str,
        value: str,
        ttl: float = 0.0,
        wait: bool = False,
        spared: frozenset[int] = frozenset(),
    ) -> int:
        # A node that cannot be reached gets the release once it answers again (owed for ttl),
        # unless it is ``spared``: the value never reached it.
        keys = (key, keyspace.fence_key(key), self._with_legacy(key))
        return self._group.run(
            scripts.RELEASE,
            keys,
            (value, 0),
            judge_zero_or_one,
            wait=wait,
            every=wait,
            owed_for=ttl,
            spared=spared,
        ).successes

    def close(self) -> None:
        """Close this process's idle connections to the nodes."""
        self._group.close()


# -- helpers of other layers, kept beside the algorithm they use -----------------------------------


def from_settings(settings: RedlockSettings) -> Redlock:
    """The lock manager ``settings`` describe. Without the even-node warning: a worker logs it
    once at start, ``celery redlock status`` reports it."""
    redlock = Redlock.__new__(Redlock)
    redlock._configure(settings)
    return redlock


def drift(redlock: Redlock, ttl: float) -> float:
    """Seconds subtracted from the validity of a ``ttl``-second lock for clock drift."""
    return ttl * redlock._settings.clock_drift_factor + DRIFT_CONSTANT_SECONDS


def check_ttl(redlock: Redlock, ttl: float, name: str = "ttl") -> None:
    """Raise `ConfigurationError` unless a ``ttl``-second lock can have positive validity."""
    check_seconds(name, ttl)
    node_timeout = redlock._settings.node_timeout
    if ttl - drift(redlock, ttl) - node_timeout <= 0:
        raise ConfigurationError(
            f"{name}={ttl!r}s leaves no validity after the clock drift allowance "
            f"({drift(redlock, ttl):.3f}s) and one node timeout ({node_timeout}s); "
            "use a ttl of at least a few tenths of a second"
        )


def legacy_layout(redlock: Redlock) -> bool:
    """Whether 0.2 workers can share ``redlock``'s nodes (none is a cluster node), so that locks
    may live at 0.2 keys (`legacy_key_of`)."""
    return redlock._legacy_layout


def legacy_key_of(redlock: Redlock, key: str) -> str | None:
    """Where 0.2 workers lock what ``key`` locks (`keyspace.legacy_key`); None for a group with a
    cluster node (0.2 could not use one) or a key that is no lock key."""
    if not redlock._legacy_layout:
        return None
    return keyspace.legacy_key(redlock._settings.key_prefix, key)


def reserve(redlock: Redlock, resource: str, ttl: float, owner: str = "", *, token: str) -> Outcome:
    """Reserve the lock on ``resource`` for its next holder (``on_duplicate="coalesce"``): while
    reserved, only an attempt with the same ``token`` and ``owner`` takes it once free. The
    reservation is a lock itself (`Redlock.release` gives it up); one attempt, like `attempt`."""
    key = keyspace.reservation_key(redlock._checked_key(resource, ttl))
    return redlock._attempt_at(Acquisition(resource, key, ttl, owner, token))


def reservation_of(redlock: Redlock, resource: str) -> Held | None:
    """Who holds the reservation of the lock on ``resource`` (`reserve`), like `holder_of`."""
    return redlock._holder_at(keyspace.reservation_key(redlock.key_for(resource)))


def run_script(
    redlock: Redlock,
    script: scripts.Script,
    keys: Sequence[str],
    arguments: Sequence[str | int],
    judge: Judge,
) -> RoundResult:
    """Run ``script`` on every node over ``redlock``'s connections until the outcome is known (a
    quorum of replies ``judge`` calls successes, or too few left). For records beside a lock."""
    return redlock._group.run(script, keys, arguments, judge)


def release_stored(redlock: Redlock, key: str, value: str) -> int:
    """Delete the lock at ``key`` on every node where it still holds exactly ``value`` (read
    earlier); returns on how many nodes. For operators' tools: never anybody else's lock."""
    return redlock._release_value(key, value, wait=True)


def release_if_owner(redlock: Redlock, resource: str, owner_prefix: str) -> int:
    """Delete the lock on ``resource`` where its owner text starts with ``owner_prefix``
    (`owner.run_prefix`); returns on how many nodes. Frees a gone process's lock, nobody else's."""
    key = redlock.key_for(resource)
    keys = (key, redlock._with_legacy(key))
    return redlock._group.run(
        scripts.RELEASE_IF_OWNER, keys, (owner_prefix,), judge_zero_or_one, every=True
    ).successes
