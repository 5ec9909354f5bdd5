"""OpenAI Agents SDK objects as GenAI span attributes: model calls, tools, handoffs, guardrails.

The SDK speaks the Responses API format whatever model runs behind it: a
``Model`` gets system instructions plus a list of Responses input items, and
returns (or streams) Responses output items. Transitions carry OpenAI chat
messages, so :func:`input_messages` converts input items the way the SDK's own
chat-completions converter does (system instructions first, function calls
folded into the assistant message they follow, function-call outputs as tool
messages) and :func:`output_message` makes one assistant message of a
response's output items. Items arrive as plain dicts (what the runner builds)
or as pydantic objects (what a model returned); both are read field by field,
never ``model_dump``-ed, and an item of a kind with no chat equivalent (a hosted
tool call, an item reference) is left out rather than guessed.

Everything here runs on the call's hot path: the attributes common to every
call of one model are built once per model class and name, tool definitions
once per tool (and their JSON once per set of tools), and a message already
seen on an earlier call of the run is neither converted nor encoded again
(:class:`_InputMemo`: the runner re-sends the whole conversation on every
call). Values are clean attribute values, so
:func:`agl_core.encoding.set_on` stores them directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from agl_core import semconv
from agl_core.encoding import dumps
from agl_core.messages import to_genai

Attributes = dict[str, Any]
Message = dict[str, Any]

PLUGIN = "openai_agents"
_OTHER = "_OTHER"  # the conventions' provider name when none of the well-known ones applies
_FAKE_ID_PREFIX = "__"  # the SDK's placeholder response ids (``__fake_id__``) name no real response


def _get(item: Any, key: str, default: Any = None) -> Any:
    """A field of an item that may be a dict (TypedDict params) or a pydantic object."""
    if type(item) is dict:
        return item.get(key, default)
    return getattr(item, key, default)


# --------------------------------------------------------------------------- per model


_model_static: dict[tuple[type[Any], str | None], Attributes] = {}


def _provider(model: Any, name: str | None) -> str:
    """The SDK's own model classes (and users' subclasses of them) say who serves the model; others don't."""
    for cls in type(model).__mro__:
        module = cls.__module__
        if module.startswith("agents.models.openai"):
            return "openai"
        if module.startswith("agents.extensions.models.litellm"):
            # LiteLLM names the provider in the model string: "anthropic/claude-...", "openai/gpt-..."
            return name.split("/", 1)[0] if name and "/" in name else "litellm"
    return _OTHER


def model_name(model: Any) -> str | None:
    """The model's name when it keeps one (``OpenAIChatCompletionsModel("gpt-4o", ...)`` does); else None."""
    name = getattr(model, "model", None)
    return name if isinstance(name, str) and name else None


def _static(model: Any) -> Attributes:
    """The attributes every call through one model class and model name shares."""
    name = model_name(model)
    key = (type(model), name)
    attrs = _model_static.get(key)
    if attrs is None:
        attrs = {
            semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
            semconv.GEN_AI_PROVIDER_NAME: _provider(model, name),
            semconv.AGL_PLUGIN: PLUGIN,
        }
        if name is not None:
            attrs[semconv.GEN_AI_REQUEST_MODEL] = name
        if len(_model_static) >= 256:
            _model_static.clear()
        _model_static[key] = attrs
    return attrs


# --------------------------------------------------------------------------- input items -> chat messages


def _part(part: Any) -> dict[str, Any] | None:
    """One Responses content part as a chat content part (None for a kind chat has no equivalent of)."""
    kind = _get(part, "type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": _get(part, "text", "")}
    if kind == "input_image":
        url = _get(part, "image_url") or _get(part, "file_id")
        return {"type": "image_url", "image_url": {"url": url}} if url else None
    if kind == "refusal":
        return {"type": "refusal", "refusal": _get(part, "refusal", "")}
    if kind == "input_file":
        return {"type": "file", "file": {k: v for k in ("file_id", "filename", "file_data")
                                         if (v := _get(part, k)) is not None}}
    return None


