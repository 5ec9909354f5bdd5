"""``agl serve`` never loses, overwrites or loops: paging, rollout ownership, bad input, bounds.

Each test drives the real server on uvicorn at 127.0.0.1 (with HttpStore or
raw HTTP); only the model server is fake (FakeOpenAI, or a scripted raw reply).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import openai
import pytest

import agl_core as agl
from agl_core.testing import FakeOpenAI
from agl_core.worker import TaskClient

from .conftest import ServerFactory


def _fill(store: agl.SqliteStore, n: int, *, start_time: float = 0.0, prefix: str = "r", steps: int = 1) -> list[str]:
    """``n`` finished rollouts that share one start time (0.0: what a rollout posted without one gets)."""
    ids = []
    for i in range(n):
        rid = f"{prefix}{i:05d}"
        transitions = [agl.Transition(rollout_id=rid, task_id=f"t{i}", index=k,
                                      prompt=[{"role": "user", "content": f"{i}"}],
                                      response={"role": "assistant", "content": f"{i}.{k}"}) for k in range(steps)]
        store.put_rollout(agl.Rollout(id=rid, task_id=f"t{i}", status="succeeded", start_time=start_time),
                          agl.Trajectory(rollout_id=rid, task_id=f"t{i}", transitions=transitions), validate=False)
        ids.append(rid)
    return ids


def _walk(url: str, path: str, key: str, limit: int) -> list[Any]:
    items: list[Any] = []
    after = None
    for _ in range(100_000):
        params: dict[str, Any] = {"limit": limit, **({"after": after} if after is not None else {})}
        page = httpx.get(url + path, params=params, timeout=60).json()
        items.extend(page[key])
        after = page["next"]
        if after is None:
            return items
    raise AssertionError(f"{path}: the cursor never ended")


LISTINGS = [("/v1/rollouts", "rollouts", "id"), ("/v1/transitions", "transitions", "rollout_id"),
            ("/v1/trajectories", "trajectories", "rollout_id")]


# ---------------------------------------------------------------------- 1. paging


def test_every_listing_pages_over_tied_start_times_exactly_once(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    ids = _fill(srv.server.store, 300)
    for path, key, field in LISTINGS:
        got = [item[field] for item in _walk(srv.url, path, key, 10)]
        assert got == ids, f"{path}: {len(got)} rows listed ({len(set(got))} distinct) of {len(ids)}"


def test_http_store_reads_every_row_of_a_large_tied_store(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    ids = _fill(srv.server.store, 2_500)
    store = agl.HttpStore(srv.url)
    counts = {"rollouts": [r.id for r in store.rollouts()], "transitions": [t.rollout_id for t in store.transitions()],
              "trajectories": [t.rollout_id for t in store.trajectories()]}
    assert {k: len(v) for k, v in counts.items()} == {k: len(ids) for k in counts}
    assert all(v == ids for v in counts.values())


def test_listings_stay_whole_while_rollouts_are_added(fake: FakeOpenAI, make_server: ServerFactory,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from agl_core.store import http

    srv = make_server(fake)
    before = set(_fill(srv.server.store, 400))
    monkeypatch.setattr(http, "LISTING_PAGE", 25)
    stop = threading.Event()

    def add() -> None:  # ties, earlier and later start times, as long as the readers read
        writer, n = agl.SqliteStore(srv.server.store.path), 0
        try:
            while not stop.is_set():
                _fill(writer, 1, start_time=(0.0, -1.0, 5.0)[n % 3], prefix=f"new{n}-")
                n += 1
        finally:
            writer.close()

    adder = threading.Thread(target=add)
    adder.start()
    try:
        store = agl.HttpStore(srv.url)
        for name, read in (("rollouts", lambda: [r.id for r in store.rollouts()]),
                           ("transitions", lambda: [t.rollout_id for t in store.transitions()]),
                           ("trajectories", lambda: [t.rollout_id for t in store.trajectories()])):
            got = read()
            assert len(got) == len(set(got)), f"{name}: {len(got) - len(set(got))} rows came twice"
            assert before <= set(got), f"{name}: {len(before - set(got))} of {len(before)} stored rows missing"
    finally:
        stop.set()
        adder.join()


def test_http_store_stops_on_a_listing_that_goes_in_circles() -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from agl_core.errors import StoreError

    class Circle(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
            pass

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = json.dumps({"rollouts": [], "next": "the-same-cursor"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Circle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(StoreError, match="goes in circles"):
            agl.HttpStore(f"http://127.0.0.1:{server.server_address[1]}").rollouts()
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------- 2. rollout ownership


def _rollout(rid: str, task_id: str, *, attempt: int = 1, status: str = "succeeded", reward: float | None = 1.0,
             spans: int = 1) -> dict[str, Any]:
    span_list = [{"span_id": f"{k + 1:016x}", "trace_id": "a" * 32, "name": f"step {k}", "start_ns": k + 1,
                  "end_ns": k + 2} for k in range(spans)]
    rewards = [] if reward is None else [{"value": reward}]
    return {"id": rid, "task_id": task_id, "attempt": attempt, "status": status, "spans": span_list,
            "rewards": rewards, "start_time": 1.0}


def _kinds(spans: list[Any]) -> tuple[int, int]:
    """(spans that are not rewards, reward spans): a reward posted without a span is stored as one."""
    rewards = sum(1 for s in spans if s.attributes.get("agl.span.kind") == "reward")
    return len(spans) - rewards, rewards


def test_a_rollout_id_belongs_to_one_task_and_attempt(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    tasks = TaskClient(srv.url)
    tasks.enqueue([{"id": "A"}, {"id": "B"}])
    a, b = tasks.lease("w1"), tasks.lease("w2")
    assert a is not None and b is not None
    r = httpx.post(srv.url + "/v1/rollouts", params={"lease_id": a.lease_id}, json=_rollout("R", "A", spans=2))
    assert r.status_code == 201, r.text
    r = httpx.post(srv.url + "/v1/rollouts", params={"lease_id": b.lease_id}, json=_rollout("R", "B", reward=-1.0))
    assert r.status_code == 409, f"another task's lease took over rollout R: {r.status_code} {r.text}"
    assert "'A'" in r.json()["error"]["message"] and r.json()["error"]["param"] == "Rollout.task_id"
    r = httpx.post(srv.url + "/v1/rollouts", json=_rollout("R", "A", attempt=2))
    assert r.status_code == 409 and r.json()["error"]["param"] == "Rollout.attempt", r.text
    stored = srv.server.store.get_rollout("R")
    assert stored is not None and (stored.task_id, stored.final_reward) == ("A", 1.0)
    assert _kinds(stored.spans) == (2, 1)  # its two spans and its posted reward's span, nothing of B's
    assert tasks.task("A")["rollout_id"] == "R" and tasks.task("B")["state"] == "leased"


def test_a_finished_rollout_is_never_regressed_or_rewritten(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    url = srv.url + "/v1/rollouts"
    assert httpx.post(url, json=_rollout("R", "T", spans=2)).status_code == 201
    for change, param in (({"status": "running", "spans": [], "rewards": []}, "Rollout.status"),
                          ({"status": "failed"}, "Rollout.status"),
                          ({"rewards": [{"value": -1.0}]}, "Rollout.rewards")):
        r = httpx.post(url, json={**_rollout("R", "T", spans=2), **change})
        assert r.status_code == 409, f"{change} rewrote the finished rollout: {r.status_code} {r.text}"
        assert r.json()["error"]["param"] == param, r.text
    again = httpx.post(url, json=_rollout("R", "T", spans=2))  # the same result again: a retry, accepted
    assert again.status_code == 201, again.text
    stored = srv.server.store.get_rollout("R")
    assert stored is not None and (stored.status, stored.final_reward) == ("succeeded", 1.0)
    assert _kinds(stored.spans) == (2, 1)  # the retry added no second reward span
    assert len(srv.server.store.trajectories(rollout_ids=["R"])) == 1


def test_spans_added_to_a_finished_rollout_rebuild_its_transitions(fake: FakeOpenAI,
                                                                   make_server: ServerFactory) -> None:
    srv = make_server(fake)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    with agl.rollout(task_id="T") as run:
        for q in ("one", "two"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}])
        agl.emit_reward(1.0)
    llm = [s for s in run.rollout.spans if s.attributes.get("gen_ai.operation.name") == "chat"]
    assert len(llm) == 2
    first = agl.Rollout.from_dict({**run.rollout.to_dict(), "spans": [s.to_dict() for s in run.rollout.spans
                                                                      if s.span_id != llm[1].span_id]})
    store = agl.HttpStore(srv.url)
    assert store.post_rollout(first)["transitions"] == 1
    store.add_spans(run.id, [llm[1]])
    steps = store.transitions(rollout_id=run.id)
    assert len(steps) == 2, f"{len(steps)} transitions after a span was added: stale"
    assert [t.prompt[-1]["content"] for t in steps] == ["one", "two"]
    assert [t.token_source for t in steps] == ["gateway", "gateway"]


# ---------------------------------------------------------------------- 5. payloads at enqueue


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def test_enqueue_refuses_a_payload_no_rollout_could_carry(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake, max_body_bytes=256 * 1024)
    for payload, problem in ((_deep(80), "deeper"), ("x" * 200_000, "bytes")):
        r = httpx.post(srv.url + "/v1/tasks", json={"tasks": [{"task": payload}]}, timeout=30)
        assert r.status_code == 400, f"a payload ({problem}) no rollout could carry was queued: {r.text[:200]}"
        assert r.json()["error"]["param"].startswith("tasks[0].task") and problem in r.json()["error"]["message"], \
            r.text[:300]
    r = httpx.post(srv.url + "/v1/tasks", content=b'{"tasks": [{"task": {"q": "\\ud800"}}]}',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tasks[0].task.q", r.text
    assert TaskClient(srv.url).counts()["queued"] == 0


def _raw_backend(body: str) -> FakeOpenAI:
    return FakeOpenAI(script=lambda request: {"status": 200, "body": body})


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
TRACEPARENT = {"traceparent": f"00-{'c' * 32}-{'d' * 16}-01"}


def _reply(**choice: Any) -> str:
    first = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
             "token_ids": [11, 12], "logprobs": {"content": [{"token": "o", "logprob": -0.1},
                                                             {"token": "k", "logprob": -0.2}]}}
    first.update(choice)
    return json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "policy",
                       "prompt_token_ids": [1, 2, 3], "choices": [first]})


@pytest.mark.parametrize(("body", "field"), [
    (_reply().replace("-0.2", "NaN"), "choices[0].logprobs.content[1].logprob"),
    (_reply().replace("-0.2", "-Infinity"), "choices[0].logprobs.content[1].logprob"),
    (_reply(token_ids=[11, -5]), "choices[0].token_ids[1]"),
    (_reply(token_ids=[11, 2**40]), "choices[0].token_ids[1]"),
    (_reply().replace('"ok"', '"\\ud800"'), "choices[0].message.content"),
])
def test_a_bad_backend_reply_is_a_502_naming_it_and_never_recorded(make_server: ServerFactory, body: str,
                                                                    field: str) -> None:
    from agl_trainer.gateway import GatewayConfig

    with _raw_backend(body) as fake:
        srv = make_server(fake, gateway=GatewayConfig(served_model="policy"))
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers=TRACEPARENT, timeout=30)
    assert r.status_code == 502, r.text
    assert field in r.json()["error"]["message"], r.text
    assert len(srv.server.records) == 0


# ---------------------------------------------------------------------- 6. bad input is a 400 naming the field


BODY_ROUTES = ["/v1/tasks", "/v1/tasks/lease", "/v1/leases/heartbeat", "/v1/leases/x/release", "/v1/rollouts",
               "/v1/rollouts/r/spans", "/v1/model", "/v1/metrics", "/v1/chat/completions", "/v1/completions"]


def test_deep_nesting_is_a_400_on_every_route(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    wrong = []
    for route in BODY_ROUTES:
        for body in (b"[" * 100_000, b'{"a":' * 5_000 + b"1" + b"}" * 5_000, b"[" * 300 + b"]" * 300):
            r = httpx.post(srv.url + route, content=body, headers={"Content-Type": "application/json"}, timeout=30)
            if r.status_code != 400 or r.json()["error"]["param"] != "body" or "nested" not in r.text:
                wrong.append(f"{route} {body[:8]!r}...: {r.status_code} {r.text[:120]}")
    assert not wrong, "\n".join(wrong)


LONE = [
    ("/v1/tasks", '{"tasks": [{"task": "\\ud800"}]}', "tasks[0].task"),
    ("/v1/tasks", '{"tasks": [{"task": 1, "task_id": "\\udfff"}]}', "tasks[0].task_id"),
    ("/v1/tasks/lease", '{"worker_id": "w\\ud800"}', "worker_id"),
    ("/v1/leases/heartbeat", '{"lease_ids": ["\\ud800"]}', "lease_ids[0]"),
    ("/v1/leases/x/release", '{"reason": "\\ud800"}', "reason"),
    ("/v1/model", '{"version": 1, "weights": "/ckpt/\\ud800"}', "weights"),
    ("/v1/rollouts", '{"id": "\\ud800", "task_id": "t"}', "id"),
    ("/v1/rollouts/r/spans", '{"spans": [{"span_id": "\\ud800", "trace_id": "t", "name": "n"}]}', "spans[0].span_id"),
    ("/v1/metrics", '{"step": 1, "values": {"\\ud800": 1.0}}', "values"),
    ("/v1/metrics", '{"step": 1, "values": {"loss": NaN}}', "values.loss"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     "temperature"),
    ("/v1/completions", '{"prompt": "hi", "top_p": -Infinity}', "top_p"),
]


def test_lone_surrogates_and_nan_are_a_400_naming_the_field(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    TaskClient(srv.url).enqueue([{"id": "kept"}])
    wrong = []
    for route, body, param in LONE:
        r = httpx.post(srv.url + route, content=body.encode(), headers={"Content-Type": "application/json"},
                       timeout=30)
        if r.status_code != 400 or r.json()["error"]["param"] != param:
            wrong.append(f"{route} {body}: {r.status_code} {r.text[:200]}")
    assert not wrong, "\n".join(wrong)
    assert TaskClient(srv.url).counts()["queued"] == 1
    assert [q for q in fake.requests if q.method == "POST"] == []  # the backend never saw any of them


# ---------------------------------------------------------------------- 7. slow clients


def _held_open(url: str, payload: bytes, wait: float) -> tuple[float, bytes]:
    """Seconds until the server closed a connection that sent only ``payload`` (``wait`` + 1 if it never did),
    and what it answered."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    start = time.monotonic()
    answer = b""
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(payload)
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except TimeoutError:
            return wait + 1, answer
    return time.monotonic() - start, answer


