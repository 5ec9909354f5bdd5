"""The OpenAI-compatible gateway in front of the model being trained, recording exact token ids per call.

Routes: ``POST /v1/chat/completions`` (plain and streamed), ``POST /v1/completions``
(plain and streamed), ``GET /v1/models``; a call scoped to a rollout (``/rollouts/{id}/v1``, or
the ``X-Agl-Rollout-Id`` header) is also handed to its :class:`CallWatch`
(:mod:`agl_trainer.rollout_calls`). Behind it sits a :class:`Backend`: an
OpenAI-compatible server that returns token ids the way vLLM does
(:class:`OpenAIBackend`: ``vllm serve``, verl's async servers, agl's fake), or
the built-in torch engine (:mod:`agl_trainer.engine`).

An agent that goes away cancels its call: a dropped stream at once, a plain call
once it has run a fifth of a second (see ``_unless_gone``); the torch engine then
drops the call's rows, and an upstream server sees its connection closed (vLLM
aborts the request). Nothing is recorded for a call that did not finish.

Per call the gateway asks the backend for ``return_token_ids`` and
``logprobs``, and records the prompt token ids, the response token ids and
their logprobs under the request's W3C ``traceparent`` (see
:mod:`agl_trainer.token_records`), before the reply (or the stream's last
event) leaves. Streaming keeps the ids: they are read chunk by chunk.

**The rule for the agent's ``model`` and sampling fields**

- ``model``: the gateway serves one policy, the model being trained. With
  ``model_rule="override"`` (the default) the agent's ``model`` is replaced by
  the served model's name, whatever the agent asked for, and the reply names
  the served model, so spans and transitions say which model answered; the
  first call for each other name is said in one warning naming the fixes below.
  With ``"strict"`` a call for a model other than the served one is refused
  (404, naming the fixes). With ``"passthrough"`` the agent's ``model`` goes to
  the backend unchanged (a backend serving several models, or LoRA adapters by
  name).
- **Frozen models** (a judge, a checker, an answerer that is not trained):
  ``upstreams`` maps a model name to its own OpenAI base URL (``agl serve
  --upstream NAME=URL``). A call for that name is relayed there as the agent
  sent it, nothing is recorded for training, and its LLM span is marked
  ``agl.llm.frozen_model`` when the rollout is joined, so the builder leaves it
  out (``Trajectory.skipped`` says why). An agent can equally reach the policy
  through ``agl.policy()`` and leave ``OPENAI_BASE_URL`` to its other models.
- Sampling fields (``temperature``, ``top_p``, ``max_tokens``, ``seed``,
  ``stop``, ``n``, ...): the agent's values are honoured, since they are part of
  the agent's behaviour; ``sampling_defaults`` fill in what the agent left out;
  ``sampling_overrides`` replace what the agent said. Training runs pin
  :func:`training_sampling` there (``agl train``, ``agl serve --train-temperature``):
  the temperature the trainer computes its logprobs at, and no ``top_p``/``top_k``
  cut or penalty, so the recorded logprobs are of the distribution being trained.
- ``return_token_ids`` and ``logprobs`` are always asked of the backend; the
  agent's reply carries token ids and logprobs only when the agent asked for
  them itself, so the agent sees the reply it would get from the backend.
- With ``n > 1`` only the first choice is recorded: one request is one transition.
- **Several policies** (``policies``, a :class:`~agl_trainer.policies.PolicyRouter`): the call's
  ``X-Agl-Agent`` header (sent by agl's instrumented client) names its agent, and the call goes to
  the backend as ``model`` = that agent's policy (an adapter of the torch engine, a LoRA name of
  vLLM); an agent no policy serves goes to the base model. Either way the record says so, and the
  join writes it on the call's span (``agl.llm.policy``, or ``agl.llm.policy_note`` for the base).

**What is never recorded.** The backend's reply must be JSON a store can keep:
``NaN``/``Infinity`` anywhere or a lone surrogate in its text makes the reply a
502 naming the field; so do token ids that are not integers from 0 to
:data:`MAX_TOKEN_ID` and logprobs that are not finite numbers (vLLM itself
clamps ``-inf`` to ``-9999.0``). Nothing of such a call is recorded and the
agent sees the 502, so its rollout fails for the infrastructure and is retried,
rather than a bad value poisoning the rollout later.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
import time
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from agl_core.schema import ROLES
from agl_trainer.api import (
    DEFAULT_MAX_BODY_BYTES,
    ApiError,
    JsonProblem,
    error_body,
    parse_json,
    read_json,
    read_object,
)
from agl_trainer.token_records import TokenRecord, TokenRecords, parse_traceparent
from agl_trainer.upstream import Upstream

__all__ = ["AGENT_HEADER", "MAX_TOKEN_ID", "Backend", "BackendError", "BackendReply", "CallWatch", "Chunks", "Gateway",
           "GatewayConfig", "OpenAIBackend", "agent_from_header", "route_key", "sampling_mismatch",
           "training_sampling"]

logger = logging.getLogger("agl.trainer")

Endpoint = Literal["chat/completions", "completions"]
Chunks = AsyncGenerator[dict[str, Any], None]
"""A streamed reply: the JSON payloads of its ``data:`` events, before ``[DONE]``."""
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
MAX_TOKEN_ID = 2**31 - 1
"""The largest token id the gateway records (no vocabulary comes near it; a bigger one is a broken reply)."""
AGENT_HEADER = "x-agl-agent"
"""The header in which agl's instrumented client names the agent scope of a call (percent-encoded)."""
route_key: contextvars.ContextVar[str | None] = contextvars.ContextVar("agl_route_key", default=None)
"""The trace id of the call the backend is answering (None: it sent no ``traceparent``): one per rollout,
so a backend over several replicas (:class:`~agl_trainer.replicas.ReplicaBackend`) keeps a rollout on one."""


