"""The HTTP surface shared by the server and the gateway: errors, request bodies, bearer tokens.

Errors use the OpenAI error shape that every OpenAI client already parses,

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``, where ``param``
names the offending field (``messages[2].role``), so a client can point at it.
Bad input is always a 4xx; only a fault of the server itself is a 5xx.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["ApiError", "BearerAuth", "error_response", "read_json"]

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
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


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body; 413 past ``limit`` bytes (before reading it when the length is declared)."""
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
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise ApiError(413, f"request body is over {limit} bytes, the most this server accepts")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise ApiError(400, "the request has no body; a JSON object is expected", "body")
    try:
        return json.loads(raw)
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
