"""The data model: ``Span``, ``Rollout``, ``Transition``, ``Trajectory``.

These are the paper's MDP made concrete (see DESIGN.md): a ``Rollout`` is one run
of one task and holds its ``Span`` records; a ``Transition`` is one policy-LLM
call ``(prompt, response, reward)`` with exact token ids; a ``Trajectory`` is the
ordered transitions of one rollout plus its final reward.

Every record validates itself when built, whether from Python or from JSON, and a
bad value raises :class:`~agl_core.errors.SchemaError` naming the field
(``Transition.reward: must be a finite number, got nan``). The types on the
dataclass fields are the single source of truth: the JSON Schema shipped in
``agl_core/schemas/`` is generated from them (``json_schema()``) and a test keeps
the two equal.
"""

from __future__ import annotations

import json
import math
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Literal, TypeVar, Union

from agl_core.errors import SchemaError

SCHEMA_VERSION = 1
"""Bumped whenever a field is removed or changes meaning; adding optional fields keeps it."""

MAX_DEPTH = 64
"""Nesting limit for free-form JSON values (attributes, messages, task payloads)."""

Json = Any
"""A JSON value: None, bool, int, finite float, str, list of Json, dict of str to Json."""

TokenSource = Literal["gateway", "response", "retokenized"]
SpanStatus = Literal["unset", "ok", "error"]
RolloutStatus = Literal["running", "succeeded", "failed", "timeout", "cancelled"]
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

_R = TypeVar("_R", bound="_Record")


# --------------------------------------------------------------------------- checks


