"""The Lua scripts that make acquisition, extension and release atomic on each node.

Scripts a round waits on run by SHA-1 (EVALSHA): every new connection loads them with its first
command, so even a node answering after its round decided has them (a restarted node is reached
through a new connection). After a SCRIPT FLUSH a node answers NOSCRIPT and gets the source once.
``inline`` scripts (releases and clean-ups, whose replies may be read only after the round
decided) always carry their source: a NOSCRIPT nobody reads must not lose them. Each script's
comment says what it can return: callers check every reply against that (`replies`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Script:
    """A Lua script and the SHA-1 digest Redis knows it by."""

    name: str
    source: str
    inline: bool = False
    # Also runs on its first key alone, skipping its part on the other keys: what a round sends
    # a member whose slot is half migrated (TRYAGAIN: the keys are split between two servers).
    alone: bool = False
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


# Every command goes through call(): an error (a command or key the node's ACL user may not use,
# out of memory, a read-only replica) becomes an error reply that names the command, so that the
# caller can say which permission is missing (Redis 7 does not name it for commands in scripts).
_CALL = """
local function call(...)
    local reply = redis.pcall(...)
    if type(reply) == 'table' and reply.err then
        local message = reply.err .. ' [command ' .. string.lower((...)) .. ']'
        if redis.REDIS_VERSION then
            error({err = message})  -- Redis 7 and Valkey: the reply is this error as it is
        end
        error(message)  -- Redis 6.2: "ERR Error running script ...: <message>"
    end
    return reply
end
"""

RANK_FORMAT = "{}:{}"
"""How a record's rank ``(major, minor)`` is sent and stored: ``RANK_FORMAT.format(*rank)``."""

# A record holds a rank "major:minor" (two whole numbers); a stored rank covers every rank it is
# not below. A missing or malformed record covers nothing.
_COVERS = """
local function rank_of(text)
    local major, minor = string.match(text or '', '^(%d+):(%d+)$')
    return tonumber(major) or -1, tonumber(minor) or -1
end
local function covers(stored, rank)
    local stored_major, stored_minor = rank_of(stored)
    local major, minor = rank_of(rank)
    return stored_major > major or (stored_major == major and stored_minor >= minor)
end
"""

# The fencing counter lives at least as long as every lock it fenced: never shortened.
_KEEP_FENCE = """
local function keep_fence(fence_key, milliseconds)
    if call('PTTL', fence_key) < milliseconds then
        call('PEXPIRE', fence_key, milliseconds)
    end
end
"""

COVERED_REPLY = b"COVERED"  # ACQUIRE's answer when the record asked about covers the rank

# A string that some version of celery_redlock wrote as a lock value: a token of 40 lowercase hex
# digits first (then, from 0.2 on, '|' and the owner).
_IS_LOCK_VALUE = """
local function is_lock_value(value)
    return type(value) == 'string' and string.find(value, '^' .. string.rep('[0-9a-f]', 40)) ~= nil
end
"""

# KEYS[1] lock key, KEYS[2] its fencing counter, KEYS[3] its reservation, KEYS[4] (optional) its
# 0.2-layout key (KEYS[1] again: none), KEYS[5] (optional) a record hash. ARGV[1] value
# (token|owner), ARGV[2] ttl in ms, ARGV[3] the caller's clock in microseconds, ARGV[4] an owner
# prefix whose lock counts as free, or '', ARGV[5], ARGV[6] (with KEYS[5]) record field and rank.
# Returns COVERED when the record covers the rank; else, when the lock was taken (a key already
# holding ARGV[1] is a late SET of an earlier round: taken), the fencing token max(counter + 1,
# caller's clock), so that nodes that saw the same history agree; else {the value in the way, its
# pttl in ms} (at the lock key, else at its 0.2-layout key, else a reservation for someone else).
# A taken lock is written at both keys so 0.2 workers see it; a 0.2 key of another type, or a
# value no version writes, is left. Each key is read only when the call needs it: the record with
# KEYS[5], the 0.2-layout key with KEYS[4]. The counter is read and set in one command (SET ...
# GET) and set again only when it was not below the caller's clock; it then lives as long as this
# lock: a lock it fenced before is gone from this node (the key was free, or replaceable), and
# extensions and holds keep the counter as long as this one.
ACQUIRE = Script(
    "acquire",
    _CALL
    + _COVERS
    + _IS_LOCK_VALUE
    + """
if KEYS[5] and covers(call('HGET', KEYS[5], ARGV[5]), ARGV[6]) then
    return redis.status_reply('COVERED')
end
local function in_the_way(value)
    if not value or value == ARGV[1] then
        return false
    end
    if ARGV[4] == '' then
        return true
    end
    local owner = string.sub(value, (string.find(value, '|', 1, true) or #value) + 1)
    return string.sub(owner, 1, #ARGV[4]) ~= ARGV[4]
end
local value = call('GET', KEYS[1])
if in_the_way(value) then
    return {value, call('PTTL', KEYS[1])}
end
local legacy = KEYS[4] ~= nil and KEYS[4] ~= KEYS[1]
if legacy then
    local old = redis.pcall('GET', KEYS[4])
    if is_lock_value(old) then
        if in_the_way(old) then
            return {old, call('PTTL', KEYS[4])}
        end
    elseif old then
        legacy = false
    end
end
local reserved = call('GET', KEYS[3])
if reserved and reserved ~= ARGV[1] then
    return {reserved, call('PTTL', KEYS[3])}
end
call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if legacy then
    call('SET', KEYS[4], ARGV[1], 'PX', ARGV[2])
end
local fence = tonumber(ARGV[3])
local counter = tonumber(call('SET', KEYS[2], string.format('%.0f', fence), 'PX', ARGV[2], 'GET'))
if counter and counter >= fence then
    fence = counter + 1
    call('SET', KEYS[2], string.format('%.0f', fence), 'PX', ARGV[2])
end
return fence
""",
)

