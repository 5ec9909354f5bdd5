"""The full loop with a LangChain agent: the real worker, server and gateway, a vLLM-like backend or the torch engine.

The agent is a plain LangChain ``create_agent`` over ``ChatOpenAI`` with one
tool, with nothing of agl in it: it builds its model from the environment that
the worker points at the gateway. Each run makes two model calls (one that asks
for the tool, one that answers after it). With agl's LangChain and openai
plugins both on, each call must be one transition, with the token ids the
backend (or the engine) produced, joined by the gateway (``token_source="gateway"``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langchain_openai")
torch = pytest.importorskip("torch")

from langchain.agents import create_agent  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

import agl_core as agl  # noqa: E402
from agl_core.testing import FakeOpenAI, render_prompt, tokenize  # noqa: E402
from agl_core.worker import TaskClient, Worker  # noqa: E402
from agl_trainer.engine import TorchEngine  # noqa: E402

from .conftest import ServerFactory  # noqa: E402
from .test_engine import tiny_tokenizer  # noqa: E402

torch.set_num_threads(1)

RIVERS = {"Paris": "Seine", "Vienna": "Danube", "Cairo": "Nile", "London": "Thames"}
TASKS = [{"id": f"city-{i}", "city": city} for i, city in enumerate(RIVERS)]


@tool
def river_of(city: str) -> str:
    """The river that runs through a city."""
    return RIVERS.get(city, "unknown")


def langchain_agent(task: dict[str, Any]) -> float:
    """A LangChain agent as a user writes it: ChatOpenAI from the environment, one tool."""
    model = ChatOpenAI(model="gpt-4o-mini", max_retries=0, temperature=0)
    agent = create_agent(model, tools=[river_of], system_prompt="Answer with the tool's help.")
    result = agent.invoke({"messages": [{"role": "user", "content": f"Which river runs through {task['city']}?"}]})
    return 1.0 if RIVERS[task["city"]] in str(result["messages"][-1].content) else 0.0


@pytest.fixture(autouse=True)
def langchain_instrumented(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """agl's LangChain plugin on (the openai one is on for the suite); the worker's OPENAI_* kept to the test."""
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unset")
    active = agl.instrument(["langchain"])
    assert "langchain" in active
    yield
    agl.uninstrument(["langchain"])


def _run(url: str, **kwargs: Any) -> Worker:
    worker = Worker(url, langchain_agent, concurrency=2, idle_exit_s=0.5, poll_s=0.2, instrument=False, **kwargs)
    worker.run()
    return worker


def _city(text: Any) -> str:
    return next(city for city in RIVERS if city in str(text))


def _backend_script(body: dict[str, Any]) -> Any:
    """The model's side: ask for the tool, then answer from its result."""
    messages = body["messages"]
    if messages[-1]["role"] == "tool":
        return f"It is the {messages[-1]['content']}."
    return {"tool_calls": [{"name": "river_of", "arguments": {"city": _city(messages)}}]}


def test_langchain_agent_through_worker_server_and_gateway(make_server: ServerFactory) -> None:
    with FakeOpenAI(script=_backend_script) as fake:
        srv = make_server(fake, token="tok")
        TaskClient(srv.url, "tok").enqueue(TASKS)
        worker = _run(srv.url, token="tok")
        sent = [q for q in fake.requests if q.method == "POST"]
    assert worker.stats.posted == 4 and worker.stats.agent_errors == 0
    assert worker.stats.transitions == 8 and worker.stats.token_sources == {"gateway": 8}
    assert len(sent) == 8  # one transition per model call: LangChain's span and openai's merged
    assert srv.server.records.unkeyed == 0 and len(srv.server.records) == 0  # every call keyed, and joined
    prompts = {tuple(tokenize(render_prompt(q.body["messages"]))): q.body for q in sent}
    store = srv.server.store
    for task in TASKS:
        (traj,) = store.trajectories(task_id=task["id"])
        assert traj.reward == 1.0
        ask, answer = traj.transitions
        for t in (ask, answer):
            assert t.token_source == "gateway" and t.model == "fake-model"
            assert tuple(t.prompt_token_ids or ()) in prompts  # the ids of what the gateway sent on
            assert t.response_logprobs and len(t.response_logprobs) == len(t.response_token_ids or [])
        assert ask.response["tool_calls"][0]["function"]["name"] == "river_of"
        args = prompts[tuple(ask.prompt_token_ids or ())]["messages"]
        assert _city(args) == task["city"]
        assert ask.response_token_ids == tokenize(f'<tool_call> river_of {{"city": "{task["city"]}"}}')
        assert answer.response_token_ids == tokenize(f"It is the {RIVERS[task['city']]}.")
        assert answer.prompt[-1]["role"] == "tool"


