"""``agl demo``: train a real LangChain agent with RL on this machine's CPU, in a few minutes.

Everything runs in one process with the embedded defaults: the agl server (SQLite
store and task queue, the gateway) on 127.0.0.1, the built-in torch engine serving a
tiny model built in code, a worker whose threads run the unchanged LangChain agent of
:mod:`agl_trainer.demo.lockers` against the gateway, and the LightningRL loop of
:mod:`agl_trainer.training` updating the model with the torch backend and swapping the
new weights into the engine after every step.

By default the model writes text (a BPE tokenizer, tool calls of some twenty tokens) and is
warm-started by SFT on a scripted teacher's traces before RL (:mod:`agl_trainer.demo.text`);
``--one-token`` (``DemoOptions.one_token``) is the earlier demo, whose every action is one token
of a word-level vocabulary, trained by RL alone (below).

It stops when the mean reward of the last ``--window`` steps reaches ``--target``
(or after ``--steps`` steps or ``--minutes``), and leaves in ``--dir``: the store
(``agl.db``: every rollout, span and transition), the checkpoint (``checkpoint/``),
the reward and loss curves (``reward_curve.png``, ``loss_curve.png``) and a summary (``summary.md``). Run it again
and it resumes from the checkpoint; ``--fresh`` starts over.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DemoOptions", "DemoResult", "main", "run_demo"]


@dataclass
class DemoOptions:
    folder: str = "agl-demo"
    steps: int = 200
    minutes: float = 10.0
    target: float = 0.9
    window: int = 3
    lockers: int = 4
    group_size: int = 8
    workers: int | None = None
    """Rollouts at a time; None: 1 for the text demo, 16 for ``one_token``. One at a time the text demo is the same
    run every time (with several, which call reaches the engine's batch first decides what each one samples, and
    some runs collapsed or stalled short of the target); the one-token demo reaches it either way."""
    lr: float | None = None
    """None: 1e-4 for the text demo, 5e-4 for ``one_token``."""
    kl_coef: float | None = None
    """The KL penalty to the model RL starts from; None: 0.1 for the text demo (to the SFT model), 0 for
    ``one_token``. Without it the text demo's seed 2 collapsed: a wrong code's negative
    advantage on one locker pushed down the right code's token on another, whose samples turned into broken calls,
    every one -0.5, so that group's advantages were all 0 and nothing pulled it back (reward 0.6 -> 0.25, 8% of
    replies cut at max_tokens)."""
    minibatches: int = 4
    epochs: int = 2
    row_mode: str = "trajectory"
    seed: int = 0
    threads: int = 1
    fresh: bool = False
    progress: bool = True
    checkpoint_every: int = 5
    one_token: bool = False
    """The earlier demo: a word-level model whose every action is one token (no teacher, no SFT)."""
    teacher_right: float = 0.2
    """How often the scripted teacher tries the right code first on the lockers it mixes up (half of them; it tries
    the neighbour's code otherwise, then the right one); on the others, 90% of the time."""
    teacher_runs: int = 32
    """Teacher rollouts per locker, recorded for the SFT warm start."""
    sft_epochs: int = 25
    sft_lr: float = 2e-3
    hidden: int = 128
    """The text model's hidden size (2 Llama layers)."""
    sft_min_reward: float = 0.5
    """SFT keeps the teacher's calls whose run returned at least this (the runs that opened and answered)."""


@dataclass
class DemoResult:
    steps: list[dict[str, Any]]
    reached: bool
    wall_s: float
    resumed: bool
    folder: str
    curve: str
    weights_changed: bool
    summary: str
    store_rollouts: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def run_demo(options: DemoOptions) -> DemoResult:
    """Train until the target, the step limit or the time limit; write the store, curve and summary."""
    if options.workers is None:
        options = copy.copy(options)
        options.workers = 16 if options.one_token else 1
    if not options.one_token:
        from agl_trainer.demo.text import run_text_demo

        return run_text_demo(options)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from agl_core.transitions import AirRules, TransitionBuilder
    from agl_core.worker import Worker, point_openai_at
    from agl_trainer.demo.lockers import TOOL_ERROR_REWARD, TOOL_OK_REWARD, Lockers, solve
    from agl_trainer.gateway import GatewayConfig, training_sampling
    from agl_trainer.server import ServerConfig, ServerThread, TrainerServer
    from agl_trainer.training import TrainConfig, Trainer

    torch.set_num_threads(options.threads)
    # the worker's heartbeat can name a lease that finished a moment before as lost: harmless in one process
    logging.getLogger("agl.worker").setLevel(logging.ERROR)
    started = time.monotonic()
    folder = os.path.abspath(options.folder)
    if options.fresh and os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder, exist_ok=True)

    lockers = Lockers(n=options.lockers, seed=options.seed)
    engine, backend = _policy(options, lockers)
    initial = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    # only the solver is trained; tool outcomes in the trace become intermediate rewards (AIR)
    air = AirRules(tool_ok=TOOL_OK_REWARD, tool_error=TOOL_ERROR_REWARD)
    config = ServerConfig(db_path=os.path.join(folder, "agl.db"), port=0, max_attempts=2, lease_timeout_s=120.0,
                          builder=TransitionBuilder(agent_match="solver", air=air),
                          gateway=GatewayConfig(sampling_overrides=training_sampling(1.0)))
    server = TrainerServer(config, engine)
    thread = ServerThread(server).start()
    worker: Worker | None = None
    worker_thread: threading.Thread | None = None
    try:
        point_openai_at(thread.url, None)
        worker = Worker(thread.url, solve, concurrency=options.workers, poll_s=0.2, grace_s=5.0)
        worker_thread = threading.Thread(target=worker.run, name="agl-demo-worker", daemon=True)
        worker_thread.start()
        trainer = Trainer(server, backend, engine, lockers.tasks(), TrainConfig(
            tasks_per_step=options.lockers, group_size=options.group_size,
            row_mode=options.row_mode,  # type: ignore[arg-type]
            checkpoint_dir=os.path.join(folder, "checkpoint"), checkpoint_every=options.checkpoint_every))
        resumed = trainer.resume()
        _train(trainer, options, started, folder)
    finally:
        if worker is not None:
            worker.stop(now=True)
        if worker_thread is not None:
            worker_thread.join(timeout=10)
        rollouts = len(server.store.rollouts())
        thread.stop()
    changed = any(not torch.equal(initial[k], v) for k, v in engine.model.state_dict().items())
    steps = [r.to_dict() for r in trainer.history]
    reached = _reached(trainer.history, options)
    wall = time.monotonic() - started
    curve, summary = _report(options, folder, steps, reached, wall, resumed, rollouts, lockers)
    return DemoResult(steps=steps, reached=reached, wall_s=wall, resumed=resumed, folder=folder, curve=curve,
                      weights_changed=changed, summary=summary, store_rollouts=rollouts)


