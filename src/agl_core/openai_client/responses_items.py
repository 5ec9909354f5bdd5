"""OpenAI Responses API requests and outputs as OpenAI chat messages and tools, the one format agl trains on.

Shared by agl's ``openai`` plugin (a ``responses.create`` call's span records
the chat messages its input stands for) and agl's gateway (which answers
``POST /v1/responses`` through the engine's chat path), so the prompt on a span
and the prompt the engine tokenised are the same messages.

The mapping is the one the Responses API documents against Chat Completions:
``instructions`` is a first ``system`` message; an input string is one ``user``
message; ``message`` items keep their role and their text, image and refusal
parts; a ``function_call`` item is a tool call of the assistant message before
it (consecutive calls share one message, as a chat reply holds them);
``function_call_output`` is a ``tool`` message; ``reasoning`` items become the
next assistant message's ``reasoning_content``. Function tools become chat
tools. Hosted tools (web search, file search, ...) and items that point at
stored state (``item_reference``) stand for nothing a chat model can be given:
:class:`ItemError` names them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agl_core.messages import as_dict

__all__ = ["ItemError", "ResponseWriter", "chat_request", "chat_response_format", "chat_tool_choice", "chat_tools",
           "input_messages", "output_message"]

Message = dict[str, Any]

_ROLES = frozenset({"user", "system", "developer", "assistant"})


class ItemError(ValueError):
    """A Responses request that has no chat equivalent; ``field`` names where (``input[2].call_id``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"'{field}' {message}")
        self.field = field


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise ItemError(field, f"must be a string, got {type(value).__name__}")
    return value


def _object(raw: Any, field: str) -> dict[str, Any]:
    """A request's JSON object, or an SDK object (a pydantic model) as one; :class:`ItemError` for anything else."""
    if isinstance(raw, dict):
        return raw
    if hasattr(raw, "model_dump"):
        return as_dict(raw)
    raise ItemError(field, f"must be an object, got {type(raw).__name__}")


def _part(raw: Any, field: str) -> dict[str, Any]:
    part = _object(raw, field)
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": _text(part.get("text"), f"{field}.text")}
    if kind == "refusal":
        return {"type": "refusal", "refusal": _text(part.get("refusal"), f"{field}.refusal")}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise ItemError(f"{field}.image_url", "must be an image URL (a file_id names stored state the "
                                                  "chat path cannot read)")
        return {"type": "image_url", "image_url": {"url": url}}
    raise ItemError(f"{field}.type", f"must be input_text, output_text, refusal or input_image, got {kind!r}")


