"""Gateway-only capture: a rollout-scoped base URL makes an untraced agent's calls its rollout's transitions."""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from typing import Any

import httpx
import openai
import pytest

import agl_core as agl
from agl_core import collector, semconv
from agl_core.schema import Rollout, Span
from agl_core.store.http import HttpStore
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

from .conftest import ServerFactory

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "look a city up",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def _tool_then_answer(body: dict[str, Any]) -> Any:
    """The model: asks for ``lookup`` until a tool result is in the prompt, then answers with it."""
    last = body["messages"][-1]
    if last["role"] == "tool":
        return f"The answer is {last['content']}"
    return {"tool_calls": [{"name": "lookup", "arguments": {"city": "Paris"}, "id": "call_1"}]}


def _open(url: str, rollout_id: str, task_id: str = "t1") -> None:
    r = httpx.post(url + "/v1/rollouts", json={"id": rollout_id, "task_id": task_id, "status": "running"})
    assert r.status_code == 201, r.text


def _finish(url: str, rollout_id: str, reward: float, task_id: str = "t1") -> dict[str, Any]:
    r = httpx.post(url + "/v1/rollouts", json={"id": rollout_id, "task_id": task_id, "status": "succeeded",
                                               "rewards": [{"value": reward}]})
    assert r.status_code == 201, r.text
    return dict(r.json())