# --------------------------------------------------------------------------- backends


@dataclass
class BackendReply:
    """A backend's whole answer: its status and its JSON body (or its text, when it was not JSON)."""

    status: int
    data: Any = None
    text: str = ""


class BackendError(Exception):
    """The backend failed: unreachable, timed out, or broke off a stream. ``status`` is what the agent gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Backend(Protocol):
    """What answers the gateway's calls; replies carry token ids the way vLLM's do."""

    async def complete(self, endpoint: Endpoint, body: dict[str, Any]) -> BackendReply:
        """One non-streamed call; raises :class:`BackendError` when there is no answer at all."""
        ...

    async def stream(self, endpoint: Endpoint, body: dict[str, Any]) -> BackendReply | Chunks:
        """A streamed call: its chunks (the ``data:`` payloads before ``[DONE]``), or the error reply."""
        ...

    async def models(self) -> list[str]:
        """The names of the models the backend serves."""
        ...

    async def update_weights(self, weights: str | None, version: int) -> None:
        """New weights were published (``weights`` names where they are); swap them in, or do nothing."""
        ...

    async def aclose(self) -> None: ...


class OpenAIBackend:
    """An OpenAI-compatible server at ``base_url`` (ending in ``/v1``), such as ``vllm serve``.

    Calls go over :class:`~agl_trainer.upstream.Upstream`'s keep-alive connections. The server's
    weights are its own business (verl syncs vLLM's weights itself), so :meth:`update_weights`
    only lets the gateway note the version.
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout_s: float = 600.0,
                 max_connections: int = 512) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._upstream = Upstream(self.base_url, headers, timeout_s=timeout_s, max_idle=max_connections)

    def _fail(self, exc: BaseException) -> BackendError:
        if isinstance(exc, TimeoutError):
            return BackendError(504, f"the model backend at {self.base_url} did not answer within "
                                     f"{self.timeout_s:g} s")
        return BackendError(502, f"the model backend at {self.base_url} could not be reached: "
                                 f"{type(exc).__name__}: {exc}")

    async def complete(self, endpoint: Endpoint, body: dict[str, Any]) -> BackendReply:
        try:
            status, raw = await self._upstream.request("POST", f"/{endpoint}", _dumps(body).encode())
        except (OSError, ValueError) as exc:
            raise self._fail(exc) from exc
        return _reply(status, raw)

    async def stream(self, endpoint: Endpoint, body: dict[str, Any]) -> BackendReply | Chunks:
        try:
            response, pieces = await self._upstream.open("POST", f"/{endpoint}", _dumps(body).encode())
            if response.status != 200:
                raw = b"".join([piece async for piece in pieces])
                return _reply(response.status, raw)
        except (OSError, ValueError) as exc:
            raise self._fail(exc) from exc
        return self._chunks(pieces)

    async def _chunks(self, pieces: AsyncGenerator[bytes, None]) -> Chunks:
        pending = b""
        try:
            async for data in pieces:
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, event: lines
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        async for _ in pieces:  # read to the end, so the connection can be reused
                            pass
                        return
                    yield _event(payload)
            raise BackendError(502, "the model backend's stream ended without [DONE]")
        except (OSError, ValueError) as exc:
            raise self._fail(exc) from exc
        finally:
            await pieces.aclose()

    async def models(self) -> list[str]:
        try:
            reply = _reply(*(await self._upstream.request("GET", "/models")))
        except (OSError, ValueError) as exc:
            raise self._fail(exc) from exc
        data = reply.data.get("data") if isinstance(reply.data, dict) else None
        if reply.status != 200 or not isinstance(data, list):
            raise BackendError(502, f"the model backend's /models answered {reply.status}: {reply.text[:200]}")
        return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]

    async def update_weights(self, weights: str | None, version: int) -> None:
        return None

    async def aclose(self) -> None:
        await self._upstream.aclose()


