"""agl's ``crewai`` plugin driving real crews, agents, tools and flows against a fake OpenAI server on 127.0.0.1.

Each test runs the crew inside ``agl.rollout`` and checks what a trainer gets:
the transitions (one per LLM call, in order, with the agent's role), the tool
outcomes through AIR rewards, and the final reward; and the spans that carry
crew, task and flow names around them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from crewai.agent.core import Agent
from crewai.crew import Crew
from crewai.flow.flow import Flow, listen, start
from crewai.llm import LLM
from crewai.process import Process
from crewai.task import Task
from crewai.tools import tool
from crewai.tools.tool_failure import ToolFailure

import agl_core as agl
from agl_core import guard, semconv
from agl_core.schema import Span
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

Serve = Callable[..., FakeOpenAI]


@tool("multiply")
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@tool("divide")
def divide(a: int, b: int) -> float:
    """Divide a by b."""
    return a / b


@tool("lookup")
def lookup(name: str) -> Any:
    """Look up a person's phone number."""
    return ToolFailure(message=f"no entry for {name}", code="not_found")


def _llm(srv: FakeOpenAI, **kwargs: Any) -> Any:
    return LLM(model="gpt-4o", base_url=srv.url, api_key="x", max_retries=0, **kwargs)


def _spans(run: Any, name: str) -> list[Span]:
    return [s for s in run.rollout.spans if s.name == name]


def _one(run: Any, name: str) -> Span:
    found = _spans(run, name)
    assert len(found) == 1, [s.name for s in run.rollout.spans]
    return found[0]


def _llm_spans(run: Any) -> list[Span]:
    return [s for s in run.rollout.spans if s.attributes.get(semconv.AGL_PLUGIN) == "crewai"
            and s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_CHAT]


def _tool_spans(run: Any) -> list[Span]:
    return [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_EXECUTE_TOOL]


def _calculator_crew(srv: FakeOpenAI, tools: list[Any], **llm_kwargs: Any) -> Crew:
    calculator = Agent(role="Calculator", goal="compute exactly", backstory="A careful mathematician.",
                       llm=_llm(srv, **llm_kwargs), tools=tools, max_retry_limit=0)
    task = Task(description="What is 6*7?", expected_output="a number", agent=calculator, name="multiply")
    return Crew(agents=[calculator], tasks=[task], name="calc crew")


# --------------------------------------------------------------------------- one agent, one tool


