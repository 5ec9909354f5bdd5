"""agl's plugin for LangChain and LangGraph: every chat-model run a transition, every tool run a span.

Registered under the ``agl.instrumentors`` and ``opentelemetry_instrumentor``
entry-point groups as ``langchain``, so ``agl.instrument()`` finds it. See
:mod:`agl_langchain.instrumentor` for the hook (a callback handler added to
every LangChain callback manager through ``langchain_core``'s configure hook)
and what it covers, and :mod:`agl_langchain.attributes` for how LangChain's
messages, results and tool outputs become span attributes. Importing this
package does not import LangChain.

With agl's ``openai`` plugin active too (``agl.instrument()`` activates both), a
``ChatOpenAI`` call pointed at an OpenAI-compatible server that returns token
ids (vLLM's ``return_token_ids``, agl's gateway) becomes one transition with
those token ids.
"""

from agl_langchain.instrumentor import LangChainInstrumentor

__version__ = "0.1.0"

__all__ = ["LangChainInstrumentor", "__version__"]
