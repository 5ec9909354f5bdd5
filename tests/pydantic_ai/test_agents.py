"""Pydantic AI agents end to end: tools, every way to run, streaming, structured output, AIR, delegation, graphs.

Agents are the real framework on Pydantic AI's ``OpenAIChatModel`` against the fake model server
(which returns vLLM-style token ids), with agl's ``pydantic_ai`` and ``openai`` plugins on, as
``agl.instrument()`` leaves them for a user.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, ModelRetry, RunContext

import agl_core as agl
from agl_core import semconv
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

from .fakes import by_plugin, chat_model, spans

pytestmark = pytest.mark.usefixtures("instrumented")

LOOKUP = {"tool_calls": [{"name": "lookup", "arguments": {"city": "Paris"}, "id": "call_1"}]}


def weather_agent(srv: FakeOpenAI, **kwargs: Any) -> Agent[None, Any]:
    agent: Agent[None, Any] = Agent(chat_model(srv), name="weather", instructions="Be brief.",
                                    system_prompt="You answer weather questions.", **kwargs)

    @agent.tool_plain
    def lookup(city: str) -> str:
        """Look up the weather of a city."""
        return f"{city}: 21C"

    return agent


def run_agent(agent: Agent[None, Any], prompt: str, how: str) -> Any:
    if how == "run_sync":
        return agent.run_sync(prompt).output
    if how == "run":
        return asyncio.run(agent.run(prompt)).output
    if how == "run_stream":
        async def streamed() -> Any:
            async with agent.run_stream(prompt) as result:
                return await result.get_output()

        return asyncio.run(streamed())
    if how == "run_stream_events":
        async def events() -> Any:
            output = None
            async with agent.run_stream_events(prompt) as stream:
                async for event in stream:
                    if getattr(event, "event_kind", None) == "agent_run_result":
                        output = event.result.output
            return output

        return asyncio.run(events())
    assert how == "iter"

    async def nodes() -> Any:
        async with agent.iter(prompt) as agent_run:
            async for _ in agent_run:
                pass
        assert agent_run.result is not None
        return agent_run.result.output

    return asyncio.run(nodes())


@pytest.mark.parametrize("how", ["run_sync", "run", "run_stream", "run_stream_events", "iter"])
def test_an_agent_with_a_tool_gives_one_transition_per_request_with_the_servers_token_ids(how: str) -> None:
    with FakeOpenAI(script=[LOOKUP, "Paris is at 21C."], return_token_ids=True) as srv:
        agent = weather_agent(srv)
        with agl.rollout(task_id="weather") as run:
            output = run_agent(agent, "Weather in Paris?", how)
            agl.emit_reward(1.0)
    assert output == "Paris is at 21C."
    traj = run.trajectory()
    assert traj.skipped == []
    assert [(t.agent_name, t.model, t.token_source) for t in traj.transitions] == [("weather", "fake-model",
                                                                                     "response")] * 2
    first, second = traj.transitions
    assert first.prompt == [{"role": "system", "content": "You answer weather questions."},
                            {"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Weather in Paris?"}]
    assert first.response["tool_calls"][0]["function"]["name"] == "lookup"
    assert [t["function"]["name"] for t in first.tools or []] == ["lookup"]
    assert second.prompt[-1] == {"role": "tool", "tool_call_id": "call_1", "content": "Paris: 21C"}
    assert second.response == {"role": "assistant", "content": "Paris is at 21C."}
    # the exact ids the server produced for what it was sent
    sent = srv.requests[1].body["messages"]
    assert second.prompt_token_ids == tokenize(render_prompt(sent))
    assert second.response_token_ids == tokenize("Paris is at 21C.")
    # one span of this plugin per request, the openai plugin's nested in it
    chats = spans(run, semconv.OP_CHAT)
    ours, inner = by_plugin(chats, "pydantic_ai"), by_plugin(chats, "openai")
    assert len(ours) == len(inner) == 2
    assert [s.parent_id for s in inner] == [s.span_id for s in ours]
    assert all(s.attributes[semconv.GEN_AI_REQUEST_STREAM] is how.startswith("run_stream") for s in ours)
    (agent_span,) = spans(run, semconv.OP_INVOKE_AGENT)
    assert agent_span.attributes[semconv.GEN_AI_AGENT_NAME] == "weather"
    assert {s.parent_id for s in ours} == {agent_span.span_id}
    (tool,) = spans(run, semconv.OP_EXECUTE_TOOL)
    assert tool.parent_id == agent_span.span_id
    assert (tool.attributes[semconv.GEN_AI_TOOL_NAME], tool.attributes[semconv.GEN_AI_TOOL_CALL_ID],
            tool.attributes[semconv.AGL_TOOL_STATUS], tool.attributes[semconv.GEN_AI_TOOL_CALL_RESULT]) == \
        ("lookup", "call_1", "ok", "Paris: 21C")
    # the gateway's join key: the traceparent that reached the server is the openai plugin's span, in this one
    assert [r.headers["traceparent"] for r in srv.requests] == [f"00-{s.trace_id}-{s.span_id}-01" for s in inner]


def test_an_agent_nobody_named_gets_its_variable_name_or_pydantic_ais_default() -> None:
    with FakeOpenAI(script=["hi", "hi"]) as srv:
        support_bot: Agent[None, str] = Agent(chat_model(srv))
        nameless: Agent[None, str] = Agent(chat_model(srv))
        with agl.rollout(task_id="names") as run:
            support_bot.run_sync("hello")  # run_sync names it after the variable, as Pydantic AI does

            async def direct() -> None:
                async with nameless.iter("hello") as agent_run:
                    async for _ in agent_run:
                        pass

            asyncio.run(direct())
    assert [t.agent_name for t in run.trajectory().transitions] == ["support_bot", "agent"]


class Forecast(BaseModel):
    city: str
    celsius: int


def test_structured_output_through_an_output_tool_is_recorded_with_its_outcome() -> None:
    bad = {"tool_calls": [{"name": "final_result", "arguments": {"city": "Paris", "celsius": "warm"}, "id": "o1"}]}
    good = {"tool_calls": [{"name": "final_result", "arguments": {"city": "Paris", "celsius": 21}, "id": "o2"}]}
    with FakeOpenAI(script=[LOOKUP, bad, good], return_token_ids=True) as srv:
        agent = weather_agent(srv, output_type=Forecast)
        with agl.rollout(task_id="forecast") as run:
            output = agent.run_sync("Weather in Paris?").output
            agl.emit_reward(1.0)
    assert output == Forecast(city="Paris", celsius=21)
    traj = run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(tool_error=-0.5)))
    assert len(traj.transitions) == 3
    assert [t["function"]["name"] for t in traj.transitions[0].tools or []] == ["lookup", "final_result"]
    assert traj.transitions[2].response["tool_calls"][0]["function"] == {
        "name": "final_result", "arguments": '{"city": "Paris", "celsius": 21}'}
    outputs = [s for s in spans(run, semconv.OP_EXECUTE_TOOL) if s.attributes.get(semconv.GEN_AI_TOOL_NAME)
               == "final_result"]
    assert [(s.attributes[semconv.GEN_AI_TOOL_CALL_ID], s.attributes[semconv.AGL_TOOL_STATUS],
             s.attributes["agl.pydantic_ai.tool.kind"]) for s in outputs] == [("o1", "error", "output"),
                                                                             ("o2", "ok", "output")]
    # the rejected structured output is an AIR signal on the call that produced it
    assert [t.reward for t in traj.transitions] == [None, -0.5, None]


def test_streamed_structured_output_makes_one_output_span_not_one_per_partial_validation() -> None:
    good = {"tool_calls": [{"name": "final_result", "arguments": {"city": "Paris", "celsius": 21}, "id": "o1"}]}
    with FakeOpenAI(script=[good], return_token_ids=True) as srv:
        agent = weather_agent(srv, output_type=Forecast)

        async def streamed() -> Any:
            async with agent.run_stream("Weather?") as result:
                async for _ in result.stream_output(debounce_by=None):
                    pass
                return await result.get_output()

        with agl.rollout(task_id="stream-forecast") as run:
            output = asyncio.run(streamed())
    assert output == Forecast(city="Paris", celsius=21)
    outputs = spans(run, semconv.OP_EXECUTE_TOOL)
    assert [(s.attributes[semconv.GEN_AI_TOOL_NAME], s.attributes[semconv.AGL_TOOL_STATUS]) for s in outputs] == \
        [("final_result", "ok")]
    (transition,) = run.trajectory().transitions
    assert transition.response_token_ids and transition.response["tool_calls"][0]["id"] == "o1"


def test_tool_outcomes_become_air_rewards_on_the_call_that_asked_for_them() -> None:
    calls = {"tool_calls": [{"name": "flaky", "arguments": {"n": 1}, "id": "r1"},
                            {"name": "slow", "arguments": {}, "id": "t1"},
                            {"name": "nosuch", "arguments": {}, "id": "u1"}]}
    with FakeOpenAI(script=[calls, "done"], return_token_ids=True) as srv:
        agent: Agent[None, str] = Agent(chat_model(srv), name="worker")

        @agent.tool_plain
        def flaky(n: int) -> str:
            raise ModelRetry(f"try another n than {n}")

        @agent.tool_plain(timeout=0.05)
        async def slow() -> str:
            await asyncio.sleep(5)
            return "never"

        with agl.rollout(task_id="air") as run:
            assert agent.run_sync("go").output == "done"
    rules = agl.AirRules(tool_error=-1.0, tool_timeout=-2.0, tool_exception=-4.0)
    traj = run.trajectory(builder=agl.TransitionBuilder(air=rules))
    tools = {s.attributes[semconv.GEN_AI_TOOL_CALL_ID]: s for s in spans(run, semconv.OP_EXECUTE_TOOL)}
    assert {k: (s.attributes[semconv.AGL_TOOL_STATUS], s.attributes[semconv.ERROR_TYPE], s.status)
            for k, s in tools.items()} == {"r1": ("error", "ModelRetry", "error"),
                                          "t1": ("timeout", "TimeoutError", "error"),
                                          "u1": ("error", "unknown_tool", "error")}
    assert "try another n than 1" in tools["r1"].attributes[semconv.GEN_AI_TOOL_CALL_RESULT]
    assert [t.reward for t in traj.transitions] == [-4.0, None]


def test_a_tool_that_raises_fails_the_run_unchanged_and_is_an_exception_outcome() -> None:
    class Broken(Exception):
        pass

    with FakeOpenAI(script=[{"tool_calls": [{"name": "boom", "arguments": {}, "id": "b1"}]}]) as srv:
        agent: Agent[None, str] = Agent(chat_model(srv), name="worker")

        @agent.tool_plain
        def boom() -> str:
            raise Broken("kaputt")

        with agl.rollout(task_id="boom") as run, pytest.raises(Broken, match="kaputt"):
            agent.run_sync("go")
    (tool,) = spans(run, semconv.OP_EXECUTE_TOOL)
    assert (tool.attributes[semconv.AGL_TOOL_STATUS], tool.attributes[semconv.ERROR_TYPE]) == ("exception", "Broken")
    (agent_span,) = spans(run, semconv.OP_INVOKE_AGENT)
    assert agent_span.status == "error"
    traj = run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(tool_exception=-1.0)))
    assert [t.reward for t in traj.transitions] == [-1.0]


def test_an_agent_delegating_to_another_inside_a_tool_keeps_each_agents_name() -> None:
    script = [{"tool_calls": [{"name": "ask_researcher", "arguments": {"question": "Capital of France?"},
                               "id": "d1"}]},
              {"tool_calls": [{"name": "search", "arguments": {"q": "France"}, "id": "s1"}]},
              "Paris.", "The researcher says: Paris."]
    with FakeOpenAI(script=script, return_token_ids=True) as srv:
        researcher: Agent[None, str] = Agent(chat_model(srv), name="researcher")
        lead: Agent[None, str] = Agent(chat_model(srv), name="lead")

        @researcher.tool_plain
        def search(q: str) -> str:
            return f"{q}: capital Paris"

        @lead.tool
        async def ask_researcher(ctx: RunContext[None], question: str) -> str:
            return (await researcher.run(question, usage=ctx.usage)).output

        with agl.rollout(task_id="delegate") as run:
            assert lead.run_sync("Ask the researcher.").output == "The researcher says: Paris."
    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["lead", "researcher", "researcher", "lead"]
    assert all(t.token_source == "response" for t in traj.transitions)
    agents = {s.attributes[semconv.GEN_AI_AGENT_NAME]: s for s in spans(run, semconv.OP_INVOKE_AGENT)}
    tools = {s.attributes[semconv.GEN_AI_TOOL_NAME]: s for s in spans(run, semconv.OP_EXECUTE_TOOL)}
    assert agents["researcher"].parent_id == tools["ask_researcher"].span_id
    assert tools["search"].attributes[semconv.GEN_AI_AGENT_NAME] == "researcher"
    assert tools["ask_researcher"].attributes[semconv.GEN_AI_AGENT_NAME] == "lead"
    only_researcher = run.trajectory(builder=agl.TransitionBuilder(agent_match="researcher"))
    assert len(only_researcher.transitions) == 2


def test_each_node_of_a_graph_is_an_agent_scope_and_agents_in_it_keep_their_names() -> None:
    from pydantic_ai.direct import model_request
    from pydantic_ai.messages import ModelRequest
    from pydantic_graph import BaseNode, End, GraphBuilder, GraphRunContext

    with FakeOpenAI(script=["A draft.", "A better draft."], return_token_ids=True) as srv:
        writer: Agent[None, str] = Agent(chat_model(srv), name="writer")
        model = chat_model(srv)

        @dataclass
        class Write(BaseNode[None, None, str]):
            topic: str

            async def run(self, ctx: GraphRunContext[None, None]) -> Polish:
                return Polish((await writer.run(self.topic)).output)

        @dataclass
        class Polish(BaseNode[None, None, str]):
            draft: str

            async def run(self, ctx: GraphRunContext[None, None]) -> End[str]:
                reply = await model_request(model, [ModelRequest.user_text_prompt(f"Polish: {self.draft}")])
                return End(reply.parts[0].content)

        builder = GraphBuilder(input_type=Write, output_type=str)
        builder.add(builder.edge_from(builder.start_node).to(Write), builder.node(Write), builder.node(Polish))
        graph = builder.build()
        with agl.rollout(task_id="graph") as run:
            assert asyncio.run(graph.run(inputs=Write("rain"))) == "A better draft."
    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["writer", "Polish"]
    scopes = {s.attributes[semconv.GEN_AI_AGENT_NAME]: s for s in spans(run, semconv.OP_INVOKE_AGENT)}
    assert set(scopes) == {"Write", "Polish", "writer"}  # the agent's own graph nodes are not scopes
    assert scopes["writer"].parent_id == scopes["Write"].span_id
    assert scopes["Polish"].attributes["agl.pydantic_ai.graph.node"] == "Polish"


@pytest.mark.parametrize("plugins", [["pydantic_ai", "openai"], ["pydantic_ai"]])
def test_a_prompt_given_as_a_list_reaches_the_transition_as_sent(plugins: list[str]) -> None:
    """A user prompt given as a sequence is sent as a list of parts (one here); the prompt keeps that list."""
    agl.uninstrument()
    assert list(agl.instrument(plugins)) == plugins
    try:
        with FakeOpenAI(script=[LOOKUP, "21C."]) as srv:
            with agl.rollout("as-sent") as run:
                weather_agent(srv).run_sync(["Weather in Paris?"])
    finally:
        agl.uninstrument()
    sent = [[{"content": None, **m} if m["role"] == "assistant" else m for m in r.body["messages"]]
            for r in srv.requests]
    assert {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]} in sent[0]
    assert [t.prompt for t in run.trajectory().transitions] == sent


@pytest.mark.parametrize("how", ["run", "run_stream"])
def test_the_chat_span_leaves_the_messages_to_the_openai_span_that_recorded_the_request(how: str) -> None:
    """Over the ``openai`` client, that plugin's span of each request holds its messages and tools: the chat
    span around it does not encode them again. The transitions are what went over the wire, with or
    without token ids: the prompts the chat span alone gives, the tools as sent (``strict`` included) and
    the tool call's arguments as the server wrote them."""
    def run_with(plugins: list[str]) -> tuple[Any, FakeOpenAI]:
        agl.uninstrument()
        assert list(agl.instrument(plugins)) == plugins
        try:
            with FakeOpenAI(script=[LOOKUP, "Paris is at 21C."]) as srv:
                with agl.rollout("once") as run:
                    assert run_agent(weather_agent(srv), "Weather in Paris?", how) == "Paris is at 21C."
        finally:
            agl.uninstrument()
        return run, srv

    run, srv = run_with(["pydantic_ai", "openai"])
    alone, alone_srv = run_with(["pydantic_ai"])
    # the gateway's join key: the openai plugin's span where it is on, else the chat span (one transition)
    chats = spans(alone, semconv.OP_CHAT)
    assert [r.headers["traceparent"] for r in alone_srv.requests] == [f"00-{s.trace_id}-{s.span_id}-01"
                                                                      for s in chats]
    both = run.trajectory().transitions
    assert [t.prompt for t in both] == [t.prompt for t in alone.trajectory().transitions]
    assert [t.tools for t in both] == [r.body["tools"] for r in srv.requests]
    assert both[0].response["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the server's text
    assert both[1].response == {"role": "assistant", "content": "Paris is at 21C."}
    chats = spans(run, semconv.OP_CHAT)
    content = (semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES, semconv.GEN_AI_TOOL_DEFINITIONS)
    for ours in by_plugin(chats, "pydantic_ai"):
        assert [ours.attributes.get(key) for key in content] == [None] * 3
        # what is not content stays (for a stream, read off the stream: the whole response is not built again)
        assert list(ours.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS]) in (["tool_calls"], ["stop"])
        assert ours.attributes[semconv.GEN_AI_RESPONSE_MODEL] == "fake-model"
        assert ours.attributes[semconv.GEN_AI_RESPONSE_ID].startswith("chatcmpl-")
        assert ours.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] > 0 and ours.status != "error"
    for inner in by_plugin(chats, "openai"):
        assert all(inner.attributes.get(key) for key in content)


