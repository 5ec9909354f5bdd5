"""Processes for the scale and crash tests (server, fake model, workers) and the check of every transition.

Every process is started through :class:`Processes`, which kills what is still
running when the test ends, passed or failed, so no test leaves an orphan.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from scale_agents import KINDS, lookup_value

from agl_core.testing import render_prompt, tokenize

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PYTHON = sys.executable
FULL = os.environ.get("AGL_FULL") == "1"
"""The full counts (1,000 rollouts over 64 workers, longer crash runs) instead of CI's shorter ones."""
SEED = int(os.environ.get("AGL_SCALE_SEED", "20261130"))
"""Seeds the tasks and the crash schedule; a failing run prints it, and setting it replays the run."""


def child_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO / "src"), str(REPO / "trainer"),
                                         env.get("PYTHONPATH", "")])
    env.update(PYTHONUNBUFFERED="1", OPENAI_AGENTS_DISABLE_TRACING="1", AGL_TEST_DIR=str(tmp),
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("OPENAI_API_KEY", None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for_line(self, prefix: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.output().splitlines():
                if line.startswith(prefix):
                    return line
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not print {prefix!r} in {timeout:g} s:\n{self.output()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@dataclass
class Processes:
    """The test's child processes; :meth:`close` kills every one still alive (the fixture calls it)."""

    tmp: Path
    children: list[Child] = field(default_factory=list)
    _files: list[IO[bytes]] = field(default_factory=list)

    def start(self, name: str, args: list[str], *, stdin: bool = False) -> Child:
        log = self.tmp / f"{name}-{len(self.children)}.log"
        out = open(log, "wb")  # noqa: SIM115 - closed in close()
        self._files.append(out)
        proc = subprocess.Popen([PYTHON, *args], env=child_env(self.tmp), cwd=self.tmp, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def backend(self, port: int = 0) -> tuple[Child, str]:
        child = self.start("backend", [str(HERE / "fake_backend.py"), str(port)], stdin=True)
        return child, child.wait_for_line("url ").split(" ", 1)[1]

    def server(self, db: Path, backend_url: str, port: int, *extra: str) -> tuple[Child, str]:
        child = self.start("server", ["-m", "agl_trainer", "--db", str(db), "--port", str(port), "--backend",
                                      backend_url, *extra])
        return child, child.wait_for_line("agl serve: listening on ").rsplit(" ", 1)[1]

    def worker(self, url: str, threads: int, *, asynchronous: bool = False, worker_id: str | None = None,
               extra: Iterable[str] = ()) -> Child:
        agent = "scale_agents:agent_async" if asynchronous else "scale_agents:agent"
        args = ["-m", "agl_core.worker", "--server", url, "--agent", agent, "-n", str(threads), "--poll", "0.5",
                "--log-level", "WARNING", *extra]
        if worker_id:
            args += ["--worker-id", worker_id]
        return self.start(worker_id or "worker", args)

    def asyncio_driver(self, url: str, slots: int) -> Child:
        return self.start("asyncio", [str(HERE / "asyncio_driver.py"), url, str(slots)])

    def close(self) -> None:
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGKILL)
        for child in self.children:
            try:
                child.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for f in self._files:
            f.close()


def stop_gracefully(children: Iterable[Child], timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL whatever has not exited in ``timeout`` seconds."""
    children = [c for c in children if c.proc.poll() is None]
    for c in children:
        c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()


# --------------------------------------------------------------------------- tasks and their checks


def _nonce_token(nonce: str) -> int:
    return tokenize(f" nonce={nonce}")[0]


def make_tasks(n: int, seed: int, *, delay: tuple[float, float] | None = None, poison: int = 0) -> list[dict[str, Any]]:
    """``n`` tasks over the three frameworks, each with a nonce whose token id no other task's shares,
    and ``poison`` tasks among them whose rollouts no server can store (see :mod:`scale_agents`)."""
    rng = random.Random(seed)
    used: set[int] = set()
    tasks = []
    for i in range(n):
        while True:
            nonce = f"{rng.getrandbits(48):012x}"
            ids = {_nonce_token(nonce), tokenize(f" {lookup_value(nonce)}")[0]}
            if not ids & used and len(ids) == 2:
                used |= ids
                break
        task: dict[str, Any] = {"id": f"t{i:05d}", "nonce": nonce, "kind": KINDS[i % len(KINDS)],
                                "steps": 1 + rng.randrange(3)}
        if delay:
            task["delay"] = round(rng.uniform(*delay), 3)
        tasks.append(task)
    for i in range(poison):
        tasks.insert(rng.randrange(len(tasks) + 1), {"id": f"p{i:03d}", "kind": "poison", "nonce": "none",
                                                     "steps": 0, "poison": ("big", "many")[i % 2]})
    return tasks


def expected_count(task: dict[str, Any]) -> int:
    return int(task["steps"]) if task["kind"] == "openai" else 2


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _generated(response: dict[str, Any]) -> str:
    """What the fake model generated for a response (its content, or its tool calls), as it tokenised it."""
    calls = response.get("tool_calls") or []
    text = _content(response)
    calls_text = " ".join(f"<tool_call> {c['function']['name']} {c['function']['arguments']}" for c in calls)
    return text + (" " if text and calls_text else "") + calls_text


def check_transitions(task: dict[str, Any], rollout: Any, transitions: list[Any], *, complete: bool = True,
                      gateway_ok: Callable[[Any], bool] = lambda t: True) -> list[str]:
    """Everything wrong with one rollout's transitions, as sentences (empty: all belong, in order, exact ids).

    ``complete``: the rollout succeeded, so it has exactly the transitions its agent made; otherwise a
    prefix of them. ``gateway_ok(t)``: whether ``t`` must carry the gateway's token ids.
    """
    nonce, kind, tid = task["nonce"], task["kind"], task["id"]
    problems: list[str] = []
    want = expected_count(task)
    if (complete and len(transitions) != want) or len(transitions) > want:
        problems.append(f"{tid}: {len(transitions)} transitions, expected {want}")
    for i, t in enumerate(transitions):
        where = f"{tid} ({kind}) transition {i}"
        if (t.rollout_id, t.task_id, t.attempt, t.index) != (rollout.id, tid, rollout.attempt, i):
            problems.append(f"{where}: belongs to {(t.rollout_id, t.task_id, t.attempt, t.index)}")
        nonces = {m for msg in t.prompt for m in _nonces(_content(msg))}
        if nonces != {nonce}:
            problems.append(f"{where}: prompt carries nonces {sorted(nonces)}, not just {nonce}")
        if kind == "openai":
            question = f"nonce={nonce} step={i}: what is {i}?"
            if _content(t.prompt[-1]) != question or _content(t.response) != f"reply {question}":
                problems.append(f"{where}: out of order or foreign: {t.prompt[-1]!r} -> {t.response!r}")
        elif i == 0:
            args = [json.loads(c["function"]["arguments"]) for c in t.response.get("tool_calls") or []]
            if args != [{"nonce": nonce}]:
                problems.append(f"{where}: tool call {args}, expected lookup of {nonce}")
        elif _content(t.response) != f"answer nonce={nonce} {lookup_value(nonce)}":
            problems.append(f"{where}: final answer {t.response!r}")
        if t.token_source != "gateway":
            if gateway_ok(t):
                problems.append(f"{where}: token_source {t.token_source!r}, expected the gateway's ids")
            continue
        if t.response_token_ids != tokenize(_generated(t.response)):
            problems.append(f"{where}: response token ids are not those of its own response")
        if t.prompt_token_ids != tokenize(render_prompt(t.prompt)):
            problems.append(f"{where}: prompt token ids are not those of its own prompt")
        if _nonce_token(nonce) not in t.prompt_token_ids:
            problems.append(f"{where}: prompt token ids lack the nonce's id")
        if not t.response_logprobs or len(t.response_logprobs) != len(t.response_token_ids):
            problems.append(f"{where}: logprobs missing or misaligned")
    return problems


def _nonces(text: str) -> set[str]:
    return set(re.findall(r"nonce=([0-9a-f]+)", text))
