"""The Lua scripts that make acquisition, extension and release atomic on each node.

Scripts a round waits on (acquire, extend, raise the fencing counter) run by their SHA-1
(EVALSHA). Every new connection loads them first (``SCRIPT LOAD``, sent with its first command),
so even a node that answers after its round has decided has them: a restarted node is reached
through a new connection. A node whose cache is emptied under a live connection (SCRIPT FLUSH)
answers NOSCRIPT and gets the source once (EVAL). Scripts marked ``inline`` always carry their
source: releases and clean-ups, whose replies may be read only after the round has decided, so a
NOSCRIPT nobody reads must not be able to lose them.

Stored values and owner prefixes are built by `owner`, key names by
`keyspace`; here they are compared as bytes only. Each script's comment says what it
can return: callers check every reply against that (`redlock`), since a node's reply
is untrusted input.
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
    alone: bool = False
    """The script also runs on its first key alone (called with one key): its part on the
    other keys is skipped. What a round sends a member whose slot is half migrated (TRYAGAIN:
    the keys are split between two servers for a while)."""
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

COVERED_REPLY = b"COVERED"
"""The status ACQUIRE answers when the record it was asked to check covers the caller's rank."""

# KEYS[1] lock key, KEYS[2] its fencing counter, KEYS[3] its reservation, KEYS[4] (optional) the
# lock's 0.2-layout key (KEYS[1] again: none), KEYS[5] (optional) a record hash. ARGV[1] value
# (token|owner), ARGV[2] ttl in ms, ARGV[3] the caller's clock in microseconds, ARGV[4] an owner
# prefix whose lock the caller replaces (counts as free) or '', ARGV[5] and ARGV[6] (with KEYS[5])
# the record's field and the caller's rank.
# Returns the status COVERED when the record covers the rank; else the fencing token (an integer,
# never below ARGV[3]) when the lock was taken — a key already holding ARGV[1] counts as taken (a
# late SET of an earlier round of the same acquisition); else {the value in the way, its pttl in
# ms}: the holder's (at either key), or, when the lock is free but reserved for someone else, the
# reservation's. A lock taken is written at both keys, so that 0.2 workers see it held; a 0.2
# key of another type, or with a value no version writes, is left alone.
# The fencing token is max(counter + 1, caller's clock): nodes that saw the same history agree.
ACQUIRE = Script(
    "acquire",
    _CALL
    + _COVERS
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
    if type(old) == 'string' and string.find(old, '^' .. string.rep('[0-9a-f]', 40)) then
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
local counter = call('GET', KEYS[2])
local fence = math.max((tonumber(counter) or 0) + 1, tonumber(ARGV[3]))
local keep = tonumber(ARGV[2])
if counter then
    keep = math.max(keep, call('PTTL', KEYS[2]))
end
call('SET', KEYS[2], string.format('%.0f', fence), 'PX', keep)
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
# the end of the lock's validity, in ms of the caller's wall clock.
# Returns 1 if extended, 0 if another owner holds the key or it expired. A node that lost the key
# (restarted empty) gets it back, with its fencing counter, while the lock is valid by the
# caller's clock — not when the extension reaches a node late (it was frozen): that would bring
# back the lock of a holder that may be gone. The extension counts only where a majority confirms.
# The 0.2-layout copy is extended with the lock (written again where it is gone).
# Called with the lock key alone, the fencing counter is left as it is (the next extension with
# both keys raises and keeps it again).
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

FENCE_AFTER_RELEASE_MILLISECONDS = 1000
"""How long a fencing counter outlives the lock a holder released (it lives as long as the lock
otherwise): the next holder's token is then at least its own clock in microseconds, above every
token handed out before whenever the hosts' clocks agree within half this time. Keeping counters
longer would keep a key per lock key ever used, for every task run."""

# KEYS[1] lock key (also the channel waiters listen on), KEYS[2] its fencing counter, KEYS[3]
# (optional) its 0.2-layout key (KEYS[1] again: none), KEYS[4] (optional) a record hash. ARGV[1]
# value; ARGV[2] hold in ms (0: delete now; else keep the lock that much longer); ARGV[3],
# ARGV[4], ARGV[5] (with KEYS[4]) the record's field, the rank to record and the record's
# lifetime in ms.
# Returns 1 if the lock was still ours, else 0; the record is written either way. A deleted lock's
# fencing counter lives FENCE_AFTER_RELEASE_MILLISECONDS more. The 0.2-layout copy goes (or is
# kept) with the lock, where it holds ARGV[1].
# Called with the lock key alone, the rest is left as it is.
# The PUBLISH is a pcall: an ACL user may lack channel permissions, and the release counts anyway.
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

# KEYS[1] lock key. Returns {current value or '', its pttl in ms}: who holds it, without taking it.
READ = Script("read", _CALL + "return {call('GET', KEYS[1]) or '', call('PTTL', KEYS[1])}")

# KEYS[1] lock key (its name checked by the caller: `keyspace.is_lock_key`), KEYS[2] (optional)
# its 0.2-layout key. Deletes it whoever holds it (operators' forced release), but only when it
# holds a lock value — a string of 40 lowercase hex digits (the token), alone or followed by '|'
# and the owner text — and tells waiters; the 0.2-layout copy of that value goes too.
# Returns 1 if deleted, 0 if there is no such key, else a string saying why the key is not a lock
# (its type, or a value celery_redlock never writes): such a key is left alone.
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
# prefix (`owner.run_prefix`). Deletes the lock (and its 0.2-layout copy) only if it
# holds a lock value (token, '|', owner text) whose owner text starts with the prefix: how a
# worker's main process frees the lock of a pool process it lost, and nobody else's (not the next
# attempt's of the same task id in another process). A key of another type is not a lock: 0.
# Returns 1 if deleted, else 0.
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
# value; ARGV[2..] pairs of entry name and record text. Stores the records only while the lease
# key holds the leader's own value: a leader whose lease ran out cannot overwrite its successor's
# records. Returns 1 if stored, 0 if the lease is not the caller's here. The records are one JSON
# object of strings (never numbers: cjson would round them).
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
