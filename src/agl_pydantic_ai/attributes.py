"""Pydantic AI objects as GenAI span attributes: model requests and responses, tool calls and their outcomes.

A Pydantic AI ``Model`` is handed the run's history as ``ModelRequest`` and
``ModelResponse`` messages made of parts; transitions carry OpenAI chat
messages, so the messages are converted the way Pydantic AI's own OpenAI chat
model puts them on the wire (:func:`input_messages` gives that chat form): system
prompts first, then the run's instructions (the newest request's
``instructions``) as a system message, user prompts, tool returns and tool
retries as ``tool`` messages (a retry not bound to a tool call as a user
message), and each response as one assistant message with its text, tool calls
(output tools included: they are what the model called) and thinking as
``reasoning_content``. The spans hold them in the GenAI conventions' parts format,
built straight from the parts (:func:`genai_input`). Parts are told apart by their
``part_kind`` string, which Pydantic AI keeps stable across releases; a part of
a kind chat has no equivalent of (a native tool's call, an instruction delta, a
compaction marker) is left out rather than guessed.

When the model talks to an OpenAI-compatible server through the ``openai``
client, agl's ``openai`` plugin records the exact wire messages and token ids in
its span, nested in this plugin's, and the transition reads those first; the
conversion here is what a transition holds for every other model (a user's own
``Model``, ``FunctionModel``, ``TestModel``, the Responses API).

Everything here runs on the call's hot path: the attributes every call of one
model class and name shares are built once, tool definitions once per
``ToolDefinition`` (and their JSON once per set of tools), and a message already
encoded on an earlier call of the run is not converted again (the agent re-sends
the whole history on every call, holding the same message objects: see
:class:`RunMemo`; a model called directly, outside any agent run or graph node,
encodes its whole history on each call).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from agl_core import messages as chat
from agl_core import semconv
from agl_core.encoding import dumps, sampling_attributes, span_text
from agl_core.messages import to_genai

Attributes = dict[str, Any]
Message = dict[str, Any]

PLUGIN = "pydantic_ai"
AGENT_FALLBACK_NAME = "agent"
"""The agent name of an agent nobody named (Pydantic AI's own spans use the same)."""

GRAPH_NODE = "agl.pydantic_ai.graph.node"
"""On a graph node's span: the node id (a ``BaseNode`` class name or a step's id)."""
TOOL_KIND = "agl.pydantic_ai.tool.kind"
"""On a tool span: ``function`` for a function tool, ``output`` for an output tool (structured output)."""
TOOL_DEFERRED = "agl.pydantic_ai.tool.deferred"
"""On a tool span: the call was deferred (``CallDeferred``, ``ApprovalRequired``) rather than run."""


# --------------------------------------------------------------------------- per model


_model_static: dict[tuple[type[Any], str | None], Attributes] = {}


def _text_attr(obj: Any, name: str) -> str | None:
    try:
        value = getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - a property of a user's model class may raise: no value, then
        return None
    return value if isinstance(value, str) and value else None


def model_name(model: Any) -> str | None:
    """The model's name (``OpenAIChatModel("gpt-4o")`` says ``gpt-4o``; ``FunctionModel`` says ``function:...``)."""
    return _text_attr(model, "model_name")


def _static(model: Any) -> Attributes:
    """The attributes every call through one model class and model name shares."""
    name = model_name(model)
    key = (type(model), name)
    attrs = _model_static.get(key)
    if attrs is None:
        attrs = {
            semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
            semconv.GEN_AI_PROVIDER_NAME: _text_attr(model, "system") or "_OTHER",
            semconv.AGL_PLUGIN: PLUGIN,
        }
        if name is not None:
            attrs[semconv.GEN_AI_REQUEST_MODEL] = name
        if len(_model_static) >= 256:
            _model_static.clear()
        _model_static[key] = attrs
    return attrs


# --------------------------------------------------------------------------- messages -> conventions messages


def _text(role: str, content: Any) -> Message:
    """A message of one text part (the conventions' form of ``{"role": role, "content": content}``)."""
    if type(content) is str:
        return {"role": role, "parts": [{"type": "text", "content": content}]}
    return to_genai({"role": role, "content": content})


def _user_content(content: Any) -> Any:
    """A user prompt's content as chat content: a string stays a string, a sequence becomes chat parts."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for item in content or ():
        if isinstance(item, str):
            parts.append({"type": "text", "text": item})
            continue
        kind = getattr(item, "kind", None)
        if kind == "image-url":
            parts.append({"type": "image_url", "image_url": {"url": item.url}})
        elif kind == "binary" and getattr(item, "is_image", False):
            parts.append({"type": "image_url", "image_url": {"url": item.data_uri}})
        elif isinstance(getattr(item, "content", None), str):  # TextContent and its kin
            parts.append({"type": "text", "text": item.content})
        elif isinstance(getattr(item, "url", None), str):  # audio, video, document URLs
            parts.append({"type": "text", "text": item.url})
    return parts


def _retry_text(part: Any) -> str:
    for method in ("model_response", "model_response_str"):
        fn = getattr(part, method, None)
        if fn is not None:
            text = fn()
            return text if isinstance(text, str) else str(text)
    return str(getattr(part, "content", ""))


def _tool_result(call_id: Any, content: Any) -> Message:
    return {"role": "tool", "parts": [{"type": "tool_call_response", "id": call_id, "response": content}]}


def _request_messages(request: Any) -> list[Message]:
    """The messages one ``ModelRequest``'s parts become, in order."""
    out: list[Message] = []
    for part in request.parts:
        kind = getattr(part, "part_kind", None)
        if kind == "system-prompt":
            out.append(_text("system", part.content))
        elif kind == "user-prompt":
            content = part.content
            out.append(_text("user", content if isinstance(content, str) else _user_content(content)))
        elif kind == "tool-return":
            out.append(_tool_result(part.tool_call_id, part.model_response_str()))
        elif kind in ("retry-prompt", "retry-feedback"):
            call_id = getattr(part, "tool_call_id", None) if getattr(part, "tool_name", None) else None
            out.append(_tool_result(call_id, _retry_text(part)) if call_id else _text("user", _retry_text(part)))
    return out


def response_message(response: Any) -> Message:
    """A ``ModelResponse`` as one assistant message: its reasoning, its text, its tool calls (output tools too)."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for part in response.parts:
        kind = getattr(part, "part_kind", None)
        if kind == "text":
            if part.content:
                texts.append(part.content)
        elif kind == "tool-call":
            calls.append({"type": "tool_call", "id": part.tool_call_id, "name": part.tool_name,
                          "arguments": part.args_as_json_str()})
        elif kind == "thinking":
            if part.content:
                thoughts.append(part.content)
    parts: list[dict[str, Any]] = [{"type": "reasoning", "content": "\n".join(thoughts)}] if thoughts else []
    if texts:
        parts.append({"type": "text", "content": "".join(texts)})
    parts.extend(calls)
    return {"role": "assistant", "parts": parts}


def _message(message: Any) -> list[Message]:
    if getattr(message, "kind", None) == "response":
        return [response_message(message)]
    return _request_messages(message)


def _instructions(messages: list[Any]) -> str | None:
    """The run's instructions as the model is given them: those of the newest request."""
    for message in reversed(messages):
        if getattr(message, "kind", None) == "request":
            text = getattr(message, "instructions", None)
            return text if isinstance(text, str) and text else None
    return None


def _with_instructions(messages: list[Message], instructions: str) -> list[Message]:
    """``messages`` with the instructions as a system message after the system prompts that lead them."""
    at = 0
    while at < len(messages) and messages[at]["role"] == "system":
        at += 1
    messages.insert(at, _text("system", instructions))
    return messages


def genai_input(messages: Any) -> list[Message]:
    """The messages a model request was given, in the conventions' parts format: the history's messages,
    the run's instructions after the system prompts that lead them."""
    history = list(messages or ())
    out: list[Message] = []
    for message in history:
        out.extend(_message(message))
    instructions = _instructions(history)
    return out if instructions is None else _with_instructions(out, instructions)


def input_messages(messages: Any) -> list[Message]:
    """The chat messages a model request was given, as Pydantic AI's OpenAI chat model puts them on the wire."""
    return chat.many_from_genai(genai_input(messages))


class RunMemo:
    """The JSON of the messages one agent run has encoded, kept for the rest of that run.

    An agent re-sends its whole history on every model request, holding the same message objects, so
    without this each request would convert and encode every earlier message again: quadratic in the
    length of a run. An entry is the message, its parts when it was encoded and their JSON; it answers
    only for the same message object with the same parts (a list edited since is encoded again). The
    memo holds the messages it answers for, so their ids stay theirs; it lives as long as the run's
    scope (the plugin keeps one per agent run, dropped when the run ends), so it keeps no message past
    the run that holds it anyway. ``first`` holds the run's first request with the instructions
    spliced in (see :func:`input_messages_json`), keyed by the message and the instructions.
    """

    __slots__ = ("messages", "first")

    def __init__(self) -> None:
        self.messages: dict[int, tuple[Any, tuple[Any, ...], str]] = {}
        self.first: dict[int, tuple[Any, tuple[Any, ...], str, str]] = {}

    def json(self, message: Any) -> str:
        """``_message_json(message)``, from the memo when this run has encoded it already."""
        parts = getattr(message, "parts", None)
        if not isinstance(parts, (list, tuple)):
            return _message_json(message)
        hit = self.messages.get(id(message))
        snapshot = tuple(parts)
        if hit is not None and hit[0] is message and hit[1] == snapshot:
            return hit[2]
        text = _message_json(message)
        self.messages[id(message)] = (message, snapshot, text)
        return text

    def remember(self, message: Any, text: str) -> None:
        """Keep ``text`` as the JSON of ``message`` (what ``_message_json(message)`` gives), computed elsewhere.

        The response's output attribute is made from it, and the next request re-sends the response as
        history: it is not converted again then.
        """
        parts = getattr(message, "parts", None)
        if isinstance(parts, (list, tuple)) and id(message) not in self.messages:
            self.messages[id(message)] = (message, tuple(parts), text)

    def first_json(self, first: Any, instructions: str) -> str:
        """``_first_json(first, instructions)``, from the memo when this run has encoded it already."""
        parts = first.parts
        hit = self.first.get(id(first))
        snapshot = tuple(parts)
        if hit is not None and hit[0] is first and hit[3] == instructions and hit[1] == snapshot:
            return hit[2]
        text = _first_json(first, instructions)
        self.first[id(first)] = (first, snapshot, text, instructions)
        return text


def _message_json(message: Any) -> str:
    """The JSON of the messages ``message`` becomes, without the list's brackets ("" for none)."""
    return dumps(_message(message))[1:-1]


def _first_json(first: Any, instructions: str) -> str:
    """The run's first request with the instructions after its system prompts, as ``genai_input`` puts them."""
    return dumps(_with_instructions(_message(first), instructions))[1:-1]


def _listed(texts: Iterable[str]) -> str:
    return "[" + ",".join(filter(None, texts)) + "]"  # an empty text stands for no messages


def input_messages_json(messages: Any, memo: RunMemo | None = None) -> str:
    """``gen_ai.input.messages``: the same JSON as ``dumps(genai_input(messages))``.

    The instructions go after the system prompts, which Pydantic AI puts in the run's first request:
    that request is encoded with them, every later message on its own; with the run's ``memo``, a
    message the run has encoded already is not encoded again.
    """
    history = list(messages or ())
    encode = _message_json if memo is None else memo.json
    instructions = _instructions(history)
    if instructions is None or not history:
        return _listed(map(encode, history))
    first = history[0]
    if (getattr(first, "kind", None) != "request" or not isinstance(getattr(first, "parts", None), (list, tuple))
            or all(getattr(p, "part_kind", None) == "system-prompt" for p in first.parts)):
        return dumps(genai_input(history))  # later system prompts may lead as well
    head = _first_json(first, instructions) if memo is None else memo.first_json(first, instructions)
    return _listed((head, *map(encode, history[1:])))


# --------------------------------------------------------------------------- tools offered


_tool_defs: dict[tuple[Any, ...], tuple[Any, dict[str, Any]]] = {}  # (name, description, id(schema)) -> (schema, def)


def _tool_definition(tool: Any) -> dict[str, Any]:
    """A ``ToolDefinition`` in the chat tools format, the same dict for every call that offers the same tool.

    Pydantic AI builds a new ``ToolDefinition`` for every model request (its toolsets prepare the tools per
    step) around the same JSON-schema dict, made once with the tool: so the key is the definition's name and
    description and the schema object's id (the entry holds the schema, so no other object has that id while
    the entry is there), and the tools' JSON below is encoded once per set of tools instead of once per request.
    """
    description = getattr(tool, "description", None) or ""
    schema = getattr(tool, "parameters_json_schema", None) or {}
    name = tool.name
    key = (name, description, id(schema))
    try:
        hit = _tool_defs.get(key)
    except TypeError:  # a name or description that is no string (unhashable): not cached
        return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}
    if hit is not None:
        return hit[1]
    definition = {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}
    if len(_tool_defs) >= 1024:
        _tool_defs.clear()
    _tool_defs[key] = (schema, definition)
    return definition


