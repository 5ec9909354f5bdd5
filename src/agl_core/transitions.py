"""Spans -> transitions: which LLM calls are trained, and with what reward.

A rollout's spans become one :class:`~agl_core.schema.Transition` per policy-LLM
call, in call order:

1. **One request, one transition.** LLM spans nested inside another LLM span
   (a LangChain ``ChatOpenAI`` call is also an ``openai`` client call) are merged
   into the outermost one: the agent identity comes from the outer span, the
   token ids from whichever span has the best ones (gateway > response >
   retokenized), messages from the first span that recorded them.
2. **Agent identity** is the nearest ``gen_ai.agent.name`` on the call or its
   ancestors; ``agent_match`` (a regex *searched* in the name, as Agent Lightning's
   ``agent_match`` is: ``"write"`` selects ``write_query`` and ``rewrite_query``;
   anchor it, ``"^writer$"``, for one exact name) selects which agents are trained.
3. **Rewards.** An intermediate reward (``emit_reward(v, name=...)``) attaches to
   the LLM call it follows; AIR rules turn tool outcomes (exception, error
   result, timeout) into intermediate rewards on the call that asked for the
   tool, and a malformed tool call into one on the call that made it. The final
   reward is the last unnamed ``emit_reward``. Credit assignment
   (:mod:`agl_core.credit`) then gives each transition its credited reward,
   computed over every call of the run, trained or not.
4. **Frozen models are never trained**: a call the gateway relayed to a frozen
   model's upstream, or that ``agl worker`` saw go to another server than the
   policy's (``agl.llm.frozen_model`` on its span, and no gateway token ids), is skipped.
5. **Nothing is dropped silently**: each LLM call that does not become a
   transition is listed in ``Trajectory.skipped`` with the reason.

One source of truth: a builder's :meth:`~TransitionBuilder.settings` (what it sets apart
from the defaults, functions named ``pkg.module:name``) travel to the server that builds
the stored transitions; :func:`merge_builders` joins the builder given in code
(``@agl.rollout_fn(builder=...)``) with a config's or a server's, and a key both set to
different values is a :class:`BuilderConflict` naming the two.
"""

from __future__ import annotations

import bisect
import dataclasses
import importlib
import json
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from agl_core import credit as credit_mod
from agl_core import semconv
from agl_core.errors import SchemaError
from agl_core.messages import from_genai, many_from_genai
from agl_core.schema import Rollout, Skipped, Span, Trajectory, Transition

_SOURCE_RANK = {"gateway": 3, "response": 2, "retokenized": 1}


@dataclass(frozen=True)
class AirRules:
    """Automatic intermediate rewards from system signals (AIR); None switches a rule off.

    ``custom`` is called with every tool span and may return a reward (or None). ``tool_rejected`` is a call
    refused before it ran (a "no" to its approval request); a call paused for a decision has no outcome and
    earns nothing: the span of its run after the decision does.
    """

    tool_exception: float | None = None
    tool_error: float | None = None
    tool_timeout: float | None = None
    malformed_tool_call: float | None = None
    truncated: float | None = None
    """A reply ``max_tokens`` cut off (finish reason ``length``, or ``max_tokens`` as Anthropic says): without it a
    reply that runs on and ends the run can cost less than a wrong try, and RL learns to ramble. A cut reply whose
    tool call is broken because it was cut earns this alone, never this and ``malformed_tool_call`` both."""
    tool_ok: float | None = None
    tool_rejected: float | None = None
    custom: Callable[[Span], float | None] | None = None

    def for_outcome(self, outcome: str) -> float | None:
        return {
            semconv.TOOL_EXCEPTION: self.tool_exception,
            semconv.TOOL_ERROR: self.tool_error,
            semconv.TOOL_TIMEOUT: self.tool_timeout,
            semconv.TOOL_OK: self.tool_ok,
            semconv.TOOL_REJECTED: self.tool_rejected,
        }.get(outcome)


def is_llm_span(span: Span) -> bool:
    return span.attributes.get(semconv.GEN_AI_OPERATION_NAME) in semconv.LLM_OPERATIONS


