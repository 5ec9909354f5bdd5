"""``agl train config.yaml`` through its real entry point, in a subprocess: config errors word for word, and a
real short training run of the demo's LangChain agent from a config file, then resumed.

The model is the demo's tiny policy, built in code and saved as a Hugging Face folder by the test
(``save_policy``); the agent is the demo's unchanged LangGraph agent (``agl_trainer.demo.lockers:solve``).
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("langgraph")

from agl_trainer.demo.lockers import TOOL_ERROR_REWARD, TOOL_OK_REWARD, Lockers  # noqa: E402
from agl_trainer.demo.policy import save_policy  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def agl_train() -> list[str]:
    """The ``agl train`` command: the installed ``agl`` once it has the command, else the module itself."""
    from agl_core import cli

    agl = Path(sys.executable).parent / "agl"
    commands = getattr(cli, "COMMANDS", None)
    if agl.exists() and (commands is None or "train" in commands):
        return [str(agl), "train"]
    return [sys.executable, "-m", "agl_trainer.train_cli"]


def run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "trainer"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([*agl_train(), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def write_setup(folder: Path, **changes: Any) -> Path:
    """A policy folder, a tasks file and a config in ``folder``; ``changes`` replace config sections."""
    lockers = Lockers(n=2, seed=0)
    if not (folder / "policy" / "config.json").exists():
        save_policy(folder / "policy", lockers, seed=0)
    with open(folder / "tasks.jsonl", "w", encoding="utf-8") as f:
        for task in lockers.tasks():
            f.write(json.dumps(task) + "\n")
    config: dict[str, Any] = {
        "data": {"path": "tasks.jsonl", "group_size": 8, "tasks_per_step": 2},
        "agent": "agl_trainer.demo.lockers:solve",
        "backend": {"name": "torch", "model": "policy", "device": "cpu", "threads": 1, "epochs": 2,
                    "minibatches": 2, "max_batch": 8},
        "algorithm": {"lr": 2e-3, "row_mode": "trajectory", "max_prompt_length": 64, "max_response_length": 32},
        "credit": {"method": "final"},
        "agent_match": "solver",
        "air": {"tool_ok": TOOL_OK_REWARD, "tool_error": TOOL_ERROR_REWARD},
        "workers": {"count": 8},
        "server": {"db": "agl.db"},
        "run": {"steps": STEPS, "dir": "out", "checkpoint_every": STEPS},
        **changes,
    }
    path = folder / "train.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


# ---------------------------------------------------------------------- config errors, word for word


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("train")
    write_setup(folder)
    return folder


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "algorithm.row_mode=rows"],
     "config error: algorithm.row_mode: 'rows' is not one of: transition, trajectory"),
    (["--set", "algorithm.rowmode=transition"],
     "config error: algorithm.rowmode: unknown key (did you mean row_mode?); allowed: name, clip_epsilon, "
     "clip_epsilon_high, kl_coef, lr, weight_decay, max_grad_norm, row_mode, max_prompt_length, max_response_length, "
     "scale_advantages, temperature"),
    (["--set", "backend.name=jax"], "config error: backend.name: 'jax' is not one of: torch, verl"),
    (["--set", "data.group_size=0"], "config error: data.group_size: must be greater than 0, got 0"),
    (["--set", "algorithm.lr=fast"], "config error: algorithm.lr: 'fast' is not a number"),
    (["--set", "credit.method=custom"],
     "config error: credit.function: required with credit.method: custom (pkg.module:function)"),
    (["--set", "agent=solve"], "config error: agent: must look like pkg.module:function, got 'solve'"),
    (["--set", "agent=no_such_module:solve"],
     "config error: agent: no module 'no_such_module' to import (for no_such_module:solve); is it on PYTHONPATH?"),
    (["--set", "air.custom=no_such_module:said_error"],
     "config error: air.custom: no module 'no_such_module' to import (for no_such_module:said_error); is it on "
     "PYTHONPATH?"),
    (["--set", "backend.device=gpu"], "config error: backend.device: 'gpu' is not one of: cpu, cuda, cuda:N, mps"),
    (["--set", "air.tool_eror=-1"],
     "config error: air.tool_eror: unknown key (did you mean tool_error?); allowed: tool_ok, tool_error, "
     "tool_exception, tool_timeout, tool_rejected, malformed_tool_call, truncated, custom"),
    (["--set", "algorithm.row_mode"], "config error: --set algorithm.row_mode: expected KEY=VALUE with a dotted KEY, "
                                      "e.g. algorithm.lr=1e-5"),
    (["--set", "agent.name=x"], "config error: agent: is 'agl_trainer.demo.lockers:solve', not a section: "
                                "--set agent.name cannot go inside it"),
])
def test_a_bad_key_or_value_is_named_with_what_it_takes(setup: Path, args: list[str], message: str) -> None:
    result = run(["train.yaml", *args], setup)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == message
    assert not (setup / "out").exists() and not (setup / "agl.db").exists()  # nothing started


def test_missing_files_and_bad_yaml_are_named(setup: Path) -> None:
    result = run(["train.yaml", "--set", "data.path=nope.jsonl"], setup)
    assert result.stderr.strip() == f"config error: data.path: no such file: {setup / 'nope.jsonl'}"
    result = run(["train.yaml", "--set", "backend.model=missing"], setup)
    assert result.stderr.strip() == (f"config error: backend.model: no such folder: {setup / 'missing'} (the torch "
                                     "backend needs a local Hugging Face model folder)")
    (setup / "broken.yaml").write_text("data:\n  path: [tasks.jsonl\nagent: x\n", encoding="utf-8")
    result = run(["broken.yaml"], setup)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("config error: broken.yaml line 3 is not valid YAML:")
    result = run(["absent.yaml"], setup)
    assert result.stderr.strip() == "config error: no such config file: absent.yaml"
    (setup / "bad.jsonl").write_text('{"a": 1}\n{oops}\n', encoding="utf-8")
    result = run(["train.yaml", "--set", "data.path=bad.jsonl"], setup)
    assert result.stderr.strip().startswith(f"config error: data.path: {setup / 'bad.jsonl'} line 2 is not JSON:")


def test_check_validates_and_stops(setup: Path) -> None:
    result = run(["train.yaml", "--check", "--set", "run.steps=7"], setup)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "agl train: train.yaml is valid: 2 tasks, backend torch, 7 steps of 2 tasks x 8"


# ---------------------------------------------------------------------- a real run


SIGNAL = ("ratio_first_mean", "ratio_first_min", "ratio_first_max", "sampler_kl", "clip_fraction", "advantage_mean",
          "advantage_std", "advantage_max_abs", "groups", "flat_groups", "truncated_rows", "prefix_mismatches",
          "no_reward_rollouts", "recomputed_logprobs")


def test_a_short_run_from_a_config_file_trains_records_and_resumes(tmp_path: Path) -> None:
    # at temperature 0.7: the gateway samples every call at it (whatever the agent asks) and the trainer computes
    # its logprobs at it, so before the first update of each step the importance ratio is 1
    write_setup(tmp_path, algorithm={"lr": 2e-3, "row_mode": "trajectory", "max_prompt_length": 64,
                                     "max_response_length": 32, "temperature": 0.7})
    result = run(["train.yaml"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    # each step's console line says whether it trained: grad norm, transitions trained, groups without spread
    lines = [line for line in result.stderr.splitlines() if line.startswith("step ")]
    assert len(lines) == STEPS, result.stderr[-3000:]
    for line, s in zip(lines, steps, strict=True):
        found = re.search(r"grad +(\S+) trained (\d+)/(\d+) transitions, (\d+)/(\d+) groups without spread", line)
        assert found, line
        grad, trained, selected, flat, groups = found.groups()
        assert float(grad) == pytest.approx(s["metrics"]["grad_norm"], abs=1e-4) and float(grad) > 0, line
        assert (int(trained), int(selected)) == (s["metrics"]["transitions_trained"], s["transitions"]), line
        assert 0 < int(trained) <= int(selected), line
        assert (int(flat), int(groups)) == (s["metrics"]["flat_groups"], s["metrics"]["groups"]) and int(groups) == 2
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["rollouts"] == 16 and s["failed_rollouts"] == 0 and s["rows"] > 0 for s in steps)
    assert all(s["prefix_mismatches"] == 0 for s in steps) and sum(s["merged"] for s in steps) > 0
    assert steps[-1]["version"] >= STEPS
    assert all("loss" in s["metrics"] for s in steps)
    # the signal's health, every step: sampler and trainer agree, advantages bounded (groups of 8: sqrt(7))
    for s in steps:
        assert set(SIGNAL) <= set(s["metrics"]), sorted(set(SIGNAL) - set(s["metrics"]))
        assert s["metrics"]["ratio_first_mean"] == pytest.approx(1.0, abs=1e-3)
        assert 1 - 1e-2 < s["metrics"]["ratio_first_min"] <= s["metrics"]["ratio_first_max"] < 1 + 1e-2
        assert s["metrics"]["advantage_max_abs"] <= 7 ** 0.5 + 1e-6
    assert not any("sampler/trainer mismatch" in line for line in result.stderr.splitlines())
    for name in ("reward_curve.png", "loss_curve.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"agl train: {STEPS} steps, reward" in result.stdout

    # the metrics of every step went to the server (its SQLite file: what GET /v1/metrics and the dashboard read)
    with sqlite3.connect(tmp_path / "agl.db") as conn:
        recorded = dict(conn.execute("SELECT step, value FROM trainer_metrics WHERE name = 'reward_mean'").fetchall())
        losses = conn.execute("SELECT count(*) FROM trainer_metrics WHERE name = 'loss'").fetchone()[0]
        names = {n for (n,) in conn.execute("SELECT DISTINCT name FROM trainer_metrics")}
        rollouts = conn.execute("SELECT count(*) FROM rollouts").fetchone()[0]
    assert sorted(recorded) == list(range(1, STEPS + 1)) and losses == STEPS and set(SIGNAL) <= names
    assert recorded[STEPS] == pytest.approx(steps[-1]["reward"])
    assert rollouts == STEPS * 16

    # the trained weights moved away from the folder's
    import torch
    from safetensors.torch import load_file

    initial = load_file(str(tmp_path / "policy" / "model.safetensors"))
    trained = torch.load(out / "checkpoint" / "trainer.pt", weights_only=True)["model"]
    assert any(not torch.equal(initial[k], trained[k]) for k in initial)

    # the same command with more steps resumes from the checkpoint; its step has groups of one rollout, which
    # have nothing to compare with (every advantage 0): agl train says so, in one line naming the cause
    again = run(["train.yaml", "--quiet", "--set", f"run.steps={STEPS + 1}", "--set", "data.group_size=1"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed"] is True
    assert [s["step"] for s in summary["steps"]] == list(range(1, STEPS + 2))
    assert summary["steps"][:STEPS] == steps
    assert "(resumed)" in again.stdout
    flat = f"agl train: step {STEPS + 1}: groups without spread: 2 of 2 groups scored every rollout alike and " \
           "train on nothing; the tasks are too easy or too hard for the policy, or group_size is too small"
    assert [line for line in again.stderr.splitlines() if "without spread" in line] == [flat]
    assert flat.removeprefix("agl train: ") in summary["warnings"]
    assert f"of {STEPS + 1} steps warned about the training signal (summary.json 'warnings')" in again.stderr


def test_a_step_that_trained_nothing_reads_so_on_its_console_line() -> None:
    from agl_trainer.train_cli import step_line
    from agl_trainer.training import StepResult

    flat = StepResult(step=3, reward=1.0, final_reward=1.0, rollouts=16, failed_rollouts=0, failed_tasks=0,
                      transitions=16, rows=0, merged=0, prefix_mismatches=0, rollout_s=2.0, update_s=0.0,
                      rollouts_per_s=8.0, version=3, time=0.0,
                      metrics={"groups": 2.0, "flat_groups": 2.0, "transitions_trained": 0.0})
    line = step_line(flat, 10, 12.0)
    assert line == ("step    3/10 [#######.................] reward  1.000 loss  0.0000 grad       - trained 0/16 "
                    "transitions, 2/2 groups without spread   8.0 rollouts/s    12 s")


def test_workers_as_ray_actors(tmp_path: Path) -> None:
    """``workers.ray: local``: the agent runs in Ray actors (a local cluster) against the run's own server."""
    pytest.importorskip("ray")
    write_setup(tmp_path, workers={"count": 2, "ray": "local", "actor_cpus": 0.5})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "trainer"), os.environ.get("PYTHONPATH", "")])}
    # The run's exit status is checked after a run that finished: Ray's shutdown at interpreter exit used to race
    # the thread still waiting on the actors and turn a finished run into status 1 (about one run in five here).
    # Popen, not run: the worker ids are checked against the trainer process's own pid below
    with subprocess.Popen([*agl_train(), "train.yaml", "--quiet", "--set", "run.steps=1", "--set",
                           "data.group_size=4"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        stdout, stderr = proc.communicate(timeout=400)
    assert proc.returncode == 0, stdout[-1500:] + stderr[-3000:]
    assert "core worker has already been shutdown" not in stderr, stderr[-3000:]
    steps = json.loads((tmp_path / "out" / "summary.json").read_text())["steps"]
    assert len(steps) == 1 and steps[0]["rollouts"] == 8 and steps[0]["failed_rollouts"] == 0 and steps[0]["rows"] > 0
    with sqlite3.connect(tmp_path / "agl.db") as conn:
        workers = {w for (w,) in conn.execute("SELECT DISTINCT worker_id FROM trainer_attempts")}
    # Each actor is a worker of its own (host-pid-nonce), in a Ray worker process, never the trainer's own
    # process. Both actors usually lease tasks, but on a loaded machine the first one up may drain all 8.
    assert 1 <= len(workers) <= 2, workers
    assert all(int(w.split("-")[-2]) != proc.pid for w in workers), (workers, proc.pid)
