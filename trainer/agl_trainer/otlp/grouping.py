"""Which rollout each received span belongs to (DESIGN.md, "OTLP in").

In order: the span's own ``agl.rollout.id`` attribute (set by the app, or copied from the baggage entry
``agl.rollout.id`` by a baggage span processor), the resource's (``OTEL_RESOURCE_ATTRIBUTES=agl.rollout.id=...``),
another span of the same trace that named one (in this request, or an earlier one this server saw),
else the trace itself: its id in hex is the rollout id. ``agl.task.id`` names the task the same way,
and defaults to the rollout id.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from agl_core import semconv
from agl_core.schema import Span
from agl_trainer.otlp.decode import Received, amended

__all__ = ["Group", "TraceRollouts", "group_spans"]

_MAX_ID = 512


@dataclass
class Group:
    """The spans of one rollout in one request."""

    rollout_id: str
    task_id: str
    spans: list[Span] = field(default_factory=list)
    service: str | None = None


class TraceRollouts:
    """The rollout each recently seen trace was filed under, so a trace's spans exported in several
    batches (children end, and are exported, before their parent) stay in one rollout."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._map: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def get(self, trace_id: str) -> tuple[str, str] | None:
        with self._lock:
            return self._map.get(trace_id)

    def put(self, trace_id: str, ids: tuple[str, str]) -> None:
        with self._lock:
            self._map[trace_id] = ids
            self._map.move_to_end(trace_id)
            while len(self._map) > self._capacity:
                self._map.popitem(last=False)


def _named(attrs: dict[str, Any], key: str) -> str | None:
    value = attrs.get(key)
    if value is None or isinstance(value, bool):
        return None
    text = str(value).strip()
    return text or None


def group_spans(received: Iterable[Received], traces: TraceRollouts) -> tuple[dict[str, Group], list[str]]:
    """The spans by rollout, and why any span was refused (a rollout or task id no store can hold)."""
    items = list(received)
    explicit: dict[str, tuple[str, str]] = {}
    for item in items:  # a trace whose one span names the rollout names it for all its spans
        rollout_id = _named(item.span.attributes, semconv.AGL_ROLLOUT_ID) or _named(item.resource,
                                                                                  semconv.AGL_ROLLOUT_ID)
        if rollout_id is not None and item.span.trace_id not in explicit:
            task_id = (_named(item.span.attributes, semconv.AGL_TASK_ID) or _named(item.resource, semconv.AGL_TASK_ID)
                       or rollout_id)
            explicit[item.span.trace_id] = (rollout_id, task_id)
    groups: dict[str, Group] = {}
    rejected: list[str] = []
    for item in items:
        span, a = item.span, item.span.attributes
        own = _named(a, semconv.AGL_ROLLOUT_ID) or _named(item.resource, semconv.AGL_ROLLOUT_ID)
        if own is not None:
            task = _named(a, semconv.AGL_TASK_ID) or _named(item.resource, semconv.AGL_TASK_ID) or own
            ids = (own, task)
        else:
            ids = explicit.get(span.trace_id) or traces.get(span.trace_id) or (span.trace_id, span.trace_id)
        if len(ids[0]) > _MAX_ID or len(ids[1]) > _MAX_ID:
            rejected.append(f"span {span.span_id}: agl.rollout.id / agl.task.id longer than {_MAX_ID} characters")
            continue
        traces.put(span.trace_id, ids)
        group = groups.get(ids[0])
        if group is None:
            group = groups[ids[0]] = Group(ids[0], ids[1], service=_named(item.resource, "service.name"))
        group.spans.append(amended(span, rollout_id=ids[0]))
    return groups, rejected
