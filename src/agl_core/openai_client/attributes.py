"""OpenAI chat-completion requests, responses and stream chunks as GenAI span attributes.

Everything here runs on the call's hot path, so it reads the SDK's pydantic
objects field by field (no ``model_dump``), builds each attribute dict once and
JSON-encodes each message attribute once. Token ids come from vLLM's
``return_token_ids`` extension, which the SDK keeps as pydantic extra fields:
top-level ``prompt_token_ids`` and per-choice ``token_ids`` (per chunk when
streaming). Token ids and logprobs are taken from the first choice only: one
request is one transition.

The OpenTelemetry SDK re-checks every attribute value in Python, element by
element for sequences (about a microsecond per token id on a slow core, so
milliseconds for a long prompt). Everything built here is already a clean
attribute value (str, bool, int, float, or a tuple of one of those; token ids
are checked at C speed with one ``set(map(type, ...))``), so :func:`agl_core.encoding.set_on`
stores it in an SDK span's attribute dict directly, under the span's lock, when
the span is live and no span limit applies; any other span, or a span under
limits, gets a plain ``set_attributes``. The span starts with the few
attributes a sampler may look at (:func:`agl_core.encoding.sampler_attributes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from agl_core import semconv
from agl_core.encoding import MessageMemo, dumps, sampling_attributes
from agl_core.messages import as_dict, to_genai
from agl_core.openai_client import responses_items

Attributes = dict[str, Any]

_NUMBER = frozenset({int, float})
_DEFAULT_PORTS = {"https": 443, "http": 80}
_static: dict[int, tuple[Any, Attributes]] = {}  # id(base_url) -> (base_url, attributes common to its calls)


def _common(base_url: Any) -> Attributes:
    """The attributes every call through one client shares, cached per base-URL object (clients keep theirs)."""
    hit = _static.get(id(base_url))
    if hit is not None and hit[0] is base_url:
        return hit[1]
    attrs: Attributes = {
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.GEN_AI_PROVIDER_NAME: "openai",
        semconv.AGL_PLUGIN: "openai",
    }
    host = getattr(base_url, "host", None)
    port = getattr(base_url, "port", None) or _DEFAULT_PORTS.get(getattr(base_url, "scheme", None) or "")
    if isinstance(host, str) and host:
        attrs[semconv.SERVER_ADDRESS] = host
    if isinstance(port, int):
        attrs[semconv.SERVER_PORT] = port
    if len(_static) >= 64:
        _static.clear()
    _static[id(base_url)] = (base_url, attrs)
    return attrs


_FLAT = frozenset({str, type(None)})


def _flat_key(message: Any) -> tuple[tuple[str, Any], ...] | None:
    """The memo key of a message dict whose values are all strings (or None): its items; None for any other.

    Messages holding lists (content parts, tool calls) are converted every time.
    """
    return tuple(message.items()) if type(message) is dict and set(map(type, message.values())) <= _FLAT else None


def _message_json(message: Any) -> str:
    return dumps(to_genai(message))


input_messages_json = MessageMemo(_flat_key, _message_json).encode
"""``gen_ai.input.messages``: the same JSON as ``dumps(messages.many_to_genai(messages))``."""


def request_attributes(params: Mapping[str, Any], base_url: Any) -> Attributes:
    """The span's start attributes from ``create(**params)``; ``messages``/``tools`` must be re-iterable."""
    attrs = dict(_common(base_url))
    get = params.get
    attrs[semconv.GEN_AI_REQUEST_STREAM] = get("stream") is True
    model = get("model")
    if type(model) is str:
        attrs[semconv.GEN_AI_REQUEST_MODEL] = model
    sampling_attributes(params, attrs)
    messages = get("messages")
    if isinstance(messages, (list, tuple)):
        attrs[semconv.GEN_AI_INPUT_MESSAGES] = input_messages_json(messages)
    tools = get("tools")
    if isinstance(tools, (list, tuple)) and tools:
        attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = dumps(tools)
    return attrs


