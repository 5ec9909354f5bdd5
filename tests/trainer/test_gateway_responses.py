"""``POST /v1/responses`` on the real server: the Responses API answered through the chat path, token ids recorded.

The OpenAI SDK's own ``client.responses`` is the client (its parsing of the reply and of the Responses
events is the check that the shapes are right), with agl's ``openai`` plugin on (conftest): a rollout's
Responses calls become transitions with the gateway's exact token ids, joined by ``traceparent``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

import agl_core as agl
from agl_core.testing import FakeOpenAI, render_prompt, tokenize
from agl_trainer.gateway import OpenAIBackend

from .conftest import ServerFactory

TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"
TP = {"traceparent": f"00-{TRACE}-{SPAN}-01"}
QUESTION = "What is the capital of France?"
TOOL = {"type": "function", "name": "lookup", "description": "Look a city up.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = {"tool_calls": [{"name": "lookup", "arguments": {"city": "Paris"}, "id": "call_7"}]}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def _chat_calls(fake: FakeOpenAI) -> list[dict[str, Any]]:
    return [r.body for r in fake.requests if r.path.endswith("/chat/completions")]


def test_a_plain_response_is_the_chat_reply_and_its_ids_are_recorded(
        fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    reply = _client(srv.url).responses.create(model="gpt-4o", input=QUESTION, instructions="Be brief.",
                                              max_output_tokens=32, temperature=0.5, extra_headers=TP)
    assert reply.output_text == QUESTION and reply.status == "completed" and reply.model == "fake-model"
    assert reply.id.startswith("resp_") and reply.output[0].type == "message"
    assert reply.usage is not None and reply.usage.output_tokens == len(tokenize(QUESTION))
    (sent,) = _chat_calls(fake)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    assert sent["messages"] == messages and sent["max_tokens"] == 32 and sent["temperature"] == 0.5
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    record = srv.server.records.get((TRACE, SPAN))
    assert record.prompt_token_ids == tokenize(render_prompt(messages))
    assert record.response_token_ids == tokenize(QUESTION)
    assert len(record.response_logprobs) == len(record.response_token_ids)


def test_a_streamed_response_sends_the_responses_events_and_keeps_the_ids(make_server: ServerFactory) -> None:
    with FakeOpenAI(script=["Paris it is"]) as fake:
        srv = make_server(fake)
        with httpx.stream("POST", srv.url + "/v1/responses", headers=TP, timeout=30,
                          json={"model": "m", "input": QUESTION, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = list(r.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [e["type"] for e in events] == names
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Paris it is"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Paris it is"
    assert final["usage"]["output_tokens"] == len(tokenize("Paris it is"))
    record = srv.server.records.get((TRACE, SPAN))
    assert record.response_token_ids == tokenize("Paris it is")
    assert record.prompt_token_ids == tokenize(render_prompt([{"role": "user", "content": QUESTION}]))


def test_the_sdk_reads_a_streamed_tool_call(make_server: ServerFactory) -> None:
    with FakeOpenAI(script=[CALL]) as fake:
        srv = make_server(fake)
        client = _client(srv.url)
        with client.responses.stream(model="m", input=QUESTION, tools=[TOOL],  # type: ignore[list-item]
                                     extra_headers=TP) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    (call,) = final.output
    assert (call.type, call.call_id, call.name, json.loads(call.arguments)) == (  # type: ignore[union-attr]
        "function_call", "call_7", "lookup", {"city": "Paris"})
    assert srv.server.records.get((TRACE, SPAN)).response_token_ids == tokenize(
        '<tool_call> lookup {"city": "Paris"}')


def test_a_tool_call_round_trip_in_a_rollout_becomes_two_transitions_with_the_gateway_ids(
        make_server: ServerFactory) -> None:
    with FakeOpenAI(script=[CALL, "It is sunny in Paris."]) as fake:
        srv = make_server(fake)
        client = _client(srv.url)
        store = agl.HttpStore(srv.url)
        with agl.rollout(task_id="weather", store=store) as run:
            first = client.responses.create(model="m", input=[{"role": "user", "content": "Weather in Paris?"}],
                                            tools=[TOOL], tool_choice="auto")  # type: ignore[list-item]
            (call,) = first.output
            assert call.type == "function_call" and call.call_id == "call_7"
            second = client.responses.create(
                model="m", tools=[TOOL], stream=True,  # type: ignore[list-item]
                input=[{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
                       {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
            text = "".join(e.delta for e in second if e.type == "response.output_text.delta")
            assert text == "It is sunny in Paris."
            agl.emit_reward(1.0)
        first_sent, second_sent = _chat_calls(fake)
        assert first_sent["tools"] == [{"type": "function", "function": {k: TOOL[k] for k in
                                                                          ("name", "description", "parameters")}}]
        assert first_sent["tool_choice"] == "auto"
        assert second_sent["messages"] == [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_7", "type": "function", "function": {
                "name": "lookup", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_7", "content": "sunny"}]
        traj = store.trajectories(rollout_ids=[run.id])[0]
    assert len(traj.transitions) == 2 and traj.reward == 1.0
    for t, sent in zip(traj.transitions, (first_sent, second_sent), strict=True):
        assert t.token_source == "gateway" and t.model == "fake-model"
        assert t.prompt_token_ids == tokenize(render_prompt(sent["messages"]))
        assert t.prompt == sent["messages"]
    assert traj.transitions[0].response["tool_calls"][0]["id"] == "call_7"
    assert traj.transitions[0].response_token_ids == tokenize('<tool_call> lookup {"city": "Paris"}')
    assert traj.transitions[1].response_token_ids == tokenize("It is sunny in Paris.")
    assert traj.transitions[1].response["content"] == "It is sunny in Paris."


@pytest.mark.parametrize(("body", "field", "said"), [
    ({"model": "m"}, "input", "'input' is required"),
    ({"input": 7}, "input", "must be a string or an array"),
    ({"input": []}, "input", "at least one item"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "must be one of"),
    ({"input": [{"role": {"a": 1}, "content": "hi"}]}, "input[0].role", "must be one of"),
    ({"input": ["hi"]}, "input[0]", "must be an object"),
    ({"input": [{"role": "user", "content": None}]}, "input[0].content", "string or an array"),
    ({"input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice", "must be auto"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "no chat equivalent"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "must be a string"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type", "input_text"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "hosted tool"),
    ({"input": "hi", "tools": {}}, "tools", "must be an array"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "whole conversation"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "1 or more"),
    ({"input": "hi", "instructions": 3}, "instructions", "must be a string"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type", "json_schema"),
    ({"input": "hi", "temperature": -1}, "temperature", "0 or more"),
    ({"input": "hi", "stream": "yes"}, "stream", "true or false"),
])
def test_bad_input_is_a_400_naming_the_field_and_nothing_is_recorded(
        fake: FakeOpenAI, make_server: ServerFactory, body: dict[str, Any], field: str, said: str) -> None:
    srv = make_server(fake)
    r = httpx.post(srv.url + "/v1/responses", json=body, headers=TP, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and said in error["message"], error
    assert not _chat_calls(fake) and srv.server.records.get((TRACE, SPAN)) is None
    # the server still answers the next, good call
    ok = httpx.post(srv.url + "/v1/responses", json={"input": "hi"}, headers=TP, timeout=30)
    assert ok.status_code == 200 and ok.json()["output"][0]["content"][0]["text"] == "hi"


def test_a_backend_failure_reaches_the_sdk_as_an_error(make_server: ServerFactory) -> None:
    with FakeOpenAI(script=[{"status": 500, "error": "engine fell over"}]) as fake:
        srv = make_server(fake)
        with pytest.raises(openai.APIStatusError, match="engine fell over"):
            _client(srv.url).responses.create(model="m", input="hi")


@pytest.fixture
def framework_plugins() -> Iterator[None]:
    active = agl.instrument(["pydantic_ai", "agent_framework"])
    assert set(active) == {"pydantic_ai", "agent_framework"}, active
    yield
    # not every plugin: the suite's openai plugin stays on for the tests after
    agl.uninstrument(["pydantic_ai", "agent_framework"])


async def _pydantic_ai_agent(url: str) -> str:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    agent: Agent[None, str] = Agent(OpenAIResponsesModel("fake-model", provider=OpenAIProvider(openai_client=client)),
                                    name="forecaster", instructions="Be brief.")

    @agent.tool_plain
    def lookup(city: str) -> str:
        return "sunny"

    async with agent.run_stream("Weather in Paris?") as result:
        return await result.get_output()


async def _agent_framework_agent(url: str) -> str:
    from agent_framework import Agent, tool
    from agent_framework.openai import OpenAIChatClient

    @tool
    def lookup(city: str) -> str:
        """Look a city's weather up."""
        return "sunny"

    client = OpenAIChatClient(model="fake-model", base_url=url + "/v1", api_key="x")  # the Responses API client
    agent = Agent(client=client, name="forecaster", instructions="Be brief.", tools=[lookup],
                  default_options={"store": False})
    updates = agent.run("Weather in Paris?", stream=True)
    _ = [u async for u in updates]
    return str((await updates.get_final_response()).text)


