"""Where a GPU value read in fake mode goes: the script's own source, at the line that reads it.

Why: ``int(tensor)`` must return a plain ``int`` (CPython copies an ``int`` subclass returned by
``__int__``), so once a script holds it, fake mode can no longer see where it goes. Real scripts read such
values for bookkeeping — ``classes[int(pred[0])]`` in a log line, ``for i in range(int(n)): print(...)``,
``correct += int((pred == y).sum())`` printed later — and those values decide nothing about GPU memory. So
before answering, the capture reads the script's source at the reading expression (the position of the
frame's current instruction, exact to the column) and follows it: through arithmetic, into a local name and
that name's uses in the same function, through an index to the element it picks (``sizes[i]`` may be a
shape). When every use ends in a Python index (``seq[i]``), the ``range()`` of a ``for`` loop, or output
(``print``, formatting, f-strings, logging calls), the read gets a small concrete value: 0 when it indexes
(valid for any non-empty sequence), else 1 (a loop body runs once, so its memory behaviour is seen). Any
other use — a comparison, a condition, a tensor operation or shape, a function of the script's, an
attribute or container that outlives the function — may decide memory, and the read is refused, naming the
line. Conditions get the same reading (``condition_of_read``): the test of an ``if`` whose branches only
do host work is answered false.
"""

from __future__ import annotations

import ast
import linecache
import os
import sys
import types
from dataclasses import dataclass
from types import CodeType, FrameType

_OUTPUT_CALLS = frozenset({"print", "str", "repr", "format", "len"})
_OUTPUT_METHODS = frozenset({"info", "debug", "warning", "error", "log", "write", "format", "add_scalar",
                             "add_scalars", "set_postfix", "set_description", "append"})
_HERE = os.path.dirname(os.path.abspath(__file__))
_CONVERSIONS = frozenset({"item", "tolist", "cpu", "detach", "numpy", "float", "int"})
_MAX_DEPTH = 4  # names followed through assignments
# Bare calls that log when they are the script's own or a library's Python function (PyG's
# ``torch_geometric.logging.log``), not ``math.log``/``numpy.log``/``torch.log``, which are not Python functions.
_LOG_CALLS = frozenset({"log", "info", "debug", "warning", "log_metrics"})
_GLOBALS: dict = {}  # the reading frame's globals while its read is followed (use_of_read)


@dataclass(frozen=True)
class Use:
    """Where the value went: ``bounded`` (all uses host-only) with the uses seen, and the script's line."""

    bounded: bool
    uses: frozenset[str]
    where: str  # "train.py:42"
    outcome: bool = False  # a bounded condition: the branch to take (condition_of_read)

    @property
    def value(self) -> int:
        # 1 unless it indexes: a loop body runs once, and a metric that is only output is the one a real run
        # logs first, which beats the script's initial best (``if val_acc > best: test_acc = ...``, read
        # after the ``if``) and divides safely
        return 0 if "index" in self.uses else 1


def user_frame() -> FrameType | None:
    """The innermost frame of the script's own code (outside torch and this package)."""
    torch = sys.modules.get("torch")
    own = (_HERE,) + ((os.path.dirname(os.path.abspath(torch.__file__)),) if torch is not None and torch.__file__ else ())
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(own) and not frame.f_code.co_filename.startswith("<"):
            return frame
        frame = frame.f_back
    return None


def where(frame: FrameType | None = None) -> str:
    frame = frame or user_frame()
    if frame is None:
        return "an unknown line"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def use_of_read(frame: FrameType | None = None) -> Use:
    """How the value read by ``frame``'s current instruction is used (module docstring)."""
    frame = frame or user_frame()
    if frame is None:
        return Use(False, frozenset(), where(frame))
    global _GLOBALS
    _GLOBALS = frame.f_globals
    try:
        return _use_of_read(frame)
    finally:
        _GLOBALS = {}


def _use_of_read(frame: FrameType) -> Use:
    tree, node = _source_at(frame)
    if tree is None or node is None:
        return Use(False, frozenset(), where(frame))
    # The instruction that asked for the value: ``seq[t]`` (the tensor itself was the index), ``range(t)``,
    # or ``int(t)`` / ``round(t)``, whose result is followed. Anything else (``np.zeros(t)``) consumes it.
    uses: set[str] = set()
    ok = False
    if isinstance(node, ast.Subscript):
        uses.add("index")
        ok = _follow(tree, node, uses, 0)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
        uses.add("loop bound")
        ok = _loop_iter(tree, node, uses, 0)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("int", "round"):
        ok = _follow(tree, node, uses, 0)
    return Use(ok, frozenset(uses), where(frame))


