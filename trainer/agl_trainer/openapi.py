"""The server's OpenAPI 3.1 document, served at ``GET /openapi.json``.

Written out as data, route by route, from what the handlers in
:mod:`agl_trainer.server` and :mod:`agl_trainer.gateway` accept and answer:
request bodies and query parameters with the bounds the server enforces, and
every error status a route can give (all errors have the OpenAI shape, see
:mod:`agl_trainer.api`). The record types (``Rollout``, ``Span``,
``Transition``, ``Trajectory``) are core's own JSON Schema
(``agl_core/schemas/agl.v1.schema.json``), so the two cannot drift apart.
The listings are paged (:mod:`agl_trainer.paging`); the dashboard's two JSON
routes (``/v1/dashboard/rollouts``, ``/v1/stats``) are documented too, its page
and static files are not.
``tests/scale/test_openapi.py`` checks the document against the live server
with schemathesis, and that every route of the app is in it.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from agl_trainer import dashboard
from agl_trainer.gateway import MAX_TOKEN_ID
from agl_trainer.paging import DEFAULT_LIMIT, MAX_LIMIT
from agl_trainer.queue import MAX_TASKS_PER_CALL
from agl_trainer.resources import MAX_RESOURCE_NAME
from agl_trainer.token_records import MAX_MODEL_VERSION, MAX_VERSION_STEP

__all__ = ["openapi_document", "openapi_json"]

MAX_LEASE_WAIT_S = 60.0
SQLITE_MAX_INT = 2**63 - 1

Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


_STRING = {"type": "string"}
_NON_EMPTY = {"type": "string", "minLength": 1}
_COUNT = {"type": "integer", "minimum": 0}


def _obj(properties: dict[str, Schema], required: tuple[str, ...] = (), *, extra: bool = False) -> Schema:
    out: Schema = {"type": "object", "properties": properties, "additionalProperties": extra}
    if required:
        out["required"] = list(required)
    return out


def _core_schemas() -> dict[str, Schema]:
    """Core's record schemas, with their ``$defs`` references pointed at ``components/schemas``."""
    text = resources.files("agl_core").joinpath("schemas/agl.v1.schema.json").read_text(encoding="utf-8")
    text = text.replace('"#/$defs/', '"#/components/schemas/')
    defs: dict[str, Schema] = json.loads(text)["$defs"]
    return defs


_ERROR = _obj({"error": _obj({
    "message": _STRING,
    "type": _STRING,
    "param": _nullable(_STRING),
    "code": {"type": "integer"},
}, ("message", "type", "param", "code"))}, ("error",))

_LEASE = _obj({
    "lease_id": _STRING, "task_id": _STRING, "attempt": {"type": "integer", "minimum": 1}, "group_id": _STRING,
    "task": {}, "worker_id": _STRING, "deadline": {"type": "number"}, "lease_timeout": {"type": "number"},
}, ("lease_id", "task_id", "attempt", "group_id", "task", "worker_id", "deadline", "lease_timeout"))

_ATTEMPT = _obj({
    "attempt": {"type": "integer"}, "lease_id": _STRING, "worker_id": _nullable(_STRING),
    "started": {"type": "number"}, "ended": _nullable({"type": "number"}), "outcome": _nullable(_STRING),
    "rollout_id": _nullable(_STRING),
}, ("attempt", "lease_id", "worker_id", "started", "ended", "outcome", "rollout_id"))

_TASK_STATES = ["queued", "leased", "done", "failed"]
_ROLLOUT_STATUSES = ["running", "succeeded", "failed", "timeout", "cancelled"]

