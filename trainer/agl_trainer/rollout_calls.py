"""Gateway-only capture: an agent's calls through a rollout-scoped base URL are that rollout's LLM calls.

``{server}/rollouts/{rollout_id}/v1`` is an OpenAI base URL (``POST .../chat/completions``,
plain and streamed, ``POST .../responses``, the Responses API answered through the chat path,
and ``GET .../models``), and so is the plain ``{server}/v1`` with the header
``X-Agl-Rollout-Id: {rollout_id}``. An agent that lets you set nothing but its base URL, in any
language and with no tracing, then yields a rollout whose transitions are its calls in the order
the gateway received them, with the engine's exact token ids (``token_source="gateway"``) and the
tool calls as the model produced them: the gateway writes one LLM span per call (GenAI
conventions, ``agl.plugin="gateway"``) from the request it relayed and the reply it sent back.

The rollout must be open: stored with ``status: "running"`` (``POST /v1/rollouts {"id", "task_id",
"status": "running"}``; ``agl worker --command`` does it for each lease). A call for a rollout the
server has never heard of is a 404 and one for a finished rollout a 409, both naming
``rollout_id``, so a mistyped id fails at the first call rather than leaving a rollout with
nothing to train on. ``POST /v1/rollouts`` with the rollout's finished ``status`` and its
``rewards`` (no spans needed) finishes it; its calls join it there.

Merging with instrumented spans: an agent that is traced as well (agl's plugins, or any client
that sends a W3C ``traceparent``) has its own LLM span for each call. The gateway's span of that
call is stored as a child of the client's span (the traceparent's parent id), and core's
``TransitionBuilder`` merges nested LLM spans into one transition: the agent identity from the
outer span, the token ids from the gateway. A call whose client sent no traceparent is matched to
an LLM span of the rollout without gateway ids by what the model answered (text and tool calls),
in order. So a call is one transition however it was seen.

A reward posted in ``rewards`` with no span of its own (``span_id`` null: an agent that only
POSTs its result) becomes a reward span, so the builder sees it: the final reward (no ``name``)
as such, an intermediate one at its ``time_ns`` (on the call before it; without one, on the last call).

The calls are held in memory (and written to the server's SQLite file, so they survive a restart)
until their rollout is stored, then dropped; a rollout never finished drops them after ``ttl_s``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import secrets
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agl_core import semconv
from agl_core.encoding import dumps, sampling_attributes
from agl_core.messages import from_genai, many_to_genai, to_genai
from agl_core.schema import Rollout, Span
from agl_core.store.sqlite import SqliteStore
from agl_core.transitions import is_llm_span
from agl_trainer.api import ApiError
from agl_trainer.token_records import MODEL_VERSION_ATTRIBUTE, TokenRecord

__all__ = ["ROLLOUT_HEADER", "CallCapture", "RolloutCalls", "adopt_calls", "check_rollout_id", "gateway_spans"]

logger = logging.getLogger("agl.trainer")

ROLLOUT_HEADER = "x-agl-rollout-id"
"""The header that scopes a call to ``/v1/chat/completions`` to a rollout, as the URL ``/rollouts/{id}/v1`` does."""
PLUGIN = "gateway"
"""``agl.plugin`` of the spans the gateway writes."""

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
_FINISHED = ("succeeded", "failed", "timeout", "cancelled")
_Key = tuple[str, str]


def check_rollout_id(raw: Any, where: str) -> str:
    """A rollout id as a URL path segment or header can carry it; ApiError 400 naming ``rollout_id`` otherwise."""
    if not isinstance(raw, str) or not _ID.fullmatch(raw):
        raise ApiError(400, f"the rollout id in {where} must be 1 to 200 letters, digits, '.', '_', ':' or '-' "
                            f"(starting with a letter or digit), got {json.dumps(raw)[:80]}", "rollout_id")
    return raw


class _Reply:
    """The assistant message of a chat reply, folded from the reply or from its stream chunks (first choice)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.message: dict[str, Any] | None = None  # a plain reply's message, as it came
        self.finish_reason: str | None = None
        self.model: str | None = None
        self.response_id: str | None = None
        self.usage: Any = None

    def add(self, data: Mapping[str, Any]) -> None:
        self.model = self.model or _str(data.get("model"))
        self.response_id = self.response_id or _str(data.get("id"))
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]
        choices = data.get("choices")
        first = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None) \
            if isinstance(choices, list) else None
        if first is None:
            return
        self.finish_reason = _str(first.get("finish_reason")) or self.finish_reason
        if isinstance(first.get("message"), dict):
            self.message = first["message"]
        delta = first.get("delta")
        if isinstance(delta, dict):
            if isinstance(delta.get("content"), str):
                self.content.append(delta["content"])
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str):
                self.reasoning.append(reasoning)
            for piece in delta.get("tool_calls") or ():
                if isinstance(piece, dict):
                    self._add_call(piece)

    def _add_call(self, piece: dict[str, Any]) -> None:
        index = piece.get("index", 0)
        call = self.calls.setdefault(index if isinstance(index, int) else 0,
                                     {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
        if piece.get("id"):
            call["id"] = piece["id"]
        fn = piece.get("function")
        if isinstance(fn, dict):
            if fn.get("name"):
                call["function"]["name"] = fn["name"]
            if isinstance(fn.get("arguments"), str):
                call["function"]["arguments"] += fn["arguments"]

    def assistant(self) -> dict[str, Any]:
        if self.message is not None:
            return {"role": "assistant", **{k: v for k, v in self.message.items() if k != "role"}}
        out: dict[str, Any] = {"role": "assistant",
                               "content": "".join(self.content) if self.content or not self.calls else None}
        if self.calls:
            out["tool_calls"] = [call for _, call in sorted(self.calls.items())]
        if self.reasoning:
            out["reasoning_content"] = "".join(self.reasoning)
        return out


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


class CallCapture:
    """One scoped call in flight: fed the reply (or each chunk), then :meth:`done` with the gateway's record."""

    def __init__(self, calls: RolloutCalls, rollout_id: str, body: dict[str, Any], key: _Key | None) -> None:
        self.calls = calls
        self.rollout_id = rollout_id
        self.body = body
        self.key = key
        self.start_ns = time.time_ns()
        self.reply = _Reply()

    def add(self, data: Mapping[str, Any]) -> None:
        self.reply.add(data)

    def done(self, record: TokenRecord | None) -> None:
        """The call was answered whole: it joins its rollout (nothing is kept of a call that did not finish)."""
        try:
            span = self.span(record)
        except Exception as exc:  # noqa: BLE001 - the agent has its answer; its rollout lists the call as skipped
            logger.exception("agl gateway: could not keep a call of rollout %s", self.rollout_id)
            trace_id, parent = self.key if self.key is not None else (_trace_of(self.rollout_id), None)
            span = Span(span_id=secrets.token_hex(8), trace_id=trace_id, parent_id=parent, name=semconv.OP_CHAT,
                        start_ns=self.start_ns, end_ns=max(time.time_ns(), self.start_ns),
                        attributes={semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT, semconv.AGL_PLUGIN: PLUGIN,
                                    semconv.AGL_ROLLOUT_ID: self.rollout_id, semconv.ERROR_TYPE: type(exc).__name__},
                        status="error", status_message=f"the gateway could not read this call: {exc}",
                        rollout_id=self.rollout_id)
        self.calls.add(self.rollout_id, span)

    def span(self, record: TokenRecord | None) -> Span:
        body, reply = self.body, self.reply
        attrs: dict[str, Any] = {
            semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
            semconv.GEN_AI_PROVIDER_NAME: "agl",
            semconv.AGL_PLUGIN: PLUGIN,
            semconv.AGL_ROLLOUT_ID: self.rollout_id,
            semconv.GEN_AI_REQUEST_STREAM: body.get("stream") is True,
            semconv.GEN_AI_INPUT_MESSAGES: dumps(many_to_genai(body.get("messages") or [])),
            semconv.GEN_AI_OUTPUT_MESSAGES: dumps([to_genai(reply.assistant(), reply.finish_reason)]),
        }
        sampling_attributes(body.get, attrs)
        if isinstance(body.get("model"), str):
            attrs[semconv.GEN_AI_REQUEST_MODEL] = body["model"]
        if body.get("tools"):
            attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = dumps(body["tools"])
        if reply.model:
            attrs[semconv.GEN_AI_RESPONSE_MODEL] = reply.model
        if reply.response_id:
            attrs[semconv.GEN_AI_RESPONSE_ID] = reply.response_id
        if reply.finish_reason:
            attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = [reply.finish_reason]
        usage = reply.usage or {}
        for name, attr in (("prompt_tokens", semconv.GEN_AI_USAGE_INPUT_TOKENS),
                           ("completion_tokens", semconv.GEN_AI_USAGE_OUTPUT_TOKENS)):
            if type(usage.get(name)) is int:
                attrs[attr] = usage[name]
        if record is not None:
            attrs[semconv.AGL_PROMPT_TOKEN_IDS] = list(record.prompt_token_ids)
            attrs[semconv.AGL_RESPONSE_TOKEN_IDS] = list(record.response_token_ids)
            if record.response_logprobs is not None:
                attrs[semconv.AGL_RESPONSE_LOGPROBS] = list(record.response_logprobs)
            attrs[semconv.AGL_TOKEN_SOURCE] = "gateway"
            attrs[MODEL_VERSION_ATTRIBUTE] = record.model_version
        # the client's span is the parent: the builder merges the two into one transition
        trace_id, parent = self.key if self.key is not None else (_trace_of(self.rollout_id), None)
        return Span(span_id=secrets.token_hex(8), trace_id=trace_id, parent_id=parent,
                    name=semconv.chat_span_name(reply.model or attrs.get(semconv.GEN_AI_REQUEST_MODEL)),
                    start_ns=self.start_ns, end_ns=max(time.time_ns(), self.start_ns), attributes=attrs,
                    rollout_id=self.rollout_id)


def _size(span: Span) -> int:
    """About what a call's span holds in memory: its message JSON, token ids and logprobs, and overhead."""
    a = span.attributes
    return (600 + len(a.get(semconv.GEN_AI_INPUT_MESSAGES, "")) + len(a.get(semconv.GEN_AI_OUTPUT_MESSAGES, ""))
            + len(a.get(semconv.GEN_AI_TOOL_DEFINITIONS, "")) + 36 * len(a.get(semconv.AGL_PROMPT_TOKEN_IDS, ()))
            + 68 * len(a.get(semconv.AGL_RESPONSE_TOKEN_IDS, ())))


def _trace_of(rollout_id: str) -> str:
    """The trace id of a rollout's untraced calls: the rollout id when it is one (OTLP's), else a hash of it."""
    if re.fullmatch(r"[0-9a-f]{32}", rollout_id) and rollout_id != "0" * 32:
        return rollout_id
    return hashlib.sha256(rollout_id.encode()).hexdigest()[:32]


_SCHEMA = """CREATE TABLE IF NOT EXISTS trainer_rollout_calls (
    rollout_id TEXT NOT NULL,
    span_id TEXT NOT NULL,
    created REAL NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (rollout_id, span_id)
)"""


class RolloutCalls:
    """The gateway's spans of scoped calls, per rollout, until the rollout is stored (see the module docstring).

    With ``path`` (the server's SQLite file) a background thread writes new calls there every
    ``flush_interval_s``, as :class:`~agl_trainer.token_records.TokenRecords` does, so a call answered
    before a restart still joins its rollout after it. Memory is bounded by ``max_bytes`` (about what the
    spans' attributes hold): past it the oldest rollouts' calls leave memory, with one warning, and stay
    in the file.
    """

    def __init__(self, store: SqliteStore, path: str | None = None, *, ttl_s: float = 6 * 3600.0,
                 max_rollouts: int = 100_000, max_bytes: int = 256 * 1024 * 1024,
                 flush_interval_s: float = 0.25) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_rollouts = max_rollouts
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._calls: OrderedDict[str, list[Span]] = OrderedDict()
        self._bytes = 0
        self._open: OrderedDict[str, float] = OrderedDict()  # rollout ids found running: no store read per call
        self._pending: list[Span] = []
        self._finished: OrderedDict[str, str] = OrderedDict()  # rollout id -> status, of rollouts stored finished
        self.captured = 0
        self.evicted = 0
        self.late = 0
        """Calls answered after their rollout was stored finished: in no trajectory (each one said in the log)."""
        self._conn: sqlite3.Connection | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._db_lock = threading.Lock()
        self._in_file: set[str] = set()
        if path is not None:
            self._conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
            self._conn.execute("PRAGMA busy_timeout = 30000")
            self._conn.execute(_SCHEMA)
            # the rollouts with calls in the file (from before a restart too): any other's post reads nothing there
            self._in_file = {row[0] for row in
                             self._conn.execute("SELECT DISTINCT rollout_id FROM trainer_rollout_calls")}
            self._flush_interval = flush_interval_s
            self._thread = threading.Thread(target=self._flusher, name="agl-rollout-calls", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the gateway's side

    async def capture(self, request: Request, endpoint: str, body: dict[str, Any],
                      key: _Key | None) -> CallCapture | None:
        """The capture of this request when it is scoped to a rollout; ApiError 400/404/409 naming ``rollout_id``."""
        in_path = request.path_params.get("rollout_id")
        in_header = request.headers.get(ROLLOUT_HEADER)
        if in_path is None and in_header is None:
            return None
        if endpoint != "chat/completions":
            raise ApiError(400, "a rollout's calls are chat completions: X-Agl-Rollout-Id is not taken on "
                                f"/v1/{endpoint}", "rollout_id")
        if in_path is not None:
            rollout_id = check_rollout_id(in_path, "the URL /rollouts/{rollout_id}/v1")
            if in_header is not None and in_header != rollout_id:
                raise ApiError(400, f"the header X-Agl-Rollout-Id ({in_header[:80]!r}) names another rollout than "
                                    f"the URL ({rollout_id!r}): send one of them", "rollout_id")
        else:
            rollout_id = check_rollout_id(in_header, "the header X-Agl-Rollout-Id")
        await self._check_open(rollout_id)
        return CallCapture(self, rollout_id, body, key)

    async def _check_open(self, rollout_id: str) -> None:
        with self._lock:
            if rollout_id in self._open:
                return
        stored = await run_in_threadpool(lambda: self.store.get_rollout(rollout_id, with_spans=False))
        if stored is None:
            raise ApiError(404, f"no rollout {rollout_id!r} is open for calls: open it first with POST /v1/rollouts "
                                f"{{\"id\": \"{rollout_id}\", \"task_id\": ..., \"status\": \"running\"}} (agl worker "
                                "--command does this for each task), and check the id in the base URL", "rollout_id")
        if stored.status in _FINISHED:
            raise ApiError(409, f"rollout {rollout_id!r} is finished ({stored.status}): its calls can no longer be "
                                "added; a new attempt is a new rollout with its own id", "rollout_id")
        with self._lock:
            self._open[rollout_id] = time.time()
            while len(self._open) > self.max_rollouts:
                self._open.popitem(last=False)

    def add(self, rollout_id: str, span: Span) -> None:
        evicted = 0
        with self._lock:
            finished = self._finished.get(rollout_id)
            if finished is not None:  # it was open when the call came; no post will take the call now
                self.late += 1
            else:
                self._hold(rollout_id, span)
                cutoff = time.time_ns() - int(self.ttl_s * 1e9)
                while len(self._calls) > 1:
                    oldest, spans = next(iter(self._calls.items()))
                    over = len(self._calls) > self.max_rollouts or self._bytes > self.max_bytes
                    if not over and spans[-1].end_ns >= cutoff:
                        break
                    del self._calls[oldest]
                    self._bytes -= sum(_size(s) for s in spans)
                    evicted += over
                    if self._conn is not None:
                        self._in_file.add(oldest)  # its calls are on their way to the file, or in it
            first = evicted and self.evicted == 0
            self.evicted += evicted
        if finished is not None:
            _said_late(rollout_id, finished, 1)
            return
        if first:
            where = "they stay in the server's file and still join their rollouts" if self._conn is not None else \
                "without a file their calls are lost"
            logger.warning("agl gateway: the calls of open rollouts hold more than %d MiB of memory; the oldest "
                           "rollouts' calls leave memory (%s); finish rollouts with POST /v1/rollouts",
                           self.max_bytes // (1024 * 1024), where)

    def _hold(self, rollout_id: str, span: Span) -> None:
        """Keep ``span`` until its rollout is stored (the lock held)."""
        self._calls.setdefault(rollout_id, []).append(span)
        self._calls.move_to_end(rollout_id)
        self._bytes += _size(span)
        self.captured += 1
        if self._conn is not None:
            self._pending.append(span)  # encoded by the flusher, off the gateway's path

    # ------------------------------------------------------------------ the rollout's side

    def pending(self, rollout_id: str) -> list[Span]:
        """The calls of ``rollout_id`` not yet stored with it, in the order they were answered."""
        with self._lock:
            found = list(self._calls.get(rollout_id, ()))
            elsewhere = rollout_id in self._in_file
        if self._conn is None or not (found or elsewhere):  # what is in memory is in the file or on its way
            return found
        self.flush()
        with self._db_lock:
            rows = self._conn.execute("SELECT data FROM trainer_rollout_calls WHERE rollout_id = ?",
                                      (rollout_id,)).fetchall()
        have = {s.span_id for s in found}
        found += [span for span in (Span.from_json(row[0]) for row in rows) if span.span_id not in have]
        return sorted(found, key=lambda s: (s.start_ns, s.end_ns))

    def spans_of(self, rollout: Rollout) -> list[Span]:
        """The rollout's posted spans with its gateway calls (each under its client's span) and reward spans.

        Once merged with what is stored, :func:`adopt_calls` places the calls whose client span is not known.
        """
        return gateway_spans(rollout, self.pending(rollout.id))

    def stored(self, rollout: Rollout) -> None:
        """``rollout`` was stored with its calls: drop those (a call answered meanwhile waits for the next post);
        a finished rollout takes no more."""
        kept = {s.span_id for s in rollout.spans}
        finished = rollout.status in _FINISHED
        with self._lock:
            spans = self._calls.pop(rollout.id, [])
            was_open = self._open.get(rollout.id) is not None or bool(spans) or rollout.id in self._in_file
            if not was_open:  # a rollout that never took a scoped call: nothing of it here, nothing to read
                return
            later = [s for s in spans if s.span_id not in kept]
            if later and not finished:
                self._calls[rollout.id] = later
            self._bytes -= sum(_size(s) for s in (spans if finished else [s for s in spans if s.span_id in kept]))
            if finished:
                self._open.pop(rollout.id, None)
                self._finished[rollout.id] = rollout.status
                while len(self._finished) > self.max_rollouts:
                    self._finished.popitem(last=False)
                self.late += len(later)
        if finished and later:
            _said_late(rollout.id, rollout.status, len(later))
        if self._conn is not None:
            self.flush()
            with self._db_lock:
                if finished:  # what it did not take, no post will
                    self._conn.execute("DELETE FROM trainer_rollout_calls WHERE rollout_id = ?", (rollout.id,))
                    with self._lock:
                        self._in_file.discard(rollout.id)
                else:
                    self._conn.execute("DELETE FROM trainer_rollout_calls WHERE rollout_id = ? AND span_id IN "
                                       "(SELECT value FROM json_each(?))", (rollout.id, json.dumps(sorted(kept))))

    def flush(self) -> None:
        """Write every call not yet in the file."""
        if self._conn is None:
            return
        with self._lock:
            pending, self._pending = self._pending, []
            self._in_file.update(str(s.rollout_id) for s in pending)  # a reader waits for the write (the db lock)
        if not pending:
            return
        rows = [(s.rollout_id, s.span_id, s.end_ns / 1e9, s.to_json()) for s in pending]
        with self._db_lock:
            self._conn.executemany("INSERT OR REPLACE INTO trainer_rollout_calls (rollout_id, span_id, created, data)"
                                   " VALUES (?, ?, ?, ?)", rows)

    def _flusher(self) -> None:
        last_sweep = time.monotonic()
        while not self._stop.wait(self._flush_interval):
            try:
                self.flush()
                if time.monotonic() - last_sweep > 60 and self._conn is not None:
                    last_sweep = time.monotonic()
                    with self._db_lock:
                        self._conn.execute("DELETE FROM trainer_rollout_calls WHERE created < ?",
                                           (time.time() - self.ttl_s,))
            except sqlite3.Error as exc:  # the calls stay in memory; only a restart could lose them
                logger.warning("agl gateway: could not persist the calls of open rollouts: %s", exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._conn is not None:
            self.flush()
            self._conn.close()
            self._conn = None

    # ------------------------------------------------------------------ routes

    def routes(self, chat: Callable[[Request], Any], models: Callable[[Request], Any],
               responses: Callable[[Request], Any] | None = None) -> list[Route]:
        async def scoped_models(request: Request) -> Response:
            check_rollout_id(request.path_params["rollout_id"], "the URL /rollouts/{rollout_id}/v1")
            response: Response = await models(request)
            return response

        routes = [
            Route("/rollouts/{rollout_id}/v1/chat/completions", chat, methods=["POST"]),
            Route("/rollouts/{rollout_id}/v1/models", scoped_models, methods=["GET"]),
        ]
        if responses is not None:  # the Responses API, answered through the chat path (agl_trainer.responses_api)
            routes.append(Route("/rollouts/{rollout_id}/v1/responses", responses, methods=["POST"]))
        return routes


def gateway_spans(rollout: Rollout, calls: Sequence[Span]) -> list[Span]:
    """``rollout.spans`` with ``calls`` (the gateway's spans of its scoped calls) and its span-less rewards' spans.

    A call already among the spans (a rollout posted again) is not added twice.
    """
    spans = list(rollout.spans)
    have = {s.span_id for s in spans}
    spans += [c for c in calls if c.span_id not in have]
    spans += _reward_spans(rollout, have)
    return sorted(spans, key=lambda s: (s.start_ns, s.end_ns))


def adopt_calls(spans: Sequence[Span]) -> list[Span]:
    """A rollout's whole span list with each orphan gateway span put under the LLM span that gave its answer.

    An orphan is a gateway span whose parent is not among ``spans``: its client sent no traceparent
    (spans exported by another SDK), or its client span came in another post. It goes under the
    rollout's first LLM span, not the gateway's and without gateway ids or a gateway child yet, that
    answered the same (text and tool calls); so the two are one transition, and an answer no other
    span gave stays a transition of its own. Run on the merged list, so spans that arrive after
    the calls (a late exporter batch) still find them.
    """
    ids = {s.span_id for s in spans}
    ours = [s for s in spans if s.attributes.get(semconv.AGL_PLUGIN) == PLUGIN and is_llm_span(s)]
    orphans = [s for s in ours if s.parent_id not in ids]
    if not orphans:
        return list(spans)
    parents = {s.parent_id for s in ours if s.parent_id in ids}
    candidates: dict[Any, list[Span]] = {}
    for span in sorted(spans, key=lambda s: s.start_ns):
        if is_llm_span(span) and span.span_id not in parents and \
                span.attributes.get(semconv.AGL_TOKEN_SOURCE) != "gateway" and \
                span.attributes.get(semconv.AGL_PLUGIN) != PLUGIN:
            signature = _answer(span)
            if signature is not None:
                candidates.setdefault(signature, []).append(span)
    moved: dict[str, Span] = {}
    for call in sorted(orphans, key=lambda s: s.start_ns):
        match = candidates.get(_answer(call))
        if match:
            parent = match.pop(0)
            moved[call.span_id] = dataclasses.replace(call, trace_id=parent.trace_id, parent_id=parent.span_id)
    return [moved.get(s.span_id, s) for s in spans]


def _said_late(rollout_id: str, status: str, count: int) -> None:
    logger.warning("agl gateway: %d call(s) of rollout %r were answered after it was stored %s: they are in no "
                   "trajectory and are not trained; finish a rollout only once its agent's calls have returned "
                   "(an agent that times out and leaves a call running loses it so)", count, rollout_id, status)


def _answer(span: Span) -> Any:
    """What the model answered on this LLM span: (text, ((tool, arguments), ...)); None when unknown."""
    raw = span.attributes.get(semconv.GEN_AI_OUTPUT_MESSAGES)
    try:
        messages = json.loads(raw) if isinstance(raw, str) else raw
        message = from_genai(messages[0])
    except (ValueError, TypeError, LookupError, AttributeError):
        return None
    content = message.get("content")
    text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
    calls = tuple((str((c.get("function") or {}).get("name")), str((c.get("function") or {}).get("arguments")))
                  for c in message.get("tool_calls") or ())
    return (text or "", calls) if text or calls else None


def _reward_spans(rollout: Rollout, have: set[str]) -> list[Span]:
    """A reward span for each of ``rollout.rewards`` that has none (posted without spans); their ids set on them."""
    out = []
    end_ns = int((rollout.end_time or time.time()) * 1e9)
    seen: dict[tuple[Any, ...], int] = {}
    for reward in rollout.rewards:
        if reward.span_id is not None and reward.span_id in have:
            continue
        # the id is what the reward is (and which of its equals in this post), not its place in the list: a later
        # post (the finishing one after a running one) lists other rewards at the same places, and the same id
        # would replace a stored reward span; a retry of the same post still gives the same ids
        what = (reward.name, reward.value, reward.time_ns)
        seen[what] = seen.get(what, 0) + 1
        key = f"{rollout.id}:reward:{reward.name}:{reward.value!r}:{reward.time_ns}:{seen[what]}"
        span_id = reward.span_id or hashlib.sha256(key.encode()).hexdigest()[:16]
        if span_id in have:
            continue
        attrs: dict[str, Any] = {semconv.AGL_SPAN_KIND: semconv.KIND_REWARD, semconv.AGL_REWARD_VALUE: reward.value}
        if reward.name is not None:
            attrs[semconv.AGL_REWARD_NAME] = reward.name
        at = reward.time_ns or end_ns
        out.append(Span(span_id=span_id, trace_id=_trace_of(rollout.id), name=semconv.SPAN_REWARD, start_ns=at,
                        end_ns=at, attributes=attrs, rollout_id=rollout.id))
        reward.span_id = span_id
        have.add(span_id)
    return out
