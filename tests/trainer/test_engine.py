"""The built-in torch engine with a tiny Llama and a byte-level tokenizer built in code (no downloads)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import agl_core as agl  # noqa: E402
from agl_core.worker import TaskClient, Worker  # noqa: E402
from agl_trainer.engine import TorchEngine  # noqa: E402
from agl_trainer.gateway import GatewayConfig  # noqa: E402

from .conftest import ServerFactory  # noqa: E402

torch.set_num_threads(1)

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function'] | tojson }}"
            "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer() -> Any:
    """Byte-level BPE with no merges: every byte is a token, so any text round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="<pad>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = TEMPLATE
    return fast


def tiny_model(vocab_size: int, seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


@pytest.fixture
def engine(tokenizer: Any) -> TorchEngine:
    return TorchEngine(tiny_model(len(tokenizer)), tokenizer, name="tiny", seed=0, default_max_tokens=12)


def expected_logprobs(model: Any, prompt: list[int], response: list[int]) -> list[float]:
    """One forward pass over prompt + response: the logprob of each response token."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)]


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]


def test_gateway_records_the_engine_ids_and_they_match_the_model(engine: TorchEngine, tokenizer: Any,
                                                                 make_server: ServerFactory) -> None:
    srv = make_server(engine)
    store = agl.HttpStore(srv.url)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    with agl.rollout(task_id="t", store=store) as run:
        plain = client.chat.completions.create(model="anything", messages=MESSAGES, temperature=0,  # type: ignore
                                               max_tokens=8)
        stream = client.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=8,  # type: ignore
                                                stream=True, seed=3)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        agl.emit_reward(0.5)
    assert run.store_error is None
    assert plain.model == "tiny"
    first, second = store.transitions(rollout_id=run.id)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if not isinstance(prompt, list) else prompt)
    for t in (first, second):
        assert t.token_source == "gateway" and t.prompt_token_ids == prompt
        assert t.model == "tiny"
        assert t.response_logprobs == pytest.approx(expected_logprobs(engine.model, prompt, t.response_token_ids),
                                                    abs=1e-4)
    assert first.response_token_ids == greedy(engine.model, prompt, len(first.response_token_ids))
    assert len(first.response_token_ids) == 8 and first.finish_reason == "length"
    assert tokenizer.decode(first.response_token_ids, skip_special_tokens=True) == plain.choices[0].message.content
    assert tokenizer.decode(second.response_token_ids, skip_special_tokens=True) == streamed


def test_concurrent_requests_are_batched_with_their_own_sampling(engine: TorchEngine, tokenizer: Any,
                                                                 make_server: ServerFactory) -> None:
    engine.batch_wait_s = 0.2
    srv = make_server(engine)
    prompts = [[{"role": "user", "content": "x" * (i + 1)}] for i in range(4)]
    results: dict[int, Any] = {}

    def call(i: int) -> None:
        body = {"messages": prompts[i], "max_tokens": 3 + i, "temperature": 0 if i % 2 else 1.0, "seed": i,
                "return_token_ids": True, "logprobs": True}
        results[i] = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(engine.batches) > 1
    for i, data in results.items():
        ids = data["choices"][0]["token_ids"]
        assert len(ids) == 3 + i  # each row stops at its own max_tokens
        want = expected_logprobs(engine.model, data["prompt_token_ids"], ids)
        got = [e["logprob"] for e in data["choices"][0]["logprobs"]["content"]]
        assert got == pytest.approx(want, abs=1e-4)  # left padding changes nothing
        if i % 2:
            assert ids == greedy(engine.model, data["prompt_token_ids"], len(ids))


def test_stop_on_the_end_token_and_on_stop_strings(tokenizer: Any, make_server: ServerFactory) -> None:
    model = tiny_model(len(tokenizer))
    head = torch.nn.Linear(32, len(tokenizer), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = 50.0
    model.lm_head = head
    srv = make_server(TorchEngine(model, tokenizer, name="stopper"))
    data = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MESSAGES, "return_token_ids": True},
                      timeout=60).json()
    choice = data["choices"][0]
    assert choice["token_ids"] == [tokenizer.eos_token_id]  # the end token is in the ids, not in the text
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""


def test_text_completions_and_token_id_prompts(engine: TorchEngine, tokenizer: Any,
                                               make_server: ServerFactory) -> None:
    srv = make_server(engine)
    tp = {"traceparent": f"00-{'c' * 32}-{'d' * 16}-01"}
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0},
                   headers=tp, timeout=60)
    assert r.status_code == 200, r.text
    record = srv.server.records.get(("c" * 32, "d" * 16))
    assert record is not None and record.prompt_token_ids == tokenizer.encode("hello")
    assert record.response_token_ids == greedy(engine.model, record.prompt_token_ids, 4)
    streamed_tp = {"traceparent": f"00-{'c' * 32}-{'e' * 16}-01"}
    with httpx.stream("POST", srv.url + "/v1/completions", headers=streamed_tp, timeout=60,
                      json={"prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True,
                            "return_token_ids": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [i for c in chunks for i in c["choices"][0].get("token_ids", [])] == record.response_token_ids
    assert chunks[0]["choices"][0]["prompt_token_ids"] == record.prompt_token_ids
    streamed = srv.server.records.get(("c" * 32, "e" * 16))
    assert streamed is not None and streamed.response_token_ids == record.response_token_ids
    assert streamed.response_logprobs == pytest.approx(record.response_logprobs, abs=1e-5)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [10_000]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x" * 300}, timeout=60)
    assert r.status_code == 400 and "at most 256" in r.json()["error"]["message"]


def test_tool_calls_are_parsed_and_streamed_with_ids() -> None:
    from agl_trainer.engine import _tool_calls

    content, calls = _tool_calls('Let me look. <tool_call>{"name": "lookup", "arguments": {"q": 1}}</tool_call>')
    assert content == "Let me look."
    assert calls[0]["function"] == {"name": "lookup", "arguments": '{"q": 1}'}
    assert _tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_weights_swap_in_place_and_calls_record_the_version(engine: TorchEngine, tokenizer: Any,
                                                            make_server: ServerFactory, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    srv = make_server(engine)
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    before = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
    storage = {k: v.data_ptr() for k, v in engine.model.state_dict().items()}
    new_model = tiny_model(len(tokenizer), seed=1)
    path = tmp_path / "step1.safetensors"
    save_file({k: v.contiguous() for k, v in new_model.state_dict().items()}, str(path))
    r = httpx.post(srv.url + "/v1/model", json={"version": 1, "weights": str(path)}, timeout=60)
    assert r.status_code == 200 and r.json() == {**r.json(), "model": "tiny", "version": 1}
    assert {k: v.data_ptr() for k, v in engine.model.state_dict().items()} == storage  # in place
    tp = {"traceparent": f"00-{'e' * 32}-{'f' * 16}-01"}
    after = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=tp, timeout=60).json()
    prompt = after["prompt_token_ids"]
    assert after["choices"][0]["token_ids"] == greedy(new_model, prompt, 6)
    assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    assert srv.server.records.get(("e" * 32, "f" * 16)).model_version == 1  # type: ignore[union-attr]
    bad = tmp_path / "bad.safetensors"
    save_file({"nope": torch.zeros(2)}, str(bad))
    with pytest.raises(ValueError, match="tensors the model does not"):
        engine.swap_weights({"nope": torch.zeros(2)}, 2)
    assert engine.version == 1


def test_from_pretrained_and_a_worker_loop(tokenizer: Any, tmp_path: Path, make_server: ServerFactory,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "tiny-policy"
    tiny_model(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    engine = TorchEngine.from_pretrained(folder, default_max_tokens=4)
    assert engine.name == "tiny-policy"
    srv = make_server(engine, gateway=GatewayConfig(sampling_overrides={"temperature": 1.0}))
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")

    def agent(task: dict[str, Any]) -> float:
        client = openai.OpenAI(max_retries=0)
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["q"]}])
        return float(len(reply.choices[0].message.content or "") % 2)

    TaskClient(srv.url).enqueue([{"q": f"q{i}"} for i in range(6)], repeat=2)
    worker = Worker(srv.url, agent, concurrency=4, idle_exit_s=0.5, poll_s=0.2, instrument=False)
    worker.run()
    assert worker.stats.posted == 12 and worker.stats.token_sources == {"gateway": 12}
    for t in srv.server.store.transitions():
        assert len(t.response_token_ids or []) == 4 and t.model == "tiny-policy"
    assert json.loads(httpx.get(srv.url + "/v1/models").text)["data"][0]["id"] == "tiny-policy"


# ---------------------------------------------------------------------- streaming: tool calls as they come, cancel


class ScriptedLM(torch.nn.Module):  # type: ignore[misc]
    """A causal LM that says ``script`` (token ids, then the end token) whatever the prompt, one token a step.

    Step ``hold_at`` waits for ``gate`` (at most 10 s), so a test can look at what has arrived while the
    model is still generating. ``steps`` counts the forward passes.
    """

    def __init__(self, vocab: int, script: list[int], eos: int, hold_at: int | None = None,
                 delay_s: float = 0.0) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.config = type("Config", (), {"max_position_embeddings": 4096})()
        self.vocab, self.script, self.eos, self.hold_at = vocab, script, eos, hold_at
        self.gate = threading.Event()
        self.held_out = False  # the gate was never opened: the hold timed out
        self.steps = 0

    def forward(self, input_ids: Any, attention_mask: Any = None, position_ids: Any = None, use_cache: bool = True,
                past_key_values: Any = None) -> Any:
        step = 0 if past_key_values is None else past_key_values + 1
        self.steps += 1
        time.sleep(self.delay_s)
        if step == self.hold_at:
            self.held_out = not self.gate.wait(10)
        token = self.script[step] if step < len(self.script) else self.eos
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], self.vocab), -30.0)
        logits[:, -1, token] = 0.0
        return type("Out", (), {"logits": logits, "past_key_values": step})()


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
FIRST = 'Checking. <tool_call>{"name": "lookup", "arguments": {"q": "a"}}</tool_call>'
SECOND = ' <tool_call>{"name": "lookup", "arguments": {"q": "b"}}</tool_call>'


def test_streamed_tool_calls_leave_as_each_block_closes_with_their_token_ids(tokenizer: Any,
                                                                            make_server: ServerFactory) -> None:
    script = tokenizer.encode(FIRST + SECOND)
    model = ScriptedLM(len(tokenizer), script, tokenizer.eos_token_id, hold_at=len(tokenizer.encode(FIRST)))
    srv = make_server(TorchEngine(model, tokenizer, name="scripted", default_max_tokens=200))
    tp = {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"}
    seen_while_held: list[str] = []
    calls: list[dict[str, Any]] = []
    text = ""
    with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=tp, timeout=60,
                      json={"messages": MESSAGES, "tools": TOOLS, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            text += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                calls.append(call)
                if not model.gate.is_set():  # the model is still held at the step after the first block
                    seen_while_held.append(call["function"]["arguments"])
                    model.gate.set()
    assert seen_while_held == ['{"q": "a"}'] and not model.held_out
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, "lookup", '{"q": "a"}'), (1, "lookup", '{"q": "b"}')]
    assert text.strip() == "Checking."
    record = srv.server.records.get(("1" * 32, "2" * 16))
    assert record is not None and record.response_token_ids == [*script, tokenizer.eos_token_id]
    assert len(record.response_logprobs) == len(script) + 1


def test_stream_splitter_holds_what_may_become_a_tag_or_a_stop_string() -> None:
    from agl_trainer.engine import _StreamSplitter

    s = _StreamSplitter(["END"], tools=True)
    assert s.feed("Hi <tool") == [{"content": "Hi "}]
    assert s.feed('Hi <tool_call>{"name": "f"}') == []
    out = s.feed('Hi <tool_call>{"name": "f"}</tool_call> ok E')
    assert out[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"} and out[1] == {"content": " ok "}
    assert s.feed('Hi <tool_call>{"name": "f"}</tool_call> ok EN') == []
    assert s.feed('Hi <tool_call>{"name": "f"}</tool_call> ok END more', final=True) == []  # nothing from the stop on
    bad = _StreamSplitter([], tools=True)
    assert bad.feed("<tool_call>not json</tool_call>", final=True) == [{"content": "<tool_call>not json</tool_call>"}]
    plain = _StreamSplitter([], tools=False)
    assert plain.feed("a <tool_call>") == [{"content": "a <tool_call>"}] and plain.feed("a <tool_call>\ufffd") == []


def test_a_client_that_goes_away_mid_stream_stops_its_generation(tokenizer: Any,
                                                                 make_server: ServerFactory) -> None:
    script = tokenizer.encode("a" * 150)
    model = ScriptedLM(len(tokenizer), script, tokenizer.eos_token_id, delay_s=0.03)  # 150 tokens: 4.5 s
    engine = TorchEngine(model, tokenizer, name="scripted", default_max_tokens=200)
    srv = make_server(engine)
    tp = {"traceparent": f"00-{'3' * 32}-{'4' * 16}-01"}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=tp, timeout=60,
                      json={"messages": MESSAGES, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # the first words arrived; now the agent goes away
    deadline = time.monotonic() + 10
    while engine.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.cancelled == 1
    assert model.steps < 100  # dropped soon after the agent left, not run to its 150 tokens
    assert srv.server.records.get(("3" * 32, "4" * 16)) is None  # half a call is not recorded
    model.delay_s = 0.0  # the engine serves the next request as usual
    data = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3,
                                                              "return_token_ids": True}, timeout=60).json()
    assert data["choices"][0]["token_ids"] == script[:3]


def test_a_client_that_gives_up_on_a_plain_request_stops_its_generation(tokenizer: Any,
                                                                        make_server: ServerFactory) -> None:
    script = tokenizer.encode("b" * 150)
    model = ScriptedLM(len(tokenizer), script, tokenizer.eos_token_id, delay_s=0.03)  # 150 tokens: 4.5 s
    engine = TorchEngine(model, tokenizer, name="scripted", default_max_tokens=200)
    srv = make_server(engine)
    tp = {"traceparent": f"00-{'5' * 32}-{'6' * 16}-01"}
    with pytest.raises(httpx.ReadTimeout):  # the agent's client times out and drops the connection
        httpx.post(srv.url + "/v1/chat/completions", json={"messages": MESSAGES}, headers=tp, timeout=0.5)
    deadline = time.monotonic() + 10
    while engine.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.cancelled == 1 and model.steps < 100
    assert srv.server.gateway.abandoned == 1 and srv.server.records.get(("5" * 32, "6" * 16)) is None


def sampled_logprobs(model: Any, prompt: list[int], response: list[int], *, temperature: float, top_k: int = 0,
                     top_p: float = 1.0) -> list[float]:
    """The logprob of each response token under the distribution it was sampled from: tempered, cut, renormalised."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float() / temperature
    out = []
    for i, t in enumerate(response):
        probs = torch.softmax(logits[len(prompt) - 1 + i], dim=-1)
        if top_k:
            probs = torch.where(probs >= torch.topk(probs, top_k).values[-1], probs, 0.0)
        if top_p < 1.0:
            ranked, order = torch.sort(probs, descending=True)
            keep = ranked.cumsum(-1) - ranked < top_p * ranked.sum()
            probs = torch.zeros_like(probs).scatter(0, order, ranked * keep)
        out.append(float(torch.log(probs[t] / probs.sum())))
    return out


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.5, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)])
def test_recorded_logprobs_are_of_the_distribution_sampled_from(engine: TorchEngine, tokenizer: Any,
                                                               make_server: ServerFactory, temperature: float,
                                                               top_k: int, top_p: float) -> None:
    srv = make_server(engine)
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": temperature, "top_k": top_k, "top_p": top_p,
            "seed": 1, "return_token_ids": True, "logprobs": True}
    data = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
    ids = data["choices"][0]["token_ids"]
    got = [e["logprob"] for e in data["choices"][0]["logprobs"]["content"]]
    want = sampled_logprobs(engine.model, data["prompt_token_ids"], ids, temperature=temperature, top_k=top_k,
                            top_p=top_p)
    assert got == pytest.approx(want, abs=1e-4)  # before: the unscaled model's, off by 0.5-3 nats a token


