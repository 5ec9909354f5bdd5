"""The gateway's HTTP/1.1 client to the model server: keep-alive connections on asyncio streams.

On the gateway's path the HTTP client to the backend is most of what the
gateway adds to a call, and the general-purpose async clients cost more than
the target of a millisecond allows (measured here: httpx about 3 ms a call,
aiohttp 0.5 ms, this one a few tens of microseconds, see
``bench/gateway_latency.py``). It does only what talking to one OpenAI-compatible
server needs: JSON requests written in one piece, responses framed by
``Content-Length`` or chunked (how uvicorn-based servers such as vLLM stream
SSE), keep-alive with a pool of idle connections, one fresh retry when a
reused connection turns out to have been closed by the server, and timeouts.
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass

__all__ = ["Upstream", "UpstreamClosed", "UpstreamResponse"]

_MAX_HEAD = 64 * 1024
_LIMIT = 64 * 1024 * 1024  # longest line or chunk-size line a response may hold


class UpstreamClosed(ConnectionError):
    """The server closed the connection before a whole response came."""


@dataclass
class UpstreamResponse:
    status: int
    headers: dict[str, str]
    chunked: bool
    length: int | None
    keep_alive: bool


class _Conn:
    __slots__ = ("reader", "writer", "used")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.used = False

    def close(self) -> None:
        self.writer.close()


class Upstream:
    """Requests to the server at ``base_url``, on up to ``max_idle`` kept-alive connections."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, *, timeout_s: float = 600.0,
                 connect_timeout_s: float = 10.0, max_idle: int = 512) -> None:
        parts = urllib.parse.urlsplit(base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the backend URL must be http(s)://host:port/..., got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        netloc = parts.netloc.rsplit("@", 1)[-1]
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {netloc}\r\nContent-Type: application/json\r\nAccept: */*\r\n{extra}"
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: deque[_Conn] = deque()

    async def _connect(self) -> _Conn:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=_LIMIT), self.connect_timeout_s)
        return _Conn(reader, writer)

    def _take_idle(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.writer.is_closing() and not conn.reader.at_eof():
                return conn
            conn.close()
        return None

    def _give_back(self, conn: _Conn, response: UpstreamResponse) -> None:
        if response.keep_alive and len(self._idle) < self.max_idle and not conn.writer.is_closing():
            self._idle.append(conn)
        else:
            conn.close()

    async def open(self, method: str, path: str, body: bytes | None = None
                   ) -> tuple[UpstreamResponse, AsyncGenerator[bytes, None]]:
        """Send a request; return the response head and an iterator over its body's pieces.

        The body must be read to its end (or the iterator closed) before the connection is reused.
        """
        payload = body or b""
        request = (f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._head}Content-Length: {len(payload)}\r\n\r\n"
                   ).encode() + payload
        for fresh in (False, True):
            conn = None if fresh else self._take_idle()
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            try:
                conn.writer.write(request)
                response = await asyncio.wait_for(self._read_head(conn.reader), self.timeout_s)
            except (UpstreamClosed, ConnectionError) as exc:
                conn.close()
                if reused and not isinstance(exc, TimeoutError):
                    continue  # the server had closed this idle connection: once more on a new one
                raise
            except BaseException:
                conn.close()
                raise
            return response, self._body(conn, response)
        raise AssertionError("unreachable")  # pragma: no cover

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """One whole call: its status and body."""
        response, pieces = await self.open(method, path, body)
        data = bytearray()
        async for piece in pieces:
            data += piece
        return response.status, bytes(data)

    async def _read_head(self, reader: asyncio.StreamReader) -> UpstreamResponse:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            raise UpstreamClosed("the model server closed the connection without answering") from exc
        except asyncio.LimitOverrunError as exc:
            raise UpstreamClosed("the model server's response head is too long") from exc
        if len(head) > _MAX_HEAD:
            raise UpstreamClosed("the model server's response head is too long")
        lines = head[:-4].decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        try:
            status = int(rest[:3])
        except ValueError:
            raise UpstreamClosed(f"the model server's status line is not HTTP: {lines[0][:80]!r}") from None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = None if chunked or "content-length" not in headers else int(headers["content-length"])
        connection = headers.get("connection", "").lower()
        keep_alive = (version == "HTTP/1.1" and connection != "close") or connection == "keep-alive"
        if not chunked and length is None:
            keep_alive = False  # the body runs to the end of the connection
        return UpstreamResponse(status, headers, chunked, length, keep_alive)

    async def _body(self, conn: _Conn, response: UpstreamResponse) -> AsyncGenerator[bytes, None]:
        reader = conn.reader
        finished = False
        try:
            if response.length is not None:
                if response.length:
                    yield await asyncio.wait_for(reader.readexactly(response.length), self.timeout_s)
            elif response.chunked:
                while True:
                    size_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), self.timeout_s)
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                    if size == 0:
                        while (await reader.readuntil(b"\r\n")) != b"\r\n":
                            pass  # trailers
                        break
                    data = await asyncio.wait_for(reader.readexactly(size + 2), self.timeout_s)
                    yield data[:-2]
            else:
                while True:
                    data = await asyncio.wait_for(reader.read(65536), self.timeout_s)
                    if not data:
                        break
                    yield data
            finished = True
        except asyncio.IncompleteReadError as exc:
            raise UpstreamClosed("the model server closed the connection mid-response") from exc
        finally:
            if finished:
                self._give_back(conn, response)
            else:
                conn.close()  # cancelled or failed mid-body: the connection's state is unknown

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()
