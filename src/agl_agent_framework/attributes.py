"""Agent Framework model-client calls and tool calls as GenAI span attributes.

Agent Framework's chat clients speak ``agent_framework`` types, not OpenAI's: the
prompt is a list of ``Message`` (a role, an ``author_name`` and a list of
``Content`` items: text, reasoning, function calls and results, images) plus the
agent's ``instructions`` in the options, and the result a ``ChatResponse``
(its messages, ``finish_reason`` and ``usage_details``). They are turned into
OpenAI chat messages the way the framework's own ``OpenAIChatCompletionClient``
sends them (the instructions first, as a system message; a message's
``author_name`` as ``name``; an assistant turn's text and function calls in one
message; one ``tool`` message per function result), then into the GenAI parts
format with :func:`agl_core.messages.to_genai`. A request with a
``response_format`` (structured output) is marked ``gen_ai.output.type: json``.

Everything here runs on the call's hot path. An agent re-sends its whole
conversation on every call, so each message's JSON is memoised under a key made
of its field values (``Message`` objects are mutable, so the key is the values,
never the object): only the new messages of a call are converted. Attribute
dicts are built once and stored with :func:`agl_core.encoding.set_on`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agl_core import semconv
from agl_core.encoding import MessageMemo, dumps, sampling_attributes, span_text
from agl_core.messages import to_genai

__all__ = [
    "Attributes",
    "dumps",
    "handoff_target",
    "input_messages_json",
    "output_message",
    "request_attributes",
    "request_messages_attributes",
    "response_attributes",
    "to_openai",
    "tool_definitions",
    "tool_end_attributes",
    "tool_start_attributes",
]

Attributes = dict[str, Any]

PLUGIN = "agent_framework"
HANDOFF_TOOL_PREFIX = "handoff_to_"  # agent_framework_orchestrations' handoff tools: handoff_to_<agent id>
HANDOFF_RESULT_KEY = "handoff_to"  # ... and the key of the result they stand for


# --------------------------------------------------------------------------- messages


def _text_of(contents: Iterable[Any]) -> str | None:
    texts = [c.text for c in contents if c.type == "text" and c.text]
    return "".join(texts) if texts else None


def _arguments(arguments: Any) -> str:
    """A function call's arguments as the model's raw string (the framework may hold them parsed)."""
    if arguments is None:
        return "{}"
    return arguments if isinstance(arguments, str) else dumps(arguments)


def _tool_call(content: Any) -> dict[str, Any]:
    return {"id": content.call_id, "type": "function",
            "function": {"name": content.name, "arguments": _arguments(content.arguments)}}


def _user_part(content: Any) -> dict[str, Any] | None:
    kind = content.type
    if kind == "text":
        return {"type": "text", "text": content.text or ""}
    if kind in ("data", "uri") and content.uri:
        media = content.media_type or ""
        if media.startswith("image/") or not media:
            return {"type": "image_url", "image_url": {"url": content.uri}}
        return {"type": "text", "text": f"[{media}: {content.uri[:64]}]"}
    return None


def _result_text(content: Any) -> str:
    result = content.result
    if isinstance(result, str):
        return result
    return "" if result is None else span_text(result)


def to_openai(message: Any) -> list[dict[str, Any]]:
    """One framework ``Message`` as the OpenAI chat messages it stands for (a tool message may be several)."""
    if isinstance(message, Mapping):  # an OpenAI-format dict handed to a custom client
        return [dict(message)]
    if isinstance(message, str):
        return [{"role": "user", "content": message}]
    role = str(message.role)
    contents = message.contents
    name = message.author_name
    if role in ("system", "developer"):
        text = "\n".join(c.text for c in contents if c.type == "text" and c.text)
        if not text:
            return []
        out: dict[str, Any] = {"role": role, "content": text}
        if name:
            out["name"] = name
        return [out]
    if role == "tool":
        return [{"role": "tool", "tool_call_id": c.call_id, "content": _result_text(c)}
                for c in contents if c.type == "function_result"]
    if role == "assistant":
        calls = [_tool_call(c) for c in contents if c.type == "function_call"]
        results = [{"role": "tool", "tool_call_id": c.call_id, "content": _result_text(c)}
                   for c in contents if c.type == "function_result"]
        if not calls and not results and not any(c.type == "text" for c in contents):
            return []  # usage, approvals and other framework-internal contents are never sent
        out = {"role": "assistant", "content": _text_of(contents)}
        if name:
            out["name"] = name
        reasoning = "".join(c.text for c in contents if c.type == "text_reasoning" and c.text)
        if reasoning:
            out["reasoning_content"] = reasoning
        if calls:
            out["tool_calls"] = calls
        return [out, *results] if calls or out["content"] is not None else results
    parts = [p for p in map(_user_part, contents) if p is not None]
    results = [{"role": "tool", "tool_call_id": c.call_id, "content": _result_text(c)}
               for c in contents if c.type == "function_result"]  # a user turn carrying tool results
    if results and not parts:
        return results
    content: Any = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    out = {"role": role, "content": content}
    if name:
        out["name"] = name
    return [out, *results]


_SIMPLE = (str, int, float, bool, type(None))


def _memo_key(message: Any) -> tuple[Any, ...] | None:
    """The message's content as a tuple of immutable values, or None when it holds something else."""
    try:
        contents = message.contents
        key: list[Any] = [message.role, message.author_name]
        for c in contents:
            kind = c.type
            if kind == "text" or kind == "text_reasoning":
                key.append((kind, c.text))
            elif kind == "function_call":
                arguments = c.arguments
                if not isinstance(arguments, _SIMPLE):
                    return None
                key.append((kind, c.call_id, c.name, arguments))
            elif kind == "function_result":
                result = c.result
                if not isinstance(result, _SIMPLE):
                    return None
                key.append((kind, c.call_id, result))
            elif kind == "usage":
                continue
            else:
                return None  # images, hosted items: encoded each time
        return tuple(key)
    except AttributeError:  # a dict or a string handed to a custom client
        return None


