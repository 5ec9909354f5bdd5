"""``agl serve``: the trainer's server: task queue, rollouts, model version and the gateway, on one port.

One ASGI app (Starlette on uvicorn) over one SQLite file, which holds core's
store tables (rollouts, spans, transitions), the task queue and the gateway's
token records, so a restarted server finds all three as they were.

Routes (JSON in and out; errors in the OpenAI shape, naming the bad field):

- ``POST /v1/tasks``: enqueue ``{"tasks": [{"task": ..., "task_id"?, "group_id"?}], "repeat"?,
  "group_id"?, "max_attempts"?}``; ``GET /v1/tasks``, ``GET /v1/tasks/{id}``, ``GET /v1/queue``.
- ``POST /v1/tasks/lease`` ``{"worker_id", "wait_s"?, "lease_timeout"?}``: 200 with a lease, or 204.
- ``POST /v1/leases/heartbeat`` ``{"lease_ids": [...]}``; ``POST /v1/leases/{id}/release``
  ``{"reason"?, "failed"?}``: a shutdown's release is free, a failed attempt's counts as a try and
  backs off (:mod:`agl_trainer.queue`).
- ``POST /v1/rollouts[?lease_id=...]``: a finished ``Rollout`` with its spans. The gateway's
  token records join its LLM spans, core's ``TransitionBuilder`` builds the transitions, and
  rollout and transitions are stored; with a lease, the task is done in the same step (the
  rollout's ``metadata["agl.group_id"]`` says its GRPO group), and a lease that has already
  expired and moved on gets 409, so an attempt's result is never stored twice. A rollout id
  belongs to one task and attempt and a finished rollout is final: another task's, attempt's or
  outcome's rollout under a stored id is a 409 naming the field (core's ``put_rollout``).
- ``GET /v1/rollouts``, ``GET /v1/rollouts/{id}``, ``GET|POST /v1/rollouts/{id}/spans``,
  ``GET /v1/transitions``, ``GET /v1/trajectories``: the read side of core's ``Store``; spans
  posted to a stored rollout are joined with the gateway's records and rebuild its transitions.
- The listings (``GET /v1/tasks``, ``/v1/rollouts``, ``/v1/transitions``, ``/v1/trajectories``) are
  paged: ``limit`` (default 1000, at most 10000) and ``after=<the previous page's next>``; each
  answer has ``next``, null on the last page; every row comes once, ties included (:mod:`agl_trainer.paging`).
- ``GET /v1/model`` (with ``sampling``: the gateway's sampling overrides, which a trainer checks against its
  own); ``POST /v1/model`` ``{"version"?, "weights"?}``: the trainer announces weights
  (versions go up by at most :data:`MAX_VERSION_STEP`; none given: the next).
- ``POST /v1/metrics`` ``{"step", "values": {name: number}}``; ``GET /v1/metrics``: training curves by step.
- ``GET /v1/resources``: the current resources version (what workers hand the agent); ``POST /v1/resources``
  ``{"resources": {name: value}, "metadata"?, "current"?}``: a new version; ``GET /v1/resources/history``
  (paged, ``after=<version>``); ``GET|POST /v1/resources/{version}`` ``{"metadata"?, "current"?}``: notes on a
  version, or make it current again (:mod:`agl_trainer.resources`).
- ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/models``: the gateway
  (:mod:`agl_trainer.gateway`).
- ``POST /v1/traces``: OTLP/HTTP in (protobuf or JSON): spans of any instrumentation, mapped from their
  convention and grouped into rollouts (:mod:`agl_trainer.otlp`).
- ``/rollouts/{rollout_id}/v1/chat/completions``, ``.../v1/responses``, ``.../v1/models``: the gateway scoped
  to one open rollout, whose calls become its transitions (:mod:`agl_trainer.rollout_calls`).
- ``GET /openapi.json``: the OpenAPI 3.1 document of every route above (:mod:`agl_trainer.openapi`).
- ``/`` and ``/dashboard``: the dashboard (:mod:`agl_trainer.dashboard`), with ``GET /v1/stats``.

Security: it listens on 127.0.0.1 unless told otherwise and then refuses to
start without a bearer token; with a token every route but ``/healthz`` and the
dashboard's static files needs it (the agent's ``OPENAI_API_KEY`` carries it to the gateway). Bodies over
``max_body_bytes`` get 413; bodies are read by :func:`agl_trainer.api.parse_json` (no ``NaN``, lone
surrogate or nesting past 256 levels: a 400 naming the field); a client slower than
``header_timeout_s`` / ``body_timeout_s`` is cut off (:mod:`agl_trainer.read_timeouts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import numbers
import socket
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from agl_core.errors import RolloutConflict, SchemaError, StoreError
from agl_core.schema import Rollout, Span, Trajectory
from agl_core.store.sqlite import SqliteStore
from agl_core.transitions import TransitionBuilder
from agl_trainer.api import DEFAULT_MAX_BODY_BYTES, ApiError, BearerAuth, error_response, read_json, read_object
from agl_trainer.dashboard import OPEN_PATHS as DASHBOARD_FILES
from agl_trainer.dashboard import Dashboard
from agl_trainer.gateway import Backend, Gateway, GatewayConfig
from agl_trainer.openapi import openapi_json
from agl_trainer.otlp import TracesReceiver
from agl_trainer.otlp.finish import span_rewards
from agl_trainer.paging import limit_param, rollouts_page, trajectories_page, transitions_page
from agl_trainer.queue import LeaseLost, TaskQueue, TaskSpec
from agl_trainer.resources import ResourceVersions
from agl_trainer.rollout_calls import RolloutCalls, adopt_calls
from agl_trainer.token_records import MAX_MODEL_VERSION, MAX_VERSION_STEP, TokenRecords, keep_joined

__all__ = ["MAX_MODEL_VERSION", "MAX_VERSION_STEP", "ServerConfig", "ServerThread", "TrainerServer", "check_bind",
           "serve"]

logger = logging.getLogger("agl.trainer")

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
_FINISHED = ("succeeded", "failed", "timeout", "cancelled")
_STATUSES = ("running", *_FINISHED)
_MAX_INT = 2**63 - 1  # SQLite's INTEGER: a bigger number would fail deep in the store


@dataclass
class ServerConfig:
    """Everything ``agl serve`` is told; the defaults suit one machine."""

    db_path: str = "agl.db"
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    lease_timeout_s: float = 600.0
    max_attempts: int = 3
    retry_backoff_s: float = 1.0
    """A task whose attempt failed waits this long before its next lease, doubling each try."""
    max_backoff_s: float = 60.0
    max_task_bytes: int | None = None
    """Largest task payload (JSON bytes) enqueued; None: half of ``max_body_bytes``, so its rollout fits."""
    header_timeout_s: float = 10.0
    """A client gets this long to send a request's head (line and headers) before its connection is closed."""
    body_timeout_s: float = 120.0
    """... and this long to send the body after the head."""
    token_records_max_bytes: int = 256 * 1024 * 1024
    """Memory for the gateway's token records not yet joined to a rollout; the oldest go past it."""
    sweep_interval_s: float = 1.0
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    builder: TransitionBuilder | None = None
    """How the server turns a posted rollout into transitions; None: ``TransitionBuilder()``. A client's builder
    (``POST /v1/builder``: a worker's agent, a remote trainer's config) joins it; a key set otherwise is refused."""
    builder_source: str = "the server's builder"
    """Where ``builder`` comes from, for the error that names both sides of a conflict (``agl serve --agent-match``)."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to listen beyond this machine without a bearer token."""
    if not _is_loopback(host) and not token:
        raise ValueError(f"refusing to listen on {host} without a bearer token: anyone who can reach it could "
                         f"read rollouts and use the model. Pass --token (or AGL_TOKEN), or listen on 127.0.0.1.")


