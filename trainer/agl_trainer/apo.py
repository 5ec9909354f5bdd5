"""``agl train`` with ``algorithm.name: apo``: automatic prompt optimisation, a beam search over prompt versions.

No weights are trained: what changes is one resource (``apo.resource``, a system prompt say)
that the agent reads with ``agl.resources()``. Each round reads as its stages:

1. **run**: every candidate of the beam is published as a resources version (``POST
   /v1/resources``, made current) and runs ``apo.batch_size`` training tasks through the same
   queue and workers as any ``agl train``; each rollout records the version it ran with, and
   one that ran with another version is left out, loudly;
2. **critique**: the optimiser model (any OpenAI-compatible endpoint, ``apo.optimizer``) reads
   the candidate and its failing rollouts (reward below ``apo.success_reward``: the task, the
   model calls' messages, the reward) and writes what in the prompt made them fail, the
   "textual gradient";
3. **edit**: it writes ``apo.edits_per_candidate`` edited prompts from the critique (an edit that drops a
   ``{name}`` placeholder of the initial prompt, a template the agent formats, is refused and reported);
4. **score**: each edit, published as its own version, runs the whole validation split
   (``validation.path``, ``validation.repeat`` rollouts a task); its score is the mean final
   reward (a rollout without one scores 0). When the gateway relays the agent's model
   (``apo.gateway_model``), a scoring run's calls are sampled at ``validation.sampling``
   (greedy by default, so two candidates' scores differ by their prompts, not by the draw) and a
   batch's at the agent's own settings; an agent calling its own model samples as it says, and
   setting ``validation.sampling`` then is a config error, as ``validation.every`` and
   ``at_start`` always are (nothing here would read them);
5. **select**: the best ``apo.beam_width`` of the beam and the edits go on.

The initial prompt (``resources.<apo.resource>``) is scored first. The run stops after
``apo.rounds`` rounds, or before a batch of rollouts that would go past
``apo.max_rollouts``, or before an optimiser call whose prompt and reply would pass
``apo.max_optimizer_tokens`` (prompt and reply both count, as ``usage.total_tokens``: the
prompt is estimated at the endpoint's reported ratio of characters to tokens, the reply
capped at what is left; a reply cut by that cap is not used; :class:`Budget`), or when a
round finds no failure to critique or gets no edit back; it says which. An optimiser call that
fails is retried (``apo.optimizer.retries``, waits doubling from
``backoff_s``) and then reported in the round's ``errors``: the run goes on.

Everything is kept: each candidate is a resources version whose ``metadata["apo"]`` holds its
round, parent, critique, scores and whether it won; each round's numbers go to the server's
metrics (``apo_*``, the dashboard's curves); ``apo.json`` in ``run.dir`` holds every candidate,
critique, score, optimiser call and the winner, ``best_prompt.txt`` the winner's text, and the
winner is left as the server's current version.

The agent's model is its own business (a hosted model at its own base URL: the worker does not
touch the agent's OpenAI settings), or, with ``apo.gateway_model``, agl's gateway relays its
calls there and records them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from agl_trainer.config import (
    APO_UNREAD,
    Config,
    ConfigError,
    code_builder,
    load_tasks,
    load_validation_tasks,
    refuse_earlier_run,
    refuse_unread,
    transition_builder,
    unread_keys,
)

__all__ = ["ApoOutcome", "Budget", "Candidate", "OptimizerClient", "OptimizerError", "apo_command", "check_apo_config",
           "run_apo"]

logger = logging.getLogger("agl.trainer")

_RETRIED_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
_CLIP = 1500  # characters of one message shown to the optimiser
_PLACEHOLDER = re.compile(r"(?<!\{)\{([A-Za-z_]\w*)\}(?!\})")  # str.format's {name}, not {{escaped}}


def check_apo_config(config: Config) -> None:
    """What ``algorithm.name: apo`` needs beyond the keys' types; :class:`ConfigError` naming the key."""
    from agl_core.errors import SchemaError
    from agl_core.rollouts import check_resources

    apo = config.apo
    if apo is None:
        raise ConfigError("apo", "is required with algorithm.name: apo (apo.optimizer: {base_url, model}, ...)")
    if config.backend is not None:
        raise ConfigError("backend", "is not used with algorithm.name: apo (no model is trained or loaded): the "
                          "agent calls its own model, or apo.gateway_model through agl's gateway; drop it")
    if config.validation is None:
        raise ConfigError("validation", "is required with algorithm.name: apo: the held-out tasks every edited "
                          "prompt is scored on (validation: {path: val.jsonl})")
    try:
        check_resources(config.resources, "resources")
    except SchemaError as exc:
        raise ConfigError(exc.field, exc.problem) from None
    initial = config.resources.get(apo.resource)
    if not isinstance(initial, str) or not initial.strip():
        raise ConfigError(f"resources.{apo.resource}", f"must be the initial prompt (a non-empty string) of the "
                          f"resource apo.resource optimises, got {_shown(initial)}")
    for key, env in (("apo.optimizer.api_key_env", apo.optimizer.api_key_env),
                     ("apo.gateway_api_key_env", apo.gateway_api_key_env)):
        if env is not None and not os.environ.get(env):
            raise ConfigError(key, f"${env} is not set (or empty)")
    if apo.gateway_model is not None and config.server.url is not None:
        raise ConfigError("apo.gateway_model", "and server.url both name the agent's model server: a running agl "
                          "serve's gateway relays to its own --backend; set one of them")
    if config.workers.ray is not None:
        raise ConfigError("workers.ray", "is not available with algorithm.name: apo yet: its workers are threads "
                          "of agl train (workers.count), or your own `agl worker` with workers.count: 0")
    refuse_unread(config, "apo", APO_UNREAD)
    if unread_keys(config, {"validation.sampling": ""}) and apo.gateway_model is None:
        raise ConfigError("validation.sampling", "is applied by agl's gateway, and with algorithm.name apo the agent "
                          "calls its own model (apo.gateway_model is not set), so it would be ignored: set the "
                          "sampling in the agent, or relay its calls through the gateway with apo.gateway_model")


