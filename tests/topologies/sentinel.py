"""Redis Sentinel on 127.0.0.1: `SentinelGroup` runs one master, its replicas and three
sentinels (``redis-server <config> --sentinel``, each a `SentinelServer`) with short timeouts, and
fails the master over on request.

Example::

    from topologies import SentinelGroup

    with SentinelGroup(replicas=1, service_name="locks") as group:
        app.conf.redlock_urls = [group.url]   # redis+sentinel://127.0.0.1:p1,.../locks
        old = group.master()
        new = group.failover()                # the sentinels now name `new`
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis

from celery_redlock.testing import RedisServer
from celery_redlock.testing.redis_servers import HOST

from .servers import TopologyGroup, TopologyServer, role
from .waiting import wait_for_condition

__all__ = ["SentinelGroup", "SentinelServer"]


class SentinelServer(RedisServer):
    """One sentinel (``redis-server sentinel.conf --sentinel``) watching the master
    ``master`` as ``service_name``: a `RedisServer` kind, with the same life cycle. Its
    configuration file is written in its run's directory at every start (the sentinel rewrites
    it as it learns), naming the master :meth:`monitor` last chose.

    Args:
        service_name: the name the master is known by (``sentinel monitor <name> ...``).
        master: the server to watch first.
        quorum: how many sentinels must agree that the master is down.
        down_after: ``down-after-milliseconds``, in seconds.
        failover_timeout: ``failover-timeout``, in seconds.
        executable: the server binary; by default :func:`find_redis_server`.
    """

    def __init__(
        self,
        service_name: str,
        master: RedisServer,
        *,
        quorum: int = 2,
        down_after: float = 2.0,
        failover_timeout: float = 5.0,
        executable: str | None = None,
    ) -> None:
        super().__init__(executable=executable)
        self._service_name = service_name
        self._master = master
        self._quorum = quorum
        self._down_after_ms = max(1, round(down_after * 1000))
        self._failover_timeout_ms = max(1, round(failover_timeout * 1000))

    @property
    def service_name(self) -> str:
        """The name the master is known by."""
        return self._service_name

    def monitor(self, master: RedisServer) -> None:
        """Watch ``master`` from the next start on (a running sentinel follows failovers by
        itself)."""
        self._master = master

    def server_arguments(self, port: int, directory: Path) -> list[str]:
        """The configuration file and ``--sentinel``, then `RedisServer`'s options."""
        name = self._service_name
        lines = [
            f"sentinel monitor {name} {HOST} {self._master.port} {self._quorum}",
            f"sentinel down-after-milliseconds {name} {self._down_after_ms}",
            f"sentinel failover-timeout {name} {self._failover_timeout_ms}",
            f"sentinel parallel-syncs {name} 1",
        ]
        if self._master.password is not None:
            lines.append(f"sentinel auth-pass {name} {self._master.password}")
        configuration = directory / "sentinel.conf"
        configuration.write_text("\n".join(lines) + "\n")
        return [str(configuration), "--sentinel", *super().server_arguments(port, directory)]

    def master_address(self) -> str | None:
        """The ``host:port`` this sentinel names as the master now, or None if it names none."""
        with self.client(socket_timeout=5) as client:
            found = client.sentinel_get_master_addr_by_name(self._service_name)
        if not found:
            return None
        host, port = found
        return f"{host.decode() if isinstance(host, bytes) else host}:{int(port)}"


