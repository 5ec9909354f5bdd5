"""Agent Lightning's spider SQL agent, ported to agl: LangGraph's write / check / rewrite loop over SQLite.

The graph is the one of Agent Lightning's ``examples/spider/sql_agent.py``, with nothing of
agl in it::

    START -> write_query -> execute_query -> check_query --(correct, or out of turns)--> END
                                 ^                |
                                 +- rewrite_query +

``write_query`` turns the question into SQL, ``execute_query`` runs it with the
``sql_db_query`` tool (as LangChain's ``QuerySQLDatabaseTool``, a failing query returns
``Error: ...`` as its result instead of raising), ``check_query`` reviews the query and
its result and ends with ``THE QUERY IS CORRECT.`` or ``THE QUERY IS INCORRECT.``, and
``rewrite_query`` fixes the query from that feedback. The final query is scored by
execution match against the task's gold SQL (1.0 or 0.0).

What is trained, as in Agent Lightning (``trained_agents=r"write"``):
``agent_match="write"`` is a regex search, so it selects ``write_query`` and
``rewrite_query``; ``check_query`` is traced and listed in ``Trajectory.skipped``.
The checker may also be a frozen model of its own: with ``SPIDER_CHECKER_BASE_URL``
(and ``SPIDER_CHECKER_MODEL``, ``SPIDER_CHECKER_API_KEY``) set, its calls go there and
never reach agl's gateway; without it they go to the policy, untrained. A query whose
result is ``Error: ...`` is an AIR reward of ``SQL_ERROR_REWARD`` on the call that
wrote it (``query_failed``, an ``air.custom`` rule: the tool span's status is ok).

Run it against any OpenAI-compatible server (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``,
and ``AGL_MODEL`` or ``--model``)::

    python -m examples.spider_agent.agent --tasks 3
    python -m examples.spider_agent.agent --fake      # offline, a scripted fake model

or train it (validation on ``val.jsonl``, greedy, at the start and every 5 steps)::

    PYTHONPATH=. agl train examples/spider_agent/train.yaml --set backend.model=/path/to/model
"""

from __future__ import annotations

import os
import re
import sqlite3
import sys
from typing import Any, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

import agl_core as agl
from agl_core import semconv
from examples import runner
from examples.runner import model_name
from examples.spider_agent.database import TASKS, connect, evaluate_query, run_query, table_info

__all__ = ["BUILDER", "MAX_TURNS", "SQL_ERROR_REWARD", "TASKS", "build_graph", "query_failed", "rollout", "solve"]

MAX_TURNS = 3
SQL_ERROR_REWARD = -0.5
CORRECT, INCORRECT = "THE QUERY IS CORRECT", "THE QUERY IS INCORRECT"

WRITE_PROMPT = """You answer questions about a SQLite database by writing one query.
Use only the tables and columns of this schema:

{table_info}
Answer with the query alone, in a ```sql ... ``` block."""

CHECK_PROMPT = f"""You are a careful SQL reviewer. Check the SQLite query written for the question
against the schema and its execution result: wrong columns or joins, wrong filters, failed
execution, a result that cannot answer the question.

{{table_info}}
List the mistakes you find, if any, then end with exactly one of:
{CORRECT}.
{INCORRECT}.
Do not write a corrected query."""

REWRITE_PROMPT = """You fix a SQLite query so that it answers the question, addressing every
point of the reviewer's feedback. Use only the tables and columns of this schema:

{table_info}
Answer with the rewritten query alone, in a ```sql ... ``` block."""

_SQL_BLOCK = re.compile(r"```\w*\s*\n?(.*?)```", re.DOTALL)


class SpiderState(TypedDict, total=False):
    question: str
    query: str
    execution: str
    feedback: str
    num_turns: int


def parse_query(text: str) -> str | None:
    """The last fenced block of the reply, or None when it has none."""
    blocks = _SQL_BLOCK.findall(text)
    return blocks[-1].strip() if blocks else None


def says_correct(feedback: str) -> bool:
    """The checker's verdict: its last of the two phrases (it may quote the other one before)."""
    return feedback.rfind(CORRECT) > feedback.rfind(INCORRECT) if CORRECT in feedback else False


@tool
def sql_db_query(query: str, config: RunnableConfig) -> str:
    """Run a SQLite query on the task's database; returns its rows, or 'Error: ...' when it fails."""
    conn: sqlite3.Connection = config["configurable"]["db"]
    return run_query(conn, query)


def query_failed(span: agl.Span) -> float | None:
    """AIR (``air.custom``): a ``sql_db_query`` call whose result is ``Error: ...`` costs ``SQL_ERROR_REWARD``."""
    attrs = span.attributes
    result = attrs.get(semconv.GEN_AI_TOOL_CALL_RESULT)
    if attrs.get(semconv.GEN_AI_TOOL_NAME) == "sql_db_query" and str(result or "").startswith("Error:"):
        return SQL_ERROR_REWARD
    return None


BUILDER = agl.TransitionBuilder(agent_match="write", air=agl.AirRules(custom=query_failed))


