"""What an acquisition asks (`Acquisition`) and yields: the `Lock` held, the `Record` kept
beside it, and the typed `Outcome` of one attempt."""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import QuorumUnavailable
from .owner import lock_value, owner_text_of


@dataclass(slots=True)
class Lock:
    """A lock held on a majority of nodes.

    ``validity``: seconds the lock was guaranteed to stay valid when acquisition (or the last
    extension) finished; `remaining`: how much is left now. ``owner``: non-secret text stored
    beside the token, shown to other contenders. The token (it releases the lock) is not in
    ``repr``.

    ``fencing_token`` grows with every acquisition of the same resource (as long as a majority
    of nodes keeps its data and the clients' clocks agree within the ttl): pass it to the storage
    you write to and have it reject writes carrying a smaller token than it has seen.
    """

    resource: str
    key: str
    token: str = field(repr=False)
    validity: float
    ttl: float
    owner: str = ""
    valid_until: float = field(default=0.0, repr=False)
    fencing_token: int = 0
    # The members its acquisition never reached (their indexes): its release owes them nothing.
    unreached: frozenset[int] = field(default=frozenset(), repr=False, compare=False)

    @property
    def value(self) -> str:
        """What is stored on the nodes: the token, then the owner text."""
        return lock_value(self.token, self.owner)

    def remaining(self) -> float:
        """Seconds of guaranteed validity left now: 0 once it ran out or was released."""
        return max(0.0, self.valid_until - time.monotonic())


@dataclass(frozen=True, slots=True)
class Record:
    """A record kept beside a lock, checked atomically by every acquisition (one whose rank it
    covers ends `Covered`) and written by the release: field ``field`` of the hash at ``key`` (in
    the lock's hash slot) holds the highest ``rank`` released (sent as `scripts.RANK_FORMAT`), for
    ``ttl`` seconds."""

    key: str
    field: str
    rank: tuple[int, int]
    ttl: float


@dataclass(frozen=True, slots=True)
class Acquisition:
    """What stays the same over every round of one acquisition (one token for all of them), and
    the options of `Redlock.attempt`."""

    resource: str
    key: str
    ttl: float
    owner: str
    token: str
    replaces: str = ""
    record: Record | None = None
    rounds: int | None = None


@dataclass(frozen=True)
class Acquired:
    """The attempt took the lock."""

    lock: Lock


@dataclass(frozen=True)
class Held:
    """A majority of the nodes hold the lock for one other owner (``holder``: its owner text),
    whose lock is gone from a majority in ``expires_in`` seconds unless it is extended."""

    holder: str
    expires_in: float


@dataclass(frozen=True)
class Contended:
    """A quorum answered but no majority names a holder: racing callers or leftovers on a
    minority. Worth another attempt after ``retry_in`` seconds (or a release notification)."""

    retry_in: float


@dataclass(frozen=True)
class Unavailable:
    """Fewer than a majority of the nodes answered: nothing can be decided."""

    error: QuorumUnavailable


@dataclass(frozen=True)
class Covered:
    """The `Record` the attempt asked about covers its rank (at least one node says so)."""


Outcome = Acquired | Held | Contended | Unavailable | Covered


def copies_agree(copies: Sequence[tuple[str, int]], quorum: int) -> bool:
    """True when at least ``quorum`` of the per-node ``(stored value, pttl in ms)`` copies carry
    one same value, the empty one (no lock) included: a majority names the holder, or none."""
    counts = collections.Counter(value for value, _ in copies)
    return any(count >= quorum for count in counts.values())


def majority_holder(copies: Sequence[tuple[str, int]], quorum: int) -> Held | None:
    """The holder when at least ``quorum`` copies (like `copies_agree`'s; a pttl below 0: no
    expiry) carry one same non-empty value, else None. Its lock is gone once all but
    ``quorum - 1`` of its copies expired: ``expires_in`` is the ``len - quorum + 1``-th soonest."""
    by_value: dict[str, list[float]] = {}
    for value, milliseconds in copies:
        if value:
            left = float("inf") if milliseconds < 0 else milliseconds / 1000
            by_value.setdefault(value, []).append(left)
    for value, lefts in by_value.items():
        if len(lefts) >= quorum:
            expires_in = sorted(lefts)[len(lefts) - quorum]
            return Held(owner_text_of(value), max(expires_in, 0.0))
    return None
