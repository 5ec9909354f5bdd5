"""Credit assignment: a rollout's rewards turned into one reward per step (LightningRL).

``rewards[t]`` is the immediate reward of step ``t`` (the sum of intermediate
rewards attached to that LLM call, or None), ``final`` the episode's final
reward. Methods:

- ``"final"``: every step gets the episode return, the sum of all intermediate
  rewards plus the final reward (the paper's choice). Intermediate rewards count.
- ``"discounted"``: return-to-go, ``G_t = r_t + gamma * G_{t+1}`` with the final
  reward added to the last step.
- a callable ``(rewards, final) -> list[float | None]`` of the same length.

A rollout with no reward at all gets None for every step, not a made-up zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

from agl_core.errors import SchemaError

CreditFn = Callable[[Sequence[float | None], float | None], Sequence[float | None]]
Credit = Literal["final", "discounted"] | CreditFn


def assign(
    rewards: Sequence[float | None],
    final: float | None,
    method: Credit = "final",
    gamma: float = 1.0,
) -> list[float | None]:
    """Return the credited reward of each step; see the module docstring for the methods."""
    n = len(rewards)
    if n == 0:
        return []
    if callable(method):
        out = list(method(list(rewards), final))
        if len(out) != n:
            raise SchemaError("credit", f"the credit function returned {len(out)} values for {n} steps")
        for i, v in enumerate(out):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise SchemaError(f"credit[{i}]", f"must be a finite number or None, got {v!r}")
        return [None if v is None else float(v) for v in out]
    if final is None and all(r is None for r in rewards):
        return [None] * n
    if method == "final":
        total = sum(r for r in rewards if r is not None) + (final or 0.0)
        _check_finite(total, rewards, final)
        return [total] * n
    if method == "discounted":
        if not 0.0 <= gamma <= 1.0:
            raise SchemaError("gamma", f"must be between 0 and 1, got {gamma!r}")
        out_d: list[float | None] = [0.0] * n
        running = 0.0
        for t in range(n - 1, -1, -1):
            r = (rewards[t] or 0.0) + ((final or 0.0) if t == n - 1 else 0.0)
            running = r + gamma * running
            _check_finite(running, rewards, final)
            out_d[t] = running
        return out_d
    raise SchemaError("credit", f"must be 'final', 'discounted' or a function, got {method!r}")


def _check_finite(value: float, rewards: Sequence[float | None], final: float | None) -> None:
    if not math.isfinite(value):
        raise SchemaError("credit", f"the rewards add up to {value!r} (final {final!r}, steps {list(rewards)!r}): "
                                    "keep rewards within a float's range")
