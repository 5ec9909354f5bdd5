"""agl plugin for the OpenAI Agents SDK (``openai-agents >= 0.2``): packaged, not capturing yet.

The plugin is registered under the ``agl.instrumentors`` and
``opentelemetry_instrumentor`` entry-point groups, so ``agl.instrument()`` finds
it; until its hooks land, activation reports it as skipped with the reason.

Planned hook: a ``TracingProcessor`` added with ``agents.add_trace_processor``.
The SDK opens its own span for every agent turn, model call, function tool and
handoff, on the sync, async and streamed runners alike, so one processor sees
them all, where wrapping ``Runner`` methods would miss the model calls inside.
"""

from __future__ import annotations

from typing import ClassVar

from agl_core.plugin import Instrumentor

__version__ = "0.1.0"

__all__ = ["OpenAIAgentsInstrumentor", "__version__"]


class OpenAIAgentsInstrumentor(Instrumentor):
    """Turns OpenAI Agents SDK agent, model and tool spans into agl spans (not capturing yet)."""

    name: ClassVar[str] = "openai_agents"
    framework: ClassVar[str] = "agents"
    requirements: ClassVar[tuple[str, ...]] = ("openai-agents >= 0.2",)
