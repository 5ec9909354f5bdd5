"""A fake OpenAI-compatible server on 127.0.0.1 that answers like vLLM, for tests, demos and benchmarks.

It serves ``POST /v1/chat/completions`` (plain JSON, or SSE with ``data: ...``
chunks, ``data: [DONE]`` and ``stream_options.include_usage``),
``POST /v1/completions`` (plain JSON only), ``POST /v1/responses`` (the
Responses API: the request made the chat request it stands for and the chat
reply written back as a ``Response`` or its events, as agl's gateway does; with
token ids, the ``Response`` carries ``prompt_token_ids`` and ``token_ids``) and
``GET /v1/models``. Replies are
scripted and consumed in order; once the script is used up (or without one) the
reply echoes the last user message. A reply is one of:

- ``"text"``: an assistant message with that content;
- ``{"content": ..., "tool_calls": [{"name": ..., "arguments": "..." | {...}, "id": ...}],
  "reasoning": ..., "finish_reason": ...}``: every key optional;
- ``{"status": 500, "error": "message"}``: an HTTP error with an OpenAI-style error body;
- ``{"status": 200, "body": "not json"}``: exactly that body, for malformed-reply tests;

or ``script`` is a callable ``(request_json) -> reply``. Note that the openai
client retries 5xx and connection errors: use ``max_retries=0`` when a test
scripts a failure, or every retry consumes a reply.

Like vLLM, a request with ``return_token_ids: true`` gets ``prompt_token_ids``
(top level; first chunk when streaming) and per-choice ``token_ids`` (per chunk
when streaming), and ``logprobs: true`` gets per-token logprobs. Token ids come
from a deterministic toy tokenizer, :func:`tokenize` (and :func:`render_prompt`
for chat prompts), so tests can compute the ids they expect. ``return_token_ids=True``
answers every chat request with them, asked or not, as a serving engine set up to
always return them would: an unchanged agent (one that never asks) then gets token
ids in its transitions.

With ``enable_lora=True`` it also serves vLLM's runtime LoRA endpoints, as ``vllm serve --enable-lora``
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` does: ``POST /v1/load_lora_adapter``
(``lora_name``, ``lora_path`` a peft adapter folder, ``load_inplace``; ``lora_inplace=False``: a
vLLM from before it, which ignores the field) and ``POST
/v1/unload_lora_adapter``, with vLLM's answers (a name loaded twice without ``load_inplace``
is a 400, an unknown one to unload a 404, a folder without ``adapter_config.json`` a 400);
``/v1/models`` lists the adapters, and a call whose ``model`` is neither the base nor a loaded
adapter is a 404. Each load is kept in ``srv.lora_loads`` (:class:`LoraLoad`, with a digest of
the adapter's weights as they were when it was loaded); replies name the model asked for.

Every request is recorded in ``srv.requests`` (path, lower-cased headers, JSON
body). The server uses only the standard library (``http.server``), keeps
HTTP/1.1 connections alive and never sleeps, so benchmarks measure the client,
not the fake.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self

from agl_core.openai_client.responses_items import ItemError, ResponseWriter, chat_request

Reply = str | Mapping[str, Any]
Script = Sequence[Reply] | Callable[[dict[str, Any]], Reply]

CREATED = 1_700_000_000  # a fixed timestamp keeps responses deterministic
_PIECE = re.compile(r"\s*\S+|\s+")


def tokenize(text: str) -> list[int]:
    """The toy tokenizer: each word with its leading whitespace is one stable id in ``[10, 50010)``."""
    return [zlib.crc32(piece.encode()) % 50_000 + 10 for piece in _PIECE.findall(text)]


def _pieces(text: str) -> list[str]:
    return _PIECE.findall(text)


def _logprob(token_id: int) -> float:
    return -round((token_id % 97) / 100 + 0.01, 4)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))


def render_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """The toy chat template: ``<role> content`` per message, tool calls as JSON, then ``<assistant>``."""
    out = []
    for m in messages:
        line = f"<{m.get('role', 'user')}> {_text(m.get('content'))}"
        if m.get("tool_calls"):
            line += " " + json.dumps(m["tool_calls"], sort_keys=True)
        out.append(line)
    out.append("<assistant>")
    return "\n".join(out)


def _tool_call_text(calls: Sequence[Mapping[str, Any]]) -> str:
    """What the toy model 'generates' for tool calls, so they have token ids too."""
    return " ".join(f"<tool_call> {c['function']['name']} {c['function']['arguments']}" for c in calls)


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]  # keys lower-cased
    body: Any  # the decoded JSON body, or None


@dataclass(frozen=True)
class LoraLoad:
    """One accepted ``POST /v1/load_lora_adapter``: the adapter's name, folder and weights when it was loaded."""

    name: str
    path: str
    inplace: bool
    weights_sha256: str  # of adapter_model.safetensors ("" when the folder has none)
    calls_before: int  # chat and completion calls answered before this load


