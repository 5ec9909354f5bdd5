"""Training against a remote server: ``agl serve`` (the torch engine) in one process, ``agl train`` in another.

The trainer reaches the server only over HTTP on 127.0.0.1: it enqueues the step's tasks, its
workers run the demo's LangGraph agent against the server's gateway, it reads the rollouts back
(rebuilding their transitions from the stored spans with its own ``agent_match`` and AIR rules),
and publishes each new version as a safetensors file that the server's engine loads
(``POST /v1/model``). Nothing of the server is shared but the port and the weights folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("langgraph")
httpx = pytest.importorskip("httpx")

from agl_trainer.token_records import MODEL_VERSION_ATTRIBUTE  # noqa: E402

from .test_train import REPO, STEPS, run, write_setup  # noqa: E402


@contextmanager
def agl_serve(tmp_path: Path, *options: str) -> Iterator[str]:
    """The demo's policy served by ``agl serve --engine`` in its own process; yields its URL."""
    write_setup(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "trainer"), os.environ.get("PYTHONPATH", "")])}
    agl = Path(sys.executable).parent / "agl"  # the real `agl serve`, as a user starts it
    serve = [str(agl), "serve"] if agl.exists() else [sys.executable, "-m", "agl_trainer.cli"]
    command = [*serve, "--engine", str(tmp_path / "policy"), "--model", "policy",
               "--port", "0", "--db", str(tmp_path / "server.db"), "--max-batch", "8", *options]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("agl serve: listening on "), (line, proc.stderr.read() if proc.stderr else "")
        yield line.split()[-1]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """``agl serve`` sampling as training needs (``--train-temperature``, algorithm.temperature's 1.0)."""
    with agl_serve(tmp_path, "--train-temperature", "1.0") as url:
        yield tmp_path, url


def test_a_server_that_samples_otherwise_is_refused_before_the_run_starts(tmp_path: Path) -> None:
    # agl serve passes the agent's temperature (and top_p, top_k) through by default: the calls would be
    # sampled from whatever each agent asked for, while the trainer computes its logprobs at 1.0
    with agl_serve(tmp_path) as url:
        result = run(["train.yaml", "--quiet", "--set", f"server.url={url}"], tmp_path)
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.startswith("config error: server.url: the server's gateway does not sample as this run "
                                        "trains (temperature passed through from the agent")
        assert "agl serve ... --train-temperature 1`" in result.stderr
        assert httpx.get(f"{url}/v1/tasks").json()["tasks"] == []  # nothing was enqueued
    with agl_serve(tmp_path, "--train-temperature", "0.7") as url:  # pinned, but not at this run's temperature
        result = run(["train.yaml", "--quiet", "--set", f"server.url={url}"], tmp_path)
        assert result.returncode == 2 and "temperature=0.7" in result.stderr


def test_the_trainer_drives_a_server_in_another_process_over_http(served: tuple[Path, str]) -> None:
    folder, url = served
    initial = httpx.get(f"{url}/v1/model").json()
    assert initial["version"] == 0 and initial["sampling"]["temperature"] == 1.0 and initial["sampling"]["top_k"] == -1
    result = run(["train.yaml", "--quiet", "--set", f"server.url={url}"], folder)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = json.loads((folder / "out" / "summary.json").read_text())["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    # the trainer's own builder chose the solver's calls: rows merged, the reporter's calls left out
    assert all(s["rollouts"] == 16 and s["failed_rollouts"] == 0 and s["rows"] > 0 for s in steps)
    assert sum(s["merged"] for s in steps) > 0 and all(s["prefix_mismatches"] == 0 for s in steps)

    # the server serves the last version, loaded from the file the trainer wrote; older files are gone
    model = httpx.get(f"{url}/v1/model").json()
    assert model["version"] == steps[-1]["version"] >= STEPS
    weights = Path(model["weights"])
    assert weights.parent == folder / "out" / "weights" and weights.exists()
    assert sorted(p.name for p in weights.parent.iterdir()) == [weights.name]
    from safetensors.torch import load_file

    served_now = load_file(str(weights))
    initial_weights = load_file(str(folder / "policy" / "model.safetensors"))
    assert any(not torch.equal(served_now[k], initial_weights[k]) for k in initial_weights)

    # the later rollouts were answered by later versions: the server recorded which one answered each call
    rollouts = httpx.get(f"{url}/v1/rollouts").json()["rollouts"]
    assert len(rollouts) == STEPS * 16
    last = httpx.get(f"{url}/v1/rollouts/{rollouts[-1]['id']}").json()
    versions = {s["attributes"].get(MODEL_VERSION_ATTRIBUTE) for s in last["spans"]} - {None}
    assert versions and min(versions) >= STEPS - 1

    # the metrics went to the server over HTTP (POST /v1/metrics), one record per step
    metrics = httpx.get(f"{url}/v1/metrics").json()["data"]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert metrics[-1]["values"]["reward_mean"] == pytest.approx(steps[-1]["reward"])
    assert "loss" in metrics[-1]["values"] and "rollouts_per_s" in metrics[-1]["values"]