_tools_json: dict[tuple[int, ...], tuple[list[dict[str, Any]], str]] = {}


def tool_definitions_json(params: Any) -> str | None:
    """``gen_ai.tool.definitions``: the function tools and the output tools offered, or None when there are none."""
    tools = [*(getattr(params, "function_tools", None) or ()), *(getattr(params, "output_tools", None) or ())]
    if not tools:
        return None
    defs = [_tool_definition(t) for t in tools]
    key = tuple(map(id, defs))
    hit = _tools_json.get(key)  # the entry holds the definitions: ids in its key are theirs
    if hit is not None:
        return hit[1]
    text = dumps(defs)
    if len(_tools_json) >= 256:
        _tools_json.clear()
    _tools_json[key] = (defs, text)  # holding the definitions keeps their ids from being reused
    return text


# --------------------------------------------------------------------------- requests and responses


def call_attributes(model: Any, settings: Any, stream: bool) -> Attributes:
    """The chat span's start attributes for one ``Model.request`` / ``request_stream`` call: the model, the
    provider, whether it streams, the sampling settings (the messages come at its end: :func:`prompt_attributes`)."""
    attrs = dict(_static(model))
    attrs[semconv.GEN_AI_REQUEST_STREAM] = stream
    if isinstance(settings, Mapping):
        sampling_attributes(settings, attrs)
    return attrs


