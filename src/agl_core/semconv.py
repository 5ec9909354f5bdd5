"""Span and attribute names agl emits and reads, in one place.

LLM, tool and agent spans follow the OpenTelemetry GenAI semantic conventions
(``gen_ai.*``), so any OTel backend shows them as GenAI spans. What the
conventions do not cover (rollouts, rewards, token ids for training, tool
outcomes for AIR) lives under ``agl.*``.

Message attributes (``gen_ai.input.messages`` / ``gen_ai.output.messages``) hold
JSON in the conventions' parts format; ``agl_core.messages`` converts to and from
OpenAI chat messages.
"""

from __future__ import annotations

from typing import Final

# --- GenAI semantic conventions: span names -----------------------------------------
OP_CHAT: Final = "chat"
OP_TEXT_COMPLETION: Final = "text_completion"
OP_GENERATE_CONTENT: Final = "generate_content"
OP_EXECUTE_TOOL: Final = "execute_tool"
OP_INVOKE_AGENT: Final = "invoke_agent"
OP_CREATE_AGENT: Final = "create_agent"
LLM_OPERATIONS: Final = frozenset({OP_CHAT, OP_TEXT_COMPLETION, OP_GENERATE_CONTENT})


def chat_span_name(model: str | None) -> str:
    return f"{OP_CHAT} {model}" if model else OP_CHAT


def tool_span_name(tool: str | None) -> str:
    return f"{OP_EXECUTE_TOOL} {tool}" if tool else OP_EXECUTE_TOOL


def tool_pause_span_name(tool: str | None) -> str:
    return f"{OP_TOOL_PAUSE} {tool}" if tool else OP_TOOL_PAUSE


def agent_span_name(agent: str | None) -> str:
    return f"{OP_INVOKE_AGENT} {agent}" if agent else OP_INVOKE_AGENT


# --- GenAI semantic conventions: attributes -----------------------------------------
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_SYSTEM: Final = "gen_ai.system"  # the older name of provider.name; read, never written
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_REQUEST_TEMPERATURE: Final = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P: Final = "gen_ai.request.top_p"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_SEED: Final = "gen_ai.request.seed"
GEN_AI_REQUEST_STREAM: Final = "gen_ai.request.stream"  # not in the conventions yet; widely used
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
GEN_AI_INPUT_MESSAGES: Final = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES: Final = "gen_ai.output.messages"
GEN_AI_SYSTEM_INSTRUCTIONS: Final = "gen_ai.system_instructions"
GEN_AI_TOOL_DEFINITIONS: Final = "gen_ai.tool.definitions"
GEN_AI_TOOL_NAME: Final = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID: Final = "gen_ai.tool.call.id"
GEN_AI_TOOL_CALL_ARGUMENTS: Final = "gen_ai.tool.call.arguments"
GEN_AI_TOOL_CALL_RESULT: Final = "gen_ai.tool.call.result"
GEN_AI_TOOL_TYPE: Final = "gen_ai.tool.type"
GEN_AI_AGENT_NAME: Final = "gen_ai.agent.name"
GEN_AI_AGENT_ID: Final = "gen_ai.agent.id"
GEN_AI_CONVERSATION_ID: Final = "gen_ai.conversation.id"
ERROR_TYPE: Final = "error.type"
SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"