def _policy(options: DemoOptions, lockers: Any) -> tuple[Any, Any]:
    """The engine serving a fresh tiny policy, and the torch backend training a copy of it."""
    from agl_trainer.demo.policy import PolicySpec, build_model, build_tokenizer, tool_call_text
    from agl_trainer.engine import TorchEngine
    from agl_trainer.torch_backend import TorchBackend, TorchConfig

    spec = PolicySpec(lockers.words(), [tool_call_text("unlock", {"code": c}) for c in lockers.codes],
                      lockers.things)
    tokenizer = build_tokenizer(spec)
    served = build_model(tokenizer, spec, seed=options.seed)
    engine = TorchEngine(served, tokenizer, name="tiny-locker-policy", seed=options.seed,
                         max_batch=options.workers, batch_wait_s=0.003, default_max_tokens=4)
    config = TorchConfig(lr=options.lr or 5e-4, kl_coef=options.kl_coef or 0.0, minibatches=options.minibatches,
                         epochs=options.epochs)
    backend = TorchBackend(copy.deepcopy(served), config,
                           pad_id=tokenizer.pad_token_id)
    return engine, backend


def _train(trainer: Any, options: DemoOptions, started: float, folder: str) -> None:
    """Run the steps left, with the progress line; stop at the target, the step or the time limit."""
    bar = _Progress(options)
    if trainer.history and options.progress:
        print(f"agl demo: resuming at step {trainer.backend.step} (last reward {trainer.history[-1].reward:.2f})",
              file=sys.stderr, flush=True)
    if _reached(trainer.history, options):
        if options.progress:
            print(f"agl demo: the run in {folder} has reached the target already; --fresh starts over",
                  file=sys.stderr, flush=True)
        return
    deadline = started + options.minutes * 60

    def stop(h: list[Any]) -> bool:
        if h and h[-1].rollouts and h[-1].failed_rollouts == h[-1].rollouts:
            raise RuntimeError(f"every rollout of step {h[-1].step} failed; the first: {trainer.last_errors[0]}")
        return _reached(h, options) or time.monotonic() > deadline

    try:
        trainer.run(options.steps, on_step=bar.update, stop=stop)
    except KeyboardInterrupt:
        trainer.save()  # the steps done so far: the same command resumes from here
        print(f"\nagl demo: interrupted at step {trainer.backend.step}; run it again to resume",
              file=sys.stderr, flush=True)
        raise
    finally:
        bar.close()


