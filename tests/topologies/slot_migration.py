"""`SlotMigration`: one hash slot of a `RedisCluster` moving from one master to another, step by
step, so a test can act in the middle (and see ``ASK`` redirections)."""

from __future__ import annotations

from typing import Protocol

from celery_redlock.testing import RedisServer
from celery_redlock.testing.redis_servers import HOST

__all__ = ["ClusterControl", "SlotMigration"]

_MIGRATE_BATCH = 100
_MIGRATE_TIMEOUT_MS = 5000


class ClusterControl(Protocol):
    """What a migration asks of its cluster (a `RedisCluster`)."""

    def node_id(self, server: RedisServer) -> str:
        """The cluster node id of ``server``."""

    def masters(self) -> list[RedisServer]:
        """The masters serving slots now."""

    def wait_until_stable(self, timeout: float | None = None) -> None:
        """Wait until every node agrees on roles and slots."""


class SlotMigration:
    """One hash slot moving from one master to another, step by step, as ``redis-cli --cluster
    reshard`` does it: :meth:`begin` (made by `RedisCluster.begin_slot_migration`),
    :meth:`move_keys` (any number of times, some keys at a time), :meth:`finish`.

    Between the steps a test sees what clients see during a resharding: the source serves the
    keys it still has and answers ``ASK <slot> <destination>`` for the others; the destination
    serves the slot only to clients that sent ``ASKING`` (others get ``MOVED`` to the source).
    """

    def __init__(
        self, cluster: ClusterControl, slot: int, source: RedisServer, destination: RedisServer
    ) -> None:
        self.cluster = cluster
        """The cluster."""
        self.slot = slot
        """The slot that moves."""
        self.source = source
        """The master that served the slot."""
        self.destination = destination
        """The master that serves it once finished."""
        self._source_id = cluster.node_id(source)
        self._destination_id = cluster.node_id(destination)

    def begin(self) -> None:
        """``CLUSTER SETSLOT <slot> IMPORTING <source>`` on the destination, then ``MIGRATING
        <destination>`` on the source."""
        with self.destination.client(socket_timeout=5) as client:
            client.execute_command("CLUSTER", "SETSLOT", self.slot, "IMPORTING", self._source_id)
        with self.source.client(socket_timeout=5) as client:
            client.execute_command(
                "CLUSTER", "SETSLOT", self.slot, "MIGRATING", self._destination_id
            )

    def remaining_keys(self) -> int:
        """How many keys of the slot the source still has."""
        with self.source.client(socket_timeout=5) as client:
            return int(client.execute_command("CLUSTER", "COUNTKEYSINSLOT", self.slot))

    def move_keys(self, count: int | None = None) -> int:
        """``MIGRATE`` keys of the slot from the source to the destination: ``count`` of them,
        or every one (``None``); return how many moved."""
        moved = 0
        password = self.source.password
        authentication = [] if password is None else ["AUTH", password]
        with self.source.client(socket_timeout=10) as client:
            while count is None or moved < count:
                batch = _MIGRATE_BATCH if count is None else min(_MIGRATE_BATCH, count - moved)
                keys = client.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, batch)
                if not keys:
                    break
                client.execute_command(
                    "MIGRATE", HOST, self.destination.port, "", 0, _MIGRATE_TIMEOUT_MS,
                    *authentication, "KEYS", *keys,
                )  # fmt: skip
                moved += len(keys)
        return moved

    def finish(self, timeout: float | None = None) -> None:
        """``CLUSTER SETSLOT <slot> NODE <destination>`` on the destination, the source and
        every other master; then wait until the cluster is stable with the slot moved.

        Raises:
            RuntimeError: the source still has keys of the slot (move them first).
        """
        left = self.remaining_keys()
        if left:
            raise RuntimeError(f"slot {self.slot} still has {left} key(s) on the source")
        others = [m for m in self.cluster.masters() if m not in (self.source, self.destination)]
        for server in [self.destination, self.source, *others]:
            with server.client(socket_timeout=5) as client:
                client.execute_command(
                    "CLUSTER", "SETSLOT", self.slot, "NODE", self._destination_id
                )
        self.cluster.wait_until_stable(timeout)

    def __repr__(self) -> str:
        return (
            f"<SlotMigration slot {self.slot} {self.source.address} -> {self.destination.address}>"
        )