@pytest.mark.usefixtures("framework_plugins")
@pytest.mark.parametrize("framework", ["pydantic_ai", "agent_framework"])
def test_a_frameworks_streamed_responses_client_trains_on_the_gateways_ids(
        make_server: ServerFactory, framework: str) -> None:
    with FakeOpenAI(script=[CALL, "It is sunny in Paris."]) as fake:
        srv = make_server(fake)
        store = agl.HttpStore(srv.url)
        agent = _pydantic_ai_agent if framework == "pydantic_ai" else _agent_framework_agent
        with agl.rollout(task_id="weather", store=store) as run:
            assert asyncio.run(agent(srv.url)) == "It is sunny in Paris."
            agl.emit_reward(1.0)
        sent = _chat_calls(fake)
        traj = store.trajectories(rollout_ids=[run.id])[0]
    assert len(sent) == 2 and all(body.get("stream") is True for body in sent)
    assert [t.agent_name for t in traj.transitions] == ["forecaster", "forecaster"]  # one per request
    for t, body in zip(traj.transitions, sent, strict=True):
        assert t.token_source == "gateway" and t.prompt_token_ids == tokenize(render_prompt(body["messages"]))
        assert len(t.response_logprobs or []) == len(t.response_token_ids or [])
    assert traj.transitions[0].response_token_ids == tokenize('<tool_call> lookup {"city": "Paris"}')
    assert traj.transitions[1].response_token_ids == tokenize("It is sunny in Paris.")
    assert traj.transitions[1].prompt[-1] == {"role": "tool", "tool_call_id": "call_7", "content": "sunny"}
    assert len(srv.server.records) == 0  # every record joined its span


