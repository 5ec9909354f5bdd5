"""Security: no code is built from received data, SQL takes its values only as parameters, and content capture
can be switched off.

1. An AST scan of ``src/`` and ``trainer/``: no ``pickle``/``marshal``/``shelve``/
   ``dill`` deserialisation, no ``eval``/``exec``/``compile`` of anything, no
   ``yaml.load`` without the safe loader, no ``torch.load`` without
   ``weights_only=True`` and no ``numpy.load(allow_pickle=True)``.
2. An AST scan of every ``execute``/``executemany``/``executescript`` call: the SQL
   text must be made only of constants. An f-string, ``%``, ``+``, ``.format`` or
   ``.join`` is accepted only when every piece it puts in is itself constant: a
   literal, a module-level constant, ``int(...)``/``len(...)`` of anything, ``"?"``
   placeholders, a local (or the first value a module function returns) that is
   only ever assigned such pieces, or a call whose arguments are all such pieces.
   Values must travel as parameters.
3. Content capture off (``agl.instrument(capture_content=False)`` or
   ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=false``) keeps prompts,
   outputs, tool arguments and results off the ``openai`` plugin's spans, and
   agl's own tool spans, while token ids, usage, names and timing stay.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agl_core as agl
from agl_core import collector, encoding, semconv
from agl_core.openai_client import OpenAIInstrumentor
from agl_core.testing import FakeOpenAI

REPO = Path(__file__).resolve().parents[2]
SCANNED = [p for root in ("src", "trainer") for p in sorted((REPO / root).rglob("*.py"))]


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _where(path: Path, node: ast.AST) -> str:
    name = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    return f"{name}:{getattr(node, 'lineno', '?')}: {ast.unparse(node)[:120]}"


# --------------------------------------------------------------------------- 1. no code from data

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}


def unsafe_calls(path: Path, tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [_where(path, node) for n in names if n.split(".")[0] in UNSAFE_MODULES]
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
        if func in UNSAFE_BUILTINS or func.split(".")[0] in UNSAFE_MODULES:
            found.append(_where(path, node))
        elif func.endswith("yaml.load") and "Loader" not in keywords:
            found.append(_where(path, node))
        elif func.endswith("yaml.load") and "Safe" not in keywords["Loader"]:
            found.append(_where(path, node))
        elif func.endswith("torch.load") and keywords.get("weights_only") != "True":
            found.append(_where(path, node))
        elif func.endswith(("np.load", "numpy.load")) and keywords.get("allow_pickle") == "True":
            found.append(_where(path, node))
    return found


def test_nothing_received_is_unpickled_or_evaluated() -> None:
    assert len(SCANNED) > 40
    findings = [f for path in SCANNED for f in unsafe_calls(path, _tree(path))]
    assert findings == []


def test_the_unsafe_call_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nfrom marshal import loads\nx = eval(s)\nexec(code)\n"
                   "yaml.load(text)\ntorch.load(f)\nnp.load(f, allow_pickle=True)\n"
                   "yaml.load(t, Loader=yaml.SafeLoader)\ntorch.load(f, weights_only=True)\n")
    found = unsafe_calls(bad, _tree(bad))
    assert [line.split(":")[1] for line in found] == ["1", "2", "3", "4", "5", "6", "7"], found


# --------------------------------------------------------------------------- 2. SQL only with parameters

SQL_METHODS = {"execute", "executemany", "executescript"}
SAFE_CALLS = {"int", "len", "float", "min", "max", "str.join"}


class SqlScope:
    """What each name of one function (or the module) is ever assigned, to judge the SQL built from it."""

    def __init__(self, body: ast.AST, module: ast.Module, functions: dict[str, ast.AST],
                 parent: SqlScope | None = None) -> None:
        self.module = module
        self.functions = functions
        self.parent = parent
        self.values: dict[str, list[ast.AST]] = {}
        for node in ast.walk(body):
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    self._bind(target, node.value)
            elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                items = node.iter.elts if isinstance(node.iter, ast.Tuple | ast.List) else [
                    ast.Subscript(value=node.iter, slice=ast.Constant(None), ctx=ast.Load())]
                for item in items:
                    self._bind(node.target, item)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("append", "extend", "insert") and isinstance(node.func.value, ast.Name)):
                for arg in node.args[-1:]:
                    self.values.setdefault(node.func.value.id, []).append(arg)
        if isinstance(body, ast.FunctionDef | ast.AsyncFunctionDef):
            self.params = [a.arg for a in [*body.args.posonlyargs, *body.args.args]]
            self.name = body.name
        else:
            self.params, self.name = [], ""

    def _bind(self, target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Name):
            self.values.setdefault(target.id, []).append(value)
        elif isinstance(target, ast.Tuple):
            if isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts):
                for t, v in zip(target.elts, value.elts, strict=True):
                    self._bind(t, v)
            else:
                for i, t in enumerate(target.elts):
                    self._bind(t, ast.Subscript(value=value, slice=ast.Constant(i), ctx=ast.Load()))

    def constant(self, node: ast.AST, seen: frozenset[str] = frozenset()) -> bool:
        """True when ``node`` can only ever be text made of constants."""
        if isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.JoinedStr):
            return all(self.constant(v.value if isinstance(v, ast.FormattedValue) else v, seen) for v in node.values)
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Mult):  # "?" * n: placeholders
                return self.constant(node.left, seen) or self.constant(node.right, seen)
            return self.constant(node.left, seen) and self.constant(node.right, seen)
        if isinstance(node, ast.IfExp):
            return self.constant(node.body, seen) and self.constant(node.orelse, seen)
        if isinstance(node, ast.Tuple | ast.List):
            return all(self.constant(e, seen) for e in node.elts)
        if isinstance(node, ast.Attribute):
            return node.attr.isupper() or node.attr.lstrip("_").isupper()  # semconv.X, cls.CONSTANT
        if isinstance(node, ast.Name):
            return self._name(node.id, seen)
        if isinstance(node, ast.Subscript):
            if isinstance(node.value, ast.Call) and isinstance(node.slice, ast.Constant):
                return self._returned(node.value, node.slice.value, seen)
            if (isinstance(node.value, ast.Tuple | ast.List) and isinstance(node.slice, ast.Constant)
                    and isinstance(node.slice.value, int) and node.slice.value < len(node.value.elts)):
                return self.constant(node.value.elts[node.slice.value], seen)
            return self.constant(node.value, seen)
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in SAFE_CALLS:
                return True  # numbers: nothing a value can smuggle in
            if isinstance(node.func, ast.Attribute) and not self.constant(node.func.value, seen):
                return False
            return all(self.constant(a, seen) for a in [*node.args, *(k.value for k in node.keywords)])
        return False

    def _name(self, name: str, seen: frozenset[str]) -> bool:
        if name in seen:
            return True  # a loop: judged by the other assignments
        if name.lstrip("_").isupper():
            return True  # a module constant
        scope: SqlScope | None = self
        while scope is not None:
            if name in scope.values:
                return all(scope.constant(v, seen | {name}) for v in scope.values[name])
            if name in scope.params:
                return scope._argument_everywhere(name, seen | {name})
            scope = scope.parent
        return False

    def _argument_everywhere(self, param: str, seen: frozenset[str]) -> bool:
        """A parameter: constant when every call of its function in this module passes constant text for it."""
        index = self.params.index(param)
        method = bool(self.params) and self.params[0] in ("self", "cls")
        calls = [n for n in ast.walk(self.module) if isinstance(n, ast.Call)
                 and ((isinstance(n.func, ast.Attribute) and n.func.attr == self.name)
                      or (isinstance(n.func, ast.Name) and n.func.id == self.name))]
        if not calls:
            return False
        for call in calls:
            position = index - 1 if method and isinstance(call.func, ast.Attribute) else index
            given = [k.value for k in call.keywords if k.arg == param] or (
                call.args[position:position + 1] if 0 <= position < len(call.args) else [])
            caller = _enclosing_scope(self.module, call, self.functions)
            if len(given) != 1 or not caller.constant(given[0], seen):
                return False
        return True

    def _returned(self, call: ast.Call, index: Any, seen: frozenset[str]) -> bool:
        """``f(...)[i]`` where ``f`` is a function of this module: its i-th returned value is constant text."""
        fn = self.functions.get(ast.unparse(call.func))
        if fn is None:
            return False
        inner = SqlScope(fn, self.module, self.functions, parent=None)
        returns = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
        picked = [r.elts[index] for r in returns if isinstance(r, ast.Tuple) and len(r.elts) > index]
        return bool(picked) and len(picked) == len(returns) and all(inner.constant(p, seen) for p in picked)


def _enclosing_scope(module: ast.Module, node: ast.AST, functions: dict[str, ast.AST]) -> SqlScope:
    """The scope of the innermost function around ``node`` (the module's when none)."""
    best: ast.AST = module
    for fn in ast.walk(module):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and any(n is node for n in ast.walk(fn)):
            best = fn  # ast.walk is breadth-first: a later match is nested deeper
    return SqlScope(best, module, functions)


def dynamic_sql(path: Path, tree: ast.Module) -> list[str]:
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    module_scope = SqlScope(ast.Module(body=[n for n in tree.body if isinstance(n, ast.Assign | ast.AnnAssign)],
                                       type_ignores=[]), tree, functions)
    found = []

    def visit(node: ast.AST, scope: SqlScope) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, SqlScope(child, tree, functions, parent=scope))
                continue
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr in SQL_METHODS and child.args and not scope.constant(child.args[0])):
                found.append(_where(path, child))
            visit(child, scope)

    visit(tree, module_scope)
    return found


