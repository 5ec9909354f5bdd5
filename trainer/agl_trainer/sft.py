"""Supervised fine-tuning on the agent's own stored calls (``algorithm: sft``), and rejection sampling (``rft``).

**SFT** reads transitions from a store (``sft.data``: a SQLite file or an ``agl serve``
URL; by default the run's ``server.db``) with the selection ``agl export`` uses
(:class:`agl_core.store.selection.Selection`: ``sft.task_ids``, ``sft.status``,
``sft.agent``, ``sft.min_reward``), and trains the torch backend (full or LoRA, as
``backend`` says) to predict each selected response from its prompt:

- the loss is the mean negative log-likelihood of the **response tokens only**: the
  prompt is context (:attr:`SftExample.label_mask` is 0 on it);
- the tokens are the **recorded ones** where the transition has them (the gateway's
  exact ids, or ids the engine returned; ``token_source`` ``gateway`` / ``response``, or
  ids the collector re-tokenised, ``retokenized``): what the model saw and sampled,
  not a re-rendering of the text that a template may tokenise differently;
- a transition without ids is rendered with the tokenizer's chat template (prompt with
  the generation prompt, then the prompt and the response: the response ids are what the
  second adds), and **counted**: ``chat_template`` in every step's metrics and the
  console line, so a run that trains on re-rendered text says so. A rendering whose
  prompt is not a prefix of the whole is left out and counted (``template_mismatch``).

**RFT** (rejection-sampling fine-tuning) runs rounds through the same server, gateway
and workers as ``grpo``: each round samples ``data.group_size`` rollouts of each of
``data.tasks_per_step`` tasks, keeps per task the rollout with the highest final reward
(ties: the first sample, ``#0`` before ``#1``; a rollout without a reward never wins;
with ``sft.min_reward`` the best must reach it, or the task keeps nothing that round),
fine-tunes on the kept rollouts' trained calls (their exact gateway ids) for
``sft.epochs`` passes, and serves the new weights to the next round. ``run.steps`` is the
number of rounds.

Both leave in ``run.dir``: ``model/`` (a Hugging Face folder, LoRA adapters merged in,
with the tokenizer: ``backend.model`` of a later ``grpo`` run starts from it),
``sft-checkpoint/`` or ``rft-checkpoint/`` (:meth:`TorchBackend.save`: not ``checkpoint/``, which a ``grpo``
run in the same folder would resume from as if its own), ``loss_curve.png`` and ``summary.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from agl_core.schema import Trajectory, Transition
from agl_core.store.selection import Selection
from agl_trainer.loss import token_logprobs
from agl_trainer.torch_backend import TorchBackend

__all__ = ["SftExample", "SftStats", "SftTrainer", "best_per_task", "save_model", "sft_examples", "sft_loss",
           "template_ids"]

logger = logging.getLogger("agl.trainer")

RECORDED = ("gateway", "response", "retokenized")
"""``token_source`` values whose ids are trained as recorded."""


@dataclass
class SftExample:
    """One training sequence: the prompt's ids, then the response's."""

    input_ids: list[int]
    prompt_len: int
    source: str
    """``gateway`` / ``response`` / ``retokenized`` (the recorded ids), or ``chat_template`` (rendered here)."""
    rollout_id: str = ""
    task_id: str = ""

    @property
    def label_mask(self) -> list[int]:
        """1 on the response tokens (trained), 0 on the prompt's."""
        return [0] * self.prompt_len + [1] * (len(self.input_ids) - self.prompt_len)

    @property
    def response_tokens(self) -> int:
        return len(self.input_ids) - self.prompt_len


@dataclass
class SftStats:
    """What became of the selected transitions."""

    transitions: int = 0
    examples: int = 0
    recorded: int = 0
    """Examples trained on the transition's own ids."""
    chat_template: int = 0
    """Examples whose ids were rendered here with the chat template (the transition had none)."""
    template_mismatch: int = 0
    """Left out: the template's prompt was not a prefix of its prompt + response."""
    empty_response: int = 0
    """Left out: no response token."""
    truncated: int = 0
    dropped_response_tokens: int = 0
    token_sources: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------- transitions -> examples