def _message_json(message: Any) -> str:
    return ",".join(dumps(to_genai(m)) for m in to_openai(message))


_memo = MessageMemo(_memo_key, _message_json)


_systems: dict[str, str] = {}  # instructions -> their system message's JSON (an agent sends the same on every call)


def input_messages_json(messages: Any, instructions: Any = None) -> str:
    """``gen_ai.input.messages`` of a request: the instructions as a system message, then each message's JSON."""
    if type(messages) is not list and type(messages) is not tuple:
        if isinstance(messages, (str, Mapping)) or not isinstance(messages, Iterable):
            messages = [messages]
    text = _memo.encode(messages)
    if type(instructions) is str and instructions:
        system = _systems.get(instructions)
        if system is None:
            system = dumps(to_genai({"role": "system", "content": instructions}))
            if len(_systems) >= 64:
                _systems.clear()
            _systems[instructions] = system
        return f"[{system},{text[1:]}" if len(text) > 2 else f"[{system}]"
    return text


def output_message(response: Any) -> dict[str, Any]:
    """A ``ChatResponse`` as the one OpenAI assistant message it stands for."""
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for m in response.messages:  # one pass over the contents: this runs once per model request
        if str(m.role) != "assistant":
            continue
        for c in m.contents:
            kind = c.type
            if kind == "text":
                if c.text:
                    texts.append(c.text)
            elif kind == "function_call":
                calls.append(_tool_call(c))
            elif kind == "text_reasoning" and c.text:
                reasoning.append(c.text)
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return out


def tool_definitions(tools: Iterable[Any]) -> list[dict[str, Any]]:
    """``options["tools"]`` in the OpenAI tools format (the framework's ``FunctionTool``, dicts, hosted tools)."""
    out: list[dict[str, Any]] = []
    for tool in tools:
        spec = getattr(tool, "to_json_schema_spec", None)
        if spec is not None:
            out.append(spec())
        elif isinstance(tool, Mapping):
            out.append(dict(tool))
        else:
            name = getattr(tool, "name", None) or type(tool).__name__
            out.append({"type": "function", "function": {"name": str(name)}})
    return out


# --------------------------------------------------------------------------- model-client calls

_static: dict[type[Any], Attributes] = {}  # client class -> attributes common to all its calls


def _common(client: Any) -> Attributes:
    cls = type(client)
    attrs = _static.get(cls)
    if attrs is None:
        provider = getattr(client, "otel_provider_name", None) or getattr(cls, "OTEL_PROVIDER_NAME", None)
        if not isinstance(provider, str) or provider == "unknown":
            provider = cls.__module__.split(".")[0] or PLUGIN
        attrs = {
            semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
            semconv.GEN_AI_PROVIDER_NAME: provider,
            semconv.AGL_PLUGIN: PLUGIN,
        }
        if len(_static) >= 256:
            _static.clear()
        _static[cls] = attrs
    return attrs


def _model(client: Any, options: Mapping[str, Any], client_kwargs: Mapping[str, Any] | None) -> str | None:
    for source in (client_kwargs, options):
        if source:
            model = source.get("model") or source.get("model_id")
            if isinstance(model, str) and model:
                return model
    model = getattr(client, "model", None) or getattr(client, "model_id", None)
    return model if isinstance(model, str) and model else None


def request_attributes(client: Any, options: Any, client_kwargs: Any, stream: bool, agent: str | None) -> Attributes:
    """The span's start attributes from ``client.get_response(messages, stream=..., options=...)``, messages aside."""
    attrs = dict(_common(client))
    attrs[semconv.GEN_AI_REQUEST_STREAM] = stream
    opts: Mapping[str, Any] = options if type(options) is dict or isinstance(options, Mapping) else {}
    kwargs = client_kwargs if type(client_kwargs) is dict or isinstance(client_kwargs, Mapping) else None
    model = _model(client, opts, kwargs)
    if model is not None:
        attrs[semconv.GEN_AI_REQUEST_MODEL] = model
    if opts:
        sampling_attributes(opts, attrs)
        if opts.get("response_format") is not None:
            attrs[semconv.GEN_AI_OUTPUT_TYPE] = "json"
    if agent:
        attrs[semconv.GEN_AI_AGENT_NAME] = agent
    return attrs


