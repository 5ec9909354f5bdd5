"""Fail-open: an error inside agl's own hooks never reaches the user's agent.

Every hook body runs under :func:`guarded` (or catches and calls :func:`report`).
The fault report is "logged once, with a count":

- the first fault at a site (``"openai.response"``, ``"langchain.on_llm_end"``,
  ...) is logged once, as a warning with its traceback, naming the site;
- every later fault at that site only bumps its counter, so a broken hook on a
  hot path cannot flood the logs; ``fault_counts()`` returns the counters
  (``agl doctor`` and the tests read them) and ``fault_summary()`` says the same
  in one line per site;
- when the process exits, sites that failed more than once get one closing
  line with their total (``agl: 1234 faults in openai.response ...``), so the
  count reaches the log too without a line per fault.

``report`` itself never raises, whatever the exception looks like (one whose
``__str__`` raises, a ``BaseException`` subclass), so it is safe in every hook.
"""

from __future__ import annotations

import atexit
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
    """Record a fault at ``site``: logged with its traceback the first time, counted after."""
    with _lock:
        n = _counts.get(site, 0) + 1
        _counts[site] = n
    if n == 1:
        try:
            logger.warning("agl: error in %s (swallowed, the agent is unaffected; this is logged once, later "
                           "faults here are counted in agl_core.guard.fault_counts()): %s",
                           site, _describe(exc), exc_info=exc)
        except Exception:  # noqa: BLE001 - a fault report must never become a fault of its own
            pass


def _describe(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises
        return type(exc).__name__


def fault_counts() -> dict[str, int]:
    """Faults swallowed so far, by site."""
    with _lock:
        return dict(_counts)


def fault_summary() -> str:
    """One line per site that failed: ``site: count``; empty when nothing failed."""
    return "\n".join(f"{site}: {n}" for site, n in sorted(fault_counts().items()))


def reset_fault_counts() -> None:
    """Forget the counters: the next fault at any site is logged again."""
    with _lock:
        _counts.clear()


def _log_totals() -> None:
    for site, n in sorted(fault_counts().items()):
        if n > 1:
            try:
                logger.warning("agl: %d faults in %s in this process (the first was logged with its traceback)",
                               n, site)
            except Exception:  # noqa: BLE001 - logging may already be torn down at exit
                return


atexit.register(_log_totals)


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