def test_one_agent_with_a_tool(instrumented: list[str], serve: Serve) -> None:
    srv = serve([{"tool_calls": [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]}, "The answer is 42."])
    crew = _calculator_crew(srv, [multiply], extra_body={"return_token_ids": True})
    with agl.rollout("calc-1") as run:
        out = crew.kickoff()
        agl.emit_reward(1.0 if "42" in out.raw else 0.0)
    assert out.raw == "The answer is 42."

    traj = run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(tool_ok=0.5)))
    assert [t.agent_name for t in traj.transitions] == ["Calculator", "Calculator"]
    assert [t.model for t in traj.transitions] == ["gpt-4o", "gpt-4o"]
    first, second = traj.transitions
    assert first.response["tool_calls"] == [{"id": "call_1_0", "type": "function", "function": {
        "name": "multiply", "arguments": json.dumps({"a": 6, "b": 7})}}]
    assert first.prompt[0]["role"] == "system" and "You are Calculator" in first.prompt[0]["content"]
    assert first.tools is not None and first.tools[0]["function"]["name"] == "multiply"
    assert second.response == {"role": "assistant", "content": "The answer is 42."}
    assert second.prompt[-1] == {"role": "tool", "tool_call_id": "call_1_0", "name": "multiply", "content": "42"}
    assert (first.reward, second.reward, traj.reward) == (0.5, None, 1.0)
    assert traj.skipped == []

    # one transition per request, though two plugins saw it: agent from crewai's span, token ids from openai's
    for transition, request in zip(traj.transitions, srv.requests, strict=True):
        assert transition.token_source == "response"
        assert transition.prompt_token_ids == tokenize(render_prompt(request.body["messages"]))
        assert transition.finish_reason in ("tool_calls", "stop")
    assert second.response_token_ids == tokenize("The answer is 42.")

    crew_span, task_span = _one(run, "crewai.crew calc crew"), _one(run, "crewai.task multiply")
    agent_span = _one(run, "invoke_agent Calculator")
    assert crew_span.attributes[semconv.CREWAI_CREW_PROCESS] == "sequential"
    assert task_span.parent_id == crew_span.span_id and agent_span.parent_id == task_span.span_id
    assert task_span.attributes[semconv.CREWAI_CREW_NAME] == "calc crew"
    assert agent_span.attributes[semconv.CREWAI_TASK_NAME] == "multiply"
    assert agent_span.attributes[semconv.GEN_AI_OPERATION_NAME] == "invoke_agent"
    llm_spans = _llm_spans(run)
    assert [s.parent_id for s in llm_spans] == [agent_span.span_id] * 2
    assert llm_spans[0].attributes[semconv.CREWAI_LLM_CLASS] == "OpenAICompletion"
    assert llm_spans[0].attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == len(first.response_token_ids or [])
    assert llm_spans[1].attributes[semconv.GEN_AI_RESPONSE_ID] == "chatcmpl-2"
    (call,) = _tool_spans(run)
    assert call.name == "execute_tool multiply" and call.parent_id == agent_span.span_id
    assert call.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_1_0"
    assert json.loads(call.attributes[semconv.GEN_AI_TOOL_CALL_ARGUMENTS]) == {"a": 6, "b": 7}
    assert call.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == "42"
    assert call.attributes[semconv.AGL_TOOL_STATUS] == "ok" and call.attributes[semconv.AGL_TOOL_CACHE_HIT] is False
    # the traceparent the gateway keys token ids by names the openai span nested in crewai's
    inner = [s for s in run.rollout.spans if s.attributes.get(semconv.AGL_PLUGIN) == "openai"]
    assert [s.parent_id for s in inner] == [s.span_id for s in llm_spans]
    assert [r.headers["traceparent"].split("-")[2] for r in srv.requests] == [s.span_id for s in inner]
    assert guard.fault_counts() == {}


def test_failing_tools_become_air_rewards(instrumented: list[str], serve: Serve) -> None:
    """A tool that raises is ``exception``; one that returns a ``ToolFailure`` is ``error``; run side by side."""
    srv = serve([
        {"tool_calls": [{"name": "divide", "arguments": {"a": 1, "b": 0}},
                        {"name": "lookup", "arguments": {"name": "Ada"}}]},
        "I could not do either.",
    ])
    crew = _calculator_crew(srv, [divide, lookup])
    with agl.rollout("calc-fail") as run:
        out = crew.kickoff()
        agl.emit_reward(0.0)
    assert out.raw == "I could not do either."

    rules = agl.AirRules(tool_exception=-1.0, tool_error=-0.25)
    traj = run.trajectory(builder=agl.TransitionBuilder(air=rules))
    assert len(traj.transitions) == 2
    assert traj.transitions[0].reward == -1.25 and traj.transitions[1].reward is None
    assert traj.reward == 0.0
    tools = {s.attributes[semconv.GEN_AI_TOOL_NAME]: s for s in _tool_spans(run)}
    raised, failed = tools["divide"], tools["lookup"]
    assert raised.attributes[semconv.AGL_TOOL_STATUS] == "exception" and raised.status == "error"
    assert raised.attributes[semconv.ERROR_TYPE] == "ZeroDivisionError"
    assert raised.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_1_0"
    assert failed.attributes[semconv.AGL_TOOL_STATUS] == "error" and failed.status == "error"
    assert failed.attributes[semconv.ERROR_TYPE] == "tool_reported"
    assert failed.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_1_1"
    assert "no entry for Ada" in failed.attributes[semconv.GEN_AI_TOOL_CALL_RESULT]
    # both ran on crewai's thread pool, each in the agent's span
    agent_span = _one(run, "invoke_agent Calculator")
    assert {raised.parent_id, failed.parent_id} == {agent_span.span_id}