def _event(payload: bytes) -> dict[str, Any]:
    """One SSE ``data:`` payload of a stream, or the error it reports."""
    try:
        chunk = parse_json(payload)
    except JsonProblem as exc:
        raise BackendError(502, f"the model backend sent a stream event that is refused: {exc} "
                                "(nothing was recorded)") from None
    except ValueError:
        raise BackendError(502, f"the model backend sent a stream event that is not JSON: {payload[:200]!r}") from None
    if not isinstance(chunk, dict):
        raise BackendError(502, f"the model backend sent a stream event that is not an object: {payload[:200]!r}")
    if "error" in chunk and "choices" not in chunk:
        error = chunk["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise BackendError(502, f"the model backend failed mid-stream: {message}")
    return chunk


def _reply(status: int, raw: bytes) -> BackendReply:
    try:
        return BackendReply(status, parse_json(raw), "")
    except JsonProblem as exc:
        if 200 <= status < 300:
            raise BackendError(502, f"the model backend's reply is refused: {exc} (nothing was recorded)") from None
        return BackendReply(status, None, raw.decode("utf-8", "replace"))
    except ValueError:
        return BackendReply(status, None, raw.decode("utf-8", "replace"))


# --------------------------------------------------------------------------- the rule


@dataclass
class GatewayConfig:
    """How the gateway treats the agent's requests; see the module docstring for the rule."""

    served_model: str | None = None
    """The name the policy is served under; None: the backend's first model."""
    model_rule: Literal["override", "strict", "passthrough"] = "override"
    upstreams: dict[str, str] = field(default_factory=dict)
    """Frozen models by the name the agent calls them: ``{model: OpenAI base URL}``; relayed there, never trained."""
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    ask_token_ids: bool = True
    """Ask the backend for ``return_token_ids`` (vLLM >= 0.10.2, the torch engine); off for others."""
    policies: Any = None
    """A :class:`~agl_trainer.policies.PolicyRouter`: each call answered by its agent's policy; None: one policy."""

    def __post_init__(self) -> None:
        if self.model_rule not in ("override", "strict", "passthrough"):
            raise ValueError(f"model_rule must be 'override', 'strict' or 'passthrough', got {self.model_rule!r}")
        for name, url in self.upstreams.items():
            if not isinstance(name, str) or not name or not isinstance(url, str) or \
                    not url.startswith(("http://", "https://")):
                raise ValueError(f"upstreams maps a model name to an http(s):// base URL, got {name!r}: {url!r}")
        for name in ("sampling_defaults", "sampling_overrides"):
            for key in getattr(self, name):
                if key in _NOT_SAMPLING:
                    raise ValueError(f"{name} may not set {key!r}: it is not a sampling field")


def training_sampling(temperature: float) -> dict[str, Any]:
    """The sampling overrides of a training run: the policy samples from ``softmax(logits / temperature)``.

    That is the distribution a trainer can compute logprobs of (:func:`agl_trainer.loss.token_logprobs`),
    so whatever the agent asks, the gateway pins every other field that reshapes it: no ``top_p`` or
    ``top_k`` cut, no ``min_p``, no penalties (a value the model's own generation config would fill in
    on vLLM too). ``top_k`` -1 is "off" for vLLM and the torch engine alike.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"a training run samples at a temperature above 0, got {temperature!r}")
    return {"temperature": float(temperature), "top_p": 1.0, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def sampling_mismatch(overrides: Mapping[str, Any], temperature: float) -> list[str]:
    """The fields of :func:`training_sampling` that ``overrides`` (a gateway's) does not pin as training needs."""
    wanted = training_sampling(temperature)
    return [key for key, value in wanted.items() if overrides.get(key) != value]


def wants_logprobs(value: Any) -> bool:
    """Whether a request's ``logprobs`` asks for any: ``true``, or a count (text completions; 0 included)."""
    return value is not None and value is not False


_NOT_SAMPLING = frozenset({"messages", "prompt", "model", "stream", "tools", "tool_choice", "return_token_ids"})


# --------------------------------------------------------------------------- validation


def agent_from_header(value: str | None) -> str | None:
    """The agent an ``X-Agl-Agent`` header value names (percent-decoded); None when absent or empty."""
    if not value:
        return None
    return urllib.parse.unquote(value).strip() or None


def _check_type(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], what: str) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be {what}, got {json.dumps(value)[:80]}", name)


def _check_common(body: Mapping[str, Any]) -> None:
    _check_type(body, "model", (str,), "a string")
    _check_type(body, "stream", (bool,), "true or false")
    _check_type(body, "return_token_ids", (bool,), "true or false")
    _check_type(body, "stream_options", (dict,), "an object")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _check_type(body, name, (int, float), "a number")
    for name in ("max_tokens", "max_completion_tokens", "n", "seed", "top_k"):
        _check_type(body, name, (int,), "an integer")
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(name)
        if value is not None and value < 1:
            raise ApiError(400, f"'{name}' must be 1 or more, got {value}", name)
    temperature = body.get("temperature")
    if temperature is not None and temperature < 0:
        raise ApiError(400, f"'temperature' must be 0 or more, got {temperature}", "temperature")
    top_p = body.get("top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and (
            not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop")


def check_chat(body: Mapping[str, Any]) -> None:
    """Reject a malformed chat request with a 400 naming the field."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array of messages", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"'messages[{i}]' must be an object", f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a dict or list role is unhashable
            raise ApiError(400, f"'messages[{i}].role' must be one of {', '.join(sorted(ROLES))}, got "
                                f"{json.dumps(role)[:40]}", f"messages[{i}].role")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ApiError(400, f"'messages[{i}].content' must be a string, an array of parts or null",
                           f"messages[{i}].content")
        calls = message.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ApiError(400, f"'messages[{i}].tool_calls' must be an array", f"messages[{i}].tool_calls")
    _check_type(body, "logprobs", (bool,), "true or false")
    _check_type(body, "top_logprobs", (int,), "an integer")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ApiError(400, "'tools' must be an array of tool objects", "tools")
    _check_common(body)


def check_completion(body: Mapping[str, Any]) -> None:
    """Reject a malformed text-completion request with a 400 naming the field."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "'prompt' is required", "prompt")
    ok = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt))
    if not ok:
        raise ApiError(400, "'prompt' must be a string or an array of token ids (one prompt per request)", "prompt")
    if isinstance(prompt, list) and not 0 <= min(prompt) <= max(prompt) <= MAX_TOKEN_ID:
        i = next(i for i, t in enumerate(prompt) if not 0 <= t <= MAX_TOKEN_ID)
        raise ApiError(400, f"'prompt[{i}]' is {prompt[i]}: a token id is an integer from 0 to {MAX_TOKEN_ID}",
                       f"prompt[{i}]")
    _check_type(body, "logprobs", (int,), "an integer (how many top logprobs)")
    _check_type(body, "echo", (bool,), "true or false")
    _check_common(body)


