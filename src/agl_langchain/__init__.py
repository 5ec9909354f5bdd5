"""agl plugin for LangChain and LangGraph (``langchain-core >= 0.3``): packaged, not capturing yet.

The plugin is registered under the ``agl.instrumentors`` and
``opentelemetry_instrumentor`` entry-point groups, so ``agl.instrument()`` finds
it; until its hooks land, activation reports it as skipped with the reason.

Planned hook: a callback handler added to every ``CallbackManager`` through
``langchain_core``'s configure hook. ``CallbackManager.configure`` runs for every
runnable call, so one handler sees sync, async, streaming and batch runs alike,
including LangGraph nodes, where patching individual chat-model classes would
miss subclasses and third-party integrations.
"""

from __future__ import annotations

from typing import ClassVar

from agl_core.plugin import Instrumentor

__version__ = "0.1.0"

__all__ = ["LangChainInstrumentor", "__version__"]


class LangChainInstrumentor(Instrumentor):
    """Turns LangChain chat-model and tool runs into agl spans (not capturing yet)."""

    name: ClassVar[str] = "langchain"
    framework: ClassVar[str] = "langchain_core"
    requirements: ClassVar[tuple[str, ...]] = ("langchain-core >= 0.3",)
