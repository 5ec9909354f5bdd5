"""Text-to-SQL with LangGraph: a writer, a checker and a rewriter over a SQLite database built here.

The graph is ordinary LangGraph with nothing of agl in it::

    START -> writer -> execute -> checker --(correct, or out of turns)--> END
                          ^                   |
                          +---- rewriter <----+

``writer`` turns the question into SQL, ``execute`` runs it with the
``run_sql`` tool (a failing query is a tool error the checker sees),
``checker`` reviews the query and its result, and ``rewriter`` fixes the query
from the checker's feedback. The final query is scored by execution accuracy
against the task's gold SQL (1.0 or 0.0).

Only the writer and the rewriter are trained:
``agl.TransitionBuilder(agent_match="writer|rewriter")`` keeps their calls and
leaves the checker's out (it is traced and listed in ``Trajectory.skipped``).
A query that fails to run is an AIR reward of ``SQL_ERROR_REWARD`` on the call
that wrote it.

Run it against any OpenAI-compatible server (``OPENAI_BASE_URL``,
``OPENAI_API_KEY``, and ``AGL_MODEL`` or ``--model``)::

    python -m examples.sql_agent.agent --tasks 3
    python -m examples.sql_agent.agent --fake      # offline, a scripted fake model

or as training rollouts through agl's gateway::

    PYTHONPATH=. agl worker --server http://127.0.0.1:8000 --agent examples.sql_agent.agent:rollout
"""

from __future__ import annotations

import os
import re
import sqlite3
import sys
from typing import Any, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import ToolException, tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

import agl_core as agl
from examples import runner
from examples.runner import model_name
from examples.sql_agent.database import TASKS, connect, execute, schema_text, score

__all__ = ["BUILDER", "SQL_ERROR_REWARD", "TASKS", "build_graph", "rollout", "solve"]

SQL_ERROR_REWARD = -0.5
MAX_REWRITES = 2
CORRECT = "THE QUERY IS CORRECT"

BUILDER = agl.TransitionBuilder(agent_match="writer|rewriter",
                                air=agl.AirRules(tool_error=SQL_ERROR_REWARD, tool_exception=SQL_ERROR_REWARD))

WRITER_PROMPT = """You write one SQLite query that answers the user's question about this database:

{schema}
Answer with the query alone in a ```sql ... ``` block."""

CHECKER_PROMPT = f"""You review a SQLite query written for a question, and the result it returned.
If the query answers the question correctly, say exactly: {CORRECT}.
Otherwise say what is wrong with it, in a few words."""

REWRITER_PROMPT = """You fix a SQLite query for this database:

{schema}
You get the question, the query, its result and a reviewer's feedback.
Answer with the corrected query alone in a ```sql ... ``` block."""

_SQL_BLOCK = re.compile(r"```(?:sql)?\s*(.*?)```", re.DOTALL | re.IGNORECASE)


class SqlState(TypedDict, total=False):
    question: str
    query: str
    result: str
    failed: bool
    feedback: str
    turns: int


def extract_sql(text: str) -> str:
    """The query in the model's reply: the last ```sql``` block, or the whole reply when there is none."""
    blocks = _SQL_BLOCK.findall(text)
    return (blocks[-1] if blocks else text).strip().rstrip(";").strip()


@tool
def run_sql(query: str, config: RunnableConfig) -> str:
    """Run a read-only SQLite query on the task's database; returns its rows."""
    conn: sqlite3.Connection = config["configurable"]["db"]
    try:
        rows = execute(conn, query)
    except sqlite3.Error as exc:
        raise ToolException(f"Error: {exc}") from exc
    return "\n".join(repr(r) for r in rows) if rows else "(no rows)"


run_sql.handle_tool_error = True  # a failing query is a tool error (status="error") the agent sees, not a crash


