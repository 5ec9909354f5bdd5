"""The dashboard ``agl serve`` shows at ``/``: rollouts, a rollout's span tree, training curves, per-agent stats.

A static page (``index.html``, ``app.js``, ``app.css`` in this folder: no build
step, nothing fetched from anywhere but this server) over the server's JSON API:

- ``GET /v1/dashboard/rollouts?status=...&limit=&offset=``: one page of rollouts,
  newest first, with their final reward, error and span count, and the counts by status;
- ``GET /v1/rollouts/{id}``: a rollout with its spans (the tree is drawn in the page);
- ``GET /v1/metrics``: reward, loss and the trainer's other metrics per step;
- ``GET /v1/stats?last=1000``: LLM and tool calls per agent over the newest ``last``
  rollouts (the agent is the nearest ``gen_ai.agent.name`` on the span or its ancestors,
  as ``TransitionBuilder`` names agents), their error rates and the window's mean final
  reward; all rollouts by status.

The page and its two files load without the bearer token; every JSON route
needs it. The page takes the token once from ``?token=`` (or a form when a
route answers 401), keeps it in ``sessionStorage`` (this tab only), drops it
from the address bar, and sends it as ``Authorization: Bearer``.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from importlib import resources
from typing import Any, get_args

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agl_core import semconv
from agl_core.schema import RolloutStatus
from agl_core.store.sqlite import SqliteStore
from agl_trainer.api import ApiError

__all__ = ["OPEN_PATHS", "Dashboard"]

_FILES: dict[str, tuple[str, str]] = {  # path -> (file in this folder, media type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/dashboard/app.css": ("app.css", "text/css; charset=utf-8"),
}
OPEN_PATHS = frozenset(_FILES)
"""The page's own files: served without the token, since they hold no data."""

# The page may talk to this server only, and run only its own script: a span attribute holding
# markup can never execute, and nothing leaks the token (no referrer, no third-party fetches).
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}

_STATUSES: tuple[str, ...] = get_args(RolloutStatus)
MAX_PAGE = 500
"""The most rollouts ``GET /v1/dashboard/rollouts`` answers in one page."""
DEFAULT_STATS_WINDOW = 1000
"""``GET /v1/stats`` counts the agents' calls over this many newest rollouts unless ``?last=`` says otherwise."""
MAX_STATS_WINDOW = 1_000_000
"""The largest ``?last=`` ``GET /v1/stats`` accepts."""
_TOOL_FAILURES = (semconv.TOOL_ERROR, semconv.TOOL_EXCEPTION, semconv.TOOL_TIMEOUT)


def _attr(name: str) -> str:
    return f"json_extract(data, '$.attributes.\"{name}\"')"


class Dashboard:
    """The page's files and the two JSON routes only it needs, over the server's store."""

    def __init__(self, store: SqliteStore) -> None:
        self.store = store
        self._agents_cache: tuple[tuple[Any, ...], list[dict[str, Any]]] | None = None

    def routes(self) -> list[Route]:
        return [
            *(Route(path, self._file(name, media), methods=["GET"]) for path, (name, media) in _FILES.items()),
            Route("/v1/dashboard/rollouts", self.get_rollouts, methods=["GET"]),
            Route("/v1/stats", self.get_stats, methods=["GET"]),
        ]

    @staticmethod
    def _file(name: str, media: str) -> Callable[[Request], Any]:
        async def serve_file(request: Request) -> Response:
            # read on each request: small files, and an edited page shows on reload
            body = resources.files(__name__).joinpath(name).read_bytes()
            return Response(body, media_type=media, headers=_HEADERS)

        return serve_file

    # ------------------------------------------------------------------ rollouts

    async def get_rollouts(self, request: Request) -> Response:
        q = request.query_params
        statuses = q.getlist("status")
        for status in statuses:
            if status not in _STATUSES:
                raise ApiError(400, f"query parameter 'status' must be one of {', '.join(_STATUSES)}; "
                                    f"got {status!r}", "status")
        limit = _int(q, "limit", 25, high=MAX_PAGE)
        offset = _int(q, "offset", 0, high=2**63 - 1)  # SQLite's integers end there
        page = await run_in_threadpool(self.rollouts_page, statuses, limit, offset)
        return _json(page)

    def rollouts_page(self, statuses: list[str], limit: int, offset: int) -> dict[str, Any]:
        """``{"data": [rollout summaries, newest first], "total": matching, "counts": {status: n}}``."""
        where = f" WHERE r.status IN ({', '.join('?' * len(statuses))})" if statuses else ""

        def work(conn: sqlite3.Connection) -> dict[str, Any]:
            rows = conn.execute(
                "SELECT r.id, r.task_id, r.attempt, r.status, r.start_time, r.end_time, r.final_reward,"
                " json_extract(r.data, '$.error'), (SELECT count(*) FROM spans s WHERE s.rollout_id = r.id)"
                f" FROM rollouts r{where} ORDER BY r.start_time DESC, r.rowid DESC LIMIT ? OFFSET ?",
                [*statuses, limit, offset]).fetchall()
            counts = dict(conn.execute("SELECT status, count(*) FROM rollouts GROUP BY status").fetchall())
            total = sum(n for s, n in counts.items() if not statuses or s in statuses)
            keys = ("id", "task_id", "attempt", "status", "start_time", "end_time", "final_reward", "error", "spans")
            return {"data": [dict(zip(keys, row, strict=True)) for row in rows], "total": total,
                    "offset": offset, "limit": limit, "counts": counts}

        return self.store._read(work)  # core's reader: its connection per thread, busy retries, StoreError

    # ------------------------------------------------------------------ stats

    async def get_stats(self, request: Request) -> Response:
        last = _int(request.query_params, "last", DEFAULT_STATS_WINDOW, high=MAX_STATS_WINDOW)
        return _json(await run_in_threadpool(self.stats, last))

    def stats(self, last: int = DEFAULT_STATS_WINDOW) -> dict[str, Any]:
        """LLM and tool calls per agent and the mean reward over the newest ``last`` rollouts; all by status.

        The agents' part reads every span of those rollouts, so it is kept until a span or a
        rollout is added (storing a rollout again writes its spans anew): a dashboard polling an
        idle server costs a few index lookups.
        """
        newest = "SELECT {} FROM rollouts ORDER BY start_time DESC, rowid DESC LIMIT ?"
        spans_sql = (
            f"SELECT rollout_id, span_id, json_extract(data, '$.parent_id'), json_extract(data, '$.status'),"
            f" {_attr(semconv.GEN_AI_OPERATION_NAME)}, {_attr(semconv.GEN_AI_AGENT_NAME)},"
            f" {_attr(semconv.ERROR_TYPE)}, {_attr(semconv.AGL_TOOL_STATUS)} FROM spans"
            f" WHERE rollout_id IN ({newest.format('id')}) ORDER BY rollout_id")

        def work(conn: sqlite3.Connection) -> tuple[list[Any], tuple[Any, ...], tuple[Any, ...], list[Any] | None]:
            by_status = conn.execute("SELECT status, count(*) FROM rollouts GROUP BY status").fetchall()
            window = conn.execute(f"SELECT count(*), avg(final_reward) FROM ({newest.format('final_reward')})",
                                  (last,)).fetchone()
            key = (last, conn.execute("SELECT max(rowid) FROM spans").fetchone()[0],
                   *conn.execute("SELECT max(rowid), count(*) FROM rollouts").fetchone())
            cached = self._agents_cache
            if cached is not None and cached[0] == key:
                return by_status, window, key, None
            return by_status, window, key, conn.execute(spans_sql, (last,)).fetchall()

        by_status, (in_window, reward_mean), key, spans = self.store._read(work)
        if spans is None:
            assert self._agents_cache is not None
            agents = self._agents_cache[1]
        else:
            agents = _agent_rows(spans)
            self._agents_cache = (key, agents)
        return {"agents": agents, "window": {"last": last, "rollouts": in_window, "reward_mean": reward_mean},
                "rollouts": {"total": sum(n for _, n in by_status), "by_status": dict(by_status)}}


