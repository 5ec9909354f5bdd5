"""Token ids from LiteLLM replies, for the plugins whose framework talks to its model through LiteLLM (the OpenAI
Agents SDK's ``LitellmModel``, CrewAI's LiteLLM fallback ``LLM``).

LiteLLM reaches an OpenAI-compatible server with the ``openai`` client's raw ``post`` (or its own HTTP client), so
agl's ``openai`` plugin never sees the reply, and the frameworks turn LiteLLM's reply into their own objects without
its token ids. LiteLLM keeps them, though: a vLLM-style server's ``prompt_token_ids`` (top level) and per-choice
``token_ids`` are on its ``ModelResponse`` (``prompt_token_ids``, ``choices[i].provider_specific_fields["token_ids"]``
and ``choices[i].token_ids``), and on its stream chunks (``token_ids`` per chunk; ``prompt_token_ids`` on the first
chunk where the route keeps it).

Hook: ``litellm.completion`` and ``litellm.acompletion``, which every caller looks up on the module at call time
(``litellm.completion(**params)``). The framework plugin's chat span is current while LiteLLM runs, so the reply's
token ids (and logprobs, when asked for) go on that span, with ``token_source="response"``; a stream's go on it
when the stream ends. Nothing is set on a span that is not an LLM span, or on one that has token ids already.

The functions are wrapped while at least one plugin holds them (:func:`hold` / :func:`release`), and only once
LiteLLM is imported: importing it here would run its import-time side effects (``load_dotenv``) in programs
that never use it, so :func:`ensure`, called by the plugins where an LLM call starts, wraps them the first time
a call finds LiteLLM loaded.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from agl_core import semconv
from agl_core.encoding import set_on
from agl_core.guard import report

_NAMES = ("completion", "acompletion")
_lock = threading.Lock()
_holders: set[int] = set()
_wrapped: dict[str, tuple[Any, Any]] = {}  # name -> (LiteLLM's own function, our wrapper)


def hold(owner: object) -> None:
    """``owner`` (a plugin) wants LiteLLM's token ids from now on."""
    with _lock:
        _holders.add(id(owner))
    ensure()


def release(owner: object) -> None:
    """``owner`` no longer does; the last one out puts LiteLLM's functions back."""
    with _lock:
        _holders.discard(id(owner))
        if _holders or not _wrapped:
            return
        module = sys.modules.get("litellm")
        for name, (original, wrapper) in _wrapped.items():
            if module is not None and getattr(module, name, None) is wrapper:
                setattr(module, name, original)
        _wrapped.clear()


def ensure() -> None:
    """Wrap LiteLLM's functions if a plugin holds them, LiteLLM is loaded and they are not wrapped yet."""
    if _wrapped or not _holders:
        return
    module = sys.modules.get("litellm")
    if module is None:
        return
    try:
        with _lock:
            if _wrapped or not _holders:
                return
            for name, make in (("completion", _wrap_sync), ("acompletion", _wrap_async)):
                original = getattr(module, name, None)
                if callable(original):
                    wrapper = make(original)
                    setattr(module, name, wrapper)
                    _wrapped[name] = (original, wrapper)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("litellm.wrap", exc)


# --------------------------------------------------------------------------- the wrappers


def _wrap_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def completion(*args: Any, **kwargs: Any) -> Any:
        span = _llm_span()
        return _observed(original(*args, **kwargs), span, bool(kwargs.get("stream")))

    return completion