def build_graph(llm: Any, *, max_rewrites: int = MAX_REWRITES) -> Any:
    """The writer / checker / rewriter graph over ``llm`` (any LangChain chat model)."""
    schema = schema_text()

    def writer(state: SqlState) -> SqlState:
        reply = llm.invoke([SystemMessage(WRITER_PROMPT.format(schema=schema)), HumanMessage(state["question"])])
        return {"query": extract_sql(str(reply.content)), "turns": 0}

    def run(state: SqlState, config: RunnableConfig) -> SqlState:
        call = {"name": "run_sql", "args": {"query": state["query"]}, "id": f"run_sql-{state['turns']}",
                "type": "tool_call"}
        message = run_sql.invoke(call, config)
        return {"result": str(message.content), "failed": message.status == "error"}

    def checker(state: SqlState) -> SqlState:
        reply = llm.invoke([SystemMessage(CHECKER_PROMPT), HumanMessage(
            f"Question: {state['question']}\nQuery: {state['query']}\nResult:\n{state['result']}")])
        return {"feedback": str(reply.content)}

    def rewriter(state: SqlState) -> SqlState:
        reply = llm.invoke([SystemMessage(REWRITER_PROMPT.format(schema=schema)), HumanMessage(
            f"Question: {state['question']}\nQuery: {state['query']}\nResult:\n{state['result']}\n"
            f"Feedback: {state['feedback']}")])
        return {"query": extract_sql(str(reply.content)), "turns": state["turns"] + 1}

    def after_check(state: SqlState) -> str:
        done = CORRECT.lower() in state["feedback"].lower() and not state["failed"]
        return END if done or state["turns"] >= max_rewrites else "rewriter"

    graph = StateGraph(SqlState)
    graph.add_node("writer", writer)
    graph.add_node("execute", run)
    graph.add_node("checker", checker)
    graph.add_node("rewriter", rewriter)
    graph.add_edge(START, "writer")
    graph.add_edge("writer", "execute")
    graph.add_edge("execute", "checker")
    graph.add_conditional_edges("checker", after_check, ["rewriter", END])
    graph.add_edge("rewriter", "execute")
    return graph.compile(name="sql_agent")


_graphs: dict[tuple[str, str], Any] = {}


def _graph(model: str) -> Any:
    """One graph per server and model; the client reads ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``."""
    key = (os.environ.get("OPENAI_BASE_URL", ""), model)
    if key not in _graphs:
        _graphs[key] = build_graph(ChatOpenAI(model=model, temperature=0.7, max_retries=1, timeout=120))
    return _graphs[key]


def solve(task: dict[str, Any], model: str | None = None) -> tuple[str, float]:
    """Run the agent on one task: ``(final query, reward)``."""
    conn = connect()
    try:
        state = _graph(model_name(model)).invoke({"question": task["question"]},
                                                 {"configurable": {"db": conn}, "recursion_limit": 25})
        query = state.get("query", "")
        return query, score(conn, query, task["gold_sql"])
    finally:
        conn.close()


@agl.rollout_fn(builder=BUILDER)
def rollout(task: dict[str, Any], model: str | None = None) -> float:
    """The entry point ``agl worker`` runs: one task ``{"id", "question", "gold_sql"}`` -> its reward."""
    return solve(task, model)[1]


# --------------------------------------------------------------------------- python -m examples.sql_agent.agent


def fake_policy(request: dict[str, Any]) -> str:
    """A scripted stand-in for a model (``--fake``): first drafts miss a column, the rewriter fixes them."""
    system = str(request["messages"][0]["content"])
    user = str(request["messages"][-1]["content"])
    task = next((t for t in TASKS if t["question"] in user), TASKS[0])
    if system.startswith("You review"):
        return "The query fails: there is no such column." if "Error" in user else f"{CORRECT}."
    if system.startswith("You write") and task["id"] != "sql-01":
        return "```sql\nSELECT missing_column FROM employees\n```"
    return f"```sql\n{task['gold_sql']}\n```"


def main(argv: list[str] | None = None) -> int:
    return runner.main(__doc__ or "", rollout, TASKS, fake_policy, argv, default_tasks=3)


if __name__ == "__main__":
    sys.exit(main())
