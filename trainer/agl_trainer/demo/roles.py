"""``agl demo --multi-policy``: a writer and a checker, each its own LoRA adapter on one tiny model, trained at once.

The agent is a LangGraph graph of two nodes, ``writer`` then ``checker``, each one
``ChatOpenAI`` call with the same prompt (``say one``), each rewarded for the opposite
answer: the writer for ``A``, the checker for ``B`` (a named reward of 1 on its own call).
One shared policy answers both from one distribution and cannot be right more than half of
the time over the two; with a policy
per role (``policies: {writer: {agents: ^writer$}, checker: {agents: ^checker$}}``) the
gateway answers each node from its own adapter and each adapter learns its answer.
Credit is ``discounted`` with ``gamma`` 0, so each call is credited its own reward and
the reward curve shows each policy's progress (``policy writer``, ``policy checker``); the
demo stops once both are at ``target`` over the last ``window`` steps.

Everything is real and in one process, as in ``agl demo``: server, gateway, the torch
engine serving the peft model with both adapters, a worker running the graph, and the
loop stepping each adapter with its own optimizer.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, TypedDict

import agl_core as agl

__all__ = ["ANSWERS", "PROMPT", "RolesOptions", "run_roles_demo", "solve"]

ANSWERS = {"writer": "A", "checker": "B"}
"""Each role's rewarded answer to the same prompt."""
PROMPT = [{"role": "user", "content": "say one"}]


class _State(TypedDict, total=False):
    said: dict[str, str]


def _node(role: str) -> Any:
    def node(state: _State) -> _State:
        from langchain_openai import ChatOpenAI

        reply = ChatOpenAI(model="policy", max_retries=0, max_tokens=1).invoke(PROMPT)
        said = str(reply.content).strip()
        agl.emit_reward(1.0 if said == ANSWERS[role] else 0.0, name=role)  # on this role's own call
        return {"said": {**state.get("said", {}), role: said}}
    return node


def solve(task: Any) -> None:
    """The writer, then the checker; each call's reward is emitted on it (no final reward)."""
    from langgraph.graph import END, START, StateGraph

    graph = StateGraph(_State)
    graph.add_node("writer", _node("writer"))
    graph.add_node("checker", _node("checker"))
    graph.add_edge(START, "writer")
    graph.add_edge("writer", "checker")
    graph.add_edge("checker", END)
    graph.compile().invoke({"said": {}})


@dataclass
class RolesOptions:
    folder: str = "agl-demo-multi"
    steps: int = 40
    minutes: float = 5.0
    target: float = 0.9
    window: int = 2
    group_size: int = 16
    lr: float = 2e-2
    seed: int = 0
    threads: int = 1
    fresh: bool = False
    progress: bool = True


def run_roles_demo(options: RolesOptions) -> dict[str, Any]:
    """Train both policies until the mean return reaches ``target``; write the curves and a summary."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from agl_core.transitions import TransitionBuilder
    from agl_core.worker import Worker, point_openai_at
    from agl_trainer.demo.policy import PolicySpec, build_model, build_tokenizer
    from agl_trainer.gateway import GatewayConfig, training_sampling
    from agl_trainer.policies import MultiPolicyBackend, Policy
    from agl_trainer.server import ServerConfig, ServerThread, TrainerServer
    from agl_trainer.torch_backend import LoraOptions, TorchConfig
    from agl_trainer.training import TrainConfig, Trainer, write_curves

    torch.set_num_threads(options.threads)
    logging.getLogger("agl.worker").setLevel(logging.ERROR)
    started = time.monotonic()
    folder = os.path.abspath(options.folder)
    if options.fresh and os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder, exist_ok=True)
    spec = PolicySpec(["user", "assistant", "say", "one"], [], sorted(set(ANSWERS.values())))
    tokenizer = build_tokenizer(spec)
    lora = LoraOptions(r=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"])
    backend = MultiPolicyBackend(build_model(tokenizer, spec, seed=options.seed, hidden=32, layers=1),
                                 [Policy(role, f"^{role}$", lora) for role in ANSWERS],
                                 TorchConfig(lr=options.lr, epochs=3, minibatches=2, gradient_checkpointing=False),
                                 pad_id=tokenizer.pad_token_id)
    engine = backend.engine(tokenizer, name="base", seed=options.seed, max_batch=32, batch_wait_s=0.003,
                            default_max_tokens=1)
    builder = TransitionBuilder(agent_match=backend.router.agent_match(), credit="discounted", gamma=0.0)
    server = TrainerServer(ServerConfig(db_path=os.path.join(folder, "agl.db"), port=0, builder=builder,
                                        gateway=GatewayConfig(sampling_overrides=training_sampling(1.0),
                                                              policies=backend.router)), engine)
    thread = ServerThread(server).start()
    point_openai_at(thread.url, None)
    worker = Worker(thread.url, solve, concurrency=16, poll_s=0.05, grace_s=2.0)
    running = threading.Thread(target=worker.run, name="agl-demo-worker", daemon=True)
    running.start()
    trainer = Trainer(server, backend, engine, [{"id": 0}], TrainConfig(
        tasks_per_step=1, group_size=options.group_size, checkpoint_dir=os.path.join(folder, "checkpoint"),
        checkpoint_every=5))
    deadline = started + options.minutes * 60

    def reached(h: list[Any]) -> bool:
        window = h[-options.window:]
        return len(window) == options.window and all(
            sum(r.metrics.get(f"policy/{role}/reward", 0.0) for r in window) / len(window) >= options.target
            for role in ANSWERS)

    def show(r: Any) -> None:
        if options.progress:
            m = r.metrics
            print(f"step {r.step:>3}  writer {m.get('policy/writer/reward', 0.0):4.2f}  "
                  f"checker {m.get('policy/checker/reward', 0.0):4.2f}  (each: the share of its calls answered "
                  "right)", file=sys.stderr, flush=True)

    try:
        resumed = trainer.resume()
        if not reached(trainer.history):
            trainer.run(options.steps, on_step=show, stop=lambda h: reached(h) or time.monotonic() > deadline)
        trainer.save()
    finally:
        worker.stop(now=True)
        running.join(timeout=10)
        thread.stop()
    curve, _ = write_curves(folder, trainer.history, target=options.target,
                            title="agl demo --multi-policy: writer (A) and checker (B), one adapter each")
    steps = [r.to_dict() for r in trainer.history]
    lines = ["# agl demo --multi-policy", "",
             "A LangGraph writer and checker asked the same thing; the writer is rewarded for A, the checker for B. "
             "Each is its own LoRA adapter on one tiny base model (one shared policy cannot be right more than half "
             "of the time over the two). Each column: the share of that policy's calls answered right.", "",
             f"Target {options.target:g} for both over the last {options.window} steps: "
             f"{'reached' if reached(trainer.history) else 'NOT reached'}.", "",
             "| step | writer | checker |", "|---:|---:|---:|"]
    for s in steps:
        m = s["metrics"]
        lines.append(f"| {s['step']} | {m.get('policy/writer/reward', 0.0):.2f} | "
                     f"{m.get('policy/checker/reward', 0.0):.2f} |")
    summary = "\n".join(lines) + "\n"
    with open(os.path.join(folder, "summary.md"), "w", encoding="utf-8") as f:
        f.write(summary)
    return {"steps": steps, "reached": reached(trainer.history), "curve": curve, "summary": summary,
            "resumed": resumed, "wall_s": time.monotonic() - started, "folder": folder}