_TASK_INFO = _obj({
    "task_id": _STRING, "group_id": _STRING, "task": {}, "state": {"enum": _TASK_STATES},
    "attempt": _COUNT, "max_attempts": {"type": "integer", "minimum": 1}, "released": _COUNT,
    "rollout_id": _nullable(_STRING), "error": _nullable(_STRING), "lease_id": _nullable(_STRING),
    "worker_id": _nullable(_STRING), "deadline": _nullable({"type": "number"}),
    "not_before": {**_nullable({"type": "number"}), "description": "A queued task whose last try failed waits "
                                                                    "until then (epoch seconds) for its next lease."},
    "attempts": {"type": "array", "items": _ATTEMPT},
}, ("task_id", "group_id", "task", "state", "attempt", "max_attempts", "released", "rollout_id", "error",
    "lease_id", "worker_id", "deadline", "not_before", "attempts"))

_ENQUEUE = _obj({
    "tasks": {"type": "array", "maxItems": MAX_TASKS_PER_CALL, "items": _obj({
        "task": {"description": "The task payload: any JSON a rollout can carry (nesting at most 64 levels, "
                                "finite numbers, unicode text, at most the server's task size); a dict's task_id "
                                "or id key names the task."},
        "task_id": _nullable(_NON_EMPTY),
        "group_id": _nullable(_NON_EMPTY),
    }, ("task",))},
    "repeat": {"type": "integer", "minimum": 1, "maximum": SQLITE_MAX_INT,
               "description": f"Copies of each task (a GRPO group); tasks times repeat is at most "
                              f"{MAX_TASKS_PER_CALL}."},
    "group_id": _nullable(_NON_EMPTY),
    "max_attempts": _nullable({"type": "integer", "minimum": 1, "maximum": SQLITE_MAX_INT}),
}, ("tasks",), extra=True)

_LEASE_REQUEST = _obj({
    "worker_id": _NON_EMPTY,
    "wait_s": {"type": "number", "minimum": 0, "maximum": MAX_LEASE_WAIT_S},
    "lease_timeout": _nullable({"type": "number", "exclusiveMinimum": 0}),
}, extra=True)

_RESOURCES = {"type": "object", "propertyNames": {"minLength": 1, "maxLength": MAX_RESOURCE_NAME},
              "description": "Resource name (not blank) to any JSON value: a prompt template, a few-shot list, ..."}

_RESOURCES_VERSION = _obj({
    "version": {"type": "integer", "minimum": 1}, "resources": _RESOURCES, "metadata": {"type": "object"},
    "created_at": {"type": "number"}, "current": {"type": "boolean"},
}, ("version", "resources", "metadata", "created_at", "current"))

_ROLLOUT_SUMMARY = _obj({
    "rollout_id": _STRING, "task_id": _STRING, "attempt": {"type": "integer"}, "status": {"enum": _ROLLOUT_STATUSES},
    "transitions": _COUNT, "token_sources": {"type": "object", "additionalProperties": _COUNT}, "joined": _COUNT,
    "skipped": {"type": "array", "items": _ref("Skipped")}, "already_stored": {"type": "boolean"},
}, ("rollout_id", "task_id", "attempt", "status", "transitions"))

_MODEL = _obj({
    "model": _nullable(_STRING), "version": _COUNT, "weights": _nullable(_STRING), "updated_at": {"type": "number"},
    "sampling": {"type": "object", "description": "The gateway's sampling overrides (a training run's pin them, "
                                                  "see training_sampling), which a trainer checks against its own."},
}, ("model", "version", "weights", "updated_at", "sampling"))

_BUILDER = _obj({"settings": {"type": "object"}, "source": _STRING}, ("settings", "source"))

_MESSAGE = _obj({
    "role": {"enum": ["system", "developer", "user", "assistant", "tool", "function"]},
    "content": _nullable({"anyOf": [_STRING, {"type": "array"}]}),
    "tool_calls": _nullable({"type": "array"}),
}, ("role",), extra=True)

