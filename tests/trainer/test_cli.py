"""``agl serve``, ``agl demo`` and ``agl train`` wired into the one ``agl`` command, and the reading
commands (``traces``, ``export``, ``doctor``) against a running ``agl serve`` over HTTP.

Everything runs through the real entry point (``.venvs/trainer/bin/agl``) in a subprocess; the
model behind the gateway is the fake vLLM-like server.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

import agl_core as agl
from agl_core.testing import FakeOpenAI

AGL = Path(sys.executable).parent / "agl"
TOKEN = "s3cret-token"


def agl_cli(*args: str, env: dict[str, str] | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    run_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    if "AGL_TOKEN" not in (env or {}):
        run_env.pop("AGL_TOKEN", None)
    out = subprocess.run([str(AGL), *args], capture_output=True, text=True, timeout=timeout, env=run_env)
    assert "Traceback" not in out.stderr, out.stderr  # errors are one clear line
    if check:
        assert out.returncode == 0, (out.stdout, out.stderr)
    return out


@pytest.fixture
def served(fake: FakeOpenAI, tmp_path: Path, subprocess_env: dict[str, str]) -> Iterator[str]:
    """``agl serve --port 0`` in a subprocess, in front of the fake model; yields the URL it printed."""
    command = [str(AGL), "serve", "--db", str(tmp_path / "served.db"), "--port", "0", "--backend", fake.url,
               "--model", "policy", "--token", TOKEN]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    try:
        match = re.fullmatch(r"agl serve: listening on (http://127\.0\.0\.1:\d+)\n", line)
        assert match, (line, proc.stderr.read() if proc.stderr and proc.poll() is not None else "")
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def test_serve_prints_its_url_and_the_reading_commands_use_it(served: str, tmp_path: Path) -> None:
    store = agl.HttpStore(served, TOKEN)
    client = openai.OpenAI(base_url=served + "/v1", api_key=TOKEN, max_retries=0)
    with agl.rollout(task_id="remote-1", store=store) as run:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello there"}])
        agl.emit_reward(0.75)
    assert run.store_error is None

    listed = agl_cli("traces", "list", "--server", served, env={"AGL_TOKEN": TOKEN}).stdout
    row = next(line for line in listed.splitlines() if run.id in line)
    assert row.split()[:7] == [run.id, "remote-1", "1", "succeeded", "0.75", str(len(store.spans(run.id))), "1"]

    shown = agl_cli("traces", "show", run.id, "--server", served, "--token", TOKEN).stdout
    lines = shown.splitlines()
    assert lines[0].startswith(f"rollout {run.id}  task remote-1  attempt 1  succeeded  reward 0.75")
    llm = next(line for line in lines if "LLM chat" in line)
    assert "→ 'hello there'" in llm and "transition #0 (gateway ids)" in llm
    assert lines[-1] == "└── reward 0.75  (final)"

    target = tmp_path / "remote.jsonl"
    agl_cli("export", "--server", served, "--token", TOKEN, str(target))
    (t,) = [agl.Transition.from_json(line) for line in target.read_text().splitlines()]
    assert (t.rollout_id, t.token_source) == (run.id, "gateway")

    doctor = agl_cli("doctor", "--server", served, "--token", TOKEN).stdout
    assert f"gateway {served} (from --server): reachable" in doctor
    assert "GET /healthz: 200" in doctor and "GET /v1/models: policy" in doctor and "agl server: yes" in doctor
    assert "token ids: exact: agl's gateway records prompt and response token ids per call (gateway)" in doctor
    refused = agl_cli("doctor", "--server", served, check=False)  # no token: the gateway says 401
    assert refused.returncode == 1 and f"GET {served}/v1/models: 401" in refused.stdout
    unauthorised = agl_cli("traces", "list", "--server", served, check=False)
    assert unauthorised.returncode == 1 and f"Error: cannot read {served}" in unauthorised.stderr


def test_doctor_probes_the_path_the_agents_client_will_use(served: str) -> None:
    without_v1 = agl_cli("doctor", "--probe", env={"OPENAI_BASE_URL": served, "OPENAI_API_KEY": TOKEN},
                         check=False).stdout
    assert "probe: chat completion 404, token ids not returned (POST /chat/completions, the path the agent's client " \
           "uses)" in without_v1, without_v1
    assert "is the base URL missing its /v1?" in without_v1
    with_v1 = agl_cli("doctor", "--probe", env={"OPENAI_BASE_URL": served + "/v1", "OPENAI_API_KEY": TOKEN}).stdout
    assert "probe: chat completion 200, token ids returned (POST /v1/chat/completions" in with_v1, with_v1
    root = agl_cli("doctor", "--probe", "--server", served, "--token", TOKEN).stdout  # agl worker adds the /v1
    assert "probe: chat completion 200, token ids returned (POST /v1/chat/completions" in root, root


def test_serve_bad_arguments_name_the_argument(fake: FakeOpenAI, tmp_path: Path) -> None:
    db = str(tmp_path / "x.db")
    cases = [
        ([], "Error: give exactly one of --backend URL (an OpenAI-compatible server) or --engine PATH"),
        (["--backend", fake.url, "--engine", "./model"], "Error: give exactly one of --backend URL"),
        (["--backend", fake.url, "--model-rule", "always"],
         "Invalid value for '--model-rule': 'always' is not one of 'override', 'strict', 'passthrough'."),
        (["--backend", fake.url, "--upstream", "judge"],
         "Invalid value for '--upstream': expected MODEL=http(s)://host:port/v1, got 'judge'"),
        (["--backend", fake.url, "--sampling-default", "temperature"],
         "Invalid value for '--sampling-default': expected KEY=VALUE, got 'temperature'"),
        (["--backend", fake.url, "--port", "70000"], "Invalid value for '--port': 70000 is not in the range"),
        (["--backend", fake.url, "--agent-match", "("], "Invalid value for '--agent-match': "),
    ]
    for args, message in cases:
        out = agl_cli("serve", "--db", db, *args, check=False)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    exposed = agl_cli("serve", "--db", db, "--host", "0.0.0.0", "--backend", fake.url, check=False,
                      env={"AGL_TOKEN": ""})
    assert exposed.returncode == 2 and exposed.stderr.startswith("agl serve: refusing to listen on 0.0.0.0 without "
                                                                 "a bearer token")
    assert not Path(db).exists()  # nothing was started


def test_serve_on_a_busy_port_says_so_in_one_line(fake: FakeOpenAI, tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = agl_cli("serve", "--db", str(tmp_path / "busy.db"), "--port", str(port), "--backend", fake.url,
                      check=False, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.strip().splitlines() == [
        f"agl serve: port {port} on 127.0.0.1 is already in use (another agl serve?): stop it, or pick another port "
        "with --port (--port 0 takes any free one)"], out.stderr


def test_serve_warns_at_start_when_the_backend_does_not_answer(tmp_path: Path,
                                                               subprocess_env: dict[str, str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    proc = subprocess.Popen([str(AGL), "serve", "--db", str(tmp_path / "w.db"), "--port", "0", "--backend", dead],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().startswith("agl serve: listening on ")
        warning = proc.stderr.readline()
        assert warning.startswith(f"agl serve: warning: the model backend at {dead} does not answer GET /models "
                                  "(it cannot be reached: "), warning
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def test_serve_help_keeps_every_option() -> None:
    text = agl_cli("serve", "--help").stdout
    for option in ("--db", "--host", "--port", "--token", "--backend", "--engine", "--backend-key",
                   "--backend-timeout", "--model", "--model-rule", "--sampling-default", "--sampling-override",
                   "--device", "--max-batch", "--agent-match", "--lease-timeout", "--max-attempts", "--retry-backoff",
                   "--max-body-mb", "--header-timeout", "--body-timeout", "--log-level"):
        assert re.search(rf"^\s+{option}\b", text, re.M), option
    assert "Usage: agl serve [OPTIONS]" in text


def test_python_m_agl_trainer_is_agl_serve() -> None:
    out = subprocess.run([sys.executable, "-m", "agl_trainer", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Usage: agl serve [OPTIONS]" in out.stdout


def test_train_is_wired() -> None:
    text = agl_cli("train", "--help").stdout
    assert "Usage: agl train [OPTIONS] CONFIG" in text and "--set" in text
    missing = agl_cli("train", check=False)
    assert missing.returncode == 2 and "Missing argument 'CONFIG'" in missing.stderr


def test_demo_is_wired() -> None:
    text = agl_cli("demo", "--help").stdout
    assert text.startswith("usage: agl demo") and "--fresh" in text and "--steps" in text
    bad = agl_cli("demo", "--steps", "many", check=False)
    assert bad.returncode == 2 and "argument --steps: invalid int value: 'many'" in bad.stderr


def test_help_lists_the_trainer_commands_without_importing_agl_trainer() -> None:
    out = agl_cli("--help", env={"PYTHONPROFILEIMPORTTIME": "1"})
    for name in ("demo", "serve", "train"):
        assert re.search(rf"^\s+{name}\s+\S", out.stdout, re.M), out.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")]
    assert not [m for m in imported if m.split(".")[0] in {"agl_trainer", "torch", "transformers", "starlette"}]
    assert "agl_core.cli" in imported