def template_ids(tokenizer: Any, t: Transition) -> tuple[list[int], list[int]] | None:
    """``(prompt_ids, response_ids)`` of ``t`` rendered with the chat template; None when the rendered prompt is
    not a prefix of the rendered prompt + response (no honest split of the two)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("a transition has no token ids and the tokenizer has no chat_template to render it with: "
                         "record calls through agl's gateway, or give the model folder a chat template")
    kwargs: dict[str, Any] = {"tools": t.tools} if t.tools else {}
    messages = [_for_template(m) for m in t.prompt]
    prompt = _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs))
    whole = _ids(tokenizer.apply_chat_template([*messages, _for_template(t.response)], tokenize=True, **kwargs))
    if whole[:len(prompt)] != prompt:
        return None
    return prompt, whole[len(prompt):]


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A stored message as chat templates take it: a tool call's ``arguments`` a mapping, not the JSON text the
    OpenAI API sends (a template would render the text as a quoted string: not what the model wrote)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                function["arguments"] = parsed
        fixed.append({**call, "function": function})
    return {**message, "tool_calls": fixed}


def _ids(rendered: Any) -> list[int]:
    """Token ids from ``apply_chat_template(tokenize=True)``: a list, or (transformers 5) a mapping of them."""
    if isinstance(rendered, dict) or hasattr(rendered, "keys"):
        rendered = rendered["input_ids"]
    return [int(i) for i in rendered]


def sft_examples(transitions: Iterable[Transition], tokenizer: Any, *, max_prompt_length: int | None = None,
                 max_response_length: int | None = None) -> tuple[list[SftExample], SftStats]:
    """The training sequences of ``transitions``: their recorded ids, else the chat template's (counted)."""
    stats = SftStats()
    out: list[SftExample] = []
    for t in transitions:
        stats.transitions += 1
        if t.prompt_token_ids is not None and t.response_token_ids is not None:
            prompt, response = list(t.prompt_token_ids), list(t.response_token_ids)
            source = str(t.token_source or "response")
        else:
            rendered = template_ids(tokenizer, t)
            if rendered is None:
                stats.template_mismatch += 1
                continue
            prompt, response = rendered
            source = "chat_template"
        if not response:
            stats.empty_response += 1
            continue
        cut = False
        if max_prompt_length is not None and len(prompt) > max_prompt_length:
            prompt, cut = prompt[-max_prompt_length:], True  # the most recent context
        if max_response_length is not None and len(response) > max_response_length:
            stats.dropped_response_tokens += len(response) - max_response_length
            response, cut = response[:max_response_length], True
        stats.truncated += cut
        stats.token_sources[source] = stats.token_sources.get(source, 0) + 1
        if source == "chat_template":
            stats.chat_template += 1
        else:
            stats.recorded += 1
        out.append(SftExample(prompt + response, len(prompt), source, t.rollout_id, t.task_id))
    stats.examples = len(out)
    return out, stats


# ---------------------------------------------------------------------- the loss


def sft_loss(logp: Any, mask: Any) -> tuple[Any, int]:
    """``(sum of -logp over masked positions, masked positions)``: ``logp`` is ``(B, L-1)``, the logprob of token
    ``p+1`` (:func:`agl_trainer.loss.token_logprobs`), ``mask`` the label mask shifted alike."""
    mask = mask.to(logp.dtype)
    return -(logp * mask).sum(), int(mask.sum().item())