class ToolUsingLM(torch.nn.Module):  # type: ignore[misc]
    """A causal LM for the tiny byte-level tokenizer that asks for the tool, then answers from its result.

    It reads its prompt (the chat template's text) and writes a fixed reply token by token, so the
    test knows every id it produces; it keeps the prompts it was given, as the engine fed them.
    """

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.config = type("Config", (), {"max_position_embeddings": 8192})()
        self.tokenizer = tokenizer
        self.prompts: list[list[int]] = []
        self.replies: list[list[int]] = []

    def reply_for(self, prompt: str) -> str:
        if "<|im_start|>tool" in prompt:
            result = prompt.rsplit("<|im_start|>tool", 1)[1].split("<|im_end|>", 1)[0].strip()
            return f"It is the {result}."
        city = _city(prompt.rsplit("<|im_start|>user", 1)[1])
        return f'<tool_call>{{"name": "river_of", "arguments": {{"city": "{city}"}}}}</tool_call>'

    def forward(self, input_ids: Any, attention_mask: Any = None, position_ids: Any = None, use_cache: bool = True,
                past_key_values: Any = None) -> Any:
        if past_key_values is None:  # the prompt: choose each row's reply
            scripts = []
            for row, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
                prompt = [t for t, m in zip(row, mask, strict=True) if m]
                self.prompts.append(prompt)
                reply = self.tokenizer.encode(self.reply_for(self.tokenizer.decode(prompt)))
                self.replies.append([*reply, self.tokenizer.eos_token_id])
                scripts.append(self.replies[-1])
            step = 0
        else:
            step, scripts = past_key_values[0] + 1, past_key_values[1]
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], len(self.tokenizer)), -30.0)
        for i, script in enumerate(scripts):
            logits[i, -1, script[min(step, len(script) - 1)]] = 0.0
        return type("Out", (), {"logits": logits, "past_key_values": (step, scripts)})()


def test_langchain_agent_through_the_torch_engine(make_server: ServerFactory) -> None:
    tokenizer = tiny_tokenizer()
    model = ToolUsingLM(tokenizer)
    engine = TorchEngine(model, tokenizer, name="tiny-tools", default_max_tokens=120, max_batch=4)
    srv = make_server(engine)
    TaskClient(srv.url).enqueue(TASKS)
    worker = _run(srv.url)
    assert worker.stats.posted == 4 and worker.stats.agent_errors == 0
    assert worker.stats.token_sources == {"gateway": 8}
    generated = {tuple(p): r for p, r in zip(model.prompts, model.replies, strict=True)}
    assert len(model.prompts) == len(generated) == 8
    for task in TASKS:
        (traj,) = srv.server.store.trajectories(task_id=task["id"])
        assert traj.reward == 1.0 and len(traj.transitions) == 2
        for t in traj.transitions:
            assert t.token_source == "gateway" and t.model == "tiny-tools"
            # the ids the engine took in and gave out, exactly, the end token included
            assert t.response_token_ids == generated[tuple(t.prompt_token_ids or ())]
            assert t.response_logprobs == pytest.approx([0.0] * len(t.response_token_ids or []), abs=1e-4)
        ask, answer = traj.transitions
        assert ask.response["tool_calls"][0]["function"]["arguments"] == f'{{"city": "{task["city"]}"}}'
        assert answer.response["content"] == f"It is the {RIVERS[task['city']]}."
