"""agl plugin for CrewAI (``crewai >= 1.0, < 2``): packaged, not capturing yet.

The plugin is registered under the ``agl.instrumentors`` and
``opentelemetry_instrumentor`` entry-point groups, so ``agl.instrument()`` finds
it; until its hooks land, activation reports it as skipped with the reason.

Planned hook: handlers on CrewAI's event bus for its LLM-call, tool-usage and
agent-execution events. CrewAI emits them from every code path that calls a
model or a tool, whichever LLM provider is behind it, so LLM spans exist even
where no client library is instrumented.
"""

from __future__ import annotations

from typing import ClassVar

from agl_core.plugin import Instrumentor

__version__ = "0.1.0"

__all__ = ["CrewAIInstrumentor", "__version__"]


class CrewAIInstrumentor(Instrumentor):
    """Turns CrewAI LLM calls, tool uses and agent steps into agl spans (not capturing yet)."""

    name: ClassVar[str] = "crewai"
    framework: ClassVar[str] = "crewai"
    requirements: ClassVar[tuple[str, ...]] = ("crewai >= 1.0, < 2",)