def _check_json(value: Any, path: str, depth: int = 0) -> Any:
    """Return ``value`` as plain JSON (tuples become lists) or raise naming ``path``."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:  # the common case first: it is hot
        return value
    if depth > MAX_DEPTH:
        raise SchemaError(path, f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SchemaError(path, f"must be a finite number, got {value!r}")
        return value
    if isinstance(value, (list, tuple)):
        return [_check_json(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise SchemaError(path, f"object keys must be strings, got {type(k).__name__} {k!r}")
            out[k] = _check_json(v, f"{path}.{k}", depth + 1)
        return out
    raise SchemaError(path, f"is not JSON-serialisable: {type(value).__name__}")


def check_json(value: Any, path: str) -> Any:
    """``value`` as plain JSON by the rules of every record's free-form fields, or ``SchemaError`` naming ``path``.

    The rules: nesting at most :data:`MAX_DEPTH` levels, finite numbers, string keys, and text that
    is unicode (no lone UTF-16 surrogate, which no store or JSON reply could carry). What passes
    here can be a ``Rollout.task``, a span attribute or a message.
    """
    plain = _check_json(value, path)
    try:
        json.dumps(plain, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise SchemaError(_surrogate_at(plain, path), "holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                                                      "which is not unicode text") from None
    return plain


def _surrogate_at(value: Any, path: str) -> str:
    """The path of the first string (or the object with a key) that holds a lone surrogate."""
    def bad(text: str) -> bool:
        return any("\ud800" <= ch <= "\udfff" for ch in text)

    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str) and bad(item):
            return where
        if isinstance(item, dict):
            if any(bad(k) for k in item):
                return where
            stack.extend((v, f"{where}.{k}") for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(item))))
    return path


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


Checker = Callable[[Any, str], Any]


def _all_plain(values: list[Any] | tuple[Any, ...], item: Any) -> bool:
    """True when every item is exactly of the scalar type ``item`` (finite, for floats): no per-item checks needed."""
    if item is float:
        return all(type(v) is float for v in values) and math.isfinite(sum(values))  # nan/inf propagate into the sum
    return all(type(v) is item for v in values)


def _check_bool(value: Any, path: str) -> Any:
    if not isinstance(value, bool):
        raise SchemaError(path, f"must be true or false, got {_type_name(value)}")
    return value


def _check_int(value: Any, path: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(path, f"must be an integer, got {_type_name(value)} {value!r}")
    return value


def _check_float(value: Any, path: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SchemaError(path, f"must be a number, got {_type_name(value)} {value!r}")
    if not math.isfinite(value):
        raise SchemaError(path, f"must be a finite number, got {value!r}")
    return float(value)


def _check_str(value: Any, path: str) -> Any:
    if not isinstance(value, str):
        raise SchemaError(path, f"must be a string, got {_type_name(value)}")
    return value


def _check_object(value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise SchemaError(path, f"must be an object, got {_type_name(value)}")
    return _check_json(value, path)


_SCALAR_CHECKERS: dict[Any, Checker] = {bool: _check_bool, int: _check_int, float: _check_float, str: _check_str}


def _compile(hint: Any) -> Checker:
    """A function that checks a value against the field type ``hint`` and returns it normalised.

    Built once per field (validation runs for every record on hot paths, so the
    type is not re-inspected per value).
    """
    if hint is Any:
        return _check_json
    if hint in _SCALAR_CHECKERS:
        return _SCALAR_CHECKERS[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported union in schema: {hint}")  # pragma: no cover - schema bug
        check_inner, nullable = _compile(inner[0]), type(None) in args

        def check_optional(value: Any, path: str) -> Any:
            if value is None:
                if nullable:
                    return None
                raise SchemaError(path, "is required and may not be null")
            return check_inner(value, path)

        return check_optional
    if origin is Literal:
        allowed = frozenset(args)
        listed = ", ".join(map(repr, args))

        def check_literal(value: Any, path: str) -> Any:
            if not isinstance(value, (str, int)) or value not in allowed:
                raise SchemaError(path, f"must be one of {listed}, got {value!r}")
            return value

        return check_literal
    if origin is list:
        (item,) = args
        check_item = _compile(item)
        plain = item in (int, float, str)

        def check_list(value: Any, path: str) -> Any:
            if not isinstance(value, (list, tuple)):
                raise SchemaError(path, f"must be a list, got {_type_name(value)}")
            if plain and _all_plain(value, item):
                return value if type(value) is list else list(value)
            return [check_item(v, f"{path}[{i}]") for i, v in enumerate(value)]

        return check_list
    if origin is dict:
        return _check_object
    if isinstance(hint, type) and issubclass(hint, _Record):
        record: type[_Record] = hint

        def check_record(value: Any, path: str) -> Any:
            if isinstance(value, record):
                return value
            if isinstance(value, dict):
                return record._from_dict(value, path)
            raise SchemaError(path, f"must be a {record.__name__} object, got {_type_name(value)}")

        return check_record
    raise TypeError(f"unsupported type in schema: {hint}")  # pragma: no cover - schema bug


def _check_message(value: Any, path: str) -> None:
    if not isinstance(value.get("role"), str) or value["role"] not in ROLES:
        raise SchemaError(f"{path}.role", f"must be one of {', '.join(sorted(ROLES))}, got {value.get('role')!r}")


# --------------------------------------------------------------------------- records


class _Record:
    """Shared validation and JSON (de)serialisation for the dataclasses below."""

    __checkers: ClassVar[dict[type, dict[str, Checker]]] = {}

    @classmethod
    def _hints(cls) -> dict[str, Any]:
        """The type of each field, in field order."""
        hints = typing.get_type_hints(cls, globalns=globals())
        return {f.name: hints[f.name] for f in fields(cls)}  # type: ignore[arg-type]

    @classmethod
    def _checkers(cls) -> dict[str, Checker]:
        checkers = _Record.__checkers.get(cls)
        if checkers is None:
            checkers = {name: _compile(hint) for name, hint in cls._hints().items()}
            _Record.__checkers[cls] = checkers
        return checkers

    def __post_init__(self) -> None:
        self._validate(type(self).__name__)

    def _validate(self, path: str) -> None:
        for name, check in self._checkers().items():
            object.__setattr__(self, name, check(getattr(self, name), f"{path}.{name}"))
        self._check_more(path)

    def _check_more(self, path: str) -> None:
        """Cross-field rules of a record, beyond the types of its fields."""

    def validate(self, path: str | None = None) -> None:
        """Check the record and the records it holds again (fields may have changed since they were built).

        Errors name the field from ``path`` on (``rollout.spans[0].attributes.x``).
        """
        path = path or type(self).__name__
        self._validate(path)
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, _Record):
                value.validate(f"{path}.{f.name}")
            elif isinstance(value, list) and value and isinstance(value[0], _Record):
                for i, item in enumerate(value):
                    item.validate(f"{path}.{f.name}[{i}]")

    @classmethod
    def _from_dict(cls: type[_R], data: dict[str, Any], path: str) -> _R:
        checkers = cls._checkers()
        unknown = sorted(set(data) - set(checkers))
        if unknown:
            raise SchemaError(f"{path}.{unknown[0]}", f"is not a field of {cls.__name__}")
        kwargs: dict[str, Any] = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name in data:
                kwargs[f.name] = checkers[f.name](data[f.name], f"{path}.{f.name}")
            elif f.default is MISSING and f.default_factory is MISSING:
                raise SchemaError(f"{path}.{f.name}", "is required")
        obj = cls.__new__(cls)
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name in kwargs:
                value = kwargs[f.name]
            elif f.default is not MISSING:
                value = f.default
            else:
                value = f.default_factory()  # type: ignore[operator]
            object.__setattr__(obj, f.name, value)
        obj._check_more(path)
        return obj

    @classmethod
    def trusted(cls: type[_R], **values: Any) -> _R:
        """Build without validation, from values agl itself produced and knows to be clean (hot paths only)."""
        obj = cls.__new__(cls)
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name in values:
                value = values[f.name]
            elif f.default is not MISSING:
                value = f.default
            else:
                value = f.default_factory()  # type: ignore[operator]
            object.__setattr__(obj, f.name, value)
        return obj

    @classmethod
    def from_dict(cls: type[_R], data: Any) -> _R:
        """Build a record from plain JSON data, raising ``SchemaError`` naming any bad field."""
        if not isinstance(data, dict):
            raise SchemaError(cls.__name__, f"must be an object, got {_type_name(data)}")
        return cls._from_dict(data, cls.__name__)

    @classmethod
    def from_json(cls: type[_R], text: str | bytes) -> _R:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise SchemaError(cls.__name__, f"is not valid JSON: {exc}") from None
        except RecursionError:
            raise SchemaError(cls.__name__, f"is nested deeper than {MAX_DEPTH} levels") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _to_plain(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _to_plain(value: Any) -> Any:
    if isinstance(value, _Record):
        return value.to_dict()
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    return value


@dataclass(eq=True)
class Span(_Record):
    """One OpenTelemetry span, kept as a plain record (ids in lower-case hex)."""

    span_id: str
    trace_id: str
    name: str
    parent_id: str | None = None
    start_ns: int = 0
    end_ns: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)
    status: SpanStatus = "unset"
    status_message: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    rollout_id: str | None = None

    def _check_more(self, path: str) -> None:
        if self.end_ns and self.end_ns < self.start_ns:
            raise SchemaError(f"{path}.end_ns", f"ends ({self.end_ns}) before it starts ({self.start_ns})")


@dataclass(eq=True)
class Reward(_Record):
    """One reward signal of a rollout: the final one has no name, intermediate ones do."""

    value: float
    name: str | None = None
    span_id: str | None = None
    time_ns: int = 0


@dataclass(eq=True)
class Rollout(_Record):
    """One run of one task: ``execution^R(x, k)`` in the paper."""

    id: str
    task_id: str
    attempt: int = 1
    status: RolloutStatus = "running"
    task: Any = None
    spans: list[Span] = field(default_factory=list)
    rewards: list[Reward] = field(default_factory=list)
    start_time: float = 0.0
    end_time: float | None = None
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    resources_version: int | None = None
    """The version of the server's resources (``GET /v1/resources``) the agent read; None: none served."""

    def _check_more(self, path: str) -> None:
        if self.resources_version is not None and self.resources_version < 0:
            raise SchemaError(f"{path}.resources_version", f"must be 0 or more, got {self.resources_version}")
        if self.attempt < 1:
            raise SchemaError(f"{path}.attempt", f"must be 1 or more, got {self.attempt}")

    @property
    def final_reward(self) -> float | None:
        """The last reward emitted without a name, or None when there is none."""
        finals = [r.value for r in self.rewards if r.name is None]
        return finals[-1] if finals else None