class SftTrainer:
    """Fine-tunes a :class:`TorchBackend`'s model on :class:`SftExample` batches: its optimizer, master weights
    and micro-batching (``max_tokens_per_forward``), the loss on response tokens only, at temperature 1."""

    def __init__(self, backend: TorchBackend, *, batch_size: int = 8) -> None:
        self.backend = backend
        self.batch_size = batch_size

    def train(self, examples: Sequence[SftExample], *, epochs: int = 1, seed: int = 0,
              on_step: Callable[[dict[str, float]], None] | None = None) -> list[dict[str, float]]:
        """``epochs`` shuffled passes in batches of ``batch_size``, one optimizer step each; each step's metrics."""
        import random

        if not examples:
            raise ValueError("no examples to fine-tune on")
        order = list(range(len(examples)))
        rng = random.Random(seed)
        out = []
        for _ in range(epochs):
            rng.shuffle(order)
            for start in range(0, len(order), self.batch_size):
                metrics = self.step([examples[i] for i in order[start:start + self.batch_size]])
                out.append(metrics)
                if on_step is not None:
                    on_step(metrics)
        return out

    def step(self, batch: Sequence[SftExample]) -> dict[str, float]:
        """One optimizer step on ``batch``: the mean NLL over all its response tokens."""
        b = self.backend
        started = time.perf_counter()
        total_tokens = sum(e.response_tokens for e in batch)
        if not total_tokens:
            raise ValueError("a batch without response tokens: nothing to train on")
        loss_sum = 0.0
        with self._holding_engine():
            b.model.train()
            b.optimizer.zero_grad(set_to_none=True)
            for micro in _micro(batch, b.config.max_tokens_per_forward):
                ids, attention, mask = self.tensors(micro)
                logp = token_logprobs(b.model, ids, attention, temperature=1.0,
                                      chunk_tokens=b.config.logit_chunk_tokens)
                nll, _ = sft_loss(logp, mask)
                b.master.backward(nll / total_tokens)
                loss_sum += float(nll.detach())
            norm, outcome = b.master.step(b.optimizer, b.config.max_grad_norm)
        b.step += 1
        metrics = {"loss": loss_sum / total_tokens, "grad_norm": norm, "rows": float(len(batch)),
                   "loss_tokens": float(total_tokens), "tokens": float(sum(len(e.input_ids) for e in batch)),
                   "chat_template": float(sum(e.source == "chat_template" for e in batch)),
                   "update_s": time.perf_counter() - started}
        if outcome != "stepped":
            metrics["skipped_steps" if outcome == "overflow" else "flat_steps"] = 1.0
        return metrics

    def tensors(self, batch: Sequence[SftExample]) -> tuple[Any, Any, Any]:
        """``(input_ids, attention_mask, label mask)`` of a right-padded batch; the mask is shifted as ``logp``."""
        torch = self.backend.torch
        width = max(len(e.input_ids) for e in batch)
        ids = torch.full((len(batch), width), self.backend.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width - 1))
        for i, e in enumerate(batch):
            n = len(e.input_ids)
            ids[i, :n] = torch.tensor(e.input_ids)
            attention[i, :n] = 1
            mask[i, :n - 1] = torch.tensor(e.label_mask[1:], dtype=torch.float32)
        device = self.backend.device
        return ids.to(device), attention.to(device), mask.to(device)

    def response_logprobs(self, examples: Sequence[SftExample]) -> list[float]:
        """The summed logprob of each example's response given its prompt, under the current weights."""
        b = self.backend
        out: list[float] = []
        was_training = b.model.training
        b.model.eval()
        try:
            with b.torch.no_grad():
                for e in examples:
                    ids, attention, mask = self.tensors([e])
                    logp = token_logprobs(b.model, ids, attention, temperature=1.0)
                    out.append(float((logp * mask).sum()))
        finally:
            b.model.train(was_training)
        return out

    @contextlib.contextmanager
    def _holding_engine(self) -> Iterator[None]:
        engine = self.backend.shared_engine
        with engine.paused() if engine is not None else contextlib.nullcontext():
            yield


def _micro(batch: Sequence[SftExample], max_tokens: int) -> list[list[SftExample]]:
    """Parts of ``batch`` whose padded size stays within ``max_tokens`` (one sequence at least)."""
    out: list[list[SftExample]] = []
    current: list[SftExample] = []
    width = 0
    for e in sorted(batch, key=lambda e: len(e.input_ids)):
        w = max(width, len(e.input_ids))
        if current and w * (len(current) + 1) > max_tokens:
            out.append(current)
            current, w = [], len(e.input_ids)
        current.append(e)
        width = w
    if current:
        out.append(current)
    return out


# ---------------------------------------------------------------------- rejection sampling


def best_per_task(trajectories: Iterable[Trajectory], min_reward: float | None = None
                  ) -> tuple[dict[str, Trajectory], int]:
    """Per task (the queue id before ``#k``), the trajectory with the highest final reward, and how many tasks kept
    none. Ties go to the first sample (``#0`` before ``#1``); no reward never wins; with ``min_reward`` the best
    must reach it."""
    by_task: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_task.setdefault(t.task_id.rpartition("#")[0] or t.task_id, []).append(t)
    best: dict[str, Trajectory] = {}
    for task, group in by_task.items():
        scored = [t for t in sorted(group, key=lambda t: _sample_index(t.task_id)) if t.reward is not None]
        if not scored:
            continue
        top = max(scored, key=lambda t: float(t.reward or 0.0))  # max keeps the first of equals
        if min_reward is not None and float(top.reward or 0.0) < min_reward:
            continue
        best[task] = top
    return best, len(by_task) - len(best)


def _sample_index(task_id: str) -> int:
    tail = task_id.rpartition("#")[2]
    return int(tail) if tail.isdigit() else 0


# ---------------------------------------------------------------------- the model folder


def save_model(backend: TorchBackend, tokenizer: Any, base_path: str, folder: str) -> str:
    """The trained policy as a Hugging Face folder (LoRA adapters merged) with its tokenizer; replaced whole."""
    tmp = f"{folder}.tmp-{os.getpid()}"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    if backend.config.lora is None:
        backend.model.save_pretrained(tmp)
    else:
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_pretrained(base_path, dtype=next(backend.model.parameters()).dtype)
        plain.load_state_dict(backend.serving_state_dict())
        plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if os.path.exists(folder):
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


