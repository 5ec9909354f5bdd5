"""AutoGen model-client calls and tool calls as GenAI span attributes.

AutoGen's model clients speak ``autogen_core.models`` types, not OpenAI's: the
prompt is a list of ``SystemMessage`` / ``UserMessage`` / ``AssistantMessage``
/ ``FunctionExecutionResultMessage`` and the result a ``CreateResult`` whose
content is text or a list of ``FunctionCall``. They are turned into OpenAI chat
messages the way ``autogen_ext``'s OpenAI client sends them by default (a user
message carries its ``source`` as ``name``; an assistant message with tool calls
carries its ``thought`` as content; a function-result message becomes one
``tool`` message per result), then into the GenAI parts format with
:func:`agl_core.messages.to_genai`. AutoGen's ``function_calls`` finish reason
is reported under OpenAI's name, ``tool_calls``.

Everything here runs on the call's hot path. An agent re-sends its whole
conversation on every call, so each message's JSON is memoised under a key
made of its (immutable) field values: only the new messages of a call are
converted. Attribute dicts are built once and stored with
:func:`agl_core.encoding.set_on`, which skips the SDK's per-value
re-check for values that are already clean.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from agl_core import semconv
from agl_core.encoding import MessageMemo, dumps, sampling_attributes, span_text
from agl_core.messages import to_genai

__all__ = [
    "Attributes",
    "dumps",
    "input_messages_json",
    "output_message",
    "request_attributes",
    "result_attributes",
    "to_openai",
    "tool_definitions",
    "tool_end_attributes",
    "tool_start_attributes",
]

Attributes = dict[str, Any]

PLUGIN = "autogen"
_FINISH = {"function_calls": "tool_calls"}  # AutoGen's name -> OpenAI's (and the conventions')


# --------------------------------------------------------------------------- messages


def _user_content(content: Any) -> Any:
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
        else:
            to_openai_format = getattr(part, "to_openai_format", None)  # autogen_core.Image
            parts.append(to_openai_format() if to_openai_format is not None else {"type": "text", "text": str(part)})
    return parts


def _function_calls(calls: Iterable[Any]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def to_openai(message: Any) -> list[dict[str, Any]]:
    """One AutoGen ``LLMMessage`` as the OpenAI chat messages it stands for (a function-result message may be many)."""
    kind = getattr(message, "type", None)
    if kind == "SystemMessage":
        return [{"role": "system", "content": message.content}]
    if kind == "UserMessage":
        return [{"role": "user", "content": _user_content(message.content), "name": message.source}]
    if kind == "AssistantMessage":
        content = message.content
        if isinstance(content, str):
            out: dict[str, Any] = {"role": "assistant", "content": content}
            if message.thought:
                out["reasoning_content"] = message.thought
            return [out]
        return [{"role": "assistant", "content": message.thought, "tool_calls": _function_calls(content)}]
    if kind == "FunctionExecutionResultMessage":
        return [{"role": "tool", "tool_call_id": r.call_id, "content": r.content} for r in message.content]
    if isinstance(message, Mapping):  # an OpenAI-format dict handed to a custom client
        return [dict(message)]
    return [{"role": "user", "content": str(message)}]


def _memo_key(message: Any) -> tuple[Any, ...] | None:
    """The message's content as a tuple of immutable values, or None when it holds something else (images)."""
    kind = getattr(message, "type", None)
    if kind == "SystemMessage":
        return (kind, message.content)
    if kind == "UserMessage":
        content = message.content
        return (kind, message.source, content) if isinstance(content, str) else None
    if kind == "AssistantMessage":
        content = message.content
        if isinstance(content, str):
            return (kind, content, message.thought)
        return (kind, message.thought, *((c.id, c.name, c.arguments) for c in content))
    if kind == "FunctionExecutionResultMessage":
        return (kind, *((r.call_id, r.content) for r in message.content))
    return None


def _message_json(message: Any) -> str:
    return ",".join(dumps(to_genai(m)) for m in to_openai(message))


_memo = MessageMemo(_memo_key, _message_json)
input_messages_json = _memo.encode
"""``gen_ai.input.messages`` for a list of ``LLMMessage``: ``dumps(many_to_genai(openai messages))``."""


