"""agl's plugin for CrewAI (``crewai >= 1.15, < 2``): LLM calls, tool uses, agents, tasks, crews and flows as spans.

Registered under the ``agl.instrumentors`` entry point as ``crewai``; see
:mod:`agl_crewai.instrumentor` for the hooks and what they cover, and
:mod:`agl_crewai.attributes` for how crewai's objects become span attributes.
Importing this package does not import ``crewai``.
"""

from agl_crewai.instrumentor import CrewAIInstrumentor

__version__ = "0.1.0"

__all__ = ["CrewAIInstrumentor", "__version__"]
