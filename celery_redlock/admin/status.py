"""Node health: is each lock node there, how fast, which Redis, and is it set up safely.

Asks every node at once (`LockReader.ask`): PING (the round trip, on an open connection), INFO
(version, role, persistence, eviction) and, with AOF on, ``CONFIG GET appendfsync``. Only PING
is needed to count a node as reachable; a command a managed service renames or an ACL denies is
reported in ``could_not_read`` (with the ``ACL SETUSER`` grant for a denial) and the check it
serves is skipped. A node that answers what no Redis server answers is unreachable, with why.

A lock node that is a Redis Cluster is probed on every master at once and reported as one node
(reachable when every master is), its masters' own records in ``servers``. Cluster and Sentinel
nodes are also checked against ``redlock_wait_replicas``: replicas that may miss a grant, or too
few replicas to acknowledge one.
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

INFO_READS = "role, persistence and eviction"


def status_report(app: Any, timeout: float = DEFAULT_TIMEOUT) -> StatusReport:
    """Every lock node's status and the warnings about the group, asked at once.

    Promises: one `NodeStatus` per configured node, in ``redlock_urls`` order (a node that does
    not answer, or answers garbage, is a record with ``reachable=False`` and the error, never an
    exception); passwords are redacted in every name; the call takes about one ``timeout``
    however many nodes hang.
    """
    with LockReader(app, timeout) as reader:
        answers = reader.ask(probe_member)
        largest_ttl = largest_lock_ttl(app, reader.settings)
        legacy = legacy_lock_warnings(reader)
    statuses = []
    for node, answer in zip(reader.nodes, answers, strict=True):
        if answer.value is None:
            error = answer.error or "no answer"
            statuses.append(NodeStatus(answer.node, reachable=False, error=error))
            continue
        status = dataclasses.replace(answer.value, node=answer.node)
        statuses.append(with_warnings(status, node, largest_ttl))
    group_warnings = group_safety_warnings(statuses, reader.quorum) + legacy
    return StatusReport(tuple(statuses), reader.quorum, largest_ttl, tuple(group_warnings))


def node_status(app: Any, timeout: float = DEFAULT_TIMEOUT) -> list[NodeStatus]:
    """One `NodeStatus` per lock node — reachable, round trip, version, role, persistence,
    eviction policy, warnings, what could not be read — in ``redlock_urls`` order.
    `status_report` adds the warnings about the group (node count, duplicates, nodes down)."""
    return list(status_report(app, timeout).nodes)


def probe_member(reads: NodeReads) -> NodeStatus:
    """One lock node's status: its server's (`probe_node`), or for a Redis Cluster every
    master's at once, merged into one record (`merged_status`)."""
    servers = reads.servers()
    if not isinstance(reads.member, ClusterNode):
        return probe_node(reads, servers[0])

    def probe_server(server: Endpoint) -> NodeStatus:
        try:
            return dataclasses.replace(probe_node(reads, server), node=server.name)
        except Exception as error:  # the master's fault: an unreachable record, with why
            return NodeStatus(server.name, reachable=False, error=failure(error, reads.user))

    with ThreadPoolExecutor(len(servers), thread_name_prefix="redlock-admin-master") as pool:
        return merged_status(reads.node, list(pool.map(probe_server, servers)))


def merged_status(name: str, servers: Sequence[NodeStatus]) -> NodeStatus:
    """One record for a lock node made of ``servers`` (a cluster's masters): reachable when
    every one is (a master down leaves its slots' locks unreachable), the slowest round trip,
    and each field where the servers agree (else None; versions listed)."""
    down = [server for server in servers if not server.reachable]
    up = [server for server in servers if server.reachable]
    error = None
    if down:
        error = f"{len(down)} of {len(servers)} masters unreachable: " + "; ".join(
            f"{server.node}: {server.error}" for server in down
        )
    versions = sorted({server.redis_version for server in up if server.redis_version})
    replicas = [server.connected_replicas for server in up]
    known_replicas = [count for count in replicas if count is not None]
    could_not_read = [
        f"{server.node}: {unread}" for server in servers for unread in server.could_not_read
    ]
    return NodeStatus(
        name,
        reachable=not down and bool(servers),
        error=error,
        round_trip_milliseconds=max(
            (server.round_trip_milliseconds or 0.0 for server in up), default=None
        ),
        redis_version=", ".join(versions) or None,
        role=agreed(server.role for server in up),
        aof_enabled=agreed(server.aof_enabled for server in up),
        appendfsync=agreed(server.appendfsync for server in up),
        maxmemory=agreed(server.maxmemory for server in up),
        maxmemory_policy=agreed(server.maxmemory_policy for server in up),
        # The weakest shard: the fewest replicas of any master (unknown if any is unknown).
        connected_replicas=min(known_replicas, default=None)
        if len(known_replicas) == len(replicas)
        else None,
        could_not_read=tuple(could_not_read),
        servers=tuple(servers),
    )


