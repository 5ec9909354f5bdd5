"""Span attribute encoding shared by every plugin.

One compact JSON encoder (:func:`dumps`), the span text of a tool's arguments or
result (:func:`span_text`), the memo that keeps a re-sent conversation from being
encoded again on every call (:class:`MessageMemo`), and the request's sampling
parameters as ``gen_ai.request.*`` attributes (:func:`sampling_attributes`).
All of it runs on the call's hot path.

Content capture. Prompts, model outputs, system instructions and tool arguments
and results (:data:`CONTENT_ATTRIBUTES`) can be kept off every span, as the
OpenTelemetry GenAI conventions ask: ``agl_core.instrument(capture_content=False)``
or the environment variable ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=false``
(an explicit argument wins over the variable; by default content is captured,
since a transition's prompt and response are what training reads when no token
ids exist). Switched off, those attributes are never set on a span, neither
agl's own records nor what the user's exporters see; token ids, logprobs,
usage, model, agent and tool names, finish reasons, status and timing stay, so
training from token ids still works. The switch is applied where every plugin's
attributes reach a span: :func:`set_on`, the start attributes of
``collector.tracer()``'s spans, and agl's own span records. Exception messages
and span status descriptions are not content attributes and are kept.

Bad values never raise here. :func:`span_text` (a tool's arguments or result)
records what it can, with a marker where it had to cut or replace:

- text longer than ``limits.max_text_chars`` (default 1,000,000; the
  ``AGL_MAX_TEXT_CHARS`` variable or ``encoding.limits.max_text_chars = n``) keeps
  its head and ends with ``…[agl: truncated N chars]``;
- ``bytes``/``bytearray``/``memoryview`` become ``[agl: binary, N bytes]`` (base64
  images in data URLs are text and kept as text);
- a value JSON cannot hold (a cycle, nesting past the interpreter's recursion
  limit, an object whose iteration raises) becomes its ``repr``, or
  ``[agl: unrepresentable <type>]`` when even that fails;
- lone surrogates (invalid unicode) become U+FFFD, so the text can be stored as
  UTF-8.

Message attributes are never truncated: a cut prompt would train the wrong
thing. NaN and infinities inside an encoded value are written as JSON's common
``NaN``/``Infinity`` extensions (Python's ``json`` reads them back); as attribute
values of their own they become the text ``"nan"``/``"inf"`` in agl's records
(``collector.to_record``), and as rewards they are refused with ``SchemaError``.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

from agl_core import semconv

__all__ = ["CAPTURE_CONTENT_ENV", "CONTENT_ATTRIBUTES", "Limits", "MessageMemo", "capture_content", "clip", "dumps",
           "limits", "redact", "reset_capture_content", "sampling_attributes", "set_capture_content", "span_text"]

CAPTURE_CONTENT_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
CONTENT_ATTRIBUTES: frozenset[str] = frozenset({
    semconv.GEN_AI_INPUT_MESSAGES,
    semconv.GEN_AI_OUTPUT_MESSAGES,
    semconv.GEN_AI_SYSTEM_INSTRUCTIONS,
    semconv.GEN_AI_TOOL_CALL_ARGUMENTS,
    semconv.GEN_AI_TOOL_CALL_RESULT,
})
"""The span attributes that hold what users and models said; left off every span when capture is off."""

_OFF = frozenset({"false", "0", "no", "off", "no_content", "none"})


def _env_capture() -> bool:
    value = os.environ.get(CAPTURE_CONTENT_ENV)
    return value is None or value.strip().lower() not in _OFF


capture_content: bool = _env_capture()
"""Whether content attributes go on spans now (read it as ``encoding.capture_content``, never import the name)."""
_explicit = False


def set_capture_content(enabled: bool | None) -> bool:
    """Switch content capture on or off; None follows the environment variable unless set explicitly before.

    Returns the setting now in force.
    """
    global capture_content, _explicit
    if enabled is None:
        if not _explicit:
            capture_content = _env_capture()
    elif isinstance(enabled, bool):
        capture_content = enabled
        _explicit = True
    else:
        raise TypeError(f"capture_content must be True, False or None, got {type(enabled).__name__}")
    return capture_content


def reset_capture_content() -> bool:
    """Forget an explicit setting and follow the environment variable again; returns the setting now."""
    global _explicit
    _explicit = False
    return set_capture_content(None)


def redact(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """``attrs`` without the content attributes."""
    return {k: v for k, v in attrs.items() if k not in CONTENT_ATTRIBUTES}


class Limits:
    """How much of a value agl records; change the attributes of :data:`limits` to configure."""

    def __init__(self) -> None:
        self.max_text_chars: int = int(os.environ.get("AGL_MAX_TEXT_CHARS") or 1_000_000)


limits = Limits()
TRUNCATED = "…[agl: truncated {n} chars]"
BINARY = "[agl: binary, {n} bytes]"
UNREPRESENTABLE = "[agl: unrepresentable {type}]"
_BINARY_TYPES = (bytes, bytearray, memoryview)


def _json_default(value: Any) -> Any:
    try:
        if isinstance(value, type):  # a class, e.g. a pydantic model given as a response_format
            schema = getattr(value, "model_json_schema", None)
            return schema() if schema is not None else value.__qualname__
        if isinstance(value, _BINARY_TYPES):
            return BINARY.format(n=memoryview(value).nbytes)
        dump = getattr(value, "model_dump", None)
        if dump is not None:
            return dump(exclude_none=True)
        if hasattr(value, "__iter__"):
            return list(value)
        return str(value)
    except Exception:  # noqa: BLE001 - an odd object is recorded as what it is, never raised from
        return UNREPRESENTABLE.format(type=type(value).__name__)


def _make_dumps() -> Callable[[Any], str]:
    encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False, default=_json_default)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return encoder.encode
    try:  # JSONEncoder.encode builds this C encoder anew on every call; build it once
        c_encode = make(None, _json_default, json.encoder.encode_basestring, None, ":", ",", False, False, True)
    except Exception:  # noqa: BLE001 - another Python's private signature: the public path works too
        return encoder.encode

    def dumps(value: Any) -> str:
        return "".join(c_encode(value, 0))

    return dumps


dumps = _make_dumps()
"""Compact, non-ASCII-escaping JSON for span attributes; pydantic objects are dumped, other odd values str()'d."""