def test_a_request_the_openai_span_did_not_record_whole_keeps_its_messages_on_the_chat_span() -> None:
    """A failed request, and a stream closed before the model finished: the chat span holds the prompt and the
    tools it sent, whatever the span below it has."""
    with FakeOpenAI(status=500) as srv:
        with agl.rollout("failed") as run:
            with pytest.raises(Exception, match="500"):  # the SDK's status error, through Pydantic AI
                weather_agent(srv).run_sync("Weather in Paris?")
    (failed,) = by_plugin(spans(run, semconv.OP_CHAT), "pydantic_ai")
    assert failed.status == "error"
    assert "Weather in Paris?" in failed.attributes[semconv.GEN_AI_INPUT_MESSAGES]
    assert "lookup" in failed.attributes[semconv.GEN_AI_TOOL_DEFINITIONS]

    async def cut_short(agent: Agent[None, Any]) -> None:
        async with agent.run_stream("Weather in Paris?") as result:
            async for _ in result.stream_text(delta=True, debounce_by=None):
                break  # the caller leaves mid-answer

    with FakeOpenAI(script=["Paris is at 21C. " * 20]) as srv:
        with agl.rollout("cut") as run:
            asyncio.run(cut_short(weather_agent(srv)))
    (cut,) = by_plugin(spans(run, semconv.OP_CHAT), "pydantic_ai")
    assert cut.status == "error"
    assert "Weather in Paris?" in cut.attributes[semconv.GEN_AI_INPUT_MESSAGES]
    assert "lookup" in cut.attributes[semconv.GEN_AI_TOOL_DEFINITIONS]