# -- source -------------------------------------------------------------------------------------------
_TREES: dict[str, tuple[ast.Module | None, dict[int, ast.AST]]] = {}


def _source_at(frame: FrameType) -> tuple[ast.Module | None, ast.AST | None]:
    """The parsed source of ``frame``'s file and the node of its current instruction (None where unknown)."""
    tree = _tree(frame.f_code.co_filename)
    position = _position(frame.f_code, frame.f_lasti)
    return tree, None if tree is None or position is None else _node_at(tree, position)


def _tree(filename: str) -> ast.Module | None:
    hit = _TREES.get(filename)
    if hit is None:
        source = "".join(linecache.getlines(filename))
        try:
            tree: ast.Module | None = ast.parse(source) if source else None
        except SyntaxError:
            tree = None
        parents: dict[int, ast.AST] = {}
        if tree is not None:
            for parent in ast.walk(tree):
                for child in ast.iter_child_nodes(parent):
                    parents[id(child)] = parent
        hit = _TREES[filename] = (tree, parents)
    return hit[0]


def _parent(tree: ast.Module, node: ast.AST) -> ast.AST | None:
    for module, parents in _TREES.values():
        if module is tree:
            return parents.get(id(node))
    return None


def _position(code: CodeType, lasti: int) -> tuple[int, int, int, int] | None:
    for i, pos in enumerate(code.co_positions()):
        if i * 2 == lasti:
            return None if None in pos else pos  # type: ignore[return-value]
    return None


def _node_at(tree: ast.Module, pos: tuple[int, int, int, int]) -> ast.AST | None:
    """The expression at exactly ``pos``; else the statement there (CPython 3.11 places the jump of
    ``if x:`` / ``if a or b:``, where ``__bool__`` is asked, on the whole ``if``)."""
    line, end_line, col, end_col = pos
    statement = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.expr, ast.stmt)) and (node.lineno, node.end_lineno, node.col_offset,
                                                       node.end_col_offset) == (line, end_line, col, end_col):
            if isinstance(node, ast.expr):
                return node
            statement = statement or node
    return statement


# -- following the value ------------------------------------------------------------------------------
def _follow(tree: ast.Module, node: ast.AST, uses: set[str], depth: int) -> bool:
    """True when every use of ``node``'s value ends in an index, a loop bound or output."""
    parent = _parent(tree, node)
    while parent is not None:
        if isinstance(parent, (ast.BinOp, ast.UnaryOp, ast.FormattedValue, ast.Tuple, ast.List)) or (
                isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id in ("int", "round", "abs")
                and node in parent.args):
            node, parent = parent, _parent(tree, parent)
            continue
        if isinstance(parent, ast.JoinedStr):
            uses.add("output")
            return True
        if isinstance(parent, ast.Subscript) and node is parent.slice:
            uses.add("index")  # the element it picks is followed in turn: ``sizes[i]`` may be a shape
            node, parent = parent, _parent(tree, parent)
            continue
        call = _parent(tree, parent) if isinstance(parent, ast.Attribute) and parent.attr in _CONVERSIONS else None
        if isinstance(call, ast.Call) and call.func is parent:
            node, parent = call, _parent(tree, call)  # ``picked.item()``: the same value, converted
            continue
        if isinstance(parent, ast.keyword):
            node, parent = parent, _parent(tree, parent)
            continue
        if isinstance(parent, ast.Call) and node is not parent.func:
            func = parent.func
            if isinstance(func, ast.Name) and func.id == "range":
                uses.add("loop bound")
                return _loop_iter(tree, parent, uses, depth)
            if (isinstance(func, ast.Name) and (func.id in _OUTPUT_CALLS or _logs(func.id))) or (
                    isinstance(func, ast.Attribute) and func.attr in _OUTPUT_METHODS):
                uses.add("output")
                return True
            return False
        if isinstance(parent, ast.Return) and node is parent.value:
            return _follow_return(tree, parent, uses, depth)
        if isinstance(parent, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node is parent.value:
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            if depth >= _MAX_DEPTH or len(targets) != 1 or not isinstance(targets[0], ast.Name):
                return False
            return _follow_name(tree, parent, targets[0].id, uses, depth + 1)
        return False
    return False


def _logs(name: str) -> bool:
    """A bare call of ``name`` is a logging call (``_LOG_CALLS``) of a Python function."""
    return name in _LOG_CALLS and isinstance(_GLOBALS.get(name), types.FunctionType)


def _follow_return(tree: ast.Module, statement: ast.Return, uses: set[str], depth: int) -> bool:
    """A value returned by a module-level function of the script: followed at every call of it in the same
    file (``def test(loader): ... return correct / n``, then ``acc = test(loader)`` and a log line), which
    must be the only way the function's name is used."""
    function = _scope(tree, statement)
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or _parent(tree, function) is not tree \
            or depth >= _MAX_DEPTH:
        return False
    names = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == function.name]
    calls = [_parent(tree, n) for n in names]
    if not names or not all(isinstance(c, ast.Call) and c.func is n for c, n in zip(calls, names)):
        return False  # never called, or passed on as a value: its results go where this file cannot see
    return all(_follow(tree, c, uses, depth + 1) for c in calls if c is not None)