def test_tool_cache_hit(instrumented: list[str], serve: Serve) -> None:
    srv = serve([
        {"tool_calls": [{"name": "multiply", "arguments": {"a": 2, "b": 3}}]},
        {"tool_calls": [{"name": "multiply", "arguments": {"a": 5, "b": 5}}]},
        {"tool_calls": [{"name": "multiply", "arguments": {"a": 2, "b": 3}}]},
        "6, 25 and 6.",
    ])
    crew = _calculator_crew(srv, [multiply])
    crew.cache = True
    with agl.rollout("cache") as run:
        assert crew.kickoff().raw == "6, 25 and 6."
    calls = _tool_spans(run)
    assert [c.attributes[semconv.AGL_TOOL_CACHE_HIT] for c in calls] == [False, False, True]
    assert [c.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] for c in calls] == ["6", "25", "6"]
    assert len(run.trajectory().transitions) == 4


# --------------------------------------------------------------------------- several agents


def _research_and_write(llm: Any, process: Process = Process.sequential, **crew_kwargs: Any) -> Crew:
    researcher = Agent(role="Researcher", goal="find facts", backstory="A librarian.", llm=llm)
    writer = Agent(role="Writer", goal="write clearly", backstory="A columnist.", llm=llm)
    if process is Process.sequential:
        research = Task(description="Find one fact about owls.", expected_output="a fact", agent=researcher,
                        name="research")
        write = Task(description="Write a sentence from the fact.", expected_output="a sentence", agent=writer,
                     context=[research], name="write")
        return Crew(agents=[researcher, writer], tasks=[research, write], name="owl crew", **crew_kwargs)
    task = Task(description="Write one fact about owls.", expected_output="one sentence", name="owl fact")
    return Crew(agents=[researcher, writer], tasks=[task], process=process, name="owl crew", manager_llm=llm,
                **crew_kwargs)


def test_sequential_crew_of_two_agents_with_agent_match(instrumented: list[str], serve: Serve) -> None:
    srv = serve(["Owls hunt at night.", "Owls are night hunters."])
    with agl.rollout("owls") as run:
        out = _research_and_write(_llm(srv)).kickoff()
        agl.emit_reward(1.0)
    assert out.raw == "Owls are night hunters."

    every = run.trajectory()
    assert [t.agent_name for t in every.transitions] == ["Researcher", "Writer"]
    assert "Owls hunt at night." in every.transitions[1].prompt[-1]["content"]  # the writer got the research

    writer_only = run.trajectory(builder=agl.TransitionBuilder(agent_match="Writer"))
    assert [t.agent_name for t in writer_only.transitions] == ["Writer"]
    assert writer_only.transitions[0].index == 0
    assert writer_only.transitions[0].response["content"] == "Owls are night hunters."
    assert writer_only.reward == 1.0 and writer_only.transitions[0].credited_reward == 1.0
    (skipped,) = writer_only.skipped
    assert "'Researcher' does not match" in skipped.reason

    crew_span = _one(run, "crewai.crew owl crew")
    tasks = [_one(run, "crewai.task research"), _one(run, "crewai.task write")]
    assert [t.parent_id for t in tasks] == [crew_span.span_id] * 2
    agents = [_one(run, "invoke_agent Researcher"), _one(run, "invoke_agent Writer")]
    assert [a.parent_id for a in agents] == [t.span_id for t in tasks]
    assert [a.attributes[semconv.CREWAI_TASK_NAME] for a in agents] == ["research", "write"]


