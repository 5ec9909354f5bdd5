"""``examples/spider_agent`` (Agent Lightning's spider agent, ported): the real LangGraph graph and ``ChatOpenAI``,
a scripted fake policy where ``OPENAI_BASE_URL`` points (as agl's gateway would be) and a frozen checker on a fake
server of its own (``SPIDER_CHECKER_BASE_URL``). Checked: ``agent_match="write"`` trains ``write_query`` and
``rewrite_query``, the checker's calls never reach the policy's server nor a transition, and the ``air.custom``
rule reads the tool's ``Error: ...`` result (its span's status is ok).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import agl_core as agl
from agl_core import guard, semconv
from agl_core.instrumentation import Instrumented
from agl_core.testing import FakeOpenAI

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.spider_agent import agent as spider  # noqa: E402
from examples.spider_agent.database import TASKS  # noqa: E402

TASK = next(t for t in TASKS if t["id"] == "spider-02")  # the singers from France: Lea Moreau
GOLD = f"```sql\n{TASK['query']}\n```"
BROKEN = "```sql\nSELECT singer_name FROM singer\n```"


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeOpenAI, FakeOpenAI]]:
    policy = FakeOpenAI([BROKEN, GOLD], return_token_ids=True).start()
    checker = FakeOpenAI([f"No column singer_name.\n{spider.INCORRECT}.", f"{spider.CORRECT}."],
                         model="frozen-checker").start()
    monkeypatch.setenv("OPENAI_BASE_URL", policy.url)
    monkeypatch.setenv("OPENAI_API_KEY", "policy-key")
    monkeypatch.setenv("SPIDER_CHECKER_BASE_URL", checker.url)
    monkeypatch.setenv("SPIDER_CHECKER_MODEL", "frozen-checker")
    yield policy, checker
    policy.stop()
    checker.stop()
    spider._graphs.clear()


def test_write_and_rewrite_are_trained_and_the_frozen_checker_only_traced(
        with_openai: Instrumented, servers: tuple[FakeOpenAI, FakeOpenAI]) -> None:
    policy, checker = servers
    assert spider.rollout(TASK) == 1.0
    run = spider.rollout.last_run
    traj = run.trajectory()  # the example's own builder: agent_match "write", air.custom query_failed
    assert [t.agent_name for t in traj.transitions] == ["write_query", "rewrite_query"]
    assert [t.response["content"] for t in traj.transitions] == [BROKEN, GOLD]
    assert [t.reward for t in traj.transitions] == [spider.SQL_ERROR_REWARD, None]  # the tool said "Error: ..."
    assert [s.reason for s in traj.skipped] == ["agent 'check_query' does not match agent_match 'write'"] * 2
    assert {t.token_source for t in traj.transitions} == {"response"}

    # every checker call went to its own server, every policy call to the policy's
    assert [r.body["model"] for r in checker.requests] == ["frozen-checker"] * 2
    assert [r.body["model"] for r in policy.requests] == ["policy"] * 2
    assert all("careful SQL reviewer" not in str(r.body["messages"]) for r in policy.requests)
    every = run.trajectory(builder=agl.TransitionBuilder())
    assert [(t.agent_name, t.model) for t in every.transitions] == [
        ("write_query", "policy"), ("check_query", "frozen-checker"), ("rewrite_query", "policy"),
        ("check_query", "frozen-checker")]
    tools = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert [s.attributes[semconv.AGL_TOOL_STATUS] for s in tools] == ["ok", "ok"]  # failure as text, as Spider's tool
    assert str(tools[0].attributes[semconv.GEN_AI_TOOL_CALL_RESULT]).startswith("Error: (OperationalError)")
    assert guard.fault_counts() == {}


def test_without_its_own_url_the_checker_asks_the_policy_untrained(with_openai: Instrumented,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Agent Lightning's setup: one model for every node; agent_match still trains only the writers."""
    with FakeOpenAI([GOLD, f"{spider.CORRECT}."], return_token_ids=True) as policy:
        monkeypatch.setenv("OPENAI_BASE_URL", policy.url)
        monkeypatch.setenv("OPENAI_API_KEY", "policy-key")
        monkeypatch.delenv("SPIDER_CHECKER_BASE_URL", raising=False)
        try:
            assert spider.rollout(TASK) == 1.0
        finally:
            spider._graphs.clear()
    traj = spider.rollout.last_run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["write_query"] and len(policy.requests) == 2
    assert [s.agent_name for s in traj.skipped] == ["check_query"]


def test_the_fake_mode_main_runs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SPIDER_CHECKER_BASE_URL", raising=False)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # main points it at its fake; restored after
    monkeypatch.setenv("OPENAI_API_KEY", "not-a-key")
    try:
        assert spider.main(["--fake", "--tasks", "2"]) == 0
    finally:
        agl.uninstrument()
        spider._graphs.clear()
    out = capsys.readouterr().out
    assert "== spider-01: reward 1.0" in out and "== spider-02: reward 1.0" in out
    assert "[rewrite_query / policy]" in out and "not trained: agent 'check_query'" in out
