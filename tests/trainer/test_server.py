"""The server's store, queue and model routes, through HttpStore and TaskClient, and across restarts."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import agl_core as agl
from agl_core.errors import SchemaError
from agl_core.store.http import ServerError
from agl_core.testing import FakeOpenAI, render_prompt, tokenize
from agl_core.worker import TaskClient
from agl_trainer.token_records import MODEL_VERSION_ATTRIBUTE

from .conftest import PYTHON, ServerFactory

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def _agent_run(url: str, store: agl.HttpStore, task_id: str = "q-1", **rollout: Any) -> agl.RolloutRun:
    """Two LLM calls (one streamed, one with a tool call) and a reward, through the gateway."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with agl.rollout(task_id=task_id, task={"q": "capital?"}, store=store, **rollout) as run:
        first = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "capital?"}],
                                               tools=[TOOL])  # type: ignore[list-item]
        call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
        messages: list[Any] = [{"role": "user", "content": "capital?"}, first.choices[0].message.model_dump(),
                               {"role": "tool", "tool_call_id": call.id, "content": "Paris"}]
        stream = client.chat.completions.create(model="gpt-4o", messages=messages, stream=True)
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        agl.emit_reward(1.0)
    return run


SCRIPT = [{"tool_calls": [{"name": "lookup", "arguments": {"q": "capital"}}]}, "It is Paris."]


def test_rollout_through_http_store_gets_gateway_token_ids(make_server: ServerFactory) -> None:
    with FakeOpenAI(script=SCRIPT) as fake:
        srv = make_server(fake)
        store = agl.HttpStore(srv.url)
        run = _agent_run(srv.url, store)
        assert run.store_error is None
        traj = store.trajectories(rollout_ids=[run.id])[0]
        assert traj.reward == 1.0 and len(traj.transitions) == 2
        bodies = [q.body for q in fake.requests if q.method == "POST"]
        for t, body in zip(traj.transitions, bodies, strict=True):
            assert t.token_source == "gateway"
            assert t.prompt_token_ids == tokenize(render_prompt(body["messages"]))
            assert t.credited_reward == 1.0 and t.model == "fake-model"
        assert traj.transitions[0].response_token_ids == tokenize('<tool_call> lookup {"q": "capital"}')
        assert traj.transitions[0].response["tool_calls"][0]["function"]["name"] == "lookup"
        assert traj.transitions[1].response_token_ids == tokenize("It is Paris.")
        assert len(traj.transitions[1].response_logprobs or []) == 3
        # the stored spans carry the joined ids, so a rebuild with another builder keeps them
        rebuilt = store.trajectories(rollout_ids=[run.id], builder=agl.TransitionBuilder(credit="discounted"))[0]
        assert [t.response_token_ids for t in rebuilt.transitions] == [t.response_token_ids for t in traj.transitions]
        llm = [s for s in store.spans(run.id) if s.attributes.get("agl.llm.token_source") == "gateway"]
        assert len(llm) == 2 and all(s.attributes[MODEL_VERSION_ATTRIBUTE] == 0 for s in llm)
        assert len(srv.server.records) == 0  # joined records are dropped