def agreed(values: Any) -> Any:
    """The one value every server gave, else None."""
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else None


def with_warnings(status: NodeStatus, node: LockNode, largest_ttl: float) -> NodeStatus:
    """``status`` with the warnings about its settings: its own, or for a node of several
    servers each server's (a warning that not every server shares names the servers)."""
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
    """What a Cluster or Sentinel master's replicas mean for the locks it grants."""
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
    """One server's status: PING twice (the first connects and authenticates, the second is
    the round trip), then INFO and CONFIG where they are allowed."""
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
        could_not_read.append(f"{INFO_READS} (INFO): {describe_error(error, reads.user)}")
    if fields.get("aof_enabled"):
        try:
            fields["appendfsync"] = read_appendfsync(reads, server)
        except ResponseError as error:
            reason = describe_error(error, reads.user)
            could_not_read.append(f"appendfsync (CONFIG GET): {reason}")
    return NodeStatus("", reachable=True, could_not_read=tuple(could_not_read), **fields)


def ping(reads: NodeReads, server: Endpoint) -> str | None:
    """PING the server: None when it answers PONG, what to grant when an ACL denies PING (it
    answered all the same); anything else raises (`BadReply`, an error reply)."""
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
    """Version, server id, role, master, replicas, persistence and eviction from INFO."""
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
    """The version in an INFO ``server`` section: ``redis_version`` for Redis; for Valkey
    (``server_name:valkey``) ``valkey <valkey_version>``, since its ``redis_version`` is only
    the Redis version it is compatible with. None when the section names no version."""
    version = server.get("redis_version")
    valkey_version = server.get("valkey_version")
    if valkey_version is not None:
        return f"valkey {valkey_version}"
    if version is not None and server.get("server_name") == "valkey":
        return f"valkey {version}"  # Valkey 7.2 reports no valkey_version: they are the same
    return version


def info_section(reads: NodeReads, server: Endpoint, section: str) -> dict[str, str]:
    """The ``name:value`` lines of one INFO section."""
    body = expect_text(reads.call(server, "INFO", section), f"INFO {section}")
    fields = {}
    for line in body.splitlines():
        name, colon, value = line.partition(":")
        if colon and not name.startswith("#"):
            fields[name.strip()] = value.strip()
    return fields


def number(fields: dict[str, str], name: str, section: str) -> int:
    """A whole-number INFO field (0 when absent)."""
    value = fields.get(name, "0")
    if not value.isdigit():
        raise BadReply(f"INFO {section}", f"{name}:{value}", f"a number for {name}")
    return int(value)


def read_appendfsync(reads: NodeReads, server: Endpoint) -> str | None:
    """``CONFIG GET appendfsync`` (a managed service may deny or rename it: `ResponseError`)."""
    reply = reads.call(server, "CONFIG", "GET", "appendfsync")
    if not isinstance(reply, list) or len(reply) % 2:
        raise BadReply("CONFIG GET", reply, "name and value pairs")
    pairs = [expect_text(item, "CONFIG GET") for item in reply]
    return dict(zip(pairs[::2], pairs[1::2], strict=True)).get("appendfsync")


def node_safety_warnings(status: NodeStatus, largest_ttl: float) -> list[str]:
    """The settings of one reachable node that weaken the lock's safety."""
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
    """Warnings about the set of nodes as a whole."""
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
    """One warning per Redis server that several nodes reach (the same ``run_id``, whatever
    their URLs say: ``127.0.0.1`` and ``localhost``, two names of one host), naming them."""
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
    """A warning naming the locks that celery-redlock 0.2 workers hold (0.2-layout keys), if
    any: the fleet is being upgraded."""
    if not legacy_layout(reader.redlock):
        return []
    found = reader.read(None).found
    keys = [lock.record.key for lock in found if lock.record.legacy_layout and lock.record.held]
    if not keys:
        return []
    shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    held_for = (
        "0.3 workers treat them as held"
        if reader.settings.legacy_layout
        else "0.3 workers do NOT treat them as held (redlock_legacy_layout is False): set it "
        "back to True while any 0.2 process runs"
    )
    return [
        f"{len(keys)} lock(s) under 0.2-layout keys ({shown}): celery-redlock 0.2 workers or "
        f"beats hold them, and {held_for}; `celery redlock list` shows their holders (README: "
        "Upgrading)"
    ]


def largest_lock_ttl(app: Any, settings: RedlockSettings) -> float:
    """The longest a lock key can live: the ttl setting or any singleton task's ttl or hold."""
    largest = settings.ttl
    for task in singleton_tasks(app).values():
        with contextlib.suppress(RedlockError):
            plan = task.lock_plan
            largest = max(largest, plan.ttl, plan.hold)
    return float(largest)