# ---------------------------------------------------------------------- agl train's runs


def step_line(kind: str, step: int, metrics: dict[str, float], extra: str = "") -> str:
    """The console line of one optimizer step (with its count of chat-template examples)."""
    return (f"{kind} step {step:>4} loss {metrics['loss']:7.4f} grad {metrics['grad_norm']:7.4f} "
            f"{int(metrics['rows'])} examples, {int(metrics['loss_tokens'])} response tokens, "
            f"{int(metrics.get('chat_template', 0))} chat-template{extra}")


def run_sft(config: Any, backend: TorchBackend, tokenizer: Any, *, progress: bool = True) -> dict[str, Any]:
    """``algorithm: sft``: the selected transitions of ``sft.data``, fine-tuned on; what the run did."""
    from agl_core.errors import AglError
    from agl_trainer.config import ConfigError

    started = time.monotonic()
    s, a = config.sft, config.algorithm
    selection = Selection(task_ids=s.task_ids, status=s.status or None, agent=_agent(config),
                          min_reward=s.min_reward)
    source, store = _open_store(config)
    try:
        with store:
            transitions = list(selection.transitions(store))
    except AglError as exc:
        raise ConfigError("sft.data", f"cannot read {source}: {exc}") from None
    examples, stats = sft_examples(transitions, tokenizer, max_prompt_length=a.max_prompt_length,
                                   max_response_length=a.max_response_length)
    _say(progress, f"agl train: sft on {stats.examples} examples of {stats.transitions} selected transitions from "
                   f"{source} ({stats.recorded} with recorded token ids, {stats.chat_template} rendered with the chat "
                   f"template, {stats.template_mismatch + stats.empty_response} left out)")
    if not examples:
        raise ConfigError("sft", f"no transition of {source} passes the selection ({_shown(selection)}) with "
                                 f"token ids or a chat template: nothing to fine-tune on")
    trainer = SftTrainer(backend, batch_size=s.batch_size)
    steps: list[dict[str, Any]] = []

    def on_step(m: dict[str, float]) -> None:
        steps.append({"step": backend.step, **m})
        _say(progress, step_line("sft", backend.step, m))

    trainer.train(examples, epochs=s.epochs, seed=config.run.seed, on_step=on_step)
    return _finish(config, backend, tokenizer, started, {"selection": stats.as_dict(), "steps": steps})


def run_rft(config: Any, backend: TorchBackend, tokenizer: Any, link: Any, tasks: Sequence[Any], *,
            progress: bool = True) -> dict[str, Any]:
    """``algorithm: rft``: ``run.steps`` rounds of sample, keep the best per task, fine-tune, publish."""
    from agl_trainer.training import collect

    started = time.monotonic()
    s, d, a = config.sft, config.data, config.algorithm
    keep = Selection(agent=s.agent)  # agent_match already chose the trained calls (the server's builder)
    trainer = SftTrainer(backend, batch_size=s.batch_size)
    run_id = uuid.uuid4().hex[:6]
    rounds: list[dict[str, Any]] = []
    for r in range(config.run.steps):
        chosen = [tasks[(r * d.tasks_per_step + j) % len(tasks)] for j in range(d.tasks_per_step)]
        ids = [f"{run_id}-r{r}-t{j}" for j in range(d.tasks_per_step)]
        queued = link.enqueue(chosen, ids, repeat=d.group_size, max_attempts=config.server.max_attempts)
        trajectories, errors, failed = collect(link, queued, timeout_s=config.run.step_timeout_s)
        if trajectories and len(errors) == len(trajectories):
            raise RuntimeError(f"every rollout of round {r + 1} failed; the first error: {errors[0]}")
        finals = [float(t.reward) for t in trajectories if t.reward is not None]
        best, without = best_per_task(trajectories, s.min_reward)
        kept = [t for traj in best.values() for t in traj.transitions if keep.keeps(t)]
        examples, stats = sft_examples(kept, tokenizer, max_prompt_length=a.max_prompt_length,
                                       max_response_length=a.max_response_length)
        record: dict[str, Any] = {
            "round": r + 1, "reward_mean": sum(finals) / len(finals) if finals else 0.0,
            "best_reward_mean": sum(float(t.reward or 0.0) for t in best.values()) / len(best) if best else 0.0,
            "rollouts": len(trajectories), "failed_rollouts": len(errors), "failed_tasks": failed,
            "tasks_kept": len(best), "tasks_without_keeper": without, "selection": stats.as_dict(), "steps": []}
        line = (f"rft round {r + 1}/{config.run.steps}: reward {record['reward_mean']:.3f} over "
                f"{len(trajectories)} rollouts, kept the best of {len(best)} tasks ({without} without one "
                f"reaching sft.min_reward), {stats.examples} examples")
        _say(progress, line)
        if not examples:
            logger.warning("agl train: rft round %d trains on nothing: no task had a rollout to keep (rewards "
                           "missing, or none reached sft.min_reward %s)", r + 1, s.min_reward)
        else:
            def on_step(m: dict[str, float], record: dict[str, Any] = record) -> None:
                record["steps"].append({"step": backend.step, **m})
                _say(progress, step_line("rft", backend.step, m))

            trainer.train(examples, epochs=s.epochs, seed=config.run.seed + r, on_step=on_step)
        record["version"] = link.publish(backend)
        rounds.append(record)
        last = record["steps"][-1] if record["steps"] else {}
        values = {"reward_mean": record["reward_mean"], "rft_best_reward_mean": record["best_reward_mean"],
                  "rft_tasks_kept": float(len(best)), "transitions_trained": float(stats.examples),
                  "chat_template": float(stats.chat_template), **({"loss": last["loss"]} if last else {})}
        try:
            link.record_metrics(r + 1, values)
        except Exception as exc:  # noqa: BLE001 - a dashboard that is down must not cost a round
            logger.warning("agl train: could not record the metrics of round %d: %s", r + 1, exc)
    steps = [m for rec in rounds for m in rec["steps"]]
    return _finish(config, backend, tokenizer, started, {"rounds": rounds, "steps": steps})


