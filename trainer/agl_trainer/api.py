"""The HTTP surface shared by the server and the gateway: errors, request bodies, bearer tokens.

Errors use the OpenAI error shape that every OpenAI client already parses,

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``, where ``param``
names the offending field (``messages[2].role``), so a client can point at it.
Bad input is always a 4xx; only a fault of the server itself is a 5xx.

Every JSON body is read by :func:`parse_json`, which takes only what every
later step can carry: no ``NaN`` or ``Infinity`` (not JSON, and no record may
hold one), no lone UTF-16 surrogate (``"\\ud800"``: valid JSON, but no UTF-8
text, so it could never be stored or answered), and no nesting deeper than
:data:`MAX_BODY_DEPTH`. Each refusal names the field (``tasks[0].task.q``), or
``body`` for nesting too deep to walk.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["MAX_BODY_DEPTH", "ApiError", "BearerAuth", "JsonProblem", "error_response", "parse_json",
           "read_json"]

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_BODY_DEPTH = 256
"""How deeply a JSON body may nest: far above what a record holds (its free-form values nest at most 64
levels, inside a rollout's few), and far below what would exhaust Python's stack in a later step."""

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 409: "conflict_error",
          413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error"}


class ApiError(Exception):
    """An error answered to the client as ``status`` with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, *, headers: dict[str, str] | None = None
                 ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def response(self) -> Response:
        return error_response(self.status, self.message, self.param, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, *,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(error_body(status, message, param)), status_code=status,
                    media_type="application/json", headers=headers)


class JsonProblem(ValueError):
    """A JSON text that :func:`parse_json` refuses; ``path`` names the field (``""``: the whole text)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path or 'the body'}: {problem}")
        self.path = path
        self.problem = problem


class _Constant:
    """What ``NaN``, ``Infinity`` and ``-Infinity`` parse to, so the walk can say where one was."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


_DECODER = json.JSONDecoder(parse_constant=_Constant)
_SURROGATE_ESCAPE = re.compile(r"\\[uU][dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json(raw: bytes | str) -> Any:
    """``raw`` (UTF-8) as JSON, refusing non-finite numbers, lone surrogates and nesting past :data:`MAX_BODY_DEPTH`.

    Raises :class:`JsonProblem` naming the field; bytes that are not UTF-8 raise ``UnicodeDecodeError``, a text
    that is not JSON at all a plain ``ValueError``. The checks cost next to nothing beside the parse unless
    the text holds a surrogate escape or many brackets.
    """
    # UTF-8 only (as JSON on a network must be): json.loads would also take UTF-16 and pass its lone surrogates
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    try:
        data = _DECODER.decode(text)
    except RecursionError:
        raise JsonProblem("", f"is nested deeper than {MAX_BODY_DEPTH} levels") from None
    if ("NaN" in text or "Infinity" in text) and (found := _find(data, _is_constant)) is not None:
        raise JsonProblem(found[0], f"must be a finite number, got {found[1].text} (not JSON)")
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(data):
        found = _find(data, lambda v: isinstance(v, str) and _SURROGATE.search(v) is not None, keys=True)
        raise JsonProblem(found[0] if found else "",
                          "holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not unicode text")
    if text.count("[") + text.count("{") > MAX_BODY_DEPTH and _deeper_than(data, MAX_BODY_DEPTH):
        raise JsonProblem("", f"is nested deeper than {MAX_BODY_DEPTH} levels")
    return data


def _is_constant(value: Any) -> bool:
    return isinstance(value, _Constant)


def _has_lone_surrogate(data: Any) -> bool:
    """Escaped pairs decode to one character, so only a lone surrogate is left to fail the UTF-8 encoding."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _deeper_than(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        for child in (item.values() if type(item) is dict else item):
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1))
    return False


def _find(value: Any, bad: Callable[[Any], bool], *, keys: bool = False) -> tuple[str, Any] | None:
    """``(path, value)`` (path as ``a.b[2]``) of the first value for which ``bad`` holds, or of the first
    object with such a key; None when there is none."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if bad(item):
            return path, item
        if isinstance(item, dict):
            if keys and any(bad(k) for k in item):
                return path, item
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))
    return None


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body (:func:`parse_json`); 413 past ``limit`` bytes (before reading it when the
    length is declared), 400 naming the field for what :func:`parse_json` refuses."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError(400, f"Content-Length is not a number: {declared!r}", "Content-Length") from None
        if size > limit:
            raise ApiError(413, f"request body is {size} bytes; this server accepts at most {limit}")
    chunks: list[bytes] = []
    total = 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise ApiError(413, f"request body is over {limit} bytes, the most this server accepts")
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or cut off by the body read timeout: nobody reads this answer
        raise ApiError(408, "the request body did not arrive (the client went away or was too slow)",
                       "body") from None
    raw = b"".join(chunks)
    if not raw:
        raise ApiError(400, "the request has no body; a JSON object is expected", "body")
    try:
        return parse_json(raw)
    except JsonProblem as exc:
        raise ApiError(400, str(exc) if exc.path else f"the body {exc.problem}", exc.path or "body") from None
    except UnicodeDecodeError:
        raise ApiError(400, "the body is not UTF-8 text", "body") from None
    except ValueError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", "body") from None


def read_object(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {_kind(data)}", "body")
    return data


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


class BearerAuth:
    """ASGI middleware: every request but ``open_paths`` must carry ``Authorization: Bearer <token>``.

    A pure ASGI layer (no request object is built), so it costs the gateway's hot path a header scan.
    """

    def __init__(self, app: ASGIApp, token: str, open_paths: frozenset[str] = frozenset({"/healthz"})) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        if given is None:
            problem = "this server needs a bearer token: send 'Authorization: Bearer <token>'"
        elif not hmac.compare_digest(given, self.expected):
            problem = "the bearer token is wrong"
        else:
            await self.app(scope, receive, send)
            return
        response = error_response(401, problem, "Authorization", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
