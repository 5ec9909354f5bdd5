"""CrewAI objects (LLMs, their calls and replies, tool events, agents, tasks, crews, flows) as span attributes.

The LLM-call functions run on every model call, so they read crewai's objects
attribute by attribute (no ``model_dump``), build each attribute dict once and
JSON-encode each message attribute once, with :mod:`agl_core.encoding`'s
encoder and the ``openai`` plugin's message memo (an agent re-sends its whole
conversation on every call; the memo keeps that from costing quadratic time).

crewai hands an LLM its conversation as OpenAI-format message dicts whatever
the provider, so they need no conversion before :func:`agl_core.messages.to_genai`.
A reply is a string, a list of tool calls in the provider's own shape (OpenAI
and LiteLLM objects or dicts, Anthropic ``ToolUseBlock``, Gemini ``Part``,
Bedrock dicts), or a pydantic object for structured output; :func:`reply_message`
turns each into one OpenAI assistant message. Nothing here imports crewai.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agl_core import encoding, semconv
from agl_core.encoding import dumps, sampling_attributes, span_text
from agl_core.messages import to_genai
from agl_core.openai_client.attributes import input_messages_json

Attributes = dict[str, Any]

# crewai's provider names -> the GenAI conventions' gen_ai.provider.name values (others pass through as they are)
_PROVIDERS = {
    "openai": "openai",
    "anthropic": "anthropic",
    "claude": "anthropic",
    "gemini": "gcp.gemini",
    "google": "gcp.gemini",
    "bedrock": "aws.bedrock",
    "aws": "aws.bedrock",
    "azure": "azure.ai.openai",
    "azure_openai": "azure.ai.openai",
    "deepseek": "deepseek",
    "groq": "groq",
    "mistral": "mistral_ai",
    "cohere": "cohere",
    "watsonx": "ibm.watsonx.ai",
    "xai": "x_ai",
    "perplexity": "perplexity",
}



def provider_name(llm: Any) -> str:
    """``gen_ai.provider.name`` for an LLM: its crewai ``provider``, in the conventions' spelling."""
    provider = getattr(llm, "provider", None)
    if not isinstance(provider, str) or not provider:
        return "crewai"
    return _PROVIDERS.get(provider.lower(), provider)


def _as_messages(messages: Any) -> list[Any] | None:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if isinstance(messages, list):
        return messages
    if isinstance(messages, tuple):
        return list(messages)
    return None