def test_http_store_reads_like_the_sqlite_store(make_server: ServerFactory, tmp_path: Path) -> None:
    with FakeOpenAI(script=SCRIPT * 2) as fake:
        srv = make_server(fake)
        store = agl.HttpStore(srv.url)
        runs = [_agent_run(srv.url, store, task_id=f"t{i}") for i in range(2)]
        local = srv.server.store
        assert [r.id for r in store.rollouts()] == [r.id for r in runs]
        assert store.rollouts(task_id="t1")[0].id == runs[1].id
        assert store.rollouts(status=["failed"]) == []
        assert store.rollouts(limit=1, with_spans=True)[0] == local.rollouts(limit=1, with_spans=True)[0]
        assert store.get_rollout(runs[0].id) == local.get_rollout(runs[0].id)
        assert store.get_rollout("nope") is None
        assert store.spans(runs[0].id) == local.spans(runs[0].id)
        assert store.transitions(task_id="t0") == local.transitions(task_id="t0")
        assert store.trajectories() == local.trajectories()
        for what in ("transitions", "rollouts", "spans"):
            mine, theirs = tmp_path / f"h-{what}.jsonl", tmp_path / f"s-{what}.jsonl"
            assert store.export(mine, what=what) == local.export(theirs, what=what) > 0
            assert mine.read_text() == theirs.read_text()
        store.add_spans(runs[0].id, [agl.Span(span_id="00000000000000ff", trace_id="1" * 32, name="late")])
        assert any(s.name == "late" for s in local.spans(runs[0].id))
        with pytest.raises(ServerError, match="no rollout 'nope'"):
            store.add_spans("nope", [])


