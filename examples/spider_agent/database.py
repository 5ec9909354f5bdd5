"""The Spider-style environment: a ``concert_singer`` database built here, Spider task records, the reward.

Agent Lightning's spider example reads Spider's own files (``database/<db_id>/<db_id>.sqlite``
and ``train_spider.parquet``); this port builds one database of the same shape in code, so it
runs with nothing downloaded. A task is a Spider record: ``{"id", "db_id", "question",
"query"}`` (``query`` is the gold SQL). The database is made in memory for each rollout, read
only (``PRAGMA query_only``), so a query the model writes never changes what the next rollout
sees. The reward is Spider's execution match: the predicted and gold queries return the same
rows (in order when the gold query orders them), 1.0 or 0.0.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

from examples.runner import read_tasks

__all__ = ["DB_ID", "SCHEMA", "TASKS", "VALIDATION_TASKS", "connect", "evaluate_query", "run_query", "table_info"]

DB_ID = "concert_singer"

SCHEMA = """\
CREATE TABLE stadium (
    stadium_id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    location TEXT NOT NULL,
    capacity INTEGER NOT NULL
);
CREATE TABLE singer (
    singer_id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    country TEXT NOT NULL,
    age INTEGER NOT NULL
);
CREATE TABLE concert (
    concert_id INTEGER PRIMARY KEY,
    concert_name TEXT NOT NULL,
    stadium_id INTEGER NOT NULL REFERENCES stadium(stadium_id),
    year INTEGER NOT NULL
);
CREATE TABLE singer_in_concert (
    concert_id INTEGER NOT NULL REFERENCES concert(concert_id),
    singer_id INTEGER NOT NULL REFERENCES singer(singer_id)
);
"""

_STADIUMS = [(1, "Riverside Arena", "Porto", 12000), (2, "Hill Park", "Lyon", 8000),
             (3, "Harbour Dome", "Porto", 20000), (4, "Old Mill", "Ghent", 3500)]
_SINGERS = [(1, "Ana Ruiz", "Spain", 29), (2, "Tom Baker", "UK", 41), (3, "Lea Moreau", "France", 35),
            (4, "Ivo Petrov", "Bulgaria", 52), (5, "Mia Costa", "Portugal", 24), (6, "Jan de Wit", "Netherlands", 38)]
_CONCERTS = [(1, "Spring Nights", 1, 2014), (2, "Summer Tide", 3, 2015), (3, "Autumn Lights", 2, 2015),
             (4, "Winter Echo", 3, 2016), (5, "Harbour Live", 3, 2014)]
_LINEUPS = [(1, 1), (1, 5), (2, 2), (2, 3), (2, 5), (3, 3), (4, 4), (4, 6), (5, 1), (5, 2)]

TASKS: list[dict[str, Any]] = read_tasks(Path(__file__).with_name("tasks.jsonl"))
VALIDATION_TASKS: list[dict[str, Any]] = read_tasks(Path(__file__).with_name("val.jsonl"))


def connect() -> sqlite3.Connection:
    """A fresh in-memory ``concert_singer`` database, read-only from here on."""
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    conn.executescript(SCHEMA)
    conn.executemany("INSERT INTO stadium VALUES (?, ?, ?, ?)", _STADIUMS)
    conn.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)", _SINGERS)
    conn.executemany("INSERT INTO concert VALUES (?, ?, ?, ?)", _CONCERTS)
    conn.executemany("INSERT INTO singer_in_concert VALUES (?, ?)", _LINEUPS)
    conn.commit()
    conn.execute("PRAGMA query_only = ON")
    return conn


def table_info() -> str:
    """The schema as the agents see it in their prompts (what LangChain's ``SQLDatabase.get_table_info`` gives)."""
    return SCHEMA


def run_query(conn: sqlite3.Connection, query: str, *, limit: int = 20) -> str:
    """The query's rows as text, or ``Error: ...``: what LangChain's ``QuerySQLDatabaseTool`` returns.

    Like that tool, a query that fails does not raise: its error is the result, so the tool span's
    status stays ok (the example's ``query_failed`` AIR rule reads the text).
    """
    try:
        rows = conn.execute(query).fetchmany(limit)
    except (sqlite3.Error, sqlite3.Warning) as exc:  # Warning: more than one statement
        return f"Error: ({type(exc).__name__}) {exc}"
    return "\n".join(repr(r) for r in rows) if rows else "(no rows)"


def _norm(row: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(round(v, 4) if isinstance(v, float) else v for v in row)


def evaluate_query(query: str | None, ground_truth: str) -> float:
    """Execution match on a fresh database: 1.0 when ``query`` returns ``ground_truth``'s rows, else 0.0."""
    if not query:
        return 0.0
    conn = connect()
    try:
        try:
            predicted = [_norm(r) for r in conn.execute(query).fetchall()]
        except (sqlite3.Error, sqlite3.Warning):
            return 0.0
        gold = [_norm(r) for r in conn.execute(ground_truth).fetchall()]
    finally:
        conn.close()
    ordered = "order by" in ground_truth.lower()
    return 1.0 if (predicted == gold if ordered else Counter(predicted) == Counter(gold)) else 0.0