# --------------------------------------------------------------------------- token ids in replies


def _logprob_values(logprobs: Any, endpoint: Endpoint) -> list[Any] | None:
    if not isinstance(logprobs, dict):
        return None
    if endpoint == "chat/completions":
        content = logprobs.get("content")
        if isinstance(content, list):
            return [entry.get("logprob") for entry in content if isinstance(entry, dict)]
        return None
    values = logprobs.get("token_logprobs")
    return list(values) if isinstance(values, list) else None


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(type(v) is int for v in value):
        return value
    return None


def _token_ids(value: Any, field: str) -> list[int] | None:
    """A reply's token id list, or None when it has none; BackendError naming the id out of range."""
    ids = _int_list(value)
    if ids and not 0 <= min(ids) <= max(ids) <= MAX_TOKEN_ID:
        i = next(i for i, t in enumerate(ids) if not 0 <= t <= MAX_TOKEN_ID)
        raise BackendError(502, f"the model backend's reply is refused: {field}[{i}] is {ids[i]}, not a token id "
                                f"(an integer from 0 to {MAX_TOKEN_ID}); nothing was recorded")
    return ids


def _check_logprobs(values: list[Any], endpoint: Endpoint, field: str) -> None:
    """BackendError naming the first logprob that is NaN or infinite (the sum is a cheap test for all)."""
    try:
        if math.isfinite(sum(values)):
            return
    except TypeError:  # a missing logprob: the record keeps none (see _Ids.record), which is no wrong value
        pass
    for i, v in enumerate(values):
        if isinstance(v, float) and not math.isfinite(v):
            where = f"{field}.logprobs.content[{i}].logprob" if endpoint == "chat/completions" \
                else f"{field}.logprobs.token_logprobs[{i}]"
            raise BackendError(502, f"the model backend's reply is refused: {where} is {v!r}, not a finite "
                                    "logprob; nothing was recorded")


