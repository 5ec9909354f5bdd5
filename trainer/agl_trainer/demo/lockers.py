"""The demo's task and its agent: a plain LangChain / LangGraph agent, with nothing of agl in it.

**The task.** There are a few lockers (``red``, ``blue``, ...). Each opens with one
code and holds one thing; neither is written anywhere the model can read. A task
says "what is inside locker red". The agent must call the ``unlock`` tool with the
right code (a wrong one is a tool error; so is trying again once it is open) and then
answer with what is inside.

**The agent.** A two-agent LangGraph: ``solver``, a prebuilt ``create_agent`` with
the ``unlock`` tool (one LLM call that picks the code, the tool, one LLM call that
answers; more calls when it keeps trying codes), then ``reporter``, a node that
asks the same model for a one-word report. Both talk to the model through
``ChatOpenAI``, which the worker points at agl's gateway. Only ``solver`` is trained
(``agent_match="solver"``); ``reporter``'s calls are traced and left out.

**The reward.** The agent's final reward is 0.5 when the locker was opened and the
answer names what is inside, else 0. The rest comes from tool outcomes seen in the
trace (AIR rules given to the server's ``TransitionBuilder``): ``TOOL_OK_REWARD`` (0.5)
for the call that opened the locker (it opens once: a second try is an error), and
``TOOL_ERROR_REWARD`` (-0.05) for each failed try. The best return is 1; acting at
random scores about 0.1. (A penalty-only design, tried first, taught the model to
skip the tool and answer at once: zero reward, no tool errors, nothing left to learn.)

What the model has to learn is two small lookups (locker -> code, locker -> thing,
or reading the thing off the tool's answer), one decision per call: an honest RL
problem a tiny model solves in minutes on a CPU, not language understanding.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

from langchain.agents import create_agent
from langchain_core.messages import HumanMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import ToolException, tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, MessagesState, StateGraph

__all__ = ["TEXT_MAX_TOKENS", "TEXT_TOOL_ERROR_REWARD", "TOOL_ERROR_REWARD", "TOOL_OK_REWARD", "Lockers", "build_agent",
           "solve", "solve_text"]

TOOL_OK_REWARD = 0.5
TOOL_ERROR_REWARD = -0.05
TEXT_TOOL_ERROR_REWARD = -0.5
"""The text demo's price of a wrong code: a run that opens the locker at the second try returns 0.5, not 1."""
TEXT_MAX_TOKENS = 48
"""The text demo's ``max_tokens`` per call: a tool call is about twenty tokens of the BPE tokenizer and the longest
well-formed replies the policy writes are about 35, so only a reply that runs on is cut (at 32, a few that would
have ended were cut too: 1-2% of the replies, none of them weeded out by RL)."""

_NAMES = ["red", "blue", "green", "gold", "white", "black", "pink", "brown"]
_THINGS = ["coin", "key", "map", "ring", "lamp", "book", "shoe", "cup"]

SYSTEM = "open the locker with the unlock tool then name what is inside"


@dataclass(frozen=True)
class Lockers:
    """``n`` lockers, each with a code and a thing inside, shuffled by ``seed``."""

    n: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if not 2 <= self.n <= len(_NAMES):
            raise ValueError(f"lockers: n must be between 2 and {len(_NAMES)}, got {self.n}")

    @property
    def names(self) -> list[str]:
        return _NAMES[:self.n]

    @property
    def codes(self) -> list[str]:
        return [str(i + 1) for i in range(self.n)]

    @property
    def things(self) -> list[str]:
        return _THINGS[:self.n]

    def secret(self) -> dict[str, tuple[str, str]]:
        """Locker name -> (code, thing)."""
        rng = random.Random(self.seed)
        codes, things = self.codes, self.things
        rng.shuffle(codes)
        rng.shuffle(things)
        return {name: (codes[i], things[i]) for i, name in enumerate(self.names)}

    def tasks(self) -> list[dict[str, Any]]:
        """One task per locker: what the agent is given (the secret rides along for the reward only)."""
        return [{"locker": name, "code": code, "thing": thing, "question": f"what is inside locker {name}"}
                for name, (code, thing) in self.secret().items()]

    def words(self) -> list[str]:
        """Every word of the agent's prompts and the tools' answers (the tiny tokenizer's vocabulary)."""
        fixed = (SYSTEM + " what is inside locker wrong code already report the answer none").split()
        return list(dict.fromkeys([*fixed, "system", "user", "assistant", "tool", *self.names, *self.things]))


# --------------------------------------------------------------------------- the agent (plain LangChain)

_graphs: dict[str, Any] = {}


def build_agent(max_tokens: int = 1, *, reporter: bool = True) -> Any:
    """The two-agent graph (``solver`` alone without ``reporter``); its model client talks to ``OPENAI_BASE_URL``
    as it was when it was built."""
    # one token a call: the tiny model's vocabulary makes each one a whole tool call or a whole answer
    llm = ChatOpenAI(model="policy", temperature=1.0, max_tokens=max_tokens, max_retries=0, timeout=120)

    @tool
    def unlock(code: str, config: RunnableConfig) -> str:
        """Try a code on the locker; returns what is inside when the code is right."""
        task = config["configurable"]["task"]
        if config["configurable"]["opened"]:
            raise ToolException("already open")  # so opening pays once, however often the model tries
        if code != task["code"]:
            raise ToolException("wrong code")
        config["configurable"]["opened"].append(code)
        return f"inside is {task['thing']}"

    unlock.handle_tool_error = True  # a wrong code is a tool error the model sees, not a crash
    unlock.handle_validation_error = True  # and so are arguments without a code (a model that writes its calls)

    solver = create_agent(llm, [unlock], system_prompt=SYSTEM, name="solver")

    class State(MessagesState):
        report: str

    def report(state: State) -> dict[str, Any]:
        answer = str(state["messages"][-1].content or "none")
        return {"report": str(llm.invoke([HumanMessage(f"report the answer {answer}")]).content)}

    graph = StateGraph(State)
    graph.add_node("solver", solver)
    graph.add_edge(START, "solver")
    if reporter:
        graph.add_node("reporter", report)
        graph.add_edge("solver", "reporter")
        graph.add_edge("reporter", END)
    else:
        graph.add_edge("solver", END)
    return graph.compile(name="lockers")


def solve(task: dict[str, Any]) -> float:
    """Run the agent on one task; return the final reward (the worker makes this a rollout)."""
    return _solve(task, "one-token")


def solve_text(task: dict[str, Any]) -> float:
    """:func:`solve` for the text demo: ``solver`` alone, ``TEXT_MAX_TOKENS`` a call."""
    return _solve(task, "text")


def _solve(task: dict[str, Any], kind: str) -> float:
    base_url = os.environ.get("OPENAI_BASE_URL", "")
    graph = _graphs.get(f"{kind} {base_url}")
    if graph is None:  # once per gateway (the worker points OPENAI_BASE_URL at it)
        graph = _graphs[f"{kind} {base_url}"] = build_agent() if kind == "one-token" else \
            build_agent(TEXT_MAX_TOKENS, reporter=False)
    opened: list[str] = []
    config = {"configurable": {"task": task, "opened": opened}, "recursion_limit": 8}
    try:
        state = graph.invoke({"messages": [HumanMessage(task["question"])]}, config)
    except GraphRecursionError:
        return 0.0  # kept trying codes until the step limit: no answer
    answer = str(state["messages"][-1].content or "").strip()
    return 0.5 if opened and answer == task["thing"] else 0.0