def _loop_iter(tree: ast.Module, call: ast.Call, uses: set[str], depth: int) -> bool:
    """``range(n)`` is the iterable of a ``for`` loop or a comprehension (a range kept is not bounded), and
    the loop variable is followed like the value: ``torch.zeros(k)`` in the body would decide memory."""
    loop = _parent(tree, call)
    if not isinstance(loop, (ast.For, ast.comprehension)) or loop.iter is not call:
        return False
    if not isinstance(loop.target, ast.Name) or depth >= _MAX_DEPTH:
        return False
    body = loop if isinstance(loop, ast.For) else _parent(tree, loop)
    if body is None:
        return False
    loads = [n for n in ast.walk(body) if isinstance(n, ast.Name) and n.id == loop.target.id
             and isinstance(n.ctx, ast.Load)]
    inner: set[str] = set()  # the loop variable's uses: 0 .. n-1 index whatever n indexes, so not "index"
    return all(_follow(tree, n, inner, depth + 1) for n in loads)


def _follow_name(tree: ast.Module, statement: ast.stmt, name: str, uses: set[str], depth: int) -> bool:
    scope = _scope(tree, statement)
    loads = [n for n in ast.walk(scope) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
             and not _inside(tree, n, statement)]
    return all(_follow(tree, n, uses, depth) for n in loads)


def _scope(tree: ast.Module, node: ast.AST) -> ast.AST:
    parent = _parent(tree, node)
    while parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        parent = _parent(tree, parent)
    return parent if parent is not None else tree


def _inside(tree: ast.Module, node: ast.AST, ancestor: ast.AST) -> bool:
    parent = _parent(tree, node)
    while parent is not None:
        if parent is ancestor:
            return True
        parent = _parent(tree, parent)
    return False


# -- conditions ---------------------------------------------------------------------------------------
# Calls a branch may make and still be host work only: output, checkpoints, bookkeeping.
_HOST_CALLS = frozenset({"print", "save", "state_dict", "join", "open", "dump", "dumps", "write", "info", "debug",
                         "warning", "log", "str", "format", "float", "int", "round", "dict", "list", "len",
                         "append", "makedirs", "mkdir", "add_scalar", "add_scalars", "items", "keys", "values",
                         "copy", "deepcopy", "flush", "close", "exists", "time", "perf_counter", "abs", "min",
                         "max", "item"})


