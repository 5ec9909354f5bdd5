"""The task queue: tasks leased to workers, re-queued as a new attempt when a worker goes silent.

A task moves ``queued -> leased -> done``. A lease has a deadline that the
worker's heartbeats push back; a lease whose deadline passes (the worker died,
or hangs) puts the task back in the queue, and the next lease is the next
attempt. A task is tried at most ``max_attempts`` times, then marked ``failed``
with the reason. A lease that the worker gives back on a graceful shutdown
(``release``) is not counted as a try; one given back because the attempt
failed without a result (``release(..., failed=True)``: the agent raised before
its rollout existed, the server refused the rollout, the infrastructure failed)
is counted, and the task waits ``backoff_s * 2**(tries - 1)`` seconds (at most
``max_backoff_s``) before it can be leased again. So a task that can never be
stored ends ``failed`` with its last reason after ``max_attempts`` tries,
instead of being leased over and over. Attempt numbers only go up, so the
result of an old attempt can never be taken for that of a newer one.

A payload is checked when it is enqueued by the rules of the rollout that will
carry it (:func:`agl_core.schema.check_json`: nesting, finite numbers, unicode)
and, with ``max_task_bytes``, its size: what the queue takes, a rollout can carry.

The queue lives in the server's SQLite file, beside the store's tables (under
``trainer_*`` names), so a restarted server finds its queue, its leases and
their deadlines as they were. Every change is one ``BEGIN IMMEDIATE``
transaction under one lock: the queue is small and its calls are short, and the
lock also lets the server write a rollout and finish its lease as one step
(:meth:`TaskQueue.finishing`).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl_core.errors import SchemaError, StoreError
from agl_core.schema import check_json

__all__ = ["MAX_TASKS_PER_CALL", "Lease", "LeaseLost", "TaskInfo", "TaskQueue", "TaskSpec"]

STATES = ("queued", "leased", "done", "failed")
MAX_TASKS_PER_CALL = 100_000
"""Most tasks (payloads times ``repeat``) one ``enqueue`` may add: a bigger call is refused before it fills memory."""
_MAX_INT = 2**63 - 1  # SQLite's INTEGER

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS trainer_tasks (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        task_id TEXT NOT NULL UNIQUE,
        group_id TEXT NOT NULL,
        task TEXT NOT NULL,
        state TEXT NOT NULL,
        attempt INTEGER NOT NULL DEFAULT 0,
        released INTEGER NOT NULL DEFAULT 0,
        max_attempts INTEGER NOT NULL,
        lease_id TEXT,
        worker_id TEXT,
        lease_timeout REAL,
        deadline REAL,
        rollout_id TEXT,
        error TEXT,
        created REAL NOT NULL,
        updated REAL NOT NULL,
        not_before REAL
    )""",
    "CREATE INDEX IF NOT EXISTS trainer_tasks_state ON trainer_tasks (state, seq)",
    "CREATE INDEX IF NOT EXISTS trainer_tasks_lease ON trainer_tasks (lease_id)",
    """CREATE TABLE IF NOT EXISTS trainer_attempts (
        task_id TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        lease_id TEXT NOT NULL,
        worker_id TEXT,
        started REAL NOT NULL,
        ended REAL,
        outcome TEXT,
        rollout_id TEXT,
        PRIMARY KEY (task_id, attempt)
    )""",
)


@dataclass(frozen=True)
class TaskSpec:
    """One task to enqueue: its payload (any JSON), and optionally its id and GRPO group."""

    task: Any
    task_id: str | None = None
    group_id: str | None = None


@dataclass(frozen=True)
class Lease:
    """A task handed to a worker until ``deadline`` (epoch seconds)."""

    lease_id: str
    task_id: str
    attempt: int
    group_id: str
    task: Any
    worker_id: str
    deadline: float
    lease_timeout: float

    def to_dict(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "task_id": self.task_id, "attempt": self.attempt,
                "group_id": self.group_id, "task": self.task, "worker_id": self.worker_id,
                "deadline": self.deadline, "lease_timeout": self.lease_timeout}


@dataclass
class TaskInfo:
    """A task's state, with the history of its attempts."""

    task_id: str
    group_id: str
    task: Any
    state: str
    attempt: int
    max_attempts: int
    released: int
    rollout_id: str | None
    error: str | None
    lease_id: str | None
    worker_id: str | None
    deadline: float | None
    not_before: float | None = None
    """A queued task that failed an attempt waits until then (epoch seconds) for its next lease."""
    attempts: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class LeaseLost(StoreError):
    """The lease is no longer the task's current one: it expired (and the task moved on) or was finished."""


