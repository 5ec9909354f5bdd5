"""SqliteStore: round trips, queries, concurrent writers, files that are not ours, export."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agl_core.errors import SchemaError, StoreError
from agl_core.schema import Reward, Rollout, Skipped, Span, Trajectory, Transition
from agl_core.store import SqliteStore, Store
from agl_core.store.sqlite import APPLICATION_ID, STORE_SCHEMA_VERSION

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def make_span(rollout_id: str, n: int, start_ns: int, **attributes: object) -> Span:
    return Span(
        span_id=f"{n:016x}",
        trace_id=TRACE,
        name="chat gpt-x",
        start_ns=start_ns,
        end_ns=start_ns + 5,
        attributes={"gen_ai.operation.name": "chat", "n": n, **attributes},
        events=[{"name": "tick", "attributes": {"ok": True}}],
    )


def make_rollout(
    rid: str,
    *,
    task_id: str = "task-a",
    status: str = "succeeded",
    start: float = 1000.0,
    reward: float | None = 1.0,
    n_spans: int = 3,
) -> Rollout:
    # Spans given out of start order, so ordering by start_ns is observable.
    spans = [make_span(rid, n, start_ns=(n_spans - n) * 100) for n in range(n_spans)]
    rewards = [Reward(0.25, name="tool_ok", time_ns=1)] + ([Reward(reward)] if reward is not None else [])
    return Rollout(
        id=rid,
        task_id=task_id,
        status=status,  # type: ignore[arg-type]
        task={"question": "Wie viel ist 2+2? ✓", "n": [1, 2.5, None]},
        spans=spans,
        rewards=rewards,
        start_time=start,
        end_time=start + 1.5,
        metadata={"worker": "w-1"},
    )


def make_trajectory(rollout: Rollout, n: int = 2, *, model: str = "gpt-x") -> Trajectory:
    steps = [
        Transition(
            rollout_id=rollout.id,
            task_id=rollout.task_id,
            attempt=rollout.attempt,
            index=i,
            prompt=[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"step {i} ✓"}],
            response={"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
            agent_name="writer",
            model=model,
            prompt_token_ids=[1, 2, 3 + i],
            response_token_ids=[7, 8],
            response_logprobs=[-0.5, -0.25],
            token_source="gateway",
            reward=None if i else 0.25,
            credited_reward=1.0,
            span_id=rollout.spans[i].span_id if i < len(rollout.spans) else None,
            trace_id=TRACE,
        )
        for i in range(n)
    ]
    return Trajectory(
        rollout_id=rollout.id,
        task_id=rollout.task_id,
        attempt=rollout.attempt,
        transitions=steps,
        reward=rollout.final_reward,
        skipped=[Skipped(span_id="00000000000000ff", reason="agent 'checker' not matched")],
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    with SqliteStore(tmp_path / "runs.db", timeout=10) as s:
        yield s


def by_start(spans: list[Span]) -> list[Span]:
    return sorted(spans, key=lambda s: s.start_ns)


# --------------------------------------------------------------------------- round trips


def test_round_trip_of_rollout_spans_transitions_trajectory(store: SqliteStore) -> None:
    r = make_rollout("r-1")
    traj = make_trajectory(r)
    store.put_rollout(r, traj)

    got = store.get_rollout("r-1")
    assert got is not None
    assert got.to_dict() == {**r.to_dict(), "spans": [s.to_dict() for s in by_start(r.spans)]}
    bare = store.get_rollout("r-1", with_spans=False)
    assert bare is not None and bare.spans == [] and bare.task == r.task and bare.final_reward == 1.0
    assert store.spans("r-1") == by_start(r.spans)
    assert store.transitions(rollout_id="r-1") == traj.transitions
    assert store.trajectories() == [traj]
    assert store.get_rollout("nope") is None and store.spans("nope") == []


def test_store_satisfies_protocol_and_reopens_with_data(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    with SqliteStore(path) as s:
        assert isinstance(s, Store)
        s.put_rollout(make_rollout("r-1"), make_trajectory(make_rollout("r-1")))
    with SqliteStore(str(path)) as again:
        assert [r.id for r in again.rollouts()] == ["r-1"]
        assert len(again.transitions()) == 2
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert raw.execute("SELECT value FROM agl_meta WHERE key='schema_version'").fetchone()[0] == "1"
    raw.close()


def test_memory_store_works_for_one_process() -> None:
    with SqliteStore(":memory:") as s:
        s.put_rollout(make_rollout("m-1"))
        assert s.get_rollout("m-1") == Rollout.from_dict(
            {**make_rollout("m-1").to_dict(), "spans": [x.to_dict() for x in by_start(make_rollout("m-1").spans)]}
        )


def test_closed_store_refuses_calls(tmp_path: Path) -> None:
    s = SqliteStore(tmp_path / "runs.db")
    s.close()
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.rollouts()


# --------------------------------------------------------------------------- queries


def test_queries_by_task_status_time_window_and_limit(store: SqliteStore) -> None:
    rows = [
        ("a1", "task-a", "succeeded", 30.0),
        ("a2", "task-a", "failed", 10.0),
        ("b1", "task-b", "succeeded", 20.0),
        ("b2", "task-b", "running", 40.0),
        ("b3", "task-b", "timeout", 50.0),
    ]
    for rid, task, status, start in rows:
        store.put_rollout(make_rollout(rid, task_id=task, status=status, start=start))

    def ids(found: list[Rollout]) -> list[str]:
        return [r.id for r in found]

    assert ids(store.rollouts()) == ["a2", "b1", "a1", "b2", "b3"]
    assert ids(store.rollouts(task_id="task-a")) == ["a2", "a1"]
    assert ids(store.rollouts(status="succeeded")) == ["b1", "a1"]
    assert ids(store.rollouts(status=["running", "timeout"], task_id="task-b")) == ["b2", "b3"]
    assert ids(store.rollouts(since=20.0, until=40.0)) == ["b1", "a1"]
    assert ids(store.rollouts(since=45)) == ["b3"]
    assert ids(store.rollouts(limit=2)) == ["a2", "b1"]
    assert store.rollouts(limit=0) == []
    assert all(r.spans == [] for r in store.rollouts())
    assert [len(r.spans) for r in store.rollouts(task_id="task-a", with_spans=True)] == [3, 3]

    with pytest.raises(ValueError, match="status must be one of"):
        store.rollouts(status="done")
    with pytest.raises(ValueError, match="limit"):
        store.rollouts(limit=-1)


def test_transitions_and_trajectories_filters(store: SqliteStore) -> None:
    a = make_rollout("a", task_id="task-a", start=2.0, reward=0.5)
    b = make_rollout("b", task_id="task-b", start=1.0, status="failed", reward=None)
    c = make_rollout("c", task_id="task-a", start=3.0)  # stored without a trajectory
    store.put_rollout(a, make_trajectory(a, 2))
    store.put_rollout(b, make_trajectory(b, 1))
    store.put_rollout(c)

    assert [(t.rollout_id, t.index) for t in store.transitions()] == [("b", 0), ("a", 0), ("a", 1)]
    assert [t.rollout_id for t in store.transitions(task_id="task-a")] == ["a", "a"]
    assert store.transitions(rollout_id="c") == []
    assert [(t.rollout_id, t.reward) for t in store.trajectories()] == [("b", None), ("a", 0.5)]
    assert [t.rollout_id for t in store.trajectories(status="failed")] == ["b"]
    assert [t.rollout_id for t in store.trajectories(rollout_ids=["a", "c"])] == ["a"]
    assert store.trajectories(task_id="task-z") == []


def test_trajectories_rebuilt_by_a_builder_from_stored_spans(store: SqliteStore) -> None:
    class FirstSpanOnly:
        """A user's own selection: one transition per rollout, from its earliest span."""

        def __init__(self) -> None:
            self.seen: list[Rollout] = []

        def build(self, rollout: Rollout) -> Trajectory:
            self.seen.append(rollout)
            first = rollout.spans[0]
            step = Transition(
                rollout_id=rollout.id,
                task_id=rollout.task_id,
                index=0,
                prompt=[{"role": "user", "content": "x"}],
                response={"role": "assistant", "content": first.name},
                span_id=first.span_id,
            )
            return Trajectory(rollout.id, rollout.task_id, transitions=[step], reward=rollout.final_reward)

    for rid, start in (("x", 2.0), ("y", 1.0)):
        store.put_rollout(make_rollout(rid, start=start))  # no stored trajectory: a builder still sees them
    builder = FirstSpanOnly()
    built = store.trajectories(builder=builder)
    assert [t.rollout_id for t in built] == ["y", "x"]
    assert [len(r.spans) for r in builder.seen] == [3, 3]
    assert built[0].transitions[0].span_id == by_start(make_rollout("y").spans)[0].span_id
    assert [t.rollout_id for t in store.trajectories(rollout_ids=["x"], builder=builder)] == ["x"]