class _ModelState:
    """The current model version and where its weights are, in the server's SQLite file."""

    def __init__(self, path: str) -> None:
        self._conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock:
            self._conn.execute("PRAGMA busy_timeout = 30000")
            self._conn.execute("CREATE TABLE IF NOT EXISTS trainer_model (id INTEGER PRIMARY KEY CHECK (id = 1),"
                               " version INTEGER NOT NULL, weights TEXT, updated REAL NOT NULL)")
            row = self._conn.execute("SELECT version, weights, updated FROM trainer_model").fetchone()
        self.version: int = row[0] if row else 0
        self.weights: str | None = row[1] if row else None
        self.updated: float = row[2] if row else 0.0

    def set(self, version: int, weights: str | None) -> None:
        now = time.time()
        with self._lock:
            self._conn.execute("INSERT INTO trainer_model (id, version, weights, updated) VALUES (1, ?, ?, ?)"
                               " ON CONFLICT (id) DO UPDATE SET version = excluded.version,"
                               " weights = excluded.weights, updated = excluded.updated", (version, weights, now))
        self.version, self.weights, self.updated = version, weights, now

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class _Metrics:
    """Training metrics per step (reward, loss, ...), one row per (step, name), in the server's SQLite file."""

    def __init__(self, path: str) -> None:
        self._conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock:
            self._conn.execute("PRAGMA busy_timeout = 30000")
            self._conn.execute("CREATE TABLE IF NOT EXISTS trainer_metrics (step INTEGER NOT NULL,"
                               " name TEXT NOT NULL, value REAL NOT NULL, time REAL NOT NULL,"
                               " PRIMARY KEY (step, name))")

    def record(self, step: int, values: dict[str, float]) -> None:
        step, rows = _metric_rows(step, values)
        now = time.time()
        with self._lock:
            # one transaction: a bad value is refused before anything is written, and a crash loses a step whole
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany("INSERT INTO trainer_metrics (step, name, value, time) VALUES (?, ?, ?, ?)"
                                       " ON CONFLICT (step, name) DO UPDATE SET value = excluded.value,"
                                       " time = excluded.time", [(step, n, v, now) for n, v in rows])
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def all(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._conn.execute("SELECT step, name, value, time FROM trainer_metrics"
                                      " ORDER BY step, name").fetchall()
        out: list[dict[str, Any]] = []
        for step, name, value, at in rows:
            if not out or out[-1]["step"] != step:
                out.append({"step": step, "time": at, "values": {}})
            out[-1]["values"][name] = value
            out[-1]["time"] = max(out[-1]["time"], at)
        return out

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _metric_rows(step: Any, values: Any) -> tuple[int, list[tuple[str, float]]]:
    """Check one step's metrics: a non-negative integer step, non-empty names, finite numbers."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 0 <= int(step) <= _MAX_INT:
        raise ValueError(f"'step' must be a non-negative integer, got {step!r}")
    if not isinstance(values, dict):
        raise ValueError(f"'values' must be a mapping of metric name to number, got {type(values).__name__}")
    rows = []
    for name, value in values.items():
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"'values' key {name!r}: a metric name must be a non-empty string")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise ValueError(f"'values.{name}' must be a finite number, got {value!r}")
        rows.append((name, float(value)))
    return int(step), rows  # plain int and float: sqlite3 cannot bind numpy's


class TrainerServer:
    """The server's parts over one SQLite file, and its ASGI :attr:`app`.

    A trainer in the same process uses the parts directly: ``server.queue``
    (enqueue, watch), ``server.store`` (read rollouts and transitions),
    ``await server.publish(version, weights)`` (new weights for the gateway).
    """

    def __init__(self, config: ServerConfig, backend: Backend) -> None:
        self.config = config
        self.store = SqliteStore(config.db_path)
        task_bytes = config.max_task_bytes if config.max_task_bytes is not None else config.max_body_bytes // 2
        self.queue = TaskQueue(config.db_path, default_max_attempts=config.max_attempts,
                               default_lease_timeout=config.lease_timeout_s, backoff_s=config.retry_backoff_s,
                               max_backoff_s=config.max_backoff_s, max_task_bytes=task_bytes)
        memory = config.db_path == ":memory:"
        self.records = TokenRecords(None if memory else config.db_path, max_bytes=config.token_records_max_bytes)
        self.model = _ModelState(config.db_path)
        self._metrics = _Metrics(config.db_path)
        self.resources = ResourceVersions(config.db_path)
        self.builder = config.builder or TransitionBuilder()
        self.builder_source = config.builder_source
        self._builder_lock = threading.Lock()
        self.dashboard = Dashboard(self.store)
        self.backend = backend
        self.gateway = Gateway(backend, self.records, config.gateway, model_version=lambda: self.model.version,
                               max_body_bytes=config.max_body_bytes)
        self.rollout_calls = RolloutCalls(self.store, None if memory else config.db_path)  # /rollouts/{id}/v1
        self.gateway.capture = self.rollout_calls.capture
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue_event: asyncio.Event | None = None
        # one rollout at a time per stripe: a post and an added span read, merge and write it whole
        self._rollout_locks = [threading.Lock() for _ in range(64)]
        self._publishing = asyncio.Lock()
        self.traces = TracesReceiver(self)  # POST /v1/traces: OTLP in (agl_trainer.otlp)
        self.app: ASGIApp = self._build_app()

    # ------------------------------------------------------------------ app

    def _build_app(self) -> ASGIApp:
        routes = [
            *self.gateway.routes(),  # first: the hot path matches at once
            *self.rollout_calls.routes(self.gateway.chat_completions, self.gateway.list_models,
                                       self.gateway.responses),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/openapi.json", _openapi, methods=["GET"]),
            Route("/v1/tasks", self.enqueue, methods=["POST"]),
            Route("/v1/tasks", self.list_tasks, methods=["GET"]),
            Route("/v1/tasks/lease", self.lease, methods=["POST"]),
            Route("/v1/tasks/{task_id:path}", self.get_task, methods=["GET"]),
            Route("/v1/queue", self.queue_counts, methods=["GET"]),
            Route("/v1/leases/heartbeat", self.heartbeat, methods=["POST"]),
            Route("/v1/leases/{lease_id}/release", self.release, methods=["POST"]),
            self.traces.route(),
            Route("/v1/rollouts", self.post_rollout, methods=["POST"]),
            Route("/v1/rollouts", self.list_rollouts, methods=["GET"]),
            Route("/v1/rollouts/{rollout_id}/spans", self.get_spans, methods=["GET"]),
            Route("/v1/rollouts/{rollout_id}/spans", self.add_spans, methods=["POST"]),
            Route("/v1/rollouts/{rollout_id}", self.get_rollout, methods=["GET"]),
            Route("/v1/transitions", self.list_transitions, methods=["GET"]),
            Route("/v1/trajectories", self.list_trajectories, methods=["GET"]),
            Route("/v1/model", self.get_model, methods=["GET"]),
            Route("/v1/model", self.post_model, methods=["POST"]),
            Route("/v1/builder", self.get_builder, methods=["GET"]),
            Route("/v1/builder", self.post_builder, methods=["POST"]),
            Route("/v1/metrics", self.get_metrics, methods=["GET"]),
            Route("/v1/metrics", self.post_metrics, methods=["POST"]),
            Route("/v1/resources", self.get_resources, methods=["GET"]),
            Route("/v1/resources", self.post_resources, methods=["POST"]),
            Route("/v1/resources/history", self.resource_history, methods=["GET"]),
            Route("/v1/resources/{version}", self.get_resource_version, methods=["GET"]),
            Route("/v1/resources/{version}", self.update_resource_version, methods=["POST"]),
            *self.dashboard.routes(),
        ]
        handlers: dict[Any, Callable[..., Any]] = {
            ApiError: _on_api_error,
            SchemaError: _on_schema_error,
            LeaseLost: _on_lease_lost,
            RolloutConflict: _on_rollout_conflict,
            StoreError: _on_store_error,
            HTTPException: _on_http_exception,
        }
        app: ASGIApp = Starlette(routes=routes, exception_handlers=handlers, lifespan=self._lifespan)
        if self.config.token:
            # the dashboard's page and script hold no data: they load without the token, then send it
            app = BearerAuth(app, self.config.token, open_paths=frozenset({"/healthz"}) | DASHBOARD_FILES)
        return app

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> AsyncIterator[None]:
        self._loop = asyncio.get_running_loop()
        self._queue_event = asyncio.Event()
        self.queue.on_change = self._changed_threadsafe
        sweeper = asyncio.create_task(self._sweep())
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            self.queue.on_change = None
            await run_in_threadpool(self.records.flush)  # a signal may end the process right after this
            await run_in_threadpool(self.rollout_calls.flush)
            await self.backend.aclose()
            await self.gateway.aclose()

    def close(self) -> None:
        """Release the store, queue and records (the app must have stopped)."""
        self.records.close()
        self.rollout_calls.close()
        self.queue.close()
        self.model.close()
        self._metrics.close()
        self.resources.close()
        self.store.close()

    def _changed_threadsafe(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake_waiters)

    def _wake_waiters(self) -> None:
        event = self._queue_event
        self._queue_event = asyncio.Event()
        if event is not None:
            event.set()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                expired = await run_in_threadpool(self.queue.expire, self._stored_attempt)
                for task_id, attempt in expired:
                    logger.info("agl serve: lease of task %s attempt %d expired", task_id, attempt)
            except Exception:  # noqa: BLE001 - the sweeper must outlive a busy database
                logger.exception("agl serve: lease sweep failed; retrying")

    def _stored_attempt(self, task_id: str, attempt: int) -> str | None:
        """A finished rollout already stored for this attempt (the server stopped before finishing its lease)."""
        for rollout in self.store.rollouts(task_id=task_id, status=[s for s in _FINISHED if s != "cancelled"]):
            if rollout.attempt == attempt:
                return rollout.id
        return None

    # ------------------------------------------------------------------ model

    async def publish(self, version: int | None = None, weights: str | None = None) -> int:
        """New weights: the backend swaps them in, then calls are recorded under ``version``; returns it.

        The rule for versions: an integer newer than the current one by at most
        :data:`MAX_VERSION_STEP` (and at most :data:`MAX_MODEL_VERSION`); None means the next one.
        So a version can never be pushed where no later publish fits: a trainer that lost count
        publishes without one, or anything the 409 names.
        """
        async with self._publishing:
            current = self.model.version
            if version is None:
                version = current + 1
            if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_MODEL_VERSION:
                raise SchemaError("version", f"must be an integer from 0 to {MAX_MODEL_VERSION} (2**53 - 1), "
                                             f"got {version!r}")
            if version <= current:
                raise ApiError(409, f"version {version} is not newer than the current version {current}: publish "
                                    f"{current + 1} to {current + MAX_VERSION_STEP}, or leave 'version' out for "
                                    f"{current + 1}", "version")
            if version > current + MAX_VERSION_STEP:
                raise ApiError(400, f"'version' {version} jumps more than {MAX_VERSION_STEP} past the current "
                                    f"version {current}: publish {current + 1} to {current + MAX_VERSION_STEP}, or "
                                    f"leave 'version' out for {current + 1}", "version")
            await self.backend.update_weights(weights, version)
            await run_in_threadpool(self.model.set, version, weights)
            return version

    async def get_model(self, request: Request) -> Response:
        try:
            name: str | None = await self.gateway.served_model()
        except Exception:  # noqa: BLE001 - the version is still worth answering while the backend is down
            name = None
        return _json({"model": name, "version": self.model.version, "weights": self.model.weights,
                      "updated_at": self.model.updated, "sampling": self.gateway.config.sampling_overrides})

    async def post_model(self, request: Request) -> Response:
        body = read_object(await read_json(request, self.config.max_body_bytes))
        version = body.get("version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ApiError(400, "'version' must be an integer (or left out for the next one)", "version")
        weights = body.get("weights")
        if weights is not None and not isinstance(weights, str):
            raise ApiError(400, "'weights' must be a string (a path the backend can read) or null", "weights")
        await self.publish(version, weights)
        return await self.get_model(request)

    # ------------------------------------------------------------------ what is trained

    async def get_builder(self, request: Request) -> Response:
        return _json({"settings": self.builder.settings(loadable=False), "source": self.builder_source})

    async def post_builder(self, request: Request) -> Response:
        body = read_object(await read_json(request, self.config.max_body_bytes))
        settings, source = body.get("settings"), body.get("source", "the client's builder")
        if not isinstance(settings, dict):
            raise ApiError(400, "'settings' must be an object (TransitionBuilder.settings())", "settings")
        if not isinstance(source, str) or not source:
            raise ApiError(400, "'source' must be a non-empty string (where the builder comes from)", "source")
        await run_in_threadpool(self.join_builder, settings, source)
        return await self.get_builder(request)

    def join_builder(self, settings: dict[str, Any], source: str) -> None:
        """Build transitions with ``settings`` (a client's builder) from now on, joined with the server's own.

        One source of truth for what is trained: a key the server's builder sets to another value
        raises :class:`ApiError` 409 naming both; a function the server cannot import, 400.
        """
        from agl_core.transitions import BuilderConflict, merge_builders

        try:
            theirs = TransitionBuilder.from_settings(settings)
        except SchemaError as exc:
            raise ApiError(400, f"{exc}: the server builds the stored transitions, so it must load every function "
                                "the builder names (install the module where `agl serve` runs)",
                           exc.field.replace("TransitionBuilder.", "")) from None
        with self._builder_lock:
            try:
                merged = merge_builders(self.builder, theirs, names=(self.builder_source, source))
            except BuilderConflict as exc:
                raise ApiError(409, str(exc), "settings") from None
            if merged is not None and merged.settings(loadable=False) != self.builder.settings(loadable=False):
                self.builder = merged
                self.builder_source = f"{self.builder_source} joined with {source}"

    # ------------------------------------------------------------------ metrics

    def record_metrics(self, step: int, values: dict[str, float]) -> None:
        """Store one training step's metrics (``{"reward_mean": 0.5, "loss": 0.12}``) for the dashboard.

        Recording a step again updates the names it gives and keeps the others. A bad step, name or
        value raises ``ValueError`` naming it, and nothing of that call is stored.
        """
        self._metrics.record(step, values)

    def metrics(self) -> list[dict[str, Any]]:
        """Every recorded step, by step: ``[{"step": 3, "time": 1764505000.0, "values": {...}}, ...]``."""
        return self._metrics.all()

    async def get_metrics(self, request: Request) -> Response:
        return _json({"data": await run_in_threadpool(self.metrics)})

    async def post_metrics(self, request: Request) -> Response:
        body = read_object(await read_json(request, self.config.max_body_bytes))
        for key in ("step", "values"):
            if key not in body:
                raise ApiError(400, f"'{key}' is required: send {{\"step\": int, \"values\": {{name: number}}}}", key)
        try:
            await run_in_threadpool(self.record_metrics, body["step"], body["values"])
        except ValueError as exc:
            field_name = str(exc).split("'")[1] if str(exc).startswith("'") else "values"
            raise ApiError(400, str(exc), field_name) from None
        return _json({"step": body["step"], "recorded": len(body["values"])}, 201)

    # ------------------------------------------------------------------ resources

    async def get_resources(self, request: Request) -> Response:
        entry = await run_in_threadpool(self.resources.current)
        if entry is None:
            raise ApiError(404, "no resources yet: POST /v1/resources {\"resources\": {name: value}} makes "
                                "version 1", "version")
        return _json(entry)

    async def post_resources(self, request: Request) -> Response:
        body = read_object(await read_json(request, self.config.max_body_bytes))
        if "resources" not in body:
            raise ApiError(400, "'resources' is required: send {\"resources\": {name: value}}", "resources")
        current = _bool_field(body, "current", True)
        entry = await run_in_threadpool(lambda: self.resources.add(body["resources"], body.get("metadata"),
                                                                   current=current))
        return _json(entry, 201)

    async def resource_history(self, request: Request) -> Response:
        q = request.query_params
        limit = limit_param(q)
        after = _version_of(q.get("after", "0"), "after", low=0)
        data = await run_in_threadpool(self.resources.history, limit + 1, after)
        more = len(data) > limit
        data = data[:limit]
        return _json({"data": data, "next": str(data[-1]["version"]) if more else None})

    async def get_resource_version(self, request: Request) -> Response:
        version = _version_of(request.path_params["version"], "version")
        entry = await run_in_threadpool(self.resources.get, version)
        if entry is None:
            raise ApiError(404, f"no resources version {version}", "version")
        return _json(entry)

    async def update_resource_version(self, request: Request) -> Response:
        # the body first, as every route: a body no route could read is a 400 naming its place, whatever the path
        body = read_object(await read_json(request, self.config.max_body_bytes))
        version = _version_of(request.path_params["version"], "version")
        current = _bool_field(body, "current", False)
        entry = await run_in_threadpool(lambda: self.resources.update(version, body.get("metadata"),
                                                                      current=current))
        if entry is None:
            raise ApiError(404, f"no resources version {version}", "version")
        return _json(entry)

    # ------------------------------------------------------------------ tasks

    async def healthz(self, request: Request) -> Response:
        return _json({"ok": True})

    async def enqueue(self, request: Request) -> Response:
        body = read_object(await read_json(request, self.config.max_body_bytes))
        items = body.get("tasks")
        if not isinstance(items, list):
            raise ApiError(400, "'tasks' must be an array of {\"task\": ..., \"task_id\"?, \"group_id\"?}", "tasks")
        specs = []
        for i, item in enumerate(items):
            if not isinstance(item, dict) or "task" not in item:
                raise ApiError(400, f"'tasks[{i}]' must be an object with a 'task' key", f"tasks[{i}]")
            unknown = sorted(set(item) - {"task", "task_id", "group_id"})
            if unknown:
                raise ApiError(400, f"'tasks[{i}].{unknown[0]}' is not a task field", f"tasks[{i}].{unknown[0]}")
            for key in ("task_id", "group_id"):
                if item.get(key) is not None and (not isinstance(item[key], str) or not item[key]):
                    raise ApiError(400, f"'tasks[{i}].{key}' must be a non-empty string", f"tasks[{i}].{key}")
            specs.append(TaskSpec(item["task"], item.get("task_id"), item.get("group_id")))
        repeat = body.get("repeat", 1)
        max_attempts = body.get("max_attempts")
        group_id = body.get("group_id")
        ids = await run_in_threadpool(lambda: self.queue.enqueue(specs, repeat=repeat, group_id=group_id,
                                                                 max_attempts=max_attempts))
        return _json({"task_ids": ids}, 201)

    async def list_tasks(self, request: Request) -> Response:
        q = request.query_params
        limit = limit_param(q)
        after = q.get("after")

        def page() -> list[Any]:
            if after is not None and self.queue.get(after) is None:
                raise ApiError(400, f"query parameter 'after' is not a cursor of this listing: {after[:200]!r} "
                                    "(pass the 'next' of the page before)", "after")
            return self.queue.tasks(state=q.get("state"), group_id=q.get("group_id"), limit=limit + 1, after=after)

        tasks = await run_in_threadpool(page)
        more = len(tasks) > limit
        tasks = tasks[:limit]
        return _json({"tasks": [t.to_dict() for t in tasks], "next": tasks[-1].task_id if more else None})

    async def get_task(self, request: Request) -> Response:
        task_id = request.path_params["task_id"]
        info = await run_in_threadpool(self.queue.get, task_id)
        if info is None:
            raise ApiError(404, f"no task {task_id!r} in the queue", "task_id")
        return _json(info.to_dict())

    async def queue_counts(self, request: Request) -> Response:
        return _json(await run_in_threadpool(self.queue.counts))

    async def lease(self, request: Request) -> Response:
        body = read_object(await read_json(request, self.config.max_body_bytes))
        worker_id = body.get("worker_id", "anonymous")
        if not isinstance(worker_id, str) or not worker_id:
            raise ApiError(400, "'worker_id' must be a non-empty string", "worker_id")
        wait_s = _number(body, "wait_s", 0.0, high=60.0)
        lease_timeout = body.get("lease_timeout")
        if lease_timeout is not None:
            lease_timeout = _number(body, "lease_timeout", 0.0, low_exclusive=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            event = self._queue_event
            lease = await run_in_threadpool(lambda: self.queue.lease(worker_id, lease_timeout=lease_timeout))
            if lease is not None:
                return _json(lease.to_dict())
            left = deadline - loop.time()
            if left <= 0 or event is None:
                return Response(status_code=204)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=min(left, self.config.sweep_interval_s))

    async def heartbeat(self, request: Request) -> Response:
        body = read_object(await read_json(request, self.config.max_body_bytes))
        ids = body.get("lease_ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ApiError(400, "'lease_ids' must be an array of lease ids", "lease_ids")
        alive, lost = await run_in_threadpool(self.queue.heartbeat, ids)
        return _json({"alive": alive, "lost": lost})

    async def release(self, request: Request) -> Response:
        lease_id = request.path_params["lease_id"]
        reason = "released by the worker"
        failed = False
        if request.headers.get("content-length") not in (None, "0"):
            body = read_object(await read_json(request, self.config.max_body_bytes))
            if body.get("reason") is not None:
                if not isinstance(body["reason"], str):
                    raise ApiError(400, "'reason' must be a string", "reason")
                reason = body["reason"]
            failed = body.get("failed", False)
            if not isinstance(failed, bool):
                raise ApiError(400, "'failed' must be true (the attempt failed: it counts as a try) or false",
                               "failed")
        await run_in_threadpool(lambda: self.queue.release(lease_id, reason, failed=failed))
        return _json({"released": lease_id})

    # ------------------------------------------------------------------ rollouts

    async def post_rollout(self, request: Request) -> Response:
        data = read_object(await read_json(request, self.config.max_body_bytes))
        lease_id = request.query_params.get("lease_id") or None
        rollout = Rollout.from_dict(data)
        _check_stored_ints(rollout.spans, "Rollout.spans", rollout.attempt)
        if lease_id is not None and rollout.status == "running":
            raise ApiError(400, "'status' of a leased task's rollout must be finished (succeeded, failed, timeout "
                                "or cancelled), got 'running'", "Rollout.status")
        summary = await run_in_threadpool(self.store_rollout, rollout, lease_id)
        return _json(summary, 201)

    def store_rollout(self, rollout: Rollout, lease_id: str | None = None) -> dict[str, Any]:
        """Join the gateway's token records into ``rollout``, build its transitions and store both.

        With ``lease_id`` the lease must still be current (:class:`LeaseLost` otherwise) and its task
        is done once the rollout is stored; a cancelled rollout is stored and its task queued again (a
        counted try).
        A rollout stored before is merged with what is stored (spans are never dropped, a finished
        rollout's are kept as they were), and its transitions are built from the whole; the store
        refuses (:class:`RolloutConflict`) another task's, attempt's or outcome's rollout under its id.
        """
        if lease_id is not None:
            done = self.queue.attempt_of(lease_id)
            if done is not None and done["outcome"] == "finished" and done["rollout_id"] == rollout.id:
                # the same result again (a retry whose first answer was lost): already stored
                return {"rollout_id": rollout.id, "task_id": rollout.task_id, "attempt": rollout.attempt,
                        "status": rollout.status, "already_stored": True,
                        "transitions": len(self.store.transitions(rollout_id=rollout.id))}
        with self._rollout_lock(rollout.id):
            rollout.spans, keys = self.records.join(self.rollout_calls.spans_of(rollout))
            stored = self.store.get_rollout(rollout.id)
            if stored is not None:
                rollout.spans = _merged(rollout.spans, stored, keep_stored=stored.status in _FINISHED)
            rollout.spans = adopt_calls(rollout.spans)  # a gateway call under the span that saw it: one transition
            span_rewards(rollout)  # rewards that came on spans alone (OTLP's agl.reward.value) are the rollout's
            if lease_id is None:
                trajectory = self.builder.build(rollout)
                self.store.put_rollout(rollout, trajectory)
            elif rollout.status == "cancelled":
                lease = self.queue.lease_of(lease_id)
                _check_matches(rollout, lease.task_id, lease.attempt)
                rollout.metadata.setdefault("agl.group_id", lease.group_id)
                trajectory = self.builder.build(rollout)
                self.store.put_rollout(rollout, trajectory)
                # not a shutdown's release (those come by the release route): a try, or a task whose agent
                # cancels itself every time would be leased for ever
                self.queue.release(lease_id, f"the rollout was cancelled: {rollout.error or 'no reason given'}",
                                   failed=True)
            else:
                with self.queue.finishing(lease_id, rollout.id) as lease:
                    _check_matches(rollout, lease.task_id, lease.attempt)
                    rollout.metadata.setdefault("agl.group_id", lease.group_id)
                    trajectory = self.builder.build(rollout)
                    self.store.put_rollout(rollout, trajectory)
            self.rollout_calls.stored(rollout)
        self.records.forget(keys)
        return _summary(rollout, trajectory, len(keys))

    def add_rollout_spans(self, rollout_id: str, spans: list[Span]) -> dict[str, Any]:
        """Add ``spans`` (joined with the gateway's records) to a stored rollout and rebuild its transitions.

        The stored spans are kept as they were; the transitions are built anew from all of them, so
        they never go stale. Raises ``LookupError`` when no rollout has this id.
        """
        with self._rollout_lock(rollout_id):
            stored = self.store.get_rollout(rollout_id)
            if stored is None:
                raise LookupError(rollout_id)
            joined, keys = self.records.join(spans)
            known = {s.span_id for s in stored.spans}
            stored.spans = adopt_calls(_merged(joined, stored, keep_stored=True))
            if stored.status == "running":  # a finished rollout's rewards are final
                span_rewards(stored)
            trajectory = self.builder.build(stored)
            self.store.put_rollout(stored, trajectory)
        self.records.forget(keys)
        summary = _summary(stored, trajectory, len(keys))
        summary["added"] = len({s.span_id for s in spans} - known)
        return summary

    def _rollout_lock(self, rollout_id: str) -> threading.Lock:
        return self._rollout_locks[hash(rollout_id) % len(self._rollout_locks)]

    async def list_rollouts(self, request: Request) -> Response:
        q = request.query_params
        statuses = _status_param(q)
        kwargs: dict[str, Any] = {"task_id": q.get("task_id"), "status": statuses,
                                  "since": _float_param(q, "since"), "until": _float_param(q, "until"),
                                  "with_spans": _bool_param(q, "with_spans")}
        limit, after = limit_param(q), q.get("after")
        rollouts, cursor = await run_in_threadpool(lambda: rollouts_page(self.store, after, limit, **kwargs))
        return _json({"rollouts": [r.to_dict() for r in rollouts], "next": cursor})

    async def get_rollout(self, request: Request) -> Response:
        rollout_id = request.path_params["rollout_id"]
        with_spans = _bool_param(request.query_params, "with_spans", True)
        rollout = await run_in_threadpool(lambda: self.store.get_rollout(rollout_id, with_spans=with_spans))
        if rollout is None:
            raise ApiError(404, f"no rollout {rollout_id!r}", "rollout_id")
        return _json(rollout.to_dict())

    async def get_spans(self, request: Request) -> Response:
        spans = await run_in_threadpool(self.store.spans, request.path_params["rollout_id"])
        return _json({"spans": [s.to_dict() for s in spans]})

    async def add_spans(self, request: Request) -> Response:
        body = read_object(await read_json(request, self.config.max_body_bytes))
        raw = body.get("spans")
        if not isinstance(raw, list):
            raise ApiError(400, "'spans' must be an array of spans", "spans")
        spans = []
        for i, item in enumerate(raw):
            try:
                spans.append(Span.from_dict(item))
            except SchemaError as exc:
                raise SchemaError(f"spans[{i}]{exc.field[len('Span'):]}", exc.problem) from None
        _check_stored_ints(spans, "spans")
        rollout_id = request.path_params["rollout_id"]
        try:
            summary = await run_in_threadpool(self.add_rollout_spans, rollout_id, spans)
        except LookupError:
            raise ApiError(404, f"no rollout {rollout_id!r} to add spans to; post the rollout first",
                           "rollout_id") from None
        return _json(summary)

    async def list_transitions(self, request: Request) -> Response:
        q = request.query_params
        limit, after = limit_param(q), q.get("after")
        items, cursor = await run_in_threadpool(lambda: transitions_page(
            self.store, after, limit, rollout_id=q.get("rollout_id"), task_id=q.get("task_id")))
        return _json({"transitions": [t.to_dict() for t in items], "next": cursor})

    async def list_trajectories(self, request: Request) -> Response:
        q = request.query_params
        kwargs: dict[str, Any] = {"task_id": q.get("task_id"), "status": _status_param(q),
                                  "rollout_ids": q.getlist("rollout_id") or None}
        limit, after = limit_param(q), q.get("after")
        items, cursor = await run_in_threadpool(lambda: trajectories_page(self.store, after, limit, **kwargs))
        return _json({"trajectories": [t.to_dict() for t in items], "next": cursor})


def _check_stored_ints(spans: list[Span], where: str, attempt: int | None = None) -> None:
    """The integers the store keeps in SQLite columns must fit them (an OverflowError deep in the store otherwise)."""
    if attempt is not None and not -_MAX_INT <= attempt <= _MAX_INT:
        raise SchemaError("Rollout.attempt", f"must fit in 64 bits, got {attempt}")
    for i, span in enumerate(spans):
        if not -_MAX_INT <= span.start_ns <= _MAX_INT:
            raise SchemaError(f"{where}[{i}].start_ns", f"must fit in 64 bits, got {span.start_ns}")


def _merged(spans: list[Span], stored: Rollout, *, keep_stored: bool) -> list[Span]:
    """``spans`` with the stored rollout's: none is dropped; for a span in both, the stored copy when
    ``keep_stored`` (a finished rollout's spans are final), else the new one with the gateway's ids kept."""
    mine = spans if keep_stored else keep_joined(spans, stored.spans)
    new = {s.span_id: s for s in mine}
    out = [s if keep_stored or s.span_id not in new else new.pop(s.span_id) for s in stored.spans]
    seen = {s.span_id for s in out}
    out += [s for s in mine if s.span_id not in seen]
    return sorted(out, key=lambda s: (s.start_ns, s.end_ns))


def _summary(rollout: Rollout, trajectory: Trajectory, joined: int) -> dict[str, Any]:
    sources: dict[str, int] = {}
    for t in trajectory.transitions:
        sources[str(t.token_source)] = sources.get(str(t.token_source), 0) + 1
    return {"rollout_id": rollout.id, "task_id": rollout.task_id, "attempt": rollout.attempt,
            "status": rollout.status, "transitions": len(trajectory.transitions), "token_sources": sources,
            "joined": joined, "skipped": [s.to_dict() for s in trajectory.skipped]}


def _check_matches(rollout: Rollout, task_id: str, attempt: int) -> None:
    if rollout.task_id != task_id:
        raise SchemaError("Rollout.task_id", f"is {rollout.task_id!r} but the lease is for task {task_id!r}")
    if rollout.attempt != attempt:
        raise SchemaError("Rollout.attempt", f"is {rollout.attempt} but the lease is attempt {attempt}")


# ---------------------------------------------------------------------- request pieces


def _json(data: Any, status: int = 200) -> Response:
    return Response(_dumps(data), status_code=status, media_type="application/json")


def _number(body: dict[str, Any], name: str, default: float, *, high: float = math.inf,
            low_exclusive: bool = False) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (low_exclusive and value == 0) or value > high:
        bound = f" and at most {high:g}" if high != math.inf else ""
        raise ApiError(400, f"'{name}' must be a {'positive' if low_exclusive else 'non-negative'} number{bound}, "
                            f"got {json.dumps(value)[:40]}", name)
    return float(value)


def _version_of(raw: str, name: str, *, low: int = 1) -> int:
    """A resources version from a path or query parameter: an integer from ``low`` up to SQLite's largest."""
    # ASCII only: str.isdigit() also takes superscripts (int() refuses them) and other scripts' digits
    if not (raw.isascii() and raw.isdigit()) or not low <= int(raw) <= _MAX_INT:
        raise ApiError(400 if name == "after" else 404, f"'{name}' must be an integer from {low} to 2**63 - 1, "
                                                        f"got {raw[:40]!r}", name)
    return int(raw)


def _bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {json.dumps(value)[:40]}", name)
    return value


def _status_param(q: Any) -> list[str] | None:
    statuses: list[str] = q.getlist("status")
    for status in statuses:
        if status not in _STATUSES:
            raise ApiError(400, f"query parameter 'status' must be one of {', '.join(_STATUSES)}, got {status!r}",
                           "status")
    return statuses or None


def _float_param(q: Any, name: str) -> float | None:
    raw = q.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ApiError(400, f"query parameter '{name}' must be a number, got {raw!r}", name) from None
    if not math.isfinite(value):
        raise ApiError(400, f"query parameter '{name}' must be a finite number, got {raw!r}", name)
    return value


def _bool_param(q: Any, name: str, default: bool = False) -> bool:
    raw = q.get(name)
    if raw is None:
        return default
    if raw.lower() in ("1", "true", "yes"):
        return True
    if raw.lower() in ("0", "false", "no"):
        return False
    raise ApiError(400, f"query parameter '{name}' must be true or false, got {raw!r}", name)


# ---------------------------------------------------------------------- error answers


async def _openapi(request: Request) -> Response:
    return Response(openapi_json(), media_type="application/json")


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _on_schema_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SchemaError)
    return error_response(400, str(exc), exc.field)


async def _on_lease_lost(request: Request, exc: Exception) -> Response:
    return error_response(409, str(exc), "lease_id")


async def _on_rollout_conflict(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RolloutConflict)
    return error_response(409, str(exc), f"Rollout.{exc.field}")


async def _on_store_error(request: Request, exc: Exception) -> Response:
    return error_response(503, f"the store could not do it: {exc}")


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(404, f"no route {request.method} {request.url.path}")
    if exc.status_code == 405:
        return error_response(405, f"{request.method} is not allowed on {request.url.path}")
    return error_response(exc.status_code, str(exc.detail))


# ---------------------------------------------------------------------- running


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket (``port`` 0: any free one); binding ourselves tells us the port before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that say so, and without it a
    # response written in two parts (headers, body) waits out the client's delayed ACK (40 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_config(server: TrainerServer, host: str, port: int, log_level: str) -> Any:
    import uvicorn

    from agl_trainer.read_timeouts import protocol

    config = server.config
    return uvicorn.Config(server.app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
                          timeout_graceful_shutdown=5, http=protocol(config.header_timeout_s, config.body_timeout_s))


def _run_async(main: Any, uvicorn_config: Any) -> None:
    """``asyncio.run(main)`` on the event loop uvicorn would pick (uvloop when installed)."""
    factory = getattr(uvicorn_config, "get_loop_factory", None)  # uvicorn >= 0.36
    with asyncio.Runner(loop_factory=factory() if factory is not None else None) as runner:
        runner.run(main)


def serve(server: TrainerServer, *, on_ready: Callable[[str], None] | None = None, log_level: str = "warning"
          ) -> None:
    """Run ``server`` on uvicorn until SIGINT/SIGTERM (blocking)."""
    import uvicorn

    config = server.config
    check_bind(config.host, config.token)
    sock = bind_socket(config.host, config.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    userver = uvicorn.Server(_uvicorn_config(server, config.host, port, log_level))

    async def main() -> None:
        task = asyncio.create_task(userver.serve(sockets=[sock]))
        while not userver.started and not task.done():
            await asyncio.sleep(0.01)
        if userver.started and on_ready is not None:
            on_ready(url)
        await task

    try:
        _run_async(main(), userver.config)
    finally:
        sock.close()
        server.close()


class ServerThread:
    """A server on uvicorn in a background thread (tests, the demo, a trainer hosting its own server)."""

    def __init__(self, server: TrainerServer, *, log_level: str = "warning") -> None:
        import uvicorn

        check_bind(server.config.host, server.config.token)
        self.server = server
        self._sock = bind_socket(server.config.host, server.config.port)
        host, port = self._sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._uvicorn = uvicorn.Server(_uvicorn_config(server, host, port, log_level))
        self._thread = threading.Thread(target=self._run, name="agl-serve", daemon=True)

    def _run(self) -> None:
        _run_async(self._uvicorn.serve(sockets=[self._sock]), self._uvicorn.config)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agl server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=15)
        self._sock.close()
        self.server.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