def is_tool_span(span: Span) -> bool:
    return span.attributes.get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_EXECUTE_TOOL


def tool_outcome(span: Span) -> str:
    """ok | error | exception | timeout | rejected | pending, from agl's attribute or the span's error status."""
    status = span.attributes.get(semconv.AGL_TOOL_STATUS)
    if isinstance(status, str) and status:
        return status
    error_type = span.attributes.get(semconv.ERROR_TYPE)
    if span.status == "error" or error_type:
        return semconv.TOOL_TIMEOUT if "timeout" in str(error_type or "").lower() else semconv.TOOL_EXCEPTION
    return semconv.TOOL_OK


def _json_attr(span: Span, key: str) -> Any:
    raw = span.attributes.get(key)
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except RecursionError:
            raise ValueError(f"{key} is nested too deeply to read") from None
    return raw


class _Call:
    """One model request: the outermost LLM span and the spans nested in it."""

    def __init__(self, outer: Span) -> None:
        self.outer = outer
        self.spans = [outer]
        self.rewards: list[float] = []
        self._tool_call_ids: set[str] | None = None
        self._ordered: list[Span] | None = None

    def tool_call_ids(self) -> set[str]:
        """Ids of the tool calls this request's response asked for."""
        if self._tool_call_ids is None:
            self._tool_call_ids = set()
            try:
                out = _first_json(self, semconv.GEN_AI_OUTPUT_MESSAGES) or []
            except ValueError:
                out = []
            for message in out if isinstance(out, list) else []:
                for part in message.get("parts") or [] if isinstance(message, dict) else []:
                    if isinstance(part, dict) and part.get("type") == "tool_call" and part.get("id"):
                        self._tool_call_ids.add(str(part["id"]))
        return self._tool_call_ids

    @property
    def start(self) -> int:
        return self.outer.start_ns

    def first(self, key: str) -> Any:
        for span in self.ordered():
            value = span.attributes.get(key)
            if value is not None:
                return value
        return None

    def token_span(self) -> Span | None:
        """The span with the best token ids (gateway > response > retokenized), if any has them."""
        best: Span | None = None
        best_rank = -1
        for span in self.spans:
            a = span.attributes
            if a.get(semconv.AGL_RESPONSE_TOKEN_IDS) is None or a.get(semconv.AGL_PROMPT_TOKEN_IDS) is None:
                continue
            if span.status == "error":
                continue  # a request that failed (a stream cut mid-way) has no trainable ids
            rank = _SOURCE_RANK.get(str(a.get(semconv.AGL_TOKEN_SOURCE)), 0)
            if rank > best_rank:
                best, best_rank = span, rank
        return best

    def ordered(self) -> list[Span]:
        """The spans to read content from: the token span first, so text and ids describe the same request.

        A framework's span may hold a post-processed reply (crewai cuts replies at stop words on the
        client side) while the client span below it saw what the model really generated. Failed
        spans come last: a retried request's broken first try must not lend its partial text. A
        framework's own span (no ``agl.plugin``: Pydantic AI's instrumentation wraps the model call
        in a ``chat`` span of its own) comes after agl's spans of the same request, whose messages
        are in the form transitions are built from (its system instructions, for one, are not in
        its input messages).
        """
        if self._ordered is None:
            best = self.token_span()
            rest = [s for s in self.spans if s is not best]
            # stable: otherwise in start order
            rest.sort(key=lambda s: (s.status == "error", not s.attributes.get(semconv.AGL_PLUGIN)))
            self._ordered = [best, *rest] if best is not None else rest
        return self._ordered

    def failed(self) -> bool:
        """The request failed: its outermost span, or every span of it, ended in an error.

        An inner failure under a successful outer span (a framework's retry) is not the call's.
        """
        errors = sum(s.status == "error" for s in self.spans)
        return errors > 0 and (self.outer.status == "error" or errors == len(self.spans))

    def tokens(self) -> tuple[list[int] | None, list[int] | None, list[float] | None, str | None]:
        best = self.token_span()
        if best is None:
            return None, None, None, None
        a = best.attributes
        source = a.get(semconv.AGL_TOKEN_SOURCE)
        logprobs = a.get(semconv.AGL_RESPONSE_LOGPROBS)
        return (list(a[semconv.AGL_PROMPT_TOKEN_IDS]), list(a[semconv.AGL_RESPONSE_TOKEN_IDS]),
                list(logprobs) if logprobs is not None else None,
                source if source in _SOURCE_RANK else "response")