# KEYS[1] fencing counter; ARGV[1] fencing token; ARGV[2] ttl in ms. Raises a node's counter to
# the token a new holder got elsewhere, so that every later acquisition on a majority sees it.
RAISE_FENCE = Script(
    "raise_fence",
    _CALL
    + _KEEP_FENCE
    + """
if (tonumber(call('GET', KEYS[1])) or 0) < tonumber(ARGV[1]) then
    call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
keep_fence(KEYS[1], tonumber(ARGV[2]))
return 1
""",
)

# KEYS[1] lock key, KEYS[2] its fencing counter, KEYS[3] (optional) its 0.2-layout key (KEYS[1]
# again: none); ARGV[1] value; ARGV[2] new ttl in ms; ARGV[3] the lock's fencing token; ARGV[4]
# the end of the lock's validity, in ms of the caller's wall clock. Returns 1 if extended, 0 if
# another owner holds the key or it expired. A node that lost the key (restarted empty) gets it
# back, with its fencing counter, while the lock is valid by the caller's clock: not when the
# extension arrives late (it was frozen), which would bring back a lock whose holder may be gone.
# The 0.2-layout copy is extended with the lock. Called with the lock key alone, the fencing
# counter is left as it is (the next extension with both keys raises and keeps it again).
EXTEND = Script(
    "extend",
    _CALL
    + _KEEP_FENCE
    + """
local value = call('GET', KEYS[1])
if value == ARGV[1] then
    call('PEXPIRE', KEYS[1], ARGV[2])
elseif value then
    return 0
else
    local now = call('TIME')
    if tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) > tonumber(ARGV[4]) then
        return 0
    end
    call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
if KEYS[2] then
    if (tonumber(call('GET', KEYS[2])) or 0) < tonumber(ARGV[3]) then
        call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
    end
    keep_fence(KEYS[2], tonumber(ARGV[2]))
end
if KEYS[3] and KEYS[3] ~= KEYS[1] then
    local old = redis.pcall('GET', KEYS[3])
    if old == ARGV[1] then
        call('PEXPIRE', KEYS[3], ARGV[2])
    elseif old == false then
        call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
    end
end
return 1
""",
    alone=True,
)

# How long a fencing counter outlives a released lock: the next holder's token is then at least
# its own clock in microseconds, above every earlier token while the hosts' clocks agree within
# half this time. Longer would keep a key per lock key ever used.
FENCE_AFTER_RELEASE_MILLISECONDS = 1000

# KEYS[1] lock key (also the waiters' channel), KEYS[2] its fencing counter, KEYS[3] (optional)
# its 0.2-layout key (KEYS[1] again: none), KEYS[4] (optional) a record hash. ARGV[1] value;
# ARGV[2] hold in ms (0: delete now); ARGV[3..5] (with KEYS[4]) the record's field, the rank and
# the record's lifetime in ms. Returns 1 if the lock was still ours, else 0; the record is
# written either way. The 0.2-layout copy goes (or is kept) with the lock. Called with the lock
# key alone, the rest is left as it is. The PUBLISH is a pcall: an ACL user may lack channel
# permissions, and the release counts anyway.
RELEASE = Script(
    "release",
    _CALL
    + _COVERS
    + _KEEP_FENCE
    + f"local FENCE_AFTER_RELEASE = {FENCE_AFTER_RELEASE_MILLISECONDS}\n"
    + """
local released = 0
if call('GET', KEYS[1]) == ARGV[1] then
    local hold = tonumber(ARGV[2])
    if hold > 0 then
        call('PEXPIRE', KEYS[1], hold)
        if KEYS[2] then
            keep_fence(KEYS[2], hold)
        end
    else
        call('DEL', KEYS[1])
        if KEYS[2] then
            call('PEXPIRE', KEYS[2], FENCE_AFTER_RELEASE)
        end
        redis.pcall('PUBLISH', KEYS[1], 'released')
    end
    released = 1
end
if KEYS[3] and KEYS[3] ~= KEYS[1] and redis.pcall('GET', KEYS[3]) == ARGV[1] then
    if tonumber(ARGV[2]) > 0 then
        call('PEXPIRE', KEYS[3], ARGV[2])
    else
        call('DEL', KEYS[3])
    end
end
if KEYS[4] then
    if not covers(call('HGET', KEYS[4], ARGV[3]), ARGV[4]) then
        call('HSET', KEYS[4], ARGV[3], ARGV[4])
    end
    call('PEXPIRE', KEYS[4], ARGV[5])
end
return released
""",
    inline=True,
    alone=True,
)