def _report(options: DemoOptions, folder: str, steps: list[dict[str, Any]], reached: bool, wall: float,
            resumed: bool, rollouts: int, lockers: Any) -> tuple[str, str]:
    """Write the reward and loss curves and the summary; return the reward curve's path and the summary."""
    from agl_trainer.training import StepResult, write_curves

    curve, _ = write_curves(folder, [StepResult.from_dict(s) for s in steps],
                            title=f"agl demo: LangChain locker agent, {options.lockers} lockers, tiny model on CPU",
                            target=options.target)
    summary = _summary(options, steps, reached, wall, resumed, rollouts, lockers)
    with open(os.path.join(folder, "summary.md"), "w", encoding="utf-8") as f:
        f.write(summary)
    return curve, summary


def _reached(history: Sequence[Any], options: DemoOptions) -> bool:
    if len(history) < options.window:
        return False
    window = history[-options.window:]
    return bool(sum(r.reward for r in window) / len(window) >= options.target)


def _warned(steps: list[dict[str, Any]]) -> list[str]:
    """The summary's lines for the steps' training-signal warnings (none when there were none)."""
    warned = [f"  - step {s['step']}: {w}" for s in steps for w in s.get("warnings", [])]
    return ["- training-signal warnings:", *warned] if warned else []


def _step_table(steps: list[dict[str, Any]]) -> list[str]:
    """The summary's table of the steps: reward, final reward, rollouts and their rate."""
    lines = ["", "| step | reward | final reward | rollouts | rollouts/s |", "|---:|---:|---:|---:|---:|"]
    for s in steps:
        lines.append(f"| {s['step']} | {s['reward']:.2f} | {s['final_reward']:.2f} | {s['rollouts']} | "
                     f"{s['rollouts_per_s']:.1f} |")
    return lines


def _summary(options: DemoOptions, steps: list[dict[str, Any]], reached: bool, wall: float, resumed: bool,
             rollouts: int, lockers: Any) -> str:
    first = steps[0] if steps else None
    last = steps[-1] if steps else None
    lines = ["# agl demo", ""]
    lines.append("A LangGraph agent (`solver`, a `create_agent` with an `unlock` tool, then `reporter`) trained with "
                 "LightningRL through agl's gateway; only `solver` is trained (`agent_match`).")
    lines.append("")
    if first and last:
        lines += [
            f"- steps: {len(steps)} ({'resumed' if resumed else 'from scratch'}), "
            f"{sum(s['rollouts'] for s in steps)} rollouts, {rollouts} in the store",
            f"- mean reward (return per rollout): {first['reward']:.2f} at step {first['step']} -> "
            f"{last['reward']:.2f} at step {last['step']}",
            f"- final reward (the answer's part): {first['final_reward']:.2f} -> {last['final_reward']:.2f}",
            f"- target {options.target:g} over the last {options.window} steps: "
            f"{'reached' if reached else 'NOT reached'}",
            f"- wall time of this run: {wall:.0f} s; rollouts/s (last step): {last['rollouts_per_s']:.1f}",
            f"- rows: mode {options.row_mode}, merged transitions (last step) {last['merged']}, "
            f"prefix mismatches {last['prefix_mismatches']}",
            _signal_line(last),
        ]
        lines += _warned(steps)
    lines += _step_table(steps)
    lines += ["", f"Task: {lockers.n} lockers, one code and one thing each; the model picks a code (one tool-call "
              "token) and then an answer (one word). Chance is about 0.1."]
    return "\n".join(lines) + "\n"


def _signal_line(step: dict[str, Any]) -> str:
    """The last step's signal health, as agl_trainer.signal_health measured it."""
    m = step.get("metrics", {})
    if "ratio_first_mean" not in m:
        return "- training signal (last step): no update ran"
    return (f"- training signal (last step): first-pass ratio {m['ratio_first_mean']:.4f} (should be 1), "
            f"KL to the sampler {m.get('sampler_kl', 0.0):.2g}, max |A| {m.get('advantage_max_abs', 0.0):.2f}, "
            f"groups without spread {m.get('flat_groups', 0):.0f} of {m.get('groups', 0):.0f}")


