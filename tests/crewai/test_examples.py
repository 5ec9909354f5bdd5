"""``examples/crewai_agent``: the order-desk crew (a researcher with a tool, a writer), as a rollout against a fake
server.

The real ``Crew``, ``Agent``, ``Task``, ``@tool`` and CrewAI's native OpenAI
provider; only the model is scripted, found through ``OPENAI_BASE_URL``.
Checked: one transition per model call named after each agent's role, the
server's token ids, ``agent_match`` keeping one role, the reward, and the AIR
penalty for looking up an order that does not exist.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import agl_core as agl
from agl_core import guard, semconv
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.crewai_agent import agent as crew_agent  # noqa: E402

pytestmark = pytest.mark.usefixtures("instrumented")

Serve = Callable[..., FakeOpenAI]
TASK = crew_agent.TASKS[0]  # order A-1001: shipped, arriving 3 December
RIGHT = "Your order A-1001 has shipped and will arrive on 3 December."


def lookup(order_id: str, call_id: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "order_lookup", "arguments": {"order_id": order_id}, "id": call_id}]}


@pytest.fixture
def model(serve: Serve, monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeOpenAI]:
    """``model(*replies)``: the suite's fake server saying them (token ids always), where the env vars point."""
    def start(*replies: Any) -> FakeOpenAI:
        srv = serve(list(replies), return_token_ids=True)
        monkeypatch.setenv("OPENAI_BASE_URL", srv.url)
        monkeypatch.setenv("OPENAI_API_KEY", "not-a-key")
        return srv

    return start


def test_the_reward_needs_every_fact() -> None:
    assert crew_agent.reward(RIGHT, TASK["facts"]) == 1.0
    assert crew_agent.reward("It has   SHIPPED, due 3\nDecember.", TASK["facts"]) == 1.0
    assert crew_agent.reward("It has shipped, due 4 December.", TASK["facts"]) == 0.0
    with pytest.raises(KeyError, match="no order 'Z-9'"):
        crew_agent.order_lookup.func("Z-9")


def test_the_crew_answers_right(model: Callable[..., FakeOpenAI]) -> None:
    srv = model(lookup("A-1001", "c1"), "Status shipped, delivery 3 December.", RIGHT)
    assert crew_agent.rollout(TASK) == 1.0
    run = crew_agent.rollout.last_run
    traj = run.trajectory()
    assert run.rollout.status == "succeeded" and traj.reward == 1.0 and traj.skipped == []
    assert [t.agent_name for t in traj.transitions] == ["Order researcher", "Order researcher", "Support writer"]
    ask, facts, reply = traj.transitions
    assert ask.response["tool_calls"][0]["function"]["name"] == "order_lookup"
    assert facts.prompt[-1]["role"] == "tool" and "delivery 3 December" in facts.prompt[-1]["content"]
    assert "Status shipped, delivery 3 December." in str(reply.prompt[-1]["content"])  # the research, as context
    assert reply.response["content"] == RIGHT
    assert [t.reward for t in traj.transitions] == [None, None, None]
    assert [t.credited_reward for t in traj.transitions] == [1.0, 1.0, 1.0]
    requests = [r for r in srv.requests if r.path.endswith("/chat/completions")]
    assert len(requests) == 3
    for t, request in zip(traj.transitions, requests, strict=True):
        assert t.token_source == "response" and t.model == "policy"
        assert t.prompt_token_ids == tokenize(render_prompt(request.body["messages"]))
        assert t.response_token_ids
    assert reply.response_token_ids == tokenize(RIGHT)

    writer_only = run.trajectory(builder=agl.TransitionBuilder(agent_match="Support writer"))
    assert [t.response["content"] for t in writer_only.transitions] == [RIGHT]
    assert len(writer_only.skipped) == 2
    names = {s.name for s in run.rollout.spans}
    assert {"crewai.crew order desk", "crewai.task research", "crewai.task reply",
            "execute_tool order_lookup"} <= names
    assert guard.fault_counts() == {}


def test_a_wrong_reply_scores_zero(model: Callable[..., FakeOpenAI]) -> None:
    model(lookup("A-1001", "c1"), "Status shipped, delivery 3 December.", "Your order arrives on 5 December.")
    assert crew_agent.rollout(TASK) == 0.0
    traj = crew_agent.rollout.last_run.trajectory()
    assert len(traj.transitions) == 3 and traj.reward == 0.0


