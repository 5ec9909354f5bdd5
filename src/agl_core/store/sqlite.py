"""The embedded store: one SQLite file that many threads and processes write at once.

Each record is kept as its own ``to_json()`` text, next to the few columns that
queries need (task, status, start time, attempt), so reading back is
``from_json`` and a newer agl can add fields without a table rebuild.

Why the file stays consistent under concurrency: it runs in WAL mode, so readers
never wait for writers; every write is one ``BEGIN IMMEDIATE`` transaction, so
two writers queue on SQLite's lock instead of deadlocking on a lock upgrade;
and a writer that finds the lock taken waits (``busy_timeout``) and retries
until ``timeout`` has passed. Each thread gets its own connection.

Why opening never harms a file that is not ours: the file's first bytes are
checked before SQLite touches it, and the tables and ``application_id`` of an
SQLite file are only read until the file is known to be an agl store (or
empty). Only then is WAL switched on and are pending migrations applied.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import threading
import time
import types
import typing
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union

from agl_core.errors import RolloutConflict, SchemaError, StoreError
from agl_core.schema import SCHEMA_VERSION, Rollout, RolloutStatus, Skipped, Span, Trajectory, Transition
from agl_core.store.base import EXPORT_FORMATS, EXPORT_WHATS

if TYPE_CHECKING:
    from agl_core.store.base import TrajectoryBuilder

__all__ = ["APPLICATION_ID", "STORE_SCHEMA_VERSION", "SqliteStore"]

APPLICATION_ID = 0x61676C31
"""Written into the SQLite header (``PRAGMA application_id``, "agl1") so tools can tell an agl store."""

_SQLITE_MAGIC = b"SQLite format 3\x00"

_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: rollouts with their spans and transitions.
    (
        "CREATE TABLE agl_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        # data: Rollout.to_json() with "spans": [] (spans live in their own table);
        # skipped: JSON list of Skipped, NULL until a trajectory has been stored.
        """CREATE TABLE rollouts (
            id TEXT PRIMARY KEY,
            task_id TEXT NOT NULL,
            attempt INTEGER NOT NULL,
            status TEXT NOT NULL,
            start_time REAL NOT NULL,
            end_time REAL,
            final_reward REAL,
            data TEXT NOT NULL,
            skipped TEXT
        )""",
        "CREATE INDEX rollouts_task ON rollouts (task_id, start_time)",
        "CREATE INDEX rollouts_task_attempt ON rollouts (task_id, attempt)",
        "CREATE INDEX rollouts_status ON rollouts (status, start_time)",
        "CREATE INDEX rollouts_start ON rollouts (start_time)",
        """CREATE TABLE spans (
            rollout_id TEXT NOT NULL REFERENCES rollouts (id) ON DELETE CASCADE,
            span_id TEXT NOT NULL,
            trace_id TEXT NOT NULL,
            start_ns INTEGER NOT NULL,
            data TEXT NOT NULL,
            UNIQUE (rollout_id, span_id)
        )""",
        "CREATE INDEX spans_rollout_start ON spans (rollout_id, start_ns)",
        # pos: place in the trajectory; idx: Transition.index (kept for ad-hoc SQL).
        """CREATE TABLE transitions (
            rollout_id TEXT NOT NULL REFERENCES rollouts (id) ON DELETE CASCADE,
            pos INTEGER NOT NULL,
            idx INTEGER NOT NULL,
            data TEXT NOT NULL,
            PRIMARY KEY (rollout_id, pos)
        )""",
    ),
)

STORE_SCHEMA_VERSION = len(_MIGRATIONS)
"""Layout version of the file this agl writes; a file with a higher one was written by a newer agl."""

_STATUSES: tuple[str, ...] = typing.get_args(RolloutStatus)
_BUSY_CODES = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
_BATCH_ROWS = 1024

_T = TypeVar("_T")
_R = TypeVar("_R", Rollout, Span, Trajectory)
_P = TypeVar("_P", Rollout, Trajectory, Transition)


class SqliteStore:
    """An agl store in one SQLite file; safe to share across threads and processes.

    ``timeout`` is how long, in seconds, a call waits for another writer to let go
    of the file before it raises :class:`~agl_core.errors.StoreError`.
    ``":memory:"`` gives a throwaway store for one process, whose threads then
    take turns on a single connection.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 30.0) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        self._path: str = os.fspath(path)
        self._timeout = float(timeout)
        self._local = threading.local()
        self._registry_lock = threading.Lock()
        self._connections: list[tuple[weakref.ref[threading.Thread], int, sqlite3.Connection]] = []
        self._closed = False
        self._shared: sqlite3.Connection | None = None
        self._guard: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()

        memory = self._path == ":memory:"
        if not memory:
            self._check_magic()
        conn = self._connect()
        try:
            version = self._check_owner(conn)
            if not memory:
                self._use_wal(conn)
            if version < STORE_SCHEMA_VERSION:
                self._transact(conn, "BEGIN IMMEDIATE", self._migrate)
        except BaseException:
            conn.close()
            raise
        if memory:
            self._shared = conn
            self._guard = threading.RLock()
        else:
            self._adopt(conn)

    @property
    def path(self) -> str:
        return self._path

    def __repr__(self) -> str:
        return f"SqliteStore({self._path!r})"

    # ------------------------------------------------------------------ opening

    def _check_magic(self) -> None:
        """Refuse a file that is not SQLite before SQLite opens it (and maybe leaves -wal files beside it)."""
        if os.path.isdir(self._path):
            raise StoreError(f"{self._path} is a directory, not an agl store file")
        try:
            with open(self._path, "rb") as f:
                head = f.read(len(_SQLITE_MAGIC))
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StoreError(f"cannot read {self._path}: {exc}") from exc
        if head and head != _SQLITE_MAGIC:
            raise StoreError(f"{self._path} is not an agl store: file is not a database (it was left unchanged)")

    def _check_owner(self, conn: sqlite3.Connection) -> int:
        """Read-only look at the file: its store schema version (0 when empty), or refused."""
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            tables = sorted(
                row[0]
                for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                if not row[0].startswith("sqlite_")
            )
            if not tables and app_id in (0, APPLICATION_ID):
                return 0
            if app_id != APPLICATION_ID or "agl_meta" not in tables:
                shown = ", ".join(tables[:5]) + (", ..." if len(tables) > 5 else "")
                raise StoreError(
                    f"{self._path} is an SQLite database but not an agl store (tables: {shown or 'none'}, "
                    f"application_id: {app_id:#x}); it was left unchanged: give SqliteStore another path"
                )
            version = self._stored_version(conn)
            self._check_version(version)
            return version
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {self._path} as an agl store: {exc} (it was left unchanged)") from exc

    def _stored_version(self, conn: sqlite3.Connection) -> int:
        has_meta = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'agl_meta'").fetchone()
        if not has_meta:
            return 0
        row = conn.execute("SELECT value FROM agl_meta WHERE key = 'schema_version'").fetchone()
        try:
            return int(row[0])
        except (TypeError, ValueError):
            raise StoreError(f"{self._path}: agl store has no readable schema_version in agl_meta") from None

    def _check_version(self, version: int) -> None:
        if version > STORE_SCHEMA_VERSION:
            raise StoreError(
                f"{self._path} was written by a newer agl (store schema version {version}; this agl reads up "
                f"to version {STORE_SCHEMA_VERSION}); upgrade agl-core to open it. The file was left unchanged."
            )

    def _use_wal(self, conn: sqlite3.Connection) -> None:
        deadline = time.monotonic() + self._timeout
        delay = 0.001
        while True:
            try:
                if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    conn.execute("PRAGMA journal_mode = WAL").fetchone()
                return
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc) or time.monotonic() >= deadline:
                    raise self._error(exc) from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _migrate(self, conn: sqlite3.Connection) -> None:
        # Read again inside the write lock: another process may have migrated since _check_owner.
        version = self._stored_version(conn)
        self._check_version(version)
        if version == STORE_SCHEMA_VERSION:
            return
        for step in _MIGRATIONS[version:]:
            for statement in step:
                conn.execute(statement)
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute(
            "INSERT INTO agl_meta (key, value) VALUES ('schema_version', ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (str(STORE_SCHEMA_VERSION),),
        )

    # ------------------------------------------------------------------ connections

    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(self._path, timeout=self._timeout, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {self._path}: {exc}") from exc
        try:
            conn.execute(f"PRAGMA busy_timeout = {min(int(self._timeout * 1000), 2**31 - 1)}")
            conn.execute("PRAGMA foreign_keys = ON")
            # NORMAL is corruption-safe in WAL mode; it only gives up durability on power loss.
            conn.execute("PRAGMA synchronous = NORMAL")
        except sqlite3.Error as exc:
            conn.close()
            raise StoreError(f"cannot open {self._path}: {exc}") from exc
        return conn

    def _adopt(self, conn: sqlite3.Connection) -> None:
        """Make ``conn`` this thread's connection, closing those of threads that have ended."""
        pid = os.getpid()
        with self._registry_lock:
            if self._closed:
                conn.close()
                raise StoreError(f"{self._path}: the store is closed")
            kept = []
            for ref, owner_pid, other in self._connections:
                if owner_pid != pid:
                    # Inherited through fork: closing it here could drop the parent's SQLite locks.
                    continue
                thread = ref()
                if thread is None or not thread.is_alive():
                    other.close()
                else:
                    kept.append((ref, owner_pid, other))
            kept.append((weakref.ref(threading.current_thread()), pid, conn))
            self._connections = kept
        self._local.conn = conn
        self._local.pid = pid

    def _checkout(self) -> tuple[sqlite3.Connection, contextlib.AbstractContextManager[Any]]:
        if self._closed:
            raise StoreError(f"{self._path}: the store is closed")
        if self._shared is not None:
            return self._shared, self._guard
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():
            conn = self._connect()
            self._adopt(conn)
        return conn, self._guard

    def close(self) -> None:
        """Close every connection this store opened in this process; later calls raise ``StoreError``."""
        pid = os.getpid()
        with self._registry_lock:
            if self._closed:
                return
            self._closed = True
            connections, self._connections = self._connections, []
        if self._shared is not None:
            with self._guard:
                self._shared.close()
        for _, owner_pid, conn in connections:
            if owner_pid == pid:
                conn.close()

    def __enter__(self) -> SqliteStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ transactions

    def _error(self, exc: sqlite3.Error) -> StoreError:
        return StoreError(f"{self._path}: {exc}")

    def _transact(self, conn: sqlite3.Connection, begin: str, work: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``work`` in one transaction, from the start again while another writer holds the file."""
        deadline = time.monotonic() + self._timeout
        delay = 0.001
        while True:
            try:
                conn.execute(begin)
                try:
                    result = work(conn)
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        with contextlib.suppress(sqlite3.Error):
                            conn.execute("ROLLBACK")
                    raise
                return result
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise self._error(exc) from exc
                if time.monotonic() >= deadline:
                    raise StoreError(
                        f"{self._path}: still locked by another writer after {self._timeout:g} s ({exc})"
                    ) from exc
            except sqlite3.Error as exc:
                raise self._error(exc) from exc
            except UnicodeEncodeError as exc:  # rolled back above: nothing stored before is touched
                raise SchemaError("record", f"holds text that is not valid unicode ({exc.reason}: "
                                            f"{exc.object[exc.start:exc.end]!r}); nothing was written") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _write(self, work: Callable[[sqlite3.Connection], _T]) -> _T:
        conn, guard = self._checkout()
        with guard:
            return self._transact(conn, "BEGIN IMMEDIATE", work)

    def _read(self, work: Callable[[sqlite3.Connection], _T]) -> _T:
        # A read transaction gives multi-statement reads one consistent snapshot.
        conn, guard = self._checkout()
        with guard:
            return self._transact(conn, "BEGIN", work)

    # ------------------------------------------------------------------ writes

    def put_rollout(self, rollout: Rollout, trajectory: Trajectory | None = None, *, validate: bool = True) -> None:
        """Insert ``rollout`` and its spans, or update the stored one, and its transitions when ``trajectory`` is given.

        A rollout id belongs to one task and attempt, and a finished rollout is final: storing it
        again with another task, attempt, status or rewards raises :class:`RolloutConflict` naming
        the field. The same result stored again (a retry) is accepted, and adds the spans the
        stored rollout does not have yet; a running rollout is updated. Spans are never dropped: a
        rollout keeps every span stored for it, a running one takes the newer copy of a span.

        All in one transaction: on any error the rollout, spans and transitions stored before stay
        as they were. Without ``trajectory`` the transitions stored earlier are kept.
        """
        clean = _validated(rollout, Rollout, "rollout", validate)
        row = _rollout_row(clean)
        span_rows = [_span_row(clean.id, span) for span in clean.spans]
        transition_rows: list[tuple[str, int, int, str]] = []
        skipped_json: str | None = None
        if trajectory is not None:
            traj = _validated(trajectory, Trajectory, "trajectory", validate)
            _check_belongs(traj, clean)
            transition_rows = [(clean.id, pos, t.index, t.to_json()) for pos, t in enumerate(traj.transitions)]
            skipped_json = _dumps([s.to_dict() for s in traj.skipped])

        def work(conn: sqlite3.Connection) -> None:
            stored = conn.execute("SELECT task_id, attempt, status, data FROM rollouts WHERE id = ?",
                                  (clean.id,)).fetchone()
            final = stored is not None and _check_stored_again(clean, *stored)
            if final:  # the same finished result again: it keeps its row and gains the spans it lacked
                _insert_spans(conn, span_rows)
                if trajectory is not None:
                    conn.execute("UPDATE rollouts SET skipped = ? WHERE id = ?", (skipped_json, clean.id))
            else:
                conn.execute(
                    "INSERT INTO rollouts (id, task_id, attempt, status, start_time, end_time, final_reward, data,"
                    " skipped) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET"
                    " status = excluded.status, start_time = excluded.start_time, end_time = excluded.end_time,"
                    " final_reward = excluded.final_reward, data = excluded.data,"
                    " skipped = coalesce(excluded.skipped, rollouts.skipped)",
                    (*row, skipped_json),
                )
                _upsert_spans(conn, span_rows)
            if trajectory is not None:
                conn.execute("DELETE FROM transitions WHERE rollout_id = ?", (clean.id,))
                conn.executemany(
                    "INSERT INTO transitions (rollout_id, pos, idx, data) VALUES (?, ?, ?, ?)", transition_rows
                )

        self._write(work)

    def add_spans(self, rollout_id: str, spans: Sequence[Span]) -> None:
        """Append spans to a stored rollout; a span whose ``span_id`` it already has is left as it was."""
        _check_id(rollout_id, "rollout_id")
        if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence):
            raise TypeError(f"spans must be a sequence of Span, got {type(spans).__name__}")
        rows = [_span_row(rollout_id, _validated(span, Span, f"spans[{i}]")) for i, span in enumerate(spans)]

        def work(conn: sqlite3.Connection) -> None:
            if conn.execute("SELECT 1 FROM rollouts WHERE id = ?", (rollout_id,)).fetchone() is None:
                raise StoreError(f"{self._path}: no rollout {rollout_id!r} to add spans to; put_rollout it first")
            _insert_spans(conn, rows)

        self._write(work)

    # ------------------------------------------------------------------ reads

    def get_rollout(self, rollout_id: str, *, with_spans: bool = True) -> Rollout | None:
        """The rollout with this id (with its spans unless ``with_spans`` is false), or None."""
        _check_id(rollout_id, "rollout_id")

        def work(conn: sqlite3.Connection) -> Rollout | None:
            row = conn.execute("SELECT data FROM rollouts WHERE id = ?", (rollout_id,)).fetchone()
            if row is None:
                return None
            return _rollout_from(row[0], _spans_of(conn, rollout_id) if with_spans else [])

        return self._read(work)

    def rollouts(
        self,
        *,
        task_id: str | None = None,
        status: str | Sequence[str] | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = None,
        with_spans: bool = False,
    ) -> list[Rollout]:
        """Rollouts matching every filter given, ``since <= start_time < until``, oldest first."""
        where, params = _filters(task_id=task_id, status=status, since=since, until=until)
        sql = f"SELECT id, data FROM rollouts{where} ORDER BY start_time, rowid"
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"limit must be a non-negative integer, got {limit!r}")
            sql += " LIMIT ?"
            params.append(limit)

        def work(conn: sqlite3.Connection) -> list[Rollout]:
            rows = conn.execute(sql, params).fetchall()
            return [_rollout_from(data, _spans_of(conn, rid) if with_spans else []) for rid, data in rows]

        return self._read(work)

    def spans(self, rollout_id: str) -> list[Span]:
        """The spans of one rollout by ``start_ns`` (then in the order they were added); [] if none."""
        _check_id(rollout_id, "rollout_id")
        return self._read(lambda conn: _spans_of(conn, rollout_id))

    def transitions(self, *, rollout_id: str | None = None, task_id: str | None = None) -> list[Transition]:
        """Stored transitions matching every filter given, by rollout start time, then trajectory order."""
        clauses: list[str] = []
        params: list[Any] = []
        if rollout_id is not None:
            _check_id(rollout_id, "rollout_id")
            clauses.append("t.rollout_id = ?")
            params.append(rollout_id)
        if task_id is not None:
            _check_id(task_id, "task_id")
            clauses.append("r.task_id = ?")
            params.append(task_id)
        where = " WHERE " + " AND ".join(clauses) if clauses else ""
        sql = (
            f"SELECT t.data FROM transitions t JOIN rollouts r ON r.id = t.rollout_id{where}"
            " ORDER BY r.start_time, r.rowid, t.pos"
        )
        return self._read(lambda conn: [Transition.from_json(row[0]) for row in conn.execute(sql, params)])

    def trajectories(
        self,
        *,
        task_id: str | None = None,
        status: str | Sequence[str] | None = None,
        rollout_ids: Sequence[str] | None = None,
        builder: TrajectoryBuilder | None = None,
    ) -> list[Trajectory]:
        """Trajectories of the matching rollouts, oldest first.

        Without ``builder``: the stored ones, for rollouts stored with a
        trajectory; ``reward`` is the rollout's final reward. With ``builder``:
        ``builder.build(rollout)`` on every matching rollout, spans included, so
        another selection of transitions can be made from the same runs.
        """
        where, params = _filters(task_id=task_id, status=status, rollout_ids=rollout_ids)
        if builder is not None:
            if not callable(getattr(builder, "build", None)):
                raise TypeError(f"builder must have a build(rollout) method, got {type(builder).__name__}")
            sql = f"SELECT id, data FROM rollouts{where} ORDER BY start_time, rowid"
            runs = self._read(
                lambda conn: [_rollout_from(data, _spans_of(conn, rid)) for rid, data in conn.execute(sql, params)]
            )
            built = []
            for run in runs:
                traj = builder.build(run)
                if not isinstance(traj, Trajectory):
                    raise TypeError(f"builder.build() must return a Trajectory, got {type(traj).__name__}")
                built.append(traj)
            return built

        where += (" AND" if where else " WHERE") + " skipped IS NOT NULL"
        sql = f"SELECT id, task_id, attempt, final_reward, skipped FROM rollouts{where} ORDER BY start_time, rowid"

        def work(conn: sqlite3.Connection) -> list[Trajectory]:
            return [_trajectory_of(conn, *row) for row in conn.execute(sql, params).fetchall()]

        return self._read(work)

    # ------------------------------------------------------------------ pages

    def rollouts_page(
        self,
        *,
        limit: int,
        after: str | None = None,
        task_id: str | None = None,
        status: str | Sequence[str] | None = None,
        since: float | None = None,
        until: float | None = None,
        with_spans: bool = False,
    ) -> tuple[list[Rollout], str | None]:
        """Up to ``limit`` of :meth:`rollouts` after the cursor ``after``, and the cursor of the next page.

        Pages walk one total order, ``(start_time, insertion order)``, and a cursor is a place in it,
        not a rollout: every rollout comes exactly once however many share a start time, and a
        rollout stored meanwhile is listed if it falls after the cursor. The next cursor is None on
        the last page. A cursor this listing never gave raises ``ValueError``.
        """
        where, params = _filters(task_id=task_id, status=status, since=since, until=until)
        key = _parse_cursor(after, 2)

        def work(conn: sqlite3.Connection) -> tuple[list[Rollout], list[tuple[Any, ...]]]:
            rows = _keyset(conn, "SELECT start_time, rowid, id, data FROM rollouts", where, params, key,
                           _check_limit(limit) + 1)
            return [_rollout_from(data, _spans_of(conn, rid) if with_spans else [])
                    for _, _, rid, data in rows[:limit]], rows

        page, rows = self._read(work)
        return _paged(page, rows, limit)

    def trajectories_page(
        self,
        *,
        limit: int,
        after: str | None = None,
        task_id: str | None = None,
        status: str | Sequence[str] | None = None,
        rollout_ids: Sequence[str] | None = None,
    ) -> tuple[list[Trajectory], str | None]:
        """Up to ``limit`` of :meth:`trajectories` (the stored ones) after ``after``, as :meth:`rollouts_page` pages."""
        where, params = _filters(task_id=task_id, status=status, rollout_ids=rollout_ids)
        where += (" AND" if where else " WHERE") + " skipped IS NOT NULL"
        key = _parse_cursor(after, 2)

        def work(conn: sqlite3.Connection) -> tuple[list[Trajectory], list[tuple[Any, ...]]]:
            rows = _keyset(conn, "SELECT start_time, rowid, id, task_id, attempt, final_reward, skipped FROM rollouts",
                           where, params, key, _check_limit(limit) + 1)
            return [_trajectory_of(conn, *row[2:]) for row in rows[:limit]], rows

        page, rows = self._read(work)
        return _paged(page, rows, limit)

    def transitions_page(
        self, *, limit: int, after: str | None = None, rollout_id: str | None = None, task_id: str | None = None
    ) -> tuple[list[Transition], str | None]:
        """Up to ``limit`` of :meth:`transitions` after ``after``, as :meth:`rollouts_page` pages.

        The order is the rollouts' and then each trajectory's, so a cursor is a place in a rollout.
        """
        clauses: list[str] = []
        params: list[Any] = []
        if rollout_id is not None:
            _check_id(rollout_id, "rollout_id")
            clauses.append("r.id = ?")
            params.append(rollout_id)
        if task_id is not None:
            _check_id(task_id, "task_id")
            clauses.append("r.task_id = ?")
            params.append(task_id)
        key = _parse_cursor(after, 3)
        want = _check_limit(limit) + 1
        select = "SELECT r.start_time, r.rowid, t.pos, t.data FROM rollouts r JOIN transitions t ON t.rollout_id = r.id"

        def work(conn: sqlite3.Connection) -> list[tuple[Any, ...]]:
            rows: list[tuple[Any, ...]] = []

            def stage(extra: list[str], more: list[Any], order: str) -> list[tuple[Any, ...]]:
                where = " WHERE " + " AND ".join(clauses + extra) if clauses or extra else ""
                found = conn.execute(f"{select}{where} ORDER BY {order} LIMIT {int(want - len(rows))}",
                                     [*params, *more]).fetchall()
                return [tuple(row) for row in found]

            if key is None:
                return stage([], [], "r.start_time, r.rowid, t.pos")
            start, rowid, pos = key
            for extra, more, order in ((["r.rowid = ?", "t.pos > ?"], [rowid, pos], "t.pos"),
                                       (["r.start_time = ?", "r.rowid > ?"], [start, rowid], "r.rowid, t.pos"),
                                       (["r.start_time > ?"], [start], "r.start_time, r.rowid, t.pos")):
                rows += stage(extra, more, order)
                if len(rows) >= want:
                    break
            return rows

        rows = self._read(work)
        return _paged([Transition.from_json(row[3]) for row in rows[:limit]], rows, limit, 3)

    # ------------------------------------------------------------------ export

    def export(self, path: str | os.PathLike[str], format: str = "jsonl", *, what: str = "transitions") -> int:
        """Write every stored record of kind ``what`` to ``path``; return how many were written.

        ``jsonl`` writes one ``to_json()`` per line. ``parquet`` writes one column
        per field: numbers, strings and token-id lists keep their types; nested
        values (messages, attributes, spans of a rollout) are JSON text, marked by
        the field metadata ``agl.encoding = json``. Exported spans carry the id
        of their rollout. The file appears complete or not at all.
        """
        if format not in EXPORT_FORMATS:
            raise ValueError(f"format must be one of {', '.join(map(repr, EXPORT_FORMATS))}, got {format!r}")
        if what not in EXPORT_WHATS:
            raise ValueError(f"what must be one of {', '.join(map(repr, EXPORT_WHATS))}, got {what!r}")
        target = os.fspath(path)
        write: Callable[[str, Iterator[str]], int]
        if format == "parquet":
            write = _parquet_writer(typing.cast(Literal["transitions", "rollouts", "spans"], what))
        else:
            write = _write_jsonl
        tmp = f"{target}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            count = self._read(lambda conn: write(tmp, _export_lines(conn, what)))
            os.replace(tmp, target)
        except OSError as exc:
            raise StoreError(f"cannot write {target}: {exc}") from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        return count


# ---------------------------------------------------------------------- records <-> rows


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _validated(value: Any, cls: type[_R], name: str, validate: bool = True) -> _R:
    """``value`` checked again, in place: a record's fields may have been changed since it was built."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
    if validate:
        value.validate(name)
    return value


def _check_id(value: Any, name: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")


def _check_belongs(traj: Trajectory, rollout: Rollout) -> None:
    for name in ("rollout_id", "task_id", "attempt"):
        mine, theirs = getattr(traj, name), getattr(rollout, "id" if name == "rollout_id" else name)
        if mine != theirs:
            raise SchemaError(f"trajectory.{name}", f"is {mine!r} but the rollout's is {theirs!r}")
    for i, t in enumerate(traj.transitions):
        if t.rollout_id != rollout.id:
            raise SchemaError(
                f"trajectory.transitions[{i}].rollout_id", f"is {t.rollout_id!r} but the rollout's is {rollout.id!r}"
            )


def _rollout_row(rollout: Rollout) -> tuple[Any, ...]:
    data = rollout.to_dict()
    data["spans"] = []
    return (
        rollout.id,
        rollout.task_id,
        rollout.attempt,
        rollout.status,
        rollout.start_time,
        rollout.end_time,
        rollout.final_reward,
        _dumps(data),
    )


def _span_row(rollout_id: str, span: Span) -> tuple[str, str, str, int, str]:
    return (rollout_id, span.span_id, span.trace_id, span.start_ns, span.to_json())


def _insert_spans(conn: sqlite3.Connection, rows: Iterable[tuple[str, str, str, int, str]]) -> None:
    conn.executemany(
        "INSERT INTO spans (rollout_id, span_id, trace_id, start_ns, data) VALUES (?, ?, ?, ?, ?)"
        " ON CONFLICT (rollout_id, span_id) DO NOTHING",
        rows,
    )


def _upsert_spans(conn: sqlite3.Connection, rows: Iterable[tuple[str, str, str, int, str]]) -> None:
    conn.executemany(
        "INSERT INTO spans (rollout_id, span_id, trace_id, start_ns, data) VALUES (?, ?, ?, ?, ?)"
        " ON CONFLICT (rollout_id, span_id) DO UPDATE SET trace_id = excluded.trace_id,"
        " start_ns = excluded.start_ns, data = excluded.data",
        rows,
    )


_FINISHED = frozenset(_STATUSES) - {"running"}


def _check_stored_again(rollout: Rollout, task_id: str, attempt: int, status: str, data: str) -> bool:
    """Whether the stored rollout is finished (and ``rollout`` the same result); RolloutConflict if it may not change.

    Only the identity and the outcome are compared: spans, timing and the rest may differ between
    two posts of one result (token ids joined once, a span sent late).
    """
    if rollout.task_id != task_id:
        raise RolloutConflict(rollout.id, "task_id", f"belongs to task {task_id!r} attempt {attempt}; it cannot "
                                                     f"be stored for task {rollout.task_id!r}")
    if rollout.attempt != attempt:
        raise RolloutConflict(rollout.id, "attempt", f"belongs to task {task_id!r} attempt {attempt}; it cannot "
                                                     f"be stored as attempt {rollout.attempt}")
    if status not in _FINISHED:
        return False
    if rollout.status != status:
        raise RolloutConflict(rollout.id, "status", f"finished as {status!r}; a finished rollout is final and "
                                                    f"cannot become {rollout.status!r}")
    stored = json.loads(data).get("rewards") or []
    if [r.to_dict() for r in rollout.rewards] != stored:
        shown = [r.get("value") for r in stored]
        raise RolloutConflict(rollout.id, "rewards", f"finished with rewards {shown}; a finished rollout is final "
                                                     f"and cannot take {[r.value for r in rollout.rewards]}")
    return True


def _spans_of(conn: sqlite3.Connection, rollout_id: str) -> list[Span]:
    rows = conn.execute("SELECT data FROM spans WHERE rollout_id = ? ORDER BY start_ns, rowid", (rollout_id,))
    return [Span.from_json(row[0]) for row in rows]


def _trajectory_of(conn: sqlite3.Connection, rid: str, task: str, attempt: int, reward: float | None,
                   skipped: str) -> Trajectory:
    steps = conn.execute("SELECT data FROM transitions WHERE rollout_id = ? ORDER BY pos", (rid,))
    return Trajectory(
        rollout_id=rid,
        task_id=task,
        attempt=attempt,
        transitions=[Transition.from_json(row[0]) for row in steps],
        reward=reward,
        skipped=[Skipped.from_dict(s) for s in json.loads(skipped)],
    )


# ---------------------------------------------------------------------- pages


def _check_limit(limit: Any) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    return limit


def _cursor(*key: Any) -> str:
    """A place in a listing: the start time (``repr`` is exact), the rollout's row id, and the position."""
    return "~".join(repr(float(k)) if i == 0 else str(int(k)) for i, k in enumerate(key))


def _parse_cursor(after: str | None, parts: int) -> tuple[Any, ...] | None:
    if after is None:
        return None
    if not isinstance(after, str):
        raise TypeError(f"after must be a str (a page's cursor), got {type(after).__name__}")
    pieces = after.split("~")
    try:
        if len(pieces) != parts:
            raise ValueError
        start = float(pieces[0])
        rest = [int(p) for p in pieces[1:]]
    except ValueError:
        raise ValueError(f"{after[:200]!r} is not a cursor of this listing (pass the 'next' of the page before)"
                         ) from None
    if not math.isfinite(start) or any(not 0 <= r <= 2**63 - 1 for r in rest):
        raise ValueError(f"{after[:200]!r} is not a cursor of this listing (pass the 'next' of the page before)")
    return (start, *rest)


def _keyset(conn: sqlite3.Connection, select: str, where: str, params: list[Any], key: tuple[Any, ...] | None,
            want: int) -> list[tuple[Any, ...]]:
    """Up to ``want`` rows of ``select`` (start_time and rowid first) after ``key`` in (start_time, rowid) order.

    Two index-range queries (the rest of the cursor's start time, then later start times) rather
    than one row-value comparison, which SQLite answers by scanning every tie of the start time.
    """
    joiner = " AND" if where else " WHERE"
    if key is None:
        return [tuple(r) for r in conn.execute(f"{select}{where} ORDER BY start_time, rowid LIMIT {int(want)}",
                                               params)]
    start, rowid = key
    rows = [tuple(r) for r in conn.execute(f"{select}{where}{joiner} start_time = ? AND rowid > ? ORDER BY rowid"
                                           f" LIMIT {int(want)}", [*params, start, rowid])]
    if len(rows) < want:
        rows += [tuple(r) for r in conn.execute(f"{select}{where}{joiner} start_time > ? ORDER BY start_time, rowid"
                                                f" LIMIT {int(want - len(rows))}", [*params, start])]
    return rows


def _paged(page: list[_P], rows: list[tuple[Any, ...]], limit: int, key_len: int = 2) -> tuple[list[_P], str | None]:
    """The page and, when a row beyond it was found, the cursor of its last item (each row starts with its key)."""
    if len(rows) <= limit:
        return page[:limit], None
    return page[:limit], _cursor(*rows[limit - 1][:key_len])


def _rollout_from(data: str, spans: list[Span]) -> Rollout:
    fields_ = json.loads(data)
    fields_["spans"] = spans
    return Rollout.from_dict(fields_)


def _filters(
    *,
    task_id: str | None = None,
    status: str | Sequence[str] | None = None,
    since: float | None = None,
    until: float | None = None,
    rollout_ids: Sequence[str] | None = None,
) -> tuple[str, list[Any]]:
    """The WHERE clause over ``rollouts`` for the filters given, with its parameters."""
    clauses: list[str] = []
    params: list[Any] = []
    if task_id is not None:
        _check_id(task_id, "task_id")
        clauses.append("task_id = ?")
        params.append(task_id)
    if status is not None:
        wanted = [status] if isinstance(status, str) else list(status)
        for value in wanted:
            if value not in _STATUSES:
                raise ValueError(f"status must be one of {', '.join(map(repr, _STATUSES))}, got {value!r}")
        clauses.append("status IN (SELECT value FROM json_each(?))")
        params.append(_dumps(wanted))
    for name, bound, op in (("since", since, ">="), ("until", until, "<")):
        if bound is None:
            continue
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or math.isnan(bound):
            raise ValueError(f"{name} must be a time in epoch seconds, got {bound!r}")
        clauses.append(f"start_time {op} ?")
        params.append(float(bound))
    if rollout_ids is not None:
        ids = [rollout_ids] if isinstance(rollout_ids, str) else list(rollout_ids)
        for i, rid in enumerate(ids):
            _check_id(rid, f"rollout_ids[{i}]")
        clauses.append("id IN (SELECT value FROM json_each(?))")
        params.append(_dumps(ids))
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params


def _is_busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _BUSY_CODES
    message = str(exc).lower()
    return "locked" in message or "busy" in message


# ---------------------------------------------------------------------- export


def _export_lines(conn: sqlite3.Connection, what: str) -> Iterator[str]:
    """Each record of kind ``what`` as its ``to_json()`` text, in store order."""
    if what == "transitions":
        rows = conn.execute(
            "SELECT t.data FROM transitions t JOIN rollouts r ON r.id = t.rollout_id"
            " ORDER BY r.start_time, r.rowid, t.pos"
        )
        for (data,) in rows:
            yield data
    elif what == "spans":
        rows = conn.execute(
            "SELECT s.rollout_id, s.data FROM spans s JOIN rollouts r ON r.id = s.rollout_id"
            " ORDER BY r.start_time, r.rowid, s.start_ns, s.rowid"
        )
        for rid, data in rows:
            span = json.loads(data)
            if span.get("rollout_id") is None:
                span["rollout_id"] = rid
                data = _dumps(span)
            yield data
    else:
        for rid, data in conn.execute("SELECT id, data FROM rollouts ORDER BY start_time, rowid").fetchall():
            rollout = json.loads(data)
            spans = conn.execute("SELECT data FROM spans WHERE rollout_id = ? ORDER BY start_ns, rowid", (rid,))
            rollout["spans"] = [json.loads(s) for (s,) in spans]
            yield _dumps(rollout)


def _write_jsonl(path: str, lines: Iterator[str]) -> int:
    count = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(line)
            f.write("\n")
            count += 1
    return count


_RECORD_OF = {"transitions": Transition, "rollouts": Rollout, "spans": Span}


def _parquet_writer(what: Literal["transitions", "rollouts", "spans"]) -> Callable[[str, Iterator[str]], int]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise StoreError("exporting to parquet needs pyarrow: pip install pyarrow") from None
    cls = _RECORD_OF[what]
    schema, json_columns = _arrow_schema(pa, cls)

    def write(path: str, lines: Iterator[str]) -> int:
        count = 0
        with open(path, "wb") as sink, pq.ParquetWriter(sink, schema) as writer:
            for batch in _batches(lines):
                rows = [json.loads(line) for line in batch]
                for row in rows:
                    for name in json_columns:
                        row[name] = None if row[name] is None else _dumps(row[name])
                try:
                    writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                except (pa.ArrowException, OverflowError) as exc:
                    raise StoreError(f"cannot export {what} to parquet: {exc}") from exc
                count += len(rows)
        return count

    return write


def _batches(lines: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    for line in lines:
        batch.append(line)
        if len(batch) == _BATCH_ROWS:
            yield batch
            batch = []
    if batch:
        yield batch


def _arrow_schema(pa: Any, cls: type[Any]) -> tuple[Any, list[str]]:
    """One arrow column per field of ``cls``; fields with nested values become JSON text columns."""
    hints = typing.get_type_hints(cls)
    columns = []
    json_columns = []
    for f in fields(cls):
        arrow_type = _arrow_type(pa, hints[f.name])
        if arrow_type is None:
            json_columns.append(f.name)
            columns.append(pa.field(f.name, pa.string(), metadata={"agl.encoding": "json"}))
        else:
            columns.append(pa.field(f.name, arrow_type))
    metadata = {"agl.record": cls.__name__, "agl.schema_version": str(SCHEMA_VERSION)}
    return pa.schema(columns, metadata=metadata), json_columns


def _arrow_type(pa: Any, hint: Any) -> Any:
    """The arrow type of a field's type hint, or None when its values are nested JSON."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _arrow_type(pa, inner[0]) if len(inner) == 1 else None
    if origin is Literal:
        return pa.string() if all(isinstance(a, str) for a in typing.get_args(hint)) else None
    if origin is list:
        (item,) = typing.get_args(hint)
        scalar = _arrow_type(pa, item) if item in (bool, int, float, str) else None
        return None if scalar is None else pa.list_(scalar)
    scalars = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string()}
    return scalars.get(hint)