# --------------------------------------------------------------------------- writes


def test_a_running_rollout_is_updated_keeping_its_spans_and_transitions_unless_given(store: SqliteStore) -> None:
    first = make_rollout("r", status="running", n_spans=3)
    store.put_rollout(first, make_trajectory(first, 3))

    second = make_rollout("r", status="succeeded", n_spans=1, reward=0.0)
    second.spans[0].attributes["newer"] = True
    store.put_rollout(second)
    got = store.get_rollout("r")
    assert got is not None and got.status == "succeeded"
    assert sorted(s.span_id for s in got.spans) == sorted(s.span_id for s in first.spans)  # none dropped
    assert next(s for s in got.spans if s.span_id == second.spans[0].span_id).attributes["newer"] is True
    assert len(store.transitions(rollout_id="r")) == 3
    assert [t.reward for t in store.trajectories()] == [0.0]
    assert len(store.rollouts()) == 1

    store.put_rollout(second, make_trajectory(second, 1))  # the same result again, with its transitions
    assert len(store.transitions(rollout_id="r")) == 1


def test_a_rollout_id_belongs_to_one_task_attempt_and_outcome(store: SqliteStore) -> None:
    from agl_core.errors import RolloutConflict

    done = make_rollout("r", n_spans=2)
    store.put_rollout(done, make_trajectory(done, 2))
    before = (store.get_rollout("r"), store.transitions(), store.trajectories())
    for change, field in (({"task_id": "task-b"}, "task_id"), ({"attempt": 2}, "attempt"),
                          ({"status": "running"}, "status"), ({"status": "failed"}, "status"),
                          ({"rewards": [Reward(-1.0)]}, "rewards")):
        other = Rollout.from_dict({**done.to_dict(), **{k: [r.to_dict() for r in v] if k == "rewards" else v
                                                       for k, v in change.items()}})
        with pytest.raises(RolloutConflict) as err:
            store.put_rollout(other, make_trajectory(other, 0))
        assert err.value.field == field and err.value.rollout_id == "r"
        assert (store.get_rollout("r"), store.transitions(), store.trajectories()) == before
    late = make_span("r", 9, start_ns=5000)
    again = Rollout.from_dict({**done.to_dict(), "spans": [late.to_dict()], "error": "ignored"})
    store.put_rollout(again)  # the same finished result: accepted, and it gains the span it lacked
    got = store.get_rollout("r")
    assert got is not None and len(got.spans) == 3 and got.error is None and got.spans[-1] == late