def prompt_attributes(messages: Any, params: Any, memo: RunMemo | None = None) -> Attributes:
    """The messages sent and the tools offered (``memo``: the run's)."""
    attrs: Attributes = {semconv.GEN_AI_INPUT_MESSAGES: input_messages_json(messages, memo)}
    tools = tool_definitions_json(params)
    if tools is not None:
        attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = tools
    return attrs


_FINISH = {"stop": "stop", "length": "length", "content_filter": "content_filter", "tool_call": "tool_calls",
           "error": "error"}


def _finish_reason(response: Any) -> str | None:
    reason = getattr(response, "finish_reason", None)
    if isinstance(reason, str):
        return _FINISH.get(reason, reason)
    return None


def response_attributes(response: Any, request_model: str | None, memo: RunMemo | None = None,
                        reply: bool = True) -> Attributes:
    """The chat span's end attributes from a ``ModelResponse`` (what ``request`` returns, or a stream's ``get()``);
    its history JSON is kept in the run's ``memo`` for the next request, which re-sends it. ``reply=False``
    leaves the output message out (agl's span of the HTTP request below recorded it)."""
    attrs: Attributes = {}
    name = _text_attr(response, "model_name") or request_model
    if name is not None:
        attrs[semconv.GEN_AI_RESPONSE_MODEL] = name
    response_id = _text_attr(response, "provider_response_id")
    if response_id is not None:
        attrs[semconv.GEN_AI_RESPONSE_ID] = response_id
    usage = getattr(response, "usage", None)
    tokens = getattr(usage, "input_tokens", None)
    if type(tokens) is int:
        attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = tokens
    tokens = getattr(usage, "output_tokens", None)
    if type(tokens) is int:
        attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = tokens
    reason = _finish_reason(response)
    if reply:
        text = dumps(response_message(response))
        # the same JSON as dumps([{**response_message(response), "finish_reason": reason}]), its last key
        attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = (f"[{text[:-1]},\"finish_reason\":{dumps(reason)}}}]"
                                                 if reason is not None else f"[{text}]")
        if memo is not None and getattr(response, "kind", None) == "response":
            # the next request re-sends this response as history, and its JSON there is this one without the
            # finish reason (``_message_json``): remembered now rather than converted again then
            memo.remember(response, text)
    if reason is not None:
        attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = (reason,)
    return attrs


