"""agl plugin for AutoGen agentchat (``autogen-agentchat >= 0.7, < 0.8``, ``autogen-core``, ``autogen-ext``).

Registered under the ``agl.instrumentors`` entry point as ``autogen``; see
:mod:`agl_autogen.instrumentor` for the hooks and what they cover, and
:mod:`agl_autogen.attributes` for how AutoGen's messages, results and tool
calls become span attributes. Importing this package does not import AutoGen.
"""

from __future__ import annotations

from agl_autogen.instrumentor import SELECTOR, AutoGenInstrumentor

__version__ = "0.1.0"

__all__ = ["SELECTOR", "AutoGenInstrumentor", "__version__"]