def test_slow_clients_are_cut_off_after_the_read_timeouts(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake, header_timeout_s=0.5, body_timeout_s=0.5)
    half_head = b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    held, answer = _held_open(srv.url, half_head, 5.0)
    assert held < 3.0 and answer.startswith(b"HTTP/1.1 408 "), (held, answer)
    half_body = b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"tasks\":"
    held, answer = _held_open(srv.url, half_body, 5.0)
    assert held < 3.0 and answer.startswith(b"HTTP/1.1 408 ") and b"body" in answer, (held, answer)
    idle = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"  # a whole request, then a next one begun and stalled
    held, answer = _held_open(srv.url, idle + b"GET /heal", 5.0)
    assert held < 3.0 and answer.startswith(b"HTTP/1.1 200 ") and b"408" in answer, (held, answer)
    r = httpx.get(srv.url + "/healthz")  # the server itself is fine
    assert r.status_code == 200


# ---------------------------------------------------------------------- 8. model versions


def test_model_versions_are_bounded_monotonic_and_recoverable(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    url = srv.url + "/v1/model"
    r = httpx.post(url, json={"version": 2**63 - 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "version", f"{r.status_code} {r.text}"
    assert httpx.post(url, json={"version": 5}).json()["version"] == 5
    r = httpx.post(url, json={"version": 3})
    assert r.status_code == 409 and "6" in r.json()["error"]["message"], r.text  # it says what would be accepted
    assert httpx.post(url, json={"weights": "/ckpt/next"}).json()["version"] == 6  # no version: the next one
    assert httpx.post(url, json={}).json()["version"] == 7


# ---------------------------------------------------------------------- 9. unjoined token records


def test_unjoined_token_records_are_bounded_by_bytes(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    budget = 512 * 1024
    srv = make_server(fake, token_records_max_bytes=budget)
    long = " ".join(f"w{i}" for i in range(400))  # ~400 prompt and response token ids a call
    with httpx.Client(timeout=30) as client:
        for i in range(200):
            r = client.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]},
                            headers={"traceparent": f"00-{i + 1:032x}-{'e' * 16}-01"})
            assert r.status_code == 200
    records = srv.server.records
    assert records.nbytes <= budget, f"{len(records)} unjoined records hold {records.nbytes} bytes"
    assert 0 < len(records) < 200
    assert records.get((f"{200:032x}", "e" * 16)) is not None  # the newest are kept
