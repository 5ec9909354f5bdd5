"""LangChain callback payloads as GenAI span attributes: chat-model runs, tool runs, agent scopes.

LangChain hands a callback handler its own objects: ``BaseMessage`` lists for a
chat model's input, an ``LLMResult`` of ``ChatGeneration`` s for its output, the
``invocation_params`` dict the model built for the call, and the standard
``ls_*`` metadata (``ls_provider``, ``ls_model_name``, ``ls_temperature``, ...)
that every chat model adds to its run. Transitions carry OpenAI chat messages,
so :func:`openai_message` turns a LangChain message into one (tool calls with
their raw argument string when the provider kept it, ``invalid_tool_calls``
as tool calls whose arguments do not parse, so AIR's malformed-call rule sees
them), and the shared converter makes the GenAI parts format of that.

Everything here runs on the call's hot path: messages are read field by field
(no ``model_dump``), each attribute dict is built once, each JSON attribute is
encoded once, and the input messages go through the ``openai`` plugin's memo
of messages already seen (an agent re-sends its whole conversation on every
call). Values are clean attribute values, so
:func:`agl_core.encoding.set_on` stores them directly.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from agl_core import semconv
from agl_core.encoding import MessageMemo, dumps
from agl_core.messages import to_genai

Attributes = dict[str, Any]
Message = dict[str, Any]

PLUGIN = "langchain"

_ROLES = {
    "human": "user",
    "ai": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "function",
    "developer": "developer",
    "HumanMessageChunk": "user",
    "AIMessageChunk": "assistant",
    "SystemMessageChunk": "system",
    "ToolMessageChunk": "tool",
    "FunctionMessageChunk": "function",
}

# invocation parameters that have a GenAI attribute of their own, or are not parameters of the request
_NOT_PARAMS = frozenset({"tools", "_type", "stop", "stream", "callbacks", "model", "model_name"})
_NUMBER_PARAMS = {"temperature": semconv.GEN_AI_REQUEST_TEMPERATURE, "top_p": semconv.GEN_AI_REQUEST_TOP_P}


# --------------------------------------------------------------------------- messages


def _make_spaced() -> Callable[[Any], str]:
    """``json.dumps(value, ensure_ascii=False)``, with its C encoder built once instead of on every call."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is not None:
        try:
            c_encode = make(None, None, json.encoder.encode_basestring, None, ": ", ", ", False, False, True)
        except Exception:  # noqa: BLE001 - another Python's private signature: the public path works too
            c_encode = None
        if c_encode is not None:
            return lambda value: "".join(c_encode(value, 0))
    return functools.partial(json.dumps, ensure_ascii=False)


_spaced = _make_spaced()


def _arguments(args: Any) -> str:
    """Parsed tool-call arguments as text, written as LangChain's OpenAI converters write them back to the model
    (``json.dumps(args, ensure_ascii=False)``), so a call's response reads as the next call's prompt repeats it."""
    if isinstance(args, str):
        return args
    try:
        return _spaced(args if args is not None else {})
    except (TypeError, ValueError):
        return dumps(args)


def _tool_calls(message: Any) -> list[dict[str, Any]] | None:
    """The message's tool calls in OpenAI format; raw argument strings when the provider kept them."""
    calls = getattr(message, "tool_calls", None) or ()
    invalid = getattr(message, "invalid_tool_calls", None) or ()
    if not calls and not invalid:
        return None
    raw = message.additional_kwargs.get("tool_calls") if message.additional_kwargs else None
    raw_args: dict[Any, Any] = {}
    if isinstance(raw, list):
        for item in raw:
            fn = item.get("function") if isinstance(item, Mapping) else None
            if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
                raw_args[item.get("id")] = fn["arguments"]
    out = []
    for call in calls:
        call_id = call.get("id")
        arguments = raw_args.get(call_id) if call_id in raw_args else _arguments(call.get("args"))
        out.append({"id": call_id, "type": "function", "function": {"name": call.get("name"), "arguments": arguments}})
    for call in invalid:  # a call whose arguments did not parse: kept verbatim, so AIR can see it is malformed
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": call.get("name"), "arguments": _arguments(call.get("args"))}})
    return out


