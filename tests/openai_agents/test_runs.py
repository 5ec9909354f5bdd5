"""Real OpenAI Agents SDK runs, offline, turned into transitions: tools, streaming, failures, handoffs, no tracing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import agents
import pytest
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled
from agents.exceptions import UserError

import agl_core as agl
from agl_core import semconv
from agl_core.schema import Span
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

pytestmark = pytest.mark.usefixtures("instrumented")

QUESTION = "What is the weather in Paris?"
WEATHER_CALL = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_w1"}]}
AIR = agl.AirRules(tool_ok=0.25, tool_exception=-1.0, tool_error=-0.5)


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    if city == "Atlantis":
        raise ValueError("no such city: Atlantis")
    return f"Sunny in {city}, 21 C."


def weather_agent(model: Any, **kwargs: Any) -> Agent[Any]:
    return Agent(name="Weather agent", instructions="Answer briefly.", tools=[get_weather], model=model, **kwargs)


def run_agent(agent: Agent[Any], text: str, mode: str, **kwargs: Any) -> Any:
    """One run of ``agent`` through ``Runner.run``, ``run_sync`` or ``run_streamed`` (events consumed)."""
    if mode == "run_sync":
        # older SDKs run on the thread's current loop, which an earlier asyncio.run() has closed and unset
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            return Runner.run_sync(agent, text, **kwargs)
        finally:
            asyncio.set_event_loop(None)
            loop.close()

    async def go() -> Any:
        if mode == "run":
            return await Runner.run(agent, text, **kwargs)
        result = Runner.run_streamed(agent, text, **kwargs)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(go())


def sent_messages(srv: FakeOpenAI) -> list[list[dict[str, Any]]]:
    """The messages of each request the server got; an assistant message without text has content None
    (older SDKs leave the key out), as in a transition."""
    return [[{"content": None, **m} if m.get("role") == "assistant" else m for m in r.body["messages"]]
            for r in srv.requests]


def spans(run: Any, operation: str) -> list[Span]:
    return [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == operation]


def by_id(run: Any) -> dict[str, Span]:
    return {s.span_id: s for s in run.rollout.spans}


# --------------------------------------------------------------------------- one agent, one tool


@pytest.mark.parametrize("mode", ["run", "run_sync", "streamed"])
def test_agent_with_a_tool_gives_one_transition_per_model_call(mode: str, chat_model: Callable[..., Any]) -> None:
    with FakeOpenAI(script=[WEATHER_CALL, "Sunny, 21 C."]) as srv:
        agent = weather_agent(chat_model(srv), model_settings=ModelSettings(include_usage=True))  # usage streamed too
        with agl.rollout(task_id="weather") as run:
            result = run_agent(agent, QUESTION, mode)
            agl.emit_reward(1.0)
    assert result.final_output == "Sunny, 21 C."
    traj = run.trajectory(builder=agl.TransitionBuilder(air=AIR))
    assert [t.agent_name for t in traj.transitions] == ["Weather agent", "Weather agent"]
    assert [t.model for t in traj.transitions] == ["fake-model", "fake-model"]
    assert traj.skipped == [] and traj.reward == 1.0
    # each prompt is exactly what the SDK sent the server; each response what the server answered
    assert [t.prompt for t in traj.transitions] == sent_messages(srv)
    first, second = traj.transitions
    assert first.prompt == [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    assert first.response == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_w1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert second.prompt[-1] == {"role": "tool", "tool_call_id": "call_w1", "content": "Sunny in Paris, 21 C."}
    assert second.response == {"role": "assistant", "content": "Sunny, 21 C."}
    assert first.tools is not None and [t["function"]["name"] for t in first.tools] == ["get_weather"]
    sent = srv.requests[0].body["tools"][0]["function"]
    assert first.tools[0]["function"]["parameters"] == sent["parameters"]
    assert first.tools[0]["function"]["description"] == sent["description"]
    # AIR: the tool's success is a reward on the call that asked for it; credit gives each call the return
    assert [t.reward for t in traj.transitions] == [0.25, None]
    assert [t.credited_reward for t in traj.transitions] == [1.25, 1.25]  # the episode return

    (tool,) = spans(run, semconv.OP_EXECUTE_TOOL)
    assert tool.name == "execute_tool get_weather" and tool.status == "unset"
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_w1"
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] == '{"city": "Paris"}'
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == "Sunny in Paris, 21 C."
    assert tool.attributes[semconv.AGL_TOOL_STATUS] == semconv.TOOL_OK
    assert tool.attributes[semconv.GEN_AI_AGENT_NAME] == "Weather agent"
    # one invoke_agent span encloses the agent's model calls and its tool call
    (agent_span,) = spans(run, semconv.OP_INVOKE_AGENT)
    assert agent_span.name == "invoke_agent Weather agent"
    chats = spans(run, semconv.OP_CHAT)
    assert len(chats) == 2 and all(s.parent_id == agent_span.span_id for s in [*chats, tool])
    assert chats[0].end_ns <= tool.start_ns <= tool.end_ns <= chats[1].start_ns
    for chat in chats:
        a = chat.attributes
        assert chat.name == "chat fake-model"
        assert a[semconv.AGL_PLUGIN] == "openai_agents" and a[semconv.GEN_AI_PROVIDER_NAME] == "openai"
        assert a[semconv.GEN_AI_REQUEST_STREAM] is (mode == "streamed")
        assert a[semconv.GEN_AI_USAGE_INPUT_TOKENS] > 0 and a[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] > 0
    if mode == "streamed":
        assert [c.attributes[semconv.GEN_AI_RESPONSE_FINISH_REASONS] for c in chats] == [["tool_calls"], ["stop"]]
        assert [t.finish_reason for t in traj.transitions] == ["tool_calls", "stop"]


def test_model_settings_reach_the_span_and_the_server_gets_our_traceparent(chat_model: Callable[..., Any]) -> None:
    settings = ModelSettings(temperature=0.3, top_p=0.9, max_tokens=64, extra_headers={"x-user": "kept"})
    with FakeOpenAI(script=["Hello."]) as srv:
        agent = Agent(name="Greeter", instructions="Greet.", model=chat_model(srv), model_settings=settings)
        with agl.rollout(task_id="hello") as run:
            run_agent(agent, "hi", "run")
    (chat,) = spans(run, semconv.OP_CHAT)
    assert chat.attributes[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.3
    assert chat.attributes[semconv.GEN_AI_REQUEST_TOP_P] == 0.9
    assert chat.attributes[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 64
    assert semconv.GEN_AI_TOOL_DEFINITIONS not in chat.attributes  # no tools, no handoffs
    headers = srv.requests[0].headers
    assert headers["x-user"] == "kept"
    assert headers["traceparent"] == f"00-{chat.trace_id}-{chat.span_id}-01"
    assert settings.extra_headers == {"x-user": "kept"}  # the agent's own settings object is untouched


# --------------------------------------------------------------------------- failing tools


@pytest.mark.parametrize("tracing", ["on", "off"])
def test_failing_tool_turned_into_a_string_is_still_an_error_for_air(tracing: str,
                                                                      chat_model: Callable[..., Any]) -> None:
    set_tracing_disabled(tracing == "off")
    script = [{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Atlantis"}, "id": "call_a"}]},
              "Atlantis has no weather report."]
    with FakeOpenAI(script=script) as srv:
        with agl.rollout(task_id="atlantis") as run:
            result = run_agent(weather_agent(chat_model(srv)), "Weather in Atlantis?", "run")
            agl.emit_reward(0.0)
    assert result.final_output == "Atlantis has no weather report."
    # the model saw the SDK's error string, as without agl
    tool_message = srv.requests[1].body["messages"][-1]
    assert tool_message["role"] == "tool" and "error" in tool_message["content"].lower()
    (tool,) = spans(run, semconv.OP_EXECUTE_TOOL)
    assert tool.status == "error"
    assert tool.attributes[semconv.AGL_TOOL_STATUS] == semconv.TOOL_EXCEPTION
    assert tool.attributes[semconv.ERROR_TYPE] == "ValueError"
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == tool_message["content"]
    assert any(e["name"] == "exception" for e in tool.events)
    traj = run.trajectory(builder=agl.TransitionBuilder(air=AIR))
    assert [t.reward for t in traj.transitions] == [-1.0, None]


def test_tool_that_raises_through_fails_the_run_with_the_sdks_own_error(chat_model: Callable[..., Any]) -> None:
    @function_tool(failure_error_function=None)
    def strict_weather(city: str) -> str:
        """The weather in a city, or an exception."""
        raise LookupError(f"no data for {city}")

    script = [{"tool_calls": [{"name": "strict_weather", "arguments": {"city": "Oslo"}, "id": "call_s"}]}]
    with FakeOpenAI(script=script) as srv:
        agent = Agent(name="Strict", tools=[strict_weather], model=chat_model(srv))
        with pytest.raises(UserError) as raised, agl.rollout(task_id="strict") as run:
            run_agent(agent, "Weather in Oslo?", "run")
    assert isinstance(raised.value.__cause__, LookupError)
    assert run.rollout.status == "failed"
    (tool,) = spans(run, semconv.OP_EXECUTE_TOOL)
    assert tool.attributes[semconv.AGL_TOOL_STATUS] == semconv.TOOL_EXCEPTION
    assert tool.attributes[semconv.ERROR_TYPE] == "LookupError"
    traj = run.trajectory(builder=agl.TransitionBuilder(air=AIR))
    assert [t.reward for t in traj.transitions] == [-1.0]


# --------------------------------------------------------------------------- handoffs


def _specialists(model: Any) -> tuple[Agent[Any], Agent[Any], Agent[Any]]:
    refunds = Agent(name="Refunds agent", instructions="Issue refunds.", model=model)
    billing = Agent(name="Billing agent", instructions="Handle billing.", handoffs=[refunds], model=model)
    triage = Agent(name="Triage agent", instructions="Route the customer.", handoffs=[billing, refunds], model=model)
    return triage, billing, refunds


HANDOFF_SCRIPT = [
    {"tool_calls": [{"name": "transfer_to_billing_agent", "arguments": {}, "id": "call_h1"}]},
    {"tool_calls": [{"name": "transfer_to_refunds_agent", "arguments": {}, "id": "call_h2"}]},
    "Your refund of 20 EUR is on its way.",
]


@pytest.mark.parametrize("mode", ["run", "streamed"])
def test_handoff_chain_names_each_agent_and_agent_match_keeps_one(mode: str,
                                                                   chat_model: Callable[..., Any]) -> None:
    with FakeOpenAI(script=HANDOFF_SCRIPT) as srv:
        triage, _, _ = _specialists(chat_model(srv))
        with agl.rollout(task_id="refund") as run:
            result = run_agent(triage, "I was charged twice.", mode)
            agl.emit_reward(1.0)
    assert result.final_output == "Your refund of 20 EUR is on its way."
    everyone = run.trajectory()
    assert [t.agent_name for t in everyone.transitions] == ["Triage agent", "Billing agent", "Refunds agent"]
    assert [t.prompt[0]["content"] for t in everyone.transitions] == [
        "Route the customer.", "Handle billing.", "Issue refunds."]
    assert [t.prompt for t in everyone.transitions] == sent_messages(srv)
    triage_tools = everyone.transitions[0].tools
    assert triage_tools is not None
    assert [t["function"]["name"] for t in triage_tools] == ["transfer_to_billing_agent", "transfer_to_refunds_agent"]

    billing_only = run.trajectory(builder=agl.TransitionBuilder(agent_match="Billing agent"))
    assert [(t.index, t.agent_name) for t in billing_only.transitions] == [(0, "Billing agent")]
    assert billing_only.transitions[0].response["tool_calls"][0]["function"]["name"] == "transfer_to_refunds_agent"
    assert len(billing_only.skipped) == 2 and all("does not match" in s.reason for s in billing_only.skipped)
    assert billing_only.reward == 1.0

    agents = spans(run, semconv.OP_INVOKE_AGENT)
    assert [s.attributes[semconv.GEN_AI_AGENT_NAME] for s in agents] == ["Triage agent", "Billing agent",
                                                                         "Refunds agent"]
    owner = {s.attributes[semconv.GEN_AI_AGENT_NAME]: s.span_id for s in agents}
    for chat in spans(run, semconv.OP_CHAT):
        assert chat.parent_id == owner[chat.attributes[semconv.GEN_AI_AGENT_NAME]]
    handoffs = [s for s in run.rollout.spans if s.attributes.get(semconv.AGL_HANDOFF_TO_AGENT)]
    assert [(s.name, s.attributes[semconv.AGL_HANDOFF_FROM_AGENT]) for s in handoffs] == [
        ("handoff Billing agent", "Triage agent"), ("handoff Refunds agent", "Billing agent")]


def test_agent_as_tool_nests_the_inner_agent_under_the_tool(chat_model: Callable[..., Any]) -> None:
    script = [
        {"tool_calls": [{"name": "translate", "arguments": {"input": "bonjour"}, "id": "call_t"}]},
        "hello",  # the translator agent, inside the tool
        "It means hello.",
    ]
    with FakeOpenAI(script=script) as srv:
        model = chat_model(srv)
        translator = Agent(name="Translator", instructions="Translate to English.", model=model)
        tool = translator.as_tool(tool_name="translate", tool_description="Translate text to English.")
        main = Agent(name="Main", instructions="Use your tools.", tools=[tool], model=model)
        with agl.rollout(task_id="translate") as run:
            result = run_agent(main, "What does bonjour mean?", "run")
    assert result.final_output == "It means hello."
    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["Main", "Translator", "Main"]
    (tool_span,) = spans(run, semconv.OP_EXECUTE_TOOL)
    assert tool_span.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == "hello"
    (inner,) = [s for s in spans(run, semconv.OP_INVOKE_AGENT)
                if s.attributes[semconv.GEN_AI_AGENT_NAME] == "Translator"]
    assert inner.parent_id == tool_span.span_id
    translator_chat = spans(run, semconv.OP_CHAT)[1]
    assert translator_chat.parent_id == inner.span_id


# --------------------------------------------------------------------------- tracing switched off


@pytest.mark.parametrize("how", ["set_tracing_disabled", "env", "run_config"])
def test_runs_are_captured_with_the_sdks_tracing_disabled(how: str, chat_model: Callable[..., Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from agents.tracing import TracingProcessor, add_trace_processor, get_trace_provider, set_trace_provider
    from agents.tracing.provider import DefaultTraceProvider

    seen: list[Any] = []

    class Recorder(TracingProcessor):  # the user's own processor: it must see nothing, tracing being off
        def on_trace_start(self, trace: Any) -> None:
            seen.append(trace)

        def on_trace_end(self, trace: Any) -> None:
            return None

        def on_span_start(self, span: Any) -> None:
            seen.append(span)

        def on_span_end(self, span: Any) -> None:
            return None

        def shutdown(self) -> None:
            return None

        def force_flush(self) -> None:
            return None

    kwargs: dict[str, Any] = {}
    saved = get_trace_provider()
    if how == "env":
        monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
        set_trace_provider(DefaultTraceProvider())  # the SDK reads the variable when its provider starts
    elif how == "set_tracing_disabled":
        set_tracing_disabled(True)
    else:
        kwargs["run_config"] = RunConfig(tracing_disabled=True)
    add_trace_processor(Recorder())
    try:
        with FakeOpenAI(script=[*HANDOFF_SCRIPT[:1], WEATHER_CALL, "Sunny."]) as srv:
            model = chat_model(srv)
            billing = Agent(name="Billing agent", instructions="Handle billing.", tools=[get_weather], model=model)
            triage = Agent(name="Triage agent", handoffs=[billing], model=model)
            with agl.rollout(task_id="off") as run:
                result = run_agent(triage, "Weather?", "run", **kwargs)
    finally:
        set_trace_provider(saved)
    assert result.final_output == "Sunny."
    assert seen == []
    traj = run.trajectory(builder=agl.TransitionBuilder(air=AIR))
    assert [t.agent_name for t in traj.transitions] == ["Triage agent", "Billing agent", "Billing agent"]
    assert [t.reward for t in traj.transitions] == [None, 0.25, None]
    (tool,) = spans(run, semconv.OP_EXECUTE_TOOL)
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_w1"
    assert tool.attributes[semconv.GEN_AI_AGENT_NAME] == "Billing agent"
    assert len(spans(run, semconv.OP_INVOKE_AGENT)) == 2


# --------------------------------------------------------------------------- with agl's openai plugin: token ids


@pytest.mark.parametrize("mode", ["run", "streamed"])
def test_with_the_openai_plugin_one_transition_per_call_with_the_servers_token_ids(
        mode: str, both_plugins: None, chat_model: Callable[..., Any]) -> None:
    settings = ModelSettings(extra_body={"return_token_ids": True, "logprobs": True})
    with FakeOpenAI(script=[WEATHER_CALL, "Sunny, 21 C."]) as srv:
        agent = weather_agent(chat_model(srv), model_settings=settings)
        with agl.rollout(task_id="tokens") as run:
            run_agent(agent, QUESTION, mode)
    chats = spans(run, semconv.OP_CHAT)
    assert len(chats) == 4  # the agent's span and, nested in it, the openai client's
    ids = by_id(run)
    inner = [s for s in chats if s.attributes[semconv.AGL_PLUGIN] == "openai"]
    assert all(ids[s.parent_id or ""].attributes[semconv.AGL_PLUGIN] == "openai_agents" for s in inner)
    traj = run.trajectory()
    assert len(traj.transitions) == len(srv.requests) == 2
    for t, request in zip(traj.transitions, srv.requests, strict=True):
        assert t.agent_name == "Weather agent" and t.token_source == "response"
        assert t.prompt_token_ids == tokenize(render_prompt(request.body["messages"]))
        assert t.response_token_ids and t.response_logprobs and len(t.response_logprobs) == len(t.response_token_ids)
        assert ids[t.span_id or ""].attributes[semconv.AGL_PLUGIN] == "openai_agents"  # the outer span
        assert request.headers["traceparent"] == f"00-{t.trace_id}-{t.span_id}-01"
    assert traj.transitions[1].response == {"role": "assistant", "content": "Sunny, 21 C."}
    assert json.loads(chats[0].attributes[semconv.GEN_AI_INPUT_MESSAGES])[0]["role"] == "system"


# --------------------------------------------------------------------------- concurrency


def test_concurrent_runs_keep_their_own_agents_tools_and_spans(chat_model: Callable[..., Any]) -> None:
    def reply(body: dict[str, Any]) -> Any:
        if body["messages"][-1]["role"] == "tool":
            return "Done."
        return {"tool_calls": [{"name": "get_weather", "arguments": {"city": body["messages"][1]["content"]}}]}

    async def one(i: int, model: Any) -> Any:
        agent = Agent(name=f"Agent {i}", instructions=f"You are number {i}.", tools=[get_weather], model=model)
        async with agl.rollout(task_id=f"task-{i}") as run:
            if i % 2:
                await Runner.run(agent, f"City{i}")
            else:
                streamed = Runner.run_streamed(agent, f"City{i}")
                async for _ in streamed.stream_events():
                    pass
        return run

    async def all_of_them(model: Any) -> list[Any]:
        return list(await asyncio.gather(*(one(i, model) for i in range(8))))

    with FakeOpenAI(script=reply) as srv:
        runs = asyncio.run(all_of_them(chat_model(srv)))
    for i, run in enumerate(runs):
        traj = run.trajectory()
        assert [t.agent_name for t in traj.transitions] == [f"Agent {i}"] * 2
        assert all(t.prompt[0]["content"] == f"You are number {i}." for t in traj.transitions)
        (tool,) = spans(run, semconv.OP_EXECUTE_TOOL)
        assert tool.attributes[semconv.GEN_AI_AGENT_NAME] == f"Agent {i}"
        assert tool.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == f"Sunny in City{i}, 21 C."
        assert traj.transitions[0].response["tool_calls"][0]["id"] == tool.attributes[semconv.GEN_AI_TOOL_CALL_ID]


def test_with_sensitive_data_kept_out_of_the_sdks_traces_tool_spans_keep_only_the_outcome(
        chat_model: Callable[..., Any]) -> None:
    with FakeOpenAI(script=[WEATHER_CALL, "Sunny."]) as srv:
        with agl.rollout(task_id="private") as run:
            run_agent(weather_agent(chat_model(srv)), QUESTION, "run",
                      run_config=RunConfig(trace_include_sensitive_data=False))
    (tool,) = spans(run, semconv.OP_EXECUTE_TOOL)
    assert semconv.GEN_AI_TOOL_CALL_ARGUMENTS not in tool.attributes
    assert semconv.GEN_AI_TOOL_CALL_RESULT not in tool.attributes
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_w1"
    assert tool.attributes[semconv.AGL_TOOL_STATUS] == semconv.TOOL_OK
    # the model calls are the training data: their messages are kept (the tool's result is in the next prompt)
    traj = run.trajectory()
    assert traj.transitions[1].prompt[-1]["content"] == "Sunny in Paris, 21 C."


# --------------------------------------------------------------------------- content as sent (issue 16)


# tool output parts came after the bottom of the tested range (tests/openai_agents_legacy)
ToolOutputText: Any = getattr(agents, "ToolOutputText", None)


@function_tool
def lookup(city: str) -> list[Any]:
    """Two text parts, the shape an MCP tool's result takes."""
    return [ToolOutputText(text=f"{city}: 18C"), ToolOutputText(text="sunny")]


def test_a_tool_result_given_as_parts_reaches_the_prompt_as_the_model_got_it(chat_model: Callable[..., Any]) -> None:
    if ToolOutputText is None:
        pytest.skip(f"openai-agents {agents.__version__} has no tool output parts (ToolOutputText)")
    call = {"tool_calls": [{"name": "lookup", "arguments": {"city": "Paris"}, "id": "call_l1"}]}
    with FakeOpenAI(script=[call, "18C and sunny."]) as srv:
        agent = Agent(name="Weather agent", instructions="Answer briefly.", tools=[lookup], model=chat_model(srv))
        with agl.rollout(task_id="weather") as run:
            run_agent(agent, QUESTION, "run")
    sent = sent_messages(srv)[1]
    tool_message = next(m for m in sent if m["role"] == "tool")
    assert isinstance(tool_message["content"], list)  # what the SDK sends for an MCP-style result
    assert run.trajectory().transitions[1].prompt == sent