def test_a_client_span_a_users_sampler_drops_leaves_the_messages_on_the_chat_span() -> None:
    """Under a user's SDK provider whose sampler records no chat span nested in another, the ``openai`` span
    records nothing: the chat span keeps the messages, and each request is still one transition."""
    from opentelemetry import trace as otel_trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
    from opentelemetry.util._once import Once

    class NoNestedChats(Sampler):
        def should_sample(self, parent_context: Any, trace_id: int, name: str, kind: Any = None,
                          attributes: Any = None, links: Any = None, trace_state: Any = None) -> SamplingResult:
            parent = otel_trace.get_current_span(parent_context)
            nested = (attributes or {}).get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_CHAT and \
                (getattr(parent, "attributes", None) or {}).get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_CHAT
            return SamplingResult(Decision.DROP if nested else Decision.RECORD_AND_SAMPLE, attributes)

        def get_description(self) -> str:
            return "no nested chats"

    saved = (otel_trace._TRACER_PROVIDER, otel_trace._TRACER_PROVIDER_SET_ONCE)
    provider = TracerProvider(sampler=NoNestedChats())
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    otel_trace._TRACER_PROVIDER_SET_ONCE = Once()
    otel_trace.set_tracer_provider(provider)
    try:
        with FakeOpenAI(script=[LOOKUP, "Paris is at 21C."]) as srv:
            with agl.rollout("sampled") as run:
                assert run_agent(weather_agent(srv), "Weather in Paris?", "run_stream") == "Paris is at 21C."
    finally:
        otel_trace._TRACER_PROVIDER, otel_trace._TRACER_PROVIDER_SET_ONCE = saved
    chats = spans(run, semconv.OP_CHAT)
    assert by_plugin(chats, "openai") == [] and len(by_plugin(chats, "pydantic_ai")) == 2
    traj = run.trajectory()
    assert traj.skipped == [] and len(traj.transitions) == 2
    assert traj.transitions[0].prompt[-1] == {"role": "user", "content": "Weather in Paris?"}
    assert traj.transitions[1].response == {"role": "assistant", "content": "Paris is at 21C."}
