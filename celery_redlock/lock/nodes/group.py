"""The members of one `Redlock`'s quorum, and one round over all of them (`NodeGroup.run`).

A round's latency is that of the quorum-th fastest member, each bounded by ``node_timeout``
(`nodes.round`). A member that fails, is late, or answers with an error or a reply its script
cannot give is backed off: skipped without network traffic, and probed again from a background
thread (`nodes.endpoint`).
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Sequence

from ..scripts import Script
from .channel import Slot, patience
from .endpoint import Endpoint
from .forks import ProcessLock
from .members import LockNode
from .reactor import Reactor, Waiting
from .round import Judge, Members, Round, RoundResult, ScriptHeads, endpoint_of


class NodeGroup:
    """The members of one `Redlock`, with this process's connections to them (`Reactor`),
    opened lazily.

    Every thread of a process uses the same connection to a server, and a server answers the
    commands of one connection in the order they were sent, so a thread's release never
    overtakes its own acquisition's late SET. Connections are opened in the process that uses
    them: after a fork, the child leaves the parent's sockets alone and opens its own.
    """

    def __init__(self, nodes: Sequence[LockNode], node_timeout: float) -> None:
        self.nodes = list(nodes)
        self.node_timeout = node_timeout
        self.quorum = len(self.nodes) // 2 + 1
        self._replacing = ProcessLock()
        self._reactor = self._new_reactor()
        # Not a method of the group: rounds keep it, and a round still waiting in a connection
        # must not keep the group alive (its finalizer closes the connections).
        self.script_head = ScriptHeads()
        self._members = self._members_with(self._reactor)

    def _members_with(self, reactor: Reactor) -> Members:
        return Members(self.nodes, self.node_timeout, reactor, self.script_head)

    def _new_reactor(self) -> Reactor:
        reactor = Reactor(self.node_timeout)
        # Stopped when the group is dropped (its Redlock gone), not left to the garbage
        # collector; or by a forked child that replaces it: once, never again when the group is
        # dropped (the descriptor numbers of its sockets may belong to other files by then).
        self._dispose = weakref.finalize(self, reactor.dispose)
        return reactor

    def reactor(self) -> Reactor:
        """This process's reactor (a new one in a forked child, made by the first thread that
        asks while the others wait for it)."""
        reactor = self._reactor
        if reactor.pid == os.getpid():
            return reactor
        with self._replacing.held():
            reactor = self._reactor
            if reactor.pid != os.getpid():
                # A forked child: the parent's sockets are closed here (the parent keeps its
                # own), without any lock another thread may have held at the fork.
                self._dispose()
                reactor = self._new_reactor()
                # Members first: a thread that finds the new reactor finds its members too.
                self._members = self._members_with(reactor)
                self._reactor = reactor
        return reactor

    def close(self) -> None:
        """Close this process's connections to the servers and stop the members' background
        work; later rounds open and start them again."""
        for node in self.nodes:
            node.close()
        self._reactor.close()

    def run(
        self,
        script: Script,
        keys: Sequence[str],
        arguments: Sequence[str | int],
        judge: Judge,
        wait: bool = True,
        every: bool = False,
        grants: bool = False,
        owed_for: float = 0.0,
        spared: frozenset[int] = frozenset(),
    ) -> RoundResult:
        """Run ``script`` on every member at once; collect replies until the outcome is known.

        ``judge`` says what each reply means. The outcome is known when a quorum succeeded, when
        one no longer can, or when ``node_timeout`` has passed; with ``every=True`` only when
        every member answered or timed out. With ``wait=False`` the commands are only sent: the
        reactor thread reads their replies and checks them then. ``grants``: the script
        grants a lock, which members with ``wait_replicas`` confirm only once replicas
        acknowledged it. ``owed_for``: the script is a clean-up of keys that may live this many
        seconds, whose first argument is the value it removes; a member that is backed off or
        gives no reply gets it once it answers again (a stalled server runs what it was sent
        before when it resumes), but those ``spared`` (indexes): what it removes never reached
        them (`RoundResult.unsent` of the round that would have set it).
        """
        members = self._members
        if members.reactor.pid != os.getpid():  # a forked child's first round
            self.reactor()
            members = self._members
        owed_until = time.monotonic() + owed_for if owed_for > 0 else 0.0
        round_ = Round(
            members, script, keys, arguments, judge, every, grants, owed_until, wait, spared
        )
        if not wait:
            round_.start()
            return RoundResult([], 0, 0, time.monotonic(), [])
        try:
            round_.start()
            round_.collect()
        except BaseException:
            # Interrupted (a soft time limit, a signal) between sending and deciding: callers
            # release what the round may have taken; the connections keep their order.
            round_.finish()
            raise
        return round_.finish()

    def confirm(self, extension: bool = False) -> None:
        """Before a round that grants a lock (``extension``: extends one): every member makes
        sure that what it knows of its master is current (`LockNode.confirm`)."""
        for node in self.nodes:
            node.confirm(extension)

    def forgive(self, key: str, value: str) -> frozenset[int]:
        """Drop the clean-ups owed for ``value`` at ``key``, as a round is about to set it
        (`Endpoint.forgive`); returns the members that were owed one (they may hold it)."""
        encoded = value.encode()
        owed = []
        for index, node in enumerate(self.nodes):
            endpoint = endpoint_of(node, key)
            if endpoint is not None and endpoint.forgive(encoded):
                owed.append(index)
        return frozenset(owed)

    def listen_for_releases(self, channel: str) -> contextlib.closing[ReleaseListener]:
        """Subscriptions to ``channel`` (a lock key) on every member that is not backed off, for
        a ``with`` block."""
        return contextlib.closing(ReleaseListener(self, self.reactor(), channel))


class ReleaseListener(Waiting):
    """Subscriptions to a lock's release channel on every reachable member, for blocking
    waits."""

    def __init__(self, group: NodeGroup, reactor: Reactor, channel: str) -> None:
        super().__init__()
        self.reactor = reactor
        self.channel = channel
        self.notified = False
        self.endpoints: list[Endpoint] = []
        self._unconfirmed: set[Endpoint] = set()
        now = time.monotonic()
        lateness: list[float] = []
        for node in group.nodes:
            endpoint = node.endpoint_for(channel)
            if endpoint is None or endpoint.is_backed_off(now) or endpoint in self._unconfirmed:
                continue
            self.endpoints.append(endpoint)
            self._unconfirmed.add(endpoint)
            lateness.append(endpoint.lateness)
        for endpoint in self.endpoints:
            reactor.listen(endpoint, channel, self)
        # Subscribed only once the servers confirm: a release before that would go unheard.
        deadline = time.monotonic() + patience(group.node_timeout, lateness, len(lateness))
        while self._unconfirmed and not self.satisfied and time.monotonic() < deadline:
            reactor.wait(self, deadline)

    def deliver(self, slot: Slot) -> None:
        kind, endpoint = slot.tag
        if kind == "message":
            self.notified = True
            self.wakeup.wake()
        else:  # "subscribed", or "lost" (no notifications from that server)
            self._unconfirmed.discard(endpoint)
            if not self._unconfirmed:
                self.satisfy()

    def close(self) -> None:
        """Drop the subscriptions."""
        for endpoint in self.endpoints:
            self.reactor.stop_listening(endpoint, self.channel, self)
        self.endpoints.clear()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True as soon as any member announced a release — including
        one announced since the previous wait (an attempt in between must not miss it)."""
        if not self.endpoints:
            time.sleep(max(seconds, 0))
            return False
        deadline = time.monotonic() + max(seconds, 0)
        while True:
            with self.reactor.lock:
                if self.notified:
                    self.notified = False
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.wakeup.sleep(left)