class SentinelGroup(TopologyGroup):
    """One master, ``replicas`` replicas and ``sentinels`` sentinels on free ports of
    127.0.0.1, the master known to the sentinels as ``service_name``.

    Nothing starts in the constructor: :meth:`start` (or a ``with`` block) starts the master,
    the replicas and the sentinels, and returns once every sentinel names the master, knows the
    other sentinels and sees every replica in sync. :meth:`stop_all` (or leaving the block)
    stops everything; each process is killed at interpreter exit otherwise.

    Args:
        replicas: how many replicas (at least 1, so that a failover has somewhere to go).
        sentinels: how many sentinels.
        service_name: the name the master is known by.
        quorum: how many sentinels must agree that the master is down (default: a majority).
        down_after: seconds without an answer before a sentinel thinks the master is down.
        failover_timeout: the sentinels' ``failover-timeout``, in seconds.
        password: a password the master and replicas require (the sentinels none).
        executable: the server binary (for every process); by default
            :func:`find_redis_server`.
        startup_timeout: the longest :meth:`start` and every wait here take, in seconds.
    """

    def __init__(
        self,
        replicas: int = 1,
        *,
        sentinels: int = 3,
        service_name: str = "celery-redlock",
        quorum: int | None = None,
        down_after: float = 2.0,
        failover_timeout: float = 5.0,
        password: str | None = None,
        executable: str | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        if replicas < 1 or sentinels < 1:
            raise ValueError("a sentinel group needs at least one replica and one sentinel")
        self._service_name = service_name
        self._password = password
        self._timeout = startup_timeout
        first = RedisServer(password=password, executable=executable)
        super().__init__(
            [
                first,
                *(
                    TopologyServer(password=password, executable=executable, replica_of=first)
                    for _ in range(replicas)
                ),
            ]
        )
        self._sentinels = tuple(
            SentinelServer(
                service_name,
                first,
                quorum=quorum or sentinels // 2 + 1,
                down_after=down_after,
                failover_timeout=failover_timeout,
                executable=executable,
            )
            for _ in range(sentinels)
        )

    @property
    def service_name(self) -> str:
        """The name the master is known by."""
        return self._service_name

    @property
    def sentinels(self) -> tuple[SentinelServer, ...]:
        """The sentinels."""
        return self._sentinels

    @property
    def processes(self) -> tuple[RedisServer, ...]:
        """The data nodes (:attr:`servers`: the first master, then the replicas; roles change
        on failover), then the sentinels."""
        return (*self.servers, *self._sentinels)

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:S1,127.0.0.1:S2,127.0.0.1:S3/<service_name>`` (with
        ``:PASSWORD@`` first when the data nodes require a password)."""
        credentials = "" if self._password is None else f":{quote(self._password, safe='')}@"
        addresses = ",".join(sentinel.address for sentinel in self._sentinels)
        return f"redis+sentinel://{credentials}{addresses}/{quote(self._service_name, safe='')}"

    def master(self) -> RedisServer:
        """The data node the first answering sentinel names as the master.

        Raises:
            RuntimeError: no sentinel answers, or the one that does names no node of the group.
        """
        for sentinel in self._answering_sentinels():
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                address = sentinel.master_address()
                return self._server_at(address)
        raise RuntimeError(f"no sentinel of {self!r} answers")

    def replicas(self) -> list[RedisServer]:
        """The running data nodes other than :meth:`master`."""
        master = self.master()
        return [s for s in self.servers if s is not master and s.is_running]

    # -- life cycle -----------------------------------------------------------------------

    def settle(self) -> None:
        """Wait until the group is ready (:meth:`wait_until_ready`); :meth:`start` calls it."""
        self.wait_until_ready()

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Wait until every answering sentinel names the same running master, which says it is
        a master, and knows every other answering sentinel and every other running data node as
        a replica; and every such data node is a replica of that master, in sync.

        Raises:
            RuntimeError: not within ``timeout`` (default ``startup_timeout``) seconds.
        """
        self._wait(self._readiness_problem, "the sentinels to be ready", timeout)

    # -- failures -------------------------------------------------------------------------

    def failover(self, timeout: float | None = None) -> RedisServer:
        """``SENTINEL FAILOVER <service>`` (a failover without asking the other sentinels);
        return the new master once every answering sentinel names it and it says it is a
        master. The old master becomes a replica some seconds later (the sentinels wait a
        while before converting it): call :meth:`wait_until_ready` to wait for that too.

        Raises:
            RuntimeError: the failover did not finish in time.
        """
        old = self.master()
        for sentinel in self._answering_sentinels():
            with sentinel.client(socket_timeout=5) as client:
                client.sentinel_failover(self._service_name)
            break
        return self._wait_for_new_master(old, timeout)

    def kill_master(self, *, wait: bool = True, timeout: float | None = None) -> RedisServer:
        """Kill the master (SIGKILL); with ``wait``, return the new master once the sentinels
        agree it is down (``down_after``), have promoted a replica, and every answering sentinel
        names it; else return the old, killed master at once."""
        return self._fail_master(RedisServer.kill, wait, timeout)

    def pause_master(self, *, wait: bool = True, timeout: float | None = None) -> RedisServer:
        """Freeze the master (SIGSTOP); otherwise as :meth:`kill_master`. Resumed, the old master
        is turned into a replica by the sentinels."""
        return self._fail_master(RedisServer.pause, wait, timeout)

    # -- internals ------------------------------------------------------------------------

    def _fail_master(
        self, fail: Callable[[RedisServer], None], wait: bool, timeout: float | None
    ) -> RedisServer:
        old = self.master()
        fail(old)
        if not wait:
            return old
        return self._wait_for_new_master(old, timeout)

    def _wait_for_new_master(self, old: RedisServer, timeout: float | None) -> RedisServer:
        found: list[RedisServer] = []

        def problem() -> str | None:
            addresses = {s.master_address() for s in self._answering_sentinels()}
            if len(addresses) != 1 or addresses == {old.address}:
                return f"the sentinels name {sorted(map(str, addresses))}"
            new = self._server_at(addresses.pop())
            if role(new) != "master":
                return f"{new.address} is not a master yet"
            found[:] = [new]
            return None

        self._wait(problem, f"a master other than {old.address}", timeout)
        return found[0]

    def _readiness_problem(self) -> str | None:
        sentinels = self._answering_sentinels()
        running = [s for s in self.servers if s.is_running and not s.is_paused]
        master_address = None
        for sentinel in sentinels:
            with sentinel.client(socket_timeout=5, decode_responses=True) as client:
                state: dict[str, Any] = client.sentinel_master(self._service_name)
                replicas: list[dict[str, Any]] = client.sentinel_slaves(self._service_name)
            address = f"{state['ip']}:{state['port']}"
            if master_address not in (None, address):
                return f"the sentinels name different masters ({master_address}, {address})"
            master_address = address
            if int(state.get("num-other-sentinels", 0)) < len(sentinels) - 1:
                return f"sentinel {sentinel.address} does not know the other sentinels yet"
            expected = {s.address for s in running} - {address}
            known = {f"{r['ip']}:{r['port']}" for r in replicas if _flags(r) == {"slave"}}
            if not expected <= known:
                return f"sentinel {sentinel.address} knows replicas {sorted(known)} only"
        if master_address is None:
            return "no sentinel answers"
        if role(self._server_at(master_address)) != "master":
            return f"{master_address} is not a master"
        for replica in running:
            if replica.address != master_address:
                with replica.client(socket_timeout=5, decode_responses=True) as client:
                    state = client.info("replication")
                following = f"{state.get('master_host')}:{state.get('master_port')}"
                if following != master_address or state.get("master_link_status") != "up":
                    return f"{replica.address} is not a replica in sync with {master_address}"
        return None

    def _answering_sentinels(self) -> list[SentinelServer]:
        return [s for s in self._sentinels if s.is_running and not s.is_paused]

    def _server_at(self, address: str | None) -> RedisServer:
        for server in self.servers:
            if server.address == address:
                return server
        raise RuntimeError(f"{address} is not a data node of {self!r}")

    def _wait(self, problem: Callable[[], str | None], what: str, timeout: float | None) -> None:
        limit = self._timeout if timeout is None else timeout
        wait_for_condition(problem, f"{what} ({self!r})", limit)


def _flags(entry: dict[str, Any]) -> set[str]:
    flags = entry.get("flags", "")
    if isinstance(flags, str):
        return set(flags.split(","))
    return set(flags)
