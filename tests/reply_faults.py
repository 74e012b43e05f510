"""Faults between a shared connection and its server, injected where replies could reach the wrong
caller: a socket whose next write is held at a gate (`GatedSocket`), one that reads late
(`LateReadingSocket`), and a TCP proxy on loopback that cuts connections at random as replies
pass, or hands the replies over late (`FaultyProxy`).
The servers stay real."""

from __future__ import annotations

import contextlib
import queue
import random
import socket
import threading
import time
from typing import Any

GATE_TIMEOUT = 10.0
"""Seconds a held write waits for its gate at most: a test that fails never hangs."""


class NoisySocket:
    """Stands in for a channel's socket; every ``sendall`` pauses a random moment before its
    bytes go out (up to ``before`` seconds) and after (up to ``after``): the thread switches and
    descheduled threads of a busy host, at the points where they matter to a writer."""

    def __init__(self, real: Any, before: float, after: float) -> None:
        self.real = real
        self.before = before
        self.after = after

    def sendall(self, data: bytes) -> None:
        time.sleep(random.uniform(0, self.before))
        self.real.sendall(data)
        time.sleep(random.uniform(0, self.after))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class LateReadingSocket:
    """Stands in for a channel's socket; every ``recv`` first waits ``late`` seconds: the reader
    of a busy host, which gets the CPU only after several replies arrived and reads them in one
    go."""

    def __init__(self, real: Any, late: float) -> None:
        self.real = real
        self.late = late

    def recv(self, size: int, flags: int = 0) -> bytes:
        if not flags:  # a peek checks the connection: no reader waits for it
            time.sleep(self.late)
        data: bytes = self.real.recv(size, flags)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class FaultyProxy:
    """Listens on a free loopback port and forwards every connection to ``target``. Each chunk
    of bytes from the server reaches the client ``delay`` seconds after it arrived (a server
    that answers every command, only late: a busy host) or is, with probability ``cut_chance``,
    dropped instead, and the connection cut on both sides (what a reset or a failing link does
    mid-reply). A context manager; `cuts` counts the cuts."""

    def __init__(
        self, target: tuple[str, int], cut_chance: float = 0.0, seed: int = 0, delay: float = 0.0
    ) -> None:
        self.target = target
        self.cut_chance = cut_chance
        self.delay = delay
        self.cuts = 0
        self._random = random.Random(seed)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._guard = threading.Lock()
        self._open: set[socket.socket] = set()

    @property
    def url(self) -> str:
        """The ``redis://`` URL of the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> FaultyProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._guard:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._carry, args=(client,), daemon=True).start()

    def _carry(self, client: socket.socket) -> None:
        """Both directions of one connection; its sockets are closed only once neither
        direction uses them (a descriptor closed under a thread could be reused by the next
        connection, which would then get a stale connection's bytes)."""
        try:
            server = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        pair = (client, server)
        with self._guard:
            self._open.update(pair)
        upstream = threading.Thread(target=self._forward, args=(client, server, pair, False))
        upstream.start()
        self._forward(server, client, pair, True)
        upstream.join()
        with self._guard:
            self._open.difference_update(pair)
        for sock in pair:
            sock.close()

    def _forward(
        self,
        source: socket.socket,
        sink: socket.socket,
        pair: tuple[socket.socket, socket.socket],
        replies: bool,
    ) -> None:
        late: queue.Queue[tuple[float, bytes]] | None = None
        if replies and self.delay:
            late = queue.Queue()
            sender = threading.Thread(target=self._hand_over_late, args=(late, sink))
            sender.start()
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if replies and self._random.random() < self.cut_chance:
                    with self._guard:
                        self.cuts += 1
                    break
                if late is not None:
                    late.put((time.monotonic() + self.delay, data))
                else:
                    sink.sendall(data)
        if late is not None:
            late.put((0.0, b""))
            sender.join()
        for sock in pair:  # one direction ends: so does the other
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _hand_over_late(self, late: queue.Queue[tuple[float, bytes]], sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                due, data = late.get()
                if not data:
                    return
                time.sleep(max(0.0, due - time.monotonic()))
                sink.sendall(data)
