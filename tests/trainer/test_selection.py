"""What is trained, and that a selection which selects nothing says so: a step of the real loop (worker, server,
gateway, torch engine serving a tiny Llama built in code) whose agent has two named agents, ``write_query`` and
``check_query``, as Agent Lightning's spider agent has.
"""

from __future__ import annotations

import copy
import logging
import threading
from pathlib import Path
from typing import Any

import openai
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import agl_core as agl  # noqa: E402
from agl_core import collector, semconv  # noqa: E402
from agl_core.store.http import ServerError  # noqa: E402
from agl_core.testing import FakeOpenAI  # noqa: E402
from agl_core.transitions import TransitionBuilder  # noqa: E402
from agl_core.worker import Worker, point_openai_at  # noqa: E402
from agl_trainer.demo.policy import PolicySpec, build_model, build_tokenizer  # noqa: E402
from agl_trainer.engine import TorchEngine  # noqa: E402
from agl_trainer.gateway import GatewayConfig, training_sampling  # noqa: E402
from agl_trainer.server import ServerConfig, ServerThread, TrainerServer  # noqa: E402
from agl_trainer.torch_backend import TorchBackend, TorchConfig  # noqa: E402
from agl_trainer.training import StepResult, TrainConfig, Trainer  # noqa: E402

from .conftest import ServerFactory  # noqa: E402

torch.set_num_threads(1)

ACTIONS = ["a", "b"]


def _as_agent(name: str, prompt: str) -> str:
    """One call made inside an ``invoke_agent`` span, as a framework's plugin records an agent's step."""
    with collector.tracer().start_as_current_span(
            semconv.agent_span_name(name),
            attributes={semconv.GEN_AI_OPERATION_NAME: "invoke_agent", semconv.GEN_AI_AGENT_NAME: name}):
        reply = openai.OpenAI(max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=1)
    return (reply.choices[0].message.content or "").strip()


def write_then_check(task: dict[str, Any]) -> float:
    query = _as_agent("write_query", "door")
    _as_agent("check_query", "red")
    return 1.0 if query == "a" else 0.0


def one_step(folder: Path, builder: TransitionBuilder, agent: Any = write_then_check) -> tuple[StepResult, Trainer]:
    spec = PolicySpec(["user", "assistant", "door", "red"], [], ACTIONS)
    tokenizer = build_tokenizer(spec)
    served = build_model(tokenizer, spec, seed=0, hidden=16, layers=1)
    engine = TorchEngine(served, tokenizer, name="tiny", seed=0, max_batch=8, batch_wait_s=0.003, default_max_tokens=1)
    backend = TorchBackend(copy.deepcopy(served), TorchConfig(lr=1e-2), pad_id=tokenizer.pad_token_id)
    server = TrainerServer(ServerConfig(db_path=str(folder / "agl.db"), port=0, builder=builder,
                                        gateway=GatewayConfig(sampling_overrides=training_sampling(1.0))), engine)
    thread = ServerThread(server).start()
    point_openai_at(thread.url, None)
    worker = Worker(thread.url, agent, concurrency=4, poll_s=0.05, grace_s=2.0)
    running = threading.Thread(target=worker.run, daemon=True)
    running.start()
    trainer = Trainer(server, backend, engine, [{"id": "t"}], TrainConfig(tasks_per_step=1, group_size=4,
                                                                         step_timeout_s=60))
    try:
        (result,) = trainer.run(1)
    finally:
        worker.stop(now=True)
        running.join(timeout=10)
        thread.stop()
    return result, trainer


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # the worker points it at the gateway
    monkeypatch.setenv("OPENAI_API_KEY", "unset")
    logging.getLogger("agl.worker").setLevel(logging.ERROR)


def test_agent_match_write_trains_write_query_and_not_check_query(tmp_path: Path) -> None:
    result, trainer = one_step(tmp_path, TransitionBuilder(agent_match="write"))
    assert result.transitions == 4 and not result.metrics["warn_nothing_trained"]
    assert trainer.last_batch is not None
    assert {t.agent_name for s in trainer.last_batch.scored for t in s.trajectory.transitions} == {"write_query"}


def test_a_step_that_trains_nothing_says_so_naming_the_agents_seen(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agl.trainer"):
        result, _ = one_step(tmp_path, TransitionBuilder(agent_match="^write$"))  # a whole-name habit: matches none
    assert result.transitions == 0 and result.metrics["warn_nothing_trained"] == 1.0
    line = result.warnings[0]
    assert line.startswith("no transition trained: 4 rollouts, none of their LLM calls was selected; agent names "
                           "seen: 'check_query' (4), 'write_query' (4); left out: ")
    assert "4 x agent 'write_query' does not match agent_match '^write$'" in line
    assert [r.getMessage() for r in caplog.records if "no transition trained" in r.getMessage()] == [
        f"agl train: step 1: {line}"]


# ---------------------------------------------------------------------- one source of truth for what is trained

CODE_BUILDER = TransitionBuilder(agent_match="write")


@agl.rollout_fn(builder=CODE_BUILDER)
def checker_excluded_in_code(task: dict[str, Any]) -> float:
    return write_then_check(task)


def test_a_checker_excluded_in_code_is_never_trained(tmp_path: Path) -> None:
    """The server (as `agl serve` starts it: no --agent-match) builds what the agent's own builder says."""
    result, trainer = one_step(tmp_path, TransitionBuilder(), checker_excluded_in_code)
    assert result.transitions == 4
    assert trainer.last_batch is not None
    assert {t.agent_name for s in trainer.last_batch.scored for t in s.trajectory.transitions} == {"write_query"}
    server = trainer.server
    assert isinstance(server, TrainerServer) and server.builder.settings() == {"agent_match": "write"}
    stored = agl.SqliteStore(str(tmp_path / "agl.db")).transitions()
    assert len(stored) == 4 and {t.agent_name for t in stored} == {"write_query"}


def test_a_conflict_between_the_code_and_the_server_stops_the_worker_at_start(fake: FakeOpenAI,
                                                                             make_server: ServerFactory) -> None:
    thread = make_server(fake, builder=TransitionBuilder(agent_match="check"), builder_source="agl serve --agent-match")
    worker = Worker(thread.url, checker_excluded_in_code, poll_s=0.05)
    with pytest.raises(ServerError) as info:
        worker.run()
    server = thread.server
    assert info.value.status == 409
    assert (f"agent_match: agl serve --agent-match says 'check', the agent's @agl.rollout_fn builder "
            f"({__name__}:checker_excluded_in_code) says 'write'") in str(info.value)
    assert worker.stats.leased == 0 and server.builder.settings() == {"agent_match": "check"}


def test_a_conflict_between_the_code_and_the_training_config_is_a_config_error() -> None:
    from agl_trainer.config import ConfigError, transition_builder, validate

    config = validate({"data": {"path": "t.jsonl"}, "agent": "pkg.mod:solve", "backend": {"model": "m"},
                       "agent_match": "^write_query$", "air": {"tool_error": -0.5}})
    with pytest.raises(ConfigError) as info:
        transition_builder(config, CODE_BUILDER)
    assert str(info.value).startswith("config error: agent_match: two transition builders disagree (agent_match: "
                                      "the agent's @agl.rollout_fn builder (pkg.mod:solve) says 'write', the config "
                                      "says '^write_query$')")
    joined = transition_builder(validate({**config.model_dump(exclude={"agent_match"}), "air": {"tool_error": -0.5}}),
                                CODE_BUILDER)
    assert joined.settings() == {"agent_match": "write", "air": {"tool_error": -0.5}}  # each key set in one place
