"""Rollouts: one run of one task, and the ``emit_*`` calls that add signals to it.

``agl.rollout(...)`` is a sync and async context manager. Entering it opens a
buffer in the collector, makes it current (a ``ContextVar``, so asyncio tasks
and context-copying executors inherit it) and starts a root ``agl.rollout``
span, under which every span of the run nests. Leaving it ends the root span,
closes the buffer, turns the spans into a :class:`~agl_core.schema.Rollout` and,
when a store was given, writes the rollout with its transitions. The agent's
exception, if any, passes through unchanged; the rollout is then ``failed``.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, overload

from agl_core import collector, semconv
from agl_core.errors import SchemaError
from agl_core.guard import report
from agl_core.schema import Reward, Rollout, Trajectory, _check_json

if TYPE_CHECKING:
    from agl_core.store.base import Store
    from agl_core.transitions import TransitionBuilder

logger = logging.getLogger("agl")

_F = TypeVar("_F", bound=Callable[..., Any])


RESOURCES_ENV = "AGL_RESOURCES"
"""Resources for runs with none served: a JSON object, or the path of a JSON file holding one."""

_current_run: ContextVar[RolloutRun | None] = ContextVar("agl_current_run", default=None)


def resources() -> Mapping[str, Any]:
    """What training may change, as the agent reads it: ``agl.resources()["system_prompt"]``.

    Inside a rollout: the resources it runs with (those the server served for it, over the
    rollout's defaults). Outside one: :data:`RESOURCES_ENV` or nothing, so the agent runs
    unchanged outside training. Read-only: an algorithm, not the agent, makes a new version.
    """
    run = _current_run.get()
    if run is not None:
        return run.resources
    return MappingProxyType(configured_resources())


def configured_resources() -> dict[str, Any]:
    """The resources :data:`RESOURCES_ENV` gives (inline JSON or a file); {} when it is unset."""
    text = os.environ.get(RESOURCES_ENV, "").strip()
    if not text:
        return {}
    where = f"${RESOURCES_ENV}"
    if not text.startswith("{"):
        where = f"{where} file {text}"
        try:
            with open(text, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise SchemaError(RESOURCES_ENV, f"cannot read {text}: {exc}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError(RESOURCES_ENV, f"{where} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SchemaError(RESOURCES_ENV, f"{where} must hold an object of resource name to value, "
                                         f"got {type(value).__name__}")
    return check_resources(value, RESOURCES_ENV)


def check_resources(value: Any, path: str = "resources") -> dict[str, Any]:
    """``value`` as resources (an object of non-empty names to JSON values) or ``SchemaError`` naming ``path``."""
    from agl_core.schema import check_json

    if not isinstance(value, dict):
        raise SchemaError(path, f"must be an object of resource name to value, got {type(value).__name__}")
    for name in value:
        if not isinstance(name, str) or not name.strip():
            raise SchemaError(path, f"a resource name must be a non-empty string, got {name!r}")
    plain: dict[str, Any] = check_json(value, path)
    return plain


def current_rollout_id() -> str | None:
    """The id of the rollout the calling code runs in, or None outside any rollout."""
    buffer = collector.current_rollout.get()
    return buffer.rollout_id if buffer is not None and not buffer.closed else None


class RolloutRun:
    """A rollout in progress or finished: ``with agl.rollout(...) as run``."""

    def __init__(
        self,
        task_id: str,
        task: Any = None,
        *,
        store: Store | None = None,
        attempt: int = 1,
        rollout_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        builder: TransitionBuilder | None = None,
        resources: Mapping[str, Any] | None = None,
        resources_version: int | None = None,
    ) -> None:
        if not isinstance(task_id, str) or not task_id:
            raise SchemaError("rollout.task_id", f"must be a non-empty string, got {task_id!r}")
        self.rollout = Rollout(
            id=rollout_id or uuid.uuid4().hex,
            task_id=task_id,
            attempt=attempt,
            task=task,
            metadata=metadata or {},
            resources_version=resources_version,
        )
        given = check_resources(dict(resources), "rollout.resources") if resources is not None else None
        self.resources: Mapping[str, Any] = MappingProxyType(
            given if given is not None else configured_resources())
        """What ``agl.resources()`` answers inside this rollout."""
        self.store = store
        self.builder = builder
        self.store_error: BaseException | None = None
        self._buffer: collector.RolloutBuffer | None = None
        self._span: Any = None
        self._tokens: tuple[Any, Any, Any] | None = None
        self._trajectory: Trajectory | None = None

    # -- entering and leaving ------------------------------------------------------

    def _enter(self) -> RolloutRun:
        if self._buffer is not None:
            raise RuntimeError(f"rollout {self.rollout.id} was already entered; make a new agl.rollout(...) per run")
        from opentelemetry import context as otel_context
        from opentelemetry import trace

        r = self.rollout
        r.start_time = time.time()
        buffer = collector.RolloutBuffer(r.id, r.task_id, r.attempt)
        collector.open_buffer(buffer)
        self._buffer = buffer
        var_token = collector.current_rollout.set(buffer)
        self._span = collector.tracer().start_span(
            f"{semconv.SPAN_ROLLOUT} {r.task_id}",
            attributes={
                semconv.AGL_SPAN_KIND: semconv.KIND_ROLLOUT,
                semconv.AGL_TASK_ID: r.task_id,
                semconv.AGL_ROLLOUT_ATTEMPT: r.attempt,
            },
        )
        ctx_token = otel_context.attach(trace.set_span_in_context(self._span))
        self._tokens = (var_token, ctx_token, _current_run.set(self))
        return self

    def _exit(self, exc: BaseException | None, *, save: bool = True) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry.trace import Status, StatusCode

        assert self._buffer is not None and self._tokens is not None
        r = self.rollout
        if exc is not None:
            r.status = "cancelled" if isinstance(exc, (KeyboardInterrupt, _cancelled_error())) else "failed"
            r.error = f"{type(exc).__name__}: {exc}"
            self._span.record_exception(exc)
            self._span.set_status(Status(StatusCode.ERROR, r.error))
        else:
            r.status = "succeeded"
        self._span.end()
        var_token, ctx_token, run_token = self._tokens
        try:
            otel_context.detach(ctx_token)
            collector.current_rollout.reset(var_token)
            _current_run.reset(run_token)
        except ValueError:  # left in another context than it was entered (a generator moved across tasks)
            collector.current_rollout.set(None)
            _current_run.set(None)
        finished = collector.close_buffer(self._buffer)
        r.end_time = time.time()
        r.spans = sorted((collector.to_record(s, r.id) for s in finished), key=lambda s: (s.start_ns, s.end_ns))
        r.rewards = _rewards_of(r)
        if save and self.store is not None:
            self._save()

    def _save(self) -> None:
        assert self.store is not None
        try:
            self.store.put_rollout(self.rollout, self.trajectory(), validate=False)  # built and checked just now
        except Exception as exc:  # noqa: BLE001 - the agent's result must not depend on the store
            self.store_error = exc
            report("rollout store write", exc)

    def __enter__(self) -> RolloutRun:
        return self._enter()

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._exit(exc)

    async def __aenter__(self) -> RolloutRun:
        return self._enter()

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        import asyncio

        self._exit(exc, save=False)
        if self.store is not None:
            # the store's write (an HTTP post for HttpStore) in a thread: the other coroutines on this
            # loop, other rollouts among them, run on while it waits
            await asyncio.to_thread(self._save)

    # -- results ----------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self.rollout.id

    def trajectory(self, builder: TransitionBuilder | None = None) -> Trajectory:
        """The rollout's transitions; with ``builder``, another selection of the same spans."""
        if self._buffer is None or not self._buffer.closed:
            raise RuntimeError("the rollout is still running: call trajectory() after its block ends")
        if builder is None:
            if self._trajectory is None:
                self._trajectory = (self.builder or _default_builder()).build(self.rollout)
            return self._trajectory
        return builder.build(self.rollout)


def _cancelled_error() -> type[BaseException]:
    import asyncio

    return asyncio.CancelledError


def _default_builder() -> TransitionBuilder:
    from agl_core.transitions import TransitionBuilder

    return TransitionBuilder()


def _rewards_of(rollout: Rollout) -> list[Reward]:
    rewards = []
    for span in rollout.spans:
        attrs = span.attributes
        if attrs.get(semconv.AGL_SPAN_KIND) != semconv.KIND_REWARD:
            continue
        value = attrs.get(semconv.AGL_REWARD_VALUE)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            name = attrs.get(semconv.AGL_REWARD_NAME)
            rewards.append(Reward(value=float(value), name=name if isinstance(name, str) else None,
                                  span_id=span.span_id, time_ns=span.start_ns))
    return rewards


def rollout(
    task_id: str,
    task: Any = None,
    *,
    store: Store | None = None,
    attempt: int = 1,
    rollout_id: str | None = None,
    metadata: dict[str, Any] | None = None,
    builder: TransitionBuilder | None = None,
    resources: Mapping[str, Any] | None = None,
    resources_version: int | None = None,
) -> RolloutRun:
    """Group everything the agent does inside the block into one rollout of ``task_id``.

    ``resources`` (and the server's ``resources_version`` they came from) are what
    ``agl.resources()`` answers inside the block; None: :data:`RESOURCES_ENV` or nothing.
    """
    return RolloutRun(task_id, task, store=store, attempt=attempt, rollout_id=rollout_id,
                      metadata=metadata, builder=builder, resources=resources, resources_version=resources_version)


# --------------------------------------------------------------------------- decorator


def _task_id_of(task: Any) -> str:
    if isinstance(task, dict):
        for key in ("task_id", "id"):
            if isinstance(task.get(key), (str, int)):
                return str(task[key])
    return uuid.uuid4().hex


def _reward_from(result: Any) -> None:
    if result is None:
        return
    if isinstance(result, bool) or not isinstance(result, (int, float)):
        raise SchemaError("rollout_fn return value",
                          f"must be a reward (a number) or None, got {type(result).__name__}")
    emit_reward(float(result))


def _takes_resources(func: Callable[..., Any]) -> bool:
    """Whether ``func`` declares a second positional parameter for the resources: ``def agent(task, resources)``."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2:
        return False
    second = positional[1]
    return second.name == "resources" or second.default is inspect.Parameter.empty


@overload
def rollout_fn(fn: _F, /) -> _F: ...
@overload
def rollout_fn(*, store: Store | None = None, builder: TransitionBuilder | None = None,
               resources: Mapping[str, Any] | None = None) -> Callable[[_F], _F]: ...


def rollout_fn(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    store: Store | None = None,
    builder: TransitionBuilder | None = None,
    resources: Mapping[str, Any] | None = None,
) -> Any:
    """Make ``def agent(task) -> reward | None`` (or ``def agent(task, resources)``) run each call as one rollout.

    The task id is ``task["task_id"]`` or ``task["id"]`` when present (pass
    ``task_id=`` or ``store=`` as keywords to override); a returned number is
    the final reward. The wrapped function returns what the original returns;
    ``agent.last_run`` is the most recent :class:`RolloutRun`.

    ``builder`` decides what is trained wherever the function runs: ``agent.builder`` is it, and
    ``agl worker`` / ``agl train`` hand its settings to the server that builds the stored
    transitions (a key the server or the training config sets otherwise is an error at start).

    Resources: ``resources=`` here are the defaults; a caller (the worker) passes the
    served ones as ``resources=`` and ``resources_version=`` keywords, and they win key
    by key; with none served, :data:`RESOURCES_ENV` does. An agent with a second
    parameter gets them as it (read-only); any agent can call ``agl.resources()``.
    """
    defaults = check_resources(dict(resources), "rollout_fn.resources") if resources is not None else {}

    def decorate(func: Callable[..., Any]) -> Any:
        pass_resources = _takes_resources(func)

        def start(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[RolloutRun, tuple[Any, ...]]:
            task_id = kwargs.pop("task_id", None) or _task_id_of(task)
            served = kwargs.pop("resources", None)
            version = kwargs.pop("resources_version", None)
            merged = {**defaults, **(served if served is not None else configured_resources())}
            run = rollout(task_id, task, store=kwargs.pop("store", store), builder=builder,
                          attempt=kwargs.pop("attempt", 1), resources=merged, resources_version=version)
            wrapper.last_run = run
            if pass_resources and not args:
                args = (run.resources,)
            return run, args

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(task: Any, *args: Any, **kwargs: Any) -> Any:
                run, args = start(task, args, kwargs)
                async with run:
                    result = await func(task, *args, **kwargs)
                    _reward_from(result)
                return result

            wrapper: Any = async_wrapper
        else:

            @functools.wraps(func)
            def sync_wrapper(task: Any, *args: Any, **kwargs: Any) -> Any:
                run, args = start(task, args, kwargs)
                with run:
                    result = func(task, *args, **kwargs)
                    _reward_from(result)
                return result

            wrapper = sync_wrapper
        wrapper.last_run = None
        wrapper.builder = builder
        return wrapper

    return decorate(fn) if fn is not None else decorate


# --------------------------------------------------------------------------- emit_*

_warned_outside = False
_FLOAT_MAX = 1.7976931348623157e308  # an int beyond it has no float


def _instant_span(name: str, attributes: dict[str, Any]) -> str:
    """Start and end a span now; return its id (hex). Warns once when outside any rollout."""
    global _warned_outside
    if current_rollout_id() is None and not _warned_outside:
        _warned_outside = True
        logger.warning("agl: %s emitted outside agl.rollout(...): it belongs to no rollout", name)
    span = collector.tracer().start_span(name, attributes=attributes)
    span.end()
    return format(span.get_span_context().span_id, "016x")


def emit_reward(value: float, name: str | None = None, *, attributes: dict[str, Any] | None = None) -> str:
    """Record a reward: without ``name`` the final reward, with one an intermediate reward.

    Intermediate rewards attach to the LLM call they follow. Returns the reward span's id.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SchemaError("emit_reward.value", f"must be a number, got {type(value).__name__} {value!r}")
    if value != value or value in (float("inf"), float("-inf")) or abs(value) > _FLOAT_MAX:
        raise SchemaError("emit_reward.value", f"must be a finite number, got {value!r}")
    if name is not None and (not isinstance(name, str) or not name):
        raise SchemaError("emit_reward.name", f"must be a non-empty string or None, got {name!r}")
    attrs: dict[str, Any] = dict(attributes or {})
    attrs[semconv.AGL_SPAN_KIND] = semconv.KIND_REWARD
    attrs[semconv.AGL_REWARD_VALUE] = float(value)
    if name is not None:
        attrs[semconv.AGL_REWARD_NAME] = name
    return _instant_span(semconv.SPAN_REWARD, attrs)


def emit_message(message: str, *, attributes: dict[str, Any] | None = None) -> str:
    """Record a free-text message (a log line worth keeping with the rollout)."""
    if not isinstance(message, str):
        raise SchemaError("emit_message.message", f"must be a string, got {type(message).__name__}")
    attrs = dict(attributes or {})
    attrs.update({semconv.AGL_SPAN_KIND: semconv.KIND_MESSAGE, semconv.AGL_MESSAGE_BODY: message})
    return _instant_span(semconv.SPAN_MESSAGE, attrs)


def emit_object(obj: Any, *, attributes: dict[str, Any] | None = None) -> str:
    """Record a JSON-serialisable object (a parsed answer, an environment state)."""
    value = _check_json(obj, "emit_object.obj")
    attrs = dict(attributes or {})
    attrs.update({semconv.AGL_SPAN_KIND: semconv.KIND_OBJECT,
                  semconv.AGL_OBJECT_JSON: json.dumps(value, ensure_ascii=False)})
    return _instant_span(semconv.SPAN_OBJECT, attrs)


def emit_exception(exc: BaseException, *, attributes: dict[str, Any] | None = None) -> str:
    """Record an exception the agent handled itself but that should stay visible in the rollout."""
    if not isinstance(exc, BaseException):
        raise SchemaError("emit_exception.exc", f"must be an exception, got {type(exc).__name__}")
    from opentelemetry.trace import Status, StatusCode

    attrs = dict(attributes or {})
    attrs.update({semconv.AGL_SPAN_KIND: semconv.KIND_EXCEPTION, semconv.ERROR_TYPE: type(exc).__name__})
    span = collector.tracer().start_span(semconv.SPAN_EXCEPTION, attributes=attrs)
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
    span.end()
    return format(span.get_span_context().span_id, "016x")
