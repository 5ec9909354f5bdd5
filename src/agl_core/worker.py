"""``agl worker``: lease tasks from an agl server, run the agent on each, post the rollouts.

    agl worker --server http://127.0.0.1:8000 --agent my_pkg.agent:solve -n 4
    agl worker --server http://127.0.0.1:8000 --command "node agent.js"   # any language, a subprocess per task

With ``--command`` the agent is a program in any language, run once per task with
``OPENAI_BASE_URL`` scoped to its rollout (:mod:`agl_core.command_agent` says what it is given and
how it reports its reward). Otherwise each of ``-n`` slots leases a task, runs the user's agent (an
``@agl.rollout_fn`` function ``def solve(task) -> reward | None``, sync or
async; a plain function is wrapped in one) as attempt ``n`` of that task, and
the rollout context posts the rollout to the server (:class:`HttpStore`) with
the lease, which finishes the task. A heartbeat thread keeps the slots' leases
alive while agents run; a worker that dies stops heartbeating, and the server
gives its tasks to another worker as the next attempt.

Before each rollout the worker asks the server for its current resources (``GET
/v1/resources``: the prompt an algorithm is trying, say) and runs the agent with them;
the rollout records their version.

The agent talks to the model through the server's gateway with no change to its
code: before the agent's module is imported, ``OPENAI_BASE_URL`` is set to the
server's ``/v1`` and ``OPENAI_API_KEY`` to the server's token (the environment
variables every OpenAI client reads), and ``agl.instrument()`` is on, so each
call carries the ``traceparent`` that joins the gateway's token ids to it.
Each rollout is also handed the policy's endpoint, ``agl.policy()`` (base URL,
key, served model name): an agent with models that are not trained (a frozen
judge) reaches the policy that way and runs with ``--no-gateway-env``, so those
variables stay with its other models. Overwriting variables that pointed
elsewhere is said once, naming that fix.

Shutdown: the first SIGTERM (or SIGINT) stops leasing; rollouts in flight get
``grace_s`` seconds to finish and be posted, and those still running then are
released back to the queue (not counted as a try) before the process exits. A
second signal releases them at once.

An attempt that ends without a result is given back as *failed*, which the
server counts as a try (and backs off before the next): the agent raised before
its rollout existed, the server refused the rollout (400, 413, a 409 conflict),
or the infrastructure failed (:func:`is_infrastructure_error`: the agent could
not get an answer from the model server, so its failed rollout says nothing
about the agent and is not stored). So every task ends done or failed with a
reason within its ``max_attempts``, however it fails.

A server that cannot be reached is said once and then at each step of a
back-off (0.5 s doubling to 30 s) while the worker retries; ``idle_exit_s``
counts that time as idle, and the worker then stops with the reason
(``agl worker`` exits 1). Posting a rollout or giving a lease back retries an
unreachable server for 30 s (a restart), and for no longer than ``idle_exit_s``,
so a server that went away mid-rollout stops the worker within that time too.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import inspect
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import typing
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any

from agl_core.errors import AglError
from agl_core.policy_endpoint import Policy, mark_calls_elsewhere, use_policy
from agl_core.schema import Rollout, Trajectory
from agl_core.store.http import HttpStore, ServerClient, ServerError

__all__ = ["Lease", "TaskClient", "Worker", "WorkerStats", "is_infrastructure_error", "load_agent", "main"]

logger = logging.getLogger("agl.worker")


@dataclass(frozen=True)
class Lease:
    """A task the server handed to this worker, as attempt ``attempt``, until ``deadline`` (epoch seconds)."""

    lease_id: str
    task_id: str
    attempt: int
    group_id: str
    task: Any
    deadline: float
    lease_timeout: float

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lease:
        return cls(lease_id=str(data["lease_id"]), task_id=str(data["task_id"]), attempt=int(data["attempt"]),
                   group_id=str(data["group_id"]), task=data.get("task"), deadline=float(data["deadline"]),
                   lease_timeout=float(data["lease_timeout"]))


class TaskClient:
    """The task queue of the agl server at ``url``: enqueue, lease, heartbeat, release, look up."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 60.0, retry_s: float = 30.0) -> None:
        self.client = ServerClient(url, token, timeout=timeout, retry_s=retry_s)

    @property
    def url(self) -> str:
        return self.client.url

    def enqueue(self, tasks: Sequence[Any], *, repeat: int = 1, group_id: str | None = None,
                max_attempts: int | None = None, task_ids: Sequence[str] | None = None) -> list[str]:
        """Queue each task payload ``repeat`` times; return the task ids (see the server for how ids are made)."""
        if task_ids is not None and len(task_ids) != len(tasks):
            raise ValueError(f"task_ids has {len(task_ids)} ids for {len(tasks)} tasks")
        items = [{"task": t} if task_ids is None else {"task": t, "task_id": task_ids[i]}
                 for i, t in enumerate(tasks)]
        body: dict[str, Any] = {"tasks": items, "repeat": repeat}
        if group_id is not None:
            body["group_id"] = group_id
        if max_attempts is not None:
            body["max_attempts"] = max_attempts
        _, data = self.client.request("POST", "/v1/tasks", body)
        return [str(i) for i in data["task_ids"]]

    def lease(self, worker_id: str, *, wait_s: float = 0.0, lease_timeout: float | None = None,
              retry: bool = True) -> Lease | None:
        """The next task for ``worker_id``, waiting up to ``wait_s`` seconds for one; None when none came.

        ``retry=False``: an unreachable or busy server raises at once instead of being retried.
        """
        body: dict[str, Any] = {"worker_id": worker_id, "wait_s": wait_s}
        if lease_timeout is not None:
            body["lease_timeout"] = lease_timeout
        status, data = self.client.request("POST", "/v1/tasks/lease", body, timeout=self.client.timeout + wait_s,
                                           retry=retry)
        if status == 204 or not data:
            return None
        return Lease.from_dict(data)

    def heartbeat(self, lease_ids: Sequence[str]) -> tuple[list[str], list[str]]:
        """Keep these leases alive; return (alive, lost) ids."""
        _, data = self.client.request("POST", "/v1/leases/heartbeat", {"lease_ids": list(lease_ids)}, retry=False)
        return list(data["alive"]), list(data["lost"])

    def release(self, lease_id: str, reason: str, *, failed: bool = False) -> bool:
        """Give a lease back; False when it was no longer current (finished, or already moved on).

        ``failed``: the attempt ended without a result, and counts as a try (see the module docstring);
        without it (a shutdown) the task is tried again at once, as if never leased.
        """
        try:
            self.client.request("POST", f"/v1/leases/{lease_id}/release", {"reason": reason, "failed": failed})
        except ServerError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def task(self, task_id: str) -> dict[str, Any]:
        """A task's state and the history of its attempts."""
        from urllib.parse import quote

        _, data = self.client.request("GET", f"/v1/tasks/{quote(task_id, safe='')}")
        return typing.cast(dict[str, Any], data)

    def resources(self) -> tuple[int, dict[str, Any]] | None:
        """The server's current resources as (version, resources); None when it serves none (or no such route)."""
        try:
            _, data = self.client.request("GET", "/v1/resources")
        except ServerError as exc:
            if exc.status == 404:  # a server from before resources, or none posted yet
                return None
            raise
        return int(data["version"]), dict(data["resources"])

    def counts(self) -> dict[str, int]:
        """How many tasks are queued, leased, done and failed."""
        _, data = self.client.request("GET", "/v1/queue")
        return {str(k): int(v) for k, v in data.items()}

    def wait(self, *, timeout: float, poll_s: float = 0.1) -> dict[str, int]:
        """Block until no task is queued or leased (or ``timeout`` passes); return the counts."""
        deadline = time.monotonic() + timeout
        while True:
            counts = self.counts()
            if counts.get("queued", 0) == 0 and counts.get("leased", 0) == 0:
                return counts
            if time.monotonic() > deadline:
                raise TimeoutError(f"tasks still pending after {timeout:g} s: {counts}")
            time.sleep(poll_s)

    def close(self) -> None:
        self.client.close()


