"""Groups of servers started and stopped together: `ServerGroup`, and `RedisNodes`, several
independent Redis masters, the setup Redlock expects (not Redis Cluster)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TypeVar

from .processes import stop_processes
from .redis_servers import RedisServer
from .resources import ClosingResource

__all__ = ["RedisNodes", "ServerGroup"]

_GroupT = TypeVar("_GroupT", bound="ServerGroup")


class ServerGroup(ClosingResource):
    """Servers that start and stop together. Nothing starts in the constructor: :meth:`start`
    (or a ``with`` block) starts every process, :meth:`stop_all` (or leaving the block) stops
    them all; each is killed at interpreter exit otherwise.

    Indexing, ``len()`` and iteration are over :attr:`servers`.
    """

    def __init__(self, servers: Sequence[RedisServer]) -> None:
        self._servers = tuple(servers)

    @property
    def servers(self) -> tuple[RedisServer, ...]:
        """The servers, in a fixed order."""
        return self._servers

    @property
    def processes(self) -> tuple[RedisServer, ...]:
        """Every process of the group, in the order they start: the servers, and in kinds of
        group whatever else runs beside them (sentinels)."""
        return self._servers

    @property
    def urls(self) -> list[str]:
        """The URL of every server, in the order of :attr:`servers`."""
        return [server.url for server in self._servers]

    def start(self: _GroupT) -> _GroupT:
        """Start every process that is not running, then :meth:`settle`; return ``self``.

        If anything fails, every process is stopped before the error propagates.
        """
        try:
            for process in self.processes:
                if not process.is_running:
                    process.start()
            self.settle()
        except BaseException:
            with contextlib.suppress(BaseException):
                self.stop_all()
            raise
        return self

    def settle(self) -> None:
        """What :meth:`start` does once every process runs: nothing here; a cluster joins its
        nodes, sentinels wait until they know each other."""

    def stop_all(self, timeout: float = 10.0) -> None:
        """Stop every process, paused ones included, and wait until every one is gone.

        All are asked to shut down at once (SIGTERM), then waited for, at most ``timeout``
        seconds in all; whatever is left is killed.
        """
        stop_processes(self.processes, timeout)

    def close(self) -> None:
        """Stop every process (:meth:`stop_all`), as leaving a ``with`` block does."""
        self.stop_all()

    def __getitem__(self, index: int) -> RedisServer:
        """The server at ``index``."""
        return self._servers[index]

    def __len__(self) -> int:
        """The number of servers."""
        return len(self._servers)

    def __iter__(self) -> Iterator[RedisServer]:
        """Iterate over the servers."""
        return iter(self._servers)

    def __enter__(self: _GroupT) -> _GroupT:
        """Start the group and return it."""
        return self.start()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {list(self._servers)!r}>"


class RedisNodes(ServerGroup):
    """Several independent Redis masters, the setup Redlock runs on.

    This is not Redis Cluster mode: every node is a separate :class:`RedisServer` that knows
    nothing about the others.

    Args:
        count: how many servers; Redlock wants an odd number, typically 3 or 5.
        extra_args: ``redis-server`` arguments given to every node (see :class:`RedisServer`).
        password: a password every node requires; each URL carries it.
        executable: the server binary; by default :func:`find_redis_server` (give
            :func:`find_valkey_server`'s for Valkey nodes).
    """

    def __init__(
        self,
        count: int = 3,
        *,
        extra_args: Sequence[str] = (),
        password: str | None = None,
        executable: str | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        super().__init__(
            [
                RedisServer(extra_args=extra_args, password=password, executable=executable)
                for _ in range(count)
            ]
        )
