"""A TCP proxy on loopback that hands a server's replies to the client ``delay`` seconds late:
a server that answers every command, only late (a busy host, a slow link)."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time


class DelayingProxy:
    """Listens on a free loopback port and forwards every connection to ``target``; bytes from
    the server reach the client ``delay`` seconds after they arrived. A context manager."""

    def __init__(self, target: tuple[str, int], delay: float) -> None:
        self.target = target
        self.delay = delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        """The ``redis://`` URL of the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> DelayingProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopped.set()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            late: queue.Queue[tuple[float, bytes]] = queue.Queue()
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            threading.Thread(target=self._receive, args=(server, late), daemon=True).start()
            threading.Thread(target=self._hand_late, args=(late, client), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _receive(self, source: socket.socket, late: queue.Queue[tuple[float, bytes]]) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                late.put((time.monotonic() + self.delay, data))
        late.put((0.0, b""))

    def _hand_late(self, late: queue.Queue[tuple[float, bytes]], sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                due, data = late.get()
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                time.sleep(max(0.0, due - time.monotonic()))
                sink.sendall(data)
