"""OTLP trace requests (protobuf or JSON) -> agl ``Span`` records, with the opentelemetry-proto messages.

The protobuf encoding is parsed by the generated messages; the JSON encoding by protobuf's own
``json_format`` after the one change OTLP makes to protobuf's JSON mapping: trace and span ids are
hex strings, not base64. A request that does not parse is refused whole (:class:`BadPayload`); a
span that parses but cannot be stored (an id of the wrong length, an end before its start) is
refused alone and counted, as the specification's partial success says.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field, fields
from typing import Any

from agl_core.errors import SchemaError
from agl_core.schema import Span

__all__ = ["BadPayload", "Received", "amended", "decode_json", "decode_protobuf"]

_MAX_INT = 2**63 - 1  # SQLite's INTEGER
_STATUS = {0: "unset", 1: "ok", 2: "error"}
_ID_FIELDS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")


class BadPayload(ValueError):
    """The request body is not an ``ExportTraceServiceRequest`` in the encoding it says."""


@dataclass
class Received:
    """One span as received: the agl record, and what only the envelope says about it."""

    span: Span
    scope: str
    resource: dict[str, Any]


@dataclass
class Decoded:
    spans: list[Received] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    """Why each refused span was refused (``resource_spans[0].scope_spans[1].spans[2]: ...``)."""


def _messages() -> Any:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    return trace_service_pb2


def decode_protobuf(body: bytes) -> Decoded:
    from google.protobuf.message import DecodeError

    request = _messages().ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except (DecodeError, ValueError) as exc:
        raise BadPayload(f"the body is not a protobuf ExportTraceServiceRequest: {exc}") from None
    return _spans(request)


def decode_json(body: bytes) -> Decoded:
    from google.protobuf import json_format

    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadPayload(f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadPayload("the body must be a JSON object (an ExportTraceServiceRequest)")
    _hex_ids_to_base64(data)
    request = _messages().ExportTraceServiceRequest()
    try:
        # the specification: a receiver ignores fields it does not know
        json_format.ParseDict(data, request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        raise BadPayload(f"the body is not an OTLP/JSON ExportTraceServiceRequest: {exc}") from None
    return _spans(request)


def _hex_ids_to_base64(data: dict[str, Any]) -> None:
    for resource in _items(data, "resourceSpans", "resource_spans"):
        for scope in _items(resource, "scopeSpans", "scope_spans"):
            for span in _items(scope, "spans"):
                _convert_ids(span)
                for link in _items(span, "links"):
                    _convert_ids(link)


def _items(obj: Any, *names: str) -> list[Any]:
    if not isinstance(obj, dict):
        return []
    for name in names:
        value = obj.get(name)
        if isinstance(value, list):
            return value
    return []


def _convert_ids(obj: Any) -> None:
    if not isinstance(obj, dict):
        return
    for name in _ID_FIELDS:
        value = obj.get(name)
        if isinstance(value, str) and value:
            try:
                obj[name] = base64.b64encode(bytes.fromhex(value)).decode()
            except ValueError:
                raise BadPayload(f"'{name}' must be a hex string (OTLP/JSON), got {value[:40]!r}") from None


def _spans(request: Any) -> Decoded:
    out = Decoded()
    for r, resource_spans in enumerate(request.resource_spans):
        resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
        for s, scope_spans in enumerate(resource_spans.scope_spans):
            scope = scope_spans.scope.name
            for i, span in enumerate(scope_spans.spans):
                where = f"resource_spans[{r}].scope_spans[{s}].spans[{i}]"
                try:
                    out.spans.append(Received(_span(span), scope, resource))
                except SchemaError as exc:
                    out.rejected.append(f"{where}: {exc}")
    return out


def _span(span: Any) -> Span:
    if len(span.trace_id) != 16 or span.trace_id == bytes(16):
        raise SchemaError("trace_id", f"must be 16 bytes and not all zero, got {len(span.trace_id)} bytes")
    if len(span.span_id) != 8 or span.span_id == bytes(8):
        raise SchemaError("span_id", f"must be 8 bytes and not all zero, got {len(span.span_id)} bytes")
    if span.parent_span_id and len(span.parent_span_id) != 8:
        raise SchemaError("parent_span_id", f"must be 8 bytes or empty, got {len(span.parent_span_id)} bytes")
    for name in ("start_time_unix_nano", "end_time_unix_nano"):
        if getattr(span, name) > _MAX_INT:
            raise SchemaError(name, f"must fit in 63 bits, got {getattr(span, name)}")
    events = [{"name": e.name, "time_ns": e.time_unix_nano,
               "attributes": {kv.key: any_value(kv.value) for kv in e.attributes}} for e in span.events]
    return Span(
        span_id=span.span_id.hex(), trace_id=span.trace_id.hex(), name=span.name,
        parent_id=span.parent_span_id.hex() if span.parent_span_id else None,
        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano or span.start_time_unix_nano,
        attributes={kv.key: any_value(kv.value) for kv in span.attributes},
        status=_STATUS.get(span.status.code, "unset"),  # type: ignore[arg-type]
        status_message=span.status.message or None, events=events,
    )


def any_value(value: Any) -> Any:
    """An OTLP ``AnyValue`` as the plain value an SDK span attribute would hold (bytes as base64 text)."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return binascii.b2a_base64(value.bytes_value, newline=False).decode()
    return getattr(value, kind)


def amended(span: Span, **changes: Any) -> Span:
    """``span`` with ``changes``, not validated again: a decoded span was validated once, and what ingestion
    adds (JSON text of messages, ids it read from the span) is clean."""
    values = {f.name: getattr(span, f.name) for f in fields(span)}
    return Span.trusted(**{**values, **changes})
