"""agl's plugin for the OpenAI Python client: a GenAI ``chat`` span per chat-completion call.

Registered under the ``agl.instrumentors`` entry point as ``openai``; see
:mod:`agl_core.openai_client.instrumentor` for the hook and what it covers, and
:mod:`agl_core.openai_client.attributes` for how requests, responses and stream
chunks become span attributes. Importing this package does not import ``openai``.
"""

from agl_core.openai_client.instrumentor import OpenAIInstrumentor

__all__ = ["OpenAIInstrumentor"]
