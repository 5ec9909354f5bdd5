"""The OpenAI Agents SDK's own example programs, unchanged but for the model, against the fake model server.

``examples/agent_patterns/input_guardrails.py`` and ``output_guardrails.py``
(a tripped guardrail raises out of the run). Checked: the agent span of a
tripped guardrail fails with the exception's class as ``error.type``.
(``human_in_the_loop.py`` is in ``test_sdk_human_in_the_loop.py``.)
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from agents import (
    Agent,
    GuardrailFunctionOutput,
    InputGuardrailTripwireTriggered,
    OutputGuardrailTripwireTriggered,
    RunContextWrapper,
    Runner,
    input_guardrail,
    output_guardrail,
)
from pydantic import BaseModel

import agl_core as agl
from agl_core import semconv
from agl_core.schema import Span
from agl_core.testing import FakeOpenAI

pytestmark = pytest.mark.usefixtures("instrumented")


def run(agent: Agent[Any], text: Any, mode: str, **kwargs: Any) -> Any:
    """``Runner.run`` or ``Runner.run_streamed`` (its events consumed), as the examples call them."""
    async def go() -> Any:
        if mode == "run":
            return await Runner.run(agent, text, **kwargs)
        result = Runner.run_streamed(agent, text, **kwargs)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(go())


def agent_spans(rollout_run: agl.RolloutRun) -> dict[str, Span]:
    return {s.attributes[semconv.GEN_AI_AGENT_NAME]: s for s in rollout_run.rollout.spans
            if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_INVOKE_AGENT}


# --------------------------------------------------------------------------- guardrails (agent_patterns)


class MathHomeworkOutput(BaseModel):
    reasoning: str
    is_math_homework: bool


class MessageOutput(BaseModel):
    reasoning: str
    response: str
    user_name: str | None


def _by_instructions() -> Callable[[dict[str, Any]], str]:
    """The guardrail agent and the main agent run at once: answer each by its own instructions, the main agent
    once the guardrail had time to decide (a streamed run of an older SDK that finishes first never raises)."""
    guardrail_answered = threading.Event()

    def reply(body: dict[str, Any]) -> str:
        if "math homework" in json.dumps(body["messages"]):
            guardrail_answered.set()
            return json.dumps({"reasoning": "It asks to solve an equation.", "is_math_homework": True})
        if guardrail_answered.wait(5):
            time.sleep(0.5)
        return "I can help with that."

    return reply


@pytest.mark.parametrize("mode", ["run", "streamed"])
def test_a_tripped_input_guardrail_fails_the_agent_span_with_its_exception_class(
        mode: str, chat_model: Callable[..., Any]) -> None:
    with FakeOpenAI(script=_by_instructions()) as srv:
        guardrail_agent = Agent(name="Guardrail check",
                                instructions="Check if the user is asking you to do their math homework.",
                                output_type=MathHomeworkOutput, model=chat_model(srv))

        @input_guardrail
        async def math_guardrail(context: RunContextWrapper[None], agent: Agent[Any], input: Any,
                                 ) -> GuardrailFunctionOutput:
            result = await Runner.run(guardrail_agent, input, context=context.context)
            final_output = result.final_output_as(MathHomeworkOutput)
            return GuardrailFunctionOutput(output_info=final_output, tripwire_triggered=final_output.is_math_homework)

        agent = Agent(name="Customer support agent",
                      instructions="You are a customer support agent. You help customers with their questions.",
                      input_guardrails=[math_guardrail], model=chat_model(srv))
        with pytest.raises(InputGuardrailTripwireTriggered), agl.rollout(task_id="homework") as rollout_run:
            run(agent, "Can you help me solve for x: 2x + 3 = 11?", mode)
    spans = agent_spans(rollout_run)
    failed = spans["Customer support agent"]
    assert failed.status == "error"
    assert failed.attributes[semconv.ERROR_TYPE] == "InputGuardrailTripwireTriggered"
    assert spans["Guardrail check"].status != "error"  # the guardrail's own agent did its job


@pytest.mark.parametrize("mode", ["run", "streamed"])
def test_a_tripped_output_guardrail_fails_the_agent_span_with_its_exception_class(
        mode: str, chat_model: Callable[..., Any]) -> None:
    @output_guardrail
    async def sensitive_data_check(context: RunContextWrapper[None], agent: Agent[Any], output: MessageOutput,
                                   ) -> GuardrailFunctionOutput:
        phone_number_in_response = "650" in output.response
        phone_number_in_reasoning = "650" in output.reasoning
        return GuardrailFunctionOutput(
            output_info={"phone_number_in_response": phone_number_in_response,
                         "phone_number_in_reasoning": phone_number_in_reasoning},
            tripwire_triggered=phone_number_in_response or phone_number_in_reasoning)

    reply = json.dumps({"reasoning": "The user gave a number.", "response": "Your number is 650-123-4567.",
                        "user_name": None})
    with FakeOpenAI(script=[reply]) as srv:
        agent = Agent(name="Assistant", instructions="You are a helpful assistant.", output_type=MessageOutput,
                      output_guardrails=[sensitive_data_check], model=chat_model(srv))
        with pytest.raises(OutputGuardrailTripwireTriggered), agl.rollout(task_id="phone") as rollout_run:
            run(agent, "My phone number is 650-123-4567. Where do you think I live?", mode)
    failed = agent_spans(rollout_run)["Assistant"]
    assert failed.status == "error"
    assert failed.attributes[semconv.ERROR_TYPE] == "OutputGuardrailTripwireTriggered"