class _LeaseStore:
    """What one rollout writes to: it keeps the finished rollout for the worker, which posts it with the lease.

    The rollout context only ever calls ``put_rollout`` on its store, so that is all this offers.
    Posting after the agent is done lets the worker see how the agent ended first: a rollout that
    failed for the infrastructure is given back, not posted as the attempt's result.
    """

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.rollout: Rollout | None = None

    def put_rollout(self, rollout: Rollout, trajectory: Trajectory | None = None, *, validate: bool = True) -> None:
        self.rollout = rollout


@dataclass
class WorkerStats:
    """What a worker did: tasks leased, rollouts posted, agents that raised, leases released or lost."""

    leased: int = 0
    posted: int = 0
    agent_errors: int = 0
    post_errors: int = 0
    released: int = 0
    lost: int = 0
    failed_attempts: int = 0
    """Attempts given back without a result (counted as tries by the server)."""
    infrastructure_errors: int = 0
    """... of which the infrastructure failed (:func:`is_infrastructure_error`)."""
    transitions: int = 0
    token_sources: dict[str, int] = field(default_factory=dict)


_INFRASTRUCTURE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def is_infrastructure_error(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from, says the model could not be asked: not the agent's result.

    Infrastructure: the OpenAI client's ``APIConnectionError`` and ``APITimeoutError`` (the gateway
    could not be reached, or did not answer); an answer whose HTTP status blames the serving side,
    408, 429, 500, 502, 503 or 504 (agl's gateway answers 502 when its backend cannot be reached or
    fails, 504 when it times out), as an ``APIStatusError`` or a stream's error event; httpx's
    transport errors; and Python's ``ConnectionError`` (refused, reset, aborted). Anything else the
    agent raised is the agent's own failure, a result: its rollout is stored as failed.
    """
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if _is_infrastructure(current):
            return True
        todo += [current.__cause__, current.__context__]
    return False


def _is_infrastructure(exc: BaseException) -> bool:
    if isinstance(exc, ConnectionError):
        return True
    kinds = {(cls.__module__.partition(".")[0], cls.__name__) for cls in type(exc).__mro__}
    if ("openai", "APIConnectionError") in kinds or ("httpx", "TransportError") in kinds:
        return True  # APITimeoutError is an APIConnectionError; httpx's timeouts are transport errors
    if ("openai", "APIStatusError") in kinds:
        return getattr(exc, "status_code", None) in _INFRASTRUCTURE_STATUSES
    if ("openai", "APIError") in kinds:  # an error event in a stream: the status is the body's code
        body = getattr(exc, "body", None)
        code = body.get("code") if isinstance(body, dict) else None
        return isinstance(code, int) and code in _INFRASTRUCTURE_STATUSES
    return False


def load_agent(spec: str) -> Callable[..., Any]:
    """``"pkg.module:function"`` (or ``pkg.module:obj.attr``) as the object it names."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--agent must look like pkg.module:function, got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} for --agent {spec}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{module_name!r} has no {attr!r} (--agent {spec})") from None
    if not callable(obj):
        raise ValueError(f"--agent {spec} is a {type(obj).__name__}, not a function")
    return typing.cast(Callable[..., Any], obj)