def _content(content: Any, field: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ItemError(field, "must be a string or an array of content parts")
    parts = [_part(p, f"{field}[{i}]") for i, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)  # one chat string: what a chat template renders
    return parts


def _tool_output(output: Any, field: str) -> str | list[dict[str, Any]]:
    if isinstance(output, str):
        return output
    if isinstance(output, (list, tuple)):
        return _content(output, field)
    raise ItemError(field, "must be a string or an array of content parts")


def input_messages(input: Any, instructions: Any = None, *, field: str = "input") -> list[Message]:  # noqa: A002
    """The chat messages that a Responses request's ``instructions`` and ``input`` stand for."""
    messages: list[Message] = []
    if instructions is not None:
        messages.append({"role": "system", "content": _text(instructions, "instructions")})
    if isinstance(input, str):
        messages.append({"role": "user", "content": input})
        return messages
    if not isinstance(input, (list, tuple)):
        raise ItemError(field, "must be a string or an array of input items")
    reasoning: str | None = None
    calls_to: Message | None = None  # the assistant message that the next function_call joins
    for i, raw in enumerate(input):
        where = f"{field}[{i}]"
        item = _object(raw, where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:  # a dict or list role is unhashable
                raise ItemError(f"{where}.role", f"must be one of {', '.join(sorted(_ROLES))}, got {role!r}")
            message: Message = {"role": role, "content": _content(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
            calls_to = message if role == "assistant" else None
        elif kind == "function_call":
            call = {"id": _text(item.get("call_id"), f"{where}.call_id"), "type": "function",
                    "function": {"name": _text(item.get("name"), f"{where}.name"),
                                 "arguments": _text(item.get("arguments"), f"{where}.arguments")}}
            if calls_to is None:
                calls_to = {"role": "assistant", "content": None}
                if reasoning is not None:
                    calls_to["reasoning_content"], reasoning = reasoning, None
                messages.append(calls_to)
            calls_to.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _text(item.get("call_id"), f"{where}.call_id"),
                             "content": _tool_output(item.get("output"), f"{where}.output")})
            calls_to = None
        elif kind == "reasoning":
            summary = item.get("summary") or ()
            texts = [as_dict(s).get("text") for s in summary] if isinstance(summary, (list, tuple)) else []
            reasoning = "".join(t for t in texts if isinstance(t, str)) or None
        else:
            raise ItemError(f"{where}.type", f"must be message, function_call, function_call_output or reasoning, "
                                             f"got {kind!r} (items that name stored state or hosted tools have "
                                             "no chat equivalent)")
    return messages


def chat_tools(tools: Any, *, field: str = "tools") -> list[dict[str, Any]]:
    """Responses function tools (``{"type": "function", "name", "parameters", ...}``) as chat tools."""
    if not isinstance(tools, (list, tuple)):
        raise ItemError(field, "must be an array of tools")
    out = []
    for i, raw in enumerate(tools):
        tool = _object(raw, f"{field}[{i}]")
        if tool.get("type") != "function":
            raise ItemError(f"{field}[{i}].type", f"must be 'function', got {tool.get('type')!r} (a hosted tool "
                                                  "runs on OpenAI's side; the model behind this one has none)")
        fn: dict[str, Any] = {"name": _text(tool.get("name"), f"{field}[{i}].name")}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any, *, field: str = "tool_choice") -> Any:
    """A Responses ``tool_choice`` as the chat one: the same words, or ``{"type": "function", "function": ...}``."""
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": _text(choice.get("name"), f"{field}.name")}}
    raise ItemError(field, f"must be auto, none, required or a function, got {choice!r}")


def chat_response_format(text: Any, *, field: str = "text") -> dict[str, Any] | None:
    """A Responses ``text.format`` as the chat ``response_format``; None for plain text."""
    if not isinstance(text, Mapping):
        raise ItemError(field, "must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise ItemError(f"{field}.format", "must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if fmt.get(key) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise ItemError(f"{field}.format.type", f"must be text, json_object or json_schema, got {kind!r}")


def output_message(output: Any, status: Any = None, incomplete_reason: Any = None) -> tuple[Message, str]:
    """A response's ``output`` items as the one assistant chat message they stand for, and its finish reason."""
    texts: list[str] = []
    refusal: str | None = None
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for raw in output or ():
        item = raw if isinstance(raw, dict) else as_dict(raw)
        kind = item.get("type")
        if kind == "message":
            for part in item.get("content") or ():
                part = part if isinstance(part, dict) else as_dict(part)
                if part.get("type") == "output_text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif part.get("type") == "refusal":
                    refusal = part.get("refusal")
        elif kind == "function_call":
            calls.append({"id": item.get("call_id"), "type": "function",
                          "function": {"name": item.get("name"), "arguments": item.get("arguments")}})
        elif kind == "reasoning":
            for part in item.get("summary") or ():
                text = (part if isinstance(part, dict) else as_dict(part)).get("text")
                if isinstance(text, str):
                    reasoning.append(text)
    message: Message = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if refusal and not texts:
        message["content"] = [{"type": "refusal", "refusal": refusal}]
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        finish = "tool_calls"
    elif status == "incomplete":
        finish = "content_filter" if incomplete_reason == "content_filter" else "length"
    else:
        finish = "stop"
    return message, finish


# --------------------------------------------------------------------------- chat replies as Responses


class ResponseWriter:
    """A chat reply to a Responses request, written as the Responses API answers it.

    :meth:`response` turns a chat completion into the ``Response``; for a stream, :meth:`add` turns each
    chat chunk into the Responses events it stands for (each output item opened when its first delta
    comes: ``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``,
    ``response.function_call_arguments.delta``) and :meth:`done` closes them (their ``.done`` events)
    and ends with ``response.completed`` (``response.incomplete`` when the model ran out of tokens).
    Only the first choice is read: one request is one transition. Token ids the chat reply carries
    (vLLM's ``return_token_ids``) are kept on the ``Response`` as ``prompt_token_ids`` and ``token_ids``.
    """

    def __init__(self, request: Mapping[str, Any], response_id: str, created: int) -> None:
        self.request = request
        self.id = response_id
        self.created = created
        self.seq = 0
        self.model: Any = None
        self.started = False
        self.items: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the open text item of a stream
        self.calls: dict[Any, dict[str, Any]] = {}  # chat tool-call index -> its open function_call item
        self.finish: Any = None
        self.usage: Any = None
        self.prompt_ids: Any = None
        self.token_ids: list[int] | None = None

    def shell(self, status: str) -> dict[str, Any]:
        body = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": [], "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "max_output_tokens": body.get("max_output_tokens"), "store": False,
            "text": body.get("text") or {"format": {"type": "text"}}, "usage": None,
        }

    def _text_item(self) -> dict[str, Any]:
        item = {"type": "message", "id": f"msg_{self.id.removeprefix('resp_')}", "status": "completed",
                "role": "assistant", "content": [{"type": "output_text", "text": "", "annotations": []}]}
        self.items.append(item)
        return item

    def _call_item(self, call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
        item = {"type": "function_call", "id": f"fc_{self.id.removeprefix('resp_')}_{len(self.items)}",
                "call_id": call_id, "name": name, "arguments": arguments or "", "status": "completed"}
        self.items.append(item)
        return item

    def response(self, completion: Mapping[str, Any]) -> dict[str, Any]:
        """A chat completion as the ``Response`` it answers."""
        self.model = completion.get("model")
        choices = completion.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") or {}
        calls = [c for c in message.get("tool_calls") or () if isinstance(c, dict)]
        if message.get("content") or not calls:
            self._text_item()["content"][0]["text"] = message.get("content") or ""
        for call in calls:
            fn = call.get("function") or {}
            self._call_item(call.get("id"), fn.get("name"), fn.get("arguments"))
        self.prompt_ids = completion.get("prompt_token_ids")
        self.token_ids = choice.get("token_ids")
        return self._final(choice.get("finish_reason"), completion.get("usage"))

    def _final(self, finish: Any, usage: Any) -> dict[str, Any]:
        result = self.shell("incomplete" if finish == "length" else "completed")
        result["output"] = self.items
        if finish == "length":
            result["incomplete_details"] = {"reason": "max_output_tokens"}
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
            result["usage"] = {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
                               "input_tokens_details": {"cached_tokens": 0},
                               "output_tokens_details": {"reasoning_tokens": 0}}
        if self.prompt_ids is not None:
            result["prompt_token_ids"] = self.prompt_ids
        if self.token_ids is not None:
            result["token_ids"] = self.token_ids
        return result

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return data

    def add(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The Responses events one chat chunk stands for."""
        events = []
        if not self.started:
            self.started = True
            self.model = chunk.get("model")
            shell = self.shell("in_progress")
            events += [self.event("response.created", response=shell), self.event("response.in_progress",
                                                                                  response=shell)]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_ids = chunk["prompt_token_ids"]
        choices = chunk.get("choices") or ()
        first = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None)
        if first is None:
            return events
        ids = first.get("token_ids")
        if isinstance(ids, list):
            self.token_ids = (self.token_ids or []) + ids
        delta = first.get("delta") or {}
        text = delta.get("content")
        if text:
            if self.message is None:
                self.message = self._text_item()
                i = self.items.index(self.message)
                events.append(self.event("response.output_item.added", output_index=i,
                                         item={**self.message, "status": "in_progress", "content": []}))
                events.append(self.event("response.content_part.added", item_id=self.message["id"], output_index=i,
                                         content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            self.message["content"][0]["text"] += text
            events.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                     output_index=self.items.index(self.message), content_index=0, delta=text,
                                     logprobs=[]))
        for piece in delta.get("tool_calls") or ():
            fn = piece.get("function") or {}
            item = self.calls.get(piece.get("index", 0))
            if item is None:
                item = self.calls[piece.get("index", 0)] = self._call_item(piece.get("id"), fn.get("name"), "")
                events.append(self.event("response.output_item.added", output_index=self.items.index(item),
                                         item={**item, "status": "in_progress"}))
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self.items.index(item), delta=fn["arguments"]))
        if first.get("finish_reason"):
            self.finish = first["finish_reason"]
        return events

    def done(self) -> list[dict[str, Any]]:
        """The events that close a stream: each item's ``.done`` events, then the whole ``Response``."""
        events = [] if self.started else self.add({})
        if not self.items:
            self.message = self._text_item()
            events.append(self.event("response.output_item.added", output_index=0,
                                     item={**self.message, "status": "in_progress", "content": []}))
        for i, item in enumerate(self.items):
            if item["type"] == "message":
                part = item["content"][0]
                events.append(self.event("response.output_text.done", item_id=item["id"], output_index=i,
                                         content_index=0, text=part["text"], logprobs=[]))
                events.append(self.event("response.content_part.done", item_id=item["id"], output_index=i,
                                         content_index=0, part=part))
            else:
                events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=i, name=item["name"], arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=i, item=item))
        final = self._final(self.finish, self.usage)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        events.append(self.event(kind, response=final))
        return events


_SAME_NAME = ("model", "temperature", "top_p", "seed", "top_k", "min_p", "stop", "parallel_tool_calls", "user",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "return_token_ids")
"""Fields a chat request takes under the same name (a chat server then checks them as its own)."""
_STATEFUL = ("previous_response_id", "conversation", "prompt")


def chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions request a Responses request stands for; :class:`ItemError` naming what has none."""
    for name in _STATEFUL:
        if body.get(name) is not None:
            raise ItemError(name, "names stored state, which a chat model does not keep: send the whole "
                                  "conversation as input (store: false)")
    if body.get("input") is None:
        raise ItemError("input", "is required")
    limit = body.get("max_output_tokens")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ItemError("max_output_tokens", f"must be an integer of 1 or more, got {limit!r}")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ItemError("stream", "must be true or false")
    messages = input_messages(body["input"], body.get("instructions"))
    if not messages:
        raise ItemError("input", "must hold at least one item")
    chat: dict[str, Any] = {"messages": messages}
    if body.get("tools") is not None:
        tools = chat_tools(body["tools"])
        if tools:
            chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    if body.get("text") is not None:
        response_format = chat_response_format(body["text"])
        if response_format is not None:
            chat["response_format"] = response_format
    for name in _SAME_NAME:
        if body.get(name) is not None:
            chat[name] = body[name]
    if limit is not None:
        chat["max_tokens"] = limit
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat
