"""The text-to-SQL environment: a small company database built here, questions with gold SQL, and the reward.

The database (four tables: departments, employees, projects, assignments) is
created in memory for each rollout, so a query the model writes can never
change what the next rollout sees; it is also opened read-only
(``PRAGMA query_only``). The reward executes the predicted query and the gold
query and compares their results, as Spider's execution accuracy does: the
same rows (in order when the gold query orders them), numbers compared after
rounding.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

from examples.runner import read_tasks

__all__ = ["SCHEMA", "TASKS", "connect", "execute", "results_match", "score", "schema_text"]

SCHEMA = """\
CREATE TABLE departments (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    city TEXT NOT NULL
);
CREATE TABLE employees (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    department_id INTEGER NOT NULL REFERENCES departments(id),
    salary INTEGER NOT NULL,
    hired_year INTEGER NOT NULL
);
CREATE TABLE projects (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    department_id INTEGER NOT NULL REFERENCES departments(id),
    budget INTEGER NOT NULL
);
CREATE TABLE assignments (
    employee_id INTEGER NOT NULL REFERENCES employees(id),
    project_id INTEGER NOT NULL REFERENCES projects(id),
    hours INTEGER NOT NULL
);
"""

_DEPARTMENTS = [(1, "Engineering", "Berlin"), (2, "Sales", "Paris"), (3, "Research", "Berlin"),
                (4, "Support", "Lisbon")]
_EMPLOYEES = [
    (1, "Ada", 1, 95000, 2019), (2, "Ben", 1, 72000, 2021), (3, "Chloe", 2, 58000, 2020),
    (4, "Dev", 2, 61000, 2022), (5, "Eva", 3, 88000, 2018), (6, "Farid", 3, 79000, 2023),
    (7, "Gina", 4, 45000, 2021), (8, "Hugo", 1, 103000, 2017), (9, "Ines", 4, 47000, 2023),
    (10, "Jon", 3, 91000, 2020),
]
_PROJECTS = [(1, "Atlas", 1, 250000), (2, "Beacon", 2, 80000), (3, "Comet", 3, 300000), (4, "Delta", 1, 120000),
             (5, "Echo", 4, 40000)]
_ASSIGNMENTS = [(1, 1, 120), (2, 1, 80), (8, 4, 60), (1, 4, 30), (3, 2, 50), (4, 2, 70), (5, 3, 150),
                (6, 3, 90), (10, 3, 110), (7, 5, 40), (9, 5, 35), (5, 1, 20)]

TASKS: list[dict[str, Any]] = read_tasks(Path(__file__).with_name("tasks.jsonl"))


def connect() -> sqlite3.Connection:
    """A fresh in-memory copy of the database, read-only from here on."""
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    conn.executescript(SCHEMA)
    conn.executemany("INSERT INTO departments VALUES (?, ?, ?)", _DEPARTMENTS)
    conn.executemany("INSERT INTO employees VALUES (?, ?, ?, ?, ?)", _EMPLOYEES)
    conn.executemany("INSERT INTO projects VALUES (?, ?, ?, ?)", _PROJECTS)
    conn.executemany("INSERT INTO assignments VALUES (?, ?, ?)", _ASSIGNMENTS)
    conn.commit()
    conn.execute("PRAGMA query_only = ON")
    return conn


def schema_text() -> str:
    """The schema as the agents see it in their prompts."""
    return SCHEMA


def execute(conn: sqlite3.Connection, query: str, *, limit: int = 50) -> list[tuple[Any, ...]]:
    """The query's rows (at most ``limit``); ``sqlite3.Error`` when it does not run (one statement only)."""
    return conn.execute(query).fetchmany(limit)


def _norm(row: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(round(v, 4) if isinstance(v, float) else v for v in row)


def results_match(predicted: list[tuple[Any, ...]], gold: list[tuple[Any, ...]], *, ordered: bool) -> bool:
    """Execution accuracy: the same rows, in the same order when the gold query orders them."""
    p, g = [_norm(r) for r in predicted], [_norm(r) for r in gold]
    return p == g if ordered else Counter(p) == Counter(g)


def score(conn: sqlite3.Connection, query: str | None, gold_sql: str) -> float:
    """1.0 when ``query`` returns what ``gold_sql`` returns, else 0.0 (a query that fails scores 0)."""
    if not query:
        return 0.0
    try:
        predicted = execute(conn, query, limit=10_000)
    except sqlite3.Error:
        return 0.0
    gold = execute(conn, gold_sql, limit=10_000)
    return 1.0 if results_match(predicted, gold, ordered="order by" in gold_sql.lower()) else 0.0
