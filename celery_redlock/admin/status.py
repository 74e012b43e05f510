"""Node health: is each lock node there, how fast, which Redis, and is it set up safely.

PING (the round trip), INFO and, with AOF on, ``CONFIG GET appendfsync`` on every node at once;
only PING is needed to be reachable, and a command an ACL denies or a managed service renames is
in ``could_not_read``. A Redis Cluster node is every master, merged into one record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from redis.exceptions import ResponseError

from ..errors import RedlockError
from ..lock.nodes import Endpoint, LockNode
from ..lock.nodes.cluster import ClusterNode
from ..lock.nodes.sentinel import SentinelNode
from ..lock.redlock import legacy_layout
from ..settings import RedlockSettings, even_node_warning
from .locks import singleton_tasks
from .reading import (
    BadReply,
    LockReader,
    NodeReads,
    access_fix,
    describe_error,
    expect_text,
    failure,
    text,
)
from .records import DEFAULT_TIMEOUT, NodeStatus, StatusReport, names_by_warning


def status_report(app: Any, timeout: float = DEFAULT_TIMEOUT) -> StatusReport:
    """Every lock node's status, in ``redlock_urls`` order, and the warnings about the group.

    A node that does not answer (or answers garbage) is a record with ``reachable=False`` and
    the error, never an exception; passwords are redacted; takes about one ``timeout``.
    """
    with LockReader(app, timeout) as reader:
        answers = reader.ask(probe_member)
        largest_ttl = largest_lock_ttl(app, reader.settings)
        legacy = legacy_lock_warnings(reader)
    statuses = [
        with_warnings(dataclasses.replace(answer.value, node=answer.node), node, largest_ttl)
        if answer.value is not None
        else NodeStatus(answer.node, reachable=False, error=answer.error or "no answer")
        for node, answer in zip(reader.nodes, answers, strict=True)
    ]
    group_warnings = group_safety_warnings(statuses, reader.quorum) + legacy
    return StatusReport(tuple(statuses), reader.quorum, largest_ttl, tuple(group_warnings))


def node_status(app: Any, timeout: float = DEFAULT_TIMEOUT) -> list[NodeStatus]:
    """One `NodeStatus` per lock node, in ``redlock_urls`` order (`status_report` without the
    group's warnings)."""
    return list(status_report(app, timeout).nodes)


def probe_member(reads: NodeReads) -> NodeStatus:
    """One lock node's status; a Redis Cluster's masters probed at once and merged."""
    servers = reads.servers()
    if not isinstance(reads.member, ClusterNode):
        return probe_node(reads, servers[0])

    def probe_server(server: Endpoint) -> NodeStatus:
        try:
            return probe_node(reads, server)
        except Exception as error:  # the master's fault: an unreachable record, with why
            return NodeStatus(server.name, reachable=False, error=failure(error, reads.user))

    with ThreadPoolExecutor(len(servers), thread_name_prefix="redlock-admin-master") as pool:
        return merged_status(reads.node, list(pool.map(probe_server, servers)))


def merged_status(name: str, servers: Sequence[NodeStatus]) -> NodeStatus:
    """One record of a cluster's masters: reachable when every one is, the slowest round trip,
    and each field where they agree."""
    down = [server for server in servers if not server.reachable]
    up = [server for server in servers if server.reachable]
    unreachable = "; ".join(f"{server.node}: {server.error}" for server in down)
    versions = sorted({server.redis_version for server in up if server.redis_version})
    replicas = [server.connected_replicas for server in up]
    known_replicas = [count for count in replicas if count is not None]
    could_not_read = [
        f"{server.node}: {unread}" for server in servers for unread in server.could_not_read
    ]
    shared = ("role", "aof_enabled", "appendfsync", "maxmemory", "maxmemory_policy")
    values = {field: {getattr(server, field) for server in up} for field in shared}
    agreed: dict[str, Any] = {
        field: found.pop() if len(found) == 1 else None for field, found in values.items()
    }
    return NodeStatus(
        name,
        reachable=not down and bool(servers),
        error=f"{len(down)} of {len(servers)} masters unreachable: {unreachable}" if down else None,
        round_trip_milliseconds=max(
            (server.round_trip_milliseconds or 0.0 for server in up), default=None
        ),
        redis_version=", ".join(versions) or None,
        **agreed,
        # The weakest shard: the fewest replicas of any master (unknown if any is unknown).
        connected_replicas=None if None in replicas else min(known_replicas, default=None),
        could_not_read=tuple(could_not_read),
        servers=tuple(servers),
    )


def with_warnings(status: NodeStatus, node: LockNode, largest_ttl: float) -> NodeStatus:
    """``status`` with the warnings about its settings (a cluster's naming the masters that
    have them, unless all do)."""
    replicated = isinstance(node, (ClusterNode, SentinelNode))
    if not status.servers:
        warnings = [*status.warnings, *node_safety_warnings(status, largest_ttl)]
        if replicated:
            warnings += replication_warnings(status, node.wait_replicas)
        return dataclasses.replace(status, warnings=tuple(warnings))
    servers = tuple(
        with_warnings(server, node, largest_ttl) if server.reachable else server
        for server in status.servers
    )
    grouped = names_by_warning((server.node, server.warnings) for server in servers)
    merged = [
        warning if len(names) == len(servers) else f"{', '.join(names)}: {warning}"
        for warning, names in grouped.items()
    ]
    return dataclasses.replace(status, servers=servers, warnings=(*status.warnings, *merged))


def replication_warnings(status: NodeStatus, wait_replicas: int) -> list[str]:
    replicas = status.connected_replicas
    if replicas is None or status.role not in (None, "master"):
        return []
    if wait_replicas > replicas:
        return [
            f"redlock_wait_replicas is {wait_replicas} but {replicas} replica(s) are connected: "
            "WAIT cannot be satisfied, so this node refuses every lock (lower the setting, or "
            "add replicas)"
        ]
    if wait_replicas == 0 and replicas:
        return [
            f"{replicas} replica(s), redlock_wait_replicas 0: a failover to a replica that has "
            "not received a lock yet hands that lock out again; set redlock_wait_replicas to 1 "
            "so that a grant counts only once a replica has it"
        ]
    return []


def probe_node(reads: NodeReads, server: Endpoint) -> NodeStatus:
    """One server's status: PING twice (the second is the round trip), INFO and CONFIG."""
    could_not_read: list[str] = []
    denied = ping(reads, server)
    if denied is not None:
        could_not_read.append(f"whether it answers PING: {denied}")
    started = time.perf_counter()
    ping(reads, server)
    fields: dict[str, Any] = {
        "round_trip_milliseconds": round((time.perf_counter() - started) * 1000, 3)
    }
    try:
        fields.update(read_info(reads, server))
    except ResponseError as error:
        reason = describe_error(error, reads.user)
        could_not_read.append(f"role, persistence and eviction (INFO): {reason}")
    if fields.get("aof_enabled"):
        try:
            fields["appendfsync"] = read_appendfsync(reads, server)
        except ResponseError as error:
            could_not_read.append(f"appendfsync (CONFIG GET): {describe_error(error, reads.user)}")
    return NodeStatus(server.name, reachable=True, could_not_read=tuple(could_not_read), **fields)


def ping(reads: NodeReads, server: Endpoint) -> str | None:
    """None when the server answers PONG, the grant when an ACL denies PING; else raises."""
    try:
        reply = reads.call(server, "PING")
    except ResponseError as error:
        fix = access_fix(error, reads.user)
        if fix is None:
            raise
        return fix
    if not isinstance(reply, (bytes, str)) or text(reply) != "PONG":
        raise BadReply("PING", reply, "PONG")
    return None


def read_info(reads: NodeReads, server: Endpoint) -> dict[str, Any]:
    identity = info_section(reads, server, "server")
    version = server_version(identity)
    if version is None:
        raise BadReply("INFO server", identity, "fields holding redis_version")
    replication = info_section(reads, server, "replication")
    persistence = info_section(reads, server, "persistence")
    memory = info_section(reads, server, "memory")
    fields: dict[str, Any] = {
        "redis_version": version,
        "run_id": identity.get("run_id"),
        "role": replication.get("role"),
        "aof_enabled": number(persistence, "aof_enabled", "persistence") == 1,
        "maxmemory": number(memory, "maxmemory", "memory"),
        "maxmemory_policy": memory.get("maxmemory_policy", "unknown"),
    }
    if "master_host" in replication:
        fields["master"] = f"{replication['master_host']}:{replication.get('master_port')}"
    if "connected_slaves" in replication:
        fields["connected_replicas"] = number(replication, "connected_slaves", "replication")
    return fields


def server_version(server: dict[str, str]) -> str | None:
    """``redis_version``, or ``valkey <valkey_version>`` for Valkey (whose ``redis_version`` is
    the Redis version it is compatible with)."""
    version = server.get("redis_version")
    valkey_version = server.get("valkey_version")
    if valkey_version is not None:
        return f"valkey {valkey_version}"
    if version is not None and server.get("server_name") == "valkey":
        return f"valkey {version}"  # Valkey 7.2 reports no valkey_version: they are the same
    return version


def info_section(reads: NodeReads, server: Endpoint, section: str) -> dict[str, str]:
    body = expect_text(reads.call(server, "INFO", section), f"INFO {section}")
    fields = {}
    for line in body.splitlines():
        name, colon, value = line.partition(":")
        if colon and not name.startswith("#"):
            fields[name.strip()] = value.strip()
    return fields


def number(fields: dict[str, str], name: str, section: str) -> int:
    value = fields.get(name, "0")
    if not value.isdigit():
        raise BadReply(f"INFO {section}", f"{name}:{value}", f"a number for {name}")
    return int(value)


def read_appendfsync(reads: NodeReads, server: Endpoint) -> str | None:
    reply = reads.call(server, "CONFIG", "GET", "appendfsync")
    if not isinstance(reply, list) or len(reply) % 2:
        raise BadReply("CONFIG GET", reply, "name and value pairs")
    pairs = [expect_text(item, "CONFIG GET") for item in reply]
    return dict(zip(pairs[::2], pairs[1::2], strict=True)).get("appendfsync")


def node_safety_warnings(status: NodeStatus, largest_ttl: float) -> list[str]:
    warnings: list[str] = []
    if status.role is not None and status.role != "master":
        of_master = f" of {status.master}" if status.master else ""
        warnings.append(
            f"role is {status.role}{of_master}: Redlock needs independent masters; a replica "
            "rejects lock writes (read-only), and a failover to it can hand a lock out twice"
        )
    delayed_restart = (
        f"restart a crashed node only after the largest lock ttl ({largest_ttl:g}s) has passed "
        "(delayed restart), or run it with appendonly yes and appendfsync always"
    )
    if status.aof_enabled is False:
        warnings.append(f"no AOF (appendonly no): {delayed_restart}")
    elif status.aof_enabled and status.appendfsync is None:
        warnings.append(
            f"AOF on, appendfsync unknown (CONFIG GET not allowed): unless it is 'always', "
            f"{delayed_restart}"
        )
    elif status.aof_enabled and status.appendfsync != "always":
        warnings.append(
            f"AOF with appendfsync {status.appendfsync} (not 'always'): a crash can lose "
            f"recent locks; {delayed_restart}"
        )
    if status.maxmemory and status.maxmemory_policy not in (None, "noeviction"):
        warnings.append(
            f"maxmemory-policy {status.maxmemory_policy} with maxmemory set: under memory "
            "pressure Redis may evict lock keys (they have a ttl) and hand a lock out twice; "
            "use noeviction on lock nodes"
        )
    return warnings


def group_safety_warnings(statuses: Sequence[NodeStatus], quorum: int) -> list[str]:
    total = len(statuses)
    warnings: list[str] = []
    if total == 1:
        warnings.append(
            "a single lock node: no fault tolerance; while it is down no lock can be taken, "
            "and a restart without persistence forgets every lock"
        )
    even = even_node_warning(total)
    if even and total > 1:
        warnings.append(even)
    warnings += same_server_warnings(statuses)
    reachable = sum(status.reachable for status in statuses)
    if quorum <= reachable < total:
        warnings.append(
            f"{total - reachable} of {total} lock nodes unreachable: locks still work, "
            f"but {reachable - quorum + 1} more failure(s) stop them"
        )
    return warnings


def same_server_warnings(statuses: Sequence[NodeStatus]) -> list[str]:
    """One warning per Redis server (``run_id``) that several nodes reach, naming them."""
    by_server: dict[str, list[str]] = {}
    for status in statuses:
        for server in status.servers or (status,):  # a cluster's masters, each once
            if server.run_id:
                by_server.setdefault(server.run_id, []).append(status.node)
    return [
        f"{' and '.join(names)} are the same Redis server (same run_id): the nodes must be "
        "independent, or one crash removes several votes"
        for names in by_server.values()
        if len(names) > 1
    ]


def legacy_lock_warnings(reader: LockReader) -> list[str]:
    """A warning naming the locks 0.2 workers hold, if any: the fleet is being upgraded."""
    if not legacy_layout(reader.redlock):
        return []
    found = reader.read(None).found
    keys = [lock.record.key for lock in found if lock.record.legacy_layout and lock.record.held]
    if not keys:
        return []
    shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    held_for = (
        "0.3 workers treat them as held"
        if reader.settings.compat_0_2
        else "0.3 workers do NOT treat them as held (redlock_compat_0_2 is False): set it "
        "back to True while any 0.2 process runs"
    )
    return [
        f"{len(keys)} lock(s) under 0.2-layout keys ({shown}): celery-redlock 0.2 workers or "
        f"beats hold them, and {held_for}; `celery redlock list` shows their holders (README: "
        "Upgrading)"
    ]


def largest_lock_ttl(app: Any, settings: RedlockSettings) -> float:
    largest = settings.ttl
    for task in singleton_tasks(app).values():
        with contextlib.suppress(RedlockError):
            plan = task.lock_plan
            largest = max(largest, plan.ttl, plan.hold)
    return float(largest)