def test_bad_rollouts_are_refused_naming_the_field(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    r = httpx.post(srv.url + "/v1/rollouts", json={"id": "r", "task_id": "t", "attempt": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Rollout.attempt"
    r = httpx.post(srv.url + "/v1/rollouts", json={"id": "r", "task_id": "t", "spans": [{"name": 1}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("Rollout.spans[0]")
    store = agl.HttpStore(srv.url)
    with pytest.raises(ServerError, match="lease 'no-such-lease' is unknown") as err:
        store.put_rollout(agl.Rollout.from_dict({"id": "r", "task_id": "t", "status": "succeeded"}),
                          lease_id="no-such-lease")
    assert err.value.status == 409
    r = httpx.post(srv.url + "/v1/rollouts?lease_id=x", json={"id": "r", "task_id": "t"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Rollout.status"


def test_tasks_over_http(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    tasks = TaskClient(srv.url)
    ids = tasks.enqueue([{"id": "a", "x": 1}, {"x": 2}], repeat=2, max_attempts=5)
    assert ids[:2] == ["a#0", "a#1"] and len(ids) == 4
    assert tasks.counts() == {"queued": 4, "leased": 0, "done": 0, "failed": 0}
    lease = tasks.lease("w1")
    assert lease is not None and (lease.task_id, lease.attempt, lease.group_id) == ("a#0", 1, "a")
    assert tasks.heartbeat([lease.lease_id]) == ([lease.lease_id], [])
    assert tasks.release(lease.lease_id, "testing") is True
    assert tasks.release(lease.lease_id, "again") is False
    info = tasks.task("a#0")
    assert info["state"] == "queued" and info["attempts"][0]["outcome"] == "released: testing"
    r = httpx.post(srv.url + "/v1/tasks", json={"tasks": [{"task": 1, "task_id": "a#0"}]})
    assert r.status_code == 400 and "already in the queue" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/tasks", json={"tasks": [{"payload": 1}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tasks[0]"
    r = httpx.post(srv.url + "/v1/tasks/lease", json={"wait_s": 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "wait_s"
    assert httpx.get(srv.url + "/v1/tasks/nope").status_code == 404
    assert httpx.get(srv.url + "/v1/nothing-here").json()["error"]["message"] == "no route GET /v1/nothing-here"


def test_lease_waits_for_a_task(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    tasks = TaskClient(srv.url)
    start = time.monotonic()
    assert tasks.lease("w", wait_s=0.3) is None
    assert time.monotonic() - start >= 0.3
    import threading

    timer = threading.Timer(0.3, lambda: TaskClient(srv.url).enqueue(["late"]))
    timer.start()
    start = time.monotonic()
    lease = tasks.lease("w", wait_s=10)
    assert lease is not None and lease.task == "late" and time.monotonic() - start < 3


def test_result_of_a_lease_that_moved_on_is_refused(make_server: ServerFactory) -> None:
    with FakeOpenAI(script=SCRIPT * 2) as fake:
        srv = make_server(fake, lease_timeout_s=0.5, sweep_interval_s=0.1)
        tasks = TaskClient(srv.url)
        tasks.enqueue([{"id": "t"}])
        old = tasks.lease("slow-worker")
        assert old is not None
        time.sleep(0.8)  # the sweeper expires it
        new = tasks.lease("w2", lease_timeout=30)
        assert new is not None and new.attempt == 2
        store = agl.HttpStore(srv.url)
        run = _agent_run(srv.url, store, task_id="t", attempt=1)  # no lease: a free rollout is stored
        assert run.store_error is None
        late = agl.Rollout.from_dict({**run.rollout.to_dict(), "id": "late-one"})
        with pytest.raises(ServerError, match="no longer current") as err:
            store.post_rollout(late, lease_id=old.lease_id)
        assert err.value.status == 409
        assert srv.server.store.get_rollout("late-one") is None
        fresh = agl.Rollout.from_dict({**run.rollout.to_dict(), "id": "fresh", "attempt": 2})
        summary = store.post_rollout(fresh, lease_id=new.lease_id)
        assert summary["transitions"] == 2
        again = store.post_rollout(fresh, lease_id=new.lease_id)  # a retry whose first answer was lost
        assert again["already_stored"] is True and again["transitions"] == 2
        assert tasks.task("t")["state"] == "done" and tasks.task("t")["rollout_id"] == "fresh"
        tasks.enqueue([{"id": "u"}])
        u = tasks.lease("w3")
        assert u is not None
        wrong = agl.Rollout.from_dict({**run.rollout.to_dict(), "id": "u1", "task_id": "u", "attempt": 2})
        with pytest.raises(SchemaError, match="Rollout.attempt: is 2 but the lease is attempt 1"):
            store.post_rollout(wrong, lease_id=u.lease_id)
        assert tasks.task("u")["state"] == "leased"


def test_model_version(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    assert httpx.get(srv.url + "/v1/model").json()["version"] == 0
    r = httpx.post(srv.url + "/v1/model", json={"version": 3, "weights": "/ckpt/3"})
    assert r.status_code == 200 and r.json()["version"] == 3 and r.json()["model"] == "fake-model"
    assert httpx.post(srv.url + "/v1/model", json={"version": 2}).status_code == 409
    assert httpx.post(srv.url + "/v1/model", json={"version": "x"}).json()["error"]["param"] == "version"
    httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
               headers={"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"})
    assert srv.server.records.get(("a" * 32, "b" * 16)).model_version == 3  # type: ignore[union-attr]


def test_restart_keeps_rollouts_queue_leases_and_unjoined_records(make_server: ServerFactory,
                                                                  tmp_path: Path) -> None:
    db = tmp_path / "restart.db"
    with FakeOpenAI(script=SCRIPT * 3) as fake:
        first = make_server(fake, db=db)
        store = agl.HttpStore(first.url)
        done = _agent_run(first.url, store, task_id="done")
        tasks = TaskClient(first.url)
        tasks.enqueue([{"id": "a"}, {"id": "b"}])
        lease = tasks.lease("w")
        assert lease is not None
        # a rollout whose LLM calls were answered before the restart and posted after it
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="x", max_retries=0)
        with agl.rollout(task_id="a", attempt=1) as pending:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        httpx.post(first.url + "/v1/model", json={"version": 5})
        first.stop()

        second = make_server(fake, db=db)
        store2 = agl.HttpStore(second.url)
        assert store2.get_rollout(done.id, with_spans=False).status == "succeeded"  # type: ignore[union-attr]
        assert [t.token_source for t in store2.transitions(rollout_id=done.id)] == ["gateway", "gateway"]
        tasks2 = TaskClient(second.url)
        assert tasks2.counts() == {"queued": 1, "leased": 1, "done": 0, "failed": 0}
        summary = store2.post_rollout(pending.rollout, lease_id=lease.lease_id)
        assert summary["token_sources"] == {"gateway": 1}
        assert tasks2.task("a")["state"] == "done"
        assert httpx.get(second.url + "/v1/model").json()["version"] == 5


def test_cli_server_restart(fake: FakeOpenAI, tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    db = tmp_path / "cli.db"

    def start() -> tuple[subprocess.Popen[str], str]:
        command = [PYTHON, "-m", "agl_core.cli", "serve", "--db", str(db), "--port", "0", "--backend", fake.url,
                   "--model", "policy"]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("agl serve: listening on "), (line, proc.stderr.read() if proc.stderr else "")
        return proc, line.split()[-1]

    proc, url = start()
    try:
        tasks = TaskClient(url)
        tasks.enqueue(["x", "y"], task_ids=["x", "y"])
        store = agl.HttpStore(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with agl.rollout(task_id="free", store=store) as run:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert run.store_error is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    proc, url = start()
    try:
        store = agl.HttpStore(url)
        assert [t.token_source for t in store.transitions(rollout_id=run.id)] == ["gateway"]
        assert TaskClient(url).counts()["queued"] == 2
        assert json.loads(httpx.get(url + "/v1/models").text)["data"][0]["id"] == "policy"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    bad = subprocess.run([PYTHON, "-m", "agl_trainer", "--db", str(db), "--host", "0.0.0.0", "--backend", fake.url],
                         capture_output=True, text=True, env={**subprocess_env, "AGL_TOKEN": ""}, timeout=60)
    assert bad.returncode == 2 and "without a bearer token" in bad.stderr


def test_server_killed_with_sigkill_keeps_finished_rollouts_queue_and_leases(fake: FakeOpenAI, tmp_path: Path,
                                                                            subprocess_env: dict[str, str]) -> None:
    """A crash, not a shutdown: what was answered and stored before ``kill -9`` is there after the restart."""
    db = tmp_path / "crash.db"

    def start() -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen([PYTHON, "-m", "agl_trainer", "--db", str(db), "--port", "0", "--backend", fake.url,
                                 "--model", "policy", "--lease-timeout", "30"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("agl serve: listening on "), (line, proc.stderr.read() if proc.stderr else "")
        return proc, line.split()[-1]

    proc, url = start()
    try:
        tasks = TaskClient(url)
        tasks.enqueue([{"id": "done"}, {"id": "pending"}, {"id": "queued"}])
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        store = agl.HttpStore(url)
        first = tasks.lease("w")
        assert first is not None and first.task_id == "done"
        with agl.rollout(task_id="done", attempt=1) as finished:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "one"}])
        store.post_rollout(finished.rollout, lease_id=first.lease_id)
        second = tasks.lease("w")
        assert second is not None and second.task_id == "pending"
        with agl.rollout(task_id="pending", attempt=1) as pending:  # answered now, posted after the crash
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "two"}])
        time.sleep(1.0)  # the gateway writes its token records to the file every quarter second
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=20)
    proc, url = start()
    try:
        store = agl.HttpStore(url)
        tasks = TaskClient(url)
        assert tasks.counts() == {"queued": 1, "leased": 1, "done": 1, "failed": 0}
        (t,) = store.transitions(rollout_id=finished.id)
        assert t.token_source == "gateway" and t.response_token_ids == tokenize("one")
        assert tasks.task("done")["rollout_id"] == finished.id
        summary = store.post_rollout(pending.rollout, lease_id=second.lease_id)  # the lease outlived the crash
        assert summary["token_sources"] == {"gateway": 1}
        assert [r.task_id for r in store.rollouts()] == ["done", "pending"]
        lease = tasks.lease("w2")
        assert lease is not None and (lease.task_id, lease.attempt) == ("queued", 1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def test_a_rollout_posted_again_keeps_the_token_ids_joined_the_first_time(make_server: ServerFactory) -> None:
    with FakeOpenAI(script=SCRIPT * 2) as fake:
        srv = make_server(fake)
        store = agl.HttpStore(srv.url)
        run = _agent_run(srv.url, store, task_id="again")  # posted once by the rollout context
        assert [t.token_source for t in store.transitions(rollout_id=run.id)] == ["gateway", "gateway"]
        tasks = TaskClient(srv.url)
        tasks.enqueue([{"id": "again"}])
        lease = tasks.lease("w")
        assert lease is not None
        store.post_rollout(run.rollout)  # a retry whose first answer was lost: the records are gone by now
        summary = store.post_rollout(run.rollout, lease_id=lease.lease_id)  # and once more, with a lease
        assert summary["token_sources"] == {"gateway": 2}
        again = store.transitions(rollout_id=run.id)
        assert [t.token_source for t in again] == ["gateway", "gateway"]
        assert again[1].response_token_ids == tokenize("It is Paris.") and again[1].response_logprobs


@pytest.mark.parametrize(("method", "path", "body", "param"), [
    ("POST", "/v1/tasks", {"tasks": "x"}, "tasks"),
    ("POST", "/v1/tasks", {"tasks": [{"task": 1, "task_id": 5}]}, "tasks[0].task_id"),
    ("POST", "/v1/tasks", {"tasks": [{"task": 1}], "repeat": 0}, "repeat"),
    ("POST", "/v1/tasks", {"tasks": [{"task": 1}], "max_attempts": "3"}, "max_attempts"),
    ("POST", "/v1/tasks", {"tasks": [{"task": 1}], "group_id": ""}, "group_id"),
    ("POST", "/v1/tasks", {"tasks": [{"task": float("inf")}]}, "tasks[0].task"),
    ("POST", "/v1/tasks/lease", {"worker_id": 7}, "worker_id"),
    ("POST", "/v1/tasks/lease", {"lease_timeout": -1}, "lease_timeout"),
    ("POST", "/v1/leases/heartbeat", {"lease_ids": "abc"}, "lease_ids"),
    ("POST", "/v1/leases/x/release", {"reason": 3}, "reason"),
    ("POST", "/v1/model", {"version": 1, "weights": 5}, "weights"),
    ("GET", "/v1/rollouts?limit=-1", None, "limit"),
    ("GET", "/v1/rollouts?since=soon", None, "since"),
    ("GET", "/v1/rollouts/x?with_spans=maybe", None, "with_spans"),
])
def test_bad_requests_to_the_task_and_store_routes_name_the_field(fake: FakeOpenAI, make_server: ServerFactory,
                                                                  method: str, path: str, body: Any,
                                                                  param: str) -> None:
    srv = make_server(fake)
    TaskClient(srv.url).enqueue([{"id": "kept"}])
    content = None if body is None else json.dumps(body, allow_nan=True).encode()
    r = httpx.request(method, srv.url + path, content=content, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert TaskClient(srv.url).counts()["queued"] == 1  # nothing already stored is lost


def _fill(store: Any, n: int) -> None:
    """``n`` finished rollouts (some at the same start time, one still running) with 0 to 2 transitions each."""
    for i in range(n):
        rid, task = f"r{i:03d}", f"t{i % 3}"
        steps = [agl.Transition(rollout_id=rid, task_id=task, index=k, prompt=[{"role": "user", "content": f"{i}"}],
                                response={"role": "assistant", "content": f"{i}.{k}"}) for k in range(i % 3)]
        rollout = agl.Rollout(id=rid, task_id=task, status="running" if i == 5 else "succeeded",
                              start_time=float(i // 4))  # four rollouts share each start time
        store.put_rollout(rollout, None if i == 5 else agl.Trajectory(rollout_id=rid, task_id=task,
                                                                      transitions=steps))


def _walk(url: str, path: str, key: str, limit: int, **query: Any) -> list[Any]:
    items: list[Any] = []
    after = None
    for _ in range(1000):
        params = {**query, "limit": limit, **({"after": after} if after is not None else {})}
        page = httpx.get(url + path, params=params, timeout=30).json()
        assert len(page[key]) <= limit
        items.extend(page[key])
        after = page["next"]
        if after is None:
            return items
    raise AssertionError("the cursor never ended")


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 100])
def test_listings_come_in_pages_that_add_up_to_the_whole(fake: FakeOpenAI, make_server: ServerFactory,
                                                         limit: int) -> None:
    srv = make_server(fake)
    local = srv.server.store
    _fill(local, 30)
    TaskClient(srv.url).enqueue([{"n": i} for i in range(11)], task_ids=[f"q{i:02d}" for i in range(11)])
    assert [r["id"] for r in _walk(srv.url, "/v1/rollouts", "rollouts", limit)] == [r.id for r in local.rollouts()]
    assert [r["id"] for r in _walk(srv.url, "/v1/rollouts", "rollouts", limit, status="succeeded", since=2, until=6)] \
        == [r.id for r in local.rollouts(status="succeeded", since=2, until=6)]
    for query in ({}, {"task_id": "t2"}, {"rollout_id": "r014"}):
        got = _walk(srv.url, "/v1/transitions", "transitions", limit, **query)
        assert [agl.Transition.from_dict(t) for t in got] == local.transitions(**query)
    for query in ({}, {"task_id": "t1", "status": "succeeded"}, {"rollout_id": ["r020", "r003", "r005"]}):
        got = _walk(srv.url, "/v1/trajectories", "trajectories", limit, **query)
        kwargs = {("rollout_ids" if k == "rollout_id" else k): v for k, v in query.items()}
        assert [agl.Trajectory.from_dict(t) for t in got] == local.trajectories(**kwargs)
    assert [t["task_id"] for t in _walk(srv.url, "/v1/tasks", "tasks", limit)] == [f"q{i:02d}" for i in range(11)]


def test_a_listing_answers_the_default_page_and_refuses_bad_limits_and_cursors(fake: FakeOpenAI,
                                                                                make_server: ServerFactory) -> None:
    from agl_trainer.paging import DEFAULT_LIMIT, MAX_LIMIT

    srv = make_server(fake)
    TaskClient(srv.url).enqueue([{"n": i} for i in range(DEFAULT_LIMIT + 5)])
    page = httpx.get(srv.url + "/v1/tasks", timeout=30).json()
    assert len(page["tasks"]) == DEFAULT_LIMIT and page["next"] == page["tasks"][-1]["task_id"]
    rest = httpx.get(srv.url + "/v1/tasks", params={"after": page["next"], "limit": MAX_LIMIT}, timeout=30).json()
    assert len(rest["tasks"]) == 5 and rest["next"] is None
    for path in ("/v1/tasks", "/v1/rollouts", "/v1/transitions", "/v1/trajectories"):
        for limit in ("0", str(MAX_LIMIT + 1), "ten"):
            r = httpx.get(srv.url + path, params={"limit": limit}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text
        r = httpx.get(srv.url + path, params={"after": "no such cursor"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "after", r.text
        assert "'next' of the page before" in r.json()["error"]["message"]


def test_http_store_follows_the_cursor_to_the_end(fake: FakeOpenAI, make_server: ServerFactory,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from agl_core.store import http

    srv = make_server(fake)
    local = srv.server.store
    _fill(local, 30)
    monkeypatch.setattr(http, "LISTING_PAGE", 4)
    store = agl.HttpStore(srv.url)
    assert store.rollouts() == local.rollouts()
    assert store.rollouts(limit=9, status="succeeded") == local.rollouts(limit=9, status="succeeded")
    assert store.rollouts(limit=0) == []
    assert store.transitions() == local.transitions() and len(local.transitions()) > 4
    assert store.transitions(task_id="t1") == local.transitions(task_id="t1")
    assert store.trajectories() == local.trajectories()
    with pytest.raises(ValueError, match="limit must be a non-negative integer"):
        store.rollouts(limit=-1)
