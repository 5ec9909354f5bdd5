"""Validation in the training loop: a held-out set run at the start and every N steps through the same queue,
workers and gateway (a tiny Llama built in code, served by the torch engine), sampled with its own settings and
never trained on; its reward recorded per step; config errors naming the key.
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

from agl_core import collector, semconv  # noqa: E402
from agl_core.transitions import TransitionBuilder  # noqa: E402
from agl_core.worker import Worker, point_openai_at  # noqa: E402
from agl_trainer.config import ConfigError, validate  # noqa: E402
from agl_trainer.demo.policy import PolicySpec, build_model, build_tokenizer  # noqa: E402
from agl_trainer.engine import TorchEngine  # noqa: E402
from agl_trainer.gateway import GatewayConfig, training_sampling  # noqa: E402
from agl_trainer.server import ServerConfig, ServerThread, TrainerServer  # noqa: E402
from agl_trainer.torch_backend import TorchBackend, TorchConfig  # noqa: E402
from agl_trainer.training import StepBatch, TrainConfig, Trainer, ValidationResult, ValidationSpec  # noqa: E402

torch.set_num_threads(1)

TRAIN_WORD, HELD_OUT_WORD = "door", "red"
TRAIN_TASKS = [{"id": "t1", "word": TRAIN_WORD}]
HELD_OUT = [{"id": "v1", "word": HELD_OUT_WORD}, {"id": "v2", "word": HELD_OUT_WORD}]


class SeenByEngine:
    """The torch engine behind the gateway, unchanged; each request body that reaches it is kept."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.bodies: list[dict[str, Any]] = []

    async def complete(self, endpoint: Any, body: dict[str, Any]) -> Any:
        self.bodies.append(copy.deepcopy(body))
        return await self.engine.complete(endpoint, body)

    async def stream(self, endpoint: Any, body: dict[str, Any]) -> Any:
        self.bodies.append(copy.deepcopy(body))
        return await self.engine.stream(endpoint, body)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def agent(task: dict[str, Any]) -> float:
    """One ``write_query`` call; reward 1 when the policy answers 'a'."""
    with collector.tracer().start_as_current_span(
            semconv.agent_span_name("write_query"),
            attributes={semconv.GEN_AI_OPERATION_NAME: "invoke_agent", semconv.GEN_AI_AGENT_NAME: "write_query"}):
        reply = openai.OpenAI(max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": task["word"]}], max_tokens=1, temperature=0.9)
    return 1.0 if (reply.choices[0].message.content or "").strip() == "a" else 0.0


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # the worker points it at the gateway
    monkeypatch.setenv("OPENAI_API_KEY", "unset")
    logging.getLogger("agl.worker").setLevel(logging.ERROR)


def train(folder: Path, steps: int, validation: ValidationSpec) -> tuple[Trainer, TrainerServer, SeenByEngine,
                                                                         list[StepBatch], dict[str, Any]]:
    """``steps`` steps of the real loop; also returns, read before the server stops, its metrics and task ids."""
    spec = PolicySpec(["user", "assistant", TRAIN_WORD, HELD_OUT_WORD], [], ["a", "b"])
    tokenizer = build_tokenizer(spec)
    served = build_model(tokenizer, spec, seed=0, hidden=16, layers=1)
    engine = TorchEngine(served, tokenizer, name="tiny", seed=0, max_batch=8, batch_wait_s=0.003, default_max_tokens=1)
    seen = SeenByEngine(engine)
    backend = TorchBackend(copy.deepcopy(served), TorchConfig(lr=1e-2), pad_id=tokenizer.pad_token_id)
    server = TrainerServer(ServerConfig(db_path=str(folder / "agl.db"), port=0, builder=TransitionBuilder(),
                                        gateway=GatewayConfig(sampling_overrides=training_sampling(1.0))), seen)
    thread = ServerThread(server).start()
    point_openai_at(thread.url, None)
    worker = Worker(thread.url, agent, concurrency=4, poll_s=0.05, grace_s=2.0)
    running = threading.Thread(target=worker.run, daemon=True)
    running.start()
    trainer = Trainer(server, backend, engine, TRAIN_TASKS,
                      TrainConfig(tasks_per_step=1, group_size=4, step_timeout_s=60, validation=validation,
                                  curves_dir=str(folder / "curves")))
    batches: list[StepBatch] = []
    read: dict[str, Any] = {}
    try:
        trainer.run(steps, on_step=lambda _: batches.append(trainer.last_batch))  # type: ignore[arg-type]
        read["metrics"] = {r["step"]: r["values"] for r in server.metrics()}
        read["task_of"] = {r.id: r.task["id"] for r in server.store.rollouts()}
    finally:
        worker.stop(now=True)
        running.join(timeout=10)
        thread.stop()
    return trainer, server, seen, batches, read


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trainer, TrainerServer, SeenByEngine, list[StepBatch],
                                                           dict[str, Any]]:
    mp = pytest.MonkeyPatch()
    mp.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    mp.setenv("OPENAI_API_KEY", "unset")
    try:
        return train(tmp_path_factory.mktemp("validation"), 3, ValidationSpec(HELD_OUT, every=2, repeat=2))
    finally:
        mp.undo()