def point_openai_at(server_url: str, token: str | None) -> None:
    """Make every OpenAI client created from now on talk to the server's gateway.

    An ``OPENAI_BASE_URL`` that pointed elsewhere is said once: whatever read it (a frozen judge)
    now calls the policy.
    """
    gateway = server_url.rstrip("/") + "/v1"
    before = os.environ.get("OPENAI_BASE_URL")
    if before and before.rstrip("/") != gateway:
        logger.warning("agl worker: OPENAI_BASE_URL was %s and now points at the policy's gateway %s, so every "
                       "OpenAI client that reads it calls the policy and is trained; to keep other models (a frozen "
                       "judge) on %s, reach the policy through agl.policy() and run agl worker --no-gateway-env, or "
                       "give the frozen model its upstream (agl serve --upstream MODEL=%s)", before, gateway, before,
                       before)
    os.environ["OPENAI_BASE_URL"] = gateway
    os.environ["OPENAI_API_KEY"] = token or "agl-no-token"


class Worker:
    """Leases tasks from the server at ``server`` and runs ``agent`` on each, ``concurrency`` at a time.

    ``agent`` is a function or a ``"pkg.module:function"`` string (imported after the OpenAI
    environment points at the gateway). ``max_tasks`` stops after that many leases;
    ``idle_exit_s`` stops once no task has come for that long.
    """

    def __init__(
        self,
        server: str,
        agent: Callable[..., Any] | str | None = None,
        *,
        command: str | None = None,
        command_timeout_s: float | None = None,
        token: str | None = None,
        concurrency: int = 1,
        worker_id: str | None = None,
        lease_timeout: float | None = None,
        heartbeat_s: float | None = None,
        grace_s: float = 30.0,
        max_tasks: int | None = None,
        idle_exit_s: float | None = None,
        poll_s: float = 5.0,
        set_openai_env: bool = True,
        instrument: bool = True,
    ) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")
        # a post or give-back retries an unreachable server (a restart) for up to 30 s; with idle_exit_s
        # no longer than that, or a worker whose server went away mid-rollout would outlive its --idle-exit
        retry_s = 30.0 if idle_exit_s is None else min(30.0, max(idle_exit_s, 0.5))
        self.tasks = TaskClient(server, token, retry_s=retry_s)
        self.store = HttpStore(server, token, retry_s=retry_s)
        self.url = self.tasks.url
        self._token = token
        self._policy: Policy | None = None
        self._frozen_said: set[str] = set()
        if set_openai_env and command is None:  # a command's subprocess gets its own, scoped to its rollout
            point_openai_at(self.url, token)
        if instrument and command is None:
            from agl_core.instrumentation import instrument as instrument_all

            instrument_all()
        if (agent is None) == (command is None):
            raise ValueError("give the agent as --agent pkg.module:function or as --command 'node agent.js' "
                             "(one of them)")
        if command is not None:
            from agl_core.command_agent import CommandAgent

            agent = CommandAgent(command, self.url, token, timeout_s=command_timeout_s, set_openai_env=set_openai_env)
        assert agent is not None
        fn = load_agent(agent) if isinstance(agent, str) else agent
        if not hasattr(fn, "last_run"):  # not an @agl.rollout_fn yet
            from agl_core.rollouts import rollout_fn

            fn = rollout_fn(fn)
        self.agent = fn
        self.is_async = inspect.iscoroutinefunction(fn)
        self.concurrency = concurrency
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.lease_timeout = lease_timeout
        self.heartbeat_s = heartbeat_s
        self.grace_s = grace_s
        self.max_tasks = max_tasks
        self.idle_exit_s = idle_exit_s
        self.poll_s = poll_s
        self.stats = WorkerStats()
        self._lock = threading.Lock()
        self._inflight: dict[str, Lease] = {}
        # leases whose rollout is being posted: a heartbeat sent before the post may reach the server
        # after it and hear "lost" for a lease that was in fact finished
        self._posting: set[str] = set()
        self._lost: set[str] = set()  # leases counted in stats.lost, so a loss seen twice counts once
        self._stopping = threading.Event()
        self._hurry = threading.Event()
        self._leases_given = 0
        self._last_work = time.monotonic()
        self.fatal: ServerError | None = None
        """Why the worker stopped by itself (the server refused its token), raised by :meth:`run`."""
        self.unreachable: str | None = None
        """While the server cannot be reached (and when the worker stopped so): why, else None."""
        self._down_since: float | None = None
        self._down_delay = 0.5
        self._down_said = -math.inf
        self._loop: asyncio.AbstractEventLoop | None = None
        self._builder_lock = threading.Lock()
        self._builder_joined = False
        builder = getattr(fn, "builder", None)
        # now, so a builder no server could load (a lambda among its functions) fails before any task is leased
        self._builder_settings: dict[str, Any] = builder.settings() if builder is not None else {}
        self._agent_name = agent if isinstance(agent, str) else \
            f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', '?')}"

    # ------------------------------------------------------------------ control

    def stop(self, *, now: bool = False) -> None:
        """Lease nothing more; with ``now``, release the rollouts in flight instead of waiting for them."""
        self._stopping.set()
        if now:
            self._hurry.set()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stopping.is_set():
            logger.warning("agl worker: second signal: releasing the rollouts in flight now")
            self._hurry.set()
        else:
            logger.warning("agl worker: signal %d: finishing the rollouts in flight (up to %g s), leasing no more",
                           signum, self.grace_s)
            self._stopping.set()

    def run(self) -> WorkerStats:
        """Work until stopped (signal, :meth:`stop`, ``max_tasks`` or ``idle_exit_s``); return the stats.

        Raises :class:`ServerError` when the server refuses the worker's token (401 or 403).
        """
        restore: list[tuple[signal.Signals, Any]] = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                restore.append((sig, signal.signal(sig, self._on_signal)))
        slots = [threading.Thread(target=self._slot, name=f"agl-worker-{i}", daemon=True)
                 for i in range(self.concurrency)]
        beat = threading.Thread(target=self._heartbeats, name="agl-worker-heartbeat", daemon=True)
        try:
            for t in slots:
                t.start()
            beat.start()
            while any(t.is_alive() for t in slots):
                if self._stopping.is_set():
                    self._drain(slots)
                    break
                for t in slots:
                    t.join(timeout=0.1)
        finally:
            for sig, handler in restore:
                signal.signal(sig, handler)
            self._stopping.set()
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None
        if self.fatal is not None and self.fatal.status in (401, 403):
            raise ServerError(self.fatal.status, f"the agl server at {self.url} refused this worker: "
                                                 f"{self.fatal.message}; pass the server's token (--token or "
                                                 f"AGL_TOKEN)", self.fatal.param)
        if self.fatal is not None:
            raise self.fatal
        return self.stats

    def _drain(self, slots: list[threading.Thread]) -> None:
        """Wait up to the grace period for rollouts in flight, then give back the leases still held."""
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and not self._hurry.is_set():
            with self._lock:
                if not self._inflight:
                    break
            for t in slots:
                t.join(timeout=0.05)
        with self._lock:
            left = list(self._inflight.values())
        for lease in left:
            try:
                if self.tasks.release(lease.lease_id, f"worker {self.worker_id} shut down before the rollout "
                                                      f"finished"):
                    with self._lock:
                        self.stats.released += 1
            except AglError as exc:
                logger.warning("agl worker: could not release lease of task %s: %s", lease.task_id, exc)

    # ------------------------------------------------------------------ slots

    def _take(self) -> bool:
        with self._lock:
            if self.max_tasks is not None and self._leases_given >= self.max_tasks:
                return False
            self._leases_given += 1
            return True

    def _slot(self) -> None:
        while not self._stopping.is_set():
            if not self._take():
                return
            try:
                if not self._join_builder():
                    return
                lease = self.tasks.lease(self.worker_id, wait_s=self.poll_s, lease_timeout=self.lease_timeout,
                                         retry=False)
            except AglError as exc:
                with self._lock:
                    self._leases_given -= 1
                if isinstance(exc, ServerError) and exc.status in (401, 403):
                    # no retry mends a missing or wrong token: stop, and say so from run()
                    self.fatal = exc
                    self._stopping.set()
                    return
                self._stopping.wait(self._unreachable(exc))
                continue
            self._reached()
            if lease is None:
                with self._lock:
                    self._leases_given -= 1
                if self.idle_exit_s is not None and time.monotonic() - self._last_work > self.idle_exit_s \
                        and not self._tasks_waiting():
                    self._stopping.set()
                continue
            if self._stopping.is_set():
                self.tasks.release(lease.lease_id, f"worker {self.worker_id} is shutting down")
                return
            with self._lock:
                self._inflight[lease.lease_id] = lease
                self.stats.leased += 1
            try:
                self._run_one(lease)
            finally:
                with self._lock:
                    self._inflight.pop(lease.lease_id, None)
                    self._posting.discard(lease.lease_id)
                    self._lost.discard(lease.lease_id)

    def _join_builder(self) -> bool:
        """Hand the agent's ``@agl.rollout_fn`` builder to the server, once, before the first lease; False: refused.

        The server builds the stored transitions (it joins the gateway's token ids first), so the
        builder given in code must reach it, or a call the code leaves out would be trained. A key
        the server sets otherwise (``agl serve --agent-match``, a training config) is refused by it,
        naming both values, and the worker stops with that error before running any task.
        """
        with self._builder_lock:
            if self._builder_joined or not self._builder_settings:
                return True
            try:
                self.tasks.client.request("POST", "/v1/builder", {
                    "settings": self._builder_settings,
                    "source": f"the agent's @agl.rollout_fn builder ({self._agent_name})"}, retry=False)
            except ServerError as exc:
                if exc.status in (401, 403):
                    raise
                hint = " (a server older than this worker: upgrade agl-trainer)" if exc.status == 404 else ""
                self.fatal = ServerError(exc.status, f"the agl server at {self.url} refused the agent's builder: "
                                                     f"{exc.message}{hint}", exc.param)
                self._stopping.set()
                return False
            self._builder_joined = True
            return True

    def _tasks_waiting(self) -> bool:
        """Whether tasks are queued but not leasable yet (backing off after a failed try): not idle, then."""
        try:
            return self.tasks.counts().get("queued", 0) > 0
        except AglError:
            return False

    def _unreachable(self, exc: AglError) -> float:
        """Say (with back-off, once for all slots) that the server cannot be reached; the seconds to wait.

        With ``idle_exit_s``, the time without a task counts whether or not the server answers.
        """
        now = time.monotonic()
        with self._lock:
            if self._down_since is None:
                self._down_since, self._down_delay, say = now, 0.5, True
            else:  # once the last wait is over: say it again, and wait twice as long
                say = now - self._down_said >= self._down_delay
                if say:
                    self._down_delay = min(self._down_delay * 2, 30.0)
            if say:
                self._down_said = now
            delay = self._down_delay
            # the client's own error already says "cannot reach the agl server at URL: why"
            self.unreachable = str(exc) if "cannot reach" in str(exc) else \
                f"cannot lease from the agl server at {self.url}: {exc}"
        if say:
            logger.warning("agl worker: %s; retrying in %g s", self.unreachable, delay)
        if self.idle_exit_s is not None:
            left = self.idle_exit_s - (now - self._last_work)
            if left <= 0:
                logger.warning("agl worker: no task for %g s (--idle-exit) while the server could not be reached: "
                               "stopping", self.idle_exit_s)
                self._stopping.set()
            delay = min(delay, max(left, 0.0) + 0.05)  # look again when the idle time is up, not a back-off later
        return delay

    def _reached(self) -> None:
        if self._down_since is not None:
            with self._lock:
                if self._down_since is not None:
                    logger.warning("agl worker: reached the agl server at %s again after %.1f s", self.url,
                                   time.monotonic() - self._down_since)
                self._down_since, self.unreachable = None, None

    def _posting_now(self, lease_id: str) -> None:
        with self._lock:
            self._posting.add(lease_id)

    def _count_lost(self, lease_id: str) -> None:
        """Count a lease as lost once, whether the heartbeat or the post found out (the caller holds the lock)."""
        if lease_id not in self._lost:
            self._lost.add(lease_id)
            self.stats.lost += 1

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The one event loop all of this worker's async rollouts run on, started on first use.

        One loop, not one per rollout or per slot: clients that a framework caches per process
        (langchain-openai's shared httpx client) hold connections bound to the loop that opened
        them, and fail with "Event loop is closed" on any other.
        """
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="agl-worker-loop", daemon=True).start()
            return self._loop

    def policy(self) -> Policy:
        """The policy's endpoint handed to each rollout (``agl.policy()``): the gateway, once asked its model's name."""
        with self._lock:
            if self._policy is not None:
                return self._policy
        try:
            _, data = self.tasks.client.request("GET", "/v1/models", retry=False)
            names = [m.get("id") for m in data.get("data", [])] if isinstance(data, dict) else []
            model = str(names[0]) if names and names[0] else None
        except AglError as exc:  # asked again for the next rollout
            logger.warning("agl worker: could not ask the gateway for the policy's name (agl.policy().model is "
                           "None): %s", exc)
            return Policy(self.url + "/v1", self._token or "agl-no-token", None)
        with self._lock:
            self._policy = Policy(self.url + "/v1", self._token or "agl-no-token", model)
            return self._policy

    def _run_one(self, lease: Lease) -> None:
        store = _LeaseStore(lease)
        kwargs: dict[str, Any] = {"task_id": lease.task_id, "attempt": lease.attempt, "store": store}
        try:
            served = self.tasks.resources()  # per rollout: an algorithm may have made a new version meanwhile
        except AglError as exc:
            self._give_back(lease, f"the server's resources could not be read: {exc}")
            return
        if served is not None:
            kwargs["resources_version"], kwargs["resources"] = served
        error: BaseException | None = None
        endpoint = self.policy()
        try:
            if self.is_async:
                asyncio.run_coroutine_threadsafe(_with_policy(endpoint, self.agent(lease.task, **kwargs)),
                                                 self._event_loop()).result()
            else:
                use_policy(endpoint)
                self.agent(lease.task, **kwargs)
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - its rollout's status (or a retry)
            error = exc
            with self._lock:
                self.stats.agent_errors += 1
            logger.info("agl worker: task %s attempt %d: the agent raised %s: %s", lease.task_id, lease.attempt,
                        type(exc).__name__, exc)
        self._last_work = time.monotonic()  # the time spent posting to a server that went away is idle time
        if error is not None and is_infrastructure_error(error):
            with self._lock:
                self.stats.infrastructure_errors += 1
            self._give_back(lease, f"infrastructure: {type(error).__name__}: {error}")
            return
        if store.rollout is not None:
            self._say_frozen(mark_calls_elsewhere(store.rollout.spans, endpoint), endpoint)
        if store.rollout is None:
            why = (f"the agent raised before its rollout began: {type(error).__name__}: {error}" if error is not None
                   else "the agent ran no rollout (is it an @agl.rollout_fn writing to the store it is given?)")
            self._give_back(lease, why)
            return
        self._posting_now(lease.lease_id)
        try:
            summary = self.store.post_rollout(store.rollout, lease_id=lease.lease_id)
        except AglError as exc:
            with self._lock:
                self.stats.post_errors += 1
            if isinstance(exc, ServerError) and exc.status == 409 and exc.param == "lease_id":
                with self._lock:
                    self._count_lost(lease.lease_id)
                logger.warning("agl worker: task %s attempt %d: %s", lease.task_id, lease.attempt, exc.message)
                return
            self._give_back(lease, f"the rollout could not be stored: {exc}")
            return
        except (TypeError, ValueError) as exc:  # a value JSON cannot carry: no server could store this rollout
            with self._lock:
                self.stats.post_errors += 1
            self._give_back(lease, f"the rollout could not be sent: {type(exc).__name__}: {exc}")
            return
        with self._lock:
            self.stats.posted += 1
            self.stats.transitions += int(summary.get("transitions", 0))
            for source, n in (summary.get("token_sources") or {}).items():
                self.stats.token_sources[source] = self.stats.token_sources.get(source, 0) + int(n)

    def _say_frozen(self, names: set[str], endpoint: Policy) -> None:
        """Say once per model and server that calls not sent to the policy's endpoint are left out of training."""
        with self._lock:
            new = sorted(names - self._frozen_said)
            self._frozen_said |= names
        for name in new:
            logger.warning("agl worker: calls to %s did not go to the policy (agl.policy() is %s): they are a frozen "
                           "model's and are not trained", name, endpoint.base_url)

    def _give_back(self, lease: Lease, reason: str) -> None:
        """The attempt ended without a result: give the lease back as failed, so the server counts the try."""
        with self._lock:
            self.stats.failed_attempts += 1
        logger.warning("agl worker: task %s attempt %d ended without a result: %s; giving it back as a failed try",
                       lease.task_id, lease.attempt, reason)
        try:
            self.tasks.release(lease.lease_id, reason, failed=True)
        except AglError as exc:
            logger.warning("agl worker: could not give back task %s (its lease will expire instead): %s",
                           lease.task_id, exc)

    def _heartbeats(self) -> None:
        while True:
            with self._lock:
                leases = list(self._inflight.values())
            if leases:
                try:
                    _, lost = self.tasks.heartbeat([lease.lease_id for lease in leases])
                    with self._lock:
                        # a lease whose rollout was posted meanwhile is finished, not lost
                        really = [i for i in lost if i in self._inflight and i not in self._posting]
                        for lease_id in really:
                            self._count_lost(lease_id)
                    for lease_id in really:
                        logger.warning("agl worker: lease %s was lost (it expired on the server)", lease_id)
                except AglError as exc:
                    logger.warning("agl worker: heartbeat failed: %s", exc)
            elif self._stopping.is_set():
                return
            period = self.heartbeat_s or (min(lease.lease_timeout for lease in leases) / 3 if leases else 0.5)
            if self._hurry.wait(period):
                return

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop(now=True)
        self.tasks.close()
        self.store.close()


async def _with_policy(endpoint: Policy, run: Awaitable[Any]) -> Any:
    """``run`` with ``agl.policy()`` set to ``endpoint`` (a task of its own: the setting stays in it)."""
    use_policy(endpoint)
    return await run


# ---------------------------------------------------------------------- Ray


class _RayWorker:
    """One :class:`Worker` inside a Ray actor (made a remote class by :func:`run_on_ray`)."""

    def __init__(self, server: str, agent: str, token: str | None, options: dict[str, Any]) -> None:
        self.worker = Worker(server, agent, token=token, **options)

    def run(self) -> dict[str, Any]:
        return dataclasses.asdict(self.worker.run())

    def stop(self, now: bool = False) -> None:
        self.worker.stop(now=now)


def run_on_ray(
    address: str,
    server: str,
    agent: str,
    *,
    actors: int,
    token: str | None = None,
    actor_cpus: float = 1.0,
    runtime_env: dict[str, Any] | None = None,
    ray_init: dict[str, Any] | None = None,
    stop: threading.Event | None = None,
    **options: Any,
) -> WorkerStats:
    """Run ``actors`` workers as Ray actors on the cluster at ``address`` ("local": start one here).

    Each actor is a :class:`Worker` (``options`` are its keyword arguments: ``concurrency``,
    ``max_tasks``, ``idle_exit_s``, ...) that imports ``agent`` itself, so the agent's module must
    be importable on the cluster (``runtime_env`` can ship it). Ray places and restarts the
    processes; the server's leases do the rest: a task whose actor dies is retried as the next
    attempt. SIGTERM or Ctrl-C stops every actor gracefully, and so does setting ``stop`` from
    another thread (then this returns once the actors are done, so the caller can shut Ray down
    with no call of this thread still in flight). Returns the actors' stats, summed.
    """
    ray: Any = importlib.import_module("ray")
    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, runtime_env=runtime_env,
                 **(ray_init or {}))
    remote = ray.remote(num_cpus=actor_cpus, max_concurrency=2)(_RayWorker)  # 2: stop() while run() runs
    name = options.pop("worker_id", None)
    handles = [remote.remote(server, agent, token, {**options, "worker_id": f"{name}-{i}" if name else None})
               for i in range(actors)]
    pending = [h.run.remote() for h in handles]
    stopping: list[bool] = []

    def request_stop(now: bool) -> None:
        stopping.append(True)
        for handle in handles:
            handle.stop.remote(now)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        request_stop(bool(stopping))

    restore = []
    if threading.current_thread() is threading.main_thread():
        restore = [(sig, signal.signal(sig, on_signal)) for sig in (signal.SIGTERM, signal.SIGINT)]
    total = WorkerStats()
    try:
        while pending:  # ray.wait with a timeout, so a signal handler (or ``stop``) gets to run
            if stop is not None and stop.is_set() and not stopping:
                request_stop(True)
            done, pending = ray.wait(pending, num_returns=1, timeout=0.5)
            for ref in done:
                stats = ray.get(ref)
                for name, value in stats.items():
                    if name == "token_sources":
                        for source, n in value.items():
                            total.token_sources[source] = total.token_sources.get(source, 0) + n
                    else:
                        setattr(total, name, getattr(total, name) + value)
    finally:
        for sig, handler in restore:
            signal.signal(sig, handler)
    return total


