"""``agl demo``: a tiny model that writes its own tool calls, warm-started by SFT on a teacher's traces, then RL.

The stages, all in one process on this CPU, through agl's real server, gateway and torch engine:

1. **The model.** A byte-level BPE tokenizer is trained on the demo's own texts and a two-layer Llama is
   initialised at random (:mod:`agl_trainer.demo.textpolicy`); both are saved to ``base-model/`` and read back
   with ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained``. It writes noise: its reward is measured
   (``chance``).
2. **The teacher.** The same LangChain agent (:func:`agl_trainer.demo.lockers.solve_text`) runs against a
   scripted teacher model served by the torch engine (:class:`~agl_trainer.demo.textpolicy.TeacherEngine`):
   it knows half of the lockers and mixes up the others (their right code first in 20% of its runs on each).
   Its runs are captured like any agent's, into ``teacher.db``, with their exact token ids.
3. **SFT.** ``algorithm: sft``'s code (:class:`agl_core.store.selection.Selection` with ``min_reward``,
   :func:`agl_trainer.sft.sft_examples`, :class:`agl_trainer.sft.SftTrainer`) fine-tunes the model on the
   teacher's calls of the runs that opened the locker and answered; the result is saved to ``sft-model/`` and
   its reward measured (``sft``): it writes the tool call and the answer, but picks the codes as the teacher
   did, mixing up half of the lockers, and stays below the target.
4. **RL.** GRPO (:class:`agl_trainer.training.Trainer`, the torch backend) starts from ``sft-model/`` (read
   back with ``from_pretrained``, as ``agl train`` reads an SFT run's ``model/``), with a KL penalty to it
   (``kl_coef``), and trains until the mean reward of the last ``window`` steps reaches ``target``. A reply that
   ``max_tokens`` cuts off costs as much as a wrong code (``AirRules.truncated``).

A second run in the same ``--dir`` resumes the RL stage from ``checkpoint/`` and keeps the warm start's figures
(``warmstart.json``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import time
from typing import Any

__all__ = ["run_text_demo"]

WARMSTART = "warmstart.json"


def run_text_demo(options: Any) -> Any:
    """:func:`agl_trainer.demo.run.run_demo` for the text demo (the default)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from agl_trainer.demo.lockers import Lockers
    from agl_trainer.demo.run import DemoResult, _reached, _train
    from agl_trainer.engine import TorchEngine
    from agl_trainer.torch_backend import TorchBackend
    from agl_trainer.training import TrainConfig, Trainer

    torch.set_num_threads(options.threads)
    logging.getLogger("agl.worker").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the model folders are read and written several times: no bars for them
    started = time.monotonic()
    folder = os.path.abspath(options.folder)
    if options.fresh and os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder, exist_ok=True)
    lockers = Lockers(n=options.lockers, seed=options.seed)
    warm_path = os.path.join(folder, WARMSTART)
    sft_dir = os.path.join(folder, "sft-model")
    if os.path.exists(warm_path) and os.path.isdir(sft_dir):
        with open(warm_path, encoding="utf-8") as f:
            warm = json.load(f)
    else:
        warm = _warm_start(options, lockers, folder)
    engine = TorchEngine.from_pretrained(sft_dir, name="tiny-text-policy", seed=options.seed,
                                         max_batch=options.workers, batch_wait_s=0.003,
                                         default_max_tokens=_max_tokens())
    from transformers import AutoModelForCausalLM

    backend = TorchBackend(AutoModelForCausalLM.from_pretrained(sft_dir), _rl_config(options),
                           pad_id=engine.tokenizer.pad_token_id)
    initial = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    with _Serving(options, os.path.join(folder, "agl.db"), engine) as served:
        trainer = Trainer(served.server, backend, engine, lockers.tasks(), TrainConfig(
            tasks_per_step=options.lockers, group_size=options.group_size, row_mode=options.row_mode,
            checkpoint_dir=os.path.join(folder, "checkpoint"), checkpoint_every=options.checkpoint_every))
        resumed = trainer.resume()
        if "sft" not in warm and not resumed:  # the SFT model alone, sampled as the RL steps are, before any update
            warm["sft"] = served.measure(lockers.tasks(), options.group_size * options.window, "sft")
            _say(options, f"agl demo: the SFT model alone: reward {warm['sft']['reward']:.2f} over "
                          f"{warm['sft']['rollouts']} rollouts (the target is {options.target:g})")
            _write_json(warm_path, warm)
        _train(trainer, options, started, folder)
        rollouts = len(served.server.store.rollouts())
    changed = any(not torch.equal(initial[k], v) for k, v in engine.model.state_dict().items())
    steps = [r.to_dict() for r in trainer.history]
    reached = _reached(trainer.history, options)
    wall = time.monotonic() - started
    curve, summary = _report(options, folder, steps, reached, wall, resumed, rollouts, warm)
    return DemoResult(steps=steps, reached=reached, wall_s=wall, resumed=resumed, folder=folder, curve=curve,
                      weights_changed=changed, summary=summary, store_rollouts=rollouts, extra={"warm": warm})