def _extra(obj: Any) -> dict[str, Any] | None:
    """A pydantic object's extra fields (where vLLM's additions land); None when it has none."""
    extra = getattr(obj, "model_extra", None)
    return extra if extra else None


_INT = frozenset({int})


def _int_list(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, (list, tuple)):
        return None
    ids = tuple(value)
    return ids if set(map(type, ids)) <= _INT else None


def _float_list(value: Any) -> tuple[float, ...] | None:
    if not isinstance(value, (list, tuple)):
        return None
    values = tuple(value)
    return tuple(map(float, values)) if set(map(type, values)) <= _NUMBER else None


def _tool_call(call: Any) -> dict[str, Any]:
    fn = getattr(call, "function", None)
    if fn is not None:
        return {"id": call.id, "function": {"name": fn.name, "arguments": fn.arguments}}
    custom = getattr(call, "custom", None)  # a custom (free-form) tool call carries `input`, not `arguments`
    if custom is not None:
        return {"id": call.id, "function": {"name": custom.name, "arguments": custom.input}}
    return {"id": getattr(call, "id", None), "function": {}}


def _message(message: Any) -> dict[str, Any]:
    """An SDK ``ChatCompletionMessage`` as a plain OpenAI message dict, without ``model_dump``."""
    out: dict[str, Any] = {"role": message.role or "assistant", "content": message.content}
    refusal = message.refusal
    if refusal and not message.content:
        out["content"] = [{"type": "refusal", "refusal": refusal}]
    calls = message.tool_calls
    if calls:
        out["tool_calls"] = [_tool_call(c) for c in calls]
    legacy = message.function_call
    if legacy is not None:
        out["function_call"] = {"name": legacy.name, "arguments": legacy.arguments}
    extra = _extra(message)
    if extra is not None:
        reasoning = extra.get("reasoning_content") or extra.get("reasoning")
        if reasoning:
            out["reasoning_content"] = reasoning
    return out


def _logprobs(logprobs: Any) -> list[float] | None:
    content = getattr(logprobs, "content", None) if logprobs is not None else None
    return [entry.logprob for entry in content] if content else None


def _token_attributes(attrs: Attributes, prompt_ids: Any, response_ids: Any, logprobs: Any) -> None:
    prompt = _int_list(prompt_ids)
    response = _int_list(response_ids)
    if prompt is not None:
        attrs[semconv.AGL_PROMPT_TOKEN_IDS] = prompt
    if response is not None:
        attrs[semconv.AGL_RESPONSE_TOKEN_IDS] = response
        values = _float_list(logprobs)
        if values is not None and len(values) == len(response):
            attrs[semconv.AGL_RESPONSE_LOGPROBS] = values
    if prompt is not None or response is not None:
        attrs[semconv.AGL_TOKEN_SOURCE] = "response"


def _usage(attrs: Attributes, usage: Any) -> None:
    if usage is not None:
        if usage.prompt_tokens is not None:
            attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = usage.prompt_tokens
        if usage.completion_tokens is not None:
            attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = usage.completion_tokens


def response_attributes(completion: Any) -> Attributes:
    """The span's end attributes from a ``ChatCompletion`` (or ``ParsedChatCompletion``)."""
    attrs: Attributes = {}
    if completion.model:
        attrs[semconv.GEN_AI_RESPONSE_MODEL] = completion.model
    if completion.id:
        attrs[semconv.GEN_AI_RESPONSE_ID] = completion.id
    _usage(attrs, completion.usage)
    choices = completion.choices or ()
    attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = tuple(c.finish_reason for c in choices if c.finish_reason)
    attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = dumps([to_genai(_message(c.message), c.finish_reason) for c in choices])
    extra = _extra(completion)
    first = choices[0] if choices else None
    choice_extra = _extra(first) if first is not None else None
    if extra is not None or choice_extra is not None:
        _token_attributes(attrs, extra.get("prompt_token_ids") if extra is not None else None,
                          choice_extra.get("token_ids") if choice_extra is not None else None,
                          _logprobs(first.logprobs) if first is not None else None)
    return attrs


