"""``POST /v1/traces`` as the OTLP/HTTP specification says: encodings, answers, grouping, and what is refused.

Requests are what exporters send: the SDK's own encoder for protobuf (gzip too, through the SDK's exporter),
and OTLP/JSON (hex ids, lowerCamelCase, enums as integers) built as a JavaScript or Go exporter builds it.
Conventions without a Python instrumentation here (the Vercel AI SDK, the GenAI event forms, OpenLLMetry's
flattened attributes of its releases before 0.50) come as the JSON their exporters send.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.rpc.status_pb2 import Status
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_harness import AUTH, TOKEN, Agl

from agl_core.testing import FakeOpenAI, render_prompt, tokenize
from agl_trainer.gateway import GatewayConfig, OpenAIBackend
from agl_trainer.server import ServerConfig, ServerThread, TrainerServer

PROTOBUF = {**AUTH, "Content-Type": "application/x-protobuf"}
JSON = {**AUTH, "Content-Type": "application/json"}
TRACE = "5b8efff798038103d269b633813fc60c"


def _chat_span(tracer: Any, n: int, **extra: Any) -> None:
    with tracer.start_as_current_span(f"chat m{n}") as span:
        span.set_attributes({"gen_ai.operation.name": "chat", "gen_ai.request.model": "m",
                             "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [
                                 {"type": "text", "content": f"q{n}"}]}]),
                             "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [
                                 {"type": "text", "content": f"a{n}"}]}]), **extra})


def _protobuf_request(calls: int = 2, **resource: str) -> bytes:
    """An ExportTraceServiceRequest of ``calls`` GenAI chat spans under one agent span, as the SDK encodes it."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("invoke_agent solver") as agent:
        agent.set_attributes({"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"})
        for n in range(calls):
            _chat_span(tracer, n)
    return bytes(encode_spans(memory.get_finished_spans()).SerializeToString())


def _json_span(span_id: str, name: str, attributes: dict[str, Any], parent: str = "", start: int = 1,
               events: list[dict[str, Any]] | None = None, trace: str = TRACE) -> dict[str, Any]:
    def value(v: Any) -> dict[str, Any]:
        if isinstance(v, bool):
            return {"boolValue": v}
        if isinstance(v, int):
            return {"intValue": str(v)}
        if isinstance(v, float):
            return {"doubleValue": v}
        if isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v):
            return {"arrayValue": {"values": [value(x) for x in v]}}  # structured values are JSON text, as sent
        return {"stringValue": v if isinstance(v, str) else json.dumps(v)}

    def kvs(attrs: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"key": k, "value": value(v)} for k, v in attrs.items()]

    return {"traceId": trace, "spanId": span_id, "parentSpanId": parent, "name": name, "kind": 3,
            "startTimeUnixNano": str(start * 1_000_000), "endTimeUnixNano": str(start * 1_000_000 + 500_000),
            "attributes": kvs(attributes), "status": {"code": 0},
            "events": [{"name": e["name"], "timeUnixNano": str(start * 1_000_000 + 1),
                        "attributes": kvs(e["attributes"])} for e in events or []]}


def _json_request(spans: list[dict[str, Any]], scope: str = "test", **resource: Any) -> dict[str, Any]:
    return {"resourceSpans": [{"resource": {"attributes": [{"key": k, "value": {"stringValue": v}}
                                                           for k, v in resource.items()]},
                               "scopeSpans": [{"scope": {"name": scope}, "spans": spans}]}]}