def condition_of_read(frame: FrameType | None = None) -> Use:
    """A condition on a value fake mode does not have: ``bounded`` when it is the test of an ``if`` whose
    branches (both) only do host work — assignments, output, checkpoint saving (``_HOST_CALLS``) — so
    either outcome allocates the same GPU memory (``best_val_loss`` bookkeeping, saving the best model).
    Then the caller takes the branch not taken (false) — unless the value is the whole test and the ``if``
    branch binds a name that neither the ``else`` branch nor anything before the ``if`` in its function
    binds: code after the ``if`` may read that name (``if val_acc > best: best = val_acc; test_acc = tmp``,
    then ``print(test_acc)``, as PyG's examples do), so the ``if`` branch is taken (``outcome`` true).
    Loops, ``break``, ``return``, and any other call in a branch (a model, a function of the script's) may
    decide memory: not bounded."""
    frame = frame or user_frame()
    if frame is None:
        return Use(False, frozenset(), where(frame))
    tree, node = _source_at(frame)
    if tree is None:
        return Use(False, frozenset(), where(frame))
    if isinstance(node, ast.If):
        return _branch_use(tree, node, frame)
    read = node
    while node is not None and not isinstance(node, ast.stmt):
        child, node = node, _parent(tree, node)  # type: ignore[arg-type]
        if isinstance(node, ast.If) and child is node.test:
            return _branch_use(tree, node, frame, whole_test=child is read)
    return Use(False, frozenset(), where(frame))


def _branch_use(tree: ast.Module, node: ast.If, frame: FrameType, whole_test: bool = True) -> Use:
    """Bounded when both branches are host work; ``outcome`` true when the ``if`` branch alone binds a
    name that nothing in the enclosing function (or module) bound before the ``if``."""
    ok = _host_only(node.body) and _host_only(node.orelse)
    new = _bound_names(node.body) - _bound_names(node.orelse) if ok and whole_test else set()
    if new:
        scope = _scope(tree, node)
        before = {n.id for n in ast.walk(scope) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
                  and n.lineno < node.lineno}
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            before |= {a.arg for a in ast.walk(scope.args) if isinstance(a, ast.arg)}
        new -= before
    return Use(ok, frozenset({"condition"}), where(frame), outcome=bool(new))


def _bound_names(statements: list[ast.stmt]) -> set[str]:
    """Plain names the statements assign, nested branches included."""
    return {n.id for s in statements for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _host_expr(node: ast.AST | None) -> bool:
    """An expression that computes nothing on tensors: names, constants, attributes, lookups by a name or
    a constant, containers and f-strings of those, and calls of ``_HOST_CALLS`` on them. Arithmetic,
    comparisons and any other call may be a GPU operation (``x * 2`` allocates) and are refused."""
    if node is None or isinstance(node, (ast.Constant, ast.Name)):
        return True
    if isinstance(node, ast.Attribute):
        return _host_expr(node.value)
    if isinstance(node, ast.Subscript):
        return _host_expr(node.value) and isinstance(node.slice, (ast.Constant, ast.Name))
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_host_expr(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(_host_expr(k) and _host_expr(v) for k, v in zip(node.keys, node.values))
    if isinstance(node, ast.JoinedStr):
        return all(_host_expr(v) for v in node.values)
    if isinstance(node, ast.FormattedValue):
        return _host_expr(node.value)
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return name in _HOST_CALLS and (not isinstance(func, ast.Attribute) or _host_expr(func.value)) \
            and all(_host_expr(a) for a in node.args) and all(_host_expr(k.value) for k in node.keywords)
    return False


def _host_test(node: ast.AST) -> bool:
    """A nested ``if``'s test: comparisons and ``and``/``or``/``not`` of host expressions (``iter_num > 0``);
    a comparison of GPU values there is a condition of its own, read and judged when it is asked."""
    if isinstance(node, ast.Compare):
        return _host_expr(node.left) and all(_host_expr(c) for c in node.comparators)
    if isinstance(node, ast.BoolOp):
        return all(_host_test(v) for v in node.values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _host_test(node.operand)
    return _host_expr(node)


def _host_target(node: ast.AST) -> bool:
    return isinstance(node, (ast.Name, ast.Attribute)) or (
        isinstance(node, ast.Subscript) and isinstance(node.slice, (ast.Constant, ast.Name)))


def _host_only(statements: list[ast.stmt]) -> bool:
    for s in statements:
        if isinstance(s, ast.Pass):
            continue
        if isinstance(s, ast.Expr):
            if not _host_expr(s.value):
                return False
        elif isinstance(s, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            if not (all(_host_target(t) for t in targets) and _host_expr(s.value)):
                return False
        elif isinstance(s, ast.If):
            if not (_host_test(s.test) and _host_only(s.body) and _host_only(s.orelse)):
                return False
        elif isinstance(s, ast.With):
            if not (all(_host_expr(item.context_expr) for item in s.items) and _host_only(s.body)):
                return False
        else:
            return False  # loops, break/continue/return/raise, definitions: may change what runs next
    return True
