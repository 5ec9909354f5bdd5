"""``examples/sql_agent``: the writer / checker / rewriter LangGraph agent, run as a rollout against a fake server.

The real graph, the real ``ChatOpenAI`` and the real SQLite environment; only
the model is the scripted fake (pointed at through ``OPENAI_BASE_URL`` as agl's
gateway would be). Checked: which calls become transitions under
``agent_match="writer|rewriter"``, their token ids, the execution-accuracy
reward and the AIR penalty for a query that fails.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import agl_core as agl
from agl_core import guard, semconv
from agl_core.instrumentation import Instrumented
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.sql_agent import agent as sql_agent  # noqa: E402
from examples.sql_agent.database import TASKS, connect, execute, score  # noqa: E402

TASK = next(t for t in TASKS if t["id"] == "sql-02")  # Engineering's employees: Ada, Ben, Hugo
GOLD = f"```sql\n{TASK['gold_sql']}\n```"
BROKEN = "```sql\nSELECT nme FROM employees\n```"
WRONG = "```sql\nSELECT name FROM employees WHERE department_id = 2\n```"


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeOpenAI]]:
    """``serve(*replies)``: a fake vLLM-like server saying them (token ids always), where the env vars point."""
    servers: list[FakeOpenAI] = []

    def start(*replies: str) -> FakeOpenAI:
        srv = FakeOpenAI(list(replies), return_token_ids=True).start()
        servers.append(srv)
        monkeypatch.setenv("OPENAI_BASE_URL", srv.url)
        monkeypatch.setenv("OPENAI_API_KEY", "not-a-key")
        return srv

    yield start
    for srv in servers:
        srv.stop()
    sql_agent._graphs.clear()


def test_every_gold_query_runs_and_scores_one() -> None:
    conn = connect()
    for task in TASKS:
        assert execute(conn, task["gold_sql"]), task["id"]
        assert score(conn, task["gold_sql"], task["gold_sql"]) == 1.0
        assert score(conn, "SELECT 1", task["gold_sql"]) == 0.0
    assert score(conn, "SELECT nme FROM employees", TASKS[0]["gold_sql"]) == 0.0
    with pytest.raises(Exception, match="readonly"):
        execute(conn, "DELETE FROM employees")


def test_a_failed_query_rewritten_right_trains_writer_and_rewriter(with_openai: Instrumented,
                                                                   serve: Callable[..., FakeOpenAI]) -> None:
    model = serve(BROKEN, "The column nme does not exist.", GOLD, "THE QUERY IS CORRECT.")
    reward = sql_agent.rollout(TASK)
    assert reward == 1.0
    run = sql_agent.rollout.last_run
    assert run.rollout.status == "succeeded" and run.rollout.task_id == "sql-02"

    traj = run.trajectory()  # the example's own builder: writer|rewriter, AIR on SQL errors
    assert [t.agent_name for t in traj.transitions] == ["writer", "rewriter"]
    assert [s.reason for s in traj.skipped] == ["agent 'checker' does not match agent_match 'writer|rewriter'"] * 2
    writer, rewriter = traj.transitions
    assert writer.response["content"] == BROKEN and rewriter.response["content"] == GOLD
    assert (writer.reward, rewriter.reward, traj.reward) == (sql_agent.SQL_ERROR_REWARD, None, 1.0)
    assert "CREATE TABLE employees" in writer.prompt[0]["content"]
    assert "no such column: nme" in rewriter.prompt[-1]["content"]  # the tool's error reached the rewriter

    # token ids: the server's, for exactly the request each transition made (writer = 1st, rewriter = 3rd)
    requests = [r for r in model.requests if r.path.endswith("/chat/completions")]
    assert len(requests) == 4
    for t, request in zip(traj.transitions, [requests[0], requests[2]], strict=True):
        assert t.token_source == "response" and t.model == "policy"
        assert t.prompt_token_ids == tokenize(render_prompt(request.body["messages"]))
        assert t.response_token_ids == tokenize(t.response["content"])
        assert request.headers["traceparent"].split("-")[1] == t.trace_id

    every = run.trajectory(builder=agl.TransitionBuilder())
    assert [t.agent_name for t in every.transitions] == ["writer", "checker", "rewriter", "checker"]
    tools = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert [s.attributes[semconv.AGL_TOOL_STATUS] for s in tools] == ["error", "ok"]
    assert guard.fault_counts() == {}


def test_a_wrong_answer_scores_zero(with_openai: Instrumented, serve: Callable[..., FakeOpenAI]) -> None:
    serve(WRONG, "THE QUERY IS CORRECT.")  # the checker is fooled; the gold answer is not
    assert sql_agent.rollout(TASK) == 0.0
    traj = sql_agent.rollout.last_run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["writer"]
    assert traj.transitions[0].reward is None and traj.reward == 0.0
    assert traj.transitions[0].response_token_ids == tokenize(WRONG)


def test_out_of_rewrites_keeps_the_last_query_and_every_penalty(with_openai: Instrumented,
                                                                 serve: Callable[..., FakeOpenAI]) -> None:
    model = serve(BROKEN, "wrong column", BROKEN, "still wrong", BROKEN, "still wrong")
    assert sql_agent.rollout(TASK) == 0.0
    traj = sql_agent.rollout.last_run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["writer", "rewriter", "rewriter"]
    assert [t.reward for t in traj.transitions] == [sql_agent.SQL_ERROR_REWARD] * 3
    assert traj.reward == 0.0
    assert len(model.requests) == 2 * (1 + sql_agent.MAX_REWRITES)


def test_the_fake_mode_main_runs_and_prints_rewards(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # main points it at its fake; restored after
    monkeypatch.setenv("OPENAI_API_KEY", "not-a-key")
    try:
        assert sql_agent.main(["--fake", "--tasks", "3"]) == 0
    finally:
        agl.uninstrument()
    out = capsys.readouterr().out
    assert out.count("final reward") == 3 and "response ids" in out


def test_the_builder_is_what_train_yaml_gives_the_server() -> None:
    """examples/sql_agent/train.yaml gives `agl train` these rules (tests/trainer checks it)."""
    assert sql_agent.BUILDER.agent_match.pattern == "writer|rewriter"
    assert sql_agent.BUILDER.air == agl.AirRules(tool_error=-0.5, tool_exception=-0.5)
