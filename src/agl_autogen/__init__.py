"""agl plugin for AutoGen agentchat (``autogen-agentchat >= 0.7, < 0.8``): packaged, not capturing yet.

The plugin is registered under the ``agl.instrumentors`` and
``opentelemetry_instrumentor`` entry-point groups, so ``agl.instrument()`` finds
it; until its hooks land, activation reports it as skipped with the reason.

Planned hook: patches on the ``ChatCompletionClient`` implementations'
``create`` and ``create_stream`` and on ``BaseTool.run_json``. Every agentchat
agent and team reaches the model and its tools through these two interfaces,
sync or streamed, whichever agent class drives them.
"""

from __future__ import annotations

from typing import ClassVar

from agl_core.plugin import Instrumentor

__version__ = "0.1.0"

__all__ = ["AutoGenInstrumentor", "__version__"]


class AutoGenInstrumentor(Instrumentor):
    """Turns AutoGen agentchat model and tool calls into agl spans (not capturing yet)."""

    name: ClassVar[str] = "autogen"
    framework: ClassVar[str] = "autogen_agentchat"
    requirements: ClassVar[tuple[str, ...]] = ("autogen-agentchat >= 0.7, < 0.8",)
