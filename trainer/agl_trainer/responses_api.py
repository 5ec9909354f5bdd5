"""``POST /v1/responses``: the OpenAI Responses API, answered through the gateway's chat path.

An agent on a Responses client (the OpenAI SDK's ``client.responses``, Agent
Framework's ``OpenAIResponsesClient``, Pydantic AI's ``OpenAIResponsesModel``)
talks to the policy as a chat-completions agent does: the request becomes the
chat request it stands for (:func:`agl_core.openai_client.responses_items.chat_request`:
instructions and input items as chat messages, function tools as chat tools,
``text.format`` as ``response_format``), the gateway answers that as any chat
call (the model rule, sampling, frozen models, cancelling) and records its exact
token ids under the request's ``traceparent``, and the chat reply comes back as
a ``Response`` (:class:`~agl_core.openai_client.responses_items.ResponseWriter`):
a ``message`` output item for the text, a ``function_call`` item per tool call.
Streamed, the chat chunks become the Responses events (``response.created``,
``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, their ``.done`` events and
``response.completed``), as ``event:``/``data:`` pairs; the ids are still read
chunk by chunk, and a failure mid-stream is an ``error`` event, on which the
SDK raises.

The gateway keeps no responses: ``previous_response_id``, ``conversation`` and
``item_reference`` items name stored state and are refused (400 naming the
field), and so are hosted tools; the agent sends its whole conversation, as a
chat agent does (Agent Framework and Pydantic AI do with ``store`` off).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.responses import Response, StreamingResponse

from agl_core.openai_client.responses_items import ItemError, ResponseWriter, chat_request
from agl_trainer.api import ApiError

__all__ = ["ResponsesCall"]

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


def sse(event: Mapping[str, Any]) -> bytes:
    """One Responses event on the wire: its type as the SSE ``event:``, the event as ``data:``."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + _dumps(event).encode() + b"\n\n"


class ResponsesCall:
    """One ``POST /v1/responses``: the chat request it stands for (``chat``), and its answer made a Response."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        try:
            self.chat = chat_request(body)
        except ItemError as exc:
            raise ApiError(400, str(exc), exc.field) from None
        self.writer = ResponseWriter(body, f"resp_{uuid.uuid4().hex}", int(time.time()))

    def answer(self, reply: Response) -> Response:
        """The chat path's answer as the Responses API's; an error passes as it is (the same error body)."""
        if isinstance(reply, StreamingResponse):
            reply.body_iterator = self._events(reply.body_iterator)
            return reply
        if reply.status_code != 200:
            return reply
        return Response(_dumps(self.writer.response(json.loads(bytes(reply.body)))), media_type="application/json")

    async def _events(self, chunks: AsyncIterator[Any]) -> AsyncIterator[bytes]:
        """The chat path's SSE events (one ``data:`` event per piece) as the Responses API's."""
        writer = self.writer
        try:
            async for piece in chunks:
                raw = piece if isinstance(piece, bytes) else str(piece).encode()
                for line in raw.split(b"\n"):
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:]
                    if payload == b"[DONE]":
                        for event in writer.done():
                            yield sse(event)
                        return
                    chunk = json.loads(payload)
                    if "error" in chunk and "choices" not in chunk:
                        error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
                        yield sse(writer.event("error", error=error, message=error.get("message"),
                                               code=error.get("code"), param=error.get("param")))
                        return
                    for event in writer.add(chunk):
                        yield sse(event)
        finally:
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()
