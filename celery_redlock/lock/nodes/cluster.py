"""A Redis Cluster (or Valkey cluster) as one member of the quorum (`ClusterNode`).

Every key of one lock carries the lock's hash tag (`keyspace`), so they live in one hash slot and
one script can touch them together. A command goes to the master serving its key's slot, by the
slot map (``CLUSTER SLOTS``); a ``MOVED`` reply updates the map for that slot and sends the
command on, an ``ASK`` reply sends it once to the importing master after ``ASKING`` (a slot being
migrated). After a failure or a ``MOVED``, the whole map is read again in the background. Locks
spread over the shards: a cluster serves as many locks as its masters together.
"""

from __future__ import annotations

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from ...errors import RedlockError
from ...settings import redact_url
from .endpoint import Endpoint, KnownServers
from .locating import Locator, first_answer
from .members import LockNode, Redirect
from .resp import ErrorReply

SLOTS = REDIS_CLUSTER_HASH_SLOTS
NO_SLOT_MAP = "a CLUSTER SLOTS reply with no slots"


class ClusterNode(LockNode):
    """A Redis Cluster, reached through ``seeds`` (the servers its URL lists), as one member."""

    def __init__(self, url: str, seeds: list[Endpoint], wait_replicas: int = 0) -> None:
        self.name = redact_url(url)
        self.seeds = seeds
        self.wait_replicas = wait_replicas
        self.servers = KnownServers(seeds[0], seeds)
        self._slots: list[Endpoint | None] = [None] * SLOTS
        self.locator = Locator(self.name, self._read_slot_map, seeds[0].timeout)

    def endpoint_for(self, key: str) -> Endpoint | None:
        if not self.locator.ensure():
            return None
        return self._slots[key_slot(key.encode())]

    def endpoints(self) -> list[Endpoint]:
        self.locator.ensure(wait_for_the_look=True)
        return list(dict.fromkeys(endpoint for endpoint in self._slots if endpoint is not None))

    def redirect(self, reply: ErrorReply, endpoint: Endpoint) -> Redirect | None:
        if reply.code not in ("MOVED", "ASK"):
            return None
        parts = reply.text.split()
        if len(parts) != 3 or not parts[1].isdigit():
            return None
        host, _, port = parts[2].rpartition(":")
        if not port.isdigit():
            return None
        target = self.servers.at(host or (endpoint.address or ("", 0))[0], int(port))
        if reply.code == "ASK":
            return Redirect(target, asking=True)
        slot = int(parts[1])
        if 0 <= slot < SLOTS:
            self._slots[slot] = target
        self.locator.relocate()  # a failover or a resharding: other slots moved too
        return Redirect(target)

    def notice(self, reply: ErrorReply, endpoint: Endpoint) -> None:
        codes = ("MOVED", "CLUSTERDOWN", "READONLY", "TRYAGAIN")
        if reply.code in codes or any(code in reply.text for code in codes[1:]):
            self.locator.relocate()

    def locating_error(self) -> str:
        return f"cannot read its slot map ({self.locator.last_error or 'not read yet'})"

    def notice_failure(self, endpoint: Endpoint) -> None:
        self.locator.relocate()  # a master that fails may have been replaced by its replica

    def _read_slot_map(self) -> None:
        """Read ``CLUSTER SLOTS`` from the first to answer of the seeds and known masters."""
        candidates = list(dict.fromkeys([*self.seeds, *self.servers.all()]))
        self._slots = first_answer(candidates, self._slot_map_of)

    def _slot_map_of(self, server: Endpoint) -> list[Endpoint | None]:
        """The slot map ``server``'s ``CLUSTER SLOTS`` reply describes."""
        with server.client() as client:
            ranges = client.execute_command("CLUSTER SLOTS")
        if not isinstance(ranges, list) or not ranges:
            raise RedlockError(NO_SLOT_MAP)
        slots: list[Endpoint | None] = [None] * SLOTS
        for entry in ranges:
            try:
                start, end, master = int(entry[0]), int(entry[1]), entry[2]
                host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                port = int(master[1])
            except (TypeError, ValueError, IndexError, AttributeError):
                raise RedlockError(NO_SLOT_MAP) from None
            if not (0 <= start <= end < SLOTS):
                raise RedlockError(NO_SLOT_MAP)
            # An empty host means "the server you asked" (cluster-announce-hostname unset).
            endpoint = self.servers.at(host or (server.address or ("", 0))[0], port)
            slots[start : end + 1] = [endpoint] * (end - start + 1)
        return slots