# KEYS[1] lock key, KEYS[2] (optional) its 0.2-layout key (KEYS[1] again: none). Returns {current
# value or '', its pttl in ms}: who holds it, without taking it; when the lock key is empty, the
# lock value at the 0.2-layout key and its pttl, as ACQUIRE finds it in the way.
READ = Script(
    "read",
    _CALL
    + _IS_LOCK_VALUE
    + """
local value = call('GET', KEYS[1])
if not value and KEYS[2] and KEYS[2] ~= KEYS[1] then
    local old = redis.pcall('GET', KEYS[2])
    if is_lock_value(old) then
        return {old, call('PTTL', KEYS[2])}
    end
end
return {value or '', call('PTTL', KEYS[1])}
""",
)

# KEYS[1] lock key (checked by the caller: `keyspace.is_lock_key`), KEYS[2] (optional) its
# 0.2-layout key. Operators' forced release: deletes it (and its 0.2 copy) whoever holds it, and
# tells waiters, but only if it holds a lock value (40 lowercase hex digits, alone or then '|'
# and owner). Returns 1 if deleted, 0 if there is no such key, else why it is not a lock (left).
FORCE_RELEASE = Script(
    "force_release",
    """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then
    return 0
end
if kind ~= 'string' then
    return 'it is a ' .. kind .. ', not a string'
end
local value = redis.call('GET', KEYS[1])
local token = string.rep('[0-9a-f]', 40)
if not (string.find(value, '^' .. token .. '$') or string.find(value, '^' .. token .. '|')) then
    return 'its value is not a lock token (40 lowercase hex digits, then optionally | and owner)'
end
redis.call('DEL', KEYS[1])
redis.pcall('PUBLISH', KEYS[1], 'released')
if KEYS[2] and redis.pcall('GET', KEYS[2]) == value then
    redis.call('DEL', KEYS[2])
end
return 1
""",
    inline=True,
)

# KEYS[1] lock key, KEYS[2] (optional) its 0.2-layout key (KEYS[1] again: none); ARGV[1] an owner
# prefix (`owner.run_prefix`). Returns 1 after deleting the lock (and its 0.2 copy) only if it
# holds a lock value whose owner text starts with the prefix, else 0: how a worker's main process
# frees the lock of a pool process it lost, and nobody else's (not the next try of the task id).
RELEASE_IF_OWNER = Script(
    "release_if_owner",
    """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' then
    return 0
end
local value = redis.call('GET', KEYS[1])
if not string.find(value, '^' .. string.rep('[0-9a-f]', 40) .. '|') then
    return 0
end
if string.sub(value, 42, 41 + #ARGV[1]) == ARGV[1] then
    redis.call('DEL', KEYS[1])
    redis.pcall('PUBLISH', KEYS[1], 'released')
    if KEYS[2] and KEYS[2] ~= KEYS[1] and redis.pcall('GET', KEYS[2]) == value then
        redis.call('DEL', KEYS[2])
    end
    return 1
end
return 0
""",
    inline=True,
)

# KEYS[1] the beat leader's lease key, KEYS[2] its schedule records; ARGV[1] the leader's lease
# value; ARGV[2..] pairs of entry name and record text. Returns 1 after storing the records only
# while the lease holds the leader's value (one whose lease ran out cannot overwrite its
# successor's), else 0. Records are one JSON object of strings (never numbers: cjson rounds them).
RECORD_BEAT_ENTRIES = Script(
    "record_beat_entries",
    """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return 0
end
local records = {}
local stored = redis.call('GET', KEYS[2])
if stored then
    local decoded, value = pcall(cjson.decode, stored)
    if decoded and type(value) == 'table' then
        records = value
    end
end
for index = 2, #ARGV, 2 do
    records[ARGV[index]] = ARGV[index + 1]
end
redis.call('SET', KEYS[2], cjson.encode(records))
return 1
""",
)

# KEYS[1] the beat leader's schedule records. Returns them ('' when there are none).
READ_BEAT_ENTRIES = Script("read_beat_entries", "return redis.call('GET', KEYS[1]) or ''")

# What every new connection loads before its first command: the scripts run by SHA-1.
LOADED_ON_CONNECT: tuple[Script, ...] = (
    ACQUIRE,
    RAISE_FENCE,
    EXTEND,
    READ,
    RECORD_BEAT_ENTRIES,
    READ_BEAT_ENTRIES,
)