def unfinished(response: Any) -> bool:
    """A streamed response whose stream ended before the model finished (closed early, interrupted)."""
    state = getattr(response, "state", "complete")
    return isinstance(state, str) and state not in ("complete", "suspended")


# --------------------------------------------------------------------------- agents, graph nodes, tools


def agent_name(agent: Any) -> str:
    return _text_attr(agent, "name") or AGENT_FALLBACK_NAME


def agent_attributes(name: str) -> Attributes:
    return {semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT, semconv.GEN_AI_AGENT_NAME: name,
            semconv.AGL_PLUGIN: PLUGIN}


def node_attributes(node_id: str) -> Attributes:
    attrs = agent_attributes(node_id)
    attrs[GRAPH_NODE] = node_id
    return attrs


def tool_start_attributes(call: Any, kind: str, agent: str | None) -> Attributes:
    """The tool span's start attributes from the model's ``ToolCallPart``."""
    attrs: Attributes = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL, semconv.GEN_AI_TOOL_TYPE: "function",
                         semconv.AGL_PLUGIN: PLUGIN, TOOL_KIND: kind}
    name = getattr(call, "tool_name", None)
    if isinstance(name, str):
        attrs[semconv.GEN_AI_TOOL_NAME] = name
    call_id = getattr(call, "tool_call_id", None)
    if isinstance(call_id, str) and call_id:
        attrs[semconv.GEN_AI_TOOL_CALL_ID] = call_id
    attrs[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] = span_text(call.args_as_json_str())
    if agent:
        attrs[semconv.GEN_AI_AGENT_NAME] = agent
    return attrs