def _wrap_async(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def acompletion(*args: Any, **kwargs: Any) -> Any:
        span = _llm_span()
        return _observed(await original(*args, **kwargs), span, bool(kwargs.get("stream")))

    return acompletion


def _observed(reply: Any, span: Any, stream: bool) -> Any:
    """What LiteLLM returned, its token ids put on ``span`` (a stream's as it is read)."""
    if span is None:
        return reply
    if stream:
        return _Stream(reply, span)
    _record(span, lambda: reply_attributes(reply))
    return reply


def _llm_span() -> Any:
    """The LLM span current where LiteLLM is called, if it is a live one without token ids."""
    try:
        from opentelemetry import trace

        span = trace.get_current_span()
        attrs = getattr(span, "attributes", None)
        if (not span.is_recording() or attrs is None
                or attrs.get(semconv.GEN_AI_OPERATION_NAME) not in semconv.LLM_OPERATIONS
                or attrs.get(semconv.AGL_RESPONSE_TOKEN_IDS) is not None):
            return None
        return span
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("litellm.span", exc)
        return None


def _record(span: Any, attrs: Callable[[], dict[str, Any]]) -> None:
    try:
        found = attrs()
        if found:
            set_on(span, found)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("litellm.token_ids", exc)


class _Stream:
    """LiteLLM's stream, passed on chunk by chunk; its token ids go on the span when it ends."""

    def __init__(self, stream: Any, span: Any) -> None:
        self._stream = stream
        self._span = span
        self._ids = _Chunks()
        self._done = False

    def __getattr__(self, name: str) -> Any:  # everything else is the stream's own
        return getattr(self._stream, name)

    def __iter__(self) -> Iterator[Any]:
        for chunk in self._stream:
            self._add(chunk)
            yield chunk
        self._end()

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for chunk in self._stream:
            self._add(chunk)
            yield chunk
        self._end()

    def __next__(self) -> Any:
        try:
            chunk = next(self._stream)
        except StopIteration:
            self._end()
            raise
        self._add(chunk)
        return chunk

    async def __anext__(self) -> Any:
        try:
            chunk = await self._stream.__anext__()
        except StopAsyncIteration:
            self._end()
            raise
        self._add(chunk)
        return chunk

    def _add(self, chunk: Any) -> None:
        try:
            self._ids.add(chunk)
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("litellm.stream_chunk", exc)

    def _end(self) -> None:
        if not self._done:
            self._done = True
            _record(self._span, self._ids.attributes)


# --------------------------------------------------------------------------- replies -> attributes


def _extra(obj: Any, name: str) -> Any:
    value = getattr(obj, name, None)
    if value is None:
        fields = getattr(obj, "provider_specific_fields", None)
        if isinstance(fields, dict):
            value = fields.get(name)
    return value


def _ints(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (list, tuple)) and value and set(map(type, value)) == {int}:
        return tuple(value)
    return None


def _logprobs(choice: Any) -> list[float]:
    content = getattr(getattr(choice, "logprobs", None), "content", None)
    return [entry.logprob for entry in content] if content else []


def _token_attributes(prompt: Any, response: Any, logprobs: list[float]) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    prompt_ids, response_ids = _ints(prompt), _ints(response)
    if prompt_ids is not None:
        attrs[semconv.AGL_PROMPT_TOKEN_IDS] = prompt_ids
    if response_ids is not None:
        attrs[semconv.AGL_RESPONSE_TOKEN_IDS] = response_ids
        if len(logprobs) == len(response_ids) and all(isinstance(v, float) for v in logprobs):
            attrs[semconv.AGL_RESPONSE_LOGPROBS] = tuple(logprobs)
    if attrs:
        attrs[semconv.AGL_TOKEN_SOURCE] = "response"
    return attrs


def reply_attributes(reply: Any) -> dict[str, Any]:
    """The token-id attributes of a LiteLLM ``ModelResponse`` (first choice: one request is one transition)."""
    choices = getattr(reply, "choices", None) or ()
    first = choices[0] if choices else None
    return _token_attributes(_extra(reply, "prompt_token_ids"),
                             _extra(first, "token_ids") if first is not None else None,
                             _logprobs(first) if first is not None else [])


class _Chunks:
    """What a stream's chunks said of the first choice's token ids."""

    def __init__(self) -> None:
        self.prompt: Any = None
        self.response: list[int] = []
        self.logprobs: list[float] = []
        self.saw_ids = False

    def add(self, chunk: Any) -> None:
        if self.prompt is None:
            self.prompt = _extra(chunk, "prompt_token_ids")
        for choice in getattr(chunk, "choices", None) or ():
            if getattr(choice, "index", 0) != 0:
                continue
            ids = _extra(choice, "token_ids")
            if isinstance(ids, list):
                self.saw_ids = True
                self.response.extend(ids)
            self.logprobs.extend(_logprobs(choice))

    def attributes(self) -> dict[str, Any]:
        return _token_attributes(self.prompt, self.response if self.saw_ids else None, self.logprobs)