@dataclass(eq=True)
class Transition(_Record):
    """One policy-LLM call: ``(input_t, output_t, r_t)`` with exact token ids when known."""

    rollout_id: str
    task_id: str
    index: int
    prompt: list[dict[str, Any]]
    response: dict[str, Any]
    attempt: int = 1
    agent_name: str | None = None
    model: str | None = None
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    response_logprobs: list[float] | None = None
    token_source: TokenSource | None = None
    reward: float | None = None
    credited_reward: float | None = None
    span_id: str | None = None
    trace_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    finish_reason: str | None = None

    def _check_more(self, path: str) -> None:
        for i, msg in enumerate(self.prompt):
            _check_message(msg, f"{path}.prompt[{i}]")
        _check_message(self.response, f"{path}.response")
        if self.response_logprobs is not None and self.response_token_ids is not None:
            if len(self.response_logprobs) != len(self.response_token_ids):
                raise SchemaError(
                    f"{path}.response_logprobs",
                    f"has {len(self.response_logprobs)} entries for "
                    f"{len(self.response_token_ids)} response tokens",
                )
        if (self.prompt_token_ids is None) != (self.response_token_ids is None) and self.token_source:
            missing = "prompt_token_ids" if self.prompt_token_ids is None else "response_token_ids"
            raise SchemaError(f"{path}.{missing}", f"is missing while token_source is {self.token_source!r}")