def _agent_rows(spans: list[Any]) -> list[dict[str, Any]]:
    """Per-agent rows from spans sorted by rollout."""
    agents: dict[str | None, dict[str, Any]] = {}
    start = 0
    while start < len(spans):
        end = start
        while end < len(spans) and spans[end][0] == spans[start][0]:
            end += 1
        _count_rollout(spans[start:end], agents)
        start = end
    rows = []
    for name, c in agents.items():
        seen = c.pop("_rollouts")
        rows.append({"agent": name, "rollouts": len(seen), **c,
                     "llm_error_rate": c["llm_errors"] / c["llm_calls"] if c["llm_calls"] else 0.0,
                     "tool_error_rate": c["tool_errors"] / c["tool_calls"] if c["tool_calls"] else 0.0})
    rows.sort(key=lambda r: (-r["llm_calls"], -r["tool_calls"], r["agent"] or ""))
    return rows


def _count_rollout(spans: list[Any], agents: dict[str | None, dict[str, Any]]) -> None:
    """Add one rollout's LLM and tool calls to ``agents``; a call nested in a call of its kind counts once."""
    by_id = {s[1]: s for s in spans}
    for rollout_id, _, parent, status, op, own_agent, error_type, tool_status in spans:
        if op in semconv.LLM_OPERATIONS:
            kind, failed = "llm", status == "error" or error_type is not None
        elif op == semconv.OP_EXECUTE_TOOL:
            kind, failed = "tool", status == "error" or error_type is not None or tool_status in _TOOL_FAILURES
        else:
            continue
        agent: str | None = own_agent if isinstance(own_agent, str) and own_agent else None
        nested = False
        seen = 0
        up = by_id.get(parent) if parent else None
        while up is not None and seen < 10_000:
            if (up[4] in semconv.LLM_OPERATIONS) if kind == "llm" else (up[4] == semconv.OP_EXECUTE_TOOL):
                nested = True
                break
            if agent is None and isinstance(up[5], str) and up[5]:
                agent = up[5]
            up = by_id.get(up[2]) if up[2] else None
            seen += 1
        if nested:
            continue
        c = agents.setdefault(agent, {"llm_calls": 0, "llm_errors": 0, "tool_calls": 0, "tool_errors": 0,
                                      "_rollouts": set()})
        c[f"{kind}_calls"] += 1
        c[f"{kind}_errors"] += int(failed)
        c["_rollouts"].add(rollout_id)


def _int(q: Any, name: str, default: int, *, high: int | None = None) -> int:
    raw = q.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"query parameter '{name}' must be an integer, got {raw!r}", name) from None
    if value < 0 or (high is not None and value > high):
        bound = f" and at most {high}" if high is not None else ""
        raise ApiError(400, f"query parameter '{name}' must be 0 or more{bound}, got {value}", name)
    return value


def _json(data: Any) -> Response:
    return Response(json.dumps(data, ensure_ascii=False, separators=(",", ":")), media_type="application/json")
