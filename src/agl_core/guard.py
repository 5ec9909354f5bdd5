"""Fail-open: an error inside agl's own hooks never reaches the user's agent.

Every hook body runs under :func:`guarded` (or catches and calls :func:`report`).
The first failure at each site is logged with its traceback; later ones at the
same site only bump a counter, so a broken hook on a hot path cannot flood logs.
``fault_counts()`` exposes the counters for tests and ``agl doctor``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

logger = logging.getLogger("agl")

_P = ParamSpec("_P")
_T = TypeVar("_T")

_counts: dict[str, int] = {}
_lock = threading.Lock()


def report(site: str, exc: BaseException) -> None:
    """Record a fault at ``site``: logged with traceback the first time, counted after."""
    with _lock:
        n = _counts.get(site, 0) + 1
        _counts[site] = n
    if n == 1:
        logger.warning("agl: error in %s (swallowed; the agent is unaffected; later ones are counted)", site,
                       exc_info=exc)


def fault_counts() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def reset_fault_counts() -> None:
    with _lock:
        _counts.clear()


def guarded(site: str, default: _T) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]:
    """Decorate an agl hook so that any exception becomes ``report(site)`` and ``default``."""

    def wrap(fn: Callable[_P, _T]) -> Callable[_P, _T]:
        @functools.wraps(fn)
        def inner(*args: _P.args, **kwargs: _P.kwargs) -> _T:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - fail-open is the point
                report(site, exc)
                return default

        return inner

    return wrap