@dataclass(eq=True)
class Skipped(_Record):
    """An LLM call that did not become a transition, and why (nothing is dropped silently)."""

    span_id: str
    reason: str
    agent_name: str | None = None
    """The call's agent, when it had one: which agents a selection saw and left out."""


@dataclass(eq=True)
class Trajectory(_Record):
    """The ordered transitions of one rollout plus its final reward."""

    rollout_id: str
    task_id: str
    attempt: int = 1
    transitions: list[Transition] = field(default_factory=list)
    reward: float | None = None
    skipped: list[Skipped] = field(default_factory=list)


RECORDS: tuple[type[_Record], ...] = (Span, Reward, Rollout, Transition, Skipped, Trajectory)


# --------------------------------------------------------------------------- JSON Schema


def _schema_of(hint: Any) -> dict[str, Any]:
    if hint is Any:
        return {}
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return {"anyOf": [_schema_of(inner[0]), {"type": "null"}]}
    if origin is Literal:
        return {"enum": list(typing.get_args(hint))}
    if origin is list:
        return {"type": "array", "items": _schema_of(typing.get_args(hint)[0])}
    if origin is dict:
        return {"type": "object"}
    if isinstance(hint, type) and issubclass(hint, _Record):
        return {"$ref": f"#/$defs/{hint.__name__}"}
    return {"type": {bool: "boolean", int: "integer", float: "number", str: "string"}[hint]}


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of every record, generated from the field types."""
    defs: dict[str, Any] = {}
    for cls in RECORDS:
        hints = cls._hints()
        props = {}
        required = []
        for f in fields(cls):  # type: ignore[arg-type]
            props[f.name] = _schema_of(hints[f.name])
            if f.default is MISSING and f.default_factory is MISSING:
                required.append(f.name)
        defs[cls.__name__] = {
            "type": "object",
            "description": (cls.__doc__ or "").strip().splitlines()[0],
            "properties": props,
            "required": required,
            "additionalProperties": False,
        }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"agl.schema.v{SCHEMA_VERSION}.json",
        "title": f"agl data model, version {SCHEMA_VERSION}",
        "$defs": defs,
    }


def load_json_schema() -> dict[str, Any]:
    """The JSON Schema shipped in the package for ``SCHEMA_VERSION``."""
    from importlib.resources import files

    text = files("agl_core").joinpath("schemas", f"agl.v{SCHEMA_VERSION}.schema.json").read_text("utf-8")
    result: dict[str, Any] = json.loads(text)
    return result
