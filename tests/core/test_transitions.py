"""Spans -> transitions, on span records as a store would hold them."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from agl_core import credit, semconv
from agl_core.errors import SchemaError
from agl_core.messages import many_to_genai, to_genai
from agl_core.schema import Rollout, Span
from agl_core.transitions import AirRules, TransitionBuilder

_ids = itertools.count(1)
_clock = itertools.count(1000, 10)


def span(name: str, parent: Span | None = None, status: str = "unset", **attrs: Any) -> Span:
    start = next(_clock)
    return Span(span_id=f"{next(_ids):016x}", trace_id="ab" * 16, name=name,
                parent_id=parent.span_id if parent else None, start_ns=start, end_ns=start + 5,
                attributes=attrs, status=status)  # type: ignore[arg-type]


def agent(name: str, parent: Span | None = None) -> Span:
    return span(semconv.agent_span_name(name), parent, **{semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT,
                                                          semconv.GEN_AI_AGENT_NAME: name})


def llm(parent: Span | None, prompt: str, answer: Any, *, ids: bool = False, source: str = "response",
        plugin: str = "openai", tools: list[dict[str, Any]] | None = None, finish: str = "stop") -> Span:
    out = answer if isinstance(answer, dict) else {"role": "assistant", "content": answer}
    attrs: dict[str, Any] = {
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT, semconv.GEN_AI_REQUEST_MODEL: "m",
        semconv.GEN_AI_INPUT_MESSAGES: json.dumps(many_to_genai([{"role": "user", "content": prompt}])),
        semconv.GEN_AI_OUTPUT_MESSAGES: json.dumps([to_genai(out, finish_reason=finish)]),
        semconv.AGL_PLUGIN: plugin,
    }
    if tools is not None:
        attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = json.dumps(tools)
    if ids:
        attrs.update({semconv.AGL_PROMPT_TOKEN_IDS: [1, 2], semconv.AGL_RESPONSE_TOKEN_IDS: [3, 4],
                      semconv.AGL_RESPONSE_LOGPROBS: [-0.1, -0.2], semconv.AGL_TOKEN_SOURCE: source})
    return span("chat m", parent, **attrs)


def tool(parent: Span | None, name: str, call_id: str | None = None, status: str = "unset", **attrs: Any) -> Span:
    a = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL, semconv.GEN_AI_TOOL_NAME: name, **attrs}
    if call_id:
        a[semconv.GEN_AI_TOOL_CALL_ID] = call_id
    return span(semconv.tool_span_name(name), parent, status, **a)


def reward(value: float, name: str | None = None) -> Span:
    attrs: dict[str, Any] = {semconv.AGL_SPAN_KIND: semconv.KIND_REWARD, semconv.AGL_REWARD_VALUE: value}
    if name:
        attrs[semconv.AGL_REWARD_NAME] = name
    return span("agl.reward", None, **attrs)


def rollout(*spans: Span) -> Rollout:
    return Rollout(id="r1", task_id="t1", spans=list(spans), status="succeeded")


def calc_call(call_id: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "calc", "arguments": '{"x":1}'}}]}


def test_one_transition_per_call_in_order_with_messages_and_ids() -> None:
    root = agent("solver")
    a = llm(root, "2+2?", calc_call("c1"), ids=True)
    t = tool(root, "calc", "c1")
    b = llm(root, "result 4", "4")
    traj = TransitionBuilder().build(rollout(root, a, t, b, reward(1.0)))
    assert [x.index for x in traj.transitions] == [0, 1]
    first, second = traj.transitions
    assert first.prompt == [{"role": "user", "content": "2+2?"}]
    assert first.response["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"x":1}'}
    assert first.prompt_token_ids == [1, 2] and first.response_token_ids == [3, 4]
    assert first.response_logprobs == [-0.1, -0.2] and first.token_source == "response"
    assert second.response == {"role": "assistant", "content": "4"} and second.token_source is None
    assert first.agent_name == "solver" and first.finish_reason == "stop" and first.span_id == a.span_id
    assert traj.reward == 1.0 and [x.credited_reward for x in traj.transitions] == [1.0, 1.0]
    assert traj.skipped == []


def test_nested_llm_spans_merge_into_one_transition() -> None:
    root = agent("writer")
    outer = llm(root, "q", "a", plugin="langchain")  # e.g. ChatOpenAI
    inner = llm(outer, "q", "a", ids=True, source="response", plugin="openai")  # the openai client call inside it
    inner.attributes[semconv.GEN_AI_AGENT_NAME] = "not-this-one"
    traj = TransitionBuilder().build(rollout(root, outer, inner))
    assert len(traj.transitions) == 1
    t = traj.transitions[0]
    assert t.span_id == outer.span_id and t.agent_name == "writer"
    assert t.response_token_ids == [3, 4]


def test_best_token_source_wins() -> None:
    outer = llm(None, "q", "a", ids=True, source="retokenized")
    inner = llm(outer, "q", "a", ids=True, source="gateway")
    inner.attributes[semconv.AGL_PROMPT_TOKEN_IDS] = [9]
    (t,) = TransitionBuilder().build(rollout(outer, inner)).transitions
    assert t.token_source == "gateway" and t.prompt_token_ids == [9]


def test_agent_match_is_searched_in_the_name_and_reports_the_rest() -> None:
    calls = []
    spans: list[Span] = []
    for name in ["writer", "checker", "rewriter"]:
        a = agent(name)
        c = llm(a, f"{name} prompt", f"{name} answer")
        spans += [a, c]
        calls.append(c)
    b = TransitionBuilder(agent_match="writer|rewriter")
    traj = b.build(rollout(*spans, reward(1.0)))
    assert [t.agent_name for t in traj.transitions] == ["writer", "rewriter"]
    assert [t.index for t in traj.transitions] == [0, 1]
    assert [s.span_id for s in traj.skipped] == [calls[1].span_id]
    assert "checker" in traj.skipped[0].reason and traj.skipped[0].agent_name == "checker"
    # Agent Lightning's semantics, which ported configs bring: a search, so "writer" is in "rewriter" too
    searched = TransitionBuilder(agent_match="writer").build(rollout(*spans))
    assert [t.agent_name for t in searched.transitions] == ["writer", "rewriter"]
    only = TransitionBuilder(agent_match="^writer$").build(rollout(*spans))
    assert [t.agent_name for t in only.transitions] == ["writer"]


def test_agent_match_write_selects_write_query_and_rewrite_query() -> None:
    spans: list[Span] = []
    for name in ["write_query", "check_query", "rewrite_query"]:
        a = agent(name)
        spans += [a, llm(a, f"{name} prompt", f"{name} answer")]
    traj = TransitionBuilder(agent_match="write").build(rollout(*spans, reward(1.0)))
    assert [t.agent_name for t in traj.transitions] == ["write_query", "rewrite_query"]
    assert [(s.agent_name, s.reason) for s in traj.skipped] == [
        ("check_query", "agent 'check_query' does not match agent_match 'write'")]


def test_failed_and_empty_calls_are_reported_not_dropped() -> None:
    ok = llm(None, "q", "a")
    failed = span("chat m", None, "error", **{semconv.GEN_AI_OPERATION_NAME: "chat",
                                             semconv.ERROR_TYPE: "APIConnectionError"})
    empty = span("chat m", None, **{semconv.GEN_AI_OPERATION_NAME: "chat"})
    garbled = span("chat m", None, **{semconv.GEN_AI_OPERATION_NAME: "chat", semconv.GEN_AI_OUTPUT_MESSAGES: "{x"})
    traj = TransitionBuilder().build(rollout(ok, failed, empty, garbled))
    assert len(traj.transitions) == 1
    reasons = {s.span_id: s.reason for s in traj.skipped}
    assert "APIConnectionError" in reasons[failed.span_id]
    assert "no response recorded" in reasons[empty.span_id]
    assert "unreadable" in reasons[garbled.span_id]


def test_intermediate_rewards_attach_to_the_call_they_follow_and_count() -> None:
    a = llm(None, "q1", "a1")
    r1 = reward(0.5, "tool_ok")
    b = llm(None, "q2", "a2")
    r2 = reward(0.25, "step")
    r3 = reward(0.25, "step")
    final = reward(1.0)
    spans = [a, r1, b, r2, r3, final]
    traj = TransitionBuilder().build(rollout(*spans))
    assert [t.reward for t in traj.transitions] == [0.5, 0.5]
    assert [t.credited_reward for t in traj.transitions] == [2.0, 2.0]  # the return counts them all
    disc = TransitionBuilder(credit="discounted", gamma=0.5).build(rollout(*spans))
    assert [t.credited_reward for t in disc.transitions] == [0.5 + 0.5 * 1.5, 1.5]


def test_air_rules_turn_tool_outcomes_into_rewards_on_the_calling_llm() -> None:
    a = llm(None, "q", calc_call("c1"))
    b = llm(None, "q2", calc_call("c2"))
    t_exc = tool(None, "calc", "c1", "error", **{semconv.ERROR_TYPE: "ZeroDivisionError"})
    t_err = tool(None, "calc", "c2", **{semconv.AGL_TOOL_STATUS: "error"})
    t_timeout = tool(None, "calc", None, "error", **{semconv.ERROR_TYPE: "TimeoutError"})
    c = llm(None, "q3", "done")
    air = AirRules(tool_exception=-1.0, tool_error=-0.5, tool_timeout=-0.25)
    # the c1 tool span runs after b started: it still charges a, the call that asked for it
    traj = TransitionBuilder(air=air).build(rollout(a, b, t_exc, t_err, t_timeout, c))
    assert [t.reward for t in traj.transitions] == [-1.0, -0.75, None]
    assert TransitionBuilder().build(rollout(a, b, t_exc, c)).transitions[0].reward is None  # rules are opt-in


def test_malformed_tool_calls_are_penalised() -> None:
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    bad_json = {"role": "assistant", "content": None,
                "tool_calls": [{"id": "x", "type": "function", "function": {"name": "calc", "arguments": "{oops"}}]}
    unknown = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "y", "type": "function", "function": {"name": "nope", "arguments": "{}"}}]}
    spans = [llm(None, "a", bad_json, tools=tools), llm(None, "b", unknown, tools=tools),
             llm(None, "c", calc_call("z"), tools=tools)]
    traj = TransitionBuilder(air=AirRules(malformed_tool_call=-1.0)).build(rollout(*spans))
    assert [t.reward for t in traj.transitions] == [-1.0, -1.0, None]


def test_custom_air_rule_and_credit_function() -> None:
    a = llm(None, "q", calc_call("c1"))
    t = tool(None, "calc", "c1", **{semconv.AGL_TOOL_CACHE_HIT: True})
    air = AirRules(custom=lambda s: 0.1 if s.attributes.get(semconv.AGL_TOOL_CACHE_HIT) else None)
    builder = TransitionBuilder(air=air, credit=lambda rs, final: [42.0 for _ in rs])
    (tr,) = builder.build(rollout(a, t)).transitions
    assert tr.reward == 0.1 and tr.credited_reward == 42.0


def test_no_rewards_means_no_credit() -> None:
    traj = TransitionBuilder().build(rollout(llm(None, "q", "a")))
    assert traj.reward is None and traj.transitions[0].credited_reward is None


def test_builder_rejects_bad_settings_by_name() -> None:
    with pytest.raises(SchemaError, match="agent_match"):
        TransitionBuilder(agent_match="(")
    with pytest.raises(SchemaError, match="credit"):
        TransitionBuilder(credit="sometimes")  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match="credit"):
        credit.assign([1.0], None, lambda rs, f: [])
    with pytest.raises(SchemaError, match="gamma"):
        credit.assign([1.0], None, "discounted", gamma=2.0)


def test_text_comes_from_the_span_whose_token_ids_are_used() -> None:
    """A framework span may cut the reply (crewai stops at stop words client-side): text and ids must match."""
    outer = llm(None, "q", "The answer", plugin="crewai")
    inner = llm(outer, "q", "The answer is 4. Observation:", ids=True, plugin="openai")
    (t,) = TransitionBuilder().build(rollout(outer, inner)).transitions
    assert t.response["content"] == "The answer is 4. Observation:" and t.span_id == outer.span_id


def test_tool_message_keeps_its_name() -> None:
    from agl_core.messages import from_genai, to_genai

    msg = {"role": "tool", "tool_call_id": "c1", "name": "calc", "content": "4"}
    assert from_genai(to_genai(msg)) == msg


def _broken(s: Span) -> Span:
    """``s`` as a request that broke after part of its answer arrived (the openai plugin keeps that text)."""
    s.status = "error"  # type: ignore[assignment]
    s.attributes[semconv.ERROR_TYPE] = "APIConnectionError"
    return s


def test_a_failed_call_with_partial_text_is_skipped_not_trained_on() -> None:
    root = agent("solver")
    cut = _broken(llm(root, "2+2?", "Hel", ids=True))
    traj = TransitionBuilder().build(rollout(root, cut, reward(1.0)))
    assert traj.transitions == []
    assert [s.reason for s in traj.skipped] == ["the call failed (APIConnectionError): no response to train on"]


def test_a_retry_that_succeeded_under_one_framework_span_is_the_call_and_not_its_broken_first_try() -> None:
    root = agent("solver")
    outer = llm(root, "2+2?", "4", plugin="langchain")
    del outer.attributes[semconv.GEN_AI_OUTPUT_MESSAGES]  # the framework recorded no reply of its own
    first = _broken(llm(outer, "2+2?", "Hel", ids=True, source="gateway"))
    second = llm(outer, "2+2?", "4", ids=True)
    traj = TransitionBuilder().build(rollout(root, outer, first, second, reward(1.0)))
    (t,) = traj.transitions
    assert t.response["content"] == "4" and t.span_id == outer.span_id and t.token_source == "response"


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "calc", "arguments": {"x": 1</tool_call>',         # JSON that does not parse
    'Sure. <tool_call>{"name": "calc", "arguments": {"x": ',                 # cut off by max_tokens: never closed
    '<tool_call>["calc", {"x": 1}]</tool_call>',                               # JSON that is not a call
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',               # a function the request did not offer
    '<tool_call>{"name": "calc", "arguments": "x=1"}</tool_call>',            # arguments that are not an object
])
def test_a_tool_call_block_left_in_the_text_is_a_malformed_call(text: str) -> None:
    # what a serving engine's tool parser (agl's torch engine, vLLM's hermes) leaves in the content when the
    # model tried to call a tool and the block is not a valid call; before, only parsed tool_calls were checked
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    spans = [llm(None, "q", text, tools=tools), llm(None, "q2", [{"type": "text", "text": text}], tools=tools)]
    traj = TransitionBuilder(air=AirRules(malformed_tool_call=-0.5)).build(rollout(*spans))
    assert [t.reward for t in traj.transitions] == [-0.5, -0.5]


def test_a_reply_cut_off_by_max_tokens_earns_the_truncated_reward_once() -> None:
    # a plain reply that ran on until max_tokens cut it ended its run with no answer: without a rule of its own it
    # cost nothing (where a wrong tool call costs malformed_tool_call), so RL learned to ramble
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    spans = [llm(None, "q1", "the answer is the answer is the", tools=tools, finish="length"),
             llm(None, "q2", 'Sure. <tool_call>{"name": "calc", "argu', tools=tools, finish="length"),  # cut call
             llm(None, "q3", "the answer is", tools=tools, finish="max_tokens"),  # Anthropic's word for it
             llm(None, "q4", "the answer is 4", tools=tools),
             llm(None, "q5", '<tool_call>{"name": "calc", "arguments": {"x": 1</tool_call>', tools=tools)]
    traj = TransitionBuilder(air=AirRules(malformed_tool_call=-0.5, truncated=-0.4)).build(rollout(*spans))
    assert [t.reward for t in traj.transitions] == [-0.4, -0.4, -0.4, None, -0.5]  # once: never -0.9
    assert [t.finish_reason for t in traj.transitions] == ["length", "length", "max_tokens", "stop", "stop"]
    off = TransitionBuilder(air=AirRules(malformed_tool_call=-0.5)).build(rollout(*spans))
    assert [t.reward for t in off.transitions] == [None, -0.5, None, None, -0.5]  # the rule is opt-in
    settings = TransitionBuilder(air=AirRules(truncated=-0.4)).settings()
    assert TransitionBuilder.from_settings(settings).air.truncated == -0.4


def test_valid_or_absent_tool_call_blocks_in_the_text_are_not_penalised() -> None:
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    # a valid block left in the text is the backend's doing (it ran no tool parser), not the model's
    valid = '<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>'
    spans = [llm(None, "q", valid, tools=tools), llm(None, "q2", "the answer is 4", tools=tools)]
    traj = TransitionBuilder(air=AirRules(malformed_tool_call=-0.5)).build(rollout(*spans))
    assert [t.reward for t in traj.transitions] == [None, None]


def test_a_frameworks_own_span_of_a_tool_call_an_agl_plugin_recorded_counts_once_for_air() -> None:
    # Pydantic AI's instrumentation makes an execute_tool span of its own beside agl's plugin's, same call id
    a = llm(None, "q", calc_call("c1"), plugin="pydantic_ai")
    ours = tool(None, "calc", "c1", "error", **{semconv.AGL_TOOL_STATUS: "error", semconv.AGL_PLUGIN: "pydantic_ai"})
    theirs = tool(ours, "calc", "c1", "error", **{semconv.ERROR_TYPE: "ToolRetryError"})
    unrecorded = tool(None, "calc", "c9", "error", **{semconv.ERROR_TYPE: "ValueError"})  # agl saw no span of it
    b = llm(None, "q2", "done", plugin="pydantic_ai")
    air = AirRules(tool_error=-0.5, tool_exception=-1.0)
    traj = TransitionBuilder(air=air).build(rollout(a, ours, theirs, b))
    assert [t.reward for t in traj.transitions] == [-0.5, None]
    traj = TransitionBuilder(air=air).build(rollout(a, theirs, unrecorded, b))  # no agl span: theirs count
    assert [t.reward for t in traj.transitions] == [-2.0, None]


def test_one_call_id_is_one_outcome_the_last_run_of_it() -> None:
    # a graph resumed after an interrupt() runs the tool again under the same call id: only that run is told
    a = llm(None, "q", calc_call("c1"), plugin="langchain")
    first = tool(None, "calc", "c1", "error", **{semconv.AGL_TOOL_STATUS: "exception", semconv.AGL_PLUGIN: "langchain"})
    again = tool(None, "calc", "c1", **{semconv.AGL_TOOL_STATUS: "ok", semconv.AGL_PLUGIN: "langchain"})
    b = llm(None, "q2", "done", plugin="langchain")
    air = AirRules(tool_ok=0.1, tool_exception=-1.0)
    traj = TransitionBuilder(air=air).build(rollout(a, first, again, b))
    assert [t.reward for t in traj.transitions] == [0.1, None]


def test_an_id_used_again_by_a_later_reply_is_a_new_call_with_its_own_outcome() -> None:
    # servers that number calls per reply reuse "call_0": a failed call, the model asked again, the same id ok
    a = llm(None, "q", calc_call("call_0"), plugin="langchain")
    failed = tool(None, "calc", "call_0", "error", **{semconv.AGL_TOOL_STATUS: "exception",
                                                      semconv.AGL_PLUGIN: "langchain"})
    b = llm(None, "q2", calc_call("call_0"), plugin="langchain")
    ok = tool(None, "calc", "call_0", **{semconv.AGL_TOOL_STATUS: "ok", semconv.AGL_PLUGIN: "langchain"})
    c = llm(None, "q3", "done", plugin="langchain")
    traj = TransitionBuilder(air=AirRules(tool_ok=0.1, tool_exception=-1.0)).build(rollout(a, failed, b, ok, c))
    assert [t.reward for t in traj.transitions] == [-1.0, 0.1, None]


def test_a_rejected_call_is_its_own_outcome_and_a_pause_is_none() -> None:
    a = llm(None, "q", calc_call("c1"), plugin="openai_agents")
    pause = span(semconv.tool_pause_span_name("calc"), **{
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_TOOL_PAUSE, semconv.GEN_AI_TOOL_CALL_ID: "c1",
        semconv.AGL_TOOL_STATUS: semconv.TOOL_PENDING, semconv.AGL_PLUGIN: "openai_agents"})
    rejected = tool(None, "calc", "c1", "error", **{
        semconv.AGL_TOOL_STATUS: semconv.TOOL_REJECTED, semconv.ERROR_TYPE: "rejected",
        semconv.AGL_PLUGIN: "openai_agents"})
    b = llm(None, "q2", "done", plugin="openai_agents")
    everything = AirRules(tool_ok=0.1, tool_error=-0.5, tool_exception=-1.0)
    assert [t.reward for t in TransitionBuilder(air=everything).build(rollout(a, pause, b)).transitions] == [None, None]
    traj = TransitionBuilder(air=everything).build(rollout(a, pause, rejected, b))
    assert [t.reward for t in traj.transitions] == [None, None]  # not ok, not an error of the tool's
    traj = TransitionBuilder(air=AirRules(tool_ok=0.1, tool_rejected=-0.3)).build(rollout(a, pause, rejected, b))
    assert [t.reward for t in traj.transitions] == [-0.3, None]


def test_a_frameworks_own_chat_span_around_agls_lends_no_messages() -> None:
    # Pydantic AI's instrumentation wraps the model call in a chat span whose input lacks the instructions
    root = agent("weather")
    theirs = llm(root, "q", "a", plugin="")
    del theirs.attributes[semconv.AGL_PLUGIN]
    ours = llm(theirs, "q", "a")
    ours.attributes[semconv.GEN_AI_INPUT_MESSAGES] = json.dumps(many_to_genai(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}]))
    (t,) = TransitionBuilder().build(rollout(root, theirs, ours)).transitions
    assert t.span_id == theirs.span_id and t.agent_name == "weather"  # the request is still the outer span's
    assert t.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}]


@pytest.mark.parametrize("msg", [
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "18C"}]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "ok"}],
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "system", "content": "plain"},
])
def test_content_comes_back_as_sent(msg: dict[str, object]) -> None:
    """A list of parts stays a list (never its JSON text), a string stays a string, in every role."""
    from agl_core.messages import from_genai, to_genai

    assert from_genai(json.loads(json.dumps(to_genai(msg)))) == msg


def _in_trace(s: Span, trace: str, start: int, end: int, **attrs: Any) -> Span:
    s.trace_id, s.start_ns, s.end_ns = trace * 16, start, end
    s.attributes.update(attrs)
    return s


def test_best_of_n_calls_answered_alike_in_traces_of_their_own_stay_two_transitions() -> None:
    """Two requests one instrumentation recorded (threads with no context: each call a root of its own trace),
    the second inside the first's time with the same prompt and reply: two samples, both trained."""
    first = _in_trace(llm(None, "say one", "A", ids=True), "c1", 100, 400)
    second = _in_trace(llm(None, "say one", "A", ids=True), "c2", 150, 300)
    traj = TransitionBuilder().build(rollout(first, second, reward(1.0)))
    assert [t.span_id for t in traj.transitions] == [first.span_id, second.span_id]
    scoped = [_in_trace(llm(None, "say one", "A"), "d1", 100, 400, **{semconv.OTEL_SCOPE_NAME: "oi.openai"}),
              _in_trace(llm(None, "say one", "A"), "d2", 150, 300, **{semconv.OTEL_SCOPE_NAME: "oi.openai"})]
    assert len(TransitionBuilder().build(rollout(*scoped, reward(1.0))).transitions) == 2


