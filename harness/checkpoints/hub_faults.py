"""A fault-injecting HTTP proxy in front of the hub stand-in (hub_standin.py): the hub's bad days as a test.

The stand-in always answers, and answers well; the real hub sometimes does not: a 500 or 503 from a busy
front end, a connection dropped halfway through a large file, a response that never comes. Whether the
project (and huggingface_hub beneath it) retries, resumes, or fails with a message a user can act on is only
known by making those things happen. `FaultProxy` forwards every request to an upstream endpoint unchanged,
except the ones a fault matches, and records each request it saw, so a test can assert how many tries a
client made:

    with HubStandin(root) as hub, FaultProxy(hub.endpoint, [Status(path="model.safetensors", status=503)]) as proxy:
        ... HF_ENDPOINT=proxy.endpoint ...
        assert [s.status for s in proxy.seen] == [503, 200, 200]

Standard library only (http.server to listen, http.client to forward); nothing runs at import.
"""

from __future__ import annotations

import http.client
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from blockgen.harness.checkpoints.hub_standin import LoopbackServer

_CHUNK = 1 << 16
# Hop-by-hop headers belong to one connection, not to the request or answer forwarded over another.
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "host"}


@dataclass(frozen=True, kw_only=True)
class Fault:
    """Matches requests whose path contains `path` (and whose method is `method`, if given); affects the first
    `count` of them, later ones pass through."""

    path: str
    method: str | None = None
    count: int = 1

    def matches(self, method: str, path: str) -> bool:
        return self.path in path and self.method in (None, method)


@dataclass(frozen=True, kw_only=True)
class Status(Fault):
    """Answer this HTTP status (500, 503, 429...) without forwarding the request."""

    status: int = 503


@dataclass(frozen=True, kw_only=True)
class Drop(Fault):
    """Forward, send the answer's headers and the first `after_bytes` bytes of its body, then close the connection."""

    after_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class Stall(Fault):
    """Send nothing (with `headers_first`, the upstream's headers and no body) for `seconds`, then close the connection."""

    seconds: float = 30.0
    headers_first: bool = False


@dataclass(frozen=True, kw_only=True)
class Down(Fault):
    """The hub goes down at this request: it and every later one (on connections already open too) end without an
    answer, and the port stops accepting, as when the server is stopped in the middle of a run."""


@dataclass(frozen=True)
class Seen:
    """One request: `status` is what the client was sent (None: nothing), `fault` the one applied (None: passed through)."""

    method: str
    path: str
    status: int | None
    fault: Fault | None
    range: str | None = None  # the request's Range header: a resumed download asks for the rest of the file


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the hub: a dropped connection is then a surprise to the client
    proxy: "FaultProxy"

    def log_message(self, format, *args):  # noqa: A002 - the base class's name; `FaultProxy.seen` is the log
        pass

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:  # the client, or `stop`, closed the connection between requests
            pass

    def setup(self) -> None:
        super().setup()
        self.proxy._connections.add(self.connection)

    def finish(self) -> None:
        self.proxy._connections.discard(self.connection)
        super().finish()

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None  # read even when a fault answers, so keep-alive stays in step
        fault = self.proxy._take(self.command, self.path)
        self._status: int | None = None  # set once a status line is sent
        try:
            if isinstance(fault, Down):
                self.proxy._go_down()
            if self.proxy._down.is_set():
                self.close_connection = True
                return
            if isinstance(fault, Status):
                self._status = fault.status
                data = b'{"error": "injected by FaultProxy"}'
                self.send_response(fault.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                return
            if isinstance(fault, Stall) and not fault.headers_first:
                self.proxy._stopping.wait(fault.seconds)
                self.close_connection = True
                return
            self._relay(body, fault)
        except OSError:  # the client went away (or the upstream did): nothing more to send on this connection
            self.close_connection = True
        finally:
            self.proxy._record(Seen(self.command, self.path, self._status, fault, self.headers.get("Range")))

    def _relay(self, body: bytes | None, fault: Fault | None) -> None:
        """Forward to the upstream and stream its answer back, cut short as `fault` says."""
        upstream = http.client.HTTPConnection(self.proxy._upstream.hostname, self.proxy._upstream.port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            upstream.request(self.command, self.path, body=body, headers=headers)
            answer = upstream.getresponse()
            self.send_response(answer.status, answer.reason)
            self._status = answer.status
            for key, value in answer.getheaders():
                if key.lower() not in _HOP:
                    self.send_header(key, value)
            if answer.getheader("Content-Length") is None:
                self.close_connection = True  # the end of the body is then the end of the connection
            self.end_headers()
            if isinstance(fault, Stall):
                self.proxy._stopping.wait(fault.seconds)
                self.close_connection = True
                answer.read()  # drained, so that the upstream is not reset mid-answer
                return
            left = fault.after_bytes if isinstance(fault, Drop) else None
            while left is None or left > 0:
                chunk = answer.read(_CHUNK if left is None else min(_CHUNK, left))
                if not chunk:
                    break
                self.wfile.write(chunk)
                left = None if left is None else left - len(chunk)
            if isinstance(fault, Drop):
                self.wfile.flush()
                self.close_connection = True  # the client sees the end of the connection before the end of the body
                answer.read()
        finally:
            upstream.close()

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _forward


class FaultProxy(LoopbackServer):
    """The proxy on 127.0.0.1 in a background thread: `with FaultProxy(upstream, faults) as proxy: ... proxy.endpoint`."""

    def __init__(self, upstream: str, faults: list[Fault] | tuple[Fault, ...] = (), port: int = 0,
                 host: str = "127.0.0.1") -> None:
        self._upstream = urlsplit(upstream)
        self._faults = list(faults)
        self._left = [f.count for f in self._faults]
        self._seen: list[Seen] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._down = threading.Event()
        self._connections: set[socket.socket] = set()
        # daemon_threads off and block_on_close: `stop` joins every connection's thread
        super().__init__(type("Handler", (_Handler,), {"proxy": self}), port, host, daemon_threads=False)
        self._server.block_on_close = True

    @property
    def seen(self) -> list[Seen]:
        """Every request so far, in the order their answers ended."""
        with self._lock:
            return list(self._seen)

    def requests(self, path: str, method: str | None = None) -> list[Seen]:
        """The requests whose path contains `path` (and of `method`, if given)."""
        return [s for s in self.seen if path in s.path and method in (None, s.method)]

    def _take(self, method: str, path: str) -> Fault | None:
        """The first fault matching this request with uses left (one use spent), else None."""
        with self._lock:
            for i, fault in enumerate(self._faults):
                if self._left[i] > 0 and fault.matches(method, path):
                    self._left[i] -= 1
                    return fault
        return None

    def _go_down(self) -> None:
        """Stop accepting (from another thread: `shutdown` waits for the serving loop); open connections are refused
        request by request (`_forward`)."""
        if not self._down.is_set():
            self._down.set()
            threading.Thread(target=self._close_listener, daemon=True).start()

    def _close_listener(self) -> None:
        self._halt()
        self._server.socket.close()

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self._seen.append(seen)

    def stop(self) -> None:
        """Stop answering, end stalls and open connections, join every thread and free the port."""
        self._stopping.set()
        self._halt()
        for conn in list(self._connections):  # idle keep-alive connections would otherwise hold their threads
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._server.server_close()