def test_sql_is_built_only_from_constants() -> None:
    findings = [f for path in SCANNED for f in dynamic_sql(path, _tree(path))]
    assert findings == []


def test_the_sql_scan_flags_values_put_into_sql() -> None:
    bad = Path("bad_sql_example.py")  # parsed from the string below, never written
    source = '''
LIMIT_SQL = " LIMIT ?"

def ok(conn, task_id, n, statuses):
    clauses = []
    clauses.append("task_id = ?")
    where = " WHERE " + " AND ".join(clauses)
    conn.execute(f"SELECT * FROM t{where}{LIMIT_SQL} LIMIT {int(n)}", (task_id,))
    conn.execute(f"SELECT * FROM t WHERE s IN ({', '.join('?' * len(statuses))})", statuses)

def bad_fstring(conn, task_id):
    conn.execute(f"SELECT * FROM t WHERE id = '{task_id}'")

def bad_percent(conn, name):
    conn.execute("SELECT * FROM t WHERE name = '%s'" % name)

def bad_plus(conn, name):
    sql = "SELECT * FROM t WHERE name = '" + name + "'"
    conn.execute(sql)

def bad_format(conn, name):
    conn.executemany("DELETE FROM t WHERE name = '{}'".format(name), [])

def bad_join(conn, names):
    clauses = []
    for n in names:
        clauses.append(f"name = '{n}'")
    conn.execute("SELECT * FROM t WHERE " + " OR ".join(clauses))
'''
    found = dynamic_sql(bad, ast.parse(source))
    assert [f.split(":")[1] for f in found] == ["12", "15", "19", "22", "28"], found