def test_a_request_whose_messages_are_on_a_nested_span_still_joins_its_record_from_another_trace() -> None:
    """A framework chat span leaves the messages to agl's span of the HTTP request nested in it: the call
    matches another instrumentation's record of the same request (a trace of its own) by the messages of
    the call, wherever in it they are, not by its outermost span alone."""
    outer = _in_trace(llm(None, "say one", "A", plugin="pydantic_ai"), "f1", 100, 400)
    for key in (semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES):
        del outer.attributes[key]
    inner = _in_trace(llm(outer, "say one", "A"), "f1", 110, 390)
    other = _in_trace(llm(None, "say one", "A", ids=True), "f2", 150, 300, **{semconv.OTEL_SCOPE_NAME: "oi.openai"})
    del other.attributes[semconv.AGL_PLUGIN]
    (t,) = TransitionBuilder().build(rollout(outer, inner, other, reward(1.0))).transitions
    assert t.span_id == outer.span_id and t.response_token_ids == [3, 4]


def test_one_request_two_instrumentations_recorded_in_traces_of_their_own_is_one_transition() -> None:
    """OpenInference's LangChain and OpenAI instrumentors share no context: the request is two roots."""
    outer = _in_trace(llm(None, "say one", "A"), "e1", 100, 400, **{semconv.OTEL_SCOPE_NAME: "oi.langchain"})
    inner = _in_trace(llm(None, "say one", "A", ids=True), "e2", 150, 300, **{semconv.OTEL_SCOPE_NAME: "oi.openai"})
    for s in (outer, inner):
        del s.attributes[semconv.AGL_PLUGIN]
    (t,) = TransitionBuilder().build(rollout(outer, inner, reward(1.0))).transitions
    assert t.response_token_ids == [3, 4]  # the inner span's ids, on the outer call
