"""``POST /v1/traces``: the OTLP/HTTP trace receiver, as the OpenTelemetry protocol specification says.

- Bodies: ``application/x-protobuf`` (the exporters' default) or ``application/json`` (OTLP/JSON), each
  ``Content-Encoding: gzip`` or not; another type is a 415. The answer is an
  ``ExportTraceServiceResponse`` in the request's encoding: 200, with ``partial_success`` when some spans
  were refused (``rejected_spans`` and a message naming why) or stored with a warning (a model call in no
  convention agl reads: ``rejected_spans`` 0 and the message).
- A body that does not parse is a 400 whose body is a ``google.rpc.Status`` naming the problem, and nothing
  of it is stored: every span is decoded and mapped before the first is written. A body over the server's
  ``max_body_bytes`` (compressed as sent, or once decompressed) is a 413.
- The server's bearer token guards it as every route: exporters send it with
  ``OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20<token>``.

Each rollout's spans go to the server as spans posted to it (:meth:`TrainerServer.add_rollout_spans`), or as a
new running rollout: they are joined with the gateway's token records by their trace and span ids, and its
transitions are built anew. ``POST /v1/rollouts`` with its id and a finished status (and rewards) finishes it.
"""

from __future__ import annotations

import json
import time
import zlib
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from agl_core import semconv
from agl_core.schema import Rollout
from agl_trainer.otlp.conventions import AGL_CONVENTION, map_span
from agl_trainer.otlp.decode import BadPayload, Decoded, Received, decode_json, decode_protobuf
from agl_trainer.otlp.grouping import Group, TraceRollouts, group_spans

if TYPE_CHECKING:
    from agl_trainer.server import TrainerServer

__all__ = ["PROTOBUF", "TracesReceiver"]

PROTOBUF = "application/x-protobuf"
_JSON = "application/json"
_PROTOBUF_TYPES = (PROTOBUF, "application/protobuf")
_MISSING = ("the OTLP receiver needs the opentelemetry-proto package where `agl serve` runs: "
            "pip install 'agl-trainer[otlp]'")
_MAX_MESSAGE = 2000


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class TracesReceiver:
    """The route, and the rollouts each trace was filed under (see :mod:`agl_trainer.otlp.grouping`)."""

    def __init__(self, server: TrainerServer) -> None:
        self.server = server
        self.traces = TraceRollouts()

    def route(self) -> Route:
        return Route("/v1/traces", self.receive, methods=["POST"])

    async def receive(self, request: Request) -> Response:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        as_json = kind == _JSON
        try:
            if kind not in _PROTOBUF_TYPES and not as_json:
                raise _Refused(415, f"Content-Type must be {PROTOBUF} or {_JSON} (OTLP/HTTP), got {kind or 'none'!r}")
            body = await self._body(request)
            decoded = await run_in_threadpool(_decode, body, as_json)
            message = await run_in_threadpool(self.ingest, decoded)
        except _Refused as exc:
            return _status(exc.status, str(exc), as_json)
        return _answer(len(decoded.rejected), message, as_json)

    async def _body(self, request: Request) -> bytes:
        limit = self.server.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _Refused(413, f"request body is {declared} bytes; this server accepts at most {limit}")
        chunks, total = [], 0
        try:
            async for chunk in request.stream():
                total += len(chunk)
                if total > limit:
                    raise _Refused(413, f"request body is over {limit} bytes, the most this server accepts")
                chunks.append(chunk)
        except ClientDisconnect:
            raise _Refused(400, "the request body did not arrive (the client went away or was too slow)") from None
        raw = b"".join(chunks)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding == "gzip":
            return _gunzip(raw, limit)
        if encoding not in ("identity", ""):
            raise _Refused(415, f"Content-Encoding must be gzip or none, got {encoding!r}")
        return raw

    def ingest(self, decoded: Decoded) -> str:
        """Map, group and store the decoded spans; the warnings for the answer's partial success."""
        mapped = [Received(map_span(r.span, r.scope), r.scope, r.resource) for r in decoded.spans]
        groups, refused = group_spans(mapped, self.traces)
        decoded.rejected.extend(refused)
        warnings = list(decoded.rejected)
        for group in groups.values():
            self._store(group)
            unknown = sum(1 for s in group.spans if s.attributes.get(AGL_CONVENTION) == "unknown"
                          and semconv.AGL_UNTRAINABLE in s.attributes)
            if unknown:
                warnings.append(f"rollout {group.rollout_id}: {unknown} span(s) look like model calls in no "
                                "convention agl reads; kept, not trained (see the rollout's skipped calls)")
        text = "; ".join(warnings)
        return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE - 3] + "..."

    def _store(self, group: Group) -> None:
        try:
            self.server.add_rollout_spans(group.rollout_id, group.spans)
            return
        except LookupError:
            pass
        metadata: dict[str, Any] = {"agl.source": "otlp"}
        if group.service:
            metadata["service.name"] = group.service
        start = min(s.start_ns for s in group.spans) / 1e9 if group.spans else time.time()
        # a running rollout: POST /v1/rollouts with its id and a finished status finishes it
        self.server.store_rollout(Rollout(id=group.rollout_id, task_id=group.task_id, status="running",
                                          spans=group.spans, start_time=start, metadata=metadata))


def _gunzip(raw: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(raw, limit + 1)
    except zlib.error as exc:
        raise _Refused(400, f"the body is not valid gzip (Content-Encoding: gzip): {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise _Refused(413, f"the request body is over {limit} bytes once decompressed, the most this server accepts")
    if not inflater.eof:
        raise _Refused(400, "the gzip body is truncated (Content-Encoding: gzip)")
    return out


def _decode(body: bytes, as_json: bool) -> Decoded:
    try:
        return decode_json(body) if as_json else decode_protobuf(body)
    except ImportError:
        raise _Refused(501, _MISSING) from None
    except BadPayload as exc:
        raise _Refused(400, str(exc)) from None


def _answer(rejected: int, message: str, as_json: bool) -> Response:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    response = ExportTraceServiceResponse()
    if rejected or message:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = message
    if as_json:
        from google.protobuf import json_format

        return Response(json_format.MessageToJson(response, indent=None), media_type=_JSON)
    return Response(response.SerializeToString(), media_type=PROTOBUF)


def _status(code: int, message: str, as_json: bool) -> Response:
    """The specification's error answer: a ``google.rpc.Status`` (its code is gRPC's: 3 invalid argument,
    8 resource exhausted, 12 unimplemented) in the request's encoding."""
    grpc_code = {400: 3, 413: 8, 415: 3, 501: 12}.get(code, 2)
    try:
        from google.rpc.status_pb2 import Status
    except ImportError:  # googleapis-common-protos absent: the same Status in its JSON form
        as_json = True
    if as_json:
        body = json.dumps({"code": grpc_code, "message": message}).encode()
        return Response(body, status_code=code, media_type=_JSON)
    return Response(Status(code=grpc_code, message=message).SerializeToString(), status_code=code,
                    media_type=PROTOBUF)
