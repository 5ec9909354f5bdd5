"""The built-in torch engine: any Hugging Face causal LM behind the gateway, with exact token ids.

:class:`TorchEngine` is a gateway :class:`~agl_trainer.gateway.Backend` that
answers chat and text completions itself, on CPU or one GPU, in the shape vLLM
answers them (``prompt_token_ids``, per-choice ``token_ids``, per-token
``logprobs``), so the gateway records its calls exactly as it records vLLM's.

- **Prompts**: chat messages go through the tokenizer's own chat template
  (``apply_chat_template`` with ``tools``); text prompts are tokenised as the
  model's tokenizer does (or given as token ids).
- **Batching**: requests that arrive together (within ``batch_wait_s``, up to
  ``max_batch`` sequences) are generated as one left-padded batch with a KV
  cache, each row with its own sampling (``temperature`` (0: greedy),
  ``top_p``, ``top_k``, ``seed``, ``max_tokens``, ``stop``) and its own end.
  Generation runs in one background thread, so the event loop stays free.
- **Logprobs** are those of the distribution each token was sampled from: the
  logits divided by ``temperature``, cut to ``top_k`` and ``top_p`` and
  renormalised (vLLM's ``processed_logprobs``), so they are the behaviour
  policy's whatever the sampling settings; a trainer computes its own at the same
  temperature (:func:`agl_trainer.loss.token_logprobs`). Greedy calls
  (``temperature`` 0) carry the model's unscaled logprobs. The response token ids
  include the end token when the model stopped on one, so a trainer teaches the
  model to stop.
- **Tool calls**: the response text's ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  blocks (the Hermes/Qwen convention) become OpenAI ``tool_calls``. Streamed, text goes out as
  it is generated and each tool call as soon as its block closes; only what may still become a
  ``<tool_call>`` tag or a stop string is held back. A block that is not a call (its JSON does
  not parse, or names no function) or that never closed (cut off by ``max_tokens``) stays in
  the text, as vLLM's parser leaves it: the ``TransitionBuilder`` reads such a block as a
  malformed tool call (``AirRules.malformed_tool_call``).
- **Cancelling**: an agent that goes away (its stream or its request is dropped) has its row
  taken out of generation at the next step, so it costs nothing more.
- **Weights** are swapped in place between batches: :meth:`TorchEngine.swap_weights`
  from a trainer in the same process, or ``POST /v1/model`` with a path (a
  ``save_pretrained`` folder, a ``.safetensors`` file or a ``torch.save``'d state
  dict). Parameters keep their storage, so an optimizer holding them stays valid.
  A trainer in the same process can instead train the very model the engine serves
  (:meth:`agl_trainer.torch_backend.TorchBackend.engine`: one set of weights): it holds
  :meth:`TorchEngine.paused` while it updates them and then calls :meth:`TorchEngine.serve_version`.
- **Several policies** (``adapters``, :mod:`agl_trainer.policies`): a peft model holding one LoRA
  adapter per policy serves a call for ``model`` NAME from adapter NAME, and a call for its own
  ``name`` from the base (every adapter switched off). A batch holds one adapter's calls only: the
  oldest waiting call's adapter goes next, gathering its calls while the others wait for their own
  batch (calls of two roles arriving interleaved are not batched one a batch); the reply names the
  model that answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl_trainer.api import error_body
from agl_trainer.gateway import BackendError, BackendReply, Chunks, Endpoint, wants_logprobs

__all__ = ["TorchEngine"]

logger = logging.getLogger("agl.trainer")

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class _Row:
    """One sequence to generate, and where its tokens go."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[tuple[str, Any, Any]]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    version: int = 0
    cancelled: bool = False
    """Set from the event loop when the agent went away; the engine drops the row at its next step."""
    adapter: str | None = None
    """The LoRA adapter that generates this row (an engine with ``adapters``); None: the model as it is."""

    def emit(self, kind: str, a: Any = None, b: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, a, b))
        except RuntimeError:  # the server's loop has closed: no one is waiting any more
            self.cancelled = True