def openai_message(message: Any) -> Message:
    """One LangChain message (``BaseMessage`` or a plain dict) as an OpenAI chat message."""
    if isinstance(message, Mapping):
        return dict(message)
    kind = message.type
    role = message.role if kind == "chat" else _ROLES.get(kind, kind)
    out: Message = {"role": role, "content": message.content}
    if message.name:
        out["name"] = message.name
    if role == "tool":
        out["tool_call_id"] = getattr(message, "tool_call_id", None)
    elif role == "assistant":
        calls = _tool_calls(message)
        if calls is not None:
            out["tool_calls"] = calls
            if out["content"] == "":
                out["content"] = None  # as OpenAI (and ChatOpenAI's request) has it for a tool-calls-only message
        extra = message.additional_kwargs
        if extra:
            reasoning = extra.get("reasoning_content") or extra.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                out["reasoning_content"] = reasoning
    elif role == "system" and message.additional_kwargs.get("__openai_role__") == "developer":
        out["role"] = "developer"
    return out


def input_messages(messages: Iterable[Any]) -> list[Message]:
    return [openai_message(m) for m in messages]


def _plain_key(message: Any) -> tuple[Any, ...] | None:
    """The memo key of a message whose JSON depends on its type, text and ids only; None for any other.

    Fields are read by type: a missing attribute on a pydantic message costs an exception.
    """
    if isinstance(message, Mapping):
        return None
    kind = message.type
    content = message.content
    if type(content) is not str or message.additional_kwargs or message.name is not None:
        return None
    if kind == "ai" or kind == "AIMessageChunk":
        return None if message.tool_calls or message.invalid_tool_calls else (kind, content)
    if kind == "tool":
        return (kind, content, message.tool_call_id)
    if kind == "chat":
        return (kind, content, message.role)
    return (kind, content)


def _message_json(message: Any) -> str:
    return dumps(to_genai(openai_message(message)))


input_messages_json = MessageMemo(_plain_key, _message_json, max_chars=4_000_000).encode
"""``gen_ai.input.messages`` of LangChain messages: the same JSON as ``dumps(many_to_genai(input_messages(m)))``."""


# --------------------------------------------------------------------------- chat-model runs


def _request_model(params: Mapping[str, Any], metadata: Mapping[str, Any]) -> str | None:
    model = metadata.get("ls_model_name") or params.get("model") or params.get("model_name")
    return model if isinstance(model, str) and model else None


def chat_start_attributes(
    messages: Sequence[Any], params: Mapping[str, Any], metadata: Mapping[str, Any], agent: str | None
) -> tuple[Attributes, Attributes]:
    """``(sampler attributes, the rest)`` of a chat-model run from ``on_chat_model_start``.

    ``params`` is the run's ``invocation_params``, ``metadata`` its metadata (the
    ``ls_*`` keys every chat model adds), ``agent`` the agent scope the run is in.
    """
    start: Attributes = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT}
    provider = metadata.get("ls_provider") or params.get("_type")
    if isinstance(provider, str) and provider:
        start[semconv.GEN_AI_PROVIDER_NAME] = provider
    model = _request_model(params, metadata)
    if model is not None:
        start[semconv.GEN_AI_REQUEST_MODEL] = model
    attrs: Attributes = {semconv.AGL_PLUGIN: PLUGIN}
    if agent is not None:
        attrs[semconv.GEN_AI_AGENT_NAME] = agent
    rest = []
    tools = None
    max_tokens = None
    for key, value in params.items():  # one pass: a provider's parameters are many, the known ones few
        if value is None:
            continue
        if key in _NOT_PARAMS:
            if key == "tools":
                tools = value
            elif key == "stream" and value is True:
                attrs[semconv.GEN_AI_REQUEST_STREAM] = True
            continue
        rest.append((key, value))
        kind = type(value)
        if kind is float or kind is int:
            name = _NUMBER_PARAMS.get(key)
            if name is not None:
                attrs[name] = float(value)
            elif kind is int:
                if key == "max_tokens" or (key == "max_completion_tokens" and max_tokens is None):
                    max_tokens = value  # the older name wins when both are given
                elif key == "seed":
                    attrs[semconv.GEN_AI_REQUEST_SEED] = value
        elif key == "streaming" and value is True:
            attrs[semconv.GEN_AI_REQUEST_STREAM] = True
    if semconv.GEN_AI_REQUEST_TEMPERATURE not in attrs:
        temperature = metadata.get("ls_temperature")
        if type(temperature) is float or type(temperature) is int:
            attrs[semconv.GEN_AI_REQUEST_TEMPERATURE] = float(temperature)
    if max_tokens is None and type(metadata.get("ls_max_tokens")) is int:
        max_tokens = metadata["ls_max_tokens"]
    if max_tokens is not None:
        attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
    attrs[semconv.GEN_AI_INPUT_MESSAGES] = input_messages_json(messages)
    if isinstance(tools, (list, tuple)) and tools:
        attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = _tools_json(tools)
    if rest:
        attrs[semconv.AGL_LLM_INVOCATION_PARAMETERS] = _params_json(tuple(rest))
    return start, attrs