class TransitionBuilder:
    """Decides which LLM calls become transitions and which signals become rewards.

    ``agent_match``: regex searched in the agent name (``re.search``, Agent Lightning's
    semantics: ``"write"`` keeps ``write_query`` and ``rewrite_query``, ``"writer|rewriter"``
    keeps those two and not ``"checker"``, ``"^writer$"`` keeps ``writer`` alone); None keeps
    every call.
    ``air``: :class:`AirRules` for intermediate rewards from tool outcomes.
    ``credit``/``gamma``: credit assignment, see :mod:`agl_core.credit`.
    """

    def __init__(
        self,
        agent_match: str | re.Pattern[str] | None = None,
        air: AirRules | None = None,
        credit: credit_mod.Credit = "final",
        gamma: float = 1.0,
    ) -> None:
        try:
            self.agent_match = re.compile(agent_match) if isinstance(agent_match, str) else agent_match
        except re.error as exc:
            raise SchemaError("TransitionBuilder.agent_match", f"is not a valid regular expression: {exc}") from None
        if credit not in ("final", "discounted") and not callable(credit):
            raise SchemaError("TransitionBuilder.credit",
                              f"must be 'final', 'discounted' or a function, got {credit!r}")
        self.air = air or AirRules()
        self.credit = credit
        self.gamma = gamma

    def settings(self, *, loadable: bool = True) -> dict[str, Any]:
        """What this builder sets apart from the defaults, as JSON: functions as ``pkg.module:name``.

        Raises ``ValueError`` for a function that cannot be named so (a lambda, a local function),
        which no other process could load; ``loadable=False`` names it as well as it can instead.
        """
        name = function_spec if loadable else (lambda fn, what: _name_of(fn))
        out: dict[str, Any] = {}
        if self.agent_match is not None:
            out["agent_match"] = self.agent_match.pattern
        air = {f.name: getattr(self.air, f.name) for f in dataclasses.fields(AirRules)
               if getattr(self.air, f.name) is not None}
        if "custom" in air:
            air["custom"] = name(air["custom"], "AirRules.custom")
        if air:
            out["air"] = air
        if self.credit != "final":
            out["credit"] = self.credit if isinstance(self.credit, str) else name(self.credit, "credit")
        if self.gamma != 1.0:
            out["gamma"] = self.gamma
        return out

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> TransitionBuilder:
        """The builder of :meth:`settings`; a function is imported from its ``pkg.module:name``."""
        if not isinstance(settings, dict):
            raise SchemaError("TransitionBuilder.settings", f"must be an object, got {type(settings).__name__}")
        unknown = sorted(set(settings) - {"agent_match", "air", "credit", "gamma"})
        if unknown:
            raise SchemaError(f"TransitionBuilder.settings.{unknown[0]}",
                              "is not a setting (agent_match, air, credit, gamma)")
        air = {k: v for k, v in dict(settings.get("air") or {}).items() if v is not None}
        rules = {f.name for f in dataclasses.fields(AirRules)}
        for key, value in air.items():
            if key not in rules:
                raise SchemaError(f"TransitionBuilder.settings.air.{key}",
                                  f"is not a rule ({', '.join(sorted(rules))})")
            if key == "custom":
                air[key] = load_function(str(value), "air.custom")
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SchemaError(f"TransitionBuilder.settings.air.{key}", f"must be a number, got {value!r}")
        credit = settings.get("credit", "final")
        if credit not in ("final", "discounted"):
            credit = load_function(str(credit), "credit")
        gamma = settings.get("gamma", 1.0)
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)):
            raise SchemaError("TransitionBuilder.settings.gamma", f"must be a number, got {gamma!r}")
        return cls(agent_match=settings.get("agent_match"), air=AirRules(**air), credit=credit, gamma=float(gamma))

    def build(self, rollout: Rollout) -> Trajectory:
        """The trajectory of one finished rollout."""
        return self.build_from_spans(rollout.spans, rollout_id=rollout.id, task_id=rollout.task_id,
                                     attempt=rollout.attempt)

    def build_from_spans(
        self, spans: Iterable[Span], *, rollout_id: str, task_id: str, attempt: int = 1
    ) -> Trajectory:
        spans = sorted(spans, key=lambda s: (s.start_ns, s.end_ns))
        by_id = {s.span_id: s for s in spans}
        calls = _group_calls(spans, by_id)
        skipped: list[Skipped] = []

        final: float | None = None
        recorded = _tool_calls_recorded_by_agl(spans)
        superseded = _superseded_tool_spans(spans)
        for span in spans:
            a = span.attributes
            if a.get(semconv.AGL_SPAN_KIND) == semconv.KIND_REWARD:
                value = a.get(semconv.AGL_REWARD_VALUE)
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                if a.get(semconv.AGL_REWARD_NAME) is None:
                    final = float(value)
                elif calls:
                    _call_before(calls, span.start_ns).rewards.append(float(value))
            elif (is_tool_span(span) and calls and not _seen_by_agl(span, recorded)
                  and span.span_id not in superseded):
                self._air_for_tool(span, calls)

        rows: list[tuple[_Call, Transition | None]] = []
        for call in calls:
            try:
                built = self._transition(call, by_id, rollout_id, task_id, attempt, skipped)
            except (TypeError, ValueError, LookupError, AttributeError) as exc:  # a span of another shape
                skipped.append(Skipped(span_id=call.outer.span_id,
                                       reason=f"unreadable LLM span: {type(exc).__name__}: {exc}"))
                built = None
            rows.append((call, built))

        immediate = [sum(c.rewards) if c.rewards else None for c, _ in rows]
        credited = credit_mod.assign(immediate, final, self.credit, self.gamma)
        transitions: list[Transition] = []
        for (_, t), r, cr in zip(rows, immediate, credited, strict=True):
            if t is None:
                continue
            t.index = len(transitions)
            t.reward = r
            t.credited_reward = cr
            transitions.append(t)
        return Trajectory(rollout_id=rollout_id, task_id=task_id, attempt=attempt, transitions=transitions,
                          reward=final, skipped=skipped)

    # -- pieces ---------------------------------------------------------------------------

    def _air_for_tool(self, span: Span, calls: list[_Call]) -> None:
        rewards = []
        value = self.air.for_outcome(tool_outcome(span))
        if value is not None:
            rewards.append(value)
        if self.air.custom is not None:
            extra = self.air.custom(span)
            if extra is not None:
                rewards.append(float(extra))
        if not rewards:
            return
        owner = _call_for_tool(calls, span)
        owner.rewards.extend(rewards)

    def _transition(self, call: _Call, by_id: dict[str, Span], rollout_id: str, task_id: str, attempt: int,
                    skipped: list[Skipped]) -> Transition | None:
        outer = call.outer
        agent = _agent_name(call, by_id)
        try:
            raw_in = _first_json(call, semconv.GEN_AI_INPUT_MESSAGES)
            raw_out = _first_json(call, semconv.GEN_AI_OUTPUT_MESSAGES)
            tools = _first_json(call, semconv.GEN_AI_TOOL_DEFINITIONS)
        except ValueError as exc:
            skipped.append(Skipped(span_id=outer.span_id, agent_name=agent,
                                   reason=f"unreadable message attribute: {exc}"))
            return None
        frozen = call.first(semconv.AGL_FROZEN_MODEL)
        if frozen is not None and call.first(semconv.AGL_TOKEN_SOURCE) != "gateway":
            skipped.append(Skipped(span_id=outer.span_id, agent_name=agent,
                                   reason=f"answered by the frozen model {frozen!r}, not the policy: not trained"))
            return None
        prompt_ids, response_ids, logprobs, source = call.tokens()
        untrainable = call.first(semconv.AGL_UNTRAINABLE)
        if untrainable is not None and not call.first(semconv.GEN_AI_OUTPUT_MESSAGES):
            skipped.append(Skipped(span_id=outer.span_id, agent_name=agent, reason=str(untrainable)))
            return None
        if call.failed():
            # a failed call may carry what arrived before it broke (a stream cut mid-way): that
            # partial text stays on the span for debugging, never in a transition
            error = call.first(semconv.ERROR_TYPE) or outer.status_message or "error"
            skipped.append(Skipped(span_id=outer.span_id, agent_name=agent,
                                   reason=f"the call failed ({error}): no response to train on"))
            return None
        if not raw_out and response_ids is None:
            reason = "no response recorded (content capture off, or the call never finished)"
            skipped.append(Skipped(span_id=outer.span_id, agent_name=agent, reason=reason))
            return None
        response = from_genai(raw_out[0]) if raw_out else {"role": "assistant", "content": None}
        response["role"] = "assistant"
        finish = (raw_out[0].get("finish_reason") if raw_out else None) or _first_finish(call)
        if self.air.truncated is not None and str(finish) in _CUT_OFF:
            call.rewards.append(self.air.truncated)
        elif self.air.malformed_tool_call is not None and _malformed(response, tools):
            call.rewards.append(self.air.malformed_tool_call)
        if self.agent_match is not None and (agent is None or not self.agent_match.search(agent)):
            skipped.append(Skipped(span_id=outer.span_id, agent_name=agent,
                                   reason=f"agent {agent!r} does not match agent_match {self.agent_match.pattern!r}"))
            return None
        model = call.first(semconv.GEN_AI_RESPONSE_MODEL) or call.first(semconv.GEN_AI_REQUEST_MODEL)
        try:
            return Transition(
                rollout_id=rollout_id, task_id=task_id, attempt=attempt, index=0,
                agent_name=agent, model=str(model) if model is not None else None,
                prompt=many_from_genai(raw_in or []), response=response,
                prompt_token_ids=prompt_ids, response_token_ids=response_ids, response_logprobs=logprobs,
                token_source=source, span_id=outer.span_id, trace_id=outer.trace_id,  # type: ignore[arg-type]
                tools=tools if isinstance(tools, list) else None,
                finish_reason=str(finish) if finish is not None else None,
            )
        except SchemaError as exc:
            skipped.append(Skipped(span_id=outer.span_id, agent_name=agent, reason=f"invalid record: {exc}"))
            return None


