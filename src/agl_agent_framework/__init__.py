"""agl plugin for Microsoft Agent Framework (``agent-framework-core >= 1.23, < 2``, ``agent-framework-openai``).

Registered under the ``agl.instrumentors`` entry point as ``agent_framework``;
see :mod:`agl_agent_framework.instrumentor` for the hooks and what they cover,
and :mod:`agl_agent_framework.attributes` for how the framework's messages,
responses and tool calls become span attributes. Importing this package does
not import Agent Framework.
"""

from __future__ import annotations

from agl_agent_framework.instrumentor import AgentFrameworkInstrumentor

__version__ = "0.1.0"

__all__ = ["AgentFrameworkInstrumentor", "__version__"]