class _Memo:
    """A bounded map from a key to the JSON made of it; when full it starts over."""

    __slots__ = ("entries", "limit")

    def __init__(self, limit: int) -> None:
        self.entries: dict[Any, tuple[Any, str]] = {}
        self.limit = limit

    def put(self, key: Any, kept: Any, text: str) -> str:
        if len(self.entries) >= self.limit:
            self.entries.clear()
        self.entries[key] = (kept, text)
        return text


_tools_memo = _Memo(256)
_params_memo = _Memo(1024)


def _tools_json(tools: Sequence[Any]) -> str:
    """The tool definitions' JSON, once per bound tool list: a binding hands the model the same list every call."""
    hit = _tools_memo.entries.get(id(tools))
    if hit is not None and hit[0] is tools:
        return hit[1]
    return _tools_memo.put(id(tools), tools, dumps(tools))


def _param_default(value: Any) -> Any:
    if isinstance(value, type):  # a schema class (with_structured_output's response_format): its name
        return f"{value.__module__}.{value.__qualname__}"
    dump = getattr(value, "model_dump", None)
    if dump is not None:
        return dump(exclude_none=True)
    return repr(value)


def _params_json(items: tuple[tuple[str, Any], ...]) -> str:
    """Invocation parameters as JSON: providers put anything there (classes, clients, callables).

    Parameters are mostly the same from call to call, so the JSON of all-scalar ones is kept, keyed by the items.
    """
    flat = set(map(type, (v for _, v in items))) <= _SCALARS
    if flat:
        hit = _params_memo.entries.get(items)
        if hit is not None:
            return hit[1]
    params = dict(items)
    try:
        text = dumps(params)
    except (TypeError, ValueError):
        text = json.dumps(params, ensure_ascii=False, separators=(",", ":"), default=_param_default)
    return _params_memo.put(items, None, text) if flat else text


_SCALARS = frozenset({str, int, float, bool})


def _usage(attrs: Attributes, message: Any, llm_output: Mapping[str, Any] | None) -> None:
    usage = getattr(message, "usage_metadata", None)
    if usage:
        if type(usage.get("input_tokens")) is int:
            attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = usage["input_tokens"]
        if type(usage.get("output_tokens")) is int:
            attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = usage["output_tokens"]
        return
    token_usage = llm_output.get("token_usage") or llm_output.get("usage") if llm_output else None
    if isinstance(token_usage, Mapping):
        if type(token_usage.get("prompt_tokens")) is int:
            attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = token_usage["prompt_tokens"]
        if type(token_usage.get("completion_tokens")) is int:
            attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = token_usage["completion_tokens"]


def _finish_reason(generation: Any) -> str | None:
    message = getattr(generation, "message", None)
    meta = getattr(message, "response_metadata", None)
    reason = (meta.get("finish_reason") or meta.get("stop_reason")) if meta else None
    if reason is None and generation.generation_info:
        reason = generation.generation_info.get("finish_reason")
    return reason if isinstance(reason, str) else None