@dataclass(frozen=True)
class _Answer:
    """One reply made concrete: content, tool calls and the token ids behind them."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    reasoning: str | None
    finish_reason: str
    pieces: list[str]  # the generated text, split into tokens
    token_ids: list[int]


class FakeOpenAI:
    """``with FakeOpenAI(script=[...]) as srv: openai.OpenAI(base_url=srv.url, api_key="x")``."""

    def __init__(self, script: Script | None = None, *, model: str = "fake-model", status: int | None = None,
                 return_token_ids: bool = False, port: int = 0, enable_lora: bool = False,
                 lora_inplace: bool = True) -> None:
        self.model = model
        self.enable_lora = enable_lora
        self.lora_inplace = lora_inplace  # False: a vLLM from before load_inplace, which ignores the field
        self.adapters: dict[str, str] = {}  # name -> folder, the LoRA adapters loaded now
        self.lora_loads: list[LoraLoad] = []
        self.answered = 0  # chat and completion calls answered
        self.port = port  # 0: any free one; a fixed one lets a test stop the server and start it again there
        self.status = status  # when set, every chat/completions request fails with it
        self.return_token_ids = return_token_ids  # token ids in every chat reply, even unasked
        self.requests: list[RecordedRequest] = []
        self._script = script
        self._next = 0
        self._count = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        """The base URL to give an OpenAI client (ends with ``/v1``)."""
        if self._server is None:
            raise RuntimeError("FakeOpenAI is not running: use it as a context manager or call start()")
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def start(self) -> Self:
        server = ThreadingHTTPServer(("127.0.0.1", self.port), _make_handler(self))
        server.daemon_threads = True
        self._server = server
        # a short poll interval: stop() waits for the serving loop to notice, and tests start many servers
        self._thread = threading.Thread(target=server.serve_forever, args=(0.02,), name="FakeOpenAI", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ------------------------------------------------------------------ replies

    def _record(self, request: RecordedRequest) -> int:
        with self._lock:
            self.requests.append(request)
            self._count += 1
            return self._count

    def _reply(self, body: dict[str, Any]) -> Reply:
        script = self._script
        if callable(script):
            return script(body)
        if script is not None:
            with self._lock:
                if self._next < len(script):
                    self._next += 1
                    return script[self._next - 1]
        users = [m for m in body.get("messages") or () if m.get("role") == "user"]
        return _text(users[-1].get("content")) if users else _text(body.get("prompt"))

    def _answer(self, reply: Mapping[str, Any], n: int) -> _Answer:
        calls = [
            {"id": c.get("id") or f"call_{n}_{i}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"] if isinstance(c["arguments"], str)
                          else json.dumps(c["arguments"])}}
            for i, c in enumerate(reply.get("tool_calls") or ())
        ]
        content = reply.get("content")
        generated = (content or "") + (" " if content and calls else "") + _tool_call_text(calls)
        pieces = _pieces(generated)
        finish = reply.get("finish_reason") or ("tool_calls" if calls else "stop")
        if content is None and not calls:
            content = ""
        return _Answer(content, calls, reply.get("reasoning"), finish, pieces, tokenize(generated))


def _load_adapter(srv: FakeOpenAI, body: Any) -> tuple[int, str]:
    """vLLM's ``/v1/load_lora_adapter``: its status and message."""
    name, path = (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
    if not name or not path:
        return 400, "Both 'lora_name' and 'lora_path' must be provided."
    inplace = bool(body.get("load_inplace")) and srv.lora_inplace
    if name in srv.adapters and not inplace:
        return 400, f"The lora adapter '{name}' has already been loaded."
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        return 400, f"Loading lora {name} failed: No adapter found for {path}"
    weights = os.path.join(path, "adapter_model.safetensors")
    digest = ""
    if os.path.isfile(weights):
        with open(weights, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    with srv._lock:
        srv.adapters[name] = path
        srv.lora_loads.append(LoraLoad(name, path, inplace, digest, srv.answered))
    return 200, f"Success: LoRA adapter '{name}' added successfully."


def _unload_adapter(srv: FakeOpenAI, body: Any) -> tuple[int, str]:
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not name:
        return 400, "'lora_name' needs to be provided to unload a LoRA adapter."
    with srv._lock:
        if srv.adapters.pop(name, None) is None:
            return 404, f"The lora adapter '{name}' cannot be found."
    return 200, f"Success: LoRA adapter '{name}' removed successfully."


def _error_body(status: int, message: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error", "code": status, "param": param}}).encode()


def _logprobs(answer: _Answer, start: int = 0, stop: int | None = None) -> dict[str, Any]:
    ids = answer.token_ids[start:stop]
    return {"content": [{"token": p, "logprob": _logprob(t), "bytes": list(p.encode()), "top_logprobs": []}
                        for p, t in zip(answer.pieces[start:stop], ids, strict=True)]}


def _chat_response(srv: FakeOpenAI, body: dict[str, Any], answer: _Answer, n: int) -> dict[str, Any]:
    prompt_ids = tokenize(render_prompt(body.get("messages") or ()))
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.tool_calls:
        message["tool_calls"] = answer.tool_calls
    if answer.reasoning is not None:
        message["reasoning_content"] = answer.reasoning
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": answer.finish_reason,
                              "logprobs": _logprobs(answer) if body.get("logprobs") else None}
    out: dict[str, Any] = {
        "id": f"chatcmpl-{n}", "object": "chat.completion", "created": CREATED, "model": body.get("model", srv.model),
        "choices": [choice],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(answer.token_ids),
                  "total_tokens": len(prompt_ids) + len(answer.token_ids)},
    }
    if body.get("return_token_ids") or srv.return_token_ids:
        out["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = answer.token_ids
    return out


def _chat_chunks(srv: FakeOpenAI, body: dict[str, Any], answer: _Answer, n: int) -> Iterator[dict[str, Any]]:
    """The SSE chunks of one streamed reply: role, reasoning, one chunk per token, finish, usage."""
    want_ids, want_logprobs = bool(body.get("return_token_ids") or srv.return_token_ids), bool(body.get("logprobs"))
    prompt_ids = tokenize(render_prompt(body.get("messages") or ()))
    base = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "created": CREATED,
            "model": body.get("model", srv.model)}

    def chunk(delta: dict[str, Any], start: int = 0, stop: int = 0, finish: str | None = None) -> dict[str, Any]:
        logprobs = _logprobs(answer, start, stop) if want_logprobs and stop > start else None
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        if want_ids:
            choice["token_ids"] = answer.token_ids[start:stop]
        return {**base, "choices": [choice]}

    first = chunk({"role": "assistant", "content": ""})
    if want_ids:
        first["prompt_token_ids"] = prompt_ids
    yield first
    if answer.reasoning:
        yield chunk({"reasoning_content": answer.reasoning})
    content_pieces = _pieces(answer.content or "")
    for i, piece in enumerate(content_pieces):
        yield chunk({"content": piece}, i, i + 1)
    pos, rest = len(content_pieces), len(answer.token_ids) - len(content_pieces)
    for index, call in enumerate(answer.tool_calls):
        fn, k = call["function"], len(answer.tool_calls)
        end = len(content_pieces) + rest * (index + 1) // k  # the calls' tokens, shared out in order
        yield chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                     "function": {"name": fn["name"], "arguments": ""}}]})
        args, half, mid = fn["arguments"], len(fn["arguments"]) // 2, (pos + end) // 2
        # arguments arrive in two fragments, as real servers split them
        yield chunk({"tool_calls": [{"index": index, "function": {"arguments": args[:half]}}]}, pos, mid)
        yield chunk({"tool_calls": [{"index": index, "function": {"arguments": args[half:]}}]}, mid, end)
        pos = end
    yield chunk({}, pos, len(answer.token_ids), finish=answer.finish_reason)
    options = body.get("stream_options") or {}
    if options.get("include_usage"):
        yield {**base, "choices": [], "usage": {"prompt_tokens": len(prompt_ids),
                                               "completion_tokens": len(answer.token_ids),
                                               "total_tokens": len(prompt_ids) + len(answer.token_ids)}}


