"""Connection limits of the HTTP server (docs/reliability.md), on uvicorn's h11 protocol: no client
holds a connection, or a share of the open-file limit, for long without sending a request.

- max_connections: a connection past this many open ones gets a 503 and is closed at once;
- header_read_timeout_s: a request's headers must be complete this long after its first byte arrived
  (for the first request of a connection: after the connection opened), else the connection is closed.
  Idle connections and slowloris clients (a header byte now and then) are closed that way;
- keep_alive_timeout_s (uvicorn's timeout_keep_alive): a connection idle this long after a response is
  closed.
A body's pace is bounded by the server's _Guard, which reads it with header_read_timeout_s between its
parts."""

from __future__ import annotations

import asyncio
import resource
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_HEADER_READ_TIMEOUT_S = 10.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0  # uvicorn's default
_FILES_PER_CONNECTION_SLACK = 256  # open files kept beyond max_connections (ranks' pipes, the model, logs)
_TOO_MANY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
             b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s")
_TOO_MANY_BODY = (b'{"error": {"message": "too many open connections: retry later", "type": '
                  b'"ServiceUnavailableError", "param": null, "code": 503}}')


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_read_timeout_s: float = DEFAULT_HEADER_READ_TIMEOUT_S
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections: expected >= 1, got {self.max_connections}")
        for name in ("header_read_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0 seconds, got {getattr(self, name)}")

    def protocol(self) -> type[H11Protocol]:
        """uvicorn's h11 protocol with these limits (uvicorn.Config(http=...))."""
        return type("LimitedH11Protocol", (_LimitedH11Protocol,), {"limits": self})


def raise_open_files_limit(limits: ConnectionLimits) -> None:
    """Lift this process's soft limit on open files toward the hard one, so that max_connections
    connections fit beside what the server keeps open anyway; ValueError when the hard limit is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = limits.max_connections + _FILES_PER_CONNECTION_SLACK
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ValueError(f"max_connections: {limits.max_connections} connections need {need} open files, but this "
                         f"process may open at most {hard} (ulimit -Hn): lower --max-connections or raise the limit")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


class _LimitedH11Protocol(H11Protocol):
    limits: ConnectionLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.limits.keep_alive_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None
        self._reading: Any = None  # the request cycle the header timer waits to be replaced

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            transport.write(_TOO_MANY % (len(_TOO_MANY_BODY), _TOO_MANY_BODY))
            transport.close()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if self._header_timer is None and idle:
            self._arm_header_timer()  # the first byte of a request on a kept-alive connection
        super().data_received(data)
        if self.cycle is not self._reading:  # a request's headers arrived
            self._disarm_header_timer()

    def _arm_header_timer(self) -> None:
        self._reading = self.cycle
        self._header_timer = self.loop.call_later(self.limits.header_read_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            if self.conn.our_state not in (h11.ERROR, h11.CLOSED):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()