def test_validation_runs_at_the_start_every_n_steps_and_after_the_last(run: Any) -> None:
    trainer, _, _, _, _ = run
    assert [v.step for v in trainer.validations] == [0, 2, 3]
    assert all(v.rollouts == len(HELD_OUT) * 2 and v.failed_rollouts == 0 and v.no_reward == 0
               for v in trainer.validations)


def test_validation_rollouts_never_become_training_rows(run: Any) -> None:
    trainer, _, _, batches, read = run
    held_out = {i for v in trainer.validations for i in v.rollout_ids}
    assert len(held_out) == 3 * len(HELD_OUT) * 2
    assert {read["task_of"][i] for i in held_out} == {"v1", "v2"}
    assert {read["task_of"][s.rollout_id] for b in batches for s in b.scored} == {"t1"}
    trained = {s.rollout_id for b in batches for s in b.scored}
    assert len(batches) == 3 and len(trained) == 3 * 4 and not trained & held_out
    prompts = [t.prompt[-1]["content"] for b in batches for s in b.scored for t in s.trajectory.transitions]
    assert prompts and set(prompts) == {TRAIN_WORD}
    assert sum(b.row_stats.rows for b in batches) == 3 * 4  # trajectory rows: one per training rollout, none more


def test_validation_calls_sample_with_their_own_temperature(run: Any) -> None:
    _, _, seen, _, _ = run
    word = {TRAIN_WORD: "train", HELD_OUT_WORD: "validation"}
    by_kind: dict[str, set[tuple[Any, Any]]] = {"train": set(), "validation": set()}
    for body in seen.bodies:
        by_kind[word[body["messages"][-1]["content"]]].add((body["temperature"], body.get("top_p")))
    # the agent asks for 0.9; training pins 1.0 (no top_p cut), the validation its own 0.0 (the agent's top_p)
    assert by_kind == {"train": {(1.0, 1.0)}, "validation": {(0.0, None)}}
    assert sum(1 for b in seen.bodies if b["messages"][-1]["content"] == HELD_OUT_WORD) == 3 * len(HELD_OUT) * 2


def test_the_gateway_samples_as_training_again_after_a_validation(run: Any) -> None:
    _, server, _, _, _ = run
    assert server.gateway.config.sampling_overrides == training_sampling(1.0)


def test_validation_reward_is_a_metric_of_its_step(run: Any) -> None:
    trainer, _, _, _, read = run
    rows = read["metrics"]
    assert sorted(rows) == [0, 1, 2, 3]
    for v in trainer.validations:
        assert rows[v.step]["validation_reward_mean"] == pytest.approx(v.reward)
        assert rows[v.step]["validation_rollouts"] == 4.0
    assert "validation_reward_mean" not in rows[1] and "reward_mean" in rows[1]
    assert "reward_mean" in rows[2] and "reward_mean" not in rows[0]  # a step's own numbers are kept beside it
    assert (Path(trainer.config.curves_dir or "") / "reward_curve.png").stat().st_size > 0


def test_a_resumed_run_keeps_its_validations(tmp_path: Path) -> None:
    trainer, _, _, _, _ = train(tmp_path, 1, ValidationSpec(HELD_OUT[:1], every=5, at_start=False))
    assert [v.step for v in trainer.validations] == [1]  # no start; the last step always
    trainer.config.checkpoint_dir = str(tmp_path / "ckpt")
    trainer.save()
    extra = trainer.backend.load(trainer.config.checkpoint_dir)  # what Trainer.resume reads
    assert [ValidationResult.from_dict(v) for v in extra["validations"]] == trainer.validations


# ---------------------------------------------------------------------- config


BASE: dict[str, Any] = {"data": {"path": "tasks.jsonl"}, "agent": "pkg.agent:run", "backend": {"model": "m"}}


