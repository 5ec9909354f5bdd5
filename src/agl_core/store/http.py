"""``HttpStore``: the :class:`~agl_core.store.base.Store` of an agl trainer server, over HTTP.

``agl.rollout(..., store=agl.HttpStore("http://127.0.0.1:8000", token))`` posts
each finished rollout, spans included, to the server (``agl serve``), which
joins the gateway's token records to its LLM spans, builds the transitions with
its own ``TransitionBuilder`` and stores both; the trajectory built on this
side is not sent, since the server's has the exact token ids. Reads
(``rollouts``, ``spans``, ``transitions``, ``trajectories``, ``export``) ask the
server and come back as the same records a ``SqliteStore`` gives; a listing comes
page by page (``limit`` and the ``after`` cursor), all of it followed here.

Only the standard library is used (``http.client``, one keep-alive connection
per thread), so ``import agl_core`` stays free of HTTP libraries. A call that
cannot reach the server, or finds it busy (503), is retried with backoff for
up to ``retry_s`` seconds; every call here is safe to repeat (a rollout is
stored under its id). The server's refusals come back as
:class:`~agl_core.errors.SchemaError` naming the field (400) or
:class:`ServerError` with the status and the server's message.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import threading
import time
import typing
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from agl_core.errors import AglError, SchemaError, StoreError
from agl_core.schema import Rollout, Span, Trajectory, Transition
from agl_core.store.base import EXPORT_FORMATS, EXPORT_WHATS

if TYPE_CHECKING:
    from agl_core.store.base import TrajectoryBuilder

LISTING_PAGE = 1000
"""Items asked for per page of the server's listings (the server's default page; its maximum is 10000)."""

__all__ = ["HttpStore", "ServerClient", "ServerError"]

_S = TypeVar("_S", bound="HttpStore")
_RETRY_STATUSES = frozenset({502, 503, 504})
_NETWORK_ERRORS = (ConnectionError, http.client.HTTPException, socket.timeout, TimeoutError, OSError)


class ServerError(StoreError):
    """The server refused a call: ``status`` is the HTTP status, ``param`` the field it named (if any)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"{message} (HTTP {status})")
        self.status = status
        self.message = message
        self.param = param