class _Choice:
    """What the chunks of one streamed choice have said so far."""

    __slots__ = ("content", "reasoning", "calls", "finish_reason", "token_ids", "logprobs")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> {"id", "name", "arguments": [str]}
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []

    def add_calls(self, deltas: Iterable[Any]) -> None:
        for delta in deltas:
            call = self.calls.get(delta.index)
            if call is None:
                call = self.calls[delta.index] = {"id": None, "name": None, "arguments": []}
            if delta.id:
                call["id"] = delta.id
            fn = delta.function
            if fn is not None:
                if fn.name:
                    call["name"] = fn.name
                if fn.arguments:
                    call["arguments"].append(fn.arguments)

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant",
                               "content": "".join(self.content) if self.content or not self.calls else None}
        if self.calls:
            out["tool_calls"] = [{"id": c["id"], "function": {"name": c["name"], "arguments": "".join(c["arguments"])}}
                                 for _, c in sorted(self.calls.items())]
        if self.reasoning:
            out["reasoning_content"] = "".join(self.reasoning)
        return out


class StreamAccumulator:
    """Folds ``ChatCompletionChunk`` objects into the attributes a non-streamed response would give."""

    __slots__ = ("id", "model", "usage", "prompt_token_ids", "choices", "saw_token_ids")

    def __init__(self) -> None:
        self.id: str | None = None
        self.model: str | None = None
        self.usage: Any = None
        self.prompt_token_ids: Any = None
        self.choices: dict[int, _Choice] = {}
        self.saw_token_ids = False

    def add(self, chunk: Any) -> None:
        if self.id is None:
            self.id = chunk.id
            self.model = chunk.model
        if chunk.usage is not None:
            self.usage = chunk.usage
        extra = _extra(chunk)
        if extra is not None and "prompt_token_ids" in extra:
            self.prompt_token_ids = extra["prompt_token_ids"]
        for choice in chunk.choices:
            acc = self.choices.get(choice.index)
            if acc is None:
                acc = self.choices[choice.index] = _Choice()
            delta = choice.delta
            if delta is not None:
                if delta.content:
                    acc.content.append(delta.content)
                if delta.tool_calls:
                    acc.add_calls(delta.tool_calls)
                delta_extra = _extra(delta)
                if delta_extra is not None:
                    reasoning = delta_extra.get("reasoning_content") or delta_extra.get("reasoning")
                    if reasoning:
                        acc.reasoning.append(reasoning)
            if choice.finish_reason:
                acc.finish_reason = choice.finish_reason
            choice_extra = _extra(choice)
            if choice_extra is not None:
                ids = choice_extra.get("token_ids")
                if ids:
                    acc.token_ids.extend(ids)
                    self.saw_token_ids = True
                elif ids is not None:
                    self.saw_token_ids = True
            logprobs = _logprobs(choice.logprobs)
            if logprobs:
                acc.logprobs.extend(logprobs)

    def finished(self) -> bool:
        """Every choice seen has its ``finish_reason`` (and at least one choice was seen)."""
        return bool(self.choices) and all(c.finish_reason for c in self.choices.values())

    def attributes(self) -> Attributes:
        attrs: Attributes = {}
        if self.model:
            attrs[semconv.GEN_AI_RESPONSE_MODEL] = self.model
        if self.id:
            attrs[semconv.GEN_AI_RESPONSE_ID] = self.id
        _usage(attrs, self.usage)
        choices = [c for _, c in sorted(self.choices.items())]
        attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = tuple(c.finish_reason for c in choices if c.finish_reason)
        attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = dumps([to_genai(c.message(), c.finish_reason) for c in choices])
        first = choices[0] if choices else None
        response_ids = first.token_ids if first is not None and self.saw_token_ids else None
        logprobs = first.logprobs if first is not None and first.logprobs else None
        _token_attributes(attrs, self.prompt_token_ids, response_ids, logprobs)
        return attrs