class BuilderConflict(ValueError):
    """Two sources of a run's :class:`TransitionBuilder` set one key to different values."""

    def __init__(self, conflicts: list[tuple[str, Any, Any]], first: str, second: str) -> None:
        self.conflicts = conflicts
        lines = "; ".join(f"{key}: {first} says {a!r}, {second} says {b!r}" for key, a, b in conflicts)
        super().__init__(f"two transition builders disagree ({lines}): set each key in one place, or to the same "
                         "value in both")


def merge_builders(first: TransitionBuilder | None, second: TransitionBuilder | None, *,
                   names: tuple[str, str] = ("the first builder", "the second builder")) -> TransitionBuilder | None:
    """One builder holding what either sets; :class:`BuilderConflict` when both set a key to different values.

    ``names`` say where each comes from (``"the agent's @agl.rollout_fn builder"``, ``"the config"``),
    for the error. A key is set when it differs from the default; AIR rules count one by one.
    """
    if first is None or second is None:
        return first if second is None else second
    a, b = _comparable(first), _comparable(second)
    conflicts = [(key, a[key], b[key]) for key in sorted(set(a) & set(b)) if a[key] != b[key]]
    if conflicts:
        raise BuilderConflict(conflicts, *names)
    merged = {**a, **b}
    air = {key.removeprefix("air."): value for key, value in merged.items() if key.startswith("air.")}
    if "custom" in air:  # the function itself, not its name
        air["custom"] = first.air.custom if first.air.custom is not None else second.air.custom
    credit: Any = merged.get("credit", "final")
    if credit not in ("final", "discounted"):
        credit = first.credit if first.credit not in ("final", "discounted") else second.credit
    return TransitionBuilder(agent_match=merged.get("agent_match"), air=AirRules(**air), credit=credit,
                             gamma=merged.get("gamma", 1.0))


