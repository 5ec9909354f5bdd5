"""Each example's ``train.yaml`` is a valid ``agl train`` config: it loads, names the example's entry point and task
file, and carries the same ``agent_match`` and AIR rules as the example's own ``TransitionBuilder``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agl_trainer.config import ConfigError, load_config, load_tasks

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["sql_agent", "rag_agent", "calc_agent", "crewai_agent", "openai_client_agent"]
# what each example's BUILDER says (the framework suites check the BUILDERs themselves)
RULES = {
    "sql_agent": ("writer|rewriter", {"tool_error": -0.5, "tool_exception": -0.5}),
    "rag_agent": (None, {"tool_error": -0.2, "tool_exception": -0.2, "malformed_tool_call": -0.5}),
    "calc_agent": (None, {"tool_error": -0.2, "tool_exception": -0.2}),
    "crewai_agent": (None, {"tool_error": -0.3, "tool_exception": -0.3}),
    "openai_client_agent": (None, {"tool_error": -0.25, "tool_exception": -0.25, "malformed_tool_call": -0.25}),
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


@pytest.fixture(autouse=True)
def root_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))  # as PYTHONPATH=. does for `agl train` run from the root


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_train_config_loads(name: str, model_dir: Path) -> None:
    path = ROOT / "examples" / name / "train.yaml"
    config = load_config(path, [f"backend.model={model_dir}"])
    assert config.agent == f"examples.{name}.agent:rollout"
    match, air = RULES[name]
    assert config.agent_match == match
    assert {k: v for k, v in config.air.model_dump().items() if v is not None} == air
    tasks = load_tasks(config)
    lines = (ROOT / "examples" / name / "tasks.jsonl").read_text().splitlines()
    assert tasks == [json.loads(line) for line in lines] and len({t["id"] for t in tasks}) == len(tasks) >= 5
    assert Path(config.path(config.run.dir)) == ROOT / "agl-train" / name


def test_without_the_root_on_the_path_the_error_says_so(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    for module in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, module)
    with pytest.raises(ConfigError, match="no module 'examples.sql_agent.agent' to import .*PYTHONPATH"):
        load_config(ROOT / "examples" / "sql_agent" / "train.yaml", [f"backend.model={model_dir}"])