# --------------------------------------------------------------------------- the Responses API
# A ``responses.create`` call is one chat request to the model: its span has the same GenAI attributes as a
# chat completion's, its input and output items written as the chat messages they stand for
# (:mod:`agl_core.openai_client.responses_items`), so the transition it becomes reads like any other.


def responses_request_attributes(params: Mapping[str, Any], base_url: Any) -> Attributes:
    """The span's start attributes from ``responses.create(**params)``; ``input``/``tools`` must be re-iterable."""
    attrs = dict(_common(base_url))
    get = params.get
    attrs[semconv.GEN_AI_REQUEST_STREAM] = get("stream") is True
    model = get("model")
    if type(model) is str:
        attrs[semconv.GEN_AI_REQUEST_MODEL] = model
    sampling_attributes(params, attrs)
    limit = get("max_output_tokens")
    if type(limit) is int:
        attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] = limit
    given = get("input")
    if isinstance(given, (str, list, tuple)):  # not the SDK's omit/NOT_GIVEN, which a framework may pass
        instructions = get("instructions")
        messages = responses_items.input_messages(given, instructions if isinstance(instructions, str) else None)
        attrs[semconv.GEN_AI_INPUT_MESSAGES] = input_messages_json(messages)
    tools = get("tools")
    if isinstance(tools, (list, tuple)) and tools:
        try:
            attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = dumps(responses_items.chat_tools(tools))
        except responses_items.ItemError:  # hosted tools: kept as given, for debugging
            attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = dumps([t if isinstance(t, dict) else as_dict(t) for t in tools])
    return attrs


def responses_response_attributes(response: Any) -> Attributes:
    """The span's end attributes from a Responses API ``Response`` (or ``ParsedResponse``)."""
    attrs: Attributes = {}
    if response.model:
        attrs[semconv.GEN_AI_RESPONSE_MODEL] = response.model
    if response.id:
        attrs[semconv.GEN_AI_RESPONSE_ID] = response.id
    usage = response.usage
    if usage is not None:
        if usage.input_tokens is not None:
            attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = usage.input_tokens
        if usage.output_tokens is not None:
            attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = usage.output_tokens
    details = response.incomplete_details
    message, finish = responses_items.output_message(response.output, response.status,
                                                     getattr(details, "reason", None))
    attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = (finish,)
    attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = dumps([to_genai(message, finish)])
    extra = _extra(response)
    if extra is not None:  # a server that returns token ids in the body (vLLM's return_token_ids, agl's gateway)
        _token_attributes(attrs, extra.get("prompt_token_ids"), extra.get("token_ids"), None)
    return attrs


_TERMINAL = frozenset({"response.completed", "response.incomplete"})


class ResponsesStreamAccumulator:
    """Folds Responses stream events: the terminal event's ``response`` is the whole answer.

    Until it comes, the finished output items and the text deltas are kept, so a stream that broke
    off still shows on its span what arrived.
    """

    __slots__ = ("response", "items", "text", "failed")

    def __init__(self) -> None:
        self.response: Any = None
        self.items: list[Any] = []
        self.text: list[str] = []
        self.failed = False

    def add(self, event: Any) -> None:
        kind = event.type
        if kind == "response.output_text.delta":
            self.text.append(event.delta)
        elif kind == "response.output_item.done":
            self.items.append(event.item)
        elif kind in _TERMINAL:
            self.response = event.response
        elif kind == "response.failed":
            self.failed = True

    def finished(self) -> bool:
        return self.response is not None

    def attributes(self) -> Attributes:
        if self.response is not None:
            return responses_response_attributes(self.response)
        message, _ = responses_items.output_message(self.items)
        if self.text and not message.get("content"):
            message["content"] = "".join(self.text)
        return {semconv.GEN_AI_OUTPUT_MESSAGES: dumps([to_genai(message)])}