def apo_command(config: Config, *, check: bool, progress: bool) -> None:
    """``agl train`` for ``algorithm.name: apo``: ``--check``, or the run and its closing lines; exits as agl train
    does (2: config error, 1: failed while running)."""
    import click

    try:
        tasks, held_out = load_tasks(config), load_validation_tasks(config)
        refuse_earlier_run(config)
    except ConfigError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)
    apo = config.apo
    assert apo is not None and config.validation is not None
    if check:
        click.echo(f"agl train: valid: apo over resources.{apo.resource}, {len(tasks)} tasks, {len(held_out)} "
                   f"validation tasks x {config.validation.repeat}, beam {apo.beam_width}, {apo.rounds} rounds, "
                   f"optimiser {apo.optimizer.model} at {apo.optimizer.base_url}")
        return
    try:
        outcome = run_apo(config, progress=progress)
    except ConfigError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("agl train: interrupted; every candidate so far is in the server's resources history", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - one clear line, not a traceback
        logger.debug("agl train (apo) failed", exc_info=True)
        click.echo(f"agl train: failed: {type(exc).__name__}: {exc}", err=True)
        sys.exit(1)
    first, best, b = outcome.candidates[0], outcome.best, outcome.budget
    click.echo(f"agl train: apo: validation score {_score_text(first.validation_score)} (v{first.version}, the "
               f"initial prompt) -> {_score_text(best.validation_score)} (v{best.version}, round {best.round}); "
               f"{len(outcome.rounds)} rounds, {b.rollouts} rollouts, {b.calls} optimiser calls, {b.tokens} tokens; "
               f"stopped: {b.stop} ({b.detail}), {outcome.wall_s:.0f} s")
    for name, path in outcome.files.items():
        click.echo(f"{name}: {path}")


def _shown(value: Any) -> str:
    if value is None:
        return "nothing"
    return repr(value) if isinstance(value, str) else type(value).__name__


# ---------------------------------------------------------------------- the optimiser


class OptimizerError(RuntimeError):
    """An optimiser call that failed every try; ``tries`` says how many were made."""

    def __init__(self, message: str, tries: int) -> None:
        super().__init__(message)
        self.tries = tries


@dataclass
class OptimizerCall:
    """One optimiser call as ``apo.json`` keeps it."""

    purpose: str
    """``critique`` or ``edit``."""
    candidate: int
    """The resources version it was about."""
    tokens: int
    tries: int
    ok: bool
    error: str | None = None
    estimated: bool = False
    """The endpoint reported no usage: ``tokens`` is characters / 4."""


class OptimizerClient:
    """Chat completions at an OpenAI-compatible ``base_url``, retried with backoff; standard library only."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, *, temperature: float = 1.0,
                 timeout_s: float = 120.0, retries: int = 3, backoff_s: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.sleep = sleep

    def chat(self, messages: list[dict[str, Any]], max_tokens: int) -> Reply:
        """The reply: its text, ``usage`` as reported, why it ended, and the tries made."""
        body = json.dumps({"model": self.model, "messages": messages, "max_tokens": max_tokens,
                           "temperature": self.temperature}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        wait = self.backoff_s
        for attempt in range(1, self.retries + 2):
            try:
                reply = self._once(body, headers)
                reply.tries = attempt
                return reply
            except OptimizerError as exc:  # not worth another try (a 4xx: a wrong key, an unknown model)
                raise OptimizerError(str(exc), attempt) from None
            except _Retry as exc:
                if attempt > self.retries:
                    raise OptimizerError(f"{exc} (after {attempt} tries)", attempt) from None
                logger.warning("agl train: apo: optimiser call failed (%s); try %d of %d in %g s", exc,
                               attempt + 1, self.retries + 1, wait)
                self.sleep(wait)
                wait *= 2
        raise AssertionError("unreachable")

    def _once(self, body: bytes, headers: dict[str, str]) -> Reply:
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 - a config URL
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode("utf-8", "replace")
            if exc.code in _RETRIED_STATUS:
                raise _Retry(f"{self.url} answered {exc.code}: {detail}") from None
            raise OptimizerError(f"{self.url} answered {exc.code} (not retried): {detail}", 1) from None
        except (OSError, ValueError) as exc:  # unreachable, refused, timed out
            raise _Retry(f"{self.url} could not be reached: {type(exc).__name__}: {exc}") from None
        try:
            data = json.loads(raw)
            text = data["choices"][0]["message"]["content"]
            if not isinstance(text, str):
                raise TypeError("content is not a string")
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise _Retry(f"{self.url} sent a reply without a message's text ({type(exc).__name__}: {exc}): "
                         f"{raw[:200]!r}") from None
        usage = data.get("usage") if isinstance(data, dict) else None
        usage = usage if isinstance(usage, dict) else {}
        finish = data["choices"][0].get("finish_reason")
        return Reply(text, _count(usage.get("total_tokens")), _count(usage.get("prompt_tokens")),
                     finish if isinstance(finish, str) else None)


@dataclass
class Reply:
    """One optimiser reply: its text, its ``usage`` (None: not reported) and why it ended (``length``: cut)."""

    text: str
    total_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    tries: int = 1


def _count(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class _Retry(Exception):
    """A failure worth another try."""


# ---------------------------------------------------------------------- budget


@dataclass
class Budget:
    """Rounds, rollouts and optimiser tokens: what is allowed, what is spent, and why the run stopped."""

    rounds: int
    max_rollouts: int | None = None
    max_tokens: int | None = None
    rollouts: int = 0
    tokens: int = 0
    calls: int = 0
    largest_reply: int = 0
    """The most tokens a reply took so far: the next call needs room for its prompt and as much."""
    prompt_chars: int = 0
    prompt_tokens: int = 0
    """Of the calls that reported ``usage.prompt_tokens``: their prompts' characters and tokens (the estimate's
    ratio)."""
    stop: str | None = None
    """``rounds``, ``rollouts``, ``optimizer_tokens``, ``no_failures`` or ``no_edits`` once stopped (``error``: the
    run failed, the detail says how)."""
    detail: str = ""

    def take_rollouts(self, n: int, what: str) -> bool:
        """Spend ``n`` rollouts on ``what`` if they fit; otherwise stop (``rollouts``) and say False."""
        if self.stop == "rollouts":
            return False
        if self.max_rollouts is not None and self.rollouts + n > self.max_rollouts:
            self.stopped("rollouts", f"{what} needs {n} rollouts and {self.max_rollouts - self.rollouts} of "
                                     f"apo.max_rollouts={self.max_rollouts} are left")
            return False
        self.rollouts += n
        return True

    def prompt_estimate(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """The tokens ``messages`` will take as a prompt: at the endpoint's own ratio of characters to tokens once it
        reported one, else 3 characters a token (most tokenizers need fewer tokens), with a margin of a tenth."""
        chars = sum(len(str(m.get("content", ""))) for m in messages)
        ratio = self.prompt_chars / self.prompt_tokens if self.prompt_tokens else 3.0
        return int(chars / ratio * 1.1) + 4 * len(messages) + 1

    def call_allowed(self, prompt: int) -> int | None:
        """The most tokens the next optimiser call, whose prompt is about ``prompt`` tokens, may reply with (None: no
        cap); 0 (and stopped): its prompt and a reply as long as the longest so far would pass the budget."""
        if self.max_tokens is None:
            return None
        left = self.max_tokens - self.tokens
        if left < prompt + max(self.largest_reply, 1):
            self.stopped("optimizer_tokens", f"{self.tokens} of apo.max_optimizer_tokens={self.max_tokens} spent, "
                                             f"{left} left: the next call's prompt is about {prompt} tokens and the "
                                             f"longest reply so far took {self.largest_reply}")
            return 0
        return left - prompt

    def spent(self, tokens: int, reply: int, prompt_chars: int = 0, prompt_tokens: int | None = None) -> None:
        """A call took ``tokens`` in all, ``reply`` of them its reply's; its prompt's size, when reported."""
        self.calls += 1
        self.tokens += tokens
        self.largest_reply = max(self.largest_reply, reply)
        if prompt_tokens:
            self.prompt_chars += prompt_chars
            self.prompt_tokens += prompt_tokens

    def stopped(self, reason: str, detail: str) -> None:
        if self.stop is None:
            self.stop, self.detail = reason, detail

    def to_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "max_rollouts": self.max_rollouts, "max_optimizer_tokens": self.max_tokens,
                "rollouts": self.rollouts, "optimizer_tokens": self.tokens, "optimizer_calls": self.calls,
                "stop": self.stop, "stop_detail": self.detail}


# ---------------------------------------------------------------------- candidates


@dataclass
class Candidate:
    """One prompt the search tried: its resources version and what is known of it."""

    version: int
    prompt: str
    round: int
    parent: int | None = None
    critique: str | None = None
    """The critique of the parent's failures this edit was written from."""
    validation_score: float | None = None
    validation_rollouts: int = 0
    train_scores: list[float] = field(default_factory=list)
    """Its mean reward on each round's training batch while in the beam."""
    winner: bool = False

    def metadata(self, run_id: str, resource: str) -> dict[str, Any]:
        return {"apo": {"run": run_id, "resource": resource, "round": self.round, "parent": self.parent,
                        "critique": self.critique, "validation_score": self.validation_score,
                        "validation_rollouts": self.validation_rollouts, "train_scores": self.train_scores,
                        "winner": self.winner}}