def _max_tokens() -> int:
    from agl_trainer.demo.lockers import TEXT_MAX_TOKENS

    return TEXT_MAX_TOKENS


def _rl_config(options: Any) -> Any:
    from agl_trainer.torch_backend import TorchConfig

    # 1e-4: Adam moves every weight by about lr a step, and this Llama's weights start at std 0.02; at 5e-4 a
    # couple of steps wrecked the SFT model's format (it wrote "3333...")
    # kl_coef: the SFT model is the reference (a frozen copy), so a locker whose samples have all gone wrong is
    # pulled back towards well-formed calls instead of staying where GRPO sees no spread to learn from
    kl_coef = 0.1 if options.kl_coef is None else options.kl_coef
    return TorchConfig(lr=options.lr or 1e-4, kl_coef=kl_coef, minibatches=options.minibatches, epochs=options.epochs,
                       gradient_checkpointing=False)


def _say(options: Any, line: str) -> None:
    if options.progress:
        print(line, file=sys.stderr, flush=True)


def _write_json(path: str, data: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


class _Serving:
    """agl's server (store ``db``, gateway over ``engine``) on 127.0.0.1 and a worker running the agent."""

    def __init__(self, options: Any, db: str, engine: Any) -> None:
        from agl_core.transitions import AirRules, TransitionBuilder
        from agl_trainer.demo.lockers import TEXT_TOOL_ERROR_REWARD, TOOL_OK_REWARD
        from agl_trainer.gateway import GatewayConfig, training_sampling
        from agl_trainer.server import ServerConfig, TrainerServer

        self.options = options
        self.engine = engine
        # every failed call costs the same: a call the tool refuses (no code), one whose JSON does not parse or a
        # reply that runs on until max_tokens cuts it (it ends the run with no answer, 0, where a wrong code costs
        # -0.5) must not be a cheaper miss than a wrong code, or RL learns to write broken calls or to ramble
        air = AirRules(tool_ok=TOOL_OK_REWARD, tool_error=TEXT_TOOL_ERROR_REWARD,
                       tool_exception=TEXT_TOOL_ERROR_REWARD, malformed_tool_call=TEXT_TOOL_ERROR_REWARD,
                       truncated=TEXT_TOOL_ERROR_REWARD)
        self.server = TrainerServer(ServerConfig(
            db_path=db, port=0, max_attempts=2, lease_timeout_s=120.0,
            builder=TransitionBuilder(agent_match="solver", air=air),
            gateway=GatewayConfig(sampling_overrides=training_sampling(1.0))), engine)
        self.thread: Any = None
        self.worker: Any = None
        self.running: threading.Thread | None = None

    def __enter__(self) -> _Serving:
        from agl_core.worker import Worker, point_openai_at
        from agl_trainer.demo.lockers import solve_text
        from agl_trainer.server import ServerThread

        self.thread = ServerThread(self.server).start()
        point_openai_at(self.thread.url, None)
        self.worker = Worker(self.thread.url, solve_text, concurrency=self.options.workers, poll_s=0.2, grace_s=5.0)
        self.running = threading.Thread(target=self.worker.run, name="agl-demo-worker", daemon=True)
        self.running.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.worker is not None:
            self.worker.stop(now=True)
        if self.running is not None:
            self.running.join(timeout=10)
        if self.thread is not None:
            self.thread.stop()

    def run(self, tasks: list[Any], repeat: int, label: str) -> tuple[list[Any], list[str]]:
        """``repeat`` rollouts of each task; their trajectories and the queue's task ids."""
        from agl_trainer.training import LocalServer, collect

        link = LocalServer(self.server, self.engine)
        ids = link.enqueue(tasks, [f"{label}-t{j}" for j in range(len(tasks))], repeat=repeat, max_attempts=2)
        trajectories, errors, _ = collect(link, ids, timeout_s=600.0)
        if trajectories and len(errors) == len(trajectories):
            raise RuntimeError(f"every {label} rollout failed; the first: {errors[0]}")
        return trajectories, ids

    def measure(self, tasks: list[Any], repeat: int, label: str) -> dict[str, Any]:
        """The mean return (as the RL steps score it) and final reward of ``repeat`` rollouts of each task."""
        trajectories, _ = self.run(tasks, repeat, label)
        return _figures(trajectories)


def _figures(trajectories: list[Any]) -> dict[str, Any]:
    from agl_trainer.training import TrainConfig, score_batch

    batch = score_batch(trajectories, TrainConfig())
    finals = [float(t.reward) for t in trajectories if t.reward is not None]
    calls = [t for traj in trajectories for t in traj.transitions]
    first = [traj.transitions[0] for traj in trajectories if traj.transitions]
    return {"reward": batch.advantage_stats.mean_return, "final_reward": sum(finals) / max(1, len(finals)),
            "rollouts": len(trajectories),
            "tool_calls": sum(bool(t.response.get("tool_calls")) for t in calls),
            "first_call_opened": sum(t.reward is not None and t.reward > 0 for t in first) / max(1, len(first)),
            "calls": len(calls)}


def _warm_start(options: Any, lockers: Any, folder: str) -> dict[str, Any]:
    """Stages 1 to 3: the model folder, chance, the teacher's traces, SFT; their figures (``warmstart.json``)."""
    from transformers import AutoModelForCausalLM

    from agl_core.store.selection import Selection
    from agl_core.store.sqlite import SqliteStore
    from agl_trainer.demo.lockers import SYSTEM
    from agl_trainer.demo.textpolicy import Teacher, TeacherEngine, load_text_policy, save_text_policy
    from agl_trainer.sft import SftTrainer, save_model, sft_examples
    from agl_trainer.torch_backend import TorchBackend, TorchConfig

    started = time.monotonic()
    base = save_text_policy(os.path.join(folder, "base-model"), lockers, SYSTEM, seed=options.seed,
                            hidden=options.hidden)
    model, tokenizer = load_text_policy(base)
    teacher = Teacher(lockers.secret(), lockers.codes, right=options.teacher_right, seed=options.seed)
    engine = TeacherEngine(model, tokenizer, teacher, name="tiny-text-policy", seed=options.seed,
                           max_batch=options.workers, batch_wait_s=0.003, default_max_tokens=_max_tokens())
    db = os.path.join(folder, "teacher.db")
    for leftover in (db, f"{db}-wal", f"{db}-shm"):
        if os.path.exists(leftover):
            os.remove(leftover)
    with _Serving(options, db, engine) as served:
        engine.scripted = False  # the model itself: noise
        chance = served.measure(lockers.tasks(), options.group_size, "chance")
        _say(options, f"agl demo: the untrained model: reward {chance['reward']:.2f} over {chance['rollouts']} "
                      f"rollouts ({chance['tool_calls']} tool calls)")
        engine.scripted = True
        trajectories, teacher_ids = served.run(lockers.tasks(), options.teacher_runs, "teacher")
        taught = _figures(trajectories)
    _say(options, f"agl demo: the teacher: reward {taught['reward']:.2f} over {taught['rollouts']} rollouts, "
                  f"right code first in {teacher.first_right} of {teacher.first_tries} runs")
    selection = Selection(task_ids=teacher_ids, agent="^solver$", min_reward=options.sft_min_reward)
    with SqliteStore(db) as store:
        transitions = list(selection.transitions(store))
    examples, stats = sft_examples(transitions, tokenizer)
    backend = TorchBackend(AutoModelForCausalLM.from_pretrained(base), TorchConfig(lr=options.sft_lr,
                           gradient_checkpointing=False), pad_id=tokenizer.pad_token_id)
    sft = SftTrainer(backend, batch_size=16)
    before = sft.response_logprobs(examples)
    steps = sft.train(examples, epochs=options.sft_epochs, seed=options.seed)
    after = sft.response_logprobs(examples)
    save_model(backend, tokenizer, base, os.path.join(folder, "sft-model"))
    tokens = sum(e.response_tokens for e in examples)
    warm = {"chance": chance, "teacher": {**taught, "first_right": teacher.first_right,
                                          "first_tries": teacher.first_tries},
            "sft_stage": {"examples": stats.examples, "transitions": stats.transitions, "recorded": stats.recorded,
                          "chat_template": stats.chat_template, "steps": len(steps),
                          "loss_first": steps[0]["loss"], "loss_last": steps[-1]["loss"],
                          "logprob_per_token_before": sum(before) / tokens,
                          "logprob_per_token_after": sum(after) / tokens,
                          "min_reward": options.sft_min_reward},
            "warm_start_s": time.monotonic() - started}
    _say(options, f"agl demo: sft on {stats.examples} of the teacher's calls ({stats.recorded} with recorded token "
                  f"ids), {len(steps)} steps: loss {steps[0]['loss']:.2f} -> {steps[-1]['loss']:.2f}")
    _write_json(os.path.join(folder, WARMSTART), warm)
    return warm


def _report(options: Any, folder: str, steps: list[dict[str, Any]], reached: bool, wall: float, resumed: bool,
            rollouts: int, warm: dict[str, Any]) -> tuple[str, str]:
    from agl_trainer.demo.run import _signal_line, _step_table, _warned
    from agl_trainer.training import StepResult, write_curves

    curve, _ = write_curves(folder, [StepResult.from_dict(s) for s in steps],
                            title=f"agl demo: tiny BPE Llama writing tool calls, SFT then GRPO, {options.lockers} "
                                  f"lockers, CPU", target=options.target)
    first, last = (steps[0], steps[-1]) if steps else (None, None)
    s = warm.get("sft_stage", {})
    lines = ["# agl demo", "",
             "A tiny Llama (byte-level BPE tokenizer trained in code, ChatML template with Hermes tool calls) "
             "behind a LangChain agent (`solver`, a `create_agent` with an `unlock` tool): SFT on a scripted "
             "teacher's traces, then GRPO through agl's gateway.", ""]
    lines += [
        f"- untrained model: reward {warm['chance']['reward']:.2f} ({warm['chance']['tool_calls']} tool calls "
        f"in {warm['chance']['rollouts']} rollouts)",
        f"- teacher (right code first {warm['teacher']['first_right']} of {warm['teacher']['first_tries']}): "
        f"reward {warm['teacher']['reward']:.2f} over {warm['teacher']['rollouts']} rollouts",
        f"- sft: {s.get('examples', 0)} calls (return >= {s.get('min_reward', 0):g}), {s.get('steps', 0)} steps, "
        f"loss {s.get('loss_first', 0):.2f} -> {s.get('loss_last', 0):.2f}, the teacher's responses' logprob per "
        f"token {s.get('logprob_per_token_before', 0):.2f} -> {s.get('logprob_per_token_after', 0):.2f}",
    ]
    if "sft" in warm:
        lines.append(f"- SFT alone: reward {warm['sft']['reward']:.2f} over {warm['sft']['rollouts']} rollouts "
                     f"(right code first in {warm['sft']['first_call_opened']:.0%})")
    if first and last:
        lines += [
            f"- RL steps: {len(steps)} ({'resumed' if resumed else 'from the SFT model'}), "
            f"{sum(x['rollouts'] for x in steps)} rollouts, {rollouts} in the store",
            f"- mean reward (return per rollout): {first['reward']:.2f} at step {first['step']} -> "
            f"{last['reward']:.2f} at step {last['step']}",
            f"- target {options.target:g} over the last {options.window} steps: "
            f"{'reached' if reached else 'NOT reached'}",
            f"- wall time of this run: {wall:.0f} s (warm start {warm.get('warm_start_s', 0):.0f} s); "
            f"rollouts/s (last step): {last['rollouts_per_s']:.1f}",
            f"- rows: mode {options.row_mode}, merged transitions (last step) {last['merged']}, "
            f"prefix mismatches {last['prefix_mismatches']}",
            _signal_line(last),
        ]
        lines += _warned(steps)
    lines += _step_table(steps)
    lines += ["", f"Task: {options.lockers} lockers, one code and one thing each. The model writes a tool call "
              "(`<tool_call>{\"name\": \"unlock\", \"arguments\": {\"code\": \"3\"}}</tool_call><|im_end|>`, about "
              "eighteen tokens) and then the answer (a word and `<|im_end|>`). Return: 0.5 for opening the locker, "
              "0.5 for the right answer, -0.5 for each failed call (a wrong code, no code, a broken tool call)."]
    summary = "\n".join(lines) + "\n"
    with open(os.path.join(folder, "summary.md"), "w", encoding="utf-8") as f:
        f.write(summary)
    return curve, summary
