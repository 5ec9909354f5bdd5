"""The server's resources: what an algorithm changes and the agent reads, in numbered versions.

A version is immutable: its resources (``{"system_prompt": "..."}``) never change once
posted, so a rollout's ``resources_version`` says exactly what the agent read. One version
is *current*: the one ``GET /v1/resources`` serves and the workers fetch before each
rollout. Posting makes a new version (current unless ``"current": false``); an algorithm
can point ``current`` back at an older version, and add notes (``metadata``: a score, a
critique) to a version after it ran. All of it lives in the server's SQLite file.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from typing import Any

from agl_core.errors import SchemaError
from agl_core.rollouts import check_resources
from agl_core.schema import check_json

__all__ = ["MAX_RESOURCE_NAME", "ResourceVersions"]

MAX_RESOURCE_NAME = 256
"""Longest resource name, in characters."""

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


def check_named(value: Any, path: str) -> dict[str, Any]:
    """Resources as the server takes them: :func:`check_resources`, names at most :data:`MAX_RESOURCE_NAME` long."""
    plain = check_resources(value, path)
    for name in plain:
        if len(name) > MAX_RESOURCE_NAME:
            raise SchemaError(path, f"resource name {name[:40]!r}... is longer than {MAX_RESOURCE_NAME} characters")
    return plain


class ResourceVersions:
    """Numbered, immutable resource versions with notes, and which one is current."""

    def __init__(self, path: str) -> None:
        self._conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock:
            self._conn.execute("PRAGMA busy_timeout = 30000")
            self._conn.execute("CREATE TABLE IF NOT EXISTS trainer_resources (version INTEGER PRIMARY KEY,"
                               " resources TEXT NOT NULL, metadata TEXT NOT NULL, created REAL NOT NULL)")
            self._conn.execute("CREATE TABLE IF NOT EXISTS trainer_resources_current (id INTEGER PRIMARY KEY"
                               " CHECK (id = 1), version INTEGER NOT NULL)")

    def current(self) -> dict[str, Any] | None:
        """The current version as ``{"version", "resources", "metadata", "created_at", "current"}``; None: none."""
        with self._lock:
            row = self._conn.execute("SELECT version FROM trainer_resources_current").fetchone()
        return self.get(int(row[0])) if row else None

    def get(self, version: int) -> dict[str, Any] | None:
        with self._lock:
            row = self._conn.execute("SELECT r.version, r.resources, r.metadata, r.created, c.version IS NOT NULL"
                                     " FROM trainer_resources r LEFT JOIN trainer_resources_current c"
                                     " ON c.version = r.version WHERE r.version = ?", (version,)).fetchone()
        return _entry(row) if row else None

    def history(self, limit: int, after: int = 0) -> list[dict[str, Any]]:
        """Versions above ``after``, oldest first, at most ``limit``."""
        with self._lock:
            rows = self._conn.execute("SELECT r.version, r.resources, r.metadata, r.created, c.version IS NOT NULL"
                                      " FROM trainer_resources r LEFT JOIN trainer_resources_current c"
                                      " ON c.version = r.version WHERE r.version > ? ORDER BY r.version LIMIT ?",
                                      (after, limit)).fetchall()
        return [_entry(row) for row in rows]

    def add(self, resources: Any, metadata: Any = None, *, current: bool = True) -> dict[str, Any]:
        """A new version of ``resources`` (checked: names to JSON values), current unless ``current`` is false."""
        plain = check_named(resources, "resources")
        notes = _check_metadata(metadata)
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                cur = self._conn.execute("INSERT INTO trainer_resources (version, resources, metadata, created)"
                                         " VALUES ((SELECT COALESCE(MAX(version), 0) + 1 FROM trainer_resources),"
                                         " ?, ?, ?)", (_dumps(plain), _dumps(notes), time.time()))
                version = int(cur.lastrowid or 0)
                if current:
                    self._set_current(version)
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        entry = self.get(version)
        assert entry is not None
        return entry

    def update(self, version: int, metadata: Any = None, *, current: bool = False) -> dict[str, Any] | None:
        """Merge ``metadata`` into a version's notes and/or make it current; None when there is no such version."""
        notes = _check_metadata(metadata)
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                row = self._conn.execute("SELECT metadata FROM trainer_resources WHERE version = ?",
                                         (version,)).fetchone()
                if row is None:
                    self._conn.execute("ROLLBACK")
                    return None
                if notes:
                    merged = {**json.loads(row[0]), **notes}
                    self._conn.execute("UPDATE trainer_resources SET metadata = ? WHERE version = ?",
                                       (_dumps(merged), version))
                if current:
                    self._set_current(version)
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return self.get(version)

    def _set_current(self, version: int) -> None:
        self._conn.execute("INSERT INTO trainer_resources_current (id, version) VALUES (1, ?)"
                           " ON CONFLICT (id) DO UPDATE SET version = excluded.version", (version,))

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _check_metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise SchemaError("metadata", f"must be an object, got {type(metadata).__name__}")
    plain: dict[str, Any] = check_json(metadata, "metadata")
    return plain


def _entry(row: tuple[Any, ...]) -> dict[str, Any]:
    version, resources, metadata, created, current = row
    return {"version": int(version), "resources": json.loads(resources), "metadata": json.loads(metadata),
            "created_at": float(created), "current": bool(current)}