def _sse(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _expected_ids(messages: list[dict[str, Any]], generated: str) -> tuple[list[int], list[int]]:
    return tokenize(render_prompt(messages)), tokenize(generated)


def test_an_untraced_agent_on_the_scoped_url_yields_its_calls_in_order_with_exact_ids(
        make_server: ServerFactory) -> None:
    with FakeOpenAI(script=_tool_then_answer) as fake:
        srv = make_server(fake)
        rid = "untraced-1"
        _open(srv.url, rid)
        base = f"{srv.url}/rollouts/{rid}/v1"
        # plain httpx: no traceparent, no instrumentation of any kind
        first = [{"role": "user", "content": "Where is Paris?"}]
        reply = httpx.post(base + "/chat/completions", json={"model": "m", "messages": first, "tools": [LOOKUP]},
                           timeout=30).json()
        call = reply["choices"][0]["message"]["tool_calls"][0]
        assert "token_ids" not in reply["choices"][0]  # the agent sees the reply it would get anyway
        second = [*first, reply["choices"][0]["message"],
                  {"role": "tool", "tool_call_id": call["id"], "content": "France"}]
        chunks = _sse(base + "/chat/completions", {"model": "m", "messages": second, "tools": [LOOKUP]})
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == "The answer is France"
        # a streamed tool call, folded from its deltas
        third = [{"role": "user", "content": "Again?"}]
        _sse(base + "/chat/completions", {"model": "m", "messages": third, "tools": [LOOKUP]})
        assert httpx.get(base + "/models").json()["data"][0]["id"] == "fake-model"
        summary = _finish(srv.url, rid, 1.0)
    assert summary["transitions"] == 3 and summary["token_sources"] == {"gateway": 3}
    (traj,) = srv.server.store.trajectories(rollout_ids=[rid])
    assert traj.reward == 1.0
    t1, t2, t3 = traj.transitions
    args = json.dumps({"city": "Paris"})
    assert (t1.prompt_token_ids, t1.response_token_ids) == _expected_ids(first, f"<tool_call> lookup {args}")
    assert t1.response["tool_calls"] == [{"id": "call_1", "type": "function",
                                          "function": {"name": "lookup", "arguments": args}}]
    assert t1.tools == [LOOKUP] and t1.finish_reason == "tool_calls"
    assert (t2.prompt_token_ids, t2.response_token_ids) == _expected_ids(second, "The answer is France")
    assert t2.response == {"role": "assistant", "content": "The answer is France"}
    assert t2.prompt[-1] == {"role": "tool", "tool_call_id": "call_1", "content": "France"}
    assert (t3.prompt_token_ids, t3.response_token_ids) == _expected_ids(third, f"<tool_call> lookup {args}")
    assert t3.response["tool_calls"][0]["function"] == {"name": "lookup", "arguments": args}
    for t in traj.transitions:
        assert t.token_source == "gateway" and t.credited_reward == 1.0
        assert len(t.response_logprobs or []) == len(t.response_token_ids or [])
    assert srv.server.records.unkeyed == 0  # scoped calls are not "calls nothing can join"
    assert srv.server.rollout_calls.pending(rid) == []  # joined into the stored rollout, then dropped


def test_the_header_scopes_a_call_like_the_url(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    _open(srv.url, "by-header")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                           default_headers={"X-Agl-Rollout-Id": "by-header"})
    messages = [{"role": "user", "content": "hello there"}]
    client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
    assert _finish(srv.url, "by-header", 0.5)["token_sources"] == {"gateway": 1}
    (t,) = srv.server.store.transitions(rollout_id="by-header")
    assert (t.prompt_token_ids, t.response_token_ids) == _expected_ids(messages, "hello there")


def test_bad_unknown_and_finished_rollouts_are_refused_naming_the_rollout_id(
        fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def refused(path: str, status: int, headers: dict[str, str] | None = None) -> str:
        r = httpx.post(srv.url + path, json=chat, headers=headers, timeout=30)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == "rollout_id"
        return str(r.json()["error"]["message"])

    assert "POST /v1/rollouts" in refused("/rollouts/nobody/v1/chat/completions", 404)
    assert "letters, digits" in refused("/rollouts/bad%20id/v1/chat/completions", 400)
    assert "letters, digits" in refused("/v1/chat/completions", 400, {"X-Agl-Rollout-Id": ""})
    _open(srv.url, "r1")
    assert "another rollout" in refused("/rollouts/r1/v1/chat/completions", 400, {"X-Agl-Rollout-Id": "r2"})
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}, headers={"X-Agl-Rollout-Id": "r1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rollout_id"
    assert fake.requests == []  # nothing refused reached the model
    _finish(srv.url, "r1", 1.0)
    assert "finished" in refused("/rollouts/r1/v1/chat/completions", 409)
    assert "finished" in refused("/rollouts/r1/v1/chat/completions", 409)  # not only the first time
    assert httpx.get(srv.url + "/rollouts/bad%20id/v1/models").status_code == 400


def test_an_instrumented_agent_on_the_scoped_url_gets_one_transition_per_call(
        make_server: ServerFactory) -> None:
    """agl's own spans and the gateway's records of the same calls merge: identity from the spans, ids from
    the gateway; a call the instrumentation did not see (raw httpx) is still one transition."""
    with FakeOpenAI(script=_tool_then_answer) as fake:
        srv = make_server(fake)
        store = HttpStore(srv.url)
        rid = secrets.token_hex(16)
        _open(srv.url, rid, "merge")
        base = f"{srv.url}/rollouts/{rid}/v1"
        client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        first = [{"role": "user", "content": "Where is Paris?"}]
        with agl.rollout("merge", rollout_id=rid, store=store) as run:
            with collector.tracer().start_as_current_span(
                    semconv.agent_span_name("geo"), attributes={semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT,
                                                    semconv.GEN_AI_AGENT_NAME: "geo"}):
                reply = client.chat.completions.create(model="m", messages=first,  # type: ignore[arg-type]
                                                       tools=[LOOKUP])  # type: ignore[list-item]
                message = reply.choices[0].message
                second = [*first, message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": "call_1", "content": "France"}]
                stream = client.chat.completions.create(model="m", messages=second, stream=True)  # type: ignore
                assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
                    "The answer is France"
            third = [{"role": "user", "content": "untraced call"}]
            httpx.post(base + "/chat/completions", json={"model": "m", "messages": third}, timeout=30)
            agl.emit_reward(1.0)
        assert run.store_error is None
    stored = srv.server.store.get_rollout(rid)
    assert stored is not None
    gateway_spans = [s for s in stored.spans if s.attributes.get(semconv.AGL_PLUGIN) == "gateway"]
    assert len(gateway_spans) == 3  # the gateway saw all three calls ...
    (traj,) = srv.server.store.trajectories(rollout_ids=[rid])
    assert len(traj.transitions) == 3  # ... and each is one transition, never two
    t1, t2, t3 = traj.transitions
    assert [t.token_source for t in traj.transitions] == ["gateway"] * 3
    assert t1.agent_name == t2.agent_name == "geo" and t3.agent_name is None
    client_spans = {s.span_id for s in stored.spans if s.attributes.get(semconv.AGL_PLUGIN) == "openai"}
    assert {t1.span_id, t2.span_id} == client_spans  # identity from the agent's own spans
    assert t3.span_id in {s.span_id for s in gateway_spans}
    assert (t1.prompt_token_ids, t1.response_token_ids) == _expected_ids(
        first, f"<tool_call> lookup {json.dumps({'city': 'Paris'})}")
    assert t2.response_token_ids == tokenize("The answer is France")
    assert (t3.prompt_token_ids, t3.response_token_ids) == _expected_ids(
        third, f"<tool_call> lookup {json.dumps({'city': 'Paris'})}")
    assert traj.reward == 1.0


def test_a_call_without_traceparent_merges_with_the_span_that_gave_the_same_answer(
        fake: FakeOpenAI, make_server: ServerFactory) -> None:
    """An agent traced by something that sends no traceparent (an OTLP exporter of another SDK): its LLM span
    and the gateway's span of that call are one transition, matched by what the model answered."""
    srv = make_server(fake)
    rid = "foreign-1"
    _open(srv.url, rid)
    messages = [{"role": "user", "content": "the same words"}]
    httpx.post(f"{srv.url}/rollouts/{rid}/v1/chat/completions", json={"model": "m", "messages": messages})
    now = time.time_ns()
    foreign = Span(span_id="a" * 16, trace_id="b" * 32, name="chat m", start_ns=now - 10**9, end_ns=now,
                   attributes={semconv.GEN_AI_OPERATION_NAME: "chat", semconv.GEN_AI_AGENT_NAME: "writer",
                               semconv.GEN_AI_INPUT_MESSAGES: json.dumps(
                                   [{"role": "user", "parts": [{"type": "text", "content": "the same words"}]}]),
                               semconv.GEN_AI_OUTPUT_MESSAGES: json.dumps(
                                   [{"role": "assistant", "parts": [{"type": "text", "content": "the same words"}]}])})
    rollout = Rollout(id=rid, task_id="t1", status="succeeded", spans=[foreign])
    r = httpx.post(srv.url + "/v1/rollouts", json=rollout.to_dict())
    assert r.status_code == 201, r.text
    assert r.json()["transitions"] == 1
    (t,) = srv.server.store.transitions(rollout_id=rid)
    assert t.agent_name == "writer" and t.span_id == "a" * 16 and t.token_source == "gateway"
    assert (t.prompt_token_ids, t.response_token_ids) == _expected_ids(messages, "the same words")


def test_calls_answered_before_a_restart_still_join_their_rollout(fake: FakeOpenAI, make_server: ServerFactory,
                                                                  tmp_path: Any) -> None:
    db = tmp_path / "restart.db"
    srv = make_server(fake, db=db)
    _open(srv.url, "across")
    messages = [{"role": "user", "content": "before the restart"}]
    assert httpx.post(f"{srv.url}/rollouts/across/v1/chat/completions",
                      json={"model": "m", "messages": messages}).status_code == 200
    srv.stop()
    again = make_server(fake, db=db)
    assert httpx.post(f"{again.url}/rollouts/across/v1/chat/completions",
                      json={"model": "m", "messages": [{"role": "user", "content": "after it"}]}).status_code == 200
    assert _finish(again.url, "across", 1.0)["token_sources"] == {"gateway": 2}
    first, second = again.server.store.transitions(rollout_id="across")
    assert (first.prompt_token_ids, first.response_token_ids) == _expected_ids(messages, "before the restart")
    assert second.response_token_ids == tokenize("after it")
    left = sqlite3.connect(db).execute("SELECT count(*) FROM trainer_rollout_calls").fetchone()
    assert left == (0,)  # dropped once stored with their rollout


def test_memory_of_open_rollouts_is_bounded_and_the_file_keeps_what_leaves_it(
        fake: FakeOpenAI, make_server: ServerFactory, caplog: pytest.LogCaptureFixture) -> None:
    srv = make_server(fake)
    calls = srv.server.rollout_calls
    calls.max_bytes = 1  # every call pushes the older rollouts' calls out of memory
    for rid in ("m1", "m2", "m3"):
        _open(srv.url, rid)
        httpx.post(f"{srv.url}/rollouts/{rid}/v1/chat/completions",
                   json={"model": "m", "messages": [{"role": "user", "content": f"call of {rid}"}]})
    assert calls.evicted == 2 and "leave memory" in caplog.text
    for rid in ("m1", "m2", "m3"):
        assert _finish(srv.url, rid, 1.0)["token_sources"] == {"gateway": 1}


def test_the_torch_engine_behind_the_scoped_url_gives_the_models_own_ids_and_logprobs(
        make_server: ServerFactory) -> None:
    from agl_trainer.engine import TorchEngine

    from .test_engine import expected_logprobs, tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    engine = TorchEngine(tiny_model(len(tokenizer)), tokenizer, name="tiny", seed=0, default_max_tokens=6)
    srv = make_server(engine)
    _open(srv.url, "torch-1")
    messages = [{"role": "user", "content": "hi"}]
    base = f"{srv.url}/rollouts/torch-1/v1"
    plain = httpx.post(base + "/chat/completions", json={"model": "x", "messages": messages, "temperature": 0},
                       timeout=60).json()["choices"][0]["message"]["content"]
    chunks = _sse(base + "/chat/completions", {"model": "x", "messages": messages, "seed": 1})
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert _finish(srv.url, "torch-1", 1.0)["token_sources"] == {"gateway": 2}
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if not isinstance(prompt, list) else prompt)
    first, second = srv.server.store.transitions(rollout_id="torch-1")
    for t, text in ((first, plain), (second, streamed)):
        assert t.model == "tiny" and t.prompt_token_ids == prompt
        assert tokenizer.decode(t.response_token_ids, skip_special_tokens=True) == text
        assert t.response_logprobs == pytest.approx(expected_logprobs(engine.model, prompt, t.response_token_ids),
                                                    abs=1e-4)


def test_posted_rewards_without_spans_become_the_final_and_intermediate_rewards(
        fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    _open(srv.url, "rewarded")
    base = f"{srv.url}/rollouts/rewarded/v1/chat/completions"
    httpx.post(base, json={"messages": [{"role": "user", "content": "one"}]})
    between = time.time_ns()
    httpx.post(base, json={"messages": [{"role": "user", "content": "two"}]})
    finished = {"id": "rewarded", "task_id": "t1", "status": "succeeded",
                "rewards": [{"value": -0.5, "name": "bad_tool", "time_ns": between}, {"value": 2.0}]}
    r = httpx.post(srv.url + "/v1/rollouts", json=finished)
    assert r.status_code == 201, r.text
    (traj,) = srv.server.store.trajectories(rollout_ids=["rewarded"])
    assert traj.reward == 2.0
    assert [t.reward for t in traj.transitions] == [-0.5, None]  # the named reward is on the call before it
    # posted again (a retry): the reward spans are not doubled
    again = httpx.post(srv.url + "/v1/rollouts", json=finished)
    assert again.status_code == 201, again.text
    (traj,) = srv.server.store.trajectories(rollout_ids=["rewarded"])
    assert [t.reward for t in traj.transitions] == [-0.5, None] and traj.reward == 2.0


def test_a_call_the_gateway_could_not_keep_is_listed_as_skipped_not_lost(
        fake: FakeOpenAI, make_server: ServerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    from agl_trainer import rollout_calls

    def broken(self: Any, record: Any) -> Span:
        raise RuntimeError("unreadable reply")

    srv = make_server(fake)
    _open(srv.url, "broken")
    monkeypatch.setattr(rollout_calls.CallCapture, "span", broken)
    r = httpx.post(f"{srv.url}/rollouts/broken/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "still answered"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "still answered"
    summary = _finish(srv.url, "broken", 1.0)
    assert summary["transitions"] == 0
    (skipped,) = summary["skipped"]
    assert "the call failed (RuntimeError)" in skipped["reason"]
    stored = srv.server.store.get_rollout("broken")
    assert stored is not None
    (span,) = [s for s in stored.spans if s.span_id == skipped["span_id"]]
    assert span.status == "error" and "unreadable reply" in (span.status_message or "")


def test_a_call_answered_while_its_rollout_is_being_stored_waits_for_the_next_post(
        fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    _open(srv.url, "racing")
    base = f"{srv.url}/rollouts/racing/v1/chat/completions"
    httpx.post(base, json={"messages": [{"role": "user", "content": "first"}]})
    calls = srv.server.rollout_calls
    posted = Rollout(id="racing", task_id="t1")
    posted.spans = calls.spans_of(posted)  # what a post takes, then a call comes before it is stored
    httpx.post(base, json={"messages": [{"role": "user", "content": "second"}]})
    calls.stored(posted)
    (left,) = calls.pending("racing")
    assert left.attributes[semconv.AGL_RESPONSE_TOKEN_IDS] == tokenize("second")


def test_an_llm_span_that_arrives_after_its_call_was_stored_still_merges_with_it(
        fake: FakeOpenAI, make_server: ServerFactory) -> None:
    """The agent finished its rollout, then its exporter's last batch came: the late LLM span and the stored
    gateway span of that call are one transition (identity from the span), not two."""
    srv = make_server(fake)
    rid = "late-1"
    _open(srv.url, rid)
    messages = [{"role": "user", "content": "late words"}]
    httpx.post(f"{srv.url}/rollouts/{rid}/v1/chat/completions", json={"messages": messages})
    assert _finish(srv.url, rid, 1.0)["transitions"] == 1
    now = time.time_ns()
    late = Span(span_id="c" * 16, trace_id="d" * 32, name="chat m", start_ns=now - 10**9, end_ns=now,
                attributes={semconv.GEN_AI_OPERATION_NAME: "chat", semconv.GEN_AI_AGENT_NAME: "writer",
                            semconv.GEN_AI_OUTPUT_MESSAGES: json.dumps(
                                [{"role": "assistant", "parts": [{"type": "text", "content": "late words"}]}])})
    r = httpx.post(f"{srv.url}/v1/rollouts/{rid}/spans", json={"spans": [late.to_dict()]})
    assert r.status_code == 200, r.text
    assert r.json()["transitions"] == 1
    (t,) = srv.server.store.transitions(rollout_id=rid)
    assert t.agent_name == "writer" and t.token_source == "gateway" and t.span_id == "c" * 16
    assert t.response_token_ids == tokenize("late words")


def test_a_reward_posted_while_running_survives_the_finishing_post(
        fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    _open(srv.url, "stepwise")
    base = f"{srv.url}/rollouts/stepwise/v1/chat/completions"
    httpx.post(base, json={"messages": [{"role": "user", "content": "one"}]})
    between = time.time_ns()
    running = {"id": "stepwise", "task_id": "t1", "status": "running",
               "rewards": [{"value": -0.5, "name": "bad_tool", "time_ns": between}]}
    assert httpx.post(srv.url + "/v1/rollouts", json=running).status_code == 201
    httpx.post(base, json={"messages": [{"role": "user", "content": "two"}]})
    finished = {"id": "stepwise", "task_id": "t1", "status": "succeeded", "rewards": [{"value": 2.0}]}
    r = httpx.post(srv.url + "/v1/rollouts", json=finished)
    assert r.status_code == 201, r.text
    (traj,) = srv.server.store.trajectories(rollout_ids=["stepwise"])
    # each post's first reward had one span id: the final reward's span replaced the intermediate one
    assert [t.reward for t in traj.transitions] == [-0.5, None] and traj.reward == 2.0


def test_a_call_answered_after_its_rollout_finished_is_said_and_counted_not_held_until_it_expires(
        fake: FakeOpenAI, make_server: ServerFactory, caplog: pytest.LogCaptureFixture) -> None:
    srv = make_server(fake)
    _open(srv.url, "late")
    base = f"{srv.url}/rollouts/late/v1/chat/completions"
    httpx.post(base, json={"messages": [{"role": "user", "content": "first"}]})
    calls = srv.server.rollout_calls
    posted = Rollout(id="late", task_id="t1", status="succeeded")
    posted.spans = calls.spans_of(posted)  # what the finishing post takes; then a call is answered before it is stored
    httpx.post(base, json={"messages": [{"role": "user", "content": "second"}]})
    with caplog.at_level("WARNING", logger="agl.gateway"):
        calls.stored(posted)
        assert calls.pending("late") == [] and calls.late == 1  # not held for a post that will never come
        calls.add("late", posted.spans[0])  # a call open when it came, answered now, after the finish
    assert calls.late == 2 and calls.pending("late") == []
    said = [r.getMessage() for r in caplog.records if "answered after it was stored succeeded" in r.getMessage()]
    assert len(said) == 2 and "'late'" in said[0], caplog.text
    calls.flush()
    assert srv.server.rollout_calls._conn.execute(  # the file holds nothing of it either
        "SELECT COUNT(*) FROM trainer_rollout_calls WHERE rollout_id = 'late'").fetchone()[0] == 0


def test_a_rollout_that_took_no_scoped_call_costs_the_call_file_no_read(fake: FakeOpenAI,
                                                                       make_server: ServerFactory) -> None:
    srv = make_server(fake)
    calls = srv.server.rollout_calls
    assert calls._conn is not None
    statements: list[str] = []
    calls._conn.set_trace_callback(statements.append)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    with agl.rollout(task_id="plain", store=HttpStore(srv.url)):  # traced, on the plain /v1: no rollout scope
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        agl.emit_reward(1.0)
    assert [s for s in statements if "trainer_rollout_calls" in s] == []
    _open(srv.url, "scoped")  # a scoped one still reads and clears its calls
    httpx.post(f"{srv.url}/rollouts/scoped/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    _finish(srv.url, "scoped", 1.0)
    assert any("DELETE FROM trainer_rollout_calls" in s for s in statements), statements
    (traj,) = HttpStore(srv.url).trajectories(rollout_ids=["scoped"])
    assert len(traj.transitions) == 1