# --------------------------------------------------------------------------- 3. content capture off

SECRET = "SECRET-7f3a"
SCRIPT = [{"tool_calls": [{"name": "lookup", "arguments": {"city": f"Paris {SECRET}"}}]}, f"Sunny. {SECRET}"]


@pytest.fixture
def user_exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    agl.uninstrument()
    plugin = OpenAIInstrumentor()
    if plugin.is_instrumented_by_opentelemetry:
        plugin.uninstrument()
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    collector.use_provider(provider)
    yield exporter
    agl.uninstrument()
    collector.use_provider(None)
    monkeypatch.delenv(encoding.CAPTURE_CONTENT_ENV, raising=False)
    encoding.reset_capture_content()


def _agent(srv: FakeOpenAI) -> tuple[str | None, agl.RolloutRun]:
    client = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)
    messages: list[Any] = [{"role": "system", "content": f"Be brief. {SECRET}"},
                           {"role": "user", "content": f"Weather in Paris? {SECRET}"}]
    extra = {"return_token_ids": True}
    with agl.rollout("private") as run:
        first = client.chat.completions.create(model="m", messages=messages, extra_body=extra)
        call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
        with agl.tool_call("lookup", arguments=json.loads(call.function.arguments),  # type: ignore[union-attr]
                           call_id=call.id) as tool:
            tool.result = f"sunny in {SECRET}"
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": tool.result}]
        stream = client.chat.completions.create(model="m", messages=messages, extra_body=extra, stream=True,
                                                stream_options={"include_usage": True})
        answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        agl.emit_reward(1.0)
    return answer, run


