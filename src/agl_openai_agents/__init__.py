"""agl's plugin for the OpenAI Agents SDK (``openai-agents``): a span per model call, agent, tool, handoff, guardrail.

Registered under the ``agl.instrumentors`` entry point as ``openai_agents``; see
:mod:`agl_openai_agents.instrumentor` for the hooks and what they cover (every
``Model`` implementation, user subclasses included; ``Runner.run``, ``run_sync``
and ``run_streamed``; traced or not), and :mod:`agl_openai_agents.attributes`
for how the SDK's Responses-format items become span attributes and chat
messages. Importing this package does not import ``agents``.

With ``agl.instrument()`` the ``openai`` plugin is active too, and a model that
talks to an OpenAI-compatible server through the ``openai`` client
(``OpenAIChatCompletionsModel``) also gets that plugin's span, nested in this
one's and merged with it into one transition, with the server's token ids when
it returns them.
"""

from __future__ import annotations

from agl_openai_agents.instrumentor import OpenAIAgentsInstrumentor

__version__ = "0.1.0"

__all__ = ["OpenAIAgentsInstrumentor", "__version__"]
