"""Fenced writes to application data in Redis (a Redis of your data, not a lock node).

The fence of a key lives at ``<key>:fence`` by default (on a Redis Cluster give the key a hash
tag, ``{account:42}``, to keep both in one slot); one script compares and writes both, or neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
from redis.exceptions import NoScriptError

from ..lock.scripts import Script
from . import Fence, StaleFence, fencing_token

__all__ = ["FENCED_WRITE", "FENCE_SUFFIX", "fenced_hset", "fenced_set", "stored_token"]

FENCE_SUFFIX = ":fence"
"""The default fence key of a key: the key with this suffix."""

# KEYS: the data key, its fence key. ARGV: the token, "set" or "hset", then the value (set) or
# field, value, ... (hset). Returns {1, token} when written, {0, stored token} when refused.
FENCED_WRITE = Script(
    "fenced_write",
    """
local stored = redis.call('GET', KEYS[2])
if stored and tonumber(stored) >= tonumber(ARGV[1]) then
    return {0, stored}
end
redis.call('SET', KEYS[2], ARGV[1])
if ARGV[2] == 'set' then
    redis.call('SET', KEYS[1], ARGV[3])
else
    redis.call('HSET', KEYS[1], unpack(ARGV, 3))
end
return {1, ARGV[1]}
""",
)


def fenced_set(
    client: redis.Redis, key: str, value: Any, fence: Fence, *, fence_key: str | None = None
) -> None:
    """``SET key value``, only if ``fence``'s token is larger than the one stored for ``key``
    (which it then replaces); raises `StaleFence` otherwise. ``value`` is what redis-py's SET
    takes (bytes, str, int, float)."""
    _write(client, key, fence, fence_key, "set", value)


def fenced_hset(
    client: redis.Redis,
    key: str,
    mapping: Mapping[str, Any],
    fence: Fence,
    *,
    fence_key: str | None = None,
) -> None:
    """``HSET key field value ...`` for every item of ``mapping``, only if ``fence``'s token is
    larger than the one stored for ``key``; raises `StaleFence` otherwise."""
    if not mapping:
        raise ValueError("fenced_hset needs at least one field to write")
    items = [part for field_and_value in mapping.items() for part in field_and_value]
    _write(client, key, fence, fence_key, "hset", *items)


def stored_token(client: redis.Redis, key: str, *, fence_key: str | None = None) -> int:
    """The token of the last fenced write accepted for ``key``; 0 before the first."""
    return int(client.get(fence_key or key + FENCE_SUFFIX) or 0)


def _write(
    client: redis.Redis, key: str, fence: Fence, fence_key: str | None, *arguments: Any
) -> None:
    token = fencing_token(fence)
    keys_and_arguments = [key, fence_key or key + FENCE_SUFFIX, token, *arguments]
    try:
        reply = client.evalsha(FENCED_WRITE.sha, 2, *keys_and_arguments)
    except NoScriptError:
        reply = client.eval(FENCED_WRITE.source, 2, *keys_and_arguments)
    written, stored = reply
    if not written:
        raise StaleFence(key, token, int(stored))
