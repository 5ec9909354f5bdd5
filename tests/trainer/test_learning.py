"""The whole loop learns a small two-call task in every configuration that changes the signal: fp32 and bf16
weights, ``final`` and ``discounted`` credit.

The agent is a plain OpenAI-client agent run by the real worker against the real server and gateway, in
front of the torch engine serving a tiny word-level Llama built in code (``agl_trainer.demo.policy``). Each
run makes two calls: the first must say the key (a named reward of 0.5, on that call), the second the prize
(0.5, the final reward). With ``discounted`` credit (gamma 0.9) the first call's credited reward is its own
plus 0.9 times the second's, so the two calls are scored apart; with ``final`` both get the run's return.
"""

from __future__ import annotations

import copy
import logging
import threading
from pathlib import Path
from typing import Any

import openai
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import agl_core as agl  # noqa: E402
from agl_core.transitions import TransitionBuilder  # noqa: E402
from agl_core.worker import Worker, point_openai_at  # noqa: E402
from agl_trainer.demo.policy import PolicySpec, build_model, build_tokenizer  # noqa: E402
from agl_trainer.engine import TorchEngine  # noqa: E402
from agl_trainer.gateway import GatewayConfig, training_sampling  # noqa: E402
from agl_trainer.server import ServerConfig, ServerThread, TrainerServer  # noqa: E402
from agl_trainer.torch_backend import TorchBackend, TorchConfig  # noqa: E402
from agl_trainer.training import TrainConfig, Trainer  # noqa: E402

torch.set_num_threads(1)

KEY, PRIZE = "k1", "p2"
ACTIONS = ["k1", "k2", "p1", "p2"]
TARGET = 0.8
"""Mean return over the last two steps; a run that guesses scores 0.25 (discounted: 0.24)."""
MAX_STEPS = 20


def two_calls(task: dict[str, Any]) -> float:
    """Say the key, then the prize: 0.5 each (the key's as a named reward on the first call)."""
    client = openai.OpenAI(max_retries=0)
    messages: list[Any] = [{"role": "user", "content": f"door {task['door']}"}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    key = (first.choices[0].message.content or "").strip()
    agl.emit_reward(0.5 if key == KEY else 0.0, name="key")
    messages += [{"role": "assistant", "content": key}, {"role": "user", "content": "prize?"}]
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    return 0.5 if (second.choices[0].message.content or "").strip() == PRIZE else 0.0


def train(folder: Path, dtype: Any, credit: str) -> tuple[list[Any], TorchBackend]:
    spec = PolicySpec(["user", "assistant", "door", "red", "prize?"], [], ACTIONS)
    tokenizer = build_tokenizer(spec)
    served = build_model(tokenizer, spec, seed=0, hidden=32, layers=1).to(dtype)
    engine = TorchEngine(served, tokenizer, name="tiny", seed=0, max_batch=16, batch_wait_s=0.003,
                         default_max_tokens=1)
    backend = TorchBackend(copy.deepcopy(served), TorchConfig(lr=5e-3, epochs=2, minibatches=2),
                           pad_id=tokenizer.pad_token_id)
    server = TrainerServer(ServerConfig(db_path=str(folder / f"{credit}-{dtype}.db"), port=0,
                                        builder=TransitionBuilder(credit=credit, gamma=0.9),  # type: ignore[arg-type]
                                        gateway=GatewayConfig(sampling_overrides=training_sampling(1.0))), engine)
    thread = ServerThread(server).start()
    point_openai_at(thread.url, None)
    worker = Worker(thread.url, two_calls, concurrency=16, poll_s=0.05, grace_s=2.0)
    running = threading.Thread(target=worker.run, daemon=True)
    running.start()
    trainer = Trainer(server, backend, engine, [{"door": "red"}], TrainConfig(tasks_per_step=1, group_size=16))
    try:
        history = trainer.run(MAX_STEPS, stop=lambda h: len(h) >= 2 and (h[-1].reward + h[-2].reward) / 2 >= TARGET)
    finally:
        worker.stop(now=True)
        running.join(timeout=10)
        thread.stop()
    return history, backend


@pytest.mark.parametrize("credit", ["final", "discounted"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_loop_learns_in_fp32_and_bf16_with_final_and_discounted_credit(tmp_path: Path, dtype: str, credit: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # the worker points it at the gateway
    monkeypatch.setenv("OPENAI_API_KEY", "unset")
    logging.getLogger("agl.worker").setLevel(logging.ERROR)
    history, backend = train(tmp_path, getattr(torch, dtype), credit)
    rewards = [round(h.reward, 2) for h in history]
    assert (history[-1].reward + history[-2].reward) / 2 >= TARGET, rewards
    assert history[0].reward < 0.6, rewards  # it learned it: the first step guessed
    assert backend.master.active == (dtype == "bfloat16")  # bf16 trains float32 master weights
    for step in history:  # the sampler's logprobs are the trainer's before each update, in either precision
        assert step.metrics["ratio_first_mean"] == pytest.approx(1.0, abs=2e-2), step.metrics
        assert step.metrics["advantage_max_abs"] <= 15 ** 0.5 + 1e-6
    if credit == "discounted":  # the two calls are credited apart: 0.5 + 0.9 * 0.5 for a run that got both
        assert max(h.reward for h in history) <= 0.95 + 1e-6