def output_message(result: Any) -> dict[str, Any]:
    """A ``CreateResult`` as the OpenAI assistant message it stands for."""
    content = result.content
    thought = result.thought
    if isinstance(content, str):
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if thought:
            out["reasoning_content"] = thought
        return out
    return {"role": "assistant", "content": thought, "tool_calls": _function_calls(content)}


def tool_definitions(tools: Iterable[Any]) -> list[dict[str, Any]]:
    """``tools=`` (``Tool`` objects or ``ToolSchema`` dicts) in the OpenAI tools format."""
    out = []
    for tool in tools:
        schema = tool if type(tool) is dict or isinstance(tool, Mapping) else tool.schema
        out.append({"type": "function", "function": schema})
    return out


# --------------------------------------------------------------------------- model-client calls

_static: dict[type[Any], Attributes] = {}  # client class -> attributes common to all its calls


def _provider(cls: type[Any]) -> str:
    names = {c.__name__ for c in cls.__mro__}
    module = cls.__module__
    if "AzureOpenAIChatCompletionClient" in names:
        return "azure.ai.openai"
    if "BaseOpenAIChatCompletionClient" in names:
        return "openai"
    if "AnthropicBedrockChatCompletionClient" in names:
        return "aws.bedrock"
    for part, provider in (("anthropic", "anthropic"), ("ollama", "ollama"), ("azure", "azure.ai.inference"),
                           ("llama_cpp", "llama_cpp"), ("semantic_kernel", "semantic_kernel"),
                           ("replay", "autogen.replay")):
        if part in module:
            return provider
    return module.split(".")[0] or "autogen"


def _common(client: Any) -> Attributes:
    cls = type(client)
    attrs = _static.get(cls)
    if attrs is None:
        attrs = {
            semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
            semconv.GEN_AI_PROVIDER_NAME: _provider(cls),
            semconv.AGL_PLUGIN: PLUGIN,
        }
        if len(_static) >= 256:
            _static.clear()
        _static[cls] = attrs
    return attrs


def _create_args(client: Any, extra: Any) -> Mapping[str, Any]:
    """The client's own create arguments (OpenAI-style clients keep them) overlaid with the call's extra ones."""
    args = getattr(client, "_create_args", None)
    base = args if type(args) is dict or isinstance(args, Mapping) else {}
    if extra and isinstance(extra, Mapping):
        return {**base, **extra}
    return base


def _model(client: Any, args: Mapping[str, Any]) -> str | None:
    model = args.get("model")
    if isinstance(model, str):
        return model
    for name in ("_model_name", "_model", "model"):
        value = getattr(client, name, None)
        if isinstance(value, str):
            return value
    return None


def request_attributes(client: Any, messages: Any, tools: Any, extra_create_args: Any, stream: bool,
                       agent: str | None) -> Attributes:
    """The span's start attributes from ``client.create(messages, tools=..., extra_create_args=...)``."""
    attrs = dict(_common(client))
    attrs[semconv.GEN_AI_REQUEST_STREAM] = stream
    args = _create_args(client, extra_create_args)
    model = _model(client, args)
    if model is not None:
        attrs[semconv.GEN_AI_REQUEST_MODEL] = model
    if args:
        sampling_attributes(args, attrs)
    if agent:
        attrs[semconv.GEN_AI_AGENT_NAME] = agent
    if messages is not None:
        attrs[semconv.GEN_AI_INPUT_MESSAGES] = input_messages_json(messages)
    if tools:
        attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = dumps(tool_definitions(tools))
    return attrs


def result_attributes(result: Any) -> Attributes:
    """The span's end attributes from a ``CreateResult`` (the return of ``create``, the last item of a stream)."""
    finish = result.finish_reason
    finish = _FINISH.get(finish, finish)
    attrs: Attributes = {
        semconv.GEN_AI_OUTPUT_MESSAGES: dumps([to_genai(output_message(result), finish)]),
        semconv.GEN_AI_RESPONSE_FINISH_REASONS: (finish,) if isinstance(finish, str) else (),
    }
    usage = result.usage
    # AutoGen reports 0/0 when it was not told (a stream without include_usage): that is no count at all
    if usage is not None and (usage.prompt_tokens or usage.completion_tokens):
        if type(usage.prompt_tokens) is int:
            attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = usage.prompt_tokens
        if type(usage.completion_tokens) is int:
            attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = usage.completion_tokens
    return attrs


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