def _content(content: Any, text_only: bool) -> Any:
    """Message content as chat content: a string stays a string, a list of parts becomes chat parts."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for raw in content:
        part = _part(raw)
        if part is not None and (not text_only or part["type"] == "text"):
            parts.append(part)
    return parts


def _joined_text(parts: Iterable[Any], kinds: tuple[str, ...]) -> str | None:
    texts = [text for p in parts if _get(p, "type") in kinds and isinstance(text := _get(p, "text"), str)]
    return "\n".join(texts) if texts else None


def _tool_call(item: Any, kind: str) -> dict[str, Any]:
    if kind == "custom_tool_call":  # free-form tools carry `input`, not `arguments`
        arguments = _get(item, "input") or ""
    else:
        arguments = _get(item, "arguments") or "{}"
    return {"id": _get(item, "call_id"), "type": "function",
            "function": {"name": _get(item, "name"), "arguments": arguments}}


def _reasoning(item: Any) -> str | None:
    return _joined_text(_get(item, "content") or (), ("reasoning_text",)) or \
        _joined_text(_get(item, "summary") or (), ("summary_text",))


def _tool_output(output: Any) -> Any:
    if output is None or isinstance(output, str):
        return output if output is not None else ""
    if isinstance(output, (list, tuple)):
        return _content(output, text_only=True)
    return dumps(output)


_CALLS = frozenset({"function_call", "custom_tool_call"})
_OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output"})


def _opens_turn(item: Any) -> bool:
    """An earlier response's output message: the start of an assistant message that tool calls may join."""
    content = _get(item, "content")
    return _get(item, "role") == "assistant" and content is not None and not isinstance(content, str)


def _groups(items: Iterable[Any]) -> Iterator[list[Any]]:
    """Input items grouped by the chat message each group becomes.

    Function calls join the assistant message before them (or start one); a reasoning item waits for the
    next assistant message; items of kinds chat has no equivalent of become nothing.
    """
    turn: list[Any] | None = None  # an assistant message still open to tool calls
    reasoning: list[Any] = []
    for item in items:
        kind = _get(item, "type")
        if kind in _CALLS:
            if turn is None:
                turn, reasoning = reasoning, []
            turn.append(item)
            continue
        if turn is not None:
            yield turn
            turn = None
        if kind in _OUTPUTS:
            yield [item]
        elif kind == "reasoning":
            reasoning.append(item)
        elif _get(item, "role") is not None and kind in (None, "message"):
            if _opens_turn(item):
                turn, reasoning = [*reasoning, item], []
            else:
                yield [item]
    if turn is not None:
        yield turn


def _message(group: list[Any]) -> Message:
    """The chat message one group of input items becomes."""
    first = group[0]
    kind = _get(first, "type")
    if kind in _OUTPUTS:
        return {"role": "tool", "tool_call_id": _get(first, "call_id"), "content": _tool_output(_get(first, "output"))}
    role = _get(first, "role")
    if len(group) == 1 and role is not None and kind in (None, "message") and not _opens_turn(first):
        content = _get(first, "content")
        if role == "assistant":
            return {"role": "assistant", "content": content}
        return {"role": role, "content": _content(content, text_only=role != "user")}
    message: Message = {"role": "assistant", "content": None}
    calls = []
    for item in group:
        kind = _get(item, "type")
        if kind in _CALLS:
            calls.append(_tool_call(item, kind))
        elif kind == "reasoning":
            reasoning = _reasoning(item)
            if reasoning:
                message["reasoning_content"] = reasoning
        else:  # the output message that opened the turn
            content = _get(item, "content") or ()
            message["content"] = _joined_text(content, ("output_text", "text", "input_text"))
            refusal = next((_get(p, "refusal") for p in content if _get(p, "type") == "refusal"), None)
            if refusal:
                message["refusal"] = refusal
    if calls:
        message["tool_calls"] = calls
    return message


