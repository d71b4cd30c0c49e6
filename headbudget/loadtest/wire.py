"""A load generator's HTTP/1.1 at its leanest: prepared requests over keep-alive sockets, answers read by their
Content-Length. A client library's milliseconds a request would leave the server idle between requests, and an idle
server pays to wake (docs/decisions.md, 'A refusal's cost is measured as a flood sends it')."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Mapping
from typing import BinaryIO


def post(path: str, headers: Mapping[str, str], body: bytes) -> bytes:
    """The bytes of a POST of ``body`` (JSON) to ``path``."""
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (f"POST {path} HTTP/1.1\r\nHost: load\r\n{lines}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class Connection:
    """One keep-alive connection to ``port`` on the loopback."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader: BinaryIO = self.sock.makefile("rb")

    def send(self, request: bytes) -> tuple[int, bytes]:
        """(status, body) of one prepared request (``post``)."""
        self.write(request)
        return self.read()

    def write(self, request: bytes) -> None:
        """Send a prepared request without waiting for its answer (``read`` takes it)."""
        self.sock.sendall(request)

    def read(self) -> tuple[int, bytes]:
        """(status, body) of the next answer on this connection."""
        status_line = self.reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status, length = int(status_line.split(b" ", 2)[1]), 0
        while (line := self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, self.reader.read(length)

    def close(self) -> None:
        self.reader.close()
        self.sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def in_threads(user: Callable[[int], None], n: int) -> None:
    """``user(0)`` ... ``user(n - 1)``, each in a thread of its own, until all return; the first error any of them
    raised is raised here (a server gone must stop the measurement, not leave a thread's traceback behind)."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            user(i)
        except Exception as e:  # handed to the caller below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
