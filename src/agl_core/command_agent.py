"""``agl worker --command "node agent.js"``: an agent in any language, run as one subprocess per task.

The command is split like a shell would (``shlex.split``, no shell runs it) and started once per
leased task, in the worker's directory, with its own rollout. What it is given:

- ``OPENAI_BASE_URL``: the rollout-scoped gateway ``{server}/rollouts/{rollout_id}/v1``, which every
  OpenAI client reads, so its calls are that rollout's transitions with no change to the agent and
  no tracing (:mod:`agl_trainer.rollout_calls` on the server); ``OPENAI_API_KEY``: the server's token
  (or ``agl-no-token``). Both are also in ``AGL_BASE_URL`` and ``AGL_API_KEY``, and with
  ``--no-gateway-env`` only there: the command's ``OPENAI_*`` then stay for its other models (a frozen judge).
- The task: as one line of JSON on **stdin** (then end of file), and in ``AGL_TASK`` (the same JSON).
- ``AGL_SERVER``, ``AGL_ROLLOUT_ID``, ``AGL_TASK_ID``, ``AGL_ATTEMPT``, and ``AGL_RESOURCES`` (the
  served resources as a JSON object, which ``agl.resources()`` also reads) when the server serves some.

What it gives back: the **last line of its stdout that is JSON** is its result: a number (the final
reward), or an object ``{"reward": number | null}``. Exit status 0 is a succeeded rollout; any other
status is a failed one (the agent's own failure, stored and counted as a try), except 75
(``EX_TEMPFAIL``): the infrastructure failed, so the attempt is given back without a result (a
counted try; its opened rollout is stored ``cancelled`` with the reason). A command
that prints no JSON line ends a rollout with no reward, which the worker says.

Before the command starts, the rollout is opened on the server (``POST /v1/rollouts`` with ``status:
"running"``), which is what lets the scoped URL take its calls; the worker posts it finished, with
the reward, once the command exits.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import time
from collections.abc import Mapping
from typing import Any

from agl_core.rollouts import RolloutRun, emit_reward, rollout
from agl_core.schema import Rollout
from agl_core.store.http import ServerClient

__all__ = ["TEMPFAIL", "CommandAgent", "CommandFailed", "reward_of"]

logger = logging.getLogger("agl.worker")

TEMPFAIL = 75
"""The exit status (``EX_TEMPFAIL`` of sysexits.h) that says the infrastructure failed, not the agent."""


class CommandFailed(RuntimeError):
    """The agent's command exited with a status other than 0: its rollout failed."""


class _CommandUnavailable(ConnectionError):
    """The command exited with :data:`TEMPFAIL`: the worker gives the attempt back (see ``is_infrastructure_error``)."""


def reward_of(stdout: str) -> tuple[bool, float | None]:
    """``(found, reward)`` from a command's stdout: its last JSON line, a number or ``{"reward": ...}``.

    ``ValueError`` naming the line when that line is JSON of another shape.
    """
    for line in reversed(stdout.splitlines()):
        text = line.strip()
        if not text:
            continue
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if isinstance(value, dict):
            value = value.get("reward")
            if value is None:
                return True, None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"the command's last JSON line must be a number or {{\"reward\": number | null}}, "
                             f"got {text[:200]}")
        return True, float(value)
    return False, None


class CommandAgent:
    """The agent ``agl worker --command`` runs: one subprocess of ``command`` per task, as one rollout.

    It has the shape of an ``@agl.rollout_fn`` function (``last_run``, ``builder``), so the worker
    runs it as any agent.
    """

    builder = None

    def __init__(self, command: str, server: str, token: str | None = None, *,
                 timeout_s: float | None = None, set_openai_env: bool = True) -> None:
        self.argv = shlex.split(command)
        if not self.argv:
            raise ValueError("--command is empty: give the agent's command line, e.g. --command 'node agent.js'")
        self.command = command
        self.client = ServerClient(server, token)
        self.token = token
        self.timeout_s = timeout_s
        self.set_openai_env = set_openai_env
        self.last_run: RolloutRun | None = None
        self.__name__ = self.__qualname__ = f"command {command!r}"

    def __call__(self, task: Any, *, task_id: str, attempt: int = 1, store: Any = None,
                 resources: Mapping[str, Any] | None = None, resources_version: int | None = None) -> float | None:
        run = rollout(task_id, task, store=store, attempt=attempt, resources=resources,
                      resources_version=resources_version)
        self.last_run = run
        with run:
            reward = self._run(run, task)
            if reward is not None:
                emit_reward(reward)
        return reward

    def _run(self, run: RolloutRun, task: Any) -> float | None:
        opened = Rollout(id=run.id, task_id=run.rollout.task_id, attempt=run.rollout.attempt, task=task,
                         start_time=time.time(), resources_version=run.rollout.resources_version)
        self.client.request("POST", "/v1/rollouts", opened.to_dict())  # status running: the scoped URL opens
        task_json = json.dumps(task, ensure_ascii=False)
        scoped, key = f"{self.client.url}/rollouts/{run.id}/v1", self.token or "agl-no-token"
        env = dict(os.environ)
        env.update({"AGL_BASE_URL": scoped, "AGL_API_KEY": key, "AGL_SERVER": self.client.url,
                    "AGL_ROLLOUT_ID": run.id, "AGL_TASK_ID": run.rollout.task_id,
                    "AGL_ATTEMPT": str(run.rollout.attempt), "AGL_TASK": task_json})
        if self.set_openai_env:
            env.update({"OPENAI_BASE_URL": scoped, "OPENAI_API_KEY": key})
        if run.resources:
            env["AGL_RESOURCES"] = json.dumps(dict(run.resources), ensure_ascii=False)
        try:
            done = subprocess.run(self.argv, input=task_json + "\n", env=env, capture_output=True, text=True,
                                  timeout=self.timeout_s, check=False)
        except FileNotFoundError as exc:
            raise CommandFailed(f"cannot start --command {self.command!r}: {exc}") from None
        except subprocess.TimeoutExpired:
            raise CommandFailed(f"--command {self.command!r} ran past {self.timeout_s:g} s and was killed") from None
        if done.stderr:
            logger.info("agl worker: task %s: the command's stderr:\n%s", run.rollout.task_id, _tail(done.stderr))
        if done.returncode == TEMPFAIL:
            why = f"--command {self.command!r} exited {TEMPFAIL} (infrastructure): {_tail(done.stderr)}"
            # the worker gives the attempt back without a result: the opened rollout says so instead of running on
            self.client.request("POST", "/v1/rollouts", {**opened.to_dict(), "status": "cancelled", "error": why,
                                                          "end_time": time.time()})
            raise _CommandUnavailable(why)
        if done.returncode != 0:
            raise CommandFailed(f"--command {self.command!r} exited with status {done.returncode}: "
                                f"{_tail(done.stderr or done.stdout)}")
        found, reward = reward_of(done.stdout)
        if not found:
            logger.warning("agl worker: task %s: --command %r printed no JSON line on stdout, so its rollout has no "
                           "reward (print a number, or {\"reward\": number}, as the last JSON line)",
                           run.rollout.task_id, self.command)
        return reward


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])[-4000:]
