"""A Sentinel-managed master as one member of the quorum (`SentinelNode`).

The member is whichever server the sentinels name as the master of the service (``SENTINEL MASTER``:
one they see up, as redis-py's ``Sentinel.discover_master`` requires). They are asked on first use,
again in the background after the master fails or answers ``READONLY`` (demoted by a failover),
and at least every `REFRESH_SECONDS` while the member is used. Replication is asynchronous: a lock
granted by a master that fails before its replica got the write is lost with it, and a grant by a
replaced master that has not noticed yet is not seen by the new one, unless
``redlock_wait_replicas`` makes a grant count only once replicas acknowledged it.
"""

from __future__ import annotations

from ...errors import RedlockError
from ...settings import redact_url
from .endpoint import Endpoint, KnownServers
from .locating import Locator, first_answer
from .members import LockNode
from .resp import ErrorReply

REFRESH_SECONDS = 1.0
"""How old the master's address may get before the sentinels are asked again (in the background).
After a ``SENTINEL FAILOVER`` the old master keeps running, and answers writes as a master,
for some seconds until the sentinels turn it into a replica: nothing else tells the member, and a
member that kept granting locks there would disagree with every member that asked afresh."""


class SentinelNode(LockNode):
    """The master the ``sentinels`` name for ``service``, as one member of the quorum; ``master``
    holds its connection options (database, credentials, TLS), not its address."""

    def __init__(
        self,
        url: str,
        sentinels: list[Endpoint],
        service: str,
        master: Endpoint,
        wait_replicas: int = 0,
    ) -> None:
        self.name = redact_url(url)
        self.sentinels = sentinels
        self.service = service
        self.wait_replicas = wait_replicas
        self.servers = KnownServers(master)
        self._master: Endpoint | None = None
        self.locator = Locator(self.name, self._ask_sentinels, master.timeout)

    def endpoint_for(self, key: str) -> Endpoint | None:
        if self.locator.ensure():
            self.locator.refresh_if_older(REFRESH_SECONDS)
        return self._master

    def endpoints(self) -> list[Endpoint]:
        self.locator.ensure(wait_for_the_look=True)
        return [self._master] if self._master is not None else []

    def locating_error(self) -> str:
        return f"no sentinel named its master ({self.locator.last_error or 'not asked yet'})"

    def notice(self, reply: ErrorReply, endpoint: Endpoint) -> None:
        # Inside a script on Redis 6.2 every error reply is an "ERR ...": read the text too.
        if reply.code in ("READONLY", "LOADING", "MASTERDOWN") or "READONLY" in reply.text:
            self.locator.relocate()

    def notice_failure(self, endpoint: Endpoint) -> None:
        self.locator.relocate()

    def _ask_sentinels(self) -> None:
        self._master = first_answer(self.sentinels, self._master_named_by)

    def _master_named_by(self, sentinel: Endpoint) -> Endpoint:
        with sentinel.client() as client:
            state = client.sentinel_master(self.service)  # SENTINEL MASTER, parsed by redis-py
        host, port = master_address(state)
        return self.servers.at(host, port)


def master_address(state: object) -> tuple[str, int]:
    """The address of the master a sentinel's ``SENTINEL MASTER`` reply (parsed by redis-py)
    describes, with redis-py's checks (``Sentinel.check_master_state``): one the sentinel sees
    down or no longer as a master, or whose count of other sentinels is no count, is refused
    (`RedlockError`)."""
    if not isinstance(state, dict):
        raise RedlockError(f"gave a reply no sentinel gives to SENTINEL MASTER: {state!r:.60}")
    if not state.get("is_master") or state.get("is_sdown") or state.get("is_odown"):
        raise RedlockError(
            f"does not see {state.get('name')!r} up as a master ({state.get('flags')})"
        )
    others = state.get("num-other-sentinels")
    if not isinstance(others, int) or others < 0:  # redis-py's min_other_sentinels: 0
        raise RedlockError(f"sees {others!r} other sentinels")
    host, port = state.get("ip"), state.get("port")
    if not isinstance(host, str) or not host or not isinstance(port, int) or not 0 < port < 65536:
        raise RedlockError(f"names no valid master address: {host!r}:{port!r}")
    return host, port