def tool_ok_attributes(result: Any) -> Attributes:
    attrs: Attributes = {semconv.AGL_TOOL_STATUS: semconv.TOOL_OK}
    if result is not None:
        attrs[semconv.GEN_AI_TOOL_CALL_RESULT] = span_text(result)
    return attrs


def _chain(exc: BaseException) -> Iterable[BaseException]:
    """``exc`` and what it was raised from or while handling (a timeout re-raised ``from None`` included)."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 16:
        yield current
        current = current.__cause__ or current.__context__
        seen += 1


def tool_failure(exc: BaseException, retry_types: tuple[type[BaseException], ...],
                 deferral_types: tuple[type[BaseException], ...]) -> tuple[str | None, str, str | None]:
    """How a tool call failed: ``(agl.tool.status, error.type, what the model is told)``.

    A retry the model is asked for (the tool raised ``ModelRetry`` or ``ToolFailed``, its arguments failed
    validation, it named no known tool) is ``error``; one whose chain holds a ``TimeoutError`` (Pydantic AI
    turns a tool's timeout into a retry) is ``timeout``; a deferral (``CallDeferred``, ``ApprovalRequired``) is
    no failure (status None); anything else is ``exception``, named by its type.
    """
    if isinstance(exc, deferral_types):
        return None, type(exc).__name__, None
    chain = list(_chain(exc))
    told = getattr(exc, "tool_retry", None) or getattr(exc, "tool_failed", None)
    if any(isinstance(e, TimeoutError) for e in chain):
        status, error_type = semconv.TOOL_TIMEOUT, "TimeoutError"
    elif any(isinstance(e, retry_types) for e in chain):
        # what the tool or the framework raised beneath the retry wrapper, else why the framework retried
        beneath = [e for e in chain[1:] if isinstance(e, Exception)]
        cause = getattr(getattr(told, "retry", None), "cause", None)
        status = semconv.TOOL_ERROR
        error_type = type(beneath[0]).__name__ if beneath else cause if isinstance(cause, str) else type(exc).__name__
    else:
        return semconv.TOOL_EXCEPTION, type(exc).__name__, None
    return status, error_type, _retry_text(told) if told is not None else None
