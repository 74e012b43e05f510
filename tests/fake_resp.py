"""Fake Redis servers that misbehave: they speak RESP but answer what their ``reply`` says.

A lock node is untrusted input. These servers stand for a broken proxy, a wrong server behind a
load balancer, or a hostile node: `FakeRedisServer(reply)` answers every command with the RESP
bytes ``reply(command)`` returns (the command is a list of ``bytes`` arguments, upper-cased name
first). Real locking behaviour is never tested against them; they only prove that garbage
replies are not trusted.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Callable, Sequence
from types import TracebackType

Reply = Callable[[list[bytes]], bytes]


def always(raw: bytes) -> Reply:
    """A reply function answering every command with ``raw`` (RESP bytes), except the
    connection handshake (``AUTH``, ``SELECT``, ``CLIENT``, ``HELLO``), which gets ``+OK``."""

    def reply(command: list[bytes]) -> bytes:
        if command and command[0] in (b"AUTH", b"SELECT", b"CLIENT", b"HELLO"):
            return b"+OK\r\n"
        return raw

    return reply


def _read_line(stream: socketserver.StreamRequestHandler) -> bytes:
    line = stream.rfile.readline()
    if not line:
        raise EOFError
    return line.rstrip(b"\r\n")


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        try:
            while True:
                command = self._read_command()
                self.server.commands.append(command)
                self.wfile.write(self.server.reply(command))
                self.wfile.flush()
        except (EOFError, ConnectionError, OSError, ValueError):
            return

    def _read_command(self) -> list[bytes]:
        header = _read_line(self)
        if not header.startswith(b"*"):  # an inline command
            return [part for part in header.split() if part] or [b""]
        arguments = []
        for _ in range(int(header[1:])):
            length = int(_read_line(self)[1:])
            arguments.append(self.rfile.read(length + 2)[:-2])
        if arguments:
            arguments[0] = arguments[0].upper()
        return arguments


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, reply: Reply) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.reply = reply
        self.commands: list[list[bytes]] = []


class FakeRedisServer:
    """A TCP server on a free loopback port that answers RESP commands with ``reply``.

    Use it as a context manager, or `start` and `stop` it. ``commands`` lists every command
    received, in order.
    """

    def __init__(self, reply: Reply) -> None:
        self._server = _Server(reply)
        # A short poll interval: `stop` waits for the serving loop to notice the shutdown.
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.02},
            name="fake redis",
            daemon=True,
        )

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """A ``redis://`` URL of this server."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def commands(self) -> Sequence[list[bytes]]:
        """Every command received so far."""
        return list(self._server.commands)

    def start(self) -> FakeRedisServer:
        """Start serving in a background thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> FakeRedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def answers(url: str) -> bool:
    """True if something accepts connections at the ``redis://host:port`` of ``url``."""
    host, _, port = url.removeprefix("redis://").partition("/")[0].partition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False