BROKEN = 'Checking. <tool_call>{"name": "lookup", "arguments": {"q": "a"</tool_call>'  # the JSON does not parse
CUT = 'Checking. <tool_call>{"name": "lookup", "arguments": {"q": "a"}}</tool_call>'   # max_tokens ends it early


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_that_does_not_parse_or_was_cut_off_is_a_malformed_call(tokenizer: Any, stream: bool,
                                                                          make_server: ServerFactory) -> None:
    air = agl.AirRules(malformed_tool_call=-0.5)
    rewards = []
    for text, max_tokens in ((BROKEN, 200), (CUT, len(tokenizer.encode(CUT)) - 4)):
        model = ScriptedLM(len(tokenizer), tokenizer.encode(text), tokenizer.eos_token_id)
        srv = make_server(TorchEngine(model, tokenizer, name="scripted", default_max_tokens=200))
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with agl.rollout(task_id="t", store=agl.HttpStore(srv.url)) as run:
            reply = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,  # type: ignore
                                                   max_tokens=max_tokens, stream=stream)
            if stream:
                content = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
            else:
                content = reply.choices[0].message.content or ""
        assert "<tool_call>" in content  # the engine's parser left the broken block in the text
        (t,) = run.trajectory(builder=agl.TransitionBuilder(air=air)).transitions
        rewards.append(t.reward)
    assert rewards == [-0.5, -0.5]  # before: None, None (only parsed tool_calls were checked)


def test_a_vllm_reply_that_left_a_broken_block_in_the_text_is_a_malformed_call(make_server: ServerFactory) -> None:
    from agl_core.testing import FakeOpenAI

    with FakeOpenAI(script=[{"content": BROKEN}]) as fake:  # what vLLM's hermes parser returns for it
        srv = make_server(fake)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with agl.rollout(task_id="t", store=agl.HttpStore(srv.url)) as run:
            client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS)  # type: ignore[arg-type]
        air = agl.AirRules(malformed_tool_call=-0.5)
        (t,) = run.trajectory(builder=agl.TransitionBuilder(air=air)).transitions
        assert t.reward == -0.5  # before: None