# --- agl's own attributes ---------------------------------------------------------------
AGL_ROLLOUT_ID: Final = "agl.rollout.id"
AGL_ROLLOUT_ATTEMPT: Final = "agl.rollout.attempt"
AGL_TASK_ID: Final = "agl.task.id"
AGL_SPAN_KIND: Final = "agl.span.kind"  # rollout | reward | message | object | exception
AGL_REWARD_VALUE: Final = "agl.reward.value"
AGL_REWARD_NAME: Final = "agl.reward.name"
AGL_MESSAGE_BODY: Final = "agl.message.body"
AGL_OBJECT_JSON: Final = "agl.object.json"
AGL_PLUGIN: Final = "agl.plugin"  # which plugin made the span: "openai", "langchain", ...
OTEL_SCOPE_NAME: Final = "otel.scope.name"  # a span that came over OTLP: the instrumentation scope that made it
AGL_PROMPT_TOKEN_IDS: Final = "agl.llm.prompt_token_ids"
AGL_RESPONSE_TOKEN_IDS: Final = "agl.llm.response_token_ids"
AGL_RESPONSE_LOGPROBS: Final = "agl.llm.response_logprobs"
AGL_TOKEN_SOURCE: Final = "agl.llm.token_source"
AGL_FROZEN_MODEL: Final = "agl.llm.frozen_model"
AGL_POLICY: Final = "agl.llm.policy"  # several policies in one run: the one that answered this call
AGL_POLICY_NOTE: Final = "agl.llm.policy_note"  # ... or why the base model did (its agent matched no policy)
"""The frozen model (a gateway upstream, not the policy) that answered this call: it is never a transition."""
AGL_TOOL_STATUS: Final = "agl.tool.status"  # ok | error | exception | timeout | rejected | pending
AGL_TOOL_CACHE_HIT: Final = "agl.tool.cache_hit"
AGL_UNTRAINABLE: Final = "agl.untrainable"
"""Why a span that looks like a model call cannot be trained (an OTLP span in no convention agl reads): the
builder lists the call in ``Trajectory.skipped`` with this reason."""

# agl.span.kind values
KIND_ROLLOUT: Final = "rollout"
KIND_REWARD: Final = "reward"
KIND_MESSAGE: Final = "message"
KIND_OBJECT: Final = "object"
KIND_EXCEPTION: Final = "exception"

# agl.tool.status values
TOOL_OK: Final = "ok"
TOOL_ERROR: Final = "error"  # the tool returned an error result
TOOL_EXCEPTION: Final = "exception"  # the tool raised
TOOL_TIMEOUT: Final = "timeout"
TOOL_REJECTED: Final = "rejected"  # refused before it ran: a "no" to an approval request, a tool guardrail
TOOL_PENDING: Final = "pending"  # paused for a decision (an approval, LangGraph's interrupt()): no outcome yet

# a tool call that paused for a decision is not a tool execution: its span is ``tool_pause {tool}`` with this
# operation (agl's own, not a GenAI one), so it is never counted as an ``execute_tool`` span or rewarded
OP_TOOL_PAUSE: Final = "tool_pause"

# span names of agl's own spans
SPAN_ROLLOUT: Final = "agl.rollout"
SPAN_REWARD: Final = "agl.reward"
SPAN_MESSAGE: Final = "agl.message"
SPAN_OBJECT: Final = "agl.object"
SPAN_EXCEPTION: Final = "agl.exception"

TRACER_NAME: Final = "agl"

# --- openai_agents
AGL_HANDOFF_FROM_AGENT: Final = "agl.handoff.from_agent"  # on a handoff span: the agent handing over
AGL_HANDOFF_TO_AGENT: Final = "agl.handoff.to_agent"  # ... and the agent taking over
AGL_GUARDRAIL_NAME: Final = "agl.guardrail.name"
AGL_GUARDRAIL_TRIGGERED: Final = "agl.guardrail.triggered"  # the guardrail's tripwire fired

# --- langchain
AGL_LLM_INVOCATION_PARAMETERS: Final = "agl.llm.invocation_parameters"  # JSON: the model's other call parameters

# --- crewai
CREWAI_CREW_NAME: Final = "agl.crewai.crew.name"  # on crew, task and agent spans: the crew they run in
CREWAI_CREW_ID: Final = "agl.crewai.crew.id"
CREWAI_CREW_PROCESS: Final = "agl.crewai.crew.process"  # sequential | hierarchical
CREWAI_TASK_NAME: Final = "agl.crewai.task.name"  # the task's name, or its description when it has none
CREWAI_TASK_ID: Final = "agl.crewai.task.id"
CREWAI_FLOW_NAME: Final = "agl.crewai.flow.name"
CREWAI_FLOW_ID: Final = "agl.crewai.flow.id"
CREWAI_LLM_CLASS: Final = "agl.crewai.llm.class"  # the BaseLLM class that served the call: OpenAICompletion, LLM, ...

# --- agent_framework
GEN_AI_OUTPUT_TYPE: Final = "gen_ai.output.type"  # the conventions' name; "json" on a structured-output request
