"""The OpenAI Agents SDK's ``examples/agent_patterns/human_in_the_loop.py``, unchanged but for the model, against the
fake model server: a tool that needs approval pauses the run, its state is saved to JSON and loaded, the call is
approved or rejected, and the run resumed.

Checked: the pause is a ``tool_pause`` span, not an outcome; one call id is one ``execute_tool`` span, the call's
outcome: ``ok`` with its result when approved (the tool ran once), ``rejected`` when not (it never ran); AIR
rewards that outcome once (``tool_ok`` for an approved call, ``tool_rejected`` for a rejected one).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import agents
import pytest

if not hasattr(agents, "RunState"):  # the bottom of the tested range (tests/openai_agents_legacy) predates it
    pytest.skip(f"openai-agents {agents.__version__} has no human in the loop (needs_approval, RunState)",
                allow_module_level=True)

from agents import Agent, Runner, RunState, ToolApprovalItem, function_tool  # noqa: E402

import agl_core as agl  # noqa: E402
from agl_core import semconv  # noqa: E402
from agl_core.schema import Span  # noqa: E402
from agl_core.testing import FakeOpenAI  # noqa: E402

pytestmark = pytest.mark.usefixtures("instrumented")


async def run_async(agent: Agent[Any], text: Any, mode: str) -> Any:
    """``Runner.run`` or ``Runner.run_streamed`` (its events consumed), as the example calls them."""
    if mode == "run":
        return await Runner.run(agent, text)
    result = Runner.run_streamed(agent, text)
    async for _ in result.stream_events():
        pass
    return result


ran: list[str] = []  # the cities get_temperature really ran for


@function_tool
async def get_weather(city: str) -> str:
    """Get the weather for a given city.

    Args:
        city: The city to get weather for.

    Returns:
        Weather information for the city.
    """
    return f"The weather in {city} is sunny"


async def _needs_temperature_approval(_ctx: Any, params: dict[str, Any], _call_id: str) -> bool:
    """Check if temperature tool needs approval."""
    return "Oakland" in params.get("city", "")


@function_tool(needs_approval=_needs_temperature_approval)
async def get_temperature(city: str) -> str:
    """Get the temperature for a given city.

    Args:
        city: The city to get temperature for.

    Returns:
        Temperature information for the city.
    """
    ran.append(city)
    return f"The temperature in {city} is 20° Celsius"


WEATHER_SCRIPT: list[Any] = [
    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oakland"}, "id": "call_weather"},
                    {"name": "get_temperature", "arguments": {"city": "Oakland"}, "id": "call_temp"}]},
    "It is sunny in Oakland.",
]


async def _human_in_the_loop(agent: Agent[Any], confirmed: bool, mode: str, tmp_path: Any) -> Any:
    """The example's ``main()``: run, and while interrupted save the state, load it, decide, resume."""
    result = await run_async(agent, "What is the weather and temperature in Oakland?", mode)
    pauses = 0
    while result.interruptions:
        pauses += 1
        saved = tmp_path / "result.json"
        saved.write_text(json.dumps(result.to_state().to_json(), indent=2))
        state = await RunState.from_json(agent, json.loads(saved.read_text()))
        for interruption in result.interruptions:
            if not isinstance(interruption, ToolApprovalItem):
                continue
            if confirmed:
                state.approve(interruption)
            else:
                state.reject(interruption)
        result = await run_async(agent, state, mode)
    assert pauses == 1
    return result


def tool_spans(rollout_run: agl.RolloutRun, operation: str) -> list[Span]:
    return [s for s in rollout_run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == operation]


@pytest.mark.parametrize("mode", ["run", "streamed"])
@pytest.mark.parametrize("confirmed", [True, False], ids=["approved", "rejected"])
def test_a_call_that_waits_for_approval_has_one_outcome(mode: str, confirmed: bool, tmp_path: Any,
                                                        chat_model: Callable[..., Any]) -> None:
    ran.clear()
    with FakeOpenAI(script=WEATHER_SCRIPT) as srv:
        agent = Agent(name="Weather Assistant",
                      instructions=("You are a helpful weather assistant. "
                                    "Answer questions about weather and temperature using the available tools."),
                      tools=[get_weather, get_temperature], model=chat_model(srv))
        with agl.rollout(task_id="weather") as rollout_run:
            result = asyncio.run(_human_in_the_loop(agent, confirmed, mode, tmp_path))
    assert result.final_output == "It is sunny in Oakland."
    assert ran == (["Oakland"] if confirmed else [])

    # the pause is a span of its own kind, never an execute_tool span or an outcome
    (pause,) = tool_spans(rollout_run, semconv.OP_TOOL_PAUSE)
    assert pause.name == "tool_pause get_temperature"
    assert pause.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_temp"
    assert pause.attributes[semconv.AGL_TOOL_STATUS] == semconv.TOOL_PENDING and pause.status != "error"
    # one call id, one execute_tool span: the call's outcome
    by_id: dict[str, list[Span]] = {}
    for span in tool_spans(rollout_run, semconv.OP_EXECUTE_TOOL):
        by_id.setdefault(span.attributes[semconv.GEN_AI_TOOL_CALL_ID], []).append(span)
    assert sorted(by_id) == ["call_temp", "call_weather"] and all(len(v) == 1 for v in by_id.values())
    (temp,) = by_id["call_temp"]
    assert temp.attributes[semconv.GEN_AI_TOOL_NAME] == "get_temperature"
    assert temp.attributes[semconv.GEN_AI_AGENT_NAME] == "Weather Assistant"
    if confirmed:
        assert temp.attributes[semconv.AGL_TOOL_STATUS] == semconv.TOOL_OK
        assert temp.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == "The temperature in Oakland is 20° Celsius"
    else:
        assert temp.attributes[semconv.AGL_TOOL_STATUS] == semconv.TOOL_REJECTED
        assert temp.status == "error" and temp.attributes[semconv.ERROR_TYPE] == "rejected"
        assert semconv.GEN_AI_TOOL_CALL_RESULT not in temp.attributes

    # AIR: the call that asked for both tools earns get_weather's 0.1, plus 0.1 for get_temperature if it ran
    traj = rollout_run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(tool_ok=0.1)))
    assert [t.reward for t in traj.transitions] == ([pytest.approx(0.2), None] if confirmed else [0.1, None])
    if not confirmed:
        traj = rollout_run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(tool_ok=0.1, tool_rejected=-1)))
        assert [t.reward for t in traj.transitions] == [pytest.approx(-0.9), None]