def span_text(value: Any, encode: Callable[[Any], str] = dumps) -> str:
    """A tool's arguments or result as span text: strings as they are, anything else as JSON (repr if that fails).

    Never raises; cut, binary and unrepresentable values carry the markers described above.
    """
    if isinstance(value, str):
        text = value
    elif isinstance(value, _BINARY_TYPES):
        return BINARY.format(n=memoryview(value).nbytes)
    else:
        try:
            text = encode(value)
        except Exception:  # noqa: BLE001 - cycles, too deep, hostile __iter__: fall back to repr
            try:
                text = repr(value)
            except Exception:  # noqa: BLE001
                return UNREPRESENTABLE.format(type=type(value).__name__)
    return clip(text)


def clip(text: str) -> str:
    """``text`` cut to ``limits.max_text_chars`` with the truncation marker, lone surrogates replaced."""
    limit = limits.max_text_chars
    if len(text) > limit:
        text = text[:limit] + TRUNCATED.format(n=len(text) - limit)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text


_memos: weakref.WeakSet[MessageMemo] = weakref.WeakSet()


def forget_messages() -> None:
    """Empty every :class:`MessageMemo` (their entries are messages of rollouts that have ended)."""
    for memo in list(_memos):
        memo.clear()


class MessageMemo:
    """JSON of already-seen messages, keyed by ``key(message)``; ``to_json(message)`` encodes one.

    An agent re-sends its whole conversation on every call, so without this each call would convert
    and encode every earlier message again: quadratic in the length of a rollout. ``key`` must build
    the key from the message's own immutable values, so an edited message is a new key, never a
    stale hit; it returns None for a message it cannot key that way, which is then encoded every
    time. Past ``max_chars`` of held JSON the memo starts over. A message whose JSON is empty (it
    stands for no messages) adds nothing to the list.

    What it holds is one conversation's, so :func:`forget_messages` empties every memo when no
    rollout is open any more (the collector calls it): a long-running worker does not keep the
    messages of rollouts that have ended.
    """

    def __init__(self, key: Callable[[Any], Hashable | None], to_json: Callable[[Any], str],
                 max_chars: int = 8_000_000) -> None:
        self.key = key
        self.to_json = to_json
        self.max_chars = max_chars
        self.entries: dict[Hashable, str] = {}
        self.chars = 0
        _memos.add(self)

    def _store(self, entries: dict[Hashable, str], key: Hashable, text: str) -> None:
        if self.chars > self.max_chars:
            entries.clear()
            self.chars = 0
        entries[key] = text
        self.chars += len(text)

    def clear(self) -> None:
        self.entries = {}  # a new dict: an encode() running in another thread keeps the one it holds
        self.chars = 0

    def encode(self, messages: Iterable[Any]) -> str:
        """The JSON list of the messages' JSON."""
        entries = self.entries
        key_of = self.key
        to_json = self.to_json
        parts: list[str] = []
        append = parts.append
        for message in messages:
            key = key_of(message)
            if key is not None:
                text = entries.get(key)
                if text is None:
                    text = to_json(message)
                    self._store(entries, key, text)
            else:
                text = to_json(message)
            if text:
                append(text)
        return "[" + ",".join(parts) + "]"


