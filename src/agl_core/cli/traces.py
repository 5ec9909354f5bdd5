"""``agl traces list`` and ``agl traces show ROLLOUT``: a store's rollouts, and one rollout as a tree.

The tree nests spans by their parent: rollout, then agents, their LLM calls and
the tool calls between them. Each node says what a person debugging a run asks
first: which agent, which model, how many tokens in and out, how long, what the
model answered or which tools it called, what a tool returned, and the rewards
where they were given (intermediate ones on the call they follow, the final one
on the rollout). Anything that failed is red. LLM calls that became training
transitions carry their index and credited reward.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from agl_core import semconv
from agl_core.cli.stores import open_store, store_options, where
from agl_core.errors import AglError
from agl_core.schema import Rollout, Span, Transition

if TYPE_CHECKING:
    from agl_core.store.base import Store

__all__ = ["render_rollout", "rollout_tree", "traces"]

_STATUS_STYLE = {"succeeded": "green", "failed": "bold red", "running": "yellow", "timeout": "red",
                 "cancelled": "dim"}
_TOOL_FAILED = {semconv.TOOL_ERROR, semconv.TOOL_EXCEPTION, semconv.TOOL_TIMEOUT}
_PREVIEW = 80


@click.group("traces", context_settings={"help_option_names": ["-h", "--help"]})
def traces() -> None:
    """List the rollouts of a store, or show one as a tree (agent, LLM call, tool call)."""


@traces.command("list")
@store_options
@click.option("--task", "task_id", metavar="TASK_ID", help="only this task's rollouts")
@click.option("--status", type=click.Choice(["running", "succeeded", "failed", "timeout", "cancelled"]),
              multiple=True, help="only rollouts with this status (repeatable)")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
              help="the most recent N rollouts")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per line instead of a table")
def list_rollouts(db: str, server: str | None, token: str | None, task_id: str | None, status: tuple[str, ...],
                  limit: int, as_json: bool) -> None:
    """The most recent rollouts: id, task, attempt, status, reward, spans, transitions, start time, duration."""
    with open_store(db, server, token) as store:
        try:
            rows = _summaries(store, task_id, list(status) or None, limit)
        except AglError as exc:
            raise click.ClickException(f"cannot read {where(db, server)}: {exc}") from None
    if as_json:
        for row in rows:
            click.echo(json.dumps(row, ensure_ascii=False))
        return
    console = Console(highlight=False)
    if not rows:
        console.print(f"no rollouts in {escape(where(db, server))}" + (" matching the filters" if task_id or status
                                                                        else ""))
        return
    table = Table(title=f"rollouts in {escape(where(db, server))}", title_justify="left", header_style="bold")
    for name, justify in (("id", "left"), ("task", "left"), ("attempt", "right"), ("status", "left"),
                          ("reward", "right"), ("spans", "right"), ("transitions", "right"), ("started", "left"),
                          ("duration", "right")):
        table.add_column(name, justify=justify, no_wrap=name in ("id", "status", "started"))  # type: ignore[arg-type]
    for row in rows:
        style = _STATUS_STYLE.get(row["status"], "")
        table.add_row(row["id"], escape(row["task_id"]), str(row["attempt"]),
                      Text(row["status"], style=style), _number(row["reward"]), str(row["spans"]),
                      str(row["transitions"]), _clock(row["start_time"]), _duration_s(row["duration_s"]))
    console.print(table)


@traces.command("show")
@click.argument("rollout_id", metavar="ROLLOUT_ID")
@store_options
@click.option("--full", is_flag=True, help="whole messages and tool results instead of one-line previews")
def show(rollout_id: str, db: str, server: str | None, token: str | None, full: bool) -> None:
    """One rollout as a tree: agents, LLM calls and tool calls nested by parent span, rewards inline,
    errors in red. ROLLOUT_ID may be a unique prefix of the id."""
    with open_store(db, server, token) as store:
        try:
            rollout = _find(store, rollout_id, where(db, server))
            found = store.transitions(rollout_id=rollout.id)
        except AglError as exc:
            raise click.ClickException(f"cannot read {where(db, server)}: {exc}") from None
    Console(highlight=False).print(rollout_tree(rollout, found, full=full))


# ---------------------------------------------------------------------- reading


def _summaries(store: Store, task_id: str | None, status: list[str] | None, limit: int) -> list[dict[str, Any]]:
    runs = store.rollouts(task_id=task_id, status=status)[-limit:]
    rows = []
    for run in runs:
        end = run.end_time
        rows.append({
            "id": run.id, "task_id": run.task_id, "attempt": run.attempt, "status": run.status,
            "reward": run.final_reward, "spans": len(store.spans(run.id)),
            "transitions": len(store.transitions(rollout_id=run.id)), "start_time": run.start_time,
            "duration_s": None if end is None else max(0.0, end - run.start_time), "error": run.error,
        })
    return rows


def _find(store: Store, rollout_id: str, place: str) -> Rollout:
    rollout = store.get_rollout(rollout_id)
    if rollout is not None:
        return rollout
    matches = [r.id for r in store.rollouts() if r.id.startswith(rollout_id)] if rollout_id else []
    if len(matches) == 1:
        found = store.get_rollout(matches[0])
        if found is not None:
            return found
    if len(matches) > 1:
        raise click.BadParameter(f"{rollout_id!r} matches {len(matches)} rollouts in {place}: "
                                 f"{', '.join(matches[:5])}{', ...' if len(matches) > 5 else ''}",
                                 param_hint="'ROLLOUT_ID'")
    raise click.BadParameter(f"no rollout {rollout_id!r} in {place} (agl traces list shows them)",
                             param_hint="'ROLLOUT_ID'")


# ---------------------------------------------------------------------- the tree


def render_rollout(rollout: Rollout, transitions: Sequence[Transition] = (), *, width: int = 120,
                   full: bool = False) -> str:
    """The tree of :func:`rollout_tree` as plain text (no colour), ``width`` columns wide."""
    console = Console(width=width, record=True, color_system=None, highlight=False, file=io.StringIO())
    console.print(rollout_tree(rollout, transitions, full=full))
    return console.export_text()


def rollout_tree(rollout: Rollout, transitions: Sequence[Transition] = (), *, full: bool = False) -> Tree:
    """A rich ``Tree`` of one rollout: spans nested by parent, rewards inline, failures red."""
    spans = sorted(rollout.spans, key=lambda s: (s.start_ns, s.end_ns))
    by_id = {s.span_id: s for s in spans}
    children: dict[str | None, list[Span]] = {}
    for span in spans:
        parent = span.parent_id if span.parent_id in by_id else None
        children.setdefault(parent, []).append(span)
    by_span = {t.span_id: t for t in transitions if t.span_id}
    tree = Tree(_rollout_label(rollout, transitions), guide_style="dim")
    if rollout.error:
        tree.add(Text(f"error: {_one_line(rollout.error, full)}", style="bold red"))
    shown = _Shown()

    def add(node: Tree, parent_id: str | None) -> None:
        for span in children.get(parent_id, []):
            if span.attributes.get(semconv.AGL_SPAN_KIND) == semconv.KIND_ROLLOUT:
                add(node, span.span_id)  # the rollout's own span is the root already
                continue
            label = _span_label(span, by_span.get(span.span_id), full, shown)
            add(node.add(label), span.span_id)

    add(tree, None)
    return tree


class _Shown:
    """Transitions already labelled: one request seen by two plugins is one transition, shown once."""

    def __init__(self) -> None:
        self.indexes: set[int] = set()


def _rollout_label(rollout: Rollout, transitions: Sequence[Transition]) -> Text:
    label = Text()
    label.append("rollout ", style="bold")
    label.append(rollout.id, style="bold cyan")
    label.append(f"  task {rollout.task_id}  attempt {rollout.attempt}  ")
    label.append(rollout.status, style=_STATUS_STYLE.get(rollout.status, ""))
    final = rollout.final_reward
    if final is not None:
        label.append("  reward ")
        label.append(_number(final), style=_reward_style(final))
    if rollout.end_time is not None:
        label.append(f"  {_duration_s(max(0.0, rollout.end_time - rollout.start_time))}", style="dim")
    llm = sum(1 for s in rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) in semconv.LLM_OPERATIONS)
    tools = sum(1 for s in rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_EXECUTE_TOOL)
    label.append(f"  ({len(rollout.spans)} spans: {llm} LLM, {tools} tool; {len(transitions)} transitions)",
                 style="dim")
    return label


def _span_label(span: Span, transition: Transition | None, full: bool, shown: _Shown) -> Text:
    attrs = span.attributes
    operation = attrs.get(semconv.GEN_AI_OPERATION_NAME)
    kind = attrs.get(semconv.AGL_SPAN_KIND)
    if operation in semconv.LLM_OPERATIONS:
        label = _llm_label(span, transition, full, shown)
    elif operation == semconv.OP_EXECUTE_TOOL:
        label = _tool_label(span, full)
    elif operation == semconv.OP_INVOKE_AGENT or (attrs.get(semconv.GEN_AI_AGENT_NAME) and not kind):
        label = Text()
        label.append("agent ", style="bold blue")
        label.append(str(attrs.get(semconv.GEN_AI_AGENT_NAME) or span.name), style="bold")
        _append_duration(label, span)
    elif kind == semconv.KIND_REWARD:
        value = attrs.get(semconv.AGL_REWARD_VALUE)
        name = attrs.get(semconv.AGL_REWARD_NAME)
        label = Text()
        label.append("reward ", style="bold green")
        label.append(_number(value) if isinstance(value, (int, float)) else "?",
                     style=_reward_style(value if isinstance(value, (int, float)) else 0.0))
        label.append(f"  {name}" if name else "  (final)", style="dim")
    elif kind == semconv.KIND_MESSAGE:
        label = Text("message ", style="bold")
        label.append(_one_line(attrs.get(semconv.AGL_MESSAGE_BODY), full))
    elif kind == semconv.KIND_OBJECT:
        label = Text("object ", style="bold")
        label.append(_one_line(attrs.get(semconv.AGL_OBJECT_JSON), full))
    elif kind == semconv.KIND_EXCEPTION:
        label = Text("exception ", style="bold red")
        label.append(_one_line(span.status_message or attrs.get(semconv.ERROR_TYPE) or span.name, full), style="red")
    else:
        label = Text(span.name, style="bold")
        _append_duration(label, span)
    if span.status == "error" and operation != semconv.OP_EXECUTE_TOOL and kind != semconv.KIND_EXCEPTION:
        label.stylize("red")
        label.append(f"  error: {_one_line(span.status_message or attrs.get(semconv.ERROR_TYPE) or 'error', full)}",
                     style="bold red")
    return label


def _llm_label(span: Span, transition: Transition | None, full: bool, shown: _Shown) -> Text:
    attrs = span.attributes
    model = attrs.get(semconv.GEN_AI_RESPONSE_MODEL) or attrs.get(semconv.GEN_AI_REQUEST_MODEL)
    label = Text()
    label.append("LLM ", style="bold magenta")
    label.append(f"{attrs.get(semconv.GEN_AI_OPERATION_NAME)} {model or ''}".rstrip())
    plugin = attrs.get(semconv.AGL_PLUGIN)
    if plugin:
        label.append(f" [{plugin}]", style="dim")
    tokens_in, tokens_out = attrs.get(semconv.GEN_AI_USAGE_INPUT_TOKENS), attrs.get(semconv.GEN_AI_USAGE_OUTPUT_TOKENS)
    if tokens_in is not None or tokens_out is not None:
        label.append(f"  {_count(tokens_in)} in / {_count(tokens_out)} out tokens")
    _append_duration(label, span)
    answer = _llm_answer(attrs, full)
    if answer:
        label.append("  → ", style="dim")
        label.append(answer, style="italic")
    if transition is not None and transition.index not in shown.indexes:
        shown.indexes.add(transition.index)
        label.append(f"  transition #{transition.index}", style="cyan")
        if transition.token_source:
            label.append(f" ({transition.token_source} ids)", style="dim")
        if transition.reward is not None:
            label.append("  reward ")
            label.append(_number(transition.reward), style=_reward_style(transition.reward))
        if transition.credited_reward is not None:
            label.append("  credited ")
            label.append(_number(transition.credited_reward), style=_reward_style(transition.credited_reward))
    return label


def _llm_answer(attrs: dict[str, Any], full: bool) -> str:
    """What the model said: its tool calls as ``name(args)``, else its text."""
    raw = attrs.get(semconv.GEN_AI_OUTPUT_MESSAGES)
    if raw is None:
        return ""
    try:
        messages = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return _one_line(raw, full)
    calls: list[str] = []
    texts: list[str] = []
    for message in messages if isinstance(messages, list) else []:
        for part in message.get("parts") or [] if isinstance(message, dict) else []:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "tool_call":
                args = part.get("arguments")
                shown_args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                calls.append(f"{part.get('name')}({_one_line(shown_args, full, 60)})")
            elif part.get("type") == "text" and part.get("content"):
                texts.append(str(part["content"]))
    if calls:
        return ", ".join(calls)
    return repr(_one_line(" ".join(texts), full)) if texts else ""


def _tool_label(span: Span, full: bool) -> Text:
    attrs = span.attributes
    status = attrs.get(semconv.AGL_TOOL_STATUS)
    if not status:
        status = "exception" if span.status == "error" or attrs.get(semconv.ERROR_TYPE) else "ok"
    failed = status in _TOOL_FAILED
    label = Text()
    label.append("tool ", style="bold red" if failed else "bold yellow")
    name = str(attrs.get(semconv.GEN_AI_TOOL_NAME) or span.name)
    args = attrs.get(semconv.GEN_AI_TOOL_CALL_ARGUMENTS)
    label.append(f"{name}({_one_line(args, full, 60) if args is not None else ''})", style="red" if failed else "")
    _append_duration(label, span)
    result = attrs.get(semconv.GEN_AI_TOOL_CALL_RESULT)
    if failed:
        why = result if result is not None else (span.status_message or attrs.get(semconv.ERROR_TYPE) or status)
        label.append(f"  ✗ {status}: {_one_line(why, full)}", style="bold red")
    elif result is not None:
        label.append("  → ", style="dim")
        label.append(_one_line(result, full), style="green")
    if attrs.get(semconv.AGL_TOOL_CACHE_HIT):
        label.append("  (cache hit)", style="dim")
    return label


# ---------------------------------------------------------------------- formatting


def _append_duration(label: Text, span: Span) -> None:
    if span.end_ns and span.start_ns:
        label.append(f"  {_duration_s((span.end_ns - span.start_ns) / 1e9)}", style="dim")


def _duration_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    return f"{seconds / 60:.1f} min"


def _clock(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch_s)) if epoch_s else "-"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _count(value: Any) -> str:
    return "?" if value is None else str(value)


def _reward_style(value: float) -> str:
    return "bold green" if value > 0 else ("bold red" if value < 0 else "")


def _one_line(value: Any, full: bool, limit: int = _PREVIEW) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if full:
        return text
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"