def _comparable(builder: TransitionBuilder) -> dict[str, Any]:
    """The builder's set keys, flat (``air.tool_error``), functions by their name so two imports compare equal."""
    out: dict[str, Any] = {}
    if builder.agent_match is not None:
        out["agent_match"] = builder.agent_match.pattern
    for f in dataclasses.fields(AirRules):
        value = getattr(builder.air, f.name)
        if value is not None:
            out[f"air.{f.name}"] = _name_of(value) if callable(value) else value
    if builder.credit != "final":
        out["credit"] = builder.credit if isinstance(builder.credit, str) else _name_of(builder.credit)
    if builder.gamma != 1.0:
        out["gamma"] = builder.gamma
    return out


def _name_of(fn: Callable[..., Any]) -> str:
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{name}" if module and name else repr(fn)


def function_spec(fn: Callable[..., Any], what: str) -> str:
    """``pkg.module:name`` of ``fn``, which :func:`load_function` loads back; ``ValueError`` when it cannot."""
    spec = _name_of(fn)
    module, _, name = spec.partition(":")
    if not name or "<" in name or module == "__main__":
        raise ValueError(f"{what} {spec} cannot be loaded by another process (a lambda, a local function or one "
                         "defined in __main__): define it at the top of a module")
    return spec


def load_function(spec: str, what: str) -> Callable[..., Any]:
    """The function ``pkg.module:name`` names; ``SchemaError`` naming ``what`` when it cannot be loaded."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SchemaError(what, f"must look like pkg.module:function, got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise SchemaError(what, f"cannot load {spec}: {type(exc).__name__}: {exc}") from None
    if not callable(obj):
        raise SchemaError(what, f"{spec} is a {type(obj).__name__}, not a function")
    return typing.cast(Callable[..., Any], obj)


def _group_calls(spans: list[Span], by_id: dict[str, Span]) -> list[_Call]:
    calls: dict[str, _Call] = {}
    owner: dict[str, str] = {}  # LLM span id -> its call's outer span id
    for span in spans:
        if not is_llm_span(span):
            continue
        outer = span
        parent = by_id.get(span.parent_id) if span.parent_id else None
        seen = 0
        while parent is not None and seen < 10_000:
            if is_llm_span(parent):
                outer = parent
            parent = by_id.get(parent.parent_id) if parent.parent_id else None
            seen += 1
        owner[span.span_id] = outer.span_id
        if outer.span_id in calls:
            calls[outer.span_id].spans.append(span)
        else:
            call = _Call(outer)
            if outer is not span:
                call.spans.append(span)
            calls[outer.span_id] = call
    for span in spans:
        if span.attributes.get(semconv.AGL_TOKEN_SOURCE) == "gateway" and not is_llm_span(span):
            _join_gateway_span(span, by_id, owner, calls)
    return _merged_across_traces(sorted(calls.values(), key=lambda c: c.start))


def _join_gateway_span(span: Span, by_id: dict[str, Span], owner: dict[str, str], calls: dict[str, _Call]) -> None:
    """The gateway's ids joined a span that is no LLM span: the HTTP client span of the request, whose
    traceparent the request carried when only the HTTP client is instrumented (OpenInference or the GenAI
    instrumentations over OTLP, with opentelemetry-instrumentation-httpx). Below an LLM span it is that call's."""
    parent = by_id.get(span.parent_id) if span.parent_id else None
    seen = 0
    while parent is not None and seen < 10_000:
        if parent.span_id in owner:
            calls[owner[parent.span_id]].spans.append(span)
            return
        parent = by_id.get(parent.parent_id) if parent.parent_id else None
        seen += 1