_SAMPLING: dict[str, Schema] = {
    "model": _STRING,
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object"},
    "return_token_ids": {"type": "boolean"},
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "presence_penalty": {"type": "number"},
    "frequency_penalty": {"type": "number"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "n": {"type": "integer", "minimum": 1},
    "seed": {"type": "integer"},
    "top_k": {"type": "integer"},
    "stop": {"anyOf": [_STRING, {"type": "array", "items": _STRING}]},
}

# the gateway takes null for any optional field as "not given", as OpenAI's API does
_CHAT_REQUEST = _obj({
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    **{name: _nullable(schema) for name, schema in {
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer"},
        "tools": {"type": "array", "items": {"type": "object"}},
        **_SAMPLING,
    }.items()},
}, ("messages",), extra=True)

_COMPLETION_REQUEST = _obj({
    "prompt": {"anyOf": [_STRING, {"type": "array", "minItems": 1,
                                   "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}}]},
    **{name: _nullable(schema) for name, schema in {
        "logprobs": {"type": "integer"},
        "echo": {"type": "boolean"},
        **_SAMPLING,
    }.items()},
}, ("prompt",), extra=True)

_COMPLETION_REPLY = {"type": "object", "properties": {"choices": {"type": "array"}}, "required": ["choices"]}


# --------------------------------------------------------------------------- operations

_ERRORS = {
    400: "Bad input: the body or a parameter; error.param names the field.",
    401: "A bearer token is needed (the server was started with one) or is wrong.",
    404: "No such record.",
    408: "The request's head or body did not arrive in time (a slow client); the connection is closed.",
    409: "Conflict: the lease is no longer current; a rollout id that belongs to another task or attempt, or a "
         "finished rollout whose status or rewards would change (error.param names the field); or a model "
         "version that is not newer.",
    413: "The request body is larger than the server accepts.",
    502: "The model backend failed, could not be reached, or answered what the gateway cannot record (NaN, a lone "
         "surrogate, a token id out of range: the message names the field).",
    503: "The store could not do it (a busy or failing database); safe to retry.",
    504: "The model backend did not answer in time.",
}


def _error(status: int) -> Schema:
    return {"description": _ERRORS[status], "content": {"application/json": {"schema": _ref("Error")}}}


def _json(schema: Schema, description: str = "OK") -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _body(schema: Schema, *, required: bool = True) -> Schema:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


def _op(summary: str, responses: dict[int, Schema], *, errors: tuple[int, ...] = (), body: Schema | None = None,
        params: list[Schema] | None = None, secured: bool = True) -> Schema:
    out: Schema = {"summary": summary, "responses": {str(k): v for k, v in responses.items()}}
    # every route with a JSON body may get 400 (not JSON, NaN, a lone surrogate, too deep, wrong shape),
    # 408 (too slow) and 413 (too large)
    codes = set(errors) | ({400, 408, 413} if body is not None else set()) | ({401} if secured else set())
    for code in sorted(codes):
        out["responses"][str(code)] = _error(code)
    if body is not None:
        out["requestBody"] = body
    if params:
        out["parameters"] = params
    if not secured:
        out["security"] = []
    return out


def _query(name: str, schema: Schema, description: str = "", *, array: bool = False) -> Schema:
    p: Schema = {"name": name, "in": "query", "required": False,
                 "schema": {"type": "array", "items": schema} if array else schema}
    if array:
        p["style"], p["explode"] = "form", True
    if description:
        p["description"] = description
    return p


def _path(name: str) -> Schema:
    return {"name": name, "in": "path", "required": True, "schema": _NON_EMPTY}


_BOOL = {"type": "boolean"}
_PAGE_PARAMS = [
    _query("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": DEFAULT_LIMIT},
           f"Items in this page: {DEFAULT_LIMIT} unless given, at most {MAX_LIMIT}."),
    _query("after", _STRING, "The next of the page before: this page starts after the place it names in the "
                             "listing's order. A cursor this listing never gave is a 400."),
]


def _page(key: str, item: Schema) -> Schema:
    """One page of a listing: its items under ``key`` and the cursor of the next page."""
    return _json(_obj({key: {"type": "array", "items": item},
                       "next": {**_nullable(_STRING), "description": "Pass as after for the next page; null on the "
                                                                    "last page. Every item is listed exactly once, "
                                                                    "ties in start time included."}},
                      (key, "next")))


_DASHBOARD_ROLLOUT = _obj({
    "id": _STRING, "task_id": _STRING, "attempt": {"type": "integer"}, "status": {"enum": _ROLLOUT_STATUSES},
    "start_time": {"type": "number"}, "end_time": _nullable({"type": "number"}),
    "final_reward": _nullable({"type": "number"}), "error": _nullable(_STRING), "spans": _COUNT,
}, ("id", "task_id", "attempt", "status", "start_time", "end_time", "final_reward", "error", "spans"))

_BY_STATUS = {"type": "object", "propertyNames": {"enum": _ROLLOUT_STATUSES}, "additionalProperties": _COUNT}

_AGENT_STATS = _obj({
    "agent": _nullable(_STRING), "rollouts": _COUNT, "llm_calls": _COUNT, "llm_errors": _COUNT,
    "tool_calls": _COUNT, "tool_errors": _COUNT,
    "llm_error_rate": {"type": "number", "minimum": 0, "maximum": 1},
    "tool_error_rate": {"type": "number", "minimum": 0, "maximum": 1},
}, ("agent", "rollouts", "llm_calls", "llm_errors", "tool_calls", "tool_errors", "llm_error_rate",
    "tool_error_rate"))

_STATS = _obj({
    "agents": {"type": "array", "items": _AGENT_STATS},
    "window": _obj({"last": _COUNT, "rollouts": _COUNT, "reward_mean": _nullable({"type": "number"})},
                   ("last", "rollouts", "reward_mean")),
    "rollouts": _obj({"total": _COUNT, "by_status": _BY_STATUS}, ("total", "by_status")),
}, ("agents", "window", "rollouts"))


def _paths() -> dict[str, Any]:
    return {
        "/healthz": {"get": _op("Liveness: answers without a token.", {200: _json(_obj({"ok": _BOOL}, ("ok",)))},
                                secured=False)},
        "/openapi.json": {"get": _op("This document.", {200: _json({"type": "object"})})},
        "/v1/tasks": {
            "post": _op("Enqueue tasks (all or nothing: a task id already queued fails the whole call).",
                        {201: _json(_obj({"task_ids": {"type": "array", "items": _STRING}}, ("task_ids",)),
                                    "The new task ids, in queue order.")},
                        body=_body(_ENQUEUE), errors=(503,)),
            "get": _op("One page of the tasks in queue order, filtered by state and group (cursor: a task id).",
                       {200: _page("tasks", _ref("TaskInfo"))},
                       params=[_query("state", {"enum": _TASK_STATES}), _query("group_id", _STRING), *_PAGE_PARAMS],
                       errors=(400, 503)),
        },
        "/v1/tasks/lease": {"post": _op(
            "Lease the oldest queued task as its next attempt, waiting up to wait_s seconds for one.",
            {200: _json(_ref("Lease"), "A lease."), 204: {"description": "No task came within wait_s."}},
            body=_body(_LEASE_REQUEST), errors=(503,))},
        "/v1/tasks/{task_id}": {"get": _op(
            "A task's state and the history of its attempts.", {200: _json(_ref("TaskInfo"))},
            params=[_path("task_id")], errors=(404, 503))},
        "/v1/queue": {"get": _op("How many tasks are in each state.",
                                 {200: _json(_obj({s: _COUNT for s in _TASK_STATES}, tuple(_TASK_STATES)))},
                                 errors=(503,))},
        "/v1/leases/heartbeat": {"post": _op(
            "Push back the deadlines of these leases.",
            {200: _json(_obj({"alive": {"type": "array", "items": _STRING},
                              "lost": {"type": "array", "items": _STRING}}, ("alive", "lost")))},
            body=_body(_obj({"lease_ids": {"type": "array", "items": _STRING}}, ("lease_ids",), extra=True)),
            errors=(503,))},
        "/v1/leases/{lease_id}/release": {"post": _op(
            "Give a lease back: the task is queued again. A shutdown's release is not counted as a try; with "
            "failed=true (the attempt ended without a result) it is, and the task backs off before its next lease, "
            "or fails with the reason after max_attempts tries.",
            {200: _json(_obj({"released": _STRING}, ("released",)))},
            body=_body(_obj({"reason": _nullable(_STRING), "failed": {"type": "boolean", "default": False}},
                            extra=True), required=False),
            params=[_path("lease_id")], errors=(409, 503))},
        "/v1/rollouts": {
            "post": _op("Store a finished rollout (spans included); with lease_id its task is done in the same step. "
                        "A rollout id belongs to one task and attempt, and a finished rollout is final: the same "
                        "result again is accepted (and adds spans), anything else is a 409.",
                        {201: _json(_ROLLOUT_SUMMARY, "Stored; its transitions were built with gateway token ids.")},
                        body=_body(_ref("Rollout")),
                        params=[_query("lease_id", _STRING, "The lease this rollout is the result of.")],
                        errors=(409, 503)),
            "get": _op("One page of the stored rollouts, oldest first (by start time, then as stored).",
                       {200: _page("rollouts", _ref("Rollout"))},
                       params=[_query("task_id", _STRING), _query("status", {"enum": _ROLLOUT_STATUSES}, array=True),
                               _query("since", {"type": "number"}), _query("until", {"type": "number"}),
                               _query("with_spans", _BOOL), *_PAGE_PARAMS], errors=(400, 503)),
        },
        "/v1/rollouts/{rollout_id}": {"get": _op(
            "One rollout, with its spans unless with_spans=false.", {200: _json(_ref("Rollout"))},
            params=[_path("rollout_id"), _query("with_spans", _BOOL)], errors=(400, 404, 503))},
        "/v1/rollouts/{rollout_id}/spans": {
            "get": _op("A rollout's spans.", {200: _json(_obj({"spans": {"type": "array", "items": _ref("Span")}},
                                                              ("spans",)))},
                       params=[_path("rollout_id")], errors=(503,)),
            "post": _op("Add spans to a stored rollout (a span id it already has is kept as it was); its "
                        "transitions are built again from all its spans.",
                        {200: _json({**_ROLLOUT_SUMMARY, "properties": {**_ROLLOUT_SUMMARY["properties"],
                                                                         "added": _COUNT},
                                     "required": [*_ROLLOUT_SUMMARY["required"], "added"]})},
                        body=_body(_obj({"spans": {"type": "array", "items": _ref("Span")}}, ("spans",), extra=True)),
                        params=[_path("rollout_id")], errors=(404, 503)),
        },
        "/v1/transitions": {"get": _op(
            "One page of the stored transitions, by rollout or task, in rollout order then trajectory order.",
            {200: _page("transitions", _ref("Transition"))},
            params=[_query("rollout_id", _STRING), _query("task_id", _STRING), *_PAGE_PARAMS], errors=(400, 503))},
        "/v1/trajectories": {"get": _op(
            "One page of the stored trajectories (transitions with rewards), by task, status or rollout ids, "
            "in rollout order.",
            {200: _page("trajectories", _ref("Trajectory"))},
            params=[_query("task_id", _STRING), _query("status", {"enum": _ROLLOUT_STATUSES}, array=True),
                    _query("rollout_id", _STRING, array=True), *_PAGE_PARAMS], errors=(400, 503))},
        "/v1/dashboard/rollouts": {"get": _op(
            "The dashboard's table: one page of rollout summaries, newest first, and the counts by status.",
            {200: _json(_obj({"data": {"type": "array", "items": _DASHBOARD_ROLLOUT}, "total": _COUNT,
                              "offset": _COUNT, "limit": _COUNT, "counts": _BY_STATUS},
                             ("data", "total", "offset", "limit", "counts")))},
            params=[_query("status", {"enum": _ROLLOUT_STATUSES}, array=True),
                    _query("limit", {"type": "integer", "minimum": 0, "maximum": dashboard.MAX_PAGE, "default": 25}),
                    _query("offset", {"type": "integer", "minimum": 0, "maximum": SQLITE_MAX_INT, "default": 0})],
            errors=(400, 503))},
        "/v1/stats": {"get": _op(
            "The dashboard's stats: LLM and tool calls per agent (the nearest gen_ai.agent.name) and the mean "
            "final reward over the newest last rollouts; all rollouts by status.",
            {200: _json(_STATS)},
            params=[_query("last", {"type": "integer", "minimum": 0, "maximum": dashboard.MAX_STATS_WINDOW,
                                    "default": dashboard.DEFAULT_STATS_WINDOW},
                           "How many of the newest rollouts the agents' calls are counted over.")],
            errors=(400, 503))},
        "/v1/model": {
            "get": _op("The current model version, its weights and the served model's name.", {200: _json(_MODEL)}),
            "post": _op("Announce new weights: the backend swaps them in, then calls are recorded under version. "
                        f"A version is newer than the current one by at most {MAX_VERSION_STEP}; without one, the "
                        "next.",
                        {200: _json(_MODEL)},
                        body=_body(_obj({"version": _nullable({"type": "integer", "minimum": 0,
                                                               "maximum": MAX_MODEL_VERSION}),
                                         "weights": _nullable(_STRING)}, extra=True)),
                        errors=(409, 502, 503, 504)),
        },
        "/v1/builder": {
            "get": _op("What the server trains: its TransitionBuilder's settings (agent_match, air, credit, gamma; "
                       "functions as pkg.module:name) and where they come from.", {200: _json(_BUILDER)}),
            "post": _op("Join a client's builder (a worker's @agl.rollout_fn builder, a remote trainer's config) to "
                        "the server's: from now on stored transitions are built with both; a key the server sets to "
                        "another value is refused (409, naming both values).",
                        {200: _json(_BUILDER)},
                        body=_body(_obj({"settings": {"type": "object"}, "source": _NON_EMPTY}, ("settings",))),
                        errors=(409,)),
        },
        "/v1/metrics": {
            "get": _op("Training metrics, by step.", {200: _json(_obj({"data": {"type": "array", "items": _obj({
                "step": _COUNT, "time": {"type": "number"},
                "values": {"type": "object", "additionalProperties": {"type": "number"}}},
                ("step", "time", "values"))}}, ("data",)))}, errors=(503,)),
            "post": _op("Record one training step's metrics (a name already recorded for the step is replaced).",
                        {201: _json(_obj({"step": _COUNT, "recorded": _COUNT}, ("step", "recorded")))},
                        body=_body(_obj({"step": {"type": "integer", "minimum": 0, "maximum": SQLITE_MAX_INT},
                                         "values": {"type": "object", "additionalProperties": {"type": "number"}}},
                                        ("step", "values"), extra=True)),
                        errors=(503,)),
        },
        "/v1/resources": {
            "get": _op("The current resources version: what the workers hand the agent before each rollout.",
                       {200: _json(_RESOURCES_VERSION)}, errors=(404, 503)),
            "post": _op("A new resources version (current unless current is false).",
                        {201: _json(_RESOURCES_VERSION)},
                        body=_body(_obj({"resources": _RESOURCES, "metadata": _nullable({"type": "object"}),
                                         "current": {"type": "boolean", "default": True}}, ("resources",),
                                        extra=True)),
                        errors=(503,)),
        },
        "/v1/resources/history": {"get": _op(
            "Every resources version, oldest first, paged (after: the version before this page).",
            {200: _json(_obj({"data": {"type": "array", "items": _RESOURCES_VERSION}, "next": _nullable(_STRING)},
                             ("data", "next")))},
            params=[_PAGE_PARAMS[0], _query("after", {"type": "string", "pattern": "^[0-9]+$"},
                                            "The version this page starts after (the next of the page before).")],
            errors=(400, 503))},
        "/v1/resources/{version}": {
            "get": _op("One resources version.", {200: _json(_RESOURCES_VERSION)},
                       params=[_path("version")], errors=(404, 503)),
            "post": _op("Merge notes into a version's metadata (a score, a critique), or make it current again.",
                        {200: _json(_RESOURCES_VERSION)},
                        body=_body(_obj({"metadata": _nullable({"type": "object"}),
                                         "current": {"type": "boolean", "default": False}}, extra=True)),
                        params=[_path("version")], errors=(404, 503)),
        },
        "/v1/traces": {"post": _otlp_traces()},
        "/v1/chat/completions": {"post": _op(
            "OpenAI chat completions through the gateway, recording the call's token ids by traceparent (and, with "
            "X-Agl-Rollout-Id, as a call of that open rollout).",
            {200: {"description": "The backend's reply (a JSON object, or server-sent events with stream=true).",
                   "content": {"application/json": {"schema": _COMPLETION_REPLY},
                               "text/event-stream": {"schema": {}}}}},
            body=_body(_CHAT_REQUEST), params=[_traceparent(), _rollout_header()], errors=(404, 409, 502, 504))},
        "/rollouts/{rollout_id}/v1/chat/completions": {"post": _op(
            "OpenAI chat completions scoped to an open rollout (gateway-only capture): each answered call is one "
            "of its transitions, in order, with the gateway's token ids; 404 for a rollout never opened, 409 for "
            "a finished one.",
            {200: {"description": "The backend's reply (a JSON object, or server-sent events with stream=true).",
                   "content": {"application/json": {"schema": _COMPLETION_REPLY},
                               "text/event-stream": {"schema": {}}}}},
            body=_body(_CHAT_REQUEST), params=[_rollout_path(), _traceparent(), _rollout_header()],
            errors=(404, 409, 502, 504))},
        "/rollouts/{rollout_id}/v1/models": {"get": _op(
            "The served model, at the rollout-scoped base URL.",
            {200: _json(_obj({"object": _STRING, "data": {"type": "array", "items": {"type": "object"}}},
                             ("object", "data")))}, params=[_rollout_path()], errors=(400, 502, 504))},
        "/v1/responses": {"post": _op(
            "The OpenAI Responses API through the gateway's chat path (agl_trainer.responses_api), recording the "
            "call's token ids by traceparent; stored state (previous_response_id) and hosted tools are refused.",
            {200: {"description": "A Response object, or Responses server-sent events with stream=true.",
                   "content": {"application/json": {"schema": {"type": "object"}},
                               "text/event-stream": {"schema": {}}}}},
            body=_body(_obj({"input": {"anyOf": [_STRING, {"type": "array", "items": {"type": "object"}}]},
                             "instructions": _nullable(_STRING),
                             "tools": _nullable({"type": "array", "items": {"type": "object"}}),
                             "max_output_tokens": _nullable({"type": "integer", "minimum": 1})},
                            ("input",), extra=True)),
            params=[_traceparent(), _rollout_header()], errors=(404, 409, 502, 504))},
        "/rollouts/{rollout_id}/v1/responses": {"post": _op(
            "The Responses API scoped to an open rollout (gateway-only capture), answered through the chat path: each "
            "answered call is one of its transitions, with the gateway's token ids.",
            {200: {"description": "A Response object, or Responses server-sent events with stream=true.",
                   "content": {"application/json": {"schema": {"type": "object"}},
                               "text/event-stream": {"schema": {}}}}},
            body=_body(_obj({"input": {"anyOf": [_STRING, {"type": "array", "items": {"type": "object"}}]},
                             "instructions": _nullable(_STRING),
                             "tools": _nullable({"type": "array", "items": {"type": "object"}}),
                             "max_output_tokens": _nullable({"type": "integer", "minimum": 1})},
                            ("input",), extra=True)),
            params=[_rollout_path(), _traceparent(), _rollout_header()], errors=(404, 409, 502, 504))},
        "/v1/completions": {"post": _op(
            "OpenAI text completions through the gateway, recording the call's token ids by traceparent.",
            {200: {"description": "The backend's reply (a JSON object, or server-sent events with stream=true).",
                   "content": {"application/json": {"schema": _COMPLETION_REPLY},
                               "text/event-stream": {"schema": {}}}}},
            body=_body(_COMPLETION_REQUEST), params=[_traceparent()], errors=(502, 504))},
        "/v1/models": {"get": _op(
            "The served model.",
            {200: _json(_obj({"object": _STRING, "data": {"type": "array", "items": {"type": "object"}}},
                             ("object", "data")))}, errors=(502, 504))},
    }


def _otlp_traces() -> Schema:
    """OTLP/HTTP's own answers (a ``google.rpc.Status`` on errors), not this API's error shape."""
    binary = {"type": "string", "format": "binary"}
    status = _obj({"code": {"type": "integer"}, "message": _STRING}, extra=True)

    def answer(description: str, schema: Schema) -> Schema:
        return {"description": description, "content": {"application/x-protobuf": {"schema": binary},
                                                        "application/json": {"schema": schema}}}

    partial = _obj({"partialSuccess": _obj({"rejectedSpans": {"type": ["integer", "string"]},
                                            "errorMessage": _STRING}, extra=True)}, extra=True)
    return {"summary": "OTLP/HTTP trace receiver: an ExportTraceServiceRequest (protobuf or JSON, gzip or not); its "
                       "spans are mapped from their convention and grouped into rollouts.",
            "requestBody": {"required": True, "content": {"application/x-protobuf": {"schema": binary},
                                                          "application/json": {"schema": {"type": "object"}}}},
            "responses": {"200": answer("An ExportTraceServiceResponse (partial success: spans refused or kept "
                                        "with a warning).", partial),
                          "400": answer("Not an ExportTraceServiceRequest in the encoding it says.", status),
                          "401": _error(401),
                          "413": answer("Over the server's body limit, as sent or once decompressed.", status),
                          "415": answer("Not protobuf or JSON, or compressed otherwise than gzip.", status),
                          "501": answer("The server lacks opentelemetry-proto (pip install 'agl-trainer[otlp]').",
                                        status)}}


_ROLLOUT_ID = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$"}


def _rollout_path() -> Schema:
    return {"name": "rollout_id", "in": "path", "required": True, "schema": _ROLLOUT_ID,
            "description": "An open rollout (stored with status running): its calls become its transitions."}


def _rollout_header() -> Schema:
    return {"name": "X-Agl-Rollout-Id", "in": "header", "required": False, "schema": _ROLLOUT_ID,
            "description": "The open rollout this call belongs to, as the base URL /rollouts/{rollout_id}/v1 says."}


def _traceparent() -> Schema:
    return {"name": "traceparent", "in": "header", "required": False, "schema": _STRING,
            "description": "W3C trace context of the agent's LLM span; the call's token ids are recorded under it."}


@cache
def _document() -> str:
    schemas: dict[str, Schema] = {
        **_core_schemas(), "Error": _ERROR, "Lease": _LEASE, "TaskInfo": _TASK_INFO,
    }
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "agl trainer server", "version": "1",
                 "description": "Task queue, rollouts, model version and the token-recording OpenAI-compatible "
                                "gateway, on one port. Errors have the OpenAI shape; error.param names the field."},
        "paths": _paths(),
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "Needed when the server has a token."}}},
        "security": [{"bearer": []}],
    }
    return json.dumps(doc, separators=(",", ":"))


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of the server and its gateway (a fresh copy each call)."""
    doc: dict[str, Any] = json.loads(_document())
    return doc


def openapi_json() -> bytes:
    """The document as the bytes ``GET /openapi.json`` answers (built once)."""
    return _document().encode()