def test_pages_list_every_row_once_whatever_the_ties(store: SqliteStore) -> None:
    ids = []
    for i in range(40):
        rid = f"r{i:02d}"
        r = make_rollout(rid, start=float(i % 3 == 0), n_spans=0)  # most at one start time, some at another
        store.put_rollout(r, make_trajectory(r, i % 3))
        ids.append(rid)
    want = [r.id for r in store.rollouts()]
    assert sorted(want) == sorted(ids)
    for limit in (1, 3, 7, 100):
        got, after = [], None
        while True:
            page, after = store.rollouts_page(limit=limit, after=after)
            got += [r.id for r in page]
            if after is None:
                break
        assert got == want
        steps, after = [], None
        while True:
            chunk, after = store.transitions_page(limit=limit, after=after)
            steps += chunk
            if after is None:
                break
        assert steps == store.transitions()
        trajs, after = [], None
        while True:
            part, after = store.trajectories_page(limit=limit, after=after, status="succeeded")
            trajs += part
            if after is None:
                break
        assert trajs == store.trajectories(status="succeeded")
    page, after = store.rollouts_page(limit=5)
    for k in range(5):  # stored while the walk is under way: tied, earlier and later
        store.put_rollout(make_rollout(f"new{k}", start=(0.0, -1.0, 1.0, 0.0, 7.0)[k], n_spans=0))
    rest: list[str] = []
    while after is not None:
        more, after = store.rollouts_page(limit=5, after=after)
        rest += [r.id for r in more]
    seen = [r.id for r in page] + rest
    assert len(seen) == len(set(seen)) and set(ids) <= set(seen)
    with pytest.raises(ValueError, match="not a cursor of this listing"):
        store.rollouts_page(limit=5, after="r07")
    with pytest.raises(ValueError, match="not a cursor of this listing"):
        store.transitions_page(limit=5, after="0.0~3")


