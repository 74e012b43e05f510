"""Commands nobody waits for (`Unattended`): a release at the end of a task run, the clean-up of an
attempt that failed. They go to every member at once like a round, but the caller returns as
soon as they are queued; their replies are read by whichever thread reads next, and checked then:
an error reply, or one the script cannot give, backs the server off (and is logged), and a key
that moved (MOVED, ASK) is followed to its new server. A server that is backed off, or gives no
reply, is owed the call (`Endpoint.owe`): it gets it once it answers again."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..scripts import Script
from .channel import Slot, hung_after
from .endpoint import Endpoint
from .members import LockNode
from .resp import ErrorReply, pack_command
from .round import FOLLOW_UPS_PER_MEMBER, Judge, Members


class Unattended:
    """One script call sent to every member without waiting (see the module docstring)."""

    __slots__ = ("connections", "judge", "node_timeout", "nodes", "owed_until", "packed", "script")

    def __init__(
        self, members: Members, script: Script, judge: Judge, packed: bytes, owed_until: float
    ) -> None:
        """``packed``: the whole command, EVAL and the script's source (not the SHA: nobody
        would read a NOSCRIPT in time to send it again). ``owed_until``: the monotonic time
        until which what the call removes may live (0: nothing is owed)."""
        self.nodes = members.nodes
        self.node_timeout = members.node_timeout
        self.connections = members.connections
        self.script = script
        self.judge = judge
        self.packed = packed
        self.owed_until = owed_until

    def send(self, key: str) -> None:
        """Send the call to every member that is not backed off, and owe it to those that are
        (routed by ``key``)."""
        now = time.monotonic()
        for node in self.nodes:
            endpoint = node.endpoint_for(key)
            if endpoint is None:
                continue
            if endpoint.is_backed_off(now):
                self._owe(endpoint)
            else:
                self._send_to(node, endpoint, self.packed, FOLLOW_UPS_PER_MEMBER)

    def _owe(self, endpoint: Endpoint) -> None:
        if self.owed_until:
            endpoint.owe(self.packed, self.owed_until)

    def _send_to(
        self,
        node: LockNode,
        endpoint: Endpoint,
        packed: bytes,
        follow: int,
        asking: bool = False,
    ) -> None:
        slots = [Slot(self, (node, endpoint, follow))]
        if asking:  # ASKING's own reply comes first, and is of no interest
            slots.insert(0, Slot(None, "asking"))
        channel = self.connections.channel(endpoint)
        failed = channel.send(packed, slots, late_after=hung_after(self.node_timeout))
        if failed:
            self.connections.reactor.deliver(failed)

    def deliver(self, slot: Slot) -> Callable[[], object] | None:
        """Check one reply (the reactor's lock is held); a redirection is followed afterwards."""
        node, endpoint, follow = slot.tag
        reply = slot.reply
        if slot.failure:
            node.notice_failure(endpoint)
            self._owe(endpoint)
            return None
        if isinstance(reply, ErrorReply):
            node.notice(reply, endpoint)
            redirect = node.redirect(reply, endpoint)
            if redirect is not None and follow > 0:
                commands = [self.packed]
                if redirect.asking:
                    commands.insert(0, pack_command("ASKING"))
                packed, target, asking = b"".join(commands), redirect.endpoint, redirect.asking
                return lambda: self._send_to(node, target, packed, follow - 1, asking)
            if reply.code not in ("MOVED", "ASK", "TRYAGAIN"):
                endpoint.mark_down(time.monotonic(), f"error reply: {reply}")
                self._owe(endpoint)
            return None
        if self.judge(reply) is None:
            why = f"a reply the {self.script.name} script cannot give: {reply!r:.80}"
            endpoint.mark_down(time.monotonic(), why)
        return None
