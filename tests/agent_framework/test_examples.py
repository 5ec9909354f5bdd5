"""``examples/agent_framework_agent``: the billing help desk (triage hands over to billing), against a fake server.

The real ``Agent``s, ``OpenAIChatCompletionClient``, ``HandoffBuilder`` and the
real lookup tool; only the model is scripted, found through ``OPENAI_BASE_URL``.
Checked: one transition per model call with each agent's name and the
server's token ids, the amount reward, and the AIR penalty for a lookup that
fails.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agl_core import semconv
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.agent_framework_agent import agent as desk  # noqa: E402

pytestmark = pytest.mark.usefixtures("instrumented")

HANDOFF = {"tool_calls": [{"name": "handoff_to_billing", "arguments": {}, "id": "h1"}]}
TASK = next(t for t in desk.TASKS if t["invoice"] == "INV-1003")


def lookup(invoice_id: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "lookup_invoice", "arguments": {"invoice_id": invoice_id}, "id": "l1"}]}


@pytest.fixture
def point(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeOpenAI]]:
    """``point(*replies)``: a fake vLLM-like server saying them (token ids always), where the env vars point."""
    servers: list[FakeOpenAI] = []

    def start(*replies: Any) -> FakeOpenAI:
        srv = FakeOpenAI(list(replies), return_token_ids=True).start()
        servers.append(srv)
        monkeypatch.setenv("OPENAI_BASE_URL", srv.url)
        monkeypatch.setenv("OPENAI_API_KEY", "not-a-key")
        return srv

    yield start
    for srv in servers:
        srv.stop()


def test_the_environment() -> None:
    assert len(desk.TASKS) == 8 and {t["invoice"] for t in desk.TASKS} <= set(desk.INVOICES)
    assert desk.lookup_invoice.func("inv-1003") == "INV-1003: Grace Hopper, due 2026-03-31, amount $1042.75"
    with pytest.raises(KeyError, match="no invoice"):
        desk.lookup_invoice.func("INV-9")
    assert desk.reward("It is $1,042.75.", "INV-1003") == desk.reward("1042.75", "INV-1003") == 1.0
    assert desk.reward("It is $1,042.00.", "INV-1003") == desk.reward("no idea", "INV-1003") == 0.0


def test_a_handoff_a_lookup_and_the_right_amount(point: Callable[..., FakeOpenAI]) -> None:
    srv = point(HANDOFF, lookup("INV-1003"), "Invoice INV-1003 is $1,042.75.")
    assert asyncio.run(desk.rollout(TASK)) == 1.0
    run = desk.rollout.last_run
    traj = run.trajectory()
    assert run.rollout.status == "succeeded" and traj.reward == 1.0 and traj.skipped == []
    assert [t.agent_name for t in traj.transitions] == ["triage", "billing", "billing"]
    handoff, call, answer = traj.transitions
    assert handoff.response["tool_calls"][0]["function"]["name"] == "handoff_to_billing"
    assert handoff.prompt == [{"role": "system", "content": desk.TRIAGE}, {"role": "user", "content": TASK["question"]}]
    assert call.prompt[0] == {"role": "system", "content": desk.BILLING}
    assert answer.prompt[-1]["role"] == "tool" and "amount $1042.75" in answer.prompt[-1]["content"]
    for t, request in zip(traj.transitions, srv.requests, strict=True):
        assert t.token_source == "response" and t.prompt_token_ids == tokenize(render_prompt(request.body["messages"]))
    assert [t.credited_reward for t in traj.transitions] == [1.0, 1.0, 1.0]
    tools = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert [(s.attributes[semconv.GEN_AI_TOOL_NAME], s.attributes[semconv.AGL_TOOL_STATUS]) for s in tools] == [
        ("handoff_to_billing", "ok"), ("lookup_invoice", "ok")]


def test_a_wrong_amount_and_a_failed_lookup(point: Callable[..., FakeOpenAI]) -> None:
    point(HANDOFF, lookup("INV-3001"), lookup("INV-1003"), "It is $1,000.")
    assert asyncio.run(desk.rollout(TASK)) == 0.0
    traj = desk.rollout.last_run.trajectory(builder=desk.BUILDER)
    assert [(t.agent_name, t.reward) for t in traj.transitions] == [
        ("triage", None), ("billing", desk.LOOKUP_ERROR_REWARD), ("billing", None), ("billing", None)]
    # the model is shown that the lookup failed, never the exception's text
    assert traj.transitions[2].prompt[-1]["content"] == "Error: Function failed."


def test_the_fake_policy_solves_the_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``python -m examples.agent_framework_agent.agent --fake`` runs."""
    with FakeOpenAI(desk.fake_policy, return_token_ids=True) as srv:
        monkeypatch.setenv("OPENAI_BASE_URL", srv.url)
        monkeypatch.setenv("OPENAI_API_KEY", "not-a-key")
        assert [asyncio.run(desk.rollout(task)) for task in desk.TASKS[:3]] == [1.0, 1.0, 1.0]