def test_a_stream_that_fails_midway_raises_in_the_sdk_and_records_nothing(make_server: ServerFactory) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    first = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "fake-model", "prompt_token_ids": [1],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Par"}, "token_ids": [2],
                          "finish_reason": None, "logprobs": None}]}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
            pass

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            data = b'{"object": "list", "data": [{"id": "fake-model"}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            self.rfile.read(int(self.headers["Content-Length"]))
            data = (b"data: " + json.dumps(first).encode() + b"\n\n"
                    + b'data: {"error": {"message": "engine fell over"}}\n\n')
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=upstream.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        srv = make_server(OpenAIBackend(f"http://127.0.0.1:{upstream.server_address[1]}/v1"))
        stream = _client(srv.url).responses.create(model="m", input="hi", stream=True, extra_headers=TP)
        with pytest.raises(openai.APIError, match="engine fell over"):
            for _ in stream:
                pass
        assert srv.server.records.get((TRACE, SPAN)) is None
    finally:
        upstream.shutdown()
        upstream.server_close()


def test_responses_calls_on_a_rollout_scoped_url_are_its_transitions(make_server: ServerFactory) -> None:
    with FakeOpenAI(script=[CALL, "It is sunny in Paris."]) as fake:
        srv = make_server(fake)
        r = httpx.post(srv.url + "/v1/rollouts", json={"id": "scoped-r", "task_id": "t1", "status": "running"})
        assert r.status_code == 201, r.text
        client = openai.OpenAI(base_url=srv.url + "/rollouts/scoped-r/v1", api_key="x", max_retries=0)
        first = client.responses.create(model="m", input="Weather in Paris?", tools=[TOOL])  # type: ignore[list-item]
        (call,) = first.output
        events = client.responses.create(model="m", tools=[TOOL], stream=True, input=[  # type: ignore[list-item]
            {"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": "call_7", "output": "sunny"}])
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It is sunny in Paris."
        r = httpx.post(srv.url + "/v1/rollouts", json={"id": "scoped-r", "task_id": "t1", "status": "succeeded",
                                                       "rewards": [{"value": 1.0}]})
        assert r.status_code == 201, r.text
        sent = _chat_calls(fake)
    transitions = srv.server.store.transitions(rollout_id="scoped-r")
    assert len(transitions) == 2 and all(t.token_source == "gateway" for t in transitions)
    for t, body in zip(transitions, sent, strict=True):
        assert t.prompt_token_ids == tokenize(render_prompt(body["messages"]))
    assert transitions[0].response_token_ids == tokenize('<tool_call> lookup {"city": "Paris"}')
    assert transitions[1].response_token_ids == tokenize("It is sunny in Paris.")