class TorchEngine:
    """A Hugging Face causal LM and its tokenizer, served under ``name``."""

    def __init__(self, model: Any, tokenizer: Any, *, name: str = "policy", device: str | None = None,
                 max_batch: int = 8, batch_wait_s: float = 0.005, default_max_tokens: int = 256,
                 seed: int | None = None, adapters: Sequence[str] = ()) -> None:
        import torch

        self.torch = torch
        self.model = model
        self.adapters = list(adapters)
        """LoRA adapters of a peft ``model`` served by name; the engine's own ``name`` is then the base."""
        held = getattr(model, "peft_config", None)
        unknown = [a for a in self.adapters if not isinstance(held, dict) or a not in held]
        if unknown:
            raise ValueError(f"adapters {unknown}: the model holds no LoRA adapter of that name")
        if name in self.adapters:
            raise ValueError(f"the engine's name {name!r} is the base model's: an adapter may not have it")
        self.tokenizer = tokenizer
        self.name = name
        self.device = torch.device(device) if device else next(model.parameters()).device
        if next(model.parameters()).device != self.device:
            self.model.to(self.device)
        self.model.eval()
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.default_max_tokens = default_max_tokens
        self.version = 0
        self.batches: list[int] = []  # sizes of the batches generated, for tests and monitoring
        self.cancelled = 0  # rows dropped because their agent went away
        config = getattr(model, "config", None)
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.eos_ids = self._eos_ids()
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        # transformers 5 renamed the KV-cache argument and output from past_key_values to cache
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft passes kwargs on
        self._cache_arg = "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"
        self._generator = torch.Generator(device="cpu")
        if seed is not None:
            self._generator.manual_seed(seed)
        self._lock = threading.Lock()  # held while a batch generates, and while weights are swapped
        self._requests: queue.Queue[_Row | None] = queue.Queue()
        self._waiting: list[_Row] = []  # arrived, not generated yet, oldest first (the generation thread's own)
        self._thread = threading.Thread(target=self._run, name="agl-torch-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], *, name: str | None = None, device: str = "cpu",
                        dtype: Any = None, **kwargs: Any) -> TorchEngine:
        """Load a causal LM and its tokenizer from a local folder (no download: set HF_HUB_OFFLINE=1)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype) if dtype else \
            AutoModelForCausalLM.from_pretrained(path)
        return cls(model, tokenizer, name=name or os.path.basename(os.path.normpath(path)), device=device, **kwargs)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.tokenizer.eos_token_id, getattr(getattr(self.model, "generation_config", None),
                                                              "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(i) for i in source)
        return ids

    # ------------------------------------------------------------------ weights

    def swap_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Copy ``state_dict`` into the model's parameters in place, between two batches; then serve ``version``."""
        torch = self.torch
        params = dict(self.model.state_dict())
        unexpected = sorted(set(state_dict) - set(params))
        if unexpected:
            raise ValueError(f"the new weights have tensors the model does not: {unexpected[:5]}")
        tied = {k for k in params if k.endswith("lm_head.weight")} if getattr(
            getattr(self.model, "config", None), "tie_word_embeddings", False) else set()
        missing = sorted(set(params) - set(state_dict) - tied)
        if missing:
            raise ValueError(f"the new weights lack tensors of the model: {missing[:5]}")
        for key, value in state_dict.items():
            if tuple(value.shape) != tuple(params[key].shape):
                raise ValueError(f"the new weight {key} has shape {tuple(value.shape)}, the model's "
                                 f"{tuple(params[key].shape)}")
        with self._lock, torch.no_grad():
            for key, value in state_dict.items():
                params[key].copy_(value.to(device=params[key].device, dtype=params[key].dtype))
            self.version = version

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No batch generates inside this block (one that is generating finishes first)."""
        with self._lock:
            yield

    def serve_version(self, version: int) -> None:
        """Calls from the next batch on are ``version`` (a trainer changed the shared weights in place)."""
        with self._lock:
            self.version = version

    async def update_weights(self, weights: str | None, version: int) -> None:
        """Load the weights at ``weights`` (when given) and swap them in; calls after this are ``version``."""
        if weights is None:
            self.version = version  # a trainer in this process has swapped them already
            return
        state = await asyncio.to_thread(self._load, weights)
        await asyncio.to_thread(self.swap_weights, state, version)

    def _load(self, path: str) -> dict[str, Any]:
        torch = self.torch
        if os.path.isdir(path):
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                files = sorted(f for f in os.listdir(path) if f.endswith(".bin") or f.endswith(".pt"))
            if not files:
                raise ValueError(f"no .safetensors, .bin or .pt weights in {path}")
            state: dict[str, Any] = {}
            for f in files:
                state.update(self._load(os.path.join(path, f)))
            return state
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return dict(load_file(path, device="cpu"))
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(loaded, dict):
            raise ValueError(f"{path} does not hold a state dict")
        return loaded

    # ------------------------------------------------------------------ backend

    async def models(self) -> list[str]:
        return [self.name, *self.adapters]

    def _served(self, body: dict[str, Any]) -> str:
        """The model that answers ``body``: its adapter when it asks for one, else the engine's own name."""
        asked = body.get("model")
        return asked if isinstance(asked, str) and asked in self.adapters else self.name

    async def aclose(self) -> None:
        self._requests.put(None)

    async def complete(self, endpoint: Endpoint, body: dict[str, Any]) -> BackendReply:
        try:
            rows, prompt_ids = self._rows(endpoint, body)
        except _BadRequest as exc:
            return BackendReply(400, error_body(400, exc.message, exc.param))
        for row in rows:
            self._requests.put(row)
        choices = []
        try:
            for index, row in enumerate(rows):
                while True:
                    kind, _, _ = await row.events.get()
                    if kind == "done":
                        break
                    if kind == "error":
                        raise BackendError(500, f"the torch engine failed: {row.finish_reason}")
                choices.append(self._choice(endpoint, body, row, index))
        finally:
            for row in rows:
                if row.finish_reason is None:  # cancelled: the agent went away
                    row.cancelled = True
        completion_tokens = sum(len(r.ids) for r in rows)
        out: dict[str, Any] = {
            "id": f"{'chatcmpl' if endpoint == 'chat/completions' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if endpoint == "chat/completions" else "text_completion",
            "created": int(time.time()), "model": self._served(body), "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens},
        }
        if body.get("return_token_ids") and endpoint == "chat/completions":
            out["prompt_token_ids"] = prompt_ids
        return BackendReply(200, out)

    async def stream(self, endpoint: Endpoint, body: dict[str, Any]) -> BackendReply | Chunks:
        try:
            rows, prompt_ids = self._rows(endpoint, body)
        except _BadRequest as exc:
            return BackendReply(400, error_body(400, exc.message, exc.param))
        if len(rows) != 1:
            return BackendReply(400, error_body(400, "the torch engine streams one choice per request (n=1)", "n"))
        self._requests.put(rows[0])
        return self._chunks(endpoint, body, rows[0], prompt_ids)

    # ------------------------------------------------------------------ requests

    def _rows(self, endpoint: Endpoint, body: dict[str, Any]) -> tuple[list[_Row], list[int]]:
        if endpoint == "chat/completions":
            prompt_ids = self._chat_prompt(body)
        else:
            prompt = body.get("prompt")
            prompt_ids = list(prompt) if isinstance(prompt, list) else list(self.tokenizer.encode(prompt))
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise _BadRequest(f"'prompt' holds token ids outside the vocabulary (0..{vocab - 1})", "prompt")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.default_max_tokens
        if self.max_positions is not None:
            room = self.max_positions - len(prompt_ids)
            if room < 1:
                raise _BadRequest(f"the prompt is {len(prompt_ids)} tokens; the model takes at most "
                                  f"{self.max_positions}", "messages" if endpoint == "chat/completions" else "prompt")
            max_tokens = min(max_tokens, room)
        stop = body.get("stop") or []
        loop = asyncio.get_running_loop()
        seed = body.get("seed")
        adapter = body.get("model") if self.adapters and body.get("model") in self.adapters else None
        rows = []
        for i in range(body.get("n") or 1):
            rows.append(_Row(
                prompt_ids=prompt_ids, max_tokens=int(max_tokens),
                temperature=float(body["temperature"]) if body.get("temperature") is not None else 1.0,
                top_p=float(body["top_p"]) if body.get("top_p") is not None else 1.0,
                top_k=int(body.get("top_k") or 0), seed=None if seed is None else seed + i,
                stop=[stop] if isinstance(stop, str) else list(stop), loop=loop, events=asyncio.Queue(),
                adapter=adapter))
        return rows, prompt_ids

    def _chat_prompt(self, body: dict[str, Any]) -> list[int]:
        messages = [_template_message(m) for m in body["messages"]]
        tools = body.get("tools") or None
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                     tokenize=True)
        except Exception as exc:  # noqa: BLE001 - a template's own error, about the messages it was given
            raise _BadRequest(f"the model's chat template rejected the messages: {exc}", "messages") from None
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(i) for i in ids]

    def _text(self, ids: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text

    def _finish_text(self, row: _Row) -> str:
        text = self._text(row.ids)
        for s in row.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        return text

    def _choice(self, endpoint: Endpoint, body: dict[str, Any], row: _Row, index: int) -> dict[str, Any]:
        text = self._finish_text(row)
        choice: dict[str, Any] = {"index": index, "finish_reason": row.finish_reason}
        if endpoint == "chat/completions":
            content, calls = _tool_calls(text) if body.get("tools") else (text, [])
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
                choice["finish_reason"] = "tool_calls"
            choice["message"] = message
            choice["logprobs"] = {"content": [self._lp_entry(t, lp) for t, lp in zip(row.ids, row.logprobs,
                                                                                     strict=True)]} \
                if body.get("logprobs") else None
        else:
            choice["text"] = text
            choice["logprobs"] = {"tokens": [self.tokenizer.decode([t]) for t in row.ids],
                                  "token_logprobs": list(row.logprobs)} if wants_logprobs(body.get("logprobs")) \
                else None
            if body.get("return_token_ids"):
                choice["prompt_token_ids"] = row.prompt_ids
        if body.get("return_token_ids"):
            choice["token_ids"] = list(row.ids)
        return choice

    def _lp_entry(self, token: int, logprob: float) -> dict[str, Any]:
        piece = self.tokenizer.decode([token])
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "top_logprobs": []}

    async def _chunks(self, endpoint: Endpoint, body: dict[str, Any], row: _Row, prompt_ids: list[int]
                      ) -> Chunks:
        try:
            async for chunk in self._stream_row(endpoint, body, row, prompt_ids):
                yield chunk
        finally:
            if row.finish_reason is None:  # the agent went away (or the gateway failed): stop generating it
                row.cancelled = True

    async def _stream_row(self, endpoint: Endpoint, body: dict[str, Any], row: _Row, prompt_ids: list[int]
                          ) -> Chunks:
        chat = endpoint == "chat/completions"
        want_ids, want_lp = bool(body.get("return_token_ids")), wants_logprobs(body.get("logprobs"))
        # with tools, text goes out as it comes and each tool call as soon as its block closes
        splitter = _StreamSplitter(row.stop, tools=chat and bool(body.get("tools")))
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
                "model": self._served(body)}

        def chunk(delta: dict[str, Any], ids: list[int], lps: list[float], finish: str | None = None,
                  first: bool = False) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"role": "assistant", "content": "", **delta} if first else delta
                choice["logprobs"] = {"content": [self._lp_entry(t, lp) for t, lp in zip(ids, lps, strict=True)]} \
                    if want_lp and ids else None
            else:
                choice["text"] = delta.get("content") or ""
                choice["logprobs"] = {"tokens": [self.tokenizer.decode([t]) for t in ids], "token_logprobs": lps} \
                    if want_lp and ids else None
                if first and want_ids:
                    choice["prompt_token_ids"] = prompt_ids
            if want_ids:
                choice["token_ids"] = ids
            out: dict[str, Any] = {**base, "choices": [choice]}
            if first and chat and want_ids:
                out["prompt_token_ids"] = prompt_ids
            return out

        first = True
        if chat:
            yield chunk({}, [], [], first=True)
            first = False
        while True:
            kind, a, b = await row.events.get()
            if kind == "error":
                raise BackendError(500, f"the torch engine failed: {row.finish_reason}")
            if kind == "done":
                break
            deltas = splitter.feed(self._text(row.ids))
            # the token's id and logprob ride on the first delta it completed (or on an empty one)
            for i, delta in enumerate(deltas or [{}]):
                yield chunk(delta, [a] if i == 0 else [], [b] if i == 0 else [], first=first)
                first = False
        for delta in splitter.feed(self._text(row.ids), final=True):
            yield chunk(delta, [], [])
        finish = "tool_calls" if splitter.calls else row.finish_reason
        yield chunk({}, [], [], finish=finish)
        if isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage"):
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(row.ids),
                     "total_tokens": len(prompt_ids) + len(row.ids)}
            yield {**base, "choices": [], "usage": usage}

    # ------------------------------------------------------------------ generation

    def _run(self) -> None:
        while True:
            if not self._waiting:
                first = self._requests.get()
                if first is None:
                    return
                self._hold(first)
                if not self._waiting:
                    continue
            # the oldest waiting row's adapter generates next (one adapter a batch; no adapter waits behind
            # another's stream of calls); the window gathers more of its rows, holding the others for theirs
            adapter = self._waiting[0].adapter
            deadline = time.monotonic() + self.batch_wait_s
            while sum(1 for r in self._waiting if r.adapter == adapter) < self.max_batch:
                try:
                    more = self._requests.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if more is None:  # closing: what waits is generated first
                    self._requests.put(None)
                    break
                self._hold(more)
            batch: list[_Row] = []
            rest: list[_Row] = []
            for r in self._waiting:
                if r.cancelled:
                    self._drop(r)
                elif r.adapter == adapter and len(batch) < self.max_batch:
                    batch.append(r)
                else:
                    rest.append(r)
            self._waiting = rest
            if not batch:
                continue
            try:
                with self._lock:
                    self.batches.append(len(batch))
                    with self._adapter(adapter):
                        self._generate(batch)
            except Exception as exc:  # noqa: BLE001 - every waiting request must hear of it
                logger.exception("agl torch engine: generation failed")
                for r in batch:
                    if r.finish_reason is None:
                        r.finish_reason = f"{type(exc).__name__}: {exc}"
                        r.emit("error")

    def _hold(self, row: _Row) -> None:
        """``row`` waits for its adapter's next batch (a cancelled one is dropped at once)."""
        if row.cancelled:
            self._drop(row)
        else:
            self._waiting.append(row)

    @contextlib.contextmanager
    def _adapter(self, name: str | None) -> Iterator[None]:
        """Generate from adapter ``name`` (None with ``adapters``: the base, every adapter off); held lock."""
        if not self.adapters:
            yield
        elif name is None:
            with self.model.disable_adapter():
                yield
        else:
            self.model.set_adapter(name)
            yield

    def _drop(self, row: _Row) -> None:
        """A row whose agent went away: it generates no more (and frees its place in the batch)."""
        row.finish_reason = "cancelled"
        self.cancelled += 1
        row.emit("done")

    def _generate(self, batch: list[_Row]) -> None:
        torch = self.torch
        device = self.device
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - len(r.prompt_ids):] = 1
            r.version = self.version
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generators = [self._row_generator(r) for r in batch]
        alive = [True] * len(batch)
        steps = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
            past = getattr(out, self._cache_arg)
            last_pos = positions[:, -1]
            for _ in range(steps):
                for i, r in enumerate(batch):
                    if alive[i] and r.cancelled:
                        alive[i] = False
                        self._drop(r)
                if not any(alive):
                    break
                logits = out.logits[:, -1, :].float()
                chosen = torch.full((len(batch),), self.pad_id, dtype=torch.long, device=device)
                picked = [0.0] * len(batch)
                for i, r in enumerate(batch):
                    if alive[i]:
                        token, picked[i] = self._sample(logits[i], r, generators[i])
                        chosen[i] = token
                tokens = chosen.tolist()
                for i, r in enumerate(batch):
                    if not alive[i]:
                        continue
                    token, lp = tokens[i], picked[i]
                    r.ids.append(token)
                    r.logprobs.append(lp)
                    r.emit("token", token, lp)
                    reason = self._finished(r, token)
                    if reason is not None:
                        alive[i] = False
                        r.finish_reason = reason
                        r.emit("done")
                if not any(alive):
                    break
                mask = torch.cat([mask, torch.ones((len(batch), 1), dtype=mask.dtype, device=device)], dim=1)
                last_pos = last_pos + 1
                out = self.model(input_ids=chosen[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                                 use_cache=True, **{self._cache_arg: past})
                past = getattr(out, self._cache_arg)

    def _row_generator(self, row: _Row) -> Any:
        if row.seed is None:
            return self._generator
        return self.torch.Generator(device="cpu").manual_seed(int(row.seed))

    def _sample(self, logits: Any, row: _Row, generator: Any) -> tuple[int, float]:
        """A token and its logprob under the distribution it was drawn from (see the module docstring)."""
        torch = self.torch
        if row.temperature == 0:
            token = int(torch.argmax(logits).item())
            return token, float(torch.log_softmax(logits, dim=-1)[token])
        scores = logits / row.temperature
        if 0 < row.top_k < scores.shape[-1]:
            kth = torch.topk(scores, row.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        logprobs = torch.log_softmax(scores, dim=-1)
        probs = logprobs.exp()
        if row.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < row.top_p
            filtered = torch.zeros_like(probs).scatter(0, order, sorted_probs * keep)
            kept = filtered.sum()
            probs = filtered / kept
            logprobs = logprobs - torch.log(kept)  # renormalised over the tokens top_p kept
        token = int(torch.multinomial(probs.cpu(), 1, generator=generator).item())
        return token, float(logprobs[token])

    def _finished(self, row: _Row, token: int) -> str | None:
        if token in self.eos_ids:
            return "stop"
        if row.stop:
            text = self._text(row.ids)
            if any(s in text for s in row.stop):
                return "stop"
        if len(row.ids) >= row.max_tokens:
            return "length"
        return None


class _BadRequest(Exception):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as chat templates expect it: text content, tool-call arguments as objects."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    elif content is None:
        out["content"] = ""
    calls = out.get("tool_calls")
    if calls:
        fixed = []
        for call in calls:
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
            fixed.append({**call, "function": fn})
        out["tool_calls"] = fixed
    return out


def _parse_call(inner: str) -> dict[str, Any] | None:
    """The JSON inside one ``<tool_call>`` block as an OpenAI tool call; None when it is not one."""
    try:
        spec = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        return None
    args = spec.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": spec["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def _tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``<tool_call>{json}</tool_call>`` blocks as OpenAI tool calls; the rest of the text as the content."""
    calls = [call for match in _TOOL_CALL.finditer(text) if (call := _parse_call(match.group(1))) is not None]
    if not calls:
        return text, []
    content = _TOOL_CALL.sub("", text).strip()
    return content or None, calls


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _prefix_at_end(text: str, word: str) -> int:
    """How many characters at the end of ``text`` are the start of ``word`` (and may yet become it)."""
    for n in range(min(len(text), len(word) - 1), 0, -1):
        if word.startswith(text[-n:]):
            return n
    return 0


class _StreamSplitter:
    """A streamed reply's text as chat deltas: text as it comes, each tool call as soon as its block closes.

    :meth:`feed` takes the whole text decoded so far and returns the deltas it adds. Text that may
    still turn into a stop string or a ``<tool_call>`` tag, and a trailing half of a multi-byte
    character, are held back until they cannot; nothing from a stop string on is ever sent. A block
    whose JSON is not a tool call goes out as text, as the non-streamed reply keeps it.
    """

    def __init__(self, stop: Sequence[str], *, tools: bool) -> None:
        self.stop = [s for s in stop if s]
        self.tools = tools
        self.sent = 0  # characters of the text already sent as deltas
        self.calls = 0

    def feed(self, text: str, *, final: bool = False) -> list[dict[str, Any]]:
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        pieces: list[dict[str, Any]] = []

        def content(piece: str) -> None:
            if pieces and "content" in pieces[-1]:
                pieces[-1]["content"] += piece
            else:
                pieces.append({"content": piece})
            self.sent += len(piece)

        while True:
            rest = text[self.sent:]
            opened = rest.find(_OPEN) if self.tools else -1
            if opened > 0:
                content(rest[:opened])
                continue
            if opened == 0:
                closed = rest.find(_CLOSE)
                if closed >= 0:
                    block = rest[:closed + len(_CLOSE)]
                    call = _parse_call(block[len(_OPEN):closed].strip())
                    if call is None:
                        content(block)
                    else:
                        pieces.append({"tool_calls": [{"index": self.calls, **call}]})
                        self.calls += 1
                        self.sent += len(block)
                    continue
                if final and rest:
                    content(rest)  # a block the model never closed is text
                break
            ready = len(rest) if final else len(rest) - self._held(rest)
            if ready > 0:
                content(rest[:ready])
            break
        return pieces

    def _held(self, rest: str) -> int:
        held = len(rest) - len(rest.rstrip("\ufffd"))  # an incomplete multi-byte character decodes as U+FFFD
        for word in [*self.stop, *([_OPEN] if self.tools else [])]:
            held = max(held, _prefix_at_end(rest, word))
        return held
