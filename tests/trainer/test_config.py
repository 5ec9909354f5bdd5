"""The ``agl train`` config in process: defaults, overrides, relative paths, the data set, and every kind of
mistake named by its key (the subprocess tests in test_train.py check the command's own output word for word)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agl_trainer.config import (
    Config,
    ConfigError,
    ConfigErrors,
    apply_overrides,
    load_config,
    load_tasks,
    transition_builder,
    validate,
)

MINIMAL: dict[str, Any] = {"data": {"path": "tasks.jsonl"}, "agent": "pkg.mod:solve", "backend": {"model": "m"}}


def _error(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        validate(raw)
    return str(info.value)


def test_a_minimal_config_gets_the_documented_defaults() -> None:
    config = validate(MINIMAL)
    assert config.backend.name == "torch" and config.backend.device == "cpu" and config.backend.lora is None
    assert config.algorithm.row_mode == "trajectory" and config.algorithm.clip_epsilon == 0.2
    assert config.credit.method == "final" and config.credit.gamma == 1.0
    assert config.air.tool_error is None and config.workers.count == 4 and config.workers.ray is None
    assert config.server.host == "127.0.0.1" and config.server.port == 0 and config.server.url is None
    assert config.run.steps == 100 and config.run.resume is True
    assert "base_dir" not in config.model_dump(mode="json")


def test_each_kind_of_mistake_names_its_key() -> None:
    assert _error({"agent": "pkg.mod:solve", "backend": {"model": "m"}}) == \
        "config error: data: is required, and missing"
    assert _error({**MINIMAL, "backend": {}}) == "config error: backend.model: is required, and missing"
    assert _error({**MINIMAL, "data": {"path": "t", "group_size": 2.5}}) == \
        "config error: data.group_size: 2.5 is not an integer"
    assert _error({**MINIMAL, "algorithm": {"clip_epsilon": 1.5}}) == \
        "config error: algorithm.clip_epsilon: must be less than 1, got 1.5"
    assert _error({**MINIMAL, "credit": {"gamma": -0.1}}) == "config error: credit.gamma: must be at least 0, got -0.1"
    assert _error({**MINIMAL, "server": {"port": 70000}}) == \
        "config error: server.port: must be at most 65535, got 70000"
    assert _error({**MINIMAL, "backend": {"model": "m", "lora": {"alpha": 0}}}) == \
        "config error: backend.lora.alpha: must be greater than 0, got 0"
    assert _error({**MINIMAL, "backend": {"model": "m", "verl": {"advantages": "gae"}}}) == \
        "config error: backend.verl.advantages: 'gae' is not one of: agl, grpo, rloo"
    assert _error({**MINIMAL, "run": {"resume": "yes"}}) == "config error: run.resume: 'yes' is not true or false"
    assert _error({**MINIMAL, "base_dir": "/"}).startswith("config error: base_dir: unknown key; allowed: data, agent")
    assert _error({**MINIMAL, "algorithm": {"clip_epsilon": 0.3, "clip_epsilon_high": 0.2}}) == \
        "config error: algorithm.clip_epsilon_high: must be at least algorithm.clip_epsilon (0.3), got 0.2"
    assert _error({**MINIMAL, "server": {"url": "127.0.0.1:8000"}}) == \
        "config error: server.url: must be an http:// or https:// URL, got '127.0.0.1:8000'"
    assert _error({**MINIMAL, "workers": {"count": 0, "ray": "auto"}}) == \
        "config error: workers.count: must be at least 1 with workers.ray (the number of Ray actors)"
    assert _error({**MINIMAL, "credit": {"method": "final", "function": "pkg.mod:credit"}}) == \
        "config error: credit.function: is only used with credit.method: custom, not final"
    # null would let each call sample at its agent's temperature while the trainer computes at one (before: allowed)
    assert _error({**MINIMAL, "algorithm": {"temperature": None}}).startswith(
        "config error: algorithm.temperature: must be a number: with null each call would sample at the temperature")


def test_several_mistakes_are_all_reported_one_line_each() -> None:
    with pytest.raises(ConfigErrors) as info:
        validate({**MINIMAL, "algorithm": {"row_mode": "rows", "lr": 0}})
    assert str(info.value).splitlines() == [
        "config error: algorithm.lr: must be greater than 0, got 0",
        "config error: algorithm.row_mode: 'rows' is not one of: transition, trajectory",
    ]
    assert info.value.key == "algorithm.lr"


def test_overrides_are_yaml_scalars_and_build_missing_sections() -> None:
    raw = apply_overrides(MINIMAL, ["algorithm.lr=3e-4", "backend.lora=null", "workers.ray=auto", "run.resume=false",
                                    "air.tool_error=-0.5", "backend.lora.target_modules=[q_proj, v_proj]",
                                    "air.truncated=-0.25"])
    assert MINIMAL.get("algorithm") is None  # the caller's dict is left alone
    config = validate(raw)
    assert config.algorithm.lr == pytest.approx(3e-4)  # YAML reads 3e-4 as a string: the float field parses it
    assert config.backend.lora is not None and config.backend.lora.target_modules == ["q_proj", "v_proj"]
    assert config.workers.ray == "auto" and config.run.resume is False and config.air.tool_error == -0.5
    assert transition_builder(config).air.truncated == -0.25


def test_relative_paths_are_taken_from_the_config_files_folder(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "tasks.json").write_text(json.dumps([{"q": 1}, {"q": 2}]), encoding="utf-8")
    (tmp_path / "sub" / "model").mkdir()
    (tmp_path / "sub" / "model" / "config.json").write_text("{}", encoding="utf-8")
    (tmp_path / "sub" / "train.yaml").write_text(
        "data: {path: tasks.json, group_size: 2}\nagent: json:loads\nbackend: {model: model}\nrun: {dir: out}\n",
        encoding="utf-8")
    config = load_config(tmp_path / "sub" / "train.yaml")
    assert isinstance(config, Config)
    assert config.path(config.run.dir) == str(tmp_path / "sub" / "out")
    assert config.path("/abs/x") == "/abs/x"
    assert load_tasks(config) == [{"q": 1}, {"q": 2}]


def test_the_data_set_must_hold_tasks(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n", encoding="utf-8")
    (tmp_path / "obj.json").write_text('{"q": 1}', encoding="utf-8")
    base = validate(MINIMAL, base_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"^config error: data.path: .*empty.jsonl holds no tasks$"):
        load_tasks(base.model_copy(update={"data": base.data.model_copy(update={"path": "empty.jsonl"})}))
    with pytest.raises(ConfigError, match=r"obj.json must hold a JSON list of tasks, got a dict$"):
        load_tasks(base.model_copy(update={"data": base.data.model_copy(update={"path": "obj.json"})}))


def test_a_file_that_is_not_a_mapping_or_is_empty(tmp_path: Path) -> None:
    (tmp_path / "list.yaml").write_text("- a\n- b\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "list.yaml")
    assert str(info.value) == (f"config error: {tmp_path / 'list.yaml'} must hold a mapping of sections (data, agent, "
                               "backend, ...), got a list")
    (tmp_path / "empty.yaml").write_text("", encoding="utf-8")
    with pytest.raises(ConfigErrors) as many:
        load_config(tmp_path / "empty.yaml")
    assert [e.key for e in many.value.errors] == ["data", "agent", "backend"]


def test_the_run_is_built_as_the_config_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A custom credit function, AIR rules and agent_match reach the transition builder and the training loop."""
    from agl_core.credit import assign
    from agl_trainer.config import transition_builder
    from agl_trainer.train_cli import _train_config

    source = "def last(rewards, final):\n    return [0.0] * (len(rewards) - 1) + [final]\n"
    (tmp_path / "my_credit.py").write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = validate({**MINIMAL, "credit": {"method": "custom", "function": "my_credit:last"},
                       "agent_match": "writer", "air": {"tool_error": -0.25},
                       "algorithm": {"row_mode": "transition", "max_prompt_length": 64, "max_response_length": 16,
                                     "scale_advantages": False},
                       "data": {"path": "t.jsonl", "group_size": 3, "tasks_per_step": 5}}, base_dir=str(tmp_path))
    builder = transition_builder(config)
    assert builder.agent_match.pattern == "writer" and builder.air.tool_error == -0.25 and builder.air.tool_ok is None
    assert assign([None, 0.5], 1.0, builder.credit) == [0.0, 1.0]
    train = _train_config(config, str(tmp_path / "out"))
    assert (train.tasks_per_step, train.group_size, train.row_mode) == (5, 3, "transition")
    assert (train.max_prompt_length, train.max_response_length, train.scale_advantages) == (64, 16, False)
    assert train.credit is None  # the builder credits the whole run; the loop takes its credited rewards as they are
    assert train.checkpoint_dir == str(tmp_path / "out" / "checkpoint") and train.curves_dir == str(tmp_path / "out")