def _post(agl: Agl, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{agl.url}/v1/traces", content=body, headers=headers, timeout=10)


def _rollouts(agl: Agl) -> list[dict[str, Any]]:
    return list(agl.get("/v1/rollouts")["rollouts"])


# ---------------------------------------------------------------------- encodings and grouping


def test_protobuf_by_the_sdk_exporter_with_gzip_one_trace_is_one_rollout(agl: Agl) -> None:
    """No agl.rollout.id: the trace is the rollout, its id the trace id in hex; finishing it trains."""
    provider = TracerProvider(resource=Resource.create({"service.name": "plain-app"}))
    exporter = OTLPSpanExporter(endpoint=f"{agl.url}/v1/traces", headers=AUTH, compression=Compression.Gzip)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracer = provider.get_tracer("app")
    with tracer.start_as_current_span("invoke_agent solver") as agent:
        agent.set_attributes({"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"})
        trace_id = format(agent.get_span_context().trace_id, "032x")
        _chat_span(tracer, 0)
        _chat_span(tracer, 1)
    provider.shutdown()
    (rollout,) = _rollouts(agl)
    assert rollout["id"] == trace_id and rollout["task_id"] == trace_id and rollout["status"] == "running"
    assert rollout["metadata"] == {"agl.source": "otlp", "service.name": "plain-app"}
    summary = agl.finish(trace_id, reward=1.0)
    assert summary["status"] == "succeeded" and summary["transitions"] == 2
    transitions = agl.transitions(trace_id)
    assert [t["prompt"][0]["content"] for t in transitions] == ["q0", "q1"]
    assert [t["response"]["content"] for t in transitions] == ["a0", "a1"]
    assert {t["agent_name"] for t in transitions} == {"solver"}
    assert [t["credited_reward"] for t in transitions] == [1.0, 1.0]


def test_resource_attribute_names_rollout_and_task_and_the_answer_is_an_export_response(agl: Agl) -> None:
    reply = _post(agl, _protobuf_request(**{"agl.rollout.id": "r-7", "agl.task.id": "task-7"}), PROTOBUF)
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/x-protobuf"
    answer = ExportTraceServiceResponse.FromString(reply.content)
    assert not answer.HasField("partial_success")  # everything accepted
    (rollout,) = _rollouts(agl)
    assert (rollout["id"], rollout["task_id"]) == ("r-7", "task-7")
    assert len(agl.spans("r-7")) == 3


def test_a_span_attribute_on_the_root_names_the_rollout_of_its_whole_trace_across_requests(agl: Agl) -> None:
    """Children end, and are exported, before their parent: a later request of the trace joins its rollout
    when the trace was seen naming it; spans of the same trace in one request follow the span that names it."""
    root = _json_span("0000000000000001", "agent run", {"agl.rollout.id": "by-span"}, start=1)
    child = _json_span("0000000000000002", "step", {}, parent="0000000000000001", start=2)
    later = _json_span("0000000000000003", "step", {}, parent="0000000000000001", start=3)
    assert _post(agl, json.dumps(_json_request([child, root])).encode(), JSON).status_code == 200
    assert _post(agl, json.dumps(_json_request([later])).encode(), JSON).status_code == 200
    assert [r["id"] for r in _rollouts(agl)] == ["by-span"]
    assert len(agl.spans("by-span")) == 3


def test_baggage_entry_copied_to_spans_names_the_rollout(agl: Agl) -> None:
    """The one line for an app that propagates context: baggage ``agl.rollout.id``, and the baggage span
    processor (opentelemetry-processor-baggage, or @opentelemetry/baggage-span-processor) copies it on each span."""
    from opentelemetry import baggage, context
    from opentelemetry.processor.baggage import ALLOW_ALL_BAGGAGE_KEYS, BaggageSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BaggageSpanProcessor(ALLOW_ALL_BAGGAGE_KEYS))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{agl.url}/v1/traces", headers=AUTH)))
    token = context.attach(baggage.set_baggage("agl.rollout.id", "by-baggage"))
    try:
        _chat_span(provider.get_tracer("app"), 0)  # a root of its own trace
        _chat_span(provider.get_tracer("app"), 1)  # and another
    finally:
        context.detach(token)
    provider.shutdown()
    assert [r["id"] for r in _rollouts(agl)] == ["by-baggage"]
    assert agl.finish("by-baggage")["transitions"] == 2


