"""Servers started and stopped together: `ServerGroup`, and `RedisNodes` (Redlock's nodes)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TypeVar

from .processes import stop_processes
from .redis_servers import RedisServer
from .resources import ClosingResource

_GroupT = TypeVar("_GroupT", bound="ServerGroup")


class ServerGroup(ClosingResource):
    """Servers started by :meth:`start` (or a ``with`` block) and stopped by :meth:`stop_all`
    (or leaving it). Indexing, ``len()`` and iteration are over :attr:`servers`."""

    def __init__(self, servers: Sequence[RedisServer]) -> None:
        self._servers = tuple(servers)

    @property
    def servers(self) -> tuple[RedisServer, ...]:
        """The servers, in a fixed order."""
        return self._servers

    @property
    def processes(self) -> tuple[RedisServer, ...]:
        """Every process of the group, in start order (kinds of group add sentinels, say)."""
        return self._servers

    @property
    def urls(self) -> list[str]:
        """The URL of every server, in the order of :attr:`servers`."""
        return [server.url for server in self._servers]

    def start(self: _GroupT) -> _GroupT:
        """Start every process not running, then :meth:`settle`; return ``self``. On failure
        every process is stopped before the error propagates."""
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
        """What :meth:`start` does once every process runs (a cluster joins its nodes)."""

    def stop_all(self, timeout: float = 10.0) -> None:
        """Stop every process, paused ones included (`stop_processes`: SIGTERM, then SIGKILL
        for what is left after ``timeout`` seconds in all)."""
        stop_processes(self.processes, timeout)

    def close(self) -> None:
        """Stop every process (:meth:`stop_all`), as leaving a ``with`` block does."""
        self.stop_all()

    def __getitem__(self, index: int) -> RedisServer:
        return self._servers[index]

    def __len__(self) -> int:
        return len(self._servers)

    def __iter__(self) -> Iterator[RedisServer]:
        return iter(self._servers)

    def __enter__(self: _GroupT) -> _GroupT:
        return self.start()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {list(self._servers)!r}>"


class RedisNodes(ServerGroup):
    """``count`` independent Redis masters (not Redis Cluster), the setup Redlock runs on;
    ``extra_args``, ``password`` and ``executable`` go to each `RedisServer`."""

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
