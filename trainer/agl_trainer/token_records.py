"""What the gateway saw per LLM call: exact prompt and response token ids and logprobs, by W3C traceparent.

The agent's instrumented OpenAI client sends a ``traceparent`` header on every
call whose parent-id field is the id of the client's own LLM span. The gateway
records the engine's token ids under ``(trace id, span id)``; when the worker
posts the rollout, :meth:`TokenRecords.join` writes each record into the
matching span's ``agl.llm.*`` attributes with ``token_source="gateway"``, and
core's ``TransitionBuilder`` then prefers them over any other source. The spans
are stored patched, so a later rebuild with another builder keeps the ids.

Recording is on the gateway's hot path, so :meth:`TokenRecords.put` is a dict
insert; a background thread writes new records to the server's SQLite file
every ``flush_interval_s``, so a call answered before a restart (all but the
last fraction of a second) still joins its rollout afterwards. Records are
dropped once joined, and after ``ttl_s`` when no rollout ever claims them (an
agent that runs outside any rollout).

Memory is bounded by count (``max_records``) and by bytes (``max_bytes``, an
estimate of what the records' lists hold in this process): past either, the
oldest records leave memory, with one warning. With a file they stay in it
until their ``ttl_s``, and a join still finds them there.
"""

from __future__ import annotations

import json
import logging
import re
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agl_core import semconv
from agl_core.schema import Span

__all__ = ["MAX_MODEL_VERSION", "MAX_VERSION_STEP", "MODEL_VERSION_ATTRIBUTE", "TokenRecord", "TokenRecords",
           "keep_joined", "parse_traceparent"]

logger = logging.getLogger("agl.trainer")

MODEL_VERSION_ATTRIBUTE = "agl.llm.model_version"
"""Span attribute: the version of the weights that answered the call (set by the gateway's join)."""
MAX_MODEL_VERSION = 2**53 - 1
"""The highest model version ``agl serve`` takes: exact in every JSON reader (a JavaScript number, the dashboard's)."""
MAX_VERSION_STEP = 1_000_000
"""How far past the current version one publish may go: more than any trainer's steps, and a slip of the
keyboard (``2**63 - 1``) is refused instead of leaving no version for any later publish."""

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16

Key = tuple[str, str]


def parse_traceparent(value: str | None) -> Key | None:
    """``(trace_id, span_id)`` of a W3C ``traceparent`` header, or None when absent or malformed."""
    if not value:
        return None
    match = _TRACEPARENT.fullmatch(value.strip().lower()[:55])
    if match is None or match.group(1) == "ff":
        return None
    trace_id, span_id = match.group(2), match.group(3)
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return trace_id, span_id


@dataclass(slots=True)
class TokenRecord:
    """One answered call, as the engine tokenised and sampled it (first choice only)."""

    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float] | None
    model: str | None
    model_version: int
    created: float
    frozen: str | None = None
    """The frozen model that answered (a gateway upstream): no ids, and the call is not trained."""
    policy: str | None = None
    """With several policies (:mod:`agl_trainer.policies`): the policy that answered; None: the base model."""
    policy_note: str | None = None
    """Why the base model answered a call of a run with several policies (its agent matched none)."""

    def to_json(self) -> str:
        fields: list[Any] = [self.prompt_token_ids, self.response_token_ids, self.response_logprobs, self.model,
                             self.model_version, self.created]
        if self.policy is not None or self.policy_note is not None:
            fields += [self.frozen, self.policy, self.policy_note]
        elif self.frozen is not None:
            fields.append(self.frozen)
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TokenRecord:
        prompt, response, logprobs, model, version, created, *rest = json.loads(text)
        rest += [None] * (3 - len(rest))
        return cls(prompt, response, logprobs, model, version, created, rest[0], rest[1], rest[2])


_SCHEMA = """CREATE TABLE IF NOT EXISTS trainer_token_records (
    trace_id TEXT NOT NULL,
    span_id TEXT NOT NULL,
    created REAL NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (trace_id, span_id)
)"""


