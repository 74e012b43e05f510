"""Commands nobody waits for (`Unattended`): a release at the end of a task run, the clean-up of an
attempt that failed. They go to every member at once like a round, but the caller returns as
soon as they are queued; their replies are read by whichever thread reads next, and checked then:
an error reply, or one the script cannot give, backs the server off (and is logged), and a key
that moved (MOVED, ASK) is followed to its new server. A server that is backed off, or gives no
reply, is owed the call (`Endpoint.owe`): it gets it once it answers again."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ..scripts import Script
from .channel import Slot, hung_after
from .endpoint import Endpoint
from .members import LockNode
from .resp import ErrorReply, pack_command
from .round import FOLLOW_UPS_PER_MEMBER, Judge, Members

ASKING = pack_command("ASKING")


class Unattended:
    """One script call sent to every member without waiting (see the module docstring)."""

    __slots__ = (
        "arguments",
        "connections",
        "head",
        "judge",
        "keys",
        "node_timeout",
        "nodes",
        "owed_until",
        "packed",
        "script",
    )

    def __init__(
        self,
        members: Members,
        script: Script,
        judge: Judge,
        keys: Sequence[str],
        arguments: Sequence[str | int],
        owed_until: float,
    ) -> None:
        """The call goes as EVAL with the script's source (not the SHA: nobody would read a
        NOSCRIPT in time to send it again). ``owed_until``: the monotonic time until which what
        the call removes may live (0: nothing is owed)."""
        self.nodes = members.nodes
        self.node_timeout = members.node_timeout
        self.connections = members.connections
        self.script = script
        self.judge = judge
        self.keys = keys
        self.arguments = arguments
        self.head = members.script_head(script, True)
        self.packed = self._packed(keys)
        self.owed_until = owed_until

    def _packed(self, keys: Sequence[str]) -> bytes:
        return pack_command(len(keys), *keys, *self.arguments, head=self.head, head_count=2)

    def send(self) -> None:
        """Send the call to every member that is not backed off, and owe it to those that are
        (routed by the first key)."""
        key = self.keys[0]
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
        slots = [Slot(self, (node, endpoint, follow, packed))]
        if asking:  # ASKING's own reply comes first, and is of no interest
            slots.insert(0, Slot(None, "asking"))
        channel = self.connections.channel(endpoint)
        failed = channel.send(packed, slots, late_after=hung_after(self.node_timeout))
        if failed:
            self.connections.reactor.deliver(failed)

    def deliver(self, slot: Slot) -> Callable[[], object] | None:
        """Check one reply (the reactor's lock is held); a redirection is followed afterwards."""
        node, endpoint, follow, sent = slot.tag
        reply = slot.reply
        if slot.failure:
            node.notice_failure(endpoint)
            self._owe(endpoint)
            return None
        if isinstance(reply, ErrorReply):
            node.notice(reply, endpoint)
            redirect = node.redirect(reply, endpoint)
            if redirect is not None and follow > 0:
                commands = [sent.removeprefix(ASKING)]
                if redirect.asking:
                    commands.insert(0, ASKING)
                packed, target, asking = b"".join(commands), redirect.endpoint, redirect.asking
                return lambda: self._send_to(node, target, packed, follow - 1, asking)
            alone = self.script.alone and len(self.keys) > 1
            alone = alone and sent.removeprefix(ASKING) == self.packed
            if reply.code == "TRYAGAIN" and alone and follow > 0:
                # A half-migrated slot: the lock key alone, wherever it lives now (`Round`).
                home = node.endpoint_for(self.keys[0])
                if home is not None:
                    packed = self._packed(self.keys[:1])
                    return lambda: self._send_to(node, home, packed, follow - 1)
            if reply.code not in ("MOVED", "ASK", "TRYAGAIN"):
                endpoint.mark_down(time.monotonic(), f"error reply: {reply}")
                self._owe(endpoint)
            return None
        if self.judge(reply) is None:
            why = f"a reply the {self.script.name} script cannot give: {reply!r:.80}"
            endpoint.mark_down(time.monotonic(), why)
        return None
