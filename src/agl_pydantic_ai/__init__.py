"""agl's plugin for Pydantic AI (``pydantic-ai-slim >= 2.60, < 3``, and ``pydantic-graph``).

Registered under the ``agl.instrumentors`` entry point as ``pydantic_ai``; see
:mod:`agl_pydantic_ai.instrumentor` for the hooks and what they cover (every
``Model`` class, user subclasses and classes defined later included;
``run``, ``run_sync``, ``run_stream``, ``run_stream_events`` and ``iter``; tools
and output tools with outcomes; agent delegation and graph nodes; Pydantic AI's
own instrumentation on or off), and :mod:`agl_pydantic_ai.attributes` for how
Pydantic AI's messages, responses and tool calls become span attributes.
Importing this package does not import ``pydantic_ai``.

With ``agl.instrument()`` the ``openai`` plugin is active too, and a model that
talks to an OpenAI-compatible server through the ``openai`` client
(``OpenAIChatModel``) also gets that plugin's span, nested in this one's and
merged with it into one transition, with the server's token ids when it
returns them.
"""

from __future__ import annotations

from agl_pydantic_ai.instrumentor import PydanticAIInstrumentor

__version__ = "0.1.0"

__all__ = ["PydanticAIInstrumentor", "__version__"]