def _merged_across_traces(calls: list[_Call]) -> list[_Call]:
    """Two instrumentations that share no context (OpenInference's LangChain and OpenAI instrumentors) record
    one request as two roots, each in a trace of its own: a call of another trace, inside this one's time,
    with the same prompt and reply, recorded by another instrumentation, is that request, merged into the
    outer call as a nested span would be. One instrumentation records a request once: two calls it recorded
    are two requests (best-of-n calls run at once in threads of their own, answered alike), never merged."""
    out: list[_Call] = []
    for call in calls:
        host = next((o for o in reversed(out) if o.outer.trace_id != call.outer.trace_id
                     and o.outer.start_ns <= call.outer.start_ns and call.outer.end_ns <= o.outer.end_ns
                     and _recorder(o.outer) != _recorder(call.outer)
                     and _same_messages(o, call)), None)
        if host is None:
            out.append(call)
        else:
            host.spans.extend(call.spans)
            host._ordered = host._tool_call_ids = None
    return out


def _recorder(span: Span) -> Any:
    """What recorded ``span``: its OTLP instrumentation scope, or the agl plugin (None: not known)."""
    a = span.attributes
    return a.get(semconv.OTEL_SCOPE_NAME) or a.get(semconv.AGL_PLUGIN)


def _same_messages(one: _Call, other: _Call) -> bool:
    """The two calls sent the same prompt and got the same reply, read from the first of each call's spans that
    holds them (a framework's chat span may leave them to agl's span of the HTTP request nested in it)."""
    try:
        sides = [[[_gist(m) for m in many_from_genai(_first_json(c, key) or [])]
                  for key in (semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES)] for c in (one, other)]
    except (TypeError, ValueError, AttributeError):
        return False
    return bool(sides[0][1]) and sides[0] == sides[1]


