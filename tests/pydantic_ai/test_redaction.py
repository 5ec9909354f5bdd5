"""Content capture switched off: no prompt, output, tool argument or result of a Pydantic AI agent reaches a span.

``agl.instrument(capture_content=False)`` and ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=false``
each keep them out of agl's records and out of what the user's own exporter sees, while token ids,
usage, names and timing stay, so the run still trains from token ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pydantic_ai import Agent

import agl_core as agl
from agl_core import encoding
from agl_core.testing import FakeOpenAI
from agl_core.testing.redaction import capturing_provider, check_captured, check_redacted, switch_off

from .fakes import chat_model

SECRET = "SECRET-7f3a"
SCRIPT = [{"tool_calls": [{"name": "lookup", "arguments": {"city": f"Paris {SECRET}"}, "id": "call_1"}]},
          f"It is sunny. {SECRET}"]
PLUGINS = ["openai", "pydantic_ai"]


def run_agent(srv: FakeOpenAI) -> tuple[Any, agl.RolloutRun]:
    weather: Agent[None, str] = Agent(chat_model(srv, "policy"), name="weather",
                                      instructions=f"Answer briefly. {SECRET}")

    @weather.tool_plain
    def lookup(city: str) -> str:
        """Weather in a city."""
        return f"sunny in {city}"

    with agl.rollout("private") as run:
        answer = weather.run_sync(f"weather in Paris? {SECRET}").output
        agl.emit_reward(1.0)
    return answer, run


@pytest.fixture
def capture(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A user SDK provider with an in-memory exporter; the capture setting is put back afterwards."""
    with capturing_provider(monkeypatch) as exporter:
        yield exporter


@pytest.mark.parametrize("how", ["argument", "env"])
def test_capture_off_redacts_every_span_and_keeps_token_ids(capture: Any, how: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    switch_off(how, PLUGINS, monkeypatch)
    with FakeOpenAI(script=SCRIPT, return_token_ids=True) as srv:
        answer, run = run_agent(srv)
    assert answer == f"It is sunny. {SECRET}"  # the agent is unaffected
    check_redacted(run, capture.get_finished_spans(), SECRET, tool="lookup", agent_name="weather")


def test_capture_on_by_default_records_content(capture: Any) -> None:
    """The control: without the switch the same run does carry the content (so the test above can fail)."""
    assert sorted(agl.instrument(PLUGINS)) == PLUGINS
    assert encoding.capture_content is True
    with FakeOpenAI(script=SCRIPT, return_token_ids=True) as srv:
        _, run = run_agent(srv)
    check_captured(run, capture.get_finished_spans(), SECRET)
