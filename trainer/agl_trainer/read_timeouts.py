"""Header and body read timeouts for ``agl serve``: a slow client cannot hold a connection open.

uvicorn bounds only the idle time between two requests (``timeout_keep_alive``).
A client that sends half a request head, or a body a byte at a time, keeps its
connection (a socket, a file descriptor, memory) as long as it likes: 400 such
connections stayed open for 90 s and more. :func:`protocol` is uvicorn's own
httptools protocol with one timer more: a request's head (request line and
headers) must arrive within ``header_timeout_s`` of its first byte (or of the
connection opening), its body within ``body_timeout_s`` of its head. A request
that times out and has no answer yet gets ``408`` with a JSON error, and the
connection is closed; the route still reading its body sees the client gone.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from agl_trainer.api import error_body

__all__ = ["protocol"]


def _timeout_response(part: str, seconds: float) -> bytes:
    body = json.dumps(error_body(408, f"the request's {part} did not arrive within {seconds:g} s", part)).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def protocol(header_timeout_s: float, body_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, closing connections whose requests come slower than these timeouts."""
    for name, value in (("header_timeout_s", header_timeout_s), ("body_timeout_s", body_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    class ReadTimeoutProtocol(HttpToolsProtocol):
        _read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm("head", header_timeout_s)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm("head", header_timeout_s)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm("body", body_timeout_s)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, part: str, seconds: float) -> None:
            self._disarm()
            self._read_timer = self.loop.call_later(seconds, self._too_slow, part, seconds)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _too_slow(self, part: str, seconds: float) -> None:
            self._read_timer = None
            if self.transport is None or self.transport.is_closing():
                return
            cycle = self.cycle
            # a head that is late has no answer yet; a late body's request may have one on its way
            if part == "head" or cycle is None or not cycle.response_started:
                self.transport.write(_timeout_response(part, seconds))
            if part == "body" and cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the route's own answer, if it comes, goes nowhere
                cycle.message_event.set()
            self.transport.close()

    return ReadTimeoutProtocol
