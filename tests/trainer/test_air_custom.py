"""``air.custom: pkg.module:function`` in the ``agl train`` config: a tool that reports failure in its text.

Real tools often return ``"Error: ..."`` with an ok status (Agent Lightning's spider
SQL tool does), which no built-in AIR rule can see. The config's custom rule,
``(span) -> reward | None``, gives that call its penalty. The agent is a real
LangChain ``create_agent`` over ``ChatOpenAI``, the model FakeOpenAI on 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langchain_openai")

from langchain.agents import create_agent  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

import agl_core as agl  # noqa: E402
from agl_core import semconv  # noqa: E402
from agl_core.testing import FakeOpenAI  # noqa: E402
from agl_trainer.config import ConfigError, transition_builder, validate  # noqa: E402

RULES = '''
from agl_core import semconv


def said_error(span):
    """-0.5 for a tool whose result says it failed, whatever its status."""
    result = span.attributes.get(semconv.GEN_AI_TOOL_CALL_RESULT)
    return -0.5 if isinstance(result, str) and result.startswith("Error:") else None


RULE = 0.5
'''


@tool
def run_sql(query: str) -> str:
    """Run a SQL query on the database."""
    return "Error: no such table: users"  # how the spider agent's tool reports a failure: an ok return


@pytest.fixture(autouse=True)
def langchain_instrumented() -> Iterator[None]:
    active = agl.instrument(["langchain"])
    assert "langchain" in active
    yield
    agl.uninstrument(["langchain"])  # only it: the suite's openai plugin stays on for the tests after


@pytest.fixture
def rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "my_rules.py").write_text(RULES, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _config(base: Path, air: dict[str, Any]) -> Any:
    return validate({"data": {"path": "t.jsonl"}, "agent": "pkg.mod:solve", "backend": {"model": "m"}, "air": air},
                    base_dir=str(base))


def _run_agent(tmp_path: Path) -> Any:
    script = [{"tool_calls": [{"name": "run_sql", "arguments": {"query": "SELECT * FROM users"}}]},
              {"content": "The table does not exist."}]
    with FakeOpenAI(script=script) as fake:
        model = ChatOpenAI(model="m", base_url=fake.url, api_key="x", max_retries=0, temperature=0)
        agent = create_agent(model, tools=[run_sql])
        with agl.rollout(task_id="spider-1", store=agl.SqliteStore(str(tmp_path / "runs.db"))) as run:
            agent.invoke({"messages": [{"role": "user", "content": "How many users are there?"}]})
            agl.emit_reward(0.0)
    return run


def test_a_custom_rule_from_the_config_penalises_a_tool_that_reports_failure_as_text(rules: Path) -> None:
    run = _run_agent(rules)
    (tool_span,) = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_TOOL_NAME) == "run_sql"]
    assert tool_span.attributes.get(semconv.AGL_TOOL_STATUS) == semconv.TOOL_OK  # no built-in rule sees it

    before = run.trajectory(builder=transition_builder(_config(rules, {"tool_error": -1.0, "tool_exception": -1.0})))
    assert [t.reward for t in before.transitions] == [None, None]

    after = run.trajectory(builder=transition_builder(_config(rules, {"custom": "my_rules:said_error"})))
    assert [t.reward for t in after.transitions] == [-0.5, None]  # on the call that asked for the tool
    assert after.transitions[0].response["tool_calls"][0]["function"]["name"] == "run_sql"


@pytest.mark.parametrize(("spec", "message"), [
    ("no_such_module:said_error", "air.custom: cannot load no_such_module:said_error: ModuleNotFoundError: "
                                  "No module named 'no_such_module'"),
    ("my_rules:no_such_function", "air.custom: cannot load my_rules:no_such_function: AttributeError: "
                                  "module 'my_rules' has no attribute 'no_such_function'"),
    ("my_rules:RULE", "air.custom: my_rules:RULE is a float, not a function"),
])
def test_a_custom_rule_that_cannot_be_loaded_is_named_by_its_key(rules: Path, spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        transition_builder(_config(rules, {"custom": spec}))
    assert caught.value.key == "air.custom" and str(caught.value) == f"config error: {message}"


def test_a_custom_rule_that_is_not_a_function_spec_is_named_by_its_key(rules: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        _config(rules, {"custom": "said_error"})
    assert caught.value.key == "air.custom", str(caught.value)