def _open_store(config: Any) -> tuple[str, Any]:
    """``sft.data`` (default ``server.db``) opened: an ``agl serve`` URL over HTTP, else an existing SQLite file."""
    from agl_core.errors import AglError
    from agl_trainer.config import ConfigError

    data = config.sft.data
    if data is not None and data.startswith(("http://", "https://")):
        from agl_core.store.http import HttpStore

        return data, HttpStore(data, config.server.token or os.environ.get("AGL_TOKEN") or None, timeout=30.0)
    key, path = ("sft.data", config.path(data)) if data is not None else ("server.db", config.path(config.server.db))
    if not os.path.isfile(path):
        raise ConfigError(key, f"no such store: {path} (sft reads the transitions of an agl store, a SQLite file)")
    from agl_core.store.sqlite import SqliteStore

    try:
        return path, SqliteStore(path)
    except AglError as exc:  # not an agl store: left as it was
        raise ConfigError(key, f"{path}: {exc}") from None


def _agent(config: Any) -> str | None:
    return str(config.sft.agent) if config.sft.agent is not None else config.agent_match


def _shown(selection: Selection) -> str:
    parts = [f"{k}={v!r}" for k, v in (("task_ids", selection.task_ids), ("status", selection.status),
                                       ("agent", selection.agent), ("min_reward", selection.min_reward))
             if v is not None]
    return ", ".join(parts) or "everything"


def _say(enabled: bool, line: str) -> None:
    if enabled:
        print(line, file=sys.stderr, flush=True)


def _finish(config: Any, backend: TorchBackend, tokenizer: Any, started: float, what: dict[str, Any]
            ) -> dict[str, Any]:
    """The model folder, the checkpoint, the loss curve and ``summary.json`` in ``run.dir``; the summary."""
    folder = config.path(config.run.dir)
    os.makedirs(folder, exist_ok=True)
    name = config.algorithm.name
    files = {"model": save_model(backend, tokenizer, config.path(config.backend.model), os.path.join(folder, "model")),
             "checkpoint": os.path.join(folder, f"{name}-checkpoint"),
             "loss curve": os.path.join(folder, "loss_curve.png"), "summary": os.path.join(folder, "summary.json")}
    backend.save(files["checkpoint"], extra={"algorithm": config.algorithm.name})
    try:
        _loss_curve(files["loss curve"], what["steps"], config.algorithm.name)
    except Exception as exc:  # noqa: BLE001 - a missing matplotlib or a full disk costs the picture only
        logger.warning("agl train: could not draw the loss curve: %s", exc)
        files.pop("loss curve")
    summary = {"config": config.model_dump(mode="json"), "algorithm": config.algorithm.name,
               "wall_s": time.monotonic() - started, "files": files, **what}
    with open(files["summary"], "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    return summary


def _loss_curve(path: str, steps: Sequence[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s["step"] for s in steps], [s["loss"] for s in steps])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("NLL per response token")
    ax.set_title(f"agl train: {title}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