def test_add_spans_appends_and_ignores_duplicates(store: SqliteStore) -> None:
    store.put_rollout(make_rollout("r", n_spans=2))
    dup = make_span("r", 0, start_ns=999, changed=True)
    new = make_span("r", 7, start_ns=50)
    store.add_spans("r", [dup, new])
    store.add_spans("r", [new])
    spans = store.spans("r")
    assert [s.span_id for s in spans] == [new.span_id, f"{1:016x}", f"{0:016x}"]
    assert "changed" not in spans[-1].attributes
    with pytest.raises(StoreError, match="no rollout 'ghost'"):
        store.add_spans("ghost", [new])
    with pytest.raises(TypeError, match=r"spans\[1\] must be a Span"):
        store.add_spans("r", [new, {"span_id": "x"}])  # type: ignore[list-item]


def test_bad_input_names_the_argument_and_keeps_earlier_data(store: SqliteStore) -> None:
    good = make_rollout("r", n_spans=2)
    store.put_rollout(good, make_trajectory(good, 2))
    before = (store.get_rollout("r"), store.transitions(), store.trajectories())

    with pytest.raises(TypeError, match="rollout must be a Rollout, got dict"):
        store.put_rollout(good.to_dict())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="trajectory must be a Trajectory"):
        store.put_rollout(good, [])  # type: ignore[arg-type]

    changed = make_rollout("r", n_spans=1)
    changed.spans[0].attributes["bad"] = {1, 2}  # mutated after validation: caught before writing
    with pytest.raises(SchemaError) as caught:
        store.put_rollout(changed)
    assert caught.value.field == "rollout.spans[0].attributes.bad"

    other = make_trajectory(make_rollout("someone-else"))
    with pytest.raises(SchemaError) as caught:
        store.put_rollout(make_rollout("r", n_spans=1), other)
    assert caught.value.field == "trajectory.rollout_id"

    assert (store.get_rollout("r"), store.transitions(), store.trajectories()) == before