def _completion_response(srv: FakeOpenAI, body: dict[str, Any], text: str, n: int) -> dict[str, Any]:
    prompt = body.get("prompt")
    prompt_ids = tokenize(prompt if isinstance(prompt, str) else "")
    ids = tokenize(text)
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
    if body.get("return_token_ids"):
        choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = ids
    return {"id": f"cmpl-{n}", "object": "text_completion", "created": CREATED, "model": body.get("model", srv.model),
            "choices": [choice], "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                                           "total_tokens": len(prompt_ids) + len(ids)}}


def _make_handler(srv: FakeOpenAI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: no new connection per call
        disable_nagle_algorithm = True  # headers and body go out as separate writes

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
            return None

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _read(self) -> tuple[Any, int]:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            headers = {k.lower(): v for k, v in self.headers.items()}
            return body, srv._record(RecordedRequest(self.command, self.path, headers, body))

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            srv._record(RecordedRequest("GET", self.path, {k.lower(): v for k, v in self.headers.items()}, None))
            if self.path.rstrip("/") == "/v1/models":
                models: list[dict[str, Any]] = [{"id": srv.model, "object": "model", "created": CREATED,
                                                 "owned_by": "fake"}]
                models += [{"id": name, "object": "model", "created": CREATED, "owned_by": "fake",
                                  "root": path, "parent": srv.model} for name, path in srv.adapters.items()]
                data = {"object": "list", "data": models}
                self._send(200, json.dumps(data).encode())
            else:
                self._send(404, _error_body(404, f"no route GET {self.path}"))

        def _send_response(self, request: dict[str, Any], chat: dict[str, Any], answer: _Answer, n: int) -> None:
            """The Responses API's answer: the chat reply written as a Response, or as its events."""
            writer = ResponseWriter(request, f"resp_{n}", CREATED)
            if not chat.get("stream"):
                self._send(200, json.dumps(writer.response(_chat_response(srv, chat, answer, n))).encode())
                return
            events = [e for c in _chat_chunks(srv, chat, answer, n) for e in writer.add(c)] + writer.done()
            self._send(200, b"".join(b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n"
                                     for e in events), "text/event-stream")

        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            body, n = self._read()
            path = self.path.split("?")[0].rstrip("/")
            lora = {"/v1/load_lora_adapter": _load_adapter, "/v1/unload_lora_adapter": _unload_adapter}
            if srv.enable_lora and path in lora:
                status, message = lora[path](srv, body)
                if status == 200:
                    self._send(200, message.encode(), "text/plain")
                else:
                    self._send(status, _error_body(status, message))
                return
            if path not in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
                self._send(404, _error_body(404, f"no route POST {self.path}"))
                return
            if not isinstance(body, dict):
                self._send(400, _error_body(400, "request body must be a JSON object"))
                return
            if srv.status is not None:
                self._send(srv.status, _error_body(srv.status, "FakeOpenAI was told to fail"))
                return
            if srv.enable_lora and body.get("model") not in (srv.model, *srv.adapters):
                self._send(404, _error_body(404, f"The model `{body.get('model')}` does not exist."))
                return
            request = body
            if path == "/v1/responses":
                try:
                    body = chat_request(request)
                except ItemError as exc:
                    self._send(400, _error_body(400, str(exc), exc.field))
                    return
            with srv._lock:
                srv.answered += 1
            reply = srv._reply(body)
            spec: Mapping[str, Any] = {"content": reply} if isinstance(reply, str) else reply
            status = int(spec.get("status", 200))
            if "body" in spec:
                self._send(status, str(spec["body"]).encode())
                return
            if status >= 400:
                self._send(status, _error_body(status, str(spec.get("error", "scripted failure"))))
                return
            answer = srv._answer(spec, n)
            if path == "/v1/responses":
                self._send_response(request, body, answer, n)
            elif path == "/v1/completions":
                self._send(200, json.dumps(_completion_response(srv, body, answer.content or "", n)).encode())
            elif body.get("stream"):
                # the whole event stream in one write: the client still parses it chunk by chunk
                events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in _chat_chunks(srv, body, answer, n)]
                self._send(200, b"".join(events) + b"data: [DONE]\n\n", "text/event-stream")
            else:
                self._send(200, json.dumps(_chat_response(srv, body, answer, n)).encode())

    return Handler