_SAMPLING_PARAMS = (
    ("temperature", semconv.GEN_AI_REQUEST_TEMPERATURE, float),
    ("top_p", semconv.GEN_AI_REQUEST_TOP_P, float),
    ("seed", semconv.GEN_AI_REQUEST_SEED, int),
    ("max_completion_tokens", semconv.GEN_AI_REQUEST_MAX_TOKENS, int),
    ("max_tokens", semconv.GEN_AI_REQUEST_MAX_TOKENS, int),  # last: the older name wins when both are given
)


_SAMPLING_NAMES = frozenset(key for key, _, _ in _SAMPLING_PARAMS)


def sampling_attributes(source: Mapping[str, Any] | Callable[[str], Any], attrs: dict[str, Any]) -> None:
    """Put the sampling parameters ``source`` holds (temperature, top_p, seed, max tokens) into ``attrs``.

    ``source`` is a mapping of a call's parameters, or a function that looks one up by name (None where
    absent). Floats and ints become ``float`` attributes, ``seed`` and the max-token counts stay ``int``;
    anything else (None, a bool, a string) is left out.
    """
    get: Callable[[str], Any]
    if type(source) is dict or isinstance(source, Mapping):
        if source.keys().isdisjoint(_SAMPLING_NAMES):  # the usual answer: most calls set none of them
            return
        get = source.get
    else:
        get = source
    for key, name, kind in _SAMPLING_PARAMS:
        value = get(key)
        if value is None:  # the usual answer: most calls set one or two of these, or none
            continue
        if kind is float:
            if isinstance(value, (int, float)) and type(value) is not bool:
                attrs[name] = float(value)
        elif type(value) is int:
            attrs[name] = value


_CLEAN = frozenset({str, bool, int, float, tuple})
_sdk_types: tuple[type[Any], type[Any]] | None = None
_is_sdk_span: dict[type[Any], bool] = {}  # span class -> whether it is the SDK's Span (or a subclass)


def _sdk() -> tuple[type[Any], type[Any]]:
    global _sdk_types
    if _sdk_types is None:
        from opentelemetry.attributes import BoundedAttributes
        from opentelemetry.sdk.trace import Span as SdkSpan

        _sdk_types = (SdkSpan, BoundedAttributes)
    return _sdk_types


def set_on(span: Any, attrs: dict[str, Any]) -> None:
    """``span.set_attributes(attrs)`` for values agl's attribute code built (plain scalars and tuples).

    On an SDK span it skips the SDK's per-value re-check when the span's limits allow, which costs
    about 1 µs per token id otherwise. With content capture off, content attributes are left out.
    """
    if not capture_content:
        attrs = redact(attrs)
    sdk = _is_sdk_span.get(type(span))
    if sdk is None:  # once per span class: the SDK's Span is an ABC, whose isinstance is a Python-level call
        sdk = isinstance(span, (_sdk_types or _sdk())[0])
        if len(_is_sdk_span) < 64:
            _is_sdk_span[type(span)] = sdk
    if sdk:
        bounded_type = (_sdk_types or _sdk())[1]
        bounded = span._attributes
        if (type(bounded) is bounded_type and bounded.max_value_len is None
                and (bounded.maxlen is None or len(bounded) + len(attrs) <= bounded.maxlen)
                and set(map(type, attrs.values())) <= _CLEAN):
            with span._lock:
                if span._end_time is None and not bounded._immutable:
                    bounded._dict.update(attrs)
                    return
    span.set_attributes(attrs)


_SAMPLER = (semconv.GEN_AI_OPERATION_NAME, semconv.GEN_AI_PROVIDER_NAME, semconv.GEN_AI_REQUEST_MODEL)


def sampler_attributes(attrs: dict[str, Any]) -> dict[str, Any]:
    """The attributes to start the span with, so a sampler sees what kind of call this is."""
    return {key: attrs.pop(key) for key in _SAMPLER if key in attrs}