def input_messages(system_instructions: Any, items: Any) -> list[Message]:
    """The chat messages a model call was given: system instructions, then the input items."""
    messages: list[Message] = []
    if isinstance(system_instructions, str) and system_instructions:
        messages.append({"role": "system", "content": system_instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    else:
        messages.extend(_message(group) for group in _groups(items or ()))
    return messages


_FLAT = frozenset({str, type(None)})
_MEMO_CHARS = 8_000_000  # bound on what the memo below holds; past it, it starts over


class _InputMemo:
    """``gen_ai.input.messages`` JSON, each message's text remembered by the input items it came from.

    The runner re-sends the whole conversation on every model call, rebuilding its items as new dicts
    with the same contents; keyed by those contents (all strings: the common case), a message seen on an
    earlier call is neither converted nor encoded again, so a long run stays linear. Items holding lists
    or objects are converted every time.
    """

    def __init__(self) -> None:
        self.entries: dict[Any, str] = {}
        self.chars = 0

    def _text(self, key: Any, build: Callable[[Any], Message], source: Any) -> str:
        text = self.entries.get(key) if key is not None else None
        if text is None:
            text = dumps(to_genai(build(source)))
            if key is not None:
                if self.chars > _MEMO_CHARS:
                    self.entries.clear()
                    self.chars = 0
                self.entries[key] = text
                self.chars += len(text)
        return text

    def encode(self, system_instructions: Any, items: Any) -> str:
        parts = []
        if isinstance(system_instructions, str) and system_instructions:
            parts.append(self._text(("system", system_instructions), _system, system_instructions))
        if isinstance(items, str):
            parts.append(self._text(("user", items), _user, items))
        else:
            for group in _groups(items or ()):
                key: Any = tuple(tuple(item.items()) for item in group
                                 if type(item) is dict and set(map(type, item.values())) <= _FLAT)
                parts.append(self._text(key if len(key) == len(group) else None, _message, group))
        return "[" + ",".join(parts) + "]"


def _system(text: str) -> Message:
    return {"role": "system", "content": text}


def _user(text: str) -> Message:
    return {"role": "user", "content": text}


input_messages_json = _InputMemo().encode
"""``gen_ai.input.messages`` of a call: the same JSON as ``dumps(many_to_genai(input_messages(...)))``."""


# --------------------------------------------------------------------------- tools


_tool_defs: dict[int, tuple[Any, dict[str, Any]]] = {}  # id(tool) -> (tool, definition): tools live long


def _function(name: Any, description: Any, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description or "",
                                             "parameters": parameters if parameters is not None else {}}}


def _tool_definition(tool: Any) -> dict[str, Any]:
    hit = _tool_defs.get(id(tool))
    if hit is not None and hit[0] is tool:
        return hit[1]
    schema = getattr(tool, "params_json_schema", None)
    if schema is not None:  # a FunctionTool (or anything shaped like one)
        definition = _function(tool.name, getattr(tool, "description", None), schema)
    else:  # a hosted tool (web search, file search, computer, ...): the model sees it by name only
        name = getattr(tool, "name", None) or type(tool).__name__
        definition = {"type": str(getattr(tool, "type", None) or name), "name": str(name)}
    if len(_tool_defs) >= 1024:
        _tool_defs.clear()
    _tool_defs[id(tool)] = (tool, definition)
    return definition


_handoff_defs: dict[tuple[Any, Any], tuple[Any, dict[str, Any]]] = {}  # (name, description) -> (schema, definition)


def _handoff_definition(handoff: Any) -> dict[str, Any]:
    """The runner rebuilds ``Handoff`` objects every turn: cache their definitions by what they say instead."""
    name, description = getattr(handoff, "tool_name", None), getattr(handoff, "tool_description", None)
    schema = getattr(handoff, "input_json_schema", None)
    hit = _handoff_defs.get((name, description))
    if hit is not None and hit[0] == schema:
        return hit[1]
    definition = _function(name, description, schema)
    if len(_handoff_defs) >= 1024:
        _handoff_defs.clear()
    _handoff_defs[(name, description)] = (schema, definition)
    return definition


def tool_definitions(tools: Any, handoffs: Any) -> list[dict[str, Any]]:
    """The tools a call offered the model, in the OpenAI chat ``tools`` format; handoffs are tools too."""
    defs = [_tool_definition(t) for t in tools or ()]
    defs.extend(_handoff_definition(h) for h in handoffs or ())
    return defs


_tools_json: dict[tuple[int, ...], tuple[list[dict[str, Any]], str]] = {}


def tool_definitions_json(tools: Any, handoffs: Any) -> str:
    """``gen_ai.tool.definitions``: encoded once per set of definitions (each definition is a cached object)."""
    defs = tool_definitions(tools, handoffs)
    key = tuple(map(id, defs))
    hit = _tools_json.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], defs, strict=True)):
        return hit[1]
    text = dumps(defs)
    if len(_tools_json) >= 256:
        _tools_json.clear()
    _tools_json[key] = (defs, text)  # holding the definitions keeps their ids from being reused
    return text


# --------------------------------------------------------------------------- requests and responses


_FLOAT_SETTINGS = (("temperature", semconv.GEN_AI_REQUEST_TEMPERATURE), ("top_p", semconv.GEN_AI_REQUEST_TOP_P))


def request_attributes(model: Any, system_instructions: Any, items: Any, settings: Any, tools: Any,
                       handoffs: Any, stream: bool) -> Attributes:
    """The chat span's start attributes for one ``Model.get_response`` / ``stream_response`` call."""
    attrs = dict(_static(model))
    attrs[semconv.GEN_AI_REQUEST_STREAM] = stream
    if settings is not None:
        for key, name in _FLOAT_SETTINGS:
            number = getattr(settings, key, None)
            if isinstance(number, (int, float)) and type(number) is not bool:
                attrs[name] = float(number)
        max_tokens = getattr(settings, "max_tokens", None)
        if type(max_tokens) is int:
            attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
    attrs[semconv.GEN_AI_INPUT_MESSAGES] = input_messages_json(system_instructions, items)
    if tools or handoffs:
        attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = tool_definitions_json(tools, handoffs)
    return attrs


def output_message(items: Iterable[Any]) -> Message:
    """A response's output items as one OpenAI assistant message (text, refusal, tool calls, reasoning)."""
    texts: list[str] = []
    message: Message = {"role": "assistant", "content": None}
    calls: list[dict[str, Any]] = []
    for item in items:
        kind = _get(item, "type")
        if kind == "message":
            for part in _get(item, "content") or ():
                part_kind = _get(part, "type")
                if part_kind == "output_text":
                    text = _get(part, "text")
                    if text:  # some SDK streams open an empty text part before a tool call
                        texts.append(text)
                elif part_kind == "refusal":
                    message["refusal"] = _get(part, "refusal")
        elif kind in ("function_call", "custom_tool_call"):
            calls.append(_tool_call(item, kind))
        elif kind == "reasoning":
            reasoning = _reasoning(item)
            if reasoning:
                message["reasoning_content"] = reasoning
    if texts:
        message["content"] = "\n".join(texts)
    elif "refusal" in message:
        message["content"] = [{"type": "refusal", "refusal": message.pop("refusal")}]
    if calls:
        message["tool_calls"] = calls
    return message


_INCOMPLETE = {"max_output_tokens": "length", "content_filter": "content_filter"}


def _finish_reason(message: Message, status: Any, incomplete: Any) -> str | None:
    """Known only for streamed calls, whose last event says whether the response completed."""
    if status == "incomplete":
        return _INCOMPLETE.get(_get(incomplete, "reason"), "length")
    if status is None:
        return None
    return "tool_calls" if message.get("tool_calls") else "stop"


def _usage(attrs: Attributes, usage: Any) -> None:
    if usage is None:
        return
    tokens_in = getattr(usage, "input_tokens", None)
    tokens_out = getattr(usage, "output_tokens", None)
    if type(tokens_in) is int:
        attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = tokens_in
    if type(tokens_out) is int:
        attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = tokens_out


def _outcome(attrs: Attributes, output: Any, finish: Any = None, incomplete: Any = None) -> None:
    message = output_message(output or ())
    reason = _finish_reason(message, finish, incomplete)
    attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = dumps([to_genai(message, reason)])
    if reason is not None:
        attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = (reason,)


def _response_id(attrs: Attributes, response_id: Any) -> None:
    if isinstance(response_id, str) and response_id and not response_id.startswith(_FAKE_ID_PREFIX):
        attrs[semconv.GEN_AI_RESPONSE_ID] = response_id


def response_attributes(response: Any, request_model: str | None) -> Attributes:
    """The chat span's end attributes from a ``ModelResponse`` (what ``get_response`` returns)."""
    attrs: Attributes = {}
    if request_model is not None:
        attrs[semconv.GEN_AI_RESPONSE_MODEL] = request_model  # a ModelResponse names no model of its own
    _response_id(attrs, getattr(response, "response_id", None))
    _usage(attrs, getattr(response, "usage", None))
    _outcome(attrs, getattr(response, "output", None))
    return attrs


def stream_attributes(response: Any, request_model: str | None) -> Attributes:
    """The chat span's end attributes from the ``Response`` of a stream's last event (completed or incomplete)."""
    attrs: Attributes = {}
    name = getattr(response, "model", None) if response is not None else None
    if isinstance(name, str) and name:
        attrs[semconv.GEN_AI_RESPONSE_MODEL] = name
    elif request_model is not None:
        attrs[semconv.GEN_AI_RESPONSE_MODEL] = request_model
    if response is None:
        return attrs
    _response_id(attrs, getattr(response, "id", None))
    _usage(attrs, getattr(response, "usage", None))
    # the SDK's chat-completions stream ends with a "completed" event whose response still says "in_progress"
    status = getattr(response, "status", None)
    _outcome(attrs, getattr(response, "output", None), "incomplete" if status == "incomplete" else "completed",
             getattr(response, "incomplete_details", None))
    return attrs


# --------------------------------------------------------------------------- agent, tool, handoff, guardrail spans


def agent_attributes(name: str | None) -> Attributes:
    attrs: Attributes = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT, semconv.AGL_PLUGIN: PLUGIN}
    if name:
        attrs[semconv.GEN_AI_AGENT_NAME] = name
    return attrs


def tool_start_attributes(name: str | None, agent: str | None) -> Attributes:
    attrs: Attributes = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL, semconv.GEN_AI_TOOL_TYPE: "function",
                         semconv.AGL_PLUGIN: PLUGIN}
    if name:
        attrs[semconv.GEN_AI_TOOL_NAME] = name
    if agent:
        attrs[semconv.GEN_AI_AGENT_NAME] = agent
    return attrs


def text(value: Any) -> str:
    """A tool's arguments or result as span text: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else dumps(value)


def tool_status(exc: BaseException | None) -> str:
    """The ``agl.tool.status`` of a tool the SDK reported as failed: how it failed, when we saw the exception."""
    if exc is None:
        return semconv.TOOL_ERROR
    if isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__:
        return semconv.TOOL_TIMEOUT
    return semconv.TOOL_EXCEPTION


def tool_end_attributes(arguments: Any, result: Any, call_id: Any, error: Any, exc: BaseException | None) -> Attributes:
    """The tool span's end attributes; ``error`` is the SDK's ``SpanError`` when it reported one."""
    attrs: Attributes = {}
    if isinstance(call_id, str) and call_id:
        attrs[semconv.GEN_AI_TOOL_CALL_ID] = call_id
    if arguments is not None:
        attrs[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] = text(arguments)
    if result is not None:
        attrs[semconv.GEN_AI_TOOL_CALL_RESULT] = text(result)
    if error is None:
        attrs[semconv.AGL_TOOL_STATUS] = semconv.TOOL_OK
    else:
        attrs[semconv.AGL_TOOL_STATUS] = tool_status(exc)
        attrs[semconv.ERROR_TYPE] = type(exc).__name__ if exc is not None else "tool_error"
    return attrs


def handoff_span_name(to_agent: str | None) -> str:
    return f"handoff {to_agent}" if to_agent else "handoff"


def guardrail_span_name(name: str | None) -> str:
    return f"guardrail {name}" if name else "guardrail"


def handoff_attributes(from_agent: Any, to_agent: Any) -> Attributes:
    attrs: Attributes = {semconv.AGL_PLUGIN: PLUGIN}
    if isinstance(from_agent, str):
        attrs[semconv.AGL_HANDOFF_FROM_AGENT] = from_agent
        attrs[semconv.GEN_AI_AGENT_NAME] = from_agent
    if isinstance(to_agent, str):
        attrs[semconv.AGL_HANDOFF_TO_AGENT] = to_agent
    return attrs


def guardrail_attributes(name: Any, triggered: Any, agent: str | None) -> Attributes:
    attrs: Attributes = {semconv.AGL_PLUGIN: PLUGIN, semconv.AGL_GUARDRAIL_TRIGGERED: bool(triggered)}
    if isinstance(name, str):
        attrs[semconv.AGL_GUARDRAIL_NAME] = name
    if agent:
        attrs[semconv.GEN_AI_AGENT_NAME] = agent
    return attrs


def error_message(error: Any) -> str:
    """The text of the SDK's ``SpanError`` (a TypedDict ``{"message", "data"}``) or of anything else."""
    if isinstance(error, Mapping):
        message = error.get("message")
        data = error.get("data")
        detail = data.get("error") if isinstance(data, Mapping) else None
        return f"{message}: {detail}" if message and detail else str(message or detail or error)
    return str(error)


# the exception the SDK raises for a guardrail that its SpanError reports tripped (``data.type``)
_TRIPWIRES = {"input_guardrail": "InputGuardrailTripwireTriggered",
              "output_guardrail": "OutputGuardrailTripwireTriggered"}


def error_type(error: Any) -> str:
    """``error.type`` for an error the SDK reported without the exception at hand: a tripped guardrail's is the
    class the SDK raises for it (a streamed run of older releases makes that exception only after the agent's
    span ended), anything else ``error``."""
    data = error.get("data") if isinstance(error, Mapping) else None
    kind = data.get("type") if isinstance(data, Mapping) else None
    return _TRIPWIRES.get(kind, "error") if isinstance(kind, str) else "error"