class _Ids:
    """The ids of one call, folded from a reply or from stream chunks (first choice only)."""

    __slots__ = ("endpoint", "prompt", "response", "logprobs", "saw_response")

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.prompt: list[int] | None = None
        self.response: list[int] = []
        self.logprobs: list[float] | None = []
        self.saw_response = False

    def add(self, data: dict[str, Any]) -> None:
        prompt = data.get("prompt_token_ids")
        choices = data.get("choices")
        first = None
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict) and choice.get("index", 0) == 0:
                    first = choice
                    break
        where = f"choices[{choices.index(first)}]" if first is not None and isinstance(choices, list) else ""
        if first is not None and prompt is None:
            prompt = first.get("prompt_token_ids")  # where text completions put it
            field = f"{where}.prompt_token_ids"
        else:
            field = "prompt_token_ids"
        if prompt is not None and self.prompt is None:
            self.prompt = _token_ids(prompt, field)
        if first is None:
            return
        ids = _token_ids(first.get("token_ids"), f"{where}.token_ids")
        if ids is not None:
            self.saw_response = True
            self.response.extend(ids)
            values = _logprob_values(first.get("logprobs"), self.endpoint)
            if values:
                _check_logprobs(values, self.endpoint, where)
            if values is not None and self.logprobs is not None and len(values) == len(ids):
                self.logprobs.extend(values)
            elif ids:
                self.logprobs = None  # a chunk's logprobs did not line up with its ids: keep none rather than wrong

    def record(self, model: str | None, version: int, route: Any = None) -> TokenRecord | None:
        if self.prompt is None or not self.saw_response:
            return None
        logprobs = self.logprobs
        if logprobs is not None and (len(logprobs) != len(self.response)
                                     or not all(isinstance(v, (int, float)) for v in logprobs)):
            logprobs = None
        record = TokenRecord(self.prompt, self.response, logprobs, model, version, time.time())
        if route is not None:
            record.policy, record.policy_note = route.policy, route.note
        return record