def test_hierarchical_crew(instrumented: list[str], serve: Serve) -> None:
    delegate = {"task": "Find a fact about owls", "context": "for a children's book", "coworker": "Researcher"}
    srv = serve([
        {"tool_calls": [{"name": "delegate_work_to_coworker", "arguments": delegate}]},  # the manager
        "Owls can turn their heads 270 degrees.",  # the researcher, inside the delegation tool
        "Owls can turn their heads 270 degrees.",  # the manager's final answer
    ])
    with agl.rollout("owls-h") as run:
        out = _research_and_write(_llm(srv), Process.hierarchical).kickoff()
        agl.emit_reward(1.0)
    assert out.raw == "Owls can turn their heads 270 degrees."

    traj = run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(tool_ok=0.1)))
    assert [t.agent_name for t in traj.transitions] == ["Crew Manager", "Researcher", "Crew Manager"]
    assert traj.transitions[0].response["tool_calls"][0]["function"]["name"] == "delegate_work_to_coworker"
    assert [t.reward for t in traj.transitions] == [0.1, None, None]  # the delegation counted for the manager
    researcher = run.trajectory(builder=agl.TransitionBuilder(agent_match="Researcher"))
    assert [t.response["content"] for t in researcher.transitions] == ["Owls can turn their heads 270 degrees."]

    crew_span = _one(run, "crewai.crew owl crew")
    assert crew_span.attributes[semconv.CREWAI_CREW_PROCESS] == "hierarchical"
    manager = _one(run, "invoke_agent Crew Manager")
    (delegation,) = _tool_spans(run)
    assert delegation.name == "execute_tool delegate_work_to_coworker"
    assert delegation.parent_id == manager.span_id and delegation.attributes[semconv.AGL_TOOL_STATUS] == "ok"
    coworker = _one(run, "invoke_agent Researcher")
    assert coworker.parent_id == delegation.span_id  # the coworker worked inside the manager's tool call
    assert coworker.attributes[semconv.CREWAI_TASK_NAME] == "Find a fact about owls"


# --------------------------------------------------------------------------- flows


def test_flow(instrumented: list[str], serve: Serve) -> None:
    srv = serve(["teal", "Teal sea at dusk."])
    llm = _llm(srv)
    poet = Agent(role="Poet", goal="write short poems", backstory="Writes haiku.", llm=llm)

    class ColorPoem(Flow):  # type: ignore[type-arg]
        @start()
        def pick_color(self) -> str:
            return str(llm.call("Name one color."))  # a flow step calling the LLM itself, on a worker thread

        @listen(pick_color)
        def write_poem(self, color: str) -> str:
            return str(poet.kickoff(f"Write a poem about {color}.").raw)  # a standalone agent inside the flow

    with agl.rollout("poem") as run:
        result = ColorPoem().kickoff()
        agl.emit_reward(1.0)
    assert result == "Teal sea at dusk."

    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == [None, "Poet"]
    assert traj.transitions[0].prompt == [{"role": "user", "content": "Name one color."}]
    assert traj.transitions[1].response["content"] == "Teal sea at dusk."
    flow = _one(run, "crewai.flow ColorPoem")
    assert flow.attributes[semconv.CREWAI_FLOW_NAME] == "ColorPoem"
    poet_span = _one(run, "invoke_agent Poet")
    by_id = {s.span_id: s for s in run.rollout.spans}
    for span in [*_llm_spans(run), poet_span]:  # every span of the flow is under the flow's span
        parent = span
        while parent.parent_id in by_id and parent.span_id != flow.span_id:
            parent = by_id[parent.parent_id]
        assert parent.span_id == flow.span_id, span.name
    assert not any(s.name.startswith("crewai.flow AgentExecutor") for s in run.rollout.spans)


# --------------------------------------------------------------------------- async, threads, streaming


async def test_async_kickoffs(instrumented: list[str], serve: Serve) -> None:
    srv = serve(lambda body: "done")
    crew = _calculator_crew(srv, [])
    async with agl.rollout("async") as run:
        native = await crew.akickoff()  # native async: aexecute_task and acall all the way down
        threaded = await crew.kickoff_async()  # kickoff on a worker thread
    assert native.raw == "done" and threaded.raw == "done"
    assert [t.agent_name for t in run.trajectory().transitions] == ["Calculator", "Calculator"]
    assert len(_spans(run, "crewai.crew calc crew")) == 2 and len(_spans(run, "crewai.task multiply")) == 2
    for span in _llm_spans(run):
        assert span.attributes[semconv.AGL_PLUGIN] == "crewai" and span.parent_id is not None