def chat_end_attributes(response: Any) -> Attributes:
    """A chat-model run's end attributes from the ``LLMResult`` of ``on_llm_end`` (one prompt, its generations)."""
    attrs: Attributes = {}
    generations = response.generations[0] if response.generations else ()
    outputs = []
    reasons = []
    first = None
    for generation in generations:
        message = getattr(generation, "message", None)
        if message is None:  # a text generation, from a chat model that returned plain text
            outputs.append(to_genai({"role": "assistant", "content": generation.text}))
            continue
        if first is None:
            first = message
        reason = _finish_reason(generation)
        if reason is not None:
            reasons.append(reason)
        outputs.append(to_genai(openai_message(message), reason))
    attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = dumps(outputs)
    attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = tuple(reasons)
    llm_output = response.llm_output
    meta = first.response_metadata if first is not None else None
    model = (meta.get("model_name") or meta.get("model")) if meta else None
    if model is None and llm_output:
        model = llm_output.get("model_name") or llm_output.get("model")
    if isinstance(model, str) and model:
        attrs[semconv.GEN_AI_RESPONSE_MODEL] = model
    response_id = meta.get("id") if meta else None
    if isinstance(response_id, str) and response_id:
        attrs[semconv.GEN_AI_RESPONSE_ID] = response_id
    _usage(attrs, first, llm_output)
    return attrs


def partial_output_attributes(response: Any) -> Attributes:
    """What a failed or abandoned run had produced (a stream's chunks so far), from ``on_llm_error``'s response."""
    generations = response.generations[0] if response is not None and response.generations else ()
    if not any(getattr(g, "message", None) is not None and (g.message.content or getattr(g.message, "tool_calls", None))
               for g in generations):
        return {}
    return chat_end_attributes(response)


# --------------------------------------------------------------------------- tool runs


def text(value: Any) -> str:
    """A tool's arguments or result as the text an attribute holds (JSON unless it is a string)."""
    return value if isinstance(value, str) else dumps(value)


def tool_name(serialized: Mapping[str, Any] | None, run_name: Any) -> str | None:
    name = serialized.get("name") if serialized else None
    if not isinstance(name, str) or not name:
        name = run_name
    return name if isinstance(name, str) and name else None


def tool_start_attributes(name: str | None, input_str: Any, inputs: Any, call_id: Any) -> tuple[Attributes, Attributes]:
    """``(sampler attributes, the rest)`` of a tool run from ``on_tool_start``."""
    start: Attributes = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL}
    if name is not None:
        start[semconv.GEN_AI_TOOL_NAME] = name
    attrs: Attributes = {semconv.GEN_AI_TOOL_TYPE: "function", semconv.AGL_PLUGIN: PLUGIN}
    if isinstance(call_id, str) and call_id:
        attrs[semconv.GEN_AI_TOOL_CALL_ID] = call_id
    arguments = inputs if inputs is not None else input_str
    if arguments is not None:
        attrs[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] = text(arguments)
    return start, attrs


def tool_end_attributes(output: Any) -> tuple[Attributes, str]:
    """``(attributes, status)`` from ``on_tool_end``'s output: a ``ToolMessage`` (status and all) or a raw value.

    A ``ToolMessage`` with ``status="error"`` (what ``handle_tool_error`` and
    ``handle_validation_error`` make, or what the tool itself returned) is an
    ``error`` outcome: the tool reported a failure without raising.
    """
    attrs: Attributes = {}
    if getattr(output, "type", None) == "tool":
        content = output.content
        status = semconv.TOOL_ERROR if output.status == "error" else semconv.TOOL_OK
        call_id = output.tool_call_id
        if isinstance(call_id, str) and call_id:  # langchain-core 1.0 tells it here only, not at the start
            attrs[semconv.GEN_AI_TOOL_CALL_ID] = call_id
    else:
        content = output
        status = semconv.TOOL_OK
    attrs[semconv.AGL_TOOL_STATUS] = status
    if content is not None:
        attrs[semconv.GEN_AI_TOOL_CALL_RESULT] = text(content)
    if status == semconv.TOOL_ERROR:
        attrs[semconv.ERROR_TYPE] = "tool_error"
    return attrs, status


def tool_error_status(error: BaseException) -> str:
    return semconv.TOOL_TIMEOUT if isinstance(error, TimeoutError) else semconv.TOOL_EXCEPTION


# --------------------------------------------------------------------------- agent scopes


def agent_attributes(name: str) -> Attributes:
    return {
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT,
        semconv.GEN_AI_AGENT_NAME: name,
        semconv.AGL_PLUGIN: PLUGIN,
    }