def test_looking_up_a_missing_order_is_an_air_penalty(model: Callable[..., FakeOpenAI]) -> None:
    model(lookup("A-1000", "c1"), lookup("A-1001", "c2"), "Status shipped, delivery 3 December.", RIGHT)
    assert crew_agent.rollout(TASK) == 1.0
    run = crew_agent.rollout.last_run
    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["Order researcher"] * 3 + ["Support writer"]
    assert [t.reward for t in traj.transitions] == [crew_agent.LOOKUP_ERROR_REWARD, None, None, None]
    assert traj.transitions[0].credited_reward == pytest.approx(1.0 + crew_agent.LOOKUP_ERROR_REWARD)
    tools = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert [s.attributes[semconv.AGL_TOOL_STATUS] for s in tools] == ["exception", "ok"]
    assert "no order" in str(traj.transitions[1].prompt[-1]["content"])  # the researcher saw what went wrong


def test_the_fake_mode_main_runs_and_prints_rewards(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # main points it at its fake; restored after
    monkeypatch.setenv("OPENAI_API_KEY", "not-a-key")
    try:
        assert crew_agent.main(["--fake", "--tasks", "2"]) == 0
    finally:
        agl.uninstrument()
    out = capsys.readouterr().out
    assert out.count("final reward") == 2 and "response ids" in out


def test_the_builder_is_what_train_yaml_gives_the_server() -> None:
    """examples/crewai_agent/train.yaml gives `agl train` these rules (tests/trainer checks it)."""
    assert crew_agent.BUILDER.agent_match is None
    assert crew_agent.BUILDER.air == agl.AirRules(tool_error=-0.3, tool_exception=-0.3)


# --------------------------------------------------------------------------- docs/otlp-export.md, over real OTLP/HTTP


class _Collector:
    """A local OTLP/HTTP receiver on 127.0.0.1: keeps each ``POST /v1/traces`` body, answers 200."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.bodies: list[tuple[str, dict[str, str], bytes]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.bodies.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def spans(self) -> list[Any]:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        out = []
        for _, _, body in self.bodies:
            request = ExportTraceServiceRequest.FromString(body)
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    out.extend((resource_spans.resource, span) for span in scope_spans.spans)
        return out

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_crew_exported_over_otlp_http_while_agl_collects(model: Callable[..., FakeOpenAI]) -> None:
    """The provider and OTLP exporter of docs/otlp-export.md (Langfuse-style auth header), a local receiver."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.util._once import Once

    collector = _Collector()
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    provider = TracerProvider(resource=Resource.create({"service.name": "order-desk-training"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
        endpoint=collector.endpoint, headers={"Authorization": "Basic cGstbGY6c2stbGY="})))
    try:
        trace.set_tracer_provider(provider)
        model(lookup("A-1001", "c1"), "Status shipped, delivery 3 December.", RIGHT)
        with trace.get_tracer("my.trainer").start_as_current_span("training step 1"):
            assert crew_agent.rollout(TASK) == 1.0
        assert trace.get_tracer_provider() is provider
        provider.force_flush()
    finally:
        provider.shutdown()
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved
        collector.stop()

    run = crew_agent.rollout.last_run
    traj = run.trajectory()
    assert len(traj.transitions) == 3 and traj.reward == 1.0
    assert all(path == "/v1/traces" and headers["authorization"] == "Basic cGstbGY6c2stbGY="
               and headers["content-type"] == "application/x-protobuf" for path, headers, _ in collector.bodies)
    received = {span.span_id.hex(): (resource, span) for resource, span in collector.spans()}
    assert {s.span_id for s in run.rollout.spans} <= set(received)  # every span of the rollout went out
    for t in traj.transitions:
        resource, span = received[t.span_id]
        assert span.trace_id.hex() == t.trace_id
        attrs = {a.key: a.value for a in span.attributes}
        assert attrs["gen_ai.agent.name"].string_value == t.agent_name
        assert attrs["agl.rollout.id"].string_value == run.id
        service = {a.key: a.value.string_value for a in resource.attributes}["service.name"]
        assert service == "order-desk-training"
    names = {span.name for _, span in received.values()}
    assert {"training step 1", "crewai.crew order desk", "execute_tool order_lookup", "agl.reward"} <= names