class TokenRecords:
    """Token records by ``(trace_id, span_id)``, in memory and, with ``path``, in that SQLite file."""

    def __init__(self, path: str | None = None, *, ttl_s: float = 3600.0, max_records: int = 200_000,
                 max_bytes: int = 256 * 1024 * 1024, flush_interval_s: float = 0.25) -> None:
        self.ttl_s = ttl_s
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._memory: OrderedDict[Key, TokenRecord] = OrderedDict()
        self._bytes = 0
        self.evicted = 0  # records pushed out of memory by the bounds before any rollout joined them
        self._pending: list[tuple[Key, TokenRecord]] = []
        self._stop = threading.Event()
        self._conn: sqlite3.Connection | None = None
        self._thread: threading.Thread | None = None
        self.unkeyed = 0  # calls that came without a usable traceparent: nothing can join them
        self.joined = 0
        if path is not None:
            self._conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
            self._conn.execute("PRAGMA busy_timeout = 30000")
            self._conn.execute("PRAGMA synchronous = NORMAL")  # the store put the file in WAL mode
            self._conn.execute(_SCHEMA)
            self._db_lock = threading.Lock()
            self._flush_interval = flush_interval_s
            self._thread = threading.Thread(target=self._flusher, name="agl-token-records", daemon=True)
            self._thread.start()

    def __len__(self) -> int:
        return len(self._memory)

    @property
    def nbytes(self) -> int:
        """About how many bytes the records in memory hold (their id and logprob lists, mostly)."""
        return self._bytes

    def put(self, key: Key, record: TokenRecord) -> None:
        """Keep ``record`` for the call whose traceparent gave ``key``; a later call with that key replaces it."""
        size = _size(record)
        evicted = 0
        with self._lock:
            memory = self._memory
            old = memory.get(key)
            if old is not None:
                self._bytes -= _size(old)
            memory[key] = record
            memory.move_to_end(key)
            self._bytes += size
            while len(memory) > 1 and (len(memory) > self.max_records or self._bytes > self.max_bytes):
                _, gone = memory.popitem(last=False)
                self._bytes -= _size(gone)
                evicted += 1
            if self._conn is not None:
                self._pending.append((key, record))  # encoded by the flusher, off the gateway's path
            if evicted:
                first = self.evicted == 0
                self.evicted += evicted
        if evicted and first:
            where = "they stay in the server's file until their TTL" if self._conn is not None else \
                "without a file they are lost"
            logger.warning("agl trainer: the gateway holds more token records than its bounds (%d records, %d MiB) "
                           "that no rollout has joined (calls from outside any rollout?); the oldest leave memory "
                           "(%s)", self.max_records, self.max_bytes // (1024 * 1024), where)

    def get(self, key: Key) -> TokenRecord | None:
        with self._lock:
            found = self._memory.get(key)
        if found is not None:
            return found
        return self._load([key]).get(key)

    def join(self, spans: Sequence[Span]) -> tuple[list[Span], list[Key]]:
        """The spans with each recorded call's ids written in; also the keys that joined."""
        keys = [(s.trace_id, s.span_id) for s in spans]
        with self._lock:
            found = {k: self._memory[k] for k in keys if k in self._memory}
        missing = [k for k in keys if k not in found]
        if missing and self._conn is not None:
            found.update(self._load(missing))
        if not found:
            return list(spans), []
        out = []
        for span, key in zip(spans, keys, strict=True):
            record = found.get(key)
            out.append(span if record is None else _patched(span, record))
        self.joined += len(found)
        return out, list(found)

    def forget(self, keys: Iterable[Key]) -> None:
        """Drop records that have been joined into a stored rollout."""
        keys = list(keys)
        if not keys:
            return
        with self._lock:
            for key in keys:
                gone = self._memory.pop(key, None)
                if gone is not None:
                    self._bytes -= _size(gone)
        if self._conn is not None:
            self.flush()
            with self._db_lock:
                self._conn.executemany("DELETE FROM trainer_token_records WHERE trace_id = ? AND span_id = ?", keys)

    def flush(self) -> None:
        """Write every pending record to the file now."""
        if self._conn is None:
            return
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        batch = [(key[0], key[1], record.created, record.to_json()) for key, record in pending]
        with self._db_lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(
                    "INSERT INTO trainer_token_records (trace_id, span_id, created, data) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT (trace_id, span_id) DO UPDATE SET created = excluded.created, data = excluded.data",
                    batch)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._conn is not None:
            self.flush()
            self._conn.close()
            self._conn = None

    # ------------------------------------------------------------------ pieces

    def _load(self, keys: list[Key]) -> dict[Key, TokenRecord]:
        if self._conn is None or not keys:
            return {}
        self.flush()
        wanted = set(keys)
        out: dict[Key, TokenRecord] = {}
        traces = sorted({k[0] for k in keys})
        with self._db_lock:
            rows = self._conn.execute(
                "SELECT trace_id, span_id, data FROM trainer_token_records"
                " WHERE trace_id IN (SELECT value FROM json_each(?))", (json.dumps(traces),)).fetchall()
        for trace_id, span_id, data in rows:
            if (trace_id, span_id) in wanted:
                out[(trace_id, span_id)] = TokenRecord.from_json(data)
        return out

    def _flusher(self) -> None:
        last_sweep = time.monotonic()
        while not self._stop.wait(self._flush_interval):
            try:
                self.flush()
                if time.monotonic() - last_sweep > 60:
                    last_sweep = time.monotonic()
                    self._sweep()
            except sqlite3.Error as exc:  # the records stay in memory; only a restart could lose them
                logger.warning("agl trainer: could not persist gateway token records: %s", exc)

    def _sweep(self) -> None:
        cutoff = time.time() - self.ttl_s
        with self._lock:
            while self._memory:
                key, record = next(iter(self._memory.items()))
                if record.created >= cutoff:
                    break
                self._memory.popitem(last=False)
                self._bytes -= _size(record)
        if self._conn is not None:
            with self._db_lock:
                self._conn.execute("DELETE FROM trainer_token_records WHERE created < ?", (cutoff,))


def _size(record: TokenRecord) -> int:
    """What a record holds in memory: a list slot and an int object per id, a float per logprob, and overhead."""
    logprobs = record.response_logprobs
    return 400 + 36 * (len(record.prompt_token_ids) + len(record.response_token_ids)) + 32 * len(logprobs or ())


def _patched(span: Span, record: TokenRecord) -> Span:
    attrs: dict[str, Any] = dict(span.attributes)
    if record.frozen is not None:
        attrs[semconv.AGL_FROZEN_MODEL] = record.frozen
        return replace(span, attributes=attrs)
    attrs[semconv.AGL_PROMPT_TOKEN_IDS] = list(record.prompt_token_ids)
    attrs[semconv.AGL_RESPONSE_TOKEN_IDS] = list(record.response_token_ids)
    if record.response_logprobs is not None and len(record.response_logprobs) == len(record.response_token_ids):
        attrs[semconv.AGL_RESPONSE_LOGPROBS] = list(record.response_logprobs)
    else:
        attrs.pop(semconv.AGL_RESPONSE_LOGPROBS, None)  # never pair our ids with another source's logprobs
    attrs[semconv.AGL_TOKEN_SOURCE] = "gateway"
    attrs[MODEL_VERSION_ATTRIBUTE] = record.model_version
    if record.policy is not None:
        attrs[semconv.AGL_POLICY] = record.policy
    if record.policy_note is not None:
        attrs[semconv.AGL_POLICY_NOTE] = record.policy_note
    return replace(span, attributes=attrs)


_JOINED = (semconv.AGL_PROMPT_TOKEN_IDS, semconv.AGL_RESPONSE_TOKEN_IDS, semconv.AGL_RESPONSE_LOGPROBS,
           semconv.AGL_TOKEN_SOURCE, MODEL_VERSION_ATTRIBUTE, semconv.AGL_FROZEN_MODEL, semconv.AGL_POLICY,
           semconv.AGL_POLICY_NOTE)


def _was_joined(span: Span) -> bool:
    return span.attributes.get(semconv.AGL_TOKEN_SOURCE) == "gateway" or semconv.AGL_FROZEN_MODEL in span.attributes


def keep_joined(spans: Sequence[Span], stored: Sequence[Span]) -> list[Span]:
    """``spans`` with the gateway's ids that ``stored``, an earlier post of the same rollout, already had.

    Records are dropped once joined, so a rollout posted again (a retry whose first answer was
    lost, or the same rollout posted with and without its lease) finds none; without this its
    spans would replace the stored ones without their ids.
    """
    joined = {(s.trace_id, s.span_id): s for s in stored if _was_joined(s)}
    if not joined:
        return list(spans)
    out = []
    for span in spans:
        old = joined.get((span.trace_id, span.span_id))
        if old is None or _was_joined(span):
            out.append(span)
            continue
        attrs = dict(span.attributes)
        for name in _JOINED:
            if name in old.attributes:
                attrs[name] = old.attributes[name]
            else:
                attrs.pop(name, None)
        out.append(replace(span, attributes=attrs))
    return out