def _text(attrs: Any) -> str:
    return json.dumps(dict(attrs or {}), default=str)


@pytest.mark.parametrize("how", ["argument", "env"])
def test_capture_off_redacts_the_openai_plugins_spans_and_keeps_token_ids(
        user_exporter: InMemorySpanExporter, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "argument":
        assert agl.instrument(["openai"], capture_content=False) == ["openai"]
    else:
        monkeypatch.setenv(encoding.CAPTURE_CONTENT_ENV, "False")
        assert agl.instrument(["openai"]) == ["openai"]
    assert encoding.capture_content is False
    with FakeOpenAI(script=SCRIPT) as srv:
        answer, run = _agent(srv)
    assert answer == f"Sunny. {SECRET}"
    exported = user_exporter.get_finished_spans()
    assert len(exported) == len(run.rollout.spans) >= 4
    for attrs in [s.attributes for s in run.rollout.spans] + [s.attributes for s in exported]:
        assert SECRET not in _text(attrs)
        assert not set(dict(attrs or {})) & encoding.CONTENT_ATTRIBUTES
    chats = [s for s in run.rollout.spans if s.name == "chat m"]
    assert len(chats) == 2 and all(s.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] > 0 for s in chats)
    assert [s.attributes.get(semconv.GEN_AI_TOOL_NAME) for s in run.rollout.spans
            if s.name.startswith("execute_tool")] == ["lookup"]
    traj = run.trajectory()
    assert [bool(t.prompt_token_ids and t.response_token_ids) for t in traj.transitions] == [True, True]
    assert traj.transitions[0].response["role"] == "assistant" and traj.reward == 1.0
    assert SECRET not in json.dumps(traj.to_dict())


def test_capture_is_on_by_default_and_explicit_wins_over_the_environment(
        user_exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch) -> None:
    assert agl.instrument(["openai"]) == ["openai"] and encoding.capture_content is True
    with FakeOpenAI(script=SCRIPT) as srv:
        _, run = _agent(srv)
    assert any(SECRET in _text(s.attributes) for s in run.rollout.spans)  # the control: content is there
    monkeypatch.setenv(encoding.CAPTURE_CONTENT_ENV, "true")
    agl.instrument(["openai"], capture_content=False)
    assert encoding.capture_content is False
    agl.instrument(["openai"])  # a later plain instrument() (another library's) keeps it off
    assert encoding.capture_content is False
    for value, expected in [("false", False), ("0", False), ("NO_CONTENT", False), ("true", True),
                            ("SPAN_ONLY", True)]:
        monkeypatch.setenv(encoding.CAPTURE_CONTENT_ENV, value)
        assert encoding.reset_capture_content() is expected, value
    with pytest.raises(TypeError, match="capture_content must be True, False or None"):
        agl.instrument(["openai"], capture_content="no")  # type: ignore[arg-type]