def _gist(message: dict[str, Any]) -> tuple[Any, ...]:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    calls = tuple((c.get("id"), (c.get("function") or {}).get("name")) for c in message.get("tool_calls") or ())
    return message.get("role"), content or None, calls


def _tool_calls_recorded_by_agl(spans: list[Span]) -> set[str]:
    """Call ids of the tool calls that an agl plugin recorded (its span names the plugin)."""
    return {str(s.attributes[semconv.GEN_AI_TOOL_CALL_ID]) for s in spans
            if is_tool_span(s) and s.attributes.get(semconv.AGL_PLUGIN)
            and s.attributes.get(semconv.GEN_AI_TOOL_CALL_ID)}


def _superseded_tool_spans(spans: list[Span]) -> set[str]:
    """Ids of agl tool spans that a later one of the same call id replaces: one call id is one outcome.

    A call run again under its id (a graph resumed after an ``interrupt()`` runs its tool from the start) is
    told to the model once, with the last run's result; only that run is rewarded. A model call between
    the two means the id was used again for a new call (servers that number calls per reply reuse
    ``call_0``), and each of those calls keeps its own outcome.
    """
    asked = sorted(s.start_ns for s in spans if is_llm_span(s))
    last: dict[str, Span] = {}
    superseded: set[str] = set()
    for span in spans:
        call_id = span.attributes.get(semconv.GEN_AI_TOOL_CALL_ID)
        if not (is_tool_span(span) and span.attributes.get(semconv.AGL_PLUGIN) and call_id):
            continue
        before = last.get(str(call_id))
        if before is not None and _model_asked_between(asked, before, span):
            before = None
        if before is not None:
            later, earlier = (span, before) if span.end_ns >= before.end_ns else (before, span)
            superseded.add(earlier.span_id)
            last[str(call_id)] = later
        else:
            last[str(call_id)] = span
    return superseded


def _model_asked_between(asked: list[int], one: Span, other: Span) -> bool:
    """Whether a model call started after the earlier of two spans ended and before the later one started."""
    earlier, later = (one, other) if one.end_ns <= other.end_ns else (other, one)
    i = bisect.bisect_right(asked, earlier.end_ns)
    return i < len(asked) and asked[i] < later.start_ns


def _seen_by_agl(span: Span, recorded: set[str]) -> bool:
    """A framework's own span of a tool call an agl plugin recorded too: one call is one AIR signal.

    Pydantic AI, AutoGen and others make ``execute_tool`` spans of their own on the user's provider;
    agl collects those too, and its plugin's span of the same call says more (the outcome the model
    was told), so that one is the call's.
    """
    if span.attributes.get(semconv.AGL_PLUGIN):
        return False
    call_id = span.attributes.get(semconv.GEN_AI_TOOL_CALL_ID)
    return call_id is not None and str(call_id) in recorded