class TaskQueue:
    """Tasks in the SQLite file at ``path``; safe to share across threads of one process.

    ``clock`` gives the time in epoch seconds (tests move it forward to expire leases).
    """

    def __init__(
        self,
        path: str,
        *,
        default_max_attempts: int = 3,
        default_lease_timeout: float = 600.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        max_task_bytes: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        _check_positive_int(default_max_attempts, "default_max_attempts")
        _check_positive(default_lease_timeout, "default_lease_timeout")
        for name, value in (("backoff_s", backoff_s), ("max_backoff_s", max_backoff_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise SchemaError(name, f"must be a non-negative number of seconds, got {value!r}")
        if max_task_bytes is not None:
            _check_positive_int(max_task_bytes, "max_task_bytes")
        self.path = path
        self.default_max_attempts = default_max_attempts
        self.default_lease_timeout = float(default_lease_timeout)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.max_task_bytes = max_task_bytes
        self.clock = clock
        self._lock = threading.RLock()
        try:
            self._conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
            self._conn.execute("PRAGMA busy_timeout = 30000")
            with self._transaction() as conn:
                for statement in _SCHEMA:
                    conn.execute(statement)
                columns = {row[1] for row in conn.execute("PRAGMA table_info(trainer_tasks)")}
                if "not_before" not in columns:  # a queue written before back-off existed
                    conn.execute("ALTER TABLE trainer_tasks ADD COLUMN not_before REAL")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the task queue in {path}: {exc}") from exc
        self.on_change: Callable[[], None] | None = None
        """Called (from any thread) after tasks became leasable: enqueued, released or expired."""

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    # ------------------------------------------------------------------ enqueue

    def enqueue(
        self,
        tasks: Sequence[TaskSpec],
        *,
        repeat: int = 1,
        group_id: str | None = None,
        max_attempts: int | None = None,
    ) -> list[str]:
        """Add ``repeat`` copies of each task; return the new task ids, in queue order.

        A task's id is its ``task_id``, else the ``task_id`` or ``id`` key of a
        dict payload, else a fresh one; with ``repeat > 1`` the copies are
        ``{id}#0``, ``{id}#1``, ... and share one GRPO group. A task's group is
        its own ``group_id``, else ``group_id`` here, else its id (before the
        ``#k``). All or nothing: an id already queued fails the whole call.
        """
        _check_positive_int(repeat, "repeat")
        attempts = self.default_max_attempts if max_attempts is None else max_attempts
        _check_positive_int(attempts, "max_attempts")
        if group_id is not None and (not isinstance(group_id, str) or not group_id):
            raise SchemaError("group_id", f"must be a non-empty string, got {group_id!r}")
        if len(tasks) * repeat > MAX_TASKS_PER_CALL:
            raise SchemaError("repeat", f"{len(tasks)} tasks times repeat {repeat} is over {MAX_TASKS_PER_CALL}, "
                                        f"the most one call may add; enqueue them in parts")
        rows: list[tuple[Any, ...]] = []
        now = self.clock()
        for i, spec in enumerate(tasks):
            base = spec.task_id if spec.task_id is not None else _id_in(spec.task)
            if base is not None and (not isinstance(base, str) or not base):
                raise SchemaError(f"tasks[{i}].task_id", f"must be a non-empty string, got {base!r}")
            base = base or uuid.uuid4().hex
            group = spec.group_id or group_id or base
            payload = self._payload(spec.task, f"tasks[{i}].task")
            for k in range(repeat):
                task_id = base if repeat == 1 else f"{base}#{k}"
                rows.append((task_id, group, payload, "queued", attempts, now, now))
        ids = [r[0] for r in rows]
        if len(set(ids)) != len(ids):
            raise SchemaError("tasks", f"task id {_first_duplicate(ids)!r} comes twice; nothing was added")
        with self._transaction() as conn:
            taken = conn.execute("SELECT task_id FROM trainer_tasks WHERE task_id IN (SELECT value FROM json_each(?))"
                                 " LIMIT 1", (json.dumps(ids),)).fetchone()
            if taken is not None:
                raise SchemaError("tasks", f"task id {taken[0]!r} is already in the queue; nothing was added")
            conn.executemany(
                "INSERT INTO trainer_tasks (task_id, group_id, task, state, max_attempts, created, updated)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
        self._notify()
        return [r[0] for r in rows]

    # ------------------------------------------------------------------ leases

    def lease(self, worker_id: str, *, lease_timeout: float | None = None) -> Lease | None:
        """The oldest queued task, leased to ``worker_id`` as its next attempt; None when none is queued."""
        timeout = self.default_lease_timeout if lease_timeout is None else lease_timeout
        _check_positive(timeout, "lease_timeout")
        self.expire()
        now = self.clock()
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT task_id, group_id, task, attempt FROM trainer_tasks WHERE state = 'queued'"
                " AND (not_before IS NULL OR not_before <= ?) ORDER BY seq LIMIT 1", (now,)).fetchone()
            if row is None:
                return None
            task_id, group, payload, attempt = row
            lease = Lease(lease_id=uuid.uuid4().hex, task_id=task_id, attempt=attempt + 1, group_id=group,
                          task=json.loads(payload), worker_id=worker_id, deadline=now + timeout,
                          lease_timeout=float(timeout))
            conn.execute(
                "UPDATE trainer_tasks SET state = 'leased', attempt = ?, lease_id = ?, worker_id = ?,"
                " lease_timeout = ?, deadline = ?, updated = ?, not_before = NULL WHERE task_id = ?",
                (lease.attempt, lease.lease_id, worker_id, timeout, lease.deadline, now, task_id))
            conn.execute(
                "INSERT INTO trainer_attempts (task_id, attempt, lease_id, worker_id, started) VALUES (?, ?, ?, ?, ?)",
                (task_id, lease.attempt, lease.lease_id, worker_id, now))
        return lease

    def heartbeat(self, lease_ids: Sequence[str]) -> tuple[list[str], list[str]]:
        """Push back the deadline of each current lease; return (alive, lost) lease ids."""
        now = self.clock()
        alive: list[str] = []
        lost: list[str] = []
        with self._transaction() as conn:
            for lease_id in lease_ids:
                updated = conn.execute(
                    "UPDATE trainer_tasks SET deadline = ? + lease_timeout, updated = ?"
                    " WHERE lease_id = ? AND state = 'leased'", (now, now, lease_id)).rowcount
                (alive if updated else lost).append(lease_id)
        return alive, lost

    def release(self, lease_id: str, reason: str = "released by the worker", *, failed: bool = False) -> None:
        """Give a lease back, and the task is queued again.

        Without ``failed`` (a worker shutting down) the attempt is not counted as a try and the task
        can be leased at once. With ``failed`` (the attempt ended without a result) it is counted: the
        task is ``failed`` with ``reason`` once it has had ``max_attempts`` tries, and otherwise waits
        out its back-off before the next lease.
        """
        now = self.clock()
        with self._transaction() as conn:
            task_id, attempt = self._current(conn, lease_id)
            if not failed:
                conn.execute(
                    "UPDATE trainer_tasks SET state = 'queued', released = released + 1, lease_id = NULL,"
                    " worker_id = NULL, deadline = NULL, updated = ? WHERE task_id = ?", (now, task_id))
                outcome = f"released: {reason}"
            else:
                released, max_attempts = conn.execute("SELECT released, max_attempts FROM trainer_tasks"
                                                      " WHERE task_id = ?", (task_id,)).fetchone()
                tries = attempt - released
                if tries >= max_attempts:
                    conn.execute(
                        "UPDATE trainer_tasks SET state = 'failed', lease_id = NULL, deadline = NULL, error = ?,"
                        " updated = ? WHERE task_id = ?", (f"gave up after {tries} attempts; last: {reason}"[:2000],
                                                           now, task_id))
                else:
                    wait = min(self.max_backoff_s, self.backoff_s * 2 ** (tries - 1))
                    conn.execute(
                        "UPDATE trainer_tasks SET state = 'queued', lease_id = NULL, worker_id = NULL,"
                        " deadline = NULL, not_before = ?, updated = ? WHERE task_id = ?", (now + wait, now, task_id))
                outcome = f"failed: {reason}"
            conn.execute("UPDATE trainer_attempts SET ended = ?, outcome = ? WHERE lease_id = ?",
                         (now, outcome[:2000], lease_id))
        self._notify()

    def attempt_of(self, lease_id: str) -> dict[str, Any] | None:
        """The attempt a lease was for: task, attempt number, outcome and rollout; None for an unknown lease."""
        with self._lock:
            row = self._conn.execute("SELECT task_id, attempt, outcome, rollout_id FROM trainer_attempts"
                                     " WHERE lease_id = ?", (lease_id,)).fetchone()
        if row is None:
            return None
        return {"task_id": row[0], "attempt": row[1], "outcome": row[2], "rollout_id": row[3]}

    def lease_of(self, lease_id: str) -> Lease:
        """The current lease with this id, or :class:`LeaseLost`."""
        with self._lock:
            row = self._conn.execute(
                "SELECT task_id, group_id, task, attempt, worker_id, deadline, lease_timeout FROM trainer_tasks"
                " WHERE lease_id = ? AND state = 'leased'", (lease_id,)).fetchone()
        if row is None:
            raise LeaseLost(self._why_lost(lease_id))
        task_id, group, payload, attempt, worker, deadline, timeout = row
        return Lease(lease_id, task_id, attempt, group, json.loads(payload), worker, deadline, timeout)

    @contextlib.contextmanager
    def finishing(self, lease_id: str, rollout_id: str) -> Iterator[Lease]:
        """Hold the queue while the caller stores a lease's result; the task is done when the block ends.

        Raises :class:`LeaseLost` when the lease is no longer current, before the block runs, so a late
        result of an attempt that was already given to another worker is never stored. If the block
        raises, the lease stays as it was.
        """
        with self._lock:
            lease = self.lease_of(lease_id)
            yield lease
            now = self.clock()
            with self._transaction() as conn:
                conn.execute(
                    "UPDATE trainer_tasks SET state = 'done', rollout_id = ?, lease_id = NULL, deadline = NULL,"
                    " error = NULL, updated = ? WHERE task_id = ?", (rollout_id, now, lease.task_id))
                conn.execute("UPDATE trainer_attempts SET ended = ?, outcome = 'finished', rollout_id = ?"
                             " WHERE lease_id = ?", (now, rollout_id, lease.lease_id))

    def expire(self, stored: Callable[[str, int], str | None] | None = None) -> list[tuple[str, int]]:
        """Re-queue (or fail) every task whose lease deadline has passed; return the (task_id, attempt) expired.

        ``stored(task_id, attempt)`` may name a rollout already stored for that attempt: the server
        wrote it but stopped before it could finish the lease, so the task is done, not retried.
        """
        now = self.clock()
        expired: list[tuple[str, int]] = []
        with self._lock:
            rows = self._conn.execute(
                "SELECT task_id, attempt, lease_id, worker_id, released, max_attempts FROM trainer_tasks"
                " WHERE state = 'leased' AND deadline < ?", (now,)).fetchall()
            if not rows:
                return expired
            for task_id, attempt, lease_id, worker, released, max_attempts in rows:
                rollout_id = stored(task_id, attempt) if stored is not None else None
                with self._transaction() as conn:
                    if rollout_id is not None:
                        conn.execute("UPDATE trainer_tasks SET state = 'done', rollout_id = ?, lease_id = NULL,"
                                     " deadline = NULL, updated = ? WHERE task_id = ?", (rollout_id, now, task_id))
                        conn.execute("UPDATE trainer_attempts SET ended = ?, outcome = 'finished', rollout_id = ?"
                                     " WHERE lease_id = ?", (now, rollout_id, lease_id))
                        continue
                    tries = attempt - released
                    reason = f"lease expired (worker {worker} sent no heartbeat or result in time)"
                    if tries >= max_attempts:
                        conn.execute(
                            "UPDATE trainer_tasks SET state = 'failed', lease_id = NULL, deadline = NULL,"
                            " error = ?, updated = ? WHERE task_id = ?",
                            (f"gave up after {tries} attempts; last: {reason}", now, task_id))
                    else:
                        conn.execute("UPDATE trainer_tasks SET state = 'queued', lease_id = NULL, worker_id = NULL,"
                                     " deadline = NULL, updated = ? WHERE task_id = ?", (now, task_id))
                    conn.execute("UPDATE trainer_attempts SET ended = ?, outcome = ? WHERE lease_id = ?",
                                 (now, f"expired: {reason}", lease_id))
                expired.append((task_id, attempt))
        self._notify()
        return expired

    # ------------------------------------------------------------------ reading

    def get(self, task_id: str) -> TaskInfo | None:
        with self._lock:
            row = self._conn.execute(f"SELECT {_INFO_COLUMNS} FROM trainer_tasks WHERE task_id = ?",
                                     (task_id,)).fetchone()
            if row is None:
                return None
            info = _info(row)
            info.attempts = [
                {"attempt": a, "lease_id": lid, "worker_id": w, "started": s, "ended": e, "outcome": o,
                 "rollout_id": r}
                for a, lid, w, s, e, o, r in self._conn.execute(
                    "SELECT attempt, lease_id, worker_id, started, ended, outcome, rollout_id FROM trainer_attempts"
                    " WHERE task_id = ? ORDER BY attempt", (task_id,))
            ]
        return info

    def tasks(self, *, state: str | None = None, group_id: str | None = None, limit: int | None = None,
              after: str | None = None) -> list[TaskInfo]:
        """Tasks in queue order, filtered by state and group; with ``after``, only those queued after that task."""
        clauses, params = [], []
        if after is not None:
            clauses.append("seq > COALESCE((SELECT seq FROM trainer_tasks WHERE task_id = ?), -1)")
            params.append(after)
        if state is not None:
            if state not in STATES:
                raise SchemaError("state", f"must be one of {', '.join(STATES)}, got {state!r}")
            clauses.append("state = ?")
            params.append(state)
        if group_id is not None:
            clauses.append("group_id = ?")
            params.append(group_id)
        sql = f"SELECT {_INFO_COLUMNS} FROM trainer_tasks"
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        sql += " ORDER BY seq"
        if limit is not None:
            _check_positive_int(limit, "limit")
            sql += f" LIMIT {int(limit)}"
        with self._lock:
            return [_info(row) for row in self._conn.execute(sql, params)]

    def counts(self) -> dict[str, int]:
        """How many tasks are in each state."""
        with self._lock:
            found = dict(self._conn.execute("SELECT state, COUNT(*) FROM trainer_tasks GROUP BY state").fetchall())
        return {state: int(found.get(state, 0)) for state in STATES}

    # ------------------------------------------------------------------ pieces

    def _payload(self, task: Any, name: str) -> str:
        """A task's payload as stored, refused (naming the field) when no rollout could carry it."""
        text = _dumps(check_json(task, name), name)
        size = len(text.encode("utf-8"))
        if self.max_task_bytes is not None and size > self.max_task_bytes:
            raise SchemaError(name, f"is {size} bytes of JSON; a task may be at most {self.max_task_bytes} bytes, "
                                    "so that the rollout carrying it fits the server's body limit")
        return text

    def _current(self, conn: sqlite3.Connection, lease_id: str) -> tuple[Any, ...]:
        row = conn.execute("SELECT task_id, attempt FROM trainer_tasks WHERE lease_id = ? AND state = 'leased'",
                           (lease_id,)).fetchone()
        if row is None:
            raise LeaseLost(self._why_lost(lease_id, conn))
        return tuple(row)

    def _why_lost(self, lease_id: str, conn: sqlite3.Connection | None = None) -> str:
        c = conn or self._conn
        with self._lock:
            row = c.execute("SELECT task_id, attempt, outcome FROM trainer_attempts WHERE lease_id = ?",
                            (lease_id,)).fetchone()
            if row is None:
                return f"lease {lease_id!r} is unknown to this server"
            task_id, attempt, outcome = row
            now_row = c.execute("SELECT state, attempt FROM trainer_tasks WHERE task_id = ?", (task_id,)).fetchone()
        state, current = now_row if now_row else ("unknown", attempt)
        return (f"lease {lease_id} (task {task_id!r}, attempt {attempt}) is no longer current: {outcome or 'ended'};"
                f" the task is now {state} at attempt {current}")

    def _notify(self) -> None:
        if self.on_change is not None:
            self.on_change()


_INFO_COLUMNS = ("task_id, group_id, task, state, attempt, max_attempts, released, rollout_id, error, lease_id,"
                 " worker_id, deadline, not_before")


def _info(row: Sequence[Any]) -> TaskInfo:
    task_id, group, payload, state, attempt, max_attempts, released, rollout_id, error, lease_id, worker, dl, nb = row
    return TaskInfo(task_id=task_id, group_id=group, task=json.loads(payload), state=state, attempt=attempt,
                    max_attempts=max_attempts, released=released, rollout_id=rollout_id, error=error,
                    lease_id=lease_id, worker_id=worker, deadline=dl, not_before=nb if state == "queued" else None)


def _id_in(task: Any) -> str | None:
    if isinstance(task, dict):
        for key in ("task_id", "id"):
            value = task.get(key)
            if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value):
                return str(value)
    return None


def _first_duplicate(ids: list[str]) -> str:
    seen: set[str] = set()
    for i in ids:
        if i in seen:
            return i
        seen.add(i)
    return ""


def _dumps(value: Any, name: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise SchemaError(name, f"is not JSON-serialisable: {exc}") from None


def _check_positive_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_INT:
        raise SchemaError(name, f"must be a positive integer (at most 2**63 - 1), got {value!r}")


def _check_positive(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise SchemaError(name, f"must be a positive number of seconds, got {value!r}")
