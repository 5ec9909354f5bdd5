"""The task queue on its own: ids and groups, leases, expiry as a new attempt, the try limit, restarts."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_core.errors import SchemaError
from agl_trainer.queue import LeaseLost, TaskQueue, TaskSpec


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def queue(tmp_path: Path, clock: Clock) -> TaskQueue:
    return TaskQueue(str(tmp_path / "q.db"), default_lease_timeout=10.0, default_max_attempts=2, clock=clock)


def test_ids_groups_and_repeat(queue: TaskQueue) -> None:
    ids = queue.enqueue([TaskSpec({"id": "q1", "x": 1}), TaskSpec("plain", task_id="q2", group_id="g")], repeat=2)
    assert ids == ["q1#0", "q1#1", "q2#0", "q2#1"]
    assert [t.group_id for t in queue.tasks()] == ["q1", "q1", "g", "g"]
    more = queue.enqueue([TaskSpec({"x": 2})], group_id="batch")
    assert len(more) == 1 and queue.get(more[0]).group_id == "batch"  # type: ignore[union-attr]


def test_duplicate_id_adds_nothing(queue: TaskQueue) -> None:
    queue.enqueue([TaskSpec(1, task_id="a")])
    with pytest.raises(SchemaError, match="'a' is already in the queue"):
        queue.enqueue([TaskSpec(2, task_id="b"), TaskSpec(3, task_id="a")])
    assert [t.task_id for t in queue.tasks()] == ["a"]


def test_bad_input_names_the_field(queue: TaskQueue) -> None:
    with pytest.raises(SchemaError, match=r"tasks\[0\].task: is not JSON-serialisable"):
        queue.enqueue([TaskSpec(object())])
    with pytest.raises(SchemaError, match="repeat"):
        queue.enqueue([TaskSpec(1)], repeat=0)
    with pytest.raises(SchemaError, match="lease_timeout"):
        queue.lease("w", lease_timeout=-1)


def test_leases_in_order_and_heartbeat_extends(queue: TaskQueue, clock: Clock) -> None:
    queue.enqueue([TaskSpec(i, task_id=f"t{i}") for i in range(3)])
    first = queue.lease("w1")
    assert first is not None and (first.task_id, first.attempt, first.task) == ("t0", 1, 0)
    assert first.deadline == clock.now + 10
    clock.now += 8
    assert queue.heartbeat([first.lease_id, "nope"]) == ([first.lease_id], ["nope"])
    clock.now += 8  # 16 s after the lease, 8 after the heartbeat: still alive
    assert queue.expire() == []
    assert queue.counts() == {"queued": 2, "leased": 1, "done": 0, "failed": 0}


def test_expired_lease_is_the_next_attempt_then_fails_at_the_limit(queue: TaskQueue, clock: Clock) -> None:
    queue.enqueue([TaskSpec("x", task_id="t")])
    one = queue.lease("w1")
    assert one is not None
    clock.now += 11
    assert queue.expire() == [("t", 1)]
    two = queue.lease("w2")
    assert two is not None and two.attempt == 2 and two.lease_id != one.lease_id
    with pytest.raises(LeaseLost, match="attempt 1.*expired.*now leased at attempt 2"):
        queue.lease_of(one.lease_id)
    clock.now += 11
    queue.expire()
    info = queue.get("t")
    assert info is not None and info.state == "failed" and "gave up after 2 attempts" in (info.error or "")
    assert [a["outcome"].split(":")[0] for a in info.attempts] == ["expired", "expired"]
    assert queue.lease("w3") is None


def test_release_is_not_a_try(queue: TaskQueue, clock: Clock) -> None:
    queue.enqueue([TaskSpec("x", task_id="t")])
    for _ in range(3):
        lease = queue.lease("w")
        assert lease is not None
        queue.release(lease.lease_id, "shutting down")
    lease = queue.lease("w")
    assert lease is not None and lease.attempt == 4
    clock.now += 11
    queue.expire()  # the first counted try: 4 leases, 3 released
    assert queue.get("t").state == "queued"  # type: ignore[union-attr]


def test_a_failed_release_is_a_try_with_back_off(tmp_path: Path, clock: Clock) -> None:
    queue = TaskQueue(str(tmp_path / "b.db"), default_max_attempts=3, backoff_s=2.0, max_backoff_s=3.0, clock=clock)
    queue.enqueue([TaskSpec("x", task_id="t"), TaskSpec("y", task_id="u")])
    lease = queue.lease("w")
    assert lease is not None and lease.task_id == "t"
    queue.release(lease.lease_id, "the server refused it", failed=True)
    info = queue.get("t")
    assert info is not None and (info.state, info.not_before) == ("queued", clock.now + 2.0)
    again = queue.lease("w")
    assert again is not None and again.task_id == "u"  # t waits out its back-off: the next task goes first
    assert queue.lease("w") is None
    clock.now += 2.0
    second = queue.lease("w")
    assert second is not None and (second.task_id, second.attempt) == ("t", 2)
    queue.release(second.lease_id, "again", failed=True)
    assert queue.get("t").not_before == clock.now + 3.0  # type: ignore[union-attr]  # 4 s, capped at 3
    clock.now += 3.0
    third = queue.lease("w")
    assert third is not None
    queue.release(third.lease_id, "and again", failed=True)
    info = queue.get("t")
    assert info is not None and info.state == "failed" and info.error == "gave up after 3 attempts; last: and again"
    assert [a["outcome"] for a in info.attempts] == ["failed: the server refused it", "failed: again",
                                                     "failed: and again"]


def test_a_payload_is_checked_by_the_rollouts_rules(tmp_path: Path) -> None:
    queue = TaskQueue(str(tmp_path / "p.db"), max_task_bytes=100)
    deep: object = 1
    for _ in range(70):
        deep = [deep]
    for payload, field, problem in ((deep, "tasks[1].task[0]", "nested deeper than 64 levels"),
                                    ({"q": "\ud800"}, "tasks[1].task.q", "lone UTF-16 surrogate"),
                                    ({"q": float("nan")}, "tasks[1].task.q", "finite number"),
                                    ("x" * 200, "tasks[1].task", "202 bytes of JSON")):
        with pytest.raises(SchemaError) as err:
            queue.enqueue([TaskSpec("fine", task_id="a"), TaskSpec(payload, task_id="b")])
        assert err.value.field.startswith(field) and problem in err.value.problem, err.value
    assert queue.counts()["queued"] == 0  # all or nothing


def test_finishing_refuses_a_lease_that_moved_on(queue: TaskQueue, clock: Clock) -> None:
    queue.enqueue([TaskSpec("x", task_id="t")])
    old = queue.lease("w1")
    assert old is not None
    clock.now += 11
    queue.expire()
    new = queue.lease("w2")
    assert new is not None
    with pytest.raises(LeaseLost):
        with queue.finishing(old.lease_id, "r-old"):
            raise AssertionError("must not run")
    with queue.finishing(new.lease_id, "r-new") as lease:
        assert lease.attempt == 2
    info = queue.get("t")
    assert info is not None and (info.state, info.rollout_id) == ("done", "r-new")


def test_a_stored_result_finishes_an_expired_lease(queue: TaskQueue, clock: Clock) -> None:
    queue.enqueue([TaskSpec("x", task_id="t")])
    queue.lease("w")
    clock.now += 11
    queue.expire(stored=lambda task_id, attempt: "r1" if (task_id, attempt) == ("t", 1) else None)
    info = queue.get("t")
    assert info is not None and (info.state, info.rollout_id) == ("done", "r1")


def test_queue_and_leases_survive_reopening(tmp_path: Path, clock: Clock) -> None:
    path = str(tmp_path / "q.db")
    q1 = TaskQueue(path, default_lease_timeout=10.0, clock=clock)
    q1.enqueue([TaskSpec(i, task_id=f"t{i}") for i in range(2)])
    lease = q1.lease("w")
    assert lease is not None
    q1.close()
    q2 = TaskQueue(path, default_lease_timeout=10.0, clock=clock)
    assert q2.lease_of(lease.lease_id).deadline == lease.deadline
    assert q2.counts() == {"queued": 1, "leased": 1, "done": 0, "failed": 0}
