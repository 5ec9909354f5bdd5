"""The Calc-X style environment: arithmetic word problems, a safe calculator, and the answer check.

The calculator never evaluates the model's text as code: it parses it with
:mod:`ast` and walks only numbers, parentheses and the operators + - * / // %
and ** (every value bounded, so no power grows huge), so ``__import__('os')`` or a huge power is a
clear error, not an action. Problems are Calc-X-like: a few steps of
arithmetic in words, each with a numeric answer. The agent ends its reply with
``Answer: <number>``; the reward is 1.0 when that number equals the gold
answer (to a relative 1e-6), else 0.0.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from examples.runner import read_tasks

__all__ = ["TASKS", "CalculatorError", "answer_of", "calculate", "reward"]

TASKS: list[dict[str, Any]] = read_tasks(Path(__file__).with_name("tasks.jsonl"))

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e30  # word problems never need more; bounds every intermediate value, so nothing grows huge
MAX_LENGTH = 500


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or cannot be computed (division by zero, too large)."""


def _walk(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value  # type: ignore[no-any-return]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        if isinstance(node.op, ast.Pow) and abs(left) > MAX_MAGNITUDE ** (1 / max(abs(right), 1)):
            raise CalculatorError(f"the result is too large (at most {MAX_MAGNITUDE:.0e})")
        try:
            value = _BINARY[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as exc:
            raise CalculatorError("division by zero" if isinstance(exc, ZeroDivisionError)
                                  else "the result is too large") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise CalculatorError(f"the result is not a real number within {MAX_MAGNITUDE:.0e}")
        return value  # type: ignore[no-any-return]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_walk(node.operand))  # type: ignore[no-any-return]
    raise CalculatorError(f"not arithmetic: {ast.unparse(node)!r} (use numbers, + - * / // % ** and parentheses)")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression such as ``(24 * 7) - 13``; the result as text (integers without .0)."""
    text = expression.replace(",", "").strip()
    if not text or len(text) > MAX_LENGTH:
        raise CalculatorError(f"the expression must have 1 to {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"cannot parse {expression!r}: {exc.msg}") from None
    value = _walk(tree.body)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("the result is not a finite number")
        if value.is_integer():
            return str(int(value))
        return repr(round(value, 10))
    return str(value)


_ANSWER = re.compile(r"answer\s*[:=]\s*\**\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def answer_of(reply: str) -> float | None:
    """The number after ``Answer:`` in the agent's reply (else its last number), or None."""
    found = _ANSWER.findall(reply) or _NUMBER.findall(reply)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def reward(reply: str, answer: float) -> float:
    """1.0 when the reply's answer equals ``answer`` (to a relative 1e-6), else 0.0."""
    value = answer_of(reply)
    return 1.0 if value is not None and math.isclose(value, answer, rel_tol=1e-6, abs_tol=1e-9) else 0.0