class _Progress:
    """One line, redrawn: step, reward, rollouts/s, elapsed."""

    def __init__(self, options: DemoOptions) -> None:
        self.options = options
        self.started = time.monotonic()
        self.enabled = options.progress
        self.width = 24

    def update(self, r: Any) -> None:
        if not self.enabled:
            return
        filled = int(round(max(0.0, min(1.0, r.reward / max(self.options.target, 1e-9))) * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self.started
        line = (f"step {r.step:>3}/{self.options.steps} [{bar}] reward {r.reward:5.2f} "
                f"{r.rollouts_per_s:5.1f} rollouts/s  {elapsed:5.0f} s")
        end = "\n" if os.environ.get("CI") or not sys.stderr.isatty() else "\r"
        print(line, end=end, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and sys.stderr.isatty() and not os.environ.get("CI"):
            print(file=sys.stderr)


def parser() -> argparse.ArgumentParser:
    d = DemoOptions()
    p = argparse.ArgumentParser(prog="agl demo", description="Train a LangChain agent on this CPU: a tiny model "
                                "that writes its tool calls, SFT on a teacher's traces, then LightningRL with the "
                                "torch backend, through agl's server and gateway.")
    p.add_argument("--dir", default=d.folder, help="where the store, checkpoint, curve and summary go")
    p.add_argument("--steps", type=int, default=d.steps, help="most training steps")
    p.add_argument("--minutes", type=float, default=d.minutes, help="stop after this long")
    p.add_argument("--target", type=float, default=d.target, help="stop once the mean reward reaches this")
    p.add_argument("--window", type=int, default=d.window, help="steps the target is averaged over")
    p.add_argument("--lockers", type=int, default=d.lockers, help="how many lockers (tasks); harder when more")
    p.add_argument("--group-size", type=int, default=d.group_size, help="rollouts per task per step (GRPO group)")
    p.add_argument("--workers", type=int, default=d.workers,
                   help="rollouts at a time (default: 1, the same run every time; 16 with --one-token)")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate (default: 1e-4; 5e-4 with --one-token)")
    p.add_argument("--kl-coef", type=float, default=d.kl_coef,
                   help="KL penalty to the model RL starts from (default: 0.1, to the SFT model; 0 with --one-token)")
    p.add_argument("--minibatches", type=int, default=d.minibatches, help="optimizer steps per pass over a batch")
    p.add_argument("--epochs", type=int, default=d.epochs, help="passes over each batch (PPO epochs)")
    p.add_argument("--rows", choices=("trajectory", "transition"), default=d.row_mode, help="row mode")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    p.add_argument("--fresh", action="store_true", help="delete --dir's previous run and start over")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--teacher-right", type=float, default=d.teacher_right,
                   help="how often the scripted teacher tries the right code first on the lockers it mixes up")
    p.add_argument("--one-token", action="store_true",
                   help="the earlier demo: a word-level model whose every action is one token, RL alone")
    p.add_argument("--multi-policy", action="store_true",
                   help="a writer and a checker, each its own LoRA adapter, trained at once (agl_trainer.demo.roles)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.multi_policy:
        return _multi_policy(args)
    options = DemoOptions(folder=args.dir, steps=args.steps, minutes=args.minutes, target=args.target,
                          window=args.window, lockers=args.lockers, group_size=args.group_size, workers=args.workers,
                          lr=args.lr, kl_coef=args.kl_coef, minibatches=args.minibatches, epochs=args.epochs,
                          row_mode=args.rows, seed=args.seed, threads=args.threads, fresh=args.fresh,
                          progress=not args.quiet,
                          one_token=args.one_token, teacher_right=args.teacher_right)
    try:
        result = run_demo(options)
    except KeyboardInterrupt:
        return 130
    except ImportError as exc:
        print(f"agl demo: needs the trainer's torch and LangChain extras ({exc}); "
              "pip install 'agl-trainer[torch,demo]'", file=sys.stderr)
        return 2
    print(result.summary.split("\n| step")[0].rstrip())
    print(f"\nstore: {os.path.join(result.folder, 'agl.db')}\ncurve: {result.curve}\n"
          f"summary: {os.path.join(result.folder, 'summary.md')}")
    return 0 if result.reached else 1


def _multi_policy(args: argparse.Namespace) -> int:
    from agl_trainer.demo.roles import RolesOptions, run_roles_demo

    d = RolesOptions()
    options = RolesOptions(folder=args.dir if args.dir != DemoOptions().folder else d.folder,
                           steps=args.steps if args.steps != DemoOptions().steps else d.steps,
                           minutes=args.minutes if args.minutes != DemoOptions().minutes else d.minutes,
                           target=args.target, seed=args.seed, threads=args.threads, fresh=args.fresh,
                           progress=not args.quiet)
    try:
        result = run_roles_demo(options)
    except KeyboardInterrupt:
        return 130
    except ImportError as exc:
        print(f"agl demo: needs the trainer's torch, peft and LangChain extras ({exc}); "
              "pip install 'agl-trainer[torch,demo]' peft", file=sys.stderr)
        return 2
    print(result["summary"].rstrip())
    print(f"\nstore: {os.path.join(result['folder'], 'agl.db')}\ncurve: {result['curve']}\n"
          f"summary: {os.path.join(result['folder'], 'summary.md')}")
    return 0 if result["reached"] else 1


if __name__ == "__main__":
    sys.exit(main())