def build_graph(llm: Any, checker: Any = None, *, max_turns: int = MAX_TURNS) -> Any:
    """The write / execute / check / rewrite graph; ``llm`` writes and rewrites, ``checker`` (else ``llm``) checks."""
    checker = checker if checker is not None else llm
    info = table_info()

    def write_query(state: SpiderState) -> SpiderState:
        reply = llm.invoke([SystemMessage(WRITE_PROMPT.format(table_info=info)),
                            HumanMessage(f"Question: {state['question']}")])
        text = str(reply.content)
        return {"query": parse_query(text) or text, "num_turns": 1}

    def execute_query(state: SpiderState, config: RunnableConfig) -> SpiderState:
        call = {"name": "sql_db_query", "args": {"query": state["query"]}, "id": f"query-{state['num_turns']}",
                "type": "tool_call"}
        return {"execution": str(sql_db_query.invoke(call, config).content)}

    def check_query(state: SpiderState) -> SpiderState:
        reply = checker.invoke([SystemMessage(CHECK_PROMPT.format(table_info=info)), HumanMessage(
            f"Question: {state['question']}\n\nQuery:\n```sql\n{state['query']}\n```\n\n"
            f"Execution result:\n```\n{state['execution']}\n```")])
        return {"feedback": str(reply.content)}

    def rewrite_query(state: SpiderState) -> SpiderState:
        reply = llm.invoke([SystemMessage(REWRITE_PROMPT.format(table_info=info)), HumanMessage(
            f"Question: {state['question']}\n\nPrevious query:\n```sql\n{state['query']}\n```\n\n"
            f"Its execution result:\n```\n{state['execution']}\n```\n\nFeedback:\n{state['feedback']}")])
        return {"query": parse_query(str(reply.content)) or state["query"], "num_turns": state["num_turns"] + 1}

    def should_continue(state: SpiderState) -> str:
        done = says_correct(state["feedback"]) or state["num_turns"] >= max_turns
        return END if done else "rewrite_query"

    graph = StateGraph(SpiderState)
    for node in (write_query, execute_query, check_query, rewrite_query):
        graph.add_node(node.__name__, node)
    graph.add_edge(START, "write_query")
    graph.add_edge("write_query", "execute_query")
    graph.add_edge("execute_query", "check_query")
    graph.add_conditional_edges("check_query", should_continue, ["rewrite_query", END])
    graph.add_edge("rewrite_query", "execute_query")
    return graph.compile(name="spider_agent")


def frozen_checker() -> Any:
    """The checker's own model when ``SPIDER_CHECKER_BASE_URL`` names one (never agl's gateway), else None."""
    url = os.environ.get("SPIDER_CHECKER_BASE_URL")
    if not url:
        return None
    return ChatOpenAI(model=os.environ.get("SPIDER_CHECKER_MODEL", "checker"), base_url=url,
                      api_key=os.environ.get("SPIDER_CHECKER_API_KEY", "unused"), temperature=0, max_retries=1,
                      timeout=120)


_graphs: dict[tuple[str, str, str], Any] = {}


def _graph(model: str) -> Any:
    """One graph per policy server, model and checker; the policy's client reads ``OPENAI_BASE_URL``/``_API_KEY``."""
    key = (os.environ.get("OPENAI_BASE_URL", ""), model, os.environ.get("SPIDER_CHECKER_BASE_URL", ""))
    if key not in _graphs:
        policy = ChatOpenAI(model=model, temperature=0, max_retries=1, timeout=120, max_tokens=512)
        _graphs[key] = build_graph(policy, frozen_checker())
    return _graphs[key]


def solve(task: dict[str, Any], model: str | None = None) -> tuple[str, float]:
    """Run the agent on one Spider record: ``(final query, reward)``."""
    conn = connect()
    try:
        state = _graph(model_name(model)).invoke({"question": task["question"]},
                                                 {"configurable": {"db": conn}, "recursion_limit": 100})
    finally:
        conn.close()
    query = state.get("query", "")
    return query, evaluate_query(query, task["query"])


@agl.rollout_fn(builder=BUILDER)
def rollout(task: dict[str, Any], model: str | None = None) -> float:
    """The entry point ``agl worker`` runs: one task ``{"id", "db_id", "question", "query"}`` -> its reward."""
    return solve(task, model)[1]


# --------------------------------------------------------------------------- python -m examples.spider_agent.agent


def fake_policy(request: dict[str, Any]) -> str:
    """A scripted stand-in for a model (``--fake``): a first draft with a wrong column, fixed after the review."""
    system = str(request["messages"][0]["content"])
    user = str(request["messages"][-1]["content"])
    task = next((t for t in TASKS if t["question"] in user), TASKS[0])
    if system.startswith("You are a careful SQL reviewer"):
        return f"The query does not run.\n{INCORRECT}." if "Error:" in user else f"{CORRECT}."
    if system.startswith("You answer") and task["id"] != "spider-01":
        return "```sql\nSELECT singer_name FROM singer\n```"
    return f"```sql\n{task['query']}\n```"


def main(argv: list[str] | None = None) -> int:
    return runner.main(__doc__ or "", rollout, TASKS, fake_policy, argv, default_tasks=3)


if __name__ == "__main__":
    sys.exit(main())
