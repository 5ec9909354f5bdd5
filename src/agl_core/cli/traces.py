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
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from agl_core import semconv
from agl_core.cli.stores import open_store, store_options, where
from agl_core.errors import AglError
from agl_core.schema import Rollout, Skipped, Span, Transition

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
    # below 120 columns: the id's first 10 characters (enough for `agl traces show`), times of day, short headings
    compact = console.width < 120
    headings = ("id", "task", "try" if compact else "attempt", "status", "reward", "spans",
                "trans" if compact else "transitions", "started", "time" if compact else "duration")
    table = Table(title=f"rollouts in {escape(where(db, server))}", title_justify="left", header_style="bold",
                  box=None if compact else box.SIMPLE_HEAD, pad_edge=not compact)
    for i, name in enumerate(headings):
        table.add_column(name, justify="right" if i in (2, 4, 5, 6, 8) else "left", no_wrap=name != "task")
    for row in rows:
        style = _STATUS_STYLE.get(row["status"], "")
        table.add_row(row["id"][:10] if compact else row["id"], escape(row["task_id"]), str(row["attempt"]),
                      Text(row["status"], style=style), _number(row["reward"]), str(row["spans"]),
                      str(row["transitions"]), _clock(row["start_time"], compact), _duration_s(row["duration_s"]))
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
            stored = store.trajectories(rollout_ids=[rollout.id])
            found = stored[0].transitions if stored else store.transitions(rollout_id=rollout.id)
            skipped = stored[0].skipped if stored else []
        except AglError as exc:
            raise click.ClickException(f"cannot read {where(db, server)}: {exc}") from None
    Console(highlight=False).print(rollout_tree(rollout, found, skipped, full=full))


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


def render_rollout(rollout: Rollout, transitions: Sequence[Transition] = (), skipped: Sequence[Skipped] = (), *,
                   width: int = 120, full: bool = False) -> str:
    """The tree of :func:`rollout_tree` as plain text (no colour), ``width`` columns wide."""
    console = Console(width=width, record=True, color_system=None, highlight=False, file=io.StringIO())
    console.print(rollout_tree(rollout, transitions, skipped, full=full))
    return console.export_text()


def rollout_tree(rollout: Rollout, transitions: Sequence[Transition] = (), skipped: Sequence[Skipped] = (), *,
                 full: bool = False) -> Tree:
    """A rich ``Tree`` of one rollout: spans nested by parent, rewards inline, failures red.

    One request to a model is one node, however many plugins saw it (a LangChain ``ChatOpenAI``
    call is also an ``openai`` client call): LLM spans nested in an LLM span are merged into it,
    as they are merged into one transition.
    """
    spans = sorted(rollout.spans, key=_start)
    by_id = {s.span_id: s for s in spans}
    children: dict[str | None, list[Span]] = {}
    for span in spans:
        parent = span.parent_id if span.parent_id in by_id else None
        children.setdefault(parent, []).append(span)
    by_span = {t.span_id: t for t in transitions if t.span_id}
    left_out = {s.span_id: s.reason for s in skipped}
    calls = sum(1 for s in spans if _is_llm(s) and not (s.parent_id in by_id and _is_llm(by_id[s.parent_id])))
    tree = Tree(_rollout_label(rollout, transitions, calls), guide_style="dim")
    if rollout.error:
        tree.add(Text(f"error: {_one_line(rollout.error, full)}", style="bold red"))

    def add(node: Tree, level: list[Span]) -> None:
        for span in level:
            if span.attributes.get(semconv.AGL_SPAN_KIND) == semconv.KIND_ROLLOUT:
                add(node, children.get(span.span_id, []))  # the rollout's own span is the root already
            elif _is_llm(span):
                call = _one_request(span, children)
                found = next((by_span[s.span_id] for s in call if s.span_id in by_span), None)
                why = next((left_out[s.span_id] for s in call if s.span_id in left_out), None)
                inner = [c for member in call for c in children.get(member.span_id, []) if not _is_llm(c)]
                add(node.add(_llm_label(call, found, why, full)), sorted(inner, key=_start))
            else:
                add(node.add(_span_label(span, full)), children.get(span.span_id, []))

    add(tree, children.get(None, []))
    return tree


def _start(span: Span) -> tuple[int, int]:
    return span.start_ns, span.end_ns


def _is_llm(span: Span) -> bool:
    return span.attributes.get(semconv.GEN_AI_OPERATION_NAME) in semconv.LLM_OPERATIONS


def _one_request(span: Span, children: dict[str | None, list[Span]]) -> list[Span]:
    """The LLM span and the LLM spans nested in it: one request, seen by several plugins."""
    call = [span]
    for child in children.get(span.span_id, []):
        if _is_llm(child):
            call.extend(_one_request(child, children))
    return call