def test_async_execution_task_on_its_own_thread(instrumented: list[str], serve: Serve) -> None:
    srv = serve(["Owls hunt at night.", "Owls are night hunters."])
    crew = _research_and_write(_llm(srv))
    crew.tasks[0].async_execution = True  # crewai runs it on a thread of its own
    with agl.rollout("owls-async") as run:
        assert crew.kickoff().raw == "Owls are night hunters."
    assert [t.agent_name for t in run.trajectory().transitions] == ["Researcher", "Writer"]
    research = _one(run, "crewai.task research")
    assert _one(run, "invoke_agent Researcher").parent_id == research.span_id


def test_max_execution_time_runs_the_agent_on_a_pool_thread(instrumented: list[str], serve: Serve) -> None:
    srv = serve(["Owls hunt at night.", "Owls are night hunters."])
    crew = _research_and_write(_llm(srv))
    for agent in crew.agents:
        agent.max_execution_time = 60  # crewai runs execute_task's body on a ThreadPoolExecutor
    with agl.rollout("owls-timeout") as run:
        assert crew.kickoff().raw == "Owls are night hunters."
    assert [t.agent_name for t in run.trajectory().transitions] == ["Researcher", "Writer"]
    writer = _one(run, "invoke_agent Writer")
    assert _llm_spans(run)[1].parent_id == writer.span_id


def test_concurrent_rollouts_keep_their_own_spans(instrumented: list[str], serve: Serve) -> None:
    import threading

    srv = serve(lambda body: "ok")
    runs: dict[str, Any] = {}

    def work(role: str) -> None:
        agent = Agent(role=role, goal="answer", backstory="b", llm=_llm(srv))
        crew = Crew(agents=[agent], tasks=[Task(description="Say ok.", expected_output="ok", agent=agent)])
        with agl.rollout(f"task-{role}") as run:
            crew.kickoff()
            crew.kickoff()
        runs[role] = run

    threads = [threading.Thread(target=work, args=(role,)) for role in ("Alpha", "Beta", "Gamma")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for role, run in runs.items():
        assert [t.agent_name for t in run.trajectory().transitions] == [role, role]
        roles = {s.attributes.get(semconv.GEN_AI_AGENT_NAME) for s in run.rollout.spans} - {None}
        assert roles == {role}


def test_streamed_llm(instrumented: list[str], serve: Serve) -> None:
    srv = serve([{"tool_calls": [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]}, "The answer is 42."])
    crew = _calculator_crew(srv, [multiply], stream=True, extra_body={"return_token_ids": True})
    with agl.rollout("stream") as run:
        assert crew.kickoff().raw == "The answer is 42."
    assert all(r.body["stream"] is True for r in srv.requests)
    traj = run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(tool_ok=1.0)))
    assert [t.response.get("tool_calls", [{}])[0].get("id") for t in traj.transitions] == ["call_1_0", None]
    assert traj.transitions[1].response["content"] == "The answer is 42."
    assert [t.token_source for t in traj.transitions] == ["response", "response"]
    assert traj.transitions[1].response_token_ids == tokenize("The answer is 42.")
    assert traj.transitions[0].reward == 1.0
    assert all(s.attributes[semconv.GEN_AI_REQUEST_STREAM] is True for s in _llm_spans(run))


def test_llm_failure_is_recorded_and_passes_through(instrumented: list[str], serve: Serve) -> None:
    srv = serve([{"status": 400, "error": "bad request"}])
    crew = _calculator_crew(srv, [])
    with pytest.raises(Exception) as caught, agl.rollout("broken") as run:
        crew.kickoff()
    assert "bad request" in str(caught.value)
    assert run.rollout.status == "failed"
    (span,) = _llm_spans(run)
    assert span.status == "error" and span.attributes[semconv.ERROR_TYPE] == "BadRequestError"
    traj = run.trajectory()
    assert traj.transitions == [] and "the call failed (BadRequestError)" in traj.skipped[0].reason
    assert _one(run, "invoke_agent Calculator").status == "error"


