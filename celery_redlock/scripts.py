"""The Lua scripts that make acquisition, extension and release atomic on each node.

Each script is run by its SHA-1 (EVALSHA); a node whose script cache is empty (restarted, or
flushed) answers NOSCRIPT and gets the full source once (EVAL), which also caches it there.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Script:
    """A Lua script and the SHA-1 digest Redis knows it by."""

    name: str
    source: str
    # Always sent as EVAL with the source, never EVALSHA: for scripts whose NOSCRIPT reply may
    # come after the round decided (releases), where a lost call would leave a key until its ttl.
    inline: bool = False
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


# KEYS[1] lock key, KEYS[2] its fencing counter; ARGV[1] value (token, then owner); ARGV[2] ttl
# in ms; ARGV[3] the caller's clock in microseconds; ARGV[4] a fragment of an owner description
# whose lock may be taken over (a task's own enqueue-time lock), or ''. A key already holding
# ARGV[1] counts as taken: a late SET of an earlier attempt of the same acquire (same token).
# Returns the fencing token (an integer) when the lock was taken, else {current value, its pttl
# in ms} so the caller can name the holder. The token is max(counter + 1, caller's clock): it
# grows with every acquisition, and nodes that saw the same history return the same token, so
# no second round is needed to agree on it.
ACQUIRE = Script(
    "acquire",
    """
local taken = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
if not taken then
    local value = redis.call('GET', KEYS[1])
    if value == ARGV[1] or (ARGV[4] ~= '' and value and string.find(value, ARGV[4], 1, true)) then
        taken = redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    end
end
if taken then
    local fence = math.max((tonumber(redis.call('GET', KEYS[2])) or 0) + 1, tonumber(ARGV[3]))
    redis.call('SET', KEYS[2], string.format('%.0f', fence), 'PX', ARGV[2])
    return fence
end
return {redis.call('GET', KEYS[1]) or '', redis.call('PTTL', KEYS[1])}
""",
)

# KEYS[1] fencing counter; ARGV[1] token; ARGV[2] ttl in ms. Raises a node's counter to the token
# a new holder got elsewhere, so that every later acquisition on a majority sees a larger one.
RAISE_FENCE = Script(
    "raise_fence",
    """
if (tonumber(redis.call('GET', KEYS[1])) or 0) < tonumber(ARGV[1]) then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
return 1
""",
)

# KEYS[1] lock key, KEYS[2] its fencing counter; ARGV[1] value; ARGV[2] new ttl in ms.
# Returns 1 if extended, 0 if not ours. The counter lives as long as the lock.
EXTEND = Script(
    "extend",
    """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[2], ARGV[2])
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
""",
)

# KEYS[1] lock key; ARGV[1] value; ARGV[2] release channel. Returns 1 if deleted, 0 if not ours.
# The PUBLISH wakes processes waiting for this lock instead of making them poll; it is a pcall
# because an ACL user may lack channel permissions (Redis 7 default: resetchannels), and the
# release must count anyway: the key is already deleted.
RELEASE = Script(
    "release",
    """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('DEL', KEYS[1])
    redis.pcall('PUBLISH', ARGV[2], 'released')
    return 1
end
return 0
""",
    inline=True,
)

# KEYS[1] lock key; ARGV[1] release channel. Deletes whoever holds it (operators' forced release).
FORCE_RELEASE = Script(
    "force_release",
    """
local deleted = redis.call('DEL', KEYS[1])
if deleted == 1 then
    redis.pcall('PUBLISH', ARGV[1], 'released')
end
return deleted
""",
    inline=True,
)

# KEYS[1] lock key; ARGV[1] a fragment of the owner description (e.g. the task id); ARGV[2]
# release channel. Deletes the lock only if its stored owner contains the fragment: how a worker's
# main process frees the lock of a child it lost (killed, timed out, terminated).
RELEASE_IF_OWNER_MATCHES = Script(
    "release_if_owner_matches",
    """
local value = redis.call('GET', KEYS[1])
if value and string.find(value, ARGV[1], 1, true) then
    redis.call('DEL', KEYS[1])
    redis.pcall('PUBLISH', ARGV[2], 'released')
    return 1
end
return 0
""",
    inline=True,
)
