"""Fake chat models for the ``langchain`` plugin's tests: LangChain's own ``GenericFakeChatModel``, made agent-ready.

``GenericFakeChatModel`` replays scripted ``AIMessage`` s but cannot bind tools
(so no agent can use it) and streams only the text of a message. :class:`FakeChat`
binds tools the way provider models do (OpenAI tool definitions in the call's
``tools`` parameter), and streams tool calls, usage and response metadata as
well, so streamed and non-streamed runs give the same message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.utils.function_calling import convert_to_openai_tool
from opentelemetry import trace


def ai(content: str = "", *, calls: Sequence[tuple[str, dict[str, Any], str]] = (), **kwargs: Any) -> AIMessage:
    """An ``AIMessage``: ``calls`` are ``(tool name, arguments, call id)``."""
    return AIMessage(content=content, tool_calls=[{"name": n, "args": a, "id": i, "type": "tool_call"}
                                                  for n, a, i in calls], **kwargs)


class FakeChat(GenericFakeChatModel):
    """``GenericFakeChatModel`` that binds tools and streams whole messages (tool calls and usage included)."""

    model: str = "fake-chat"  # what provider models call their model name, so LangChain reports it as one

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None,
                   **kwargs: Any) -> Runnable[Any, AIMessage]:
        formatted = [t if isinstance(t, dict) else convert_to_openai_tool(t) for t in tools]
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        return self.bind(tools=formatted, **kwargs)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        result = self._generate(messages, stop=stop, run_manager=run_manager, **kwargs)
        message = result.generations[0].message
        assert isinstance(message, AIMessage)
        text = message.content if isinstance(message.content, str) else ""
        for word in re.split(r"(\s)", text) if text else ():
            yield ChatGenerationChunk(message=AIMessageChunk(content=word, id=message.id))
        yield ChatGenerationChunk(message=AIMessageChunk(
            content="", id=message.id, chunk_position="last", usage_metadata=message.usage_metadata,
            response_metadata=message.response_metadata,
            tool_call_chunks=[{"name": c["name"], "args": json.dumps(c["args"]), "id": c["id"], "index": i}
                              for i, c in enumerate(message.tool_calls)],
        ))


class FailingChat(FakeChat):
    """Raises the given exception on every call."""

    error: BaseException

    def _generate(self, *args: Any, **kwargs: Any) -> ChatResult:
        raise self.error


class SpyChat(FakeChat):
    """Records the OpenTelemetry span current while the model's own code runs (per produced chunk when streaming)."""

    seen: list[trace.Span]

    def _generate(self, *args: Any, **kwargs: Any) -> ChatResult:
        self.seen.append(trace.get_current_span())
        return super()._generate(*args, **kwargs)

    def _stream(self, *args: Any, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        for chunk in super()._stream(*args, **kwargs):
            self.seen.append(trace.get_current_span())
            yield chunk


def script(*replies: AIMessage | str) -> Iterator[AIMessage | str]:
    return iter(replies)