def _strip(data: dict[str, Any], keep_ids: bool, keep_logprobs: bool) -> None:
    """Take out of a reply (or chunk) the token ids and logprobs that the gateway, not the agent, asked for."""
    if not keep_ids:
        data.pop("prompt_token_ids", None)
    choices = data.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                if not keep_ids:
                    choice.pop("token_ids", None)
                    choice.pop("prompt_token_ids", None)
                if not keep_logprobs and "logprobs" in choice:
                    choice["logprobs"] = None


# --------------------------------------------------------------------------- the gateway


class CallWatch(Protocol):
    """What keeps a rollout-scoped call (:mod:`agl_trainer.rollout_calls`): fed its reply or chunks, then its record."""

    rollout_id: str

    def add(self, data: dict[str, Any]) -> None: ...

    def done(self, record: TokenRecord | None) -> None: ...


Capture = Callable[[Request, Endpoint, dict[str, Any], Any], Awaitable[CallWatch | None]]


class Gateway:
    """The gateway's routes over one backend, recording into ``records``."""

    def __init__(self, backend: Backend, records: TokenRecords, config: GatewayConfig | None = None, *,
                 model_version: Callable[[], int] = lambda: 0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.backend = backend
        self.records = records
        self.config = config or GatewayConfig()
        self.max_body_bytes = max_body_bytes
        self.model_version = model_version
        self._served: str | None = self.config.served_model
        self._frozen = {name: OpenAIBackend(url) for name, url in self.config.upstreams.items()}
        self._overridden: set[str] = set()  # model names already said to be answered by the policy
        self.calls = 0
        self.frozen_calls = 0
        self.recorded = 0
        self.abandoned = 0  # calls whose agent went away before the answer
        self.capture: Capture | None = None
        """Per policy call: its :class:`CallWatch` when it is scoped to a rollout (the server sets it), else None."""

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
        ]

    async def served_model(self) -> str:
        if self._served is None:
            names = await self.backend.models()
            if not names:
                raise BackendError(502, "the model backend serves no model")
            self._served = names[0]
        return self._served

    async def list_models(self, request: Request) -> Response:
        try:
            name = await self.served_model()
        except BackendError as exc:
            raise ApiError(exc.status, exc.message) from None
        data = {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "agl",
                                            "agl_model_version": self.model_version()}]}
        return Response(_dumps(data), media_type="application/json")

    async def chat_completions(self, request: Request) -> Response:
        body = read_object(await read_json(request, self.max_body_bytes))
        check_chat(body)
        return await self._call(request, "chat/completions", body)

    async def completions(self, request: Request) -> Response:
        body = read_object(await read_json(request, self.max_body_bytes))
        check_completion(body)
        return await self._call(request, "completions", body)

    async def aclose(self) -> None:
        """Close the connections to the frozen models' upstreams (the backend is its owner's to close)."""
        for frozen in self._frozen.values():
            await frozen.aclose()

    async def _upstream(self, endpoint: Endpoint, body: dict[str, Any], policy: str | None = None
                        ) -> dict[str, Any]:
        config = self.config
        upstream = {**config.sampling_defaults, **body, **config.sampling_overrides} \
            if config.sampling_defaults or config.sampling_overrides else dict(body)
        if policy is not None:
            upstream["model"] = policy  # the agent's policy: its adapter (torch engine) or LoRA name (vLLM)
        elif config.model_rule != "passthrough" or "model" not in upstream:
            served = await self.served_model()
            asked = body.get("model")
            if asked is not None and asked != served:
                self._not_the_policy(asked, served)
            upstream["model"] = served
        if config.ask_token_ids:
            upstream["return_token_ids"] = True
        if endpoint == "chat/completions":
            upstream["logprobs"] = True
        elif upstream.get("logprobs") is None:
            upstream["logprobs"] = 0  # text completions: the sampled tokens' logprobs, no alternatives
        return upstream

    def _not_the_policy(self, asked: str, served: str) -> None:
        """A call named a model other than the policy: refused (``strict``), or said once per name (``override``)."""
        fixes = (f"if {asked!r} is a frozen model, give it its own upstream (agl serve --upstream {asked}=URL: "
                 f"relayed there, never trained), or have the agent reach the policy through agl.policy() and run "
                 f"agl worker --no-gateway-env so OPENAI_BASE_URL stays with its other models")
        if self.config.model_rule == "strict":
            raise ApiError(404, f"model {asked!r} is not the policy this gateway trains ({served!r}); {fixes}; "
                                f"or call the policy {served!r}", "model")
        if asked not in self._overridden and len(self._overridden) < 64:
            self._overridden.add(asked)
            logger.warning("agl gateway: calls for model %r are answered by the policy %r and trained "
                           "(--model-rule override); %s; --model-rule strict refuses them", asked, served, fixes)

    async def _call(self, request: Request, endpoint: Endpoint, body: dict[str, Any]) -> Response:
        self.calls += 1
        key = parse_traceparent(request.headers.get("traceparent"))
        if self._frozen:
            frozen = self._frozen.get(body.get("model"))  # type: ignore[arg-type]
            if frozen is not None:
                return await self._relay_frozen(request, frozen, endpoint, body, key)
        watch = await self.capture(request, endpoint, body, key) if self.capture is not None else None
        if key is None and watch is None:
            self.records.unkeyed += 1
        # this request's own context: Starlette's task
        route_key.set(key[0] if key is not None else watch.rollout_id if watch is not None else None)
        keep_ids = body.get("return_token_ids") is True
        keep_logprobs = wants_logprobs(body.get("logprobs"))
        route = None
        if self.config.policies is not None:
            route = self.config.policies.route(agent_from_header(request.headers.get(AGENT_HEADER)))
        try:
            upstream = await self._upstream(endpoint, body, route.policy if route is not None else None)
            if body.get("stream") is True:
                opened = await self.backend.stream(endpoint, upstream)
                if isinstance(opened, BackendReply):
                    return _relay_error(opened)
                return StreamingResponse(self._events(opened, endpoint, key, keep_ids, keep_logprobs, watch, route),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            reply = await _unless_gone(request, self.backend.complete(endpoint, upstream))
        except BackendError as exc:
            raise ApiError(exc.status, exc.message) from None
        if reply is None:
            self.abandoned += 1
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        if reply.status != 200 or not isinstance(reply.data, dict):
            return _relay_error(reply)
        data = reply.data
        ids = _Ids(endpoint)
        try:
            ids.add(data)  # before anything is recorded or answered: a bad value is a 502, never a record
            if watch is not None:
                watch.add(data)
            if not (keep_ids and keep_logprobs):
                _strip(data, keep_ids, keep_logprobs)
            answer = _dumps(data)
        except BackendError as exc:
            raise ApiError(exc.status, exc.message) from None
        except ValueError as exc:  # a backend in this process (the engine) answered a value JSON cannot carry
            raise ApiError(502, f"the model backend's reply is refused: {exc} (nothing was recorded)") from None
        self._keep(ids, data.get("model"), key, watch, route)
        return Response(answer, media_type="application/json")

    def _keep(self, ids: _Ids, model: str | None, key: Any, watch: CallWatch | None, route: Any = None) -> None:
        """Record an answered call's ids under its traceparent (with the policy that answered it, when there are
        several), and hand the call to its rollout's watch."""
        if key is None and watch is None:
            return
        record = ids.record(model, self.model_version(), route)
        if key is not None and record is not None:
            self.records.put(key, record)
            self.recorded += 1
        if watch is not None:
            watch.done(record)

    async def _relay_frozen(self, request: Request, frozen: OpenAIBackend, endpoint: Endpoint,
                            body: dict[str, Any], key: Any) -> Response:
        """A frozen model's call: to its upstream as sent, its answer back as it came, marked so it is not trained."""
        self.frozen_calls += 1
        name = str(body["model"])
        try:
            if body.get("stream") is True:
                opened = await frozen.stream(endpoint, body)
                if isinstance(opened, BackendReply):
                    return _relay_error(opened)
                return StreamingResponse(self._frozen_events(opened, key, name), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            reply = await _unless_gone(request, frozen.complete(endpoint, body))
        except BackendError as exc:
            raise ApiError(exc.status, exc.message) from None
        if reply is None:
            return Response(status_code=499)
        if reply.status != 200 or not isinstance(reply.data, dict):
            return _relay_error(reply)
        self._mark_frozen(key, name)
        return Response(_dumps(reply.data), media_type="application/json")

    async def _frozen_events(self, chunks: Chunks, key: Any, name: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield b"data: " + _dumps(chunk).encode() + b"\n\n"
        except BackendError as exc:
            yield b"data: " + _dumps(error_body(exc.status, exc.message)).encode() + b"\n\n"
            return
        finally:
            await chunks.aclose()
        self._mark_frozen(key, name)
        yield b"data: [DONE]\n\n"

    def _mark_frozen(self, key: Any, name: str) -> None:
        """Record that this call was a frozen model's: the join marks its span, and the builder leaves it out."""
        if key is not None:
            self.records.put(key, TokenRecord([], [], None, name, self.model_version(), time.time(), frozen=name))

    async def _events(self, chunks: Chunks, endpoint: Endpoint, key: Any,
                      keep_ids: bool, keep_logprobs: bool, watch: CallWatch | None = None,
                      route: Any = None) -> AsyncIterator[bytes]:
        ids = _Ids(endpoint)
        model = None
        try:
            async for chunk in chunks:
                if not isinstance(chunk, dict):
                    continue
                ids.add(chunk)
                if watch is not None:
                    watch.add(chunk)
                model = model or chunk.get("model")
                if not (keep_ids and keep_logprobs):
                    _strip(chunk, keep_ids, keep_logprobs)
                try:
                    event = _dumps(chunk).encode()
                except ValueError as exc:  # a backend in this process answered a value JSON cannot carry
                    raise BackendError(502, f"the model backend's stream is refused: {exc} (nothing was recorded)"
                                       ) from None
                yield b"data: " + event + b"\n\n"
        except BackendError as exc:
            # the agent's client raises on an error event: its rollout fails with this reason
            yield b"data: " + _dumps(error_body(exc.status, exc.message)).encode() + b"\n\n"
            return
        finally:
            await chunks.aclose()
        self._keep(ids, model, key, watch, route)  # before [DONE]: the rollout may be posted right after it
        yield b"data: [DONE]\n\n"


_WATCH_AFTER_S = 0.2
"""How long a plain call runs before the gateway starts watching for its agent to go away."""


async def _unless_gone(request: Request, call: Awaitable[BackendReply]) -> BackendReply | None:
    """The backend's reply; None when the agent disconnected first, and then the call is cancelled.

    Cancelling is what frees the model: the torch engine drops the call's rows, and an upstream
    server (vLLM) sees its connection closed and aborts the request. The watch starts only once
    the call has run ``_WATCH_AFTER_S`` (a timer costs a few microseconds, a watching task tens,
    and most calls are over by then); a disconnect that came earlier is seen at once then.
    Streams need none of this: Starlette already cancels a stream whose client went away.
    """
    task = asyncio.current_task()
    gone = False
    watcher: asyncio.Task[None] | None = None

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        if task is not None:
            task.cancel()

    def start() -> None:
        nonlocal watcher
        watcher = asyncio.ensure_future(watch())

    timer = asyncio.get_running_loop().call_later(_WATCH_AFTER_S, start)
    try:
        return await call
    except asyncio.CancelledError:
        if not gone:
            raise
        if task is not None:
            task.uncancel()
        return None
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()


def _relay_error(reply: BackendReply) -> Response:
    """A backend's own 4xx goes to the agent as it came; anything else is the backend's failure (502)."""
    if 400 <= reply.status < 500 and isinstance(reply.data, dict):
        return Response(_dumps(reply.data), status_code=reply.status, media_type="application/json")
    detail = reply.data.get("error") if isinstance(reply.data, dict) else None
    message = detail.get("message") if isinstance(detail, dict) else (detail or reply.text[:300])
    if reply.status == 200:
        return Response(_dumps(error_body(502, f"the model backend answered something that is not a JSON object: "
                                               f"{reply.text[:200]!r}")), status_code=502,
                        media_type="application/json")
    status = reply.status if 400 <= reply.status < 500 else 502
    return Response(_dumps(error_body(status, f"the model backend answered {reply.status}: {message}")),
                    status_code=status, media_type="application/json")