# ---------------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agl worker", description="Lease tasks from an agl server and run an agent "
                                "on each, with the server's gateway as the agent's OpenAI endpoint.")
    p.add_argument("--server", required=True, help="the server's URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--agent", help="the agent function, as pkg.module:function")
    p.add_argument("--command", help="or the agent as a command line run once per task, in any language "
                   "(see agl_core.command_agent), e.g. 'node agent.js'")
    p.add_argument("--command-timeout", type=float, help="seconds one run of --command may take before it is killed")
    p.add_argument("-n", "--concurrency", type=int, default=1, help="rollouts at a time")
    p.add_argument("--token", default=os.environ.get("AGL_TOKEN"), help="the server's bearer token ($AGL_TOKEN)")
    p.add_argument("--worker-id", help="name for this worker in the server's records")
    p.add_argument("--lease-timeout", type=float, help="seconds a lease lasts without a heartbeat")
    p.add_argument("--grace", type=float, default=30.0, help="seconds in-flight rollouts get on SIGTERM")
    p.add_argument("--max-tasks", type=int, help="stop after this many tasks")
    p.add_argument("--idle-exit", type=float, help="stop once no task has come for this many seconds")
    p.add_argument("--poll", type=float, default=5.0, help="seconds one lease request waits for a task")
    p.add_argument("--ray", metavar="ADDRESS", help="run the workers as Ray actors on this cluster "
                   "(an address as ray.init takes it; 'local' starts one here): -n actors of one slot each")
    p.add_argument("--actor-cpus", type=float, default=1.0, help="CPUs Ray reserves per actor (with --ray)")
    p.add_argument("--no-gateway-env", action="store_true",
                   help="leave OPENAI_BASE_URL and OPENAI_API_KEY as they are")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if args.ray:
        if args.agent is None:
            print("agl worker: --ray runs an --agent function; --command runs on this machine", file=sys.stderr)
            return 2
        options = {"worker_id": args.worker_id, "lease_timeout": args.lease_timeout, "grace_s": args.grace,
                   "max_tasks": args.max_tasks, "idle_exit_s": args.idle_exit, "poll_s": args.poll,
                   "set_openai_env": not args.no_gateway_env}
        stats = run_on_ray(args.ray, args.server, args.agent, actors=args.concurrency, token=args.token,
                           actor_cpus=args.actor_cpus, **options)
        print(f"agl worker: done on Ray: {stats}", flush=True)
        return 0
    try:
        worker = Worker(args.server, args.agent, command=args.command, command_timeout_s=args.command_timeout,
                        token=args.token, concurrency=args.concurrency, worker_id=args.worker_id,
                        lease_timeout=args.lease_timeout, grace_s=args.grace, max_tasks=args.max_tasks,
                        idle_exit_s=args.idle_exit, poll_s=args.poll, set_openai_env=not args.no_gateway_env)
    except ValueError as exc:
        print(f"agl worker: {exc}", file=sys.stderr)
        return 2
    print(f"agl worker: {worker.worker_id} working for {worker.url} with {args.concurrency} slot(s)", flush=True)
    try:
        stats = worker.run()
    except ServerError as exc:
        print(f"agl worker: {exc}", file=sys.stderr)
        return 2
    if worker.unreachable is not None:
        print(f"agl worker: stopped: {worker.unreachable}", file=sys.stderr)
        return 1
    print(f"agl worker: done: {stats}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