class ServerClient:
    """JSON over HTTP to an agl server: bearer token, keep-alive per thread, retries, errors with reasons.

    ``url`` is the server's root (``http://host:port``; a trailing ``/v1`` is accepted too).
    """

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 60.0, retry_s: float = 30.0) -> None:
        if not isinstance(url, str):
            raise TypeError(f"url must be a str, got {type(url).__name__}")
        parts = urllib.parse.urlsplit(url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be an http(s) URL such as http://127.0.0.1:8000, got {url!r}")
        path = parts.path[:-3] if parts.path.endswith("/v1") else parts.path
        self.url = f"{parts.scheme}://{parts.netloc}{path}"
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = path
        self.token = token
        self.timeout = timeout
        self.retry_s = retry_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[http.client.HTTPConnection] = []
        self._closed = False

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self.timeout)
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def _drop(self) -> None:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
            with self._lock:
                with contextlib.suppress(ValueError):
                    self._connections.remove(conn)

    def request(self, method: str, path: str, body: Any = None, *, query: Mapping[str, Any] | None = None,
                retry: bool = True, timeout: float | None = None) -> tuple[int, Any]:
        """Send one call; return ``(status, JSON body or None)`` for 2xx, raise for anything else."""
        if self._closed:
            raise StoreError(f"this client of {self.url} is closed")
        target = self._prefix + path
        if query:
            items = [(k, v) for k, v in query.items() if v is not None]
            if items:
                target += "?" + urllib.parse.urlencode(items, doseq=True)
        payload = None if body is None else _encode(body)
        headers = {"Accept": "application/json"}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        deadline = time.monotonic() + (self.retry_s if retry else 0.0)
        delay = 0.05
        while True:
            reused = getattr(self._local, "conn", None) is not None
            try:
                status, raw = self._send(method, target, payload, headers, timeout)
            except _NETWORK_ERRORS as exc:
                self._drop()
                if reused:
                    continue  # the server closed an idle keep-alive connection: a fresh one, at once
                if time.monotonic() + delay > deadline:
                    raise StoreError(f"cannot reach the agl server at {self.url}: {type(exc).__name__}: {exc}"
                                     ) from exc
            else:
                if status < 300:
                    return status, (json.loads(raw) if raw else None)
                if status not in _RETRY_STATUSES or time.monotonic() + delay > deadline:
                    raise _error(status, raw)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _send(self, method: str, target: str, payload: bytes | None, headers: dict[str, str],
              timeout: float | None) -> tuple[int, bytes]:
        conn = self._connection()
        conn.timeout = self.timeout if timeout is None else timeout
        if conn.sock is not None:
            conn.sock.settimeout(conn.timeout)
        conn.request(method, target, body=payload, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        if response.getheader("Connection", "").lower() == "close":
            self._drop()
        return response.status, raw

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()


def _encode(body: Any) -> bytes:
    """The JSON of ``body``; text that is not unicode (a lone surrogate) goes escaped, so the server names its field."""
    text = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(body, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def _error(status: int, raw: bytes) -> AglError:
    try:
        detail = json.loads(raw)["error"]
        message, param = str(detail["message"]), detail.get("param")
    except (ValueError, KeyError, TypeError):
        message, param = raw.decode("utf-8", "replace")[:500] or http.client.responses.get(status, ""), None
    if status == 400 and isinstance(param, str) and param:
        prefix = f"{param}: "
        return SchemaError(param, message[len(prefix):] if message.startswith(prefix) else message)
    return ServerError(status, message, param if isinstance(param, str) else None)


class HttpStore:
    """The store of the agl server at ``url``, which needs ``token`` when it was started with one."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 60.0, retry_s: float = 30.0) -> None:
        self.client = ServerClient(url, token, timeout=timeout, retry_s=retry_s)

    @property
    def url(self) -> str:
        return self.client.url

    def __repr__(self) -> str:
        return f"HttpStore({self.client.url!r})"

    # ------------------------------------------------------------------ writes

    def put_rollout(self, rollout: Rollout, trajectory: Trajectory | None = None, *, validate: bool = True,
                    lease_id: str | None = None) -> None:
        """Post ``rollout`` with its spans; the server builds and stores its transitions.

        ``trajectory`` is not sent: the server builds its own, with the gateway's token ids. The
        server validates what it receives, so ``validate`` changes nothing here. ``lease_id`` (the
        worker's) finishes that lease's task with this rollout.
        """
        self.post_rollout(rollout, lease_id=lease_id)

    def post_rollout(self, rollout: Rollout, *, lease_id: str | None = None) -> dict[str, Any]:
        """:meth:`put_rollout`, returning the server's summary (transitions built, their token sources)."""
        if not isinstance(rollout, Rollout):
            raise TypeError(f"rollout must be a Rollout, got {type(rollout).__name__}")
        _, data = self.client.request("POST", "/v1/rollouts", rollout.to_dict(),
                                      query={"lease_id": lease_id} if lease_id else None)
        return typing.cast(dict[str, Any], data)

    def add_spans(self, rollout_id: str, spans: Sequence[Span]) -> None:
        _check_id(rollout_id, "rollout_id")
        body = {"spans": [s.to_dict() for s in spans]}
        self.client.request("POST", f"/v1/rollouts/{_quote(rollout_id)}/spans", body)

    # ------------------------------------------------------------------ reads

    def get_rollout(self, rollout_id: str, *, with_spans: bool = True) -> Rollout | None:
        _check_id(rollout_id, "rollout_id")
        try:
            _, data = self.client.request("GET", f"/v1/rollouts/{_quote(rollout_id)}",
                                          query={"with_spans": _flag(with_spans)})
        except ServerError as exc:
            if exc.status == 404:
                return None
            raise
        return Rollout.from_dict(data)

    def rollouts(
        self,
        *,
        task_id: str | None = None,
        status: str | Sequence[str] | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = None,
        with_spans: bool = False,
    ) -> list[Rollout]:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit must be a non-negative integer, got {limit!r}")
        query = {"task_id": task_id, "status": _statuses(status), "since": since, "until": until,
                 "with_spans": _flag(with_spans)}
        return [Rollout.from_dict(r) for r in self._listing("/v1/rollouts", "rollouts", query, limit)]

    def spans(self, rollout_id: str) -> list[Span]:
        _check_id(rollout_id, "rollout_id")
        _, data = self.client.request("GET", f"/v1/rollouts/{_quote(rollout_id)}/spans")
        return [Span.from_dict(s) for s in data["spans"]]

    def transitions(self, *, rollout_id: str | None = None, task_id: str | None = None) -> list[Transition]:
        query = {"rollout_id": rollout_id, "task_id": task_id}
        return [Transition.from_dict(t) for t in self._listing("/v1/transitions", "transitions", query)]

    def trajectories(
        self,
        *,
        task_id: str | None = None,
        status: str | Sequence[str] | None = None,
        rollout_ids: Sequence[str] | None = None,
        builder: TrajectoryBuilder | None = None,
    ) -> list[Trajectory]:
        """The server's stored trajectories; with ``builder``, built here from the stored (joined) spans."""
        ids = [rollout_ids] if isinstance(rollout_ids, str) else (list(rollout_ids) if rollout_ids else None)
        if builder is None:
            query = {"task_id": task_id, "status": _statuses(status), "rollout_id": ids}
            return [Trajectory.from_dict(t) for t in self._listing("/v1/trajectories", "trajectories", query)]
        if not callable(getattr(builder, "build", None)):
            raise TypeError(f"builder must have a build(rollout) method, got {type(builder).__name__}")
        if ids is None:
            runs = self.rollouts(task_id=task_id, status=status, with_spans=True)
        else:
            wanted = set(_statuses(status) or ())
            found = [r for r in (self.get_rollout(i) for i in dict.fromkeys(ids)) if r is not None]
            runs = sorted((r for r in found if (task_id is None or r.task_id == task_id)
                           and (not wanted or r.status in wanted)), key=lambda r: r.start_time)
        built = []
        for run in runs:
            traj = builder.build(run)
            if not isinstance(traj, Trajectory):
                raise TypeError(f"builder.build() must return a Trajectory, got {type(traj).__name__}")
            built.append(traj)
        return built

    def export(self, path: str | os.PathLike[str], format: str = "jsonl", *, what: str = "transitions") -> int:
        """Write every record of kind ``what`` on the server to the local ``path``, as ``SqliteStore.export``."""
        if format not in EXPORT_FORMATS:
            raise ValueError(f"format must be one of {', '.join(map(repr, EXPORT_FORMATS))}, got {format!r}")
        if what not in EXPORT_WHATS:
            raise ValueError(f"what must be one of {', '.join(map(repr, EXPORT_WHATS))}, got {what!r}")
        from agl_core.store import sqlite

        target = os.fspath(path)
        write = (sqlite._parquet_writer(typing.cast(Literal["transitions", "rollouts", "spans"], what))
                 if format == "parquet" else sqlite._write_jsonl)
        tmp = f"{target}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            count = write(tmp, self._export_lines(what))
            os.replace(tmp, target)
        except OSError as exc:
            raise StoreError(f"cannot write {target}: {exc}") from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        return count

    def _listing(self, path: str, key: str, query: Mapping[str, Any], limit: int | None = None) -> list[Any]:
        """Every item of one of the server's paged listings (at most ``limit``), following its ``next`` cursor."""
        items: list[Any] = []
        after: str | None = None
        seen: set[str] = set()
        while limit is None or len(items) < limit:
            size = LISTING_PAGE if limit is None else min(LISTING_PAGE, limit - len(items))
            _, data = self.client.request("GET", path, query={**query, "limit": size, "after": after})
            items.extend(data[key])
            after = data.get("next")  # absent from a server that answers everything at once
            if after is None:
                break
            if after in seen:  # a server that pages in circles: say so rather than read forever
                raise StoreError(f"the agl server at {self.url} gave the cursor {after!r} of {path} twice; "
                                 f"its listing goes in circles (after {len(items)} items)")
            seen.add(after)
        return items

    def _export_lines(self, what: str) -> Iterator[str]:
        if what == "transitions":
            for t in self.transitions():
                yield t.to_json()
        elif what == "rollouts":
            for r in self.rollouts(with_spans=True):
                yield r.to_json()
        else:
            for r in self.rollouts():
                for span in self.spans(r.id):
                    if span.rollout_id is None:
                        span.rollout_id = r.id
                    yield span.to_json()

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        self.client.close()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _quote(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _statuses(status: str | Sequence[str] | None) -> list[str] | None:
    if status is None:
        return None
    return [status] if isinstance(status, str) else list(status)


def _check_id(value: Any, name: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