def test_failed_write_rolls_back_and_keeps_earlier_data(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    with SqliteStore(path) as s:
        good = make_rollout("r", n_spans=2)
        s.put_rollout(good, make_trajectory(good, 2))
        before = (s.get_rollout("r"), s.transitions(), s.trajectories())

    # A database-side failure after the rollout row and spans were already rewritten in the transaction.
    raw = sqlite3.connect(path)
    raw.execute(
        'CREATE TRIGGER refuse BEFORE INSERT ON transitions WHEN NEW.data LIKE \'%"model":"boom"%\''
        " BEGIN SELECT RAISE(ABORT, 'refused by test trigger'); END"
    )
    raw.commit()
    raw.close()

    with SqliteStore(path) as s:
        replacement = make_rollout("r", n_spans=3)  # the same result again, with a span more and a rebuild
        with pytest.raises(StoreError, match="refused by test trigger"):
            s.put_rollout(replacement, make_trajectory(replacement, 1, model="boom"))
        assert (s.get_rollout("r"), s.transitions(), s.trajectories()) == before
        s.put_rollout(replacement, make_trajectory(replacement, 1))  # the store is still usable
        assert len(s.transitions()) == 1 and len(s.spans("r")) == 3


# --------------------------------------------------------------------------- concurrency


def test_four_threads_share_one_store(store: SqliteStore) -> None:
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(50):
                r = make_rollout(f"t{w}-{i}", task_id=f"task-{w}", start=float(i), n_spans=2)
                store.put_rollout(r, make_trajectory(r, 1))
                if i % 10 == 0:
                    assert store.get_rollout(r.id) is not None
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(store.rollouts()) == 200
    assert len(store.transitions()) == 200
    for w in range(4):
        assert {r.id for r in store.rollouts(task_id=f"task-{w}")} == {f"t{w}-{i}" for i in range(50)}
    assert all(len(store.spans(f"t3-{i}")) == 2 for i in range(50))


# Run by `exec` in a spawned child: the test module itself is not importable there (importlib import mode).
_WORKER = textwrap.dedent(
    """
    from agl_core.schema import Rollout, Span, Trajectory, Transition
    from agl_core.store import SqliteStore

    with SqliteStore(PATH, timeout=30) as store:
        for i in range(30):
            rid = f"p{WORKER}-{i}"
            span = Span(span_id=f"{i:016x}", trace_id="ab" * 16, name="chat m", start_ns=i)
            rollout = Rollout(id=rid, task_id=f"task-{WORKER}", status="succeeded", spans=[span], start_time=i)
            step = Transition(rollout_id=rid, task_id=rollout.task_id, index=0,
                              prompt=[{"role": "user", "content": "q"}], response={"role": "assistant", "content": "a"})
            store.put_rollout(rollout, Trajectory(rid, rollout.task_id, transitions=[step]))
    """
)


def test_three_processes_write_one_file(tmp_path: Path) -> None:
    path = str(tmp_path / "shared.db")  # created by whichever child opens it first
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=exec, args=(_WORKER, {"PATH": path, "WORKER": w})) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    with SqliteStore(path) as s:
        assert {r.id for r in s.rollouts()} == {f"p{w}-{i}" for w in range(3) for i in range(30)}
        assert len(s.transitions()) == 90
        assert len(s.trajectories()) == 90
        assert all(len(s.spans(f"p{w}-7")) == 1 for w in range(3))


# --------------------------------------------------------------------------- files that are not ours


