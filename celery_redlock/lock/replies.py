"""What each Lua script can answer, as judges (`nodes.Judge`): a node's reply is
untrusted input, and one that is not a possible answer of its script counts as no answer at all
— no vote, no holder, no record — like an error reply."""

from __future__ import annotations

from typing import Any

from . import scripts
from .nodes import Judge, RoundResult


def is_integer(reply: Any) -> bool:
    """True for a RESP integer (never a bool)."""
    return isinstance(reply, int) and not isinstance(reply, bool)


def judge_zero_or_one(reply: Any) -> bool | None:
    """For scripts answering 1 (done) or 0 (refused): extend, release, owner-matched releases."""
    if is_integer(reply) and reply in (0, 1):
        return bool(reply == 1)
    return None


# How every refusal of `scripts.FORCE_RELEASE` starts: its other string replies are garbage.
FORCED_RELEASE_REFUSALS = (b"it is a ", b"its value is not a lock token")


def judge_forced_release(reply: Any) -> bool | None:
    """For the forced release: 1 (deleted), 0 (no such key), or why the key is not a lock
    (refused: left alone)."""
    if isinstance(reply, bytes) and reply.startswith(FORCED_RELEASE_REFUSALS):
        return False
    return judge_zero_or_one(reply)


def judge_one(reply: Any) -> bool | None:
    """For scripts that always answer 1 (raising a fencing counter)."""
    return True if is_integer(reply) and reply == 1 else None


def is_copy(reply: Any) -> bool:
    """True for ``{stored value, its pttl in ms}``: a value (empty when there is none) and a
    pttl of -2 or more."""
    return (
        isinstance(reply, list)
        and len(reply) == 2
        and isinstance(reply[0], bytes)
        and is_integer(reply[1])
        and reply[1] >= -2
    )


def copies_in(result: RoundResult) -> list[tuple[str, int]]:
    """``(stored value, pttl in ms)`` of each member whose reply in ``result`` is a copy."""
    copies = [reply for reply in result.replies if is_copy(reply)]
    return [(value.decode(errors="replace"), int(pttl)) for value, pttl in copies]


def judge_copy(reply: Any) -> bool | None:
    """For scripts that read a lock without changing it: every well-formed copy is an answer."""
    return True if is_copy(reply) else None


def acquire_judge(clock_microseconds: int, asks_record: bool) -> Judge:
    """For the acquire script, from a caller whose clock read ``clock_microseconds``: a fencing
    token never below it (granted); the value in the way and its pttl, or COVERED when a record
    was asked about (refused)."""

    def judge(reply: Any) -> bool | None:
        if is_integer(reply):
            return True if reply >= clock_microseconds else None
        if is_copy(reply) and reply[0]:
            return False
        if asks_record and reply == scripts.COVERED_REPLY:
            return False
        return None

    return judge


def judge_text(reply: Any) -> bool | None:
    """For scripts that read a stored text (the beat leader's records): any bulk string."""
    return True if isinstance(reply, bytes) else None