def test_json_request_with_a_reward_on_a_span(agl: Agl) -> None:
    chat = _json_span("00000000000000a1", "chat m", {
        "gen_ai.operation.name": "chat",
        "gen_ai.input.messages": [{"role": "user", "parts": [{"type": "text", "content": "2+2?"}]}],
        "gen_ai.output.messages": [{"role": "assistant", "parts": [{"type": "text", "content": "4"}]}]}, start=1)
    reward = _json_span("00000000000000a2", "score", {"agl.reward.value": 0.5}, start=5)
    reply = _post(agl, json.dumps(_json_request([chat, reward], **{"agl.rollout.id": "json-1"})).encode(), JSON)
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    assert reply.json() == {}
    summary = agl.finish("json-1", reward=None)  # the reward came on a span
    assert summary["transitions"] == 1
    (trajectory,) = agl.get("/v1/trajectories", rollout_id="json-1")["trajectories"]
    assert trajectory["reward"] == 0.5 and trajectory["transitions"][0]["credited_reward"] == 0.5


# ---------------------------------------------------------------------- conventions without a Python agent here


def test_vercel_ai_sdk_spans(agl: Agl) -> None:
    prompt = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": [{"type": "text", "text": "Add 2 and 3."}]}]
    run = _json_span("00000000000000b1", "ai.generateText", {
        "ai.operationId": "ai.generateText", "ai.telemetry.functionId": "calculator", "ai.model.id": "m"}, start=1)
    first = _json_span("00000000000000b2", "ai.generateText.doGenerate", {
        "ai.operationId": "ai.generateText.doGenerate", "ai.model.id": "m", "ai.model.provider": "openai.chat",
        "ai.prompt.messages": prompt, "ai.prompt.tools": [json.dumps({
            "type": "function", "name": "add", "inputSchema": {"type": "object"}})],
        "ai.response.toolCalls": [{"toolCallType": "function", "toolCallId": "call_1", "toolName": "add",
                                   "input": '{"a":2,"b":3}'}],
        "ai.response.finishReason": "tool-calls"}, parent="00000000000000b1", start=2)
    tool = _json_span("00000000000000b3", "ai.toolCall", {
        "ai.operationId": "ai.toolCall", "ai.toolCall.name": "add", "ai.toolCall.id": "call_1",
        "ai.toolCall.args": '{"a":2,"b":3}', "ai.toolCall.result": "5"}, parent="00000000000000b1", start=3)
    second = _json_span("00000000000000b4", "ai.generateText.doGenerate", {
        "ai.operationId": "ai.generateText.doGenerate", "ai.model.id": "m",
        "ai.prompt.messages": [*prompt, {"role": "assistant", "content": [
            {"type": "tool-call", "toolCallId": "call_1", "toolName": "add", "input": {"a": 2, "b": 3}}]},
            {"role": "tool", "content": [{"type": "tool-result", "toolCallId": "call_1", "toolName": "add",
                                          "output": {"type": "text", "value": "5"}}]}],
        "ai.response.text": "The sum is 5.", "ai.response.finishReason": "stop"}, parent="00000000000000b1", start=4)
    body = _json_request([first, tool, second, run], scope="ai", **{"agl.rollout.id": "vercel"})
    assert _post(agl, json.dumps(body).encode(), JSON).status_code == 200
    assert agl.finish("vercel")["transitions"] == 2
    t1, t2 = agl.transitions("vercel")
    assert t1["agent_name"] == t2["agent_name"] == "calculator" and t1["model"] == "m"
    assert t1["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."}]
    assert t1["response"]["tool_calls"] == [{"id": "call_1", "type": "function",
                                             "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}]
    assert t1["tools"] == [{"type": "function", "function": {"name": "add", "description": None,
                                                             "parameters": {"type": "object"}}}]
    assert t2["prompt"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    assert t2["response"] == {"role": "assistant", "content": "The sum is 5."}


@pytest.mark.parametrize("form", ["details", "per-message", "content"])
def test_genai_event_forms(agl: Agl, form: str) -> None:
    prompt = [{"role": "user", "content": "2+2?"}]
    events = {
        "details": [{"name": "gen_ai.client.inference.operation.details", "attributes": {
            "gen_ai.input.messages": [{"role": "user", "parts": [{"type": "text", "content": "2+2?"}]}],
            "gen_ai.output.messages": [{"role": "assistant", "parts": [{"type": "text", "content": "4"}],
                                        "finish_reason": "stop"}]}}],
        "per-message": [{"name": "gen_ai.user.message", "attributes": {"content": "2+2?"}},
                        {"name": "gen_ai.choice", "attributes": {
                            "index": 0, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "4"}}}],
        "content": [{"name": "gen_ai.content.prompt", "attributes": {"gen_ai.prompt": prompt}},
                    {"name": "gen_ai.content.completion", "attributes": {"gen_ai.completion": [
                        {"role": "assistant", "content": "4", "finish_reason": "stop"}]}}],
    }[form]
    span = _json_span("00000000000000c1", "chat m", {"gen_ai.operation.name": "chat", "gen_ai.system": "openai",
                                                     "gen_ai.request.model": "m"}, events=events)
    assert _post(agl, json.dumps(_json_request([span], **{"agl.rollout.id": form})).encode(), JSON).status_code == 200
    assert agl.finish(form)["transitions"] == 1
    (t,) = agl.transitions(form)
    assert t["prompt"] == prompt and t["response"] == {"role": "assistant", "content": "4"}
    assert t["finish_reason"] == "stop" and t["model"] == "m"


def test_openllmetry_flattened_attributes_of_older_releases(agl: Agl) -> None:
    span = _json_span("00000000000000d1", "openai.chat", {
        "llm.request.type": "chat", "gen_ai.system": "OpenAI", "gen_ai.request.model": "m",
        "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "Add 2 and 3.",
        "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.finish_reason": "tool_calls",
        "gen_ai.completion.0.tool_calls.0.id": "call_1", "gen_ai.completion.0.tool_calls.0.name": "add",
        "gen_ai.completion.0.tool_calls.0.arguments": '{"a": 2, "b": 3}',
        "llm.request.functions.0.name": "add", "llm.request.functions.0.parameters": '{"type": "object"}',
        "traceloop.workflow.name": "calc"})
    agent = _json_span("00000000000000d2", "calc.agent", {"traceloop.span.kind": "agent",
                                                         "traceloop.entity.name": "calculator"}, start=0)
    span["parentSpanId"] = "00000000000000d2"
    body = _json_request([span, agent], scope="opentelemetry.instrumentation.openai.v1",
                         **{"agl.rollout.id": "openllmetry-old"})
    assert _post(agl, json.dumps(body).encode(), JSON).status_code == 200
    assert agl.finish("openllmetry-old")["transitions"] == 1
    (t,) = agl.transitions("openllmetry-old")
    assert t["agent_name"] == "calculator" and t["prompt"] == [{"role": "user", "content": "Add 2 and 3."}]
    assert t["response"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert t["finish_reason"] == "tool_calls" and t["tools"][0]["function"]["parameters"] == {"type": "object"}


def test_an_unknown_convention_is_kept_and_reported_untrainable(agl: Agl) -> None:
    llm_like = _json_span("00000000000000e1", "llm call", {"myllm.prompt_text": "2+2?", "myllm.reply": "4"})
    other = _json_span("00000000000000e2", "db query", {"db.system": "sqlite"}, start=2)
    reply = _post(agl, json.dumps(_json_request([llm_like, other], scope="my.llm.lib",
                                                **{"agl.rollout.id": "unknown"})).encode(), JSON)
    assert reply.status_code == 200
    partial = reply.json()["partialSuccess"]
    assert "rejectedSpans" not in partial  # nothing refused: kept, with a warning
    assert "rollout unknown: 1 span(s) look like model calls in no convention agl reads" in partial["errorMessage"]
    spans = {s["name"]: s for s in agl.spans("unknown")}
    assert set(spans) == {"llm call", "db query"}  # never dropped
    assert spans["db query"]["attributes"]["agl.otlp.convention"] == "unknown"
    summary = agl.finish("unknown")
    assert summary["transitions"] == 0
    (skipped,) = summary["skipped"]
    assert skipped["span_id"] == "00000000000000e1"
    assert "looks like a model call but is in no convention agl reads (pydantic_ai, openinference" in skipped["reason"]
    (trajectory,) = agl.get("/v1/trajectories", rollout_id="unknown")["trajectories"]
    assert trajectory["skipped"] == summary["skipped"]  # visible later too (agl traces show lists it)


# ---------------------------------------------------------------------- what is refused


def test_truncated_protobuf_is_a_400_with_a_status_and_stores_nothing(agl: Agl) -> None:
    body = _protobuf_request(calls=3, **{"agl.rollout.id": "never"})
    reply = _post(agl, body[: len(body) - 7], PROTOBUF)
    assert reply.status_code == 400
    status = Status.FromString(reply.content)
    assert status.code == 3 and "not a protobuf ExportTraceServiceRequest" in status.message
    assert _rollouts(agl) == []


def test_bad_json_is_a_400_naming_the_problem_and_stores_nothing(agl: Agl) -> None:
    good = _json_span("00000000000000f1", "x", {})
    bad = _json_span("zz", "y", {})
    reply = _post(agl, json.dumps(_json_request([good, bad])).encode(), JSON)
    assert reply.status_code == 400 and "'spanId' must be a hex string" in reply.json()["message"]
    assert _post(agl, b'{"resourceSpans": [', JSON).status_code == 400
    assert _post(agl, b'{"resourceSpans": {"no": "list"}}', JSON).status_code == 400
    assert _rollouts(agl) == []


def test_wrong_content_type_or_encoding_is_a_415(agl: Agl) -> None:
    reply = _post(agl, b"spans", {**AUTH, "Content-Type": "text/plain"})
    assert reply.status_code == 415 and "application/x-protobuf or application/json" in \
        Status.FromString(reply.content).message
    reply = _post(agl, _protobuf_request(), {**PROTOBUF, "Content-Encoding": "br"})
    assert reply.status_code == 415
    assert _rollouts(agl) == []


def test_without_the_token_a_401(agl: Agl) -> None:
    reply = httpx.post(f"{agl.url}/v1/traces", content=_protobuf_request(),
                       headers={"Content-Type": "application/x-protobuf"}, timeout=10)
    assert reply.status_code == 401 and _rollouts(agl) == []


def test_spans_that_cannot_be_stored_are_a_partial_success(agl: Agl) -> None:
    good = _json_span("0000000000000011", "kept", {})
    short = _json_span("0011", "short id", {})
    backwards = _json_span("0000000000000012", "ends first", {})
    backwards["endTimeUnixNano"] = "1"
    reply = _post(agl, json.dumps(_json_request([good, short, backwards], **{"agl.rollout.id": "p"})).encode(), JSON)
    assert reply.status_code == 200
    partial = reply.json()["partialSuccess"]
    assert partial["rejectedSpans"] == "2"  # int64 as a string, as OTLP/JSON writes it
    assert "spans[1]: span_id: must be 8 bytes" in partial["errorMessage"]
    assert "spans[2]" in partial["errorMessage"] and "before it starts" in partial["errorMessage"]
    assert [s["name"] for s in agl.spans("p")] == ["kept"]


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Agl]:
    with FakeOpenAI() as fake:
        config = ServerConfig(db_path=str(tmp_path / "small.db"), port=0, token=TOKEN, max_body_bytes=64 * 1024,
                              gateway=GatewayConfig(served_model="fake-model"))
        thread = ServerThread(TrainerServer(config, OpenAIBackend(fake.url))).start()
        try:
            yield Agl(thread)
        finally:
            thread.stop()


def test_a_batch_over_the_limit_is_a_413_as_sent_or_once_decompressed(small: Agl) -> None:
    huge = _protobuf_request(calls=400, **{"agl.rollout.id": "huge"})
    assert len(huge) > 64 * 1024
    reply = _post(small, huge, PROTOBUF)
    assert reply.status_code == 413 and Status.FromString(reply.content).code == 8
    packed = gzip.compress(huge)
    assert len(packed) < 64 * 1024  # small as sent: refused once inflated past the limit
    reply = _post(small, packed, {**PROTOBUF, "Content-Encoding": "gzip"})
    assert reply.status_code == 413 and "once decompressed" in Status.FromString(reply.content).message
    assert _post(small, packed[:100], {**PROTOBUF, "Content-Encoding": "gzip"}).status_code == 400
    assert _rollouts(small) == []
    fits = _protobuf_request(calls=3, **{"agl.rollout.id": "fits"})
    assert _post(small, gzip.compress(fits), {**PROTOBUF, "Content-Encoding": "gzip"}).status_code == 200
    assert [r["id"] for r in _rollouts(small)] == ["fits"]


def test_gateway_ids_recorded_under_the_http_client_span_join_the_llm_call_above_it(agl: Agl,
                                                                                    fake: FakeOpenAI) -> None:
    """An app whose HTTP client is instrumented (Node's undici, Python's httpx) sends the HTTP span's traceparent:
    the ids the gateway recorded under it join the LLM span above, even when the HTTP span came in an earlier
    request than its parent (it ends first)."""
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    reply = httpx.post(f"{agl.url}/v1/chat/completions", json={"model": "fake-model", "messages": messages},
                       headers={**AUTH, "traceparent": f"00-{TRACE}-00000000000000a2-01"},
                       timeout=10)
    assert reply.status_code == 200, reply.text
    llm = _json_span("00000000000000a1", "chat fake-model", {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "fake-model",
        "gen_ai.input.messages": [{"role": "user", "parts": [{"type": "text", "content": "Add 2 and 3."}]}],
        "gen_ai.output.messages": [{"role": "assistant", "parts": [
            {"type": "tool_call", "id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'}]}]}, start=1)
    http = _json_span("00000000000000a2", "POST", {"http.request.method": "POST",
                                                   "url.full": f"{agl.url}/v1/chat/completions"},
                      parent="00000000000000a1", start=2)
    for batch in ([http], [llm]):
        body = json.dumps(_json_request(batch, **{"agl.rollout.id": "http-span"})).encode()
        assert _post(agl, body, JSON).status_code == 200
    assert agl.finish("http-span")["transitions"] == 1
    (t,) = agl.transitions("http-span")
    assert t["token_source"] == "gateway" and t["span_id"] == "00000000000000a1"
    assert t["prompt_token_ids"] == tokenize(render_prompt(fake.requests[0].body["messages"]))
    assert t["response"]["tool_calls"][0]["function"]["name"] == "add"


def test_a_reward_posted_at_the_finish_is_final_over_one_that_came_on_a_span(agl: Agl) -> None:
    chat = _json_span("00000000000000a1", "chat m", {
        "gen_ai.operation.name": "chat",
        "gen_ai.input.messages": [{"role": "user", "parts": [{"type": "text", "content": "2+2?"}]}],
        "gen_ai.output.messages": [{"role": "assistant", "parts": [{"type": "text", "content": "4"}]}]}, start=1)
    early = _json_span("00000000000000a2", "score", {"agl.reward.value": 0.5}, start=5)
    assert _post(agl, json.dumps(_json_request([chat, early], **{"agl.rollout.id": "two"})).encode(),
                 JSON).status_code == 200
    agl.finish("two", reward=1.0)
    agl.finish("two", reward=1.0)  # the same post again (a retry): accepted, nothing doubled
    (trajectory,) = agl.get("/v1/trajectories", rollout_id="two")["trajectories"]
    assert trajectory["reward"] == 1.0 and trajectory["transitions"][0]["credited_reward"] == 1.0
    rollout = agl.get("/v1/rollouts/two")
    assert [r["value"] for r in rollout["rewards"]] == [0.5, 1.0]
    assert sum(s["attributes"].get("agl.span.kind") == "reward" for s in rollout["spans"]) == 2  # none doubled