@dataclass
class _Batch:
    """The rollouts of one candidate on some tasks: their score and the failing ones."""

    score: float
    rollouts: int
    failures: list[dict[str, Any]]
    other_version: int
    failed_tasks: int


@dataclass
class ApoOutcome:
    """What an APO run did."""

    best: Candidate
    candidates: list[Candidate]
    rounds: list[dict[str, Any]]
    budget: Budget
    folder: str
    server_url: str
    wall_s: float
    files: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------- the run


def run_apo(config: Config, *, progress: bool = True) -> ApoOutcome:
    """Start the server and workers ``config`` asks for (or use ``server.url``), search, stop them; see the module."""
    from agl_core.store.http import HttpStore
    from agl_core.worker import TaskClient
    from agl_trainer.training import LocalServer

    assert config.apo is not None and config.validation is not None
    started = time.monotonic()
    tasks, held_out = load_tasks(config), load_validation_tasks(config)
    refuse_earlier_run(config)
    folder = config.path(config.run.dir)
    os.makedirs(folder, exist_ok=True)
    token = config.server.token or os.environ.get("AGL_TOKEN") or None
    # the stored transitions (what agl export and the dashboard read) are built as the config says (agent_match,
    # air, credit), as in a grpo run, though apo itself scores final rewards only
    builder = transition_builder(config, code_builder(config))
    local = _local_server(config, token, builder) if config.server.url is None else None
    url = local.url if local is not None else str(config.server.url)
    client = TaskClient(url, token, timeout=config.run.step_timeout_s)
    if local is None:
        _join_builder(client, builder)
    workers = _Workers(config, url, token)
    store = HttpStore(url, token, timeout=config.run.step_timeout_s)
    relayed = LocalServer(local.thread.server, None) if local is not None and config.apo.gateway_model else None
    search = _Search(config, client, store, tasks, held_out, progress=progress,
                     set_sampling=relayed.set_sampling if relayed is not None else None)
    files = {"apo": os.path.join(folder, "apo.json"), "best prompt": os.path.join(folder, "best_prompt.txt"),
             "summary": os.path.join(folder, "summary.json")}
    if local is not None:
        files["store"] = config.path(config.server.db)
    try:
        search.run()
    except BaseException as exc:  # what was found so far is written all the same, and says why the run ended
        search.budget.stopped("error", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        workers.stop()
        client.close()
        store.close()
        if local is not None:
            local.stop()
        if search.candidates:
            _write(config, search, files, url, time.monotonic() - started)
    return ApoOutcome(best=search.best(), candidates=search.candidates, rounds=search.rounds, budget=search.budget,
                      folder=folder, server_url=url, wall_s=time.monotonic() - started, files=files)


def _write(config: Config, search: _Search, files: dict[str, str], url: str, wall_s: float) -> None:
    """``apo.json``, ``best_prompt.txt`` and ``summary.json`` of the search so far."""
    assert config.apo is not None
    best = search.best()
    record = {"run": search.run_id, "resource": config.apo.resource, "budget": search.budget.to_dict(),
              "best": asdict(best), "rounds": search.rounds, "candidates": [asdict(c) for c in search.candidates],
              "optimizer_calls": [asdict(c) for c in search.calls], "server": url, "wall_s": wall_s}
    with open(files["apo"], "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
    with open(files["best prompt"], "w", encoding="utf-8") as f:
        f.write(best.prompt)
    with open(files["summary"], "w", encoding="utf-8") as f:
        json.dump({"config": config.model_dump(mode="json"), "algorithm": "apo", "wall_s": wall_s,
                   "server": url, "best_version": best.version, "best_validation_score": best.validation_score,
                   "budget": search.budget.to_dict()}, f, indent=1, ensure_ascii=False)


class _Search:
    """The beam search over one resource, against the server through ``client`` (tasks, resources) and ``store``."""

    def __init__(self, config: Config, client: Any, store: Any, tasks: list[Any], held_out: list[Any], *,
                 progress: bool, set_sampling: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        apo, validation = config.apo, config.validation
        assert apo is not None and validation is not None
        self.apo = apo
        self.set_sampling = set_sampling
        """Puts the gateway's sampling overrides in place, returning the ones before (None: the agent calls its own
        model, which no override reaches)."""
        self.sampling = validation.sampling.overrides()
        """What a scoring run's calls are sampled with, through the gateway (``validation.sampling``)."""
        self.config = config
        self.client = client
        self.store = store
        self.tasks = tasks
        self.held_out = held_out
        self.repeat = validation.repeat
        self.progress = progress
        self.run_id = uuid.uuid4().hex[:6]
        o = apo.optimizer
        key = os.environ.get(o.api_key_env) if o.api_key_env else None
        self.optimizer = OptimizerClient(o.base_url, o.model, key, temperature=o.temperature, timeout_s=o.timeout_s,
                                         retries=o.retries, backoff_s=o.backoff_s)
        self.budget = Budget(apo.rounds, apo.max_rollouts, apo.max_optimizer_tokens)
        self.candidates: list[Candidate] = []
        self.rounds: list[dict[str, Any]] = []
        self.calls: list[OptimizerCall] = []
        self.beam: list[Candidate] = []
        self._next_task = 0
        self._placeholders = set(_PLACEHOLDER.findall(str(config.resources[apo.resource])))
        """``{name}`` fields of the initial prompt (a template the agent formats): every edit keeps them."""
        self._started = time.monotonic()

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        initial = self._publish(str(self.config.resources[self.apo.resource]), round_=0)
        self.beam = [initial]
        if not self._score(initial):
            self._finish()
            return
        self._say(f"apo: initial prompt (v{initial.version}) scores {initial.validation_score:.3f} on "
                  f"{len(self.held_out)} validation tasks x {self.repeat}")
        for round_ in range(1, self.apo.rounds + 1):
            self._round(round_)
            if self.budget.stop is not None:
                break
        else:
            self.budget.stopped("rounds", f"apo.rounds={self.apo.rounds} done")
        self._finish()

    def _round(self, round_: int) -> None:
        began = time.monotonic()
        edits: list[Candidate] = []
        critiques: list[dict[str, Any]] = []
        errors: list[str] = []
        failures_seen = 0
        for parent in list(self.beam):
            if self.budget.stop is not None:
                break
            if not self.budget.take_rollouts(self.apo.batch_size, f"round {round_}'s batch of v{parent.version}"):
                break
            batch = self._run_batch(parent, round_)
            parent.train_scores.append(batch.score)
            self._note(parent)
            if not batch.failures:
                continue
            failures_seen += len(batch.failures)
            critique = self._ask("critique", parent, _critique_messages(self.apo.resource, parent.prompt,
                                                                        batch.failures), errors)
            if critique is None:
                continue
            critiques.append({"candidate": parent.version, "critique": critique, "failures": len(batch.failures),
                              "train_score": batch.score})
            for _ in range(self.apo.edits_per_candidate):
                reply = self._ask("edit", parent, _edit_messages(self.apo.resource, parent.prompt, critique), errors)
                if reply is None:
                    continue
                text = _prompt_of(reply)
                if not text:
                    errors.append(f"an edit of v{parent.version} came back empty")
                    continue
                lost = self._placeholders - set(_PLACEHOLDER.findall(text))
                if lost:  # the agent formats the template with these: an edit without them would break it
                    errors.append(f"an edit of v{parent.version} dropped the placeholders "
                                  f"{', '.join('{' + p + '}' for p in sorted(lost))} and is not tried")
                    continue
                known = next((c for c in self.candidates if c.prompt == text), None)
                if known is not None:  # the optimiser wrote a prompt tried before: scored once
                    if known not in edits and known not in self.beam:
                        edits.append(known)
                    continue
                edits.append(self._publish(text, round_=round_, parent=parent.version, critique=critique))
        scored = [e for e in edits if e.validation_score is not None or self._score(e)]
        pool = {c.version: c for c in [*self.beam, *scored]}
        self.beam = sorted(pool.values(), key=lambda c: (-(c.validation_score or 0.0), c.version)
                           )[:self.apo.beam_width]
        best = self.best()
        entry = {"round": round_, "edits": [e.version for e in edits], "scored": [e.version for e in scored],
                 "critiques": critiques, "beam": [{"version": c.version, "validation_score": c.validation_score}
                                                  for c in self.beam],
                 "best": best.version, "best_validation_score": best.validation_score, "errors": errors,
                 "rollouts": self.budget.rollouts, "optimizer_tokens": self.budget.tokens,
                 "optimizer_calls": self.budget.calls, "s": time.monotonic() - began}
        self.rounds.append(entry)
        self._metrics(round_, best)
        beam = ", ".join(f"v{c.version} {c.validation_score:.3f}" for c in self.beam)
        cap = f"/{self.budget.max_rollouts}" if self.budget.max_rollouts else ""
        tcap = f"/{self.budget.max_tokens}" if self.budget.max_tokens else ""
        self._say(f"apo round {round_}/{self.apo.rounds}: {len(critiques)} critiques, {len(scored)} edits scored, "
                  f"best v{best.version} {best.validation_score:.3f}; beam {beam}; rollouts "
                  f"{self.budget.rollouts}{cap}, optimiser {self.budget.calls} calls {self.budget.tokens}{tcap} "
                  f"tokens{f', {len(errors)} errors' if errors else ''}, {entry['s']:.1f} s")
        for line in errors:
            self._say(f"apo round {round_}: {line}")
        if self.budget.stop is None and failures_seen == 0:
            self.budget.stopped("no_failures", f"round {round_}: no rollout of the beam scored below "
                                               f"apo.success_reward={self.apo.success_reward:g}: nothing to critique")
        elif self.budget.stop is None and not edits:
            self.budget.stopped("no_edits", f"round {round_}: no edit to try came back"
                                + (f" ({errors[-1]})" if errors else ""))

    def best(self) -> Candidate:
        scored = [c for c in self.candidates if c.validation_score is not None]
        if not scored:
            return self.candidates[0]
        return min(scored, key=lambda c: (-(c.validation_score or 0.0), c.version))

    def _finish(self) -> None:
        best = self.best()
        best.winner = True
        self._note(best, current=True)
        self._say(f"apo: stopped ({self.budget.stop}: {self.budget.detail}); best v{best.version} "
                  f"{_score_text(best.validation_score)} after {self.budget.rollouts} rollouts and "
                  f"{self.budget.tokens} optimiser tokens")

    # ------------------------------------------------------------------ stages

    def _publish(self, prompt: str, *, round_: int, parent: int | None = None, critique: str | None = None
                 ) -> Candidate:
        resources = {**self.config.resources, self.apo.resource: prompt}
        candidate = Candidate(version=0, prompt=prompt, round=round_, parent=parent, critique=critique)
        _, data = self.client.client.request("POST", "/v1/resources", {
            "resources": resources, "metadata": candidate.metadata(self.run_id, self.apo.resource), "current": False})
        candidate.version = int(data["version"])
        self.candidates.append(candidate)
        return candidate

    def _note(self, candidate: Candidate, *, current: bool = False) -> None:
        body: dict[str, Any] = {"metadata": candidate.metadata(self.run_id, self.apo.resource)}
        if current:
            body["current"] = True
        self.client.client.request("POST", f"/v1/resources/{candidate.version}", body)

    def _score(self, candidate: Candidate) -> bool:
        """Run the validation split with ``candidate``; False (and stopped) when the rollout budget cannot."""
        n = len(self.held_out) * self.repeat
        if not self.budget.take_rollouts(n, f"scoring v{candidate.version} on the validation split"):
            return False
        prefix = f"apo-{self.run_id}-v{candidate.version}"
        if self.set_sampling is None:
            batch = self._run(candidate, self.held_out, prefix, self.repeat)
        else:
            before = self.set_sampling(self.sampling)
            try:
                batch = self._run(candidate, self.held_out, prefix, self.repeat)
            finally:
                self.set_sampling(before)
        candidate.validation_score, candidate.validation_rollouts = batch.score, batch.rollouts
        self._note(candidate)
        return True

    def _run_batch(self, candidate: Candidate, round_: int) -> _Batch:
        n = len(self.tasks)
        chosen = [self.tasks[(self._next_task + j) % n] for j in range(self.apo.batch_size)]
        self._next_task += self.apo.batch_size
        return self._run(candidate, chosen, f"apo-{self.run_id}-r{round_}-v{candidate.version}", 1)

    def _run(self, candidate: Candidate, tasks: Sequence[Any], prefix: str, repeat: int) -> _Batch:
        """``tasks`` x ``repeat`` with ``candidate`` current; its score and failures (a missing reward is 0)."""
        self.client.client.request("POST", f"/v1/resources/{candidate.version}", {"current": True})
        ids = [f"{prefix}-t{j}" for j in range(len(tasks))]
        task_ids = self.client.enqueue(list(tasks), repeat=repeat, max_attempts=self.config.server.max_attempts,
                                       task_ids=ids)
        rollout_ids, failed_tasks = self._wait(task_ids)
        runs = [r for r in (self.store.get_rollout(i, with_spans=True) for i in rollout_ids) if r is not None]
        mine = [r for r in runs if r.resources_version == candidate.version]
        other = len(runs) - len(mine)
        if other:
            logger.warning("agl train: apo: %d rollouts of %s ran with another resources version than v%d and are "
                           "left out of its score (is something else posting resources to this server?)", other,
                           prefix, candidate.version)
        rewards = [r.final_reward if r.final_reward is not None else 0.0 for r in mine]
        rewards += [0.0] * failed_tasks  # a task that never finished scores as a failure, not as nothing
        score = sum(rewards) / len(rewards) if rewards else 0.0
        failing = sorted((r for r in mine if (r.final_reward if r.final_reward is not None else 0.0)
                          < self.apo.success_reward), key=lambda r: r.final_reward or 0.0)
        failures = [_failure(r) for r in failing[:self.apo.max_examples]]
        return _Batch(score, len(mine), failures, other, failed_tasks)

    def _wait(self, task_ids: list[str]) -> tuple[list[str], int]:
        deadline = time.monotonic() + self.config.run.step_timeout_s
        pending = list(task_ids)
        rollout_ids: list[str] = []
        failed = 0
        while pending:
            still = []
            for task_id in pending:
                info = self.client.task(task_id)
                if info.get("state") == "done" and info.get("rollout_id"):
                    rollout_ids.append(str(info["rollout_id"]))
                elif info.get("state") in ("done", "failed"):
                    failed += 1
                else:
                    still.append(task_id)
            pending = still
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(pending)} rollouts did not finish within run.step_timeout_s="
                                       f"{self.config.run.step_timeout_s:g} s: are workers running?")
                time.sleep(0.05)
        return rollout_ids, failed

    def _ask(self, purpose: str, parent: Candidate, messages: list[dict[str, Any]], errors: list[str]) -> str | None:
        """One optimiser call within the token budget; None when the budget or the optimiser said no (reported)."""
        prompt = self.budget.prompt_estimate(messages)
        allowed = self.budget.call_allowed(prompt)
        if allowed == 0:
            return None
        cap = self.apo.optimizer.max_tokens if allowed is None else min(self.apo.optimizer.max_tokens, allowed)
        try:
            reply = self.optimizer.chat(messages, cap)
        except OptimizerError as exc:
            self.calls.append(OptimizerCall(purpose, parent.version, 0, exc.tries, False, str(exc)))
            errors.append(f"the optimiser's {purpose} of v{parent.version} failed: {exc}")
            logger.warning("agl train: apo: the optimiser's %s of v%d failed: %s", purpose, parent.version, exc)
            return None
        chars = sum(len(str(m.get("content", ""))) for m in messages)
        tokens = reply.total_tokens
        estimated = tokens is None
        if tokens is None:  # no usage reported: characters / 4, the reply's and the prompt's
            tokens = (chars + len(reply.text)) // 4 + 1
        prompt_tokens = reply.prompt_tokens if reply.prompt_tokens is not None else prompt
        self.budget.spent(tokens, max(tokens - prompt_tokens, len(reply.text) // 4 + 1), chars, reply.prompt_tokens)
        if reply.finish_reason == "length" and cap < self.apo.optimizer.max_tokens:  # cut by the budget, not asked so
            problem = (f"the optimiser's {purpose} of v{parent.version} was cut at the {cap} tokens the budget left "
                       "(apo.max_optimizer_tokens): not used")
            self.calls.append(OptimizerCall(purpose, parent.version, tokens, reply.tries, False, problem,
                                            estimated=estimated))
            self.budget.stopped("optimizer_tokens", problem)
            errors.append(problem)
            logger.warning("agl train: apo: %s", problem)
            return None
        self.calls.append(OptimizerCall(purpose, parent.version, tokens, reply.tries, True, estimated=estimated))
        return reply.text.strip()

    def _metrics(self, round_: int, best: Candidate) -> None:
        scores = [c.validation_score for c in self.beam if c.validation_score is not None]
        values = {"apo_best_validation_reward": float(best.validation_score or 0.0),
                  "apo_beam_mean_validation_reward": sum(scores) / len(scores) if scores else 0.0,
                  "apo_rollouts": float(self.budget.rollouts), "apo_optimizer_tokens": float(self.budget.tokens),
                  "apo_optimizer_calls": float(self.budget.calls), "apo_candidates": float(len(self.candidates))}
        try:
            self.client.client.request("POST", "/v1/metrics", {"step": round_, "values": values})
        except Exception as exc:  # noqa: BLE001 - a dashboard that is down costs nothing
            logger.warning("agl train: apo: could not record round %d's metrics: %s", round_, exc)

    def _say(self, line: str) -> None:
        logger.info("agl train: %s", line)
        if self.progress:
            print(line, file=sys.stderr, flush=True)


def _score_text(score: float | None) -> str:
    return "unscored" if score is None else f"{score:.3f}"


# ---------------------------------------------------------------------- what the optimiser reads


def _failure(rollout: Any) -> dict[str, Any]:
    """A failing rollout as the critique shows it: task, the model calls' messages, reward, error."""
    from agl_core import semconv
    from agl_core.messages import many_from_genai

    calls = []
    for span in rollout.spans:
        attrs = span.attributes
        if attrs.get(semconv.GEN_AI_OPERATION_NAME) not in semconv.LLM_OPERATIONS:
            continue
        try:
            prompt = _json(attrs.get(semconv.GEN_AI_INPUT_MESSAGES))
            reply = _json(attrs.get(semconv.GEN_AI_OUTPUT_MESSAGES))
            calls.append({"prompt": many_from_genai(prompt or []), "response": many_from_genai(reply or [])})
        except (ValueError, TypeError, AttributeError):
            continue
    return {"task": rollout.task, "reward": rollout.final_reward, "error": rollout.error, "calls": calls}


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _clip(text: Any) -> str:
    shown = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False, default=str)
    return shown if len(shown) <= _CLIP else shown[:_CLIP] + f"... [{len(shown) - _CLIP} more characters]"


def _render_failure(i: int, failure: dict[str, Any]) -> str:
    lines = [f"### Failure {i} (reward {failure['reward']})", f"Task: {_clip(failure['task'])}"]
    if failure.get("error"):
        lines.append(f"Error: {_clip(failure['error'])}")
    for n, call in enumerate(failure["calls"][-2:], 1):  # the last calls: where it went wrong, mostly
        lines.append(f"Model call {n}:")
        for m in [*call["prompt"], *call["response"]]:
            content = m.get("content")
            if m.get("tool_calls"):
                content = f"{content or ''} tool calls: {json.dumps(m['tool_calls'], ensure_ascii=False)}"
            lines.append(f"[{m.get('role', '?')}] {_clip(content or '')}")
    return "\n".join(lines)


def _critique_messages(resource: str, prompt: str, failures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    shown = "\n\n".join(_render_failure(i, f) for i, f in enumerate(failures, 1))
    return [{"role": "system", "content": "You improve the instructions an AI agent is given. You read its "
             f"{resource} and runs of the agent that failed, and say what in the {resource} made them fail."},
            {"role": "user", "content": f"The agent's {resource}:\n<prompt>\n{prompt}\n</prompt>\n\nRuns that failed "
             f"(reward below the target):\n\n{shown}\n\nCritique: in a few sentences, what in the {resource} "
             "made these runs fail, and what it should say instead."}]


def _edit_messages(resource: str, prompt: str, critique: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": f"You edit the {resource} of an AI agent so that it fails less."},
            {"role": "user", "content": f"The agent's {resource}:\n<prompt>\n{prompt}\n</prompt>\n\nCritique of it:\n"
             f"{critique}\n\nWrite the improved {resource}, whole, between <prompt> and </prompt>; keep every "
             "{placeholder} in braces as it is."}]


def _prompt_of(reply: str) -> str:
    """The text between the last ``<prompt>`` and the ``</prompt>`` after it; the whole reply without tags."""
    start = reply.rfind("<prompt>")
    if start < 0:
        return reply.strip()
    end = reply.find("</prompt>", start)
    return reply[start + len("<prompt>"):end if end >= 0 else len(reply)].strip()


# ---------------------------------------------------------------------- server and workers


class _NoModel:
    """The gateway's backend when the agent calls its own model: every call says where to send it instead."""

    async def complete(self, endpoint: Any, body: dict[str, Any]) -> Any:
        return self._refuse()

    async def stream(self, endpoint: Any, body: dict[str, Any]) -> Any:
        return self._refuse()

    def _refuse(self) -> Any:
        from agl_trainer.gateway import BackendError

        raise BackendError(503, "agl train (algorithm apo) serves no model here: the agent calls its own model, or "
                                "set apo.gateway_model to relay its calls through this gateway")

    async def models(self) -> list[str]:
        return ["agl-apo-no-model"]  # a name, so that asking for it is not an error: calling it is

    async def update_weights(self, weights: str | None, version: int) -> None:
        return None

    async def aclose(self) -> None:
        return None


class _Local:
    def __init__(self, thread: Any) -> None:
        self.thread = thread
        self.url: str = thread.url

    def stop(self) -> None:
        self.thread.stop()


def _join_builder(client: Any, builder: Any) -> None:
    """A running agl serve builds the stored transitions with this run's builder too, or the run is refused."""
    from agl_core.errors import AglError
    from agl_trainer.training import post_builder

    try:
        post_builder(client.client, builder, "agl train (algorithm apo: its config and the agent's @agl.rollout_fn "
                     "builder)")
    except (AglError, ValueError) as exc:
        client.close()
        raise ConfigError("server.url", f"the server does not build transitions as this run's config says: {exc}"
                          ) from None


def _local_server(config: Config, token: str | None, builder: Any = None) -> _Local:
    from agl_trainer.gateway import GatewayConfig, OpenAIBackend
    from agl_trainer.server import ServerConfig, ServerThread, TrainerServer, check_bind

    apo = config.apo
    assert apo is not None
    try:
        check_bind(config.server.host, token)
    except ValueError as exc:
        raise ConfigError("server.token", str(exc)) from None
    backend: Any = _NoModel()
    if apo.gateway_model is not None:
        key = os.environ.get(apo.gateway_api_key_env) if apo.gateway_api_key_env else None
        backend = OpenAIBackend(apo.gateway_model, key)
    server_config = ServerConfig(db_path=config.path(config.server.db), host=config.server.host,
                                 port=config.server.port, token=token, max_attempts=config.server.max_attempts,
                                 lease_timeout_s=config.server.lease_timeout_s, builder=builder,
                                 builder_source="agl train (algorithm apo: its config and the agent's "
                                                "@agl.rollout_fn builder)",
                                 gateway=GatewayConfig(upstreams=dict(config.server.upstreams)))
    return _Local(ServerThread(TrainerServer(server_config, backend)).start())


class _Workers:
    """``workers.count`` agent slots in a thread; the agent's OpenAI settings pointed at the gateway only when it
    relays the agent's model (``apo.gateway_model``)."""

    def __init__(self, config: Config, url: str, token: str | None) -> None:
        from agl_core.worker import Worker

        self.worker: Any = None
        self.thread: threading.Thread | None = None
        if config.workers.count == 0:
            return
        logging.getLogger("agl.worker").setLevel(logging.ERROR)
        apo = config.apo
        assert apo is not None
        try:
            self.worker = Worker(url, config.agent, token=token, concurrency=config.workers.count, poll_s=0.2,
                                 grace_s=5.0, set_openai_env=apo.gateway_model is not None)
        except ValueError as exc:
            raise ConfigError("agent", str(exc)) from None
        self.thread = threading.Thread(target=self.worker.run, name="agl-apo-worker", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop(now=True)
        if self.thread is not None:
            self.thread.join(timeout=30)
            if self.thread.is_alive():
                logger.warning("agl train: the workers did not stop within 30 s")
