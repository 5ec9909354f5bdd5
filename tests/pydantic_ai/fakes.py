"""What the suite's tests share: models on the fake server, span selectors."""

from __future__ import annotations

from typing import Any

from agl_core import semconv
from agl_core.schema import Span
from agl_core.testing import FakeOpenAI


def chat_model(srv: FakeOpenAI, name: str = "fake-model") -> Any:
    """An ``OpenAIChatModel`` on the fake server (explicit key, none from the environment, no retries)."""
    from openai import AsyncOpenAI
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = AsyncOpenAI(base_url=srv.url, api_key="not-a-key", max_retries=0)
    return OpenAIChatModel(name, provider=OpenAIProvider(openai_client=client))


def spans(run: Any, operation: str) -> list[Span]:
    return [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == operation]


def by_plugin(items: list[Span], plugin: str) -> list[Span]:
    return [s for s in items if s.attributes.get(semconv.AGL_PLUGIN) == plugin]