def request_messages_attributes(messages: Any, options: Any) -> Attributes:
    """The request's prompt (instructions included) and the tools it offers, as sent to the model."""
    opts: Mapping[str, Any] = options if type(options) is dict or isinstance(options, Mapping) else {}
    attrs: Attributes = {}
    if messages is not None:
        attrs[semconv.GEN_AI_INPUT_MESSAGES] = input_messages_json(messages, opts.get("instructions"))
    tools = opts.get("tools")
    if tools:
        listed = tools if type(tools) is list or isinstance(tools, Sequence) else [tools]
        attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = _tool_definitions_json(listed)
    return attrs


_tool_json: dict[tuple[int, ...], tuple[tuple[Any, ...], str]] = {}  # ids -> (the tools, held so ids stay theirs; JSON)


def _tool_definitions_json(tools: Sequence[Any]) -> str:
    """The tools' definitions as JSON, once per list of tool objects (an agent offers the same tools every call).

    A ``FunctionTool``'s schema is fixed when it is made; a dict can be edited in place, so dicts are never cached.
    """
    key = tuple(map(id, tools))
    hit = _tool_json.get(key)
    if hit is not None:  # the entry holds its tools, so these ids are still theirs: the same objects, no dict
        return hit[1]
    held = tuple(tools)
    if any(isinstance(t, Mapping) for t in held):
        return dumps(tool_definitions(held))
    text = dumps(tool_definitions(held))
    if len(_tool_json) >= 256:
        _tool_json.clear()
    _tool_json[key] = (held, text)
    return text


def response_attributes(response: Any) -> Attributes:
    """The span's end attributes from a ``ChatResponse`` (what ``get_response`` returns or a stream adds up to)."""
    finish = response.finish_reason
    finish = str(finish) if finish is not None else ("tool_calls" if _asks_for_tools(response) else None)
    attrs: Attributes = {
        semconv.GEN_AI_OUTPUT_MESSAGES: dumps([to_genai(output_message(response), finish)]),
        semconv.GEN_AI_RESPONSE_FINISH_REASONS: (finish,) if finish is not None else (),
    }
    usage = response.usage_details
    if usage:
        prompt, completion = usage.get("input_token_count"), usage.get("output_token_count")
        if type(prompt) is int:
            attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = prompt
        if type(completion) is int:
            attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = completion
    if isinstance(response.model, str) and response.model:
        attrs[semconv.GEN_AI_RESPONSE_MODEL] = response.model
    if isinstance(response.response_id, str) and response.response_id:
        attrs[semconv.GEN_AI_RESPONSE_ID] = response.response_id
    return attrs


def _asks_for_tools(response: Any) -> bool:
    return any(c.type == "function_call" for m in response.messages for c in m.contents)


# --------------------------------------------------------------------------- tool calls


def tool_start_attributes(name: str, call_id: str | None, arguments: Any, agent: str | None) -> Attributes:
    """A tool span's start attributes; ``arguments`` is the model's raw string or the parsed mapping."""
    attrs: Attributes = {
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL,
        semconv.GEN_AI_TOOL_NAME: name,
        semconv.GEN_AI_TOOL_TYPE: "function",
        semconv.AGL_PLUGIN: PLUGIN,
    }
    if call_id:
        attrs[semconv.GEN_AI_TOOL_CALL_ID] = call_id
    if arguments is not None:
        attrs[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] = span_text(arguments)
    if agent:
        attrs[semconv.GEN_AI_AGENT_NAME] = agent
    return attrs


def tool_end_attributes(result: Any, status: str, error_type: str | None) -> Attributes:
    """A tool span's end attributes: its result text, agl's outcome and, when it failed, ``error.type``."""
    attrs: Attributes = {semconv.AGL_TOOL_STATUS: status}
    if result is not None:
        attrs[semconv.GEN_AI_TOOL_CALL_RESULT] = span_text(result)
    if error_type is not None:
        attrs[semconv.ERROR_TYPE] = error_type
    return attrs


def handoff_target(tool_name: str, result_text: Any) -> str | None:
    """The agent a handoff tool hands over to (``{"handoff_to": id}``), or None for any other tool."""
    if not tool_name.startswith(HANDOFF_TOOL_PREFIX):
        return None
    if isinstance(result_text, str):
        try:
            value = json.loads(result_text)
        except ValueError:
            value = None
        if isinstance(value, Mapping) and isinstance(value.get(HANDOFF_RESULT_KEY), str):
            return str(value[HANDOFF_RESULT_KEY])
    return tool_name[len(HANDOFF_TOOL_PREFIX):]