def test_llm_that_runs_its_tools_itself(instrumented: list[str], serve: Serve) -> None:
    """``available_functions``: the LLM runs the tool it asked for and returns the tool's result."""
    srv = serve([{"tool_calls": [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]}])
    schema = {"type": "function", "function": {"name": "multiply", "description": "Multiply two integers.",
                                               "parameters": {"type": "object", "properties": {
                                                   "a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    with agl.rollout("functions") as run:
        answer = _llm(srv).call("What is 6*7?", tools=[schema], available_functions={"multiply": lambda a, b: a * b})
    assert answer == "42"
    (transition,) = run.trajectory().transitions
    (call,) = transition.response["tool_calls"]
    assert call["function"]["name"] == "multiply" and json.loads(call["function"]["arguments"]) == {"a": 6, "b": 7}
    (tool_span,) = _tool_spans(run)
    (llm_span,) = _llm_spans(run)
    assert tool_span.parent_id == llm_span.span_id and tool_span.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == "42"


def test_crews_in_an_event_loop(instrumented: list[str], serve: Serve) -> None:
    """``kickoff`` called from a coroutine's thread: crewai runs it on a worker thread; spans still land."""
    srv = serve(lambda body: "fine")

    async def main() -> Any:
        async with agl.rollout("loop") as run:
            await asyncio.to_thread(_calculator_crew(srv, []).kickoff)
        return run

    run = asyncio.run(main())
    assert [t.agent_name for t in run.trajectory().transitions] == ["Calculator"]


def test_streamed_crew(instrumented: list[str], serve: Serve) -> None:
    """``Crew(stream=True)``: kickoff hands back a chunk stream and runs the crew on a thread as it is read."""
    srv = serve(lambda body: "hello there")
    crew = _calculator_crew(srv, [])
    crew.stream = True
    with agl.rollout("crew-stream") as run:
        streaming = crew.kickoff()
        chunks = list(streaming)
        assert streaming.result.raw == "hello there"
    assert chunks and all(r.body["stream"] is True for r in srv.requests)
    assert len(_spans(run, "crewai.crew calc crew")) == 1  # the inner, unstreamed kickoff's
    (transition,) = run.trajectory().transitions
    assert transition.agent_name == "Calculator" and transition.response["content"] == "hello there"


async def test_async_flow_with_an_agent(instrumented: list[str], serve: Serve) -> None:
    srv = serve(lambda body: "hello there")
    greeter = Agent(role="Greeter", goal="greet", backstory="b", llm=_llm(srv))

    class Greeting(Flow):  # type: ignore[type-arg]
        @start()
        async def greet(self) -> str:
            return str((await greeter.kickoff_async("Say hi.")).raw)

    async with agl.rollout("greet") as run:
        assert await Greeting().kickoff_async() == "hello there"
    flow, agent = _one(run, "crewai.flow Greeting"), _one(run, "invoke_agent Greeter")
    assert agent.parent_id == flow.span_id
    assert [t.agent_name for t in run.trajectory().transitions] == ["Greeter"]


def test_a_hook_aborting_a_tool_call_still_ends_its_span(instrumented: list[str], serve: Serve) -> None:
    """An after-tool-call hook that aborts the run between crewai's two tool events: the tool span still ends."""
    from crewai.hooks.dispatch import HookAborted
    from crewai.hooks.tool_hooks import register_after_tool_call_hook, unregister_after_tool_call_hook

    def veto(context: Any) -> None:
        raise HookAborted("not this result")

    srv = serve([{"tool_calls": [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]}, "The answer is 42."])
    crew = _calculator_crew(srv, [multiply])
    register_after_tool_call_hook(veto)
    try:
        with pytest.raises(HookAborted), agl.rollout("veto") as run:
            crew.kickoff()
    finally:
        unregister_after_tool_call_hook(veto)
    (call,) = _tool_spans(run)
    assert call.attributes[semconv.AGL_TOOL_STATUS] == "exception" and call.status == "error"
    assert call.attributes[semconv.ERROR_TYPE] == "HookAborted"
    assert call.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_1_0"
    assert run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(tool_exception=-1.0))).transitions[0].reward \
        == -1.0