@pytest.mark.parametrize(("section", "message"), [
    ({"path": "val.jsonl", "every": 0}, "config error: validation.every: must be greater than 0, got 0"),
    ({"path": "val.jsonl", "sampling": {"temprature": 0.5}},
     "config error: validation.sampling.temprature: unknown key (did you mean temperature?); allowed: temperature, "
     "top_p, top_k, max_tokens, seed"),
    ({"path": "val.jsonl", "sampling": {"temperature": -1}},
     "config error: validation.sampling.temperature: must be at least 0, got -1"),
    ({"every": 3}, "config error: validation.path: is required, and missing"),
    ({"path": "val.jsonl", "evry": 3}, "config error: validation.evry: unknown key (did you mean every?); allowed: "
                                       "path, every, at_start, repeat, max_tasks, sampling"),
    ("val.jsonl", "config error: validation: must be a mapping (keys: path, every, at_start, repeat, max_tasks, "
                  "sampling), got 'val.jsonl'"),
])
def test_a_bad_validation_section_is_named_by_its_key(section: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate({**BASE, "validation": section})
    assert str(err.value) == message


def test_validation_files_and_backends_that_cannot_validate_are_named(tmp_path: Path) -> None:
    from agl_trainer.config import load_validation_tasks

    config = validate({**BASE, "validation": {"path": "missing.jsonl"}}, base_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"^config error: validation.path: no such file: .*missing.jsonl$"):
        load_validation_tasks(config)
    (tmp_path / "val.jsonl").write_text('{"id": "v1"}\n{"id": "v2"}\n')
    config = validate({**BASE, "validation": {"path": "val.jsonl", "max_tasks": 1}}, base_dir=str(tmp_path))
    assert load_validation_tasks(config) == [{"id": "v1"}] and config.validation is not None
    assert config.validation.sampling.overrides() == {"temperature": 0.0}  # greedy unless told otherwise
    with pytest.raises(ConfigError, match=r"^config error: validation: is not available with server.url yet"):
        validate({**BASE, "server": {"url": "http://127.0.0.1:8000"}, "validation": {"path": "val.jsonl"}})
    with pytest.raises(ConfigError, match=r"^config error: validation: is run by the torch backend's loop"):
        validate({**BASE, "backend": {"model": "m", "name": "verl"}, "validation": {"path": "val.jsonl"}})


# ---------------------------------------------------------------------- through `agl train` itself


def test_agl_train_validates_at_the_start_and_every_n_steps_through_its_cli(tmp_path: Path) -> None:
    """``agl train train.yaml`` with a ``validation`` section, in a subprocess: the demo's LangGraph agent on its
    tiny policy; the held-out set runs before step 1 and after step 2, greedy (every repeat of a task answers
    alike, where training samples vary), never trained on, its reward in summary.json, the server's metrics,
    the console and the reward curve."""
    import json
    import sqlite3

    import agl_core as agl

    from .test_train import run as agl_train_run
    from .test_train import write_setup

    write_setup(tmp_path, run={"steps": 2, "dir": "out", "checkpoint_every": 2},
                data={"path": "tasks.jsonl", "group_size": 4, "tasks_per_step": 2},
                validation={"path": "tasks.jsonl", "every": 2, "repeat": 3})
    check = agl_train_run(["train.yaml", "--check"], tmp_path)
    assert check.stdout.strip() == ("agl train: train.yaml is valid: 2 tasks, backend torch, 2 steps of 2 tasks x 4, "
                                    "2 validation tasks every 2 steps")
    result = agl_train_run(["train.yaml"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    validations = summary["validation"]
    assert [v["step"] for v in validations] == [0, 2]
    assert all(v["rollouts"] == 6 and v["failed_rollouts"] == 0 and v["sampling"] == {"temperature": 0.0}
               for v in validations)
    assert [s["rollouts"] for s in summary["steps"]] == [8, 8]  # a step trains on its own rollouts alone
    lines = [line for line in result.stderr.splitlines() if line.startswith("validation at step")]
    assert [line.split(":")[0] for line in lines] == ["validation at step 0", "validation at step 2"]
    assert (f"agl train: validation reward {validations[0]['reward']:.3f} at step 0 -> "
            f"{validations[1]['reward']:.3f} at step 2 (2 validations)") in result.stdout
    assert (tmp_path / "out" / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"

    with sqlite3.connect(tmp_path / "agl.db") as conn:  # what GET /v1/metrics and the dashboard's curves read
        recorded = dict(conn.execute(
            "SELECT step, value FROM trainer_metrics WHERE name = 'validation_reward_mean'").fetchall())
    assert recorded == {0: pytest.approx(validations[0]["reward"]), 2: pytest.approx(validations[1]["reward"])}

    store = agl.SqliteStore(str(tmp_path / "agl.db"))
    try:
        held_out = {i for v in validations for i in v["rollout_ids"]}
        responses: dict[tuple[str, str], set[str]] = {}
        for traj in store.trajectories():
            kind = "validation" if traj.rollout_id in held_out else "train"
            text = json.dumps([t.response_token_ids for t in traj.transitions])
            responses.setdefault((kind, traj.task_id.split("#")[0]), set()).add(text)  # one step's group or repeats
    finally:
        store.close()
    assert len(held_out) == 12
    validation = {k: v for k, v in responses.items() if k[0] == "validation"}
    assert len(validation) == 4 and all(len(v) == 1 for v in validation.values())  # greedy: 3 repeats, one answer
    assert any(len(v) > 1 for k, v in responses.items() if k[0] == "train")  # sampled at 1.0: the group differs