def tool_definitions(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """crewai's tool schemas (OpenAI format, or flat ``{name, description, parameters}``) in OpenAI format."""
    out: list[dict[str, Any]] = []
    for tool in tools:
        if type(tool) is dict and "function" in tool:  # what crewai's executors pass: OpenAI format already
            out.append(tool)
            continue
        if not isinstance(tool, Mapping):
            name = getattr(tool, "name", None)
            if name is None:
                continue
            tool = {"name": name, "description": getattr(tool, "description", None)}
        if "function" in tool:
            out.append(tool if isinstance(tool, dict) else dict(tool))
        else:
            fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            out.append({"type": "function", "function": fn})
    return out


def llm_request_attributes(llm: Any, messages: Any, tools: Any, agent: Any) -> Attributes:
    """The attributes of an LLM call known when it starts: ``llm.call(messages, tools, ..., from_agent=agent)``."""
    model = getattr(llm, "model", None)
    attrs: Attributes = {
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT,
        semconv.GEN_AI_PROVIDER_NAME: provider_name(llm),
        semconv.AGL_PLUGIN: "crewai",
        semconv.CREWAI_LLM_CLASS: type(llm).__name__,
    }
    if isinstance(model, str) and model:
        attrs[semconv.GEN_AI_REQUEST_MODEL] = model
    sampling_attributes(lambda field: getattr(llm, field, None), attrs)
    effective = getattr(llm, "_effective_stream", None)  # crewai's per-call streaming override included
    stream = effective() if callable(effective) else getattr(llm, "stream", None)
    if type(stream) is bool:
        attrs[semconv.GEN_AI_REQUEST_STREAM] = stream
    listed = _as_messages(messages)
    if listed is not None:
        attrs[semconv.GEN_AI_INPUT_MESSAGES] = input_messages_json(listed)
    if tools:
        attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = dumps(tool_definitions(tools))
    role = getattr(agent, "role", None) if agent is not None else None
    if isinstance(role, str) and role:
        attrs[semconv.GEN_AI_AGENT_NAME] = role
    return attrs


# --------------------------------------------------------------------------- replies


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else dumps(value if value is not None else {})


def tool_call(call: Any) -> dict[str, Any] | None:
    """One tool call in any provider's shape as an OpenAI tool call dict; None when it is not one."""
    if type(call) is dict or isinstance(call, Mapping):
        fn = call.get("function")
        if isinstance(fn, Mapping) and fn.get("name"):
            name, args = fn.get("name"), fn.get("arguments")
        elif call.get("name") and ("arguments" in call or "input" in call):  # Responses API item, Bedrock toolUse
            name, args = call.get("name"), call.get("arguments", call.get("input"))
        else:
            return None
        call_id = call.get("call_id") or call.get("id") or call.get("toolUseId")
    else:
        fn = getattr(call, "function", None)
        if fn is not None and getattr(fn, "name", None):  # OpenAI / LiteLLM objects
            name, args, call_id = fn.name, getattr(fn, "arguments", None), getattr(call, "id", None)
        elif getattr(call, "function_call", None) is not None:  # Gemini Part
            fc = call.function_call
            name, args, call_id = fc.name, dict(fc.args or {}), getattr(fc, "id", None)
        elif getattr(call, "name", None) and hasattr(call, "input"):  # Anthropic ToolUseBlock
            name, args, call_id = call.name, call.input, getattr(call, "id", None)
        else:
            return None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": _arguments(args)}}


def tool_calls(value: Any) -> list[dict[str, Any]] | None:
    """``value`` as OpenAI tool calls when it is a non-empty list of tool calls, else None."""
    if not isinstance(value, list) or not value:
        return None
    out = []
    for item in value:
        call = tool_call(item)
        if call is None:
            return None
        out.append(call)
    return out


def reply_message(reply: Any) -> dict[str, Any]:
    """What an LLM call gave back (a string, tool calls, a pydantic object) as one OpenAI assistant message."""
    if isinstance(reply, str):
        return {"role": "assistant", "content": reply}
    calls = tool_calls(reply)
    if calls is not None:
        return {"role": "assistant", "content": None, "tool_calls": calls}
    dump_json = getattr(reply, "model_dump_json", None)
    if dump_json is not None:
        return {"role": "assistant", "content": dump_json()}
    if reply is None:
        return {"role": "assistant", "content": None}
    return {"role": "assistant", "content": span_text(reply)}


def asked_tools_message(asked: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """The reply of a call that ran the tools it asked for itself (``available_functions``): those tool calls."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": None, "type": "function", "function": {"name": name, "arguments": _arguments(args)}}
                           for name, args in asked]}


def llm_response_attributes(message: Mapping[str, Any], usage: Any, finish_reason: Any,
                            response_id: Any) -> Attributes:
    """The attributes known when an LLM call ends: its reply and what crewai reported with it."""
    finish = finish_reason if isinstance(finish_reason, str) and finish_reason else None
    attrs: Attributes = {semconv.GEN_AI_OUTPUT_MESSAGES: dumps([to_genai(message, finish)])}
    if finish is not None:
        attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = (finish,)
    if isinstance(response_id, str) and response_id:
        attrs[semconv.GEN_AI_RESPONSE_ID] = response_id
    if type(usage) is dict or isinstance(usage, Mapping):
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if type(prompt) is int:
            attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] = prompt
        if type(completion) is int:
            attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = completion
    return attrs


# --------------------------------------------------------------------------- tools


def tool_start_attributes(name: str, call_id: str | None, arguments: Any) -> Attributes:
    attrs: Attributes = {
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL,
        semconv.GEN_AI_TOOL_NAME: name,
        semconv.GEN_AI_TOOL_TYPE: "function",
        semconv.AGL_PLUGIN: "crewai",
    }
    if call_id:
        attrs[semconv.GEN_AI_TOOL_CALL_ID] = call_id
    if arguments is not None:
        attrs[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] = span_text(arguments)
    return attrs


def failure_status(failure: Any) -> tuple[str, str, str]:
    """(agl.tool.status, error.type, message) for a crewai ``ToolFailure`` (a tool that did not succeed)."""
    reason = getattr(failure, "reason", None)
    reason_text = str(getattr(reason, "value", reason) or "tool_reported")
    message = str(getattr(failure, "message", "") or reason_text)
    status = semconv.TOOL_EXCEPTION if reason_text == "exception" else semconv.TOOL_ERROR
    return status, reason_text, message


def tool_end_attributes(status: str, result: Any, cache_hit: bool) -> Attributes:
    attrs: Attributes = {semconv.AGL_TOOL_STATUS: status, semconv.AGL_TOOL_CACHE_HIT: cache_hit}
    if result is not None:
        attrs[semconv.GEN_AI_TOOL_CALL_RESULT] = span_text(result)
    return attrs


# --------------------------------------------------------------------------- agents, tasks, crews, flows


def task_name(task: Any) -> str | None:
    """A task's name, or its description when it has none (crewai's own convention in its events)."""
    name = getattr(task, "name", None) or getattr(task, "description", None)
    return name if isinstance(name, str) and name else None


def _crew_of(owner: Any) -> Any:
    crew = getattr(owner, "crew", None)
    return crew if crew is not None and not isinstance(crew, str) else None


def _put_crew(attrs: Attributes, crew: Any) -> None:
    if crew is None:
        return
    name = getattr(crew, "name", None)
    if isinstance(name, str) and name:
        attrs[semconv.CREWAI_CREW_NAME] = name
    crew_id = getattr(crew, "id", None)
    if crew_id is not None:
        attrs[semconv.CREWAI_CREW_ID] = str(crew_id)


def _put_task(attrs: Attributes, task: Any) -> None:
    if task is None:
        return
    name = task_name(task)
    if name is not None and (encoding.capture_content or getattr(task, "name", None)):  # else it is the prompt
        attrs[semconv.CREWAI_TASK_NAME] = name
    task_id = getattr(task, "id", None)
    if task_id is not None:
        attrs[semconv.CREWAI_TASK_ID] = str(task_id)


def agent_role(agent: Any) -> str | None:
    role = getattr(agent, "role", None)
    return role if isinstance(role, str) and role else None


def agent_attributes(agent: Any, task: Any) -> Attributes:
    """An ``invoke_agent`` span: the agent (its role is its name), the task it works on, its crew."""
    attrs: Attributes = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT, semconv.AGL_PLUGIN: "crewai"}
    role = agent_role(agent)
    if role is not None:
        attrs[semconv.GEN_AI_AGENT_NAME] = role
    agent_id = getattr(agent, "id", None)
    if agent_id is not None:
        attrs[semconv.GEN_AI_AGENT_ID] = str(agent_id)
    _put_task(attrs, task)
    _put_crew(attrs, _crew_of(agent) or _crew_of(task))
    return attrs


def task_attributes(task: Any) -> Attributes:
    attrs: Attributes = {semconv.AGL_PLUGIN: "crewai"}
    _put_task(attrs, task)
    _put_crew(attrs, _crew_of(task) or _crew_of(getattr(task, "agent", None)))
    return attrs


def crew_attributes(crew: Any) -> Attributes:
    attrs: Attributes = {semconv.AGL_PLUGIN: "crewai"}
    _put_crew(attrs, crew)
    process = getattr(crew, "process", None)
    process = getattr(process, "value", process)
    if isinstance(process, str):
        attrs[semconv.CREWAI_CREW_PROCESS] = process
    return attrs


def flow_name(flow: Any) -> str:
    name = getattr(flow, "name", None)
    return name if isinstance(name, str) and name else type(flow).__name__


def flow_attributes(flow: Any) -> Attributes:
    attrs: Attributes = {semconv.AGL_PLUGIN: "crewai", semconv.CREWAI_FLOW_NAME: flow_name(flow)}
    flow_id = getattr(flow, "flow_id", None)
    if flow_id is not None:
        attrs[semconv.CREWAI_FLOW_ID] = str(flow_id)
    return attrs