@pytest.mark.parametrize(
    "content",
    [b"name,score\nalice,3\n" * 50, b"SQLite format 3\x00" + bytes(range(256)) * 16],
    ids=["text", "sqlite-header-then-garbage"],
)
def test_corrupt_file_is_refused_and_left_unchanged(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "data.db"
    path.write_bytes(content)
    with pytest.raises(StoreError, match="file is not a database") as caught:
        SqliteStore(path)
    assert str(path) in str(caught.value)
    assert path.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.db"]


def test_foreign_sqlite_file_is_refused_and_left_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    raw.execute("INSERT INTO users (name) VALUES ('ada')")
    raw.commit()
    raw.close()
    content = path.read_bytes()

    with pytest.raises(StoreError, match="not an agl store") as caught:
        SqliteStore(path)
    assert str(path) in str(caught.value) and "users" in str(caught.value)
    assert path.read_bytes() == content
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    raw.close()


def test_store_from_newer_agl_is_refused_and_left_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    with SqliteStore(path) as s:
        s.put_rollout(make_rollout("r"))
    raw = sqlite3.connect(path)
    raw.execute("UPDATE agl_meta SET value = ? WHERE key = 'schema_version'", (str(STORE_SCHEMA_VERSION + 1),))
    raw.commit()
    raw.close()

    with pytest.raises(StoreError, match="newer agl") as caught:
        SqliteStore(path)
    assert str(path) in str(caught.value)
    raw = sqlite3.connect(path)
    assert raw.execute("SELECT value FROM agl_meta").fetchone()[0] == str(STORE_SCHEMA_VERSION + 1)
    assert raw.execute("SELECT count(*) FROM rollouts").fetchone()[0] == 1
    raw.close()


def test_empty_file_becomes_a_store(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    with SqliteStore(path) as s:
        s.put_rollout(make_rollout("r"))
        assert len(s.rollouts()) == 1


# --------------------------------------------------------------------------- export


def _filled(store: SqliteStore) -> list[Rollout]:
    runs = [make_rollout("late", start=9.0), make_rollout("early", task_id="task-b", start=1.0, reward=None)]
    for r in runs:
        store.put_rollout(r, make_trajectory(r, 2))
    return [runs[1], runs[0]]


def test_export_jsonl(store: SqliteStore, tmp_path: Path) -> None:
    early, late = _filled(store)

    out = tmp_path / "transitions.jsonl"
    assert store.export(out) == 4
    lines = out.read_text("utf-8").splitlines()
    assert [Transition.from_json(line) for line in lines] == store.transitions()
    assert lines[0] == store.transitions()[0].to_json()

    assert store.export(tmp_path / "rollouts.jsonl", what="rollouts") == 2
    rollouts = [Rollout.from_json(x) for x in (tmp_path / "rollouts.jsonl").read_text("utf-8").splitlines()]
    assert rollouts == [store.get_rollout("early"), store.get_rollout("late")]

    assert store.export(str(tmp_path / "spans.jsonl"), "jsonl", what="spans") == 6
    spans = [Span.from_json(x) for x in (tmp_path / "spans.jsonl").read_text("utf-8").splitlines()]
    assert [s.rollout_id for s in spans] == ["early"] * 3 + ["late"] * 3
    assert [s.span_id for s in spans[:3]] == [s.span_id for s in by_start(early.spans)]

    with pytest.raises(ValueError, match="'jsonl', 'parquet'"):
        store.export(out, "csv")
    with pytest.raises(ValueError, match="'transitions', 'rollouts', 'spans'"):
        store.export(out, what="rewards")
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp" in p.name) == []


def _decoded(table: Any) -> list[dict[str, Any]]:
    """Rows of a parquet table with the JSON-encoded columns parsed back."""
    json_columns = [f.name for f in table.schema if (f.metadata or {}).get(b"agl.encoding") == b"json"]
    rows: list[dict[str, Any]] = table.to_pylist()
    for row in rows:
        for name in json_columns:
            row[name] = None if row[name] is None else json.loads(row[name])
    return rows


def test_export_parquet_reads_back_equal(store: SqliteStore, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    _filled(store)

    assert store.export(tmp_path / "t.parquet", "parquet") == 4
    table = pq.read_table(tmp_path / "t.parquet")
    assert table.schema.field("prompt_token_ids").type == pa.list_(pa.int64())
    assert table.schema.field("response_logprobs").type == pa.list_(pa.float64())
    assert table.schema.field("credited_reward").type == pa.float64()
    assert table.schema.metadata[b"agl.record"] == b"Transition"
    assert [Transition.from_dict(row) for row in _decoded(table)] == store.transitions()

    assert store.export(tmp_path / "r.parquet", "parquet", what="rollouts") == 2
    rollouts = [Rollout.from_dict(row) for row in _decoded(pq.read_table(tmp_path / "r.parquet"))]
    assert rollouts == store.rollouts(with_spans=True)

    assert store.export(tmp_path / "s.parquet", "parquet", what="spans") == 6
    spans = [Span.from_dict(row) for row in _decoded(pq.read_table(tmp_path / "s.parquet"))]
    assert [s.rollout_id for s in spans] == ["early"] * 3 + ["late"] * 3
    assert spans[0].attributes == store.spans("early")[0].attributes

    empty = SqliteStore(tmp_path / "empty.db")
    assert empty.export(tmp_path / "none.parquet", "parquet") == 0
    assert pq.read_table(tmp_path / "none.parquet").num_rows == 0
    empty.close()


def test_export_parquet_without_pyarrow_says_what_to_install(
    store: SqliteStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what an environment without pyarrow looks like
    with pytest.raises(StoreError, match="pip install pyarrow"):
        store.export(tmp_path / "t.parquet", "parquet")
    assert not (tmp_path / "t.parquet").exists()