def _rollout_label(rollout: Rollout, transitions: Sequence[Transition], calls: int) -> Text:
    label = Text()
    label.append("rollout ", style="bold")
    label.append(rollout.id, style="bold cyan")
    label.append(f"  task {rollout.task_id}  attempt {rollout.attempt}  ")
    label.append(rollout.status, style=_STATUS_STYLE.get(rollout.status, ""))
    final = rollout.final_reward
    if final is not None:
        label.append("  reward ")
        label.append(_number(final), style=_reward_style(final))
    if rollout.resources_version is not None:
        label.append(f"  resources v{rollout.resources_version}", style="magenta")
    if rollout.end_time is not None:
        label.append(f"  {_duration_s(max(0.0, rollout.end_time - rollout.start_time))}", style="dim")
    tools = sum(1 for s in rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_EXECUTE_TOOL)
    label.append(f"  ({len(rollout.spans)} spans: {calls} LLM calls, {tools} tool calls; {len(transitions)} "
                 "transitions)", style="dim")
    return label


def _span_label(span: Span, full: bool) -> Text:
    attrs = span.attributes
    operation = attrs.get(semconv.GEN_AI_OPERATION_NAME)
    kind = attrs.get(semconv.AGL_SPAN_KIND)
    if operation == semconv.OP_EXECUTE_TOOL:
        return _tool_label(span, full)
    if operation == semconv.OP_INVOKE_AGENT or (attrs.get(semconv.GEN_AI_AGENT_NAME) and not kind):
        label = Text()
        label.append("agent ", style="bold blue")
        label.append(str(attrs.get(semconv.GEN_AI_AGENT_NAME) or span.name), style="bold")
        _append_duration(label, span)
    elif kind == semconv.KIND_REWARD:
        value = attrs.get(semconv.AGL_REWARD_VALUE)
        number = float(value) if isinstance(value, (int, float)) else None
        name = attrs.get(semconv.AGL_REWARD_NAME)
        label = Text()
        label.append("reward ", style="bold green")
        label.append(_number(number), style=_reward_style(number or 0.0))
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
        return label
    else:
        label = Text(span.name, style="bold")
        _append_duration(label, span)
    _mark_error(label, span, full)
    return label


def _mark_error(label: Text, span: Span, full: bool) -> None:
    if span.status == "error":
        label.stylize("red")
        why = span.status_message or span.attributes.get(semconv.ERROR_TYPE) or "error"
        label.append(f"  error: {_one_line(why, full)}", style="bold red")


def _llm_label(call: list[Span], transition: Transition | None, skipped: str | None, full: bool) -> Text:
    """One model request (its spans, outermost first): model, plugins, tokens, time, answer, transition."""
    span = call[0]

    def first(key: str) -> Any:
        return next((s.attributes[key] for s in call if s.attributes.get(key) is not None), None)

    model = first(semconv.GEN_AI_RESPONSE_MODEL) or first(semconv.GEN_AI_REQUEST_MODEL)
    label = Text()
    label.append("LLM ", style="bold magenta")
    label.append(f"{span.attributes.get(semconv.GEN_AI_OPERATION_NAME)} {model or ''}".rstrip())
    plugins = [str(s.attributes[semconv.AGL_PLUGIN]) for s in call if s.attributes.get(semconv.AGL_PLUGIN)]
    if plugins:
        label.append(f" [{'+'.join(dict.fromkeys(plugins))}]", style="dim")
    policy, note = first(semconv.AGL_POLICY), first(semconv.AGL_POLICY_NOTE)
    if policy is not None:  # a run of several policies: the one that answered
        label.append(f"  policy {policy}", style="bold cyan")
    elif note is not None:
        label.append(f"  base model: {_one_line(note, full)}", style="yellow")
    tokens_in, tokens_out = first(semconv.GEN_AI_USAGE_INPUT_TOKENS), first(semconv.GEN_AI_USAGE_OUTPUT_TOKENS)
    if tokens_in is not None or tokens_out is not None:
        label.append(f"  {_count(tokens_in)} in / {_count(tokens_out)} out tokens")
    _append_duration(label, span)
    answer = _llm_answer(first(semconv.GEN_AI_OUTPUT_MESSAGES), full)
    if answer:
        label.append("  → ", style="dim")
        label.append(answer, style="italic")
    if transition is not None:
        label.append(f"  transition #{transition.index}", style="cyan")
        if transition.token_source:
            label.append(f" ({transition.token_source} ids)", style="dim")
        if transition.reward is not None:
            label.append("  reward ")
            label.append(_number(transition.reward), style=_reward_style(transition.reward))
        if transition.credited_reward is not None:
            label.append("  credited ")
            label.append(_number(transition.credited_reward), style=_reward_style(transition.credited_reward))
    elif skipped is not None:
        label.append(f"  not trained: {_one_line(skipped, full)}", style="dim")
    failed = next((s for s in call if s.status == "error"), None)
    if failed is not None:
        _mark_error(label, failed, full)
    return label


def _llm_answer(raw: Any, full: bool) -> str:
    """What the model said (``gen_ai.output.messages``): its tool calls as ``name(args)``, else its text."""
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


def _clock(epoch_s: float, compact: bool = False) -> str:
    return time.strftime("%H:%M:%S" if compact else "%Y-%m-%d %H:%M:%S", time.localtime(epoch_s)) if epoch_s else "-"


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