def _call_before(calls: list[_Call], time_ns: int) -> _Call:
    """The last call that started at or before ``time_ns`` (the first call for earlier signals)."""
    owner = calls[0]
    for call in calls:
        if call.start <= time_ns:
            owner = call
        else:
            break
    return owner


def _call_for_tool(calls: list[_Call], tool: Span) -> _Call:
    """The call that asked for ``tool``: of those that issued its id, the last to start before it ran.

    An id can come back in a later reply (servers that number calls per reply reuse ``call_0``);
    the first issuer is kept when none started before the tool (clocks of two processes).
    """
    call_id = tool.attributes.get(semconv.GEN_AI_TOOL_CALL_ID)
    if call_id:
        issuers = [call for call in calls if call_id in call.tool_call_ids()]
        if issuers:
            return _call_before(issuers, tool.start_ns)
    return _call_before(calls, tool.start_ns)


def _first_json(call: _Call, key: str) -> Any:
    for span in call.ordered():
        if span.attributes.get(key) is not None:
            return _json_attr(span, key)
    return None


def _first_finish(call: _Call) -> Any:
    reasons = call.first(semconv.GEN_AI_RESPONSE_FINISH_REASONS)
    if isinstance(reasons, (list, tuple)):
        return reasons[0] if reasons else None  # an empty list is "no reason", never the text '[]'
    return reasons


def _agent_name(call: _Call, by_id: dict[str, Span]) -> str | None:
    span: Span | None = call.outer
    hops = 0
    while span is not None and hops < 10_000:
        name = span.attributes.get(semconv.GEN_AI_AGENT_NAME)
        if isinstance(name, str) and name:
            return name
        span = by_id.get(span.parent_id) if span.parent_id else None
        hops += 1
    inner = call.first(semconv.GEN_AI_AGENT_NAME)
    return inner if isinstance(inner, str) else None


_CUT_OFF = frozenset({"length", "max_tokens"})
"""Finish reasons of a reply cut off by its token limit (OpenAI, vLLM and the torch engine; Anthropic)."""


def _malformed(response: dict[str, Any], tools: Any) -> bool:
    """The reply tried to call a tool and failed: a parsed call that is not valid, or a block left in its text."""
    names = None
    if isinstance(tools, list):
        names = {((t.get("function") or {}).get("name") or t.get("name")) if isinstance(t, dict) else None
                 for t in tools}
        names.discard(None)
    for call in response.get("tool_calls") or []:
        fn = call.get("function") or {}
        if not _valid_call(fn.get("name"), fn.get("arguments") or "{}", names):
            return True
    return _failed_text_call(response.get("content"), names)


def _valid_call(name: Any, arguments: Any, names: set[Any] | None) -> bool:
    if not isinstance(name, str) or (names and name not in names):
        return False
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return False
    return isinstance(arguments, dict)


_TEXT_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def _failed_text_call(content: Any, names: set[Any] | None) -> bool:
    """A ``<tool_call>`` block (the Hermes/Qwen convention) left in the reply's text that is not a valid call.

    A serving engine's tool parser (agl's torch engine, vLLM's ``hermes``) turns each valid
    block into a ``tool_calls`` entry and leaves in the text the blocks it could not parse:
    JSON that does not parse, JSON that is not a call, a block cut off by ``max_tokens``
    (never closed). A valid block left in the text is the backend's doing (it had no tool
    parser), not the model's: not malformed.
    """
    if isinstance(content, list):
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    if not isinstance(content, str) or "<tool_call>" not in content:
        return False
    for block in _TEXT_CALL.finditer(content):
        if not block.group(2):
            return True  # never closed: cut off
        try:
            spec = json.loads(block.group(1))
        except (ValueError, RecursionError):
            return True
        if not isinstance(spec, dict) or not _valid_call(spec.get("name"), spec.get("arguments", {}), names):
            return True
    return False
