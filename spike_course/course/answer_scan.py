"""What an answer's code does that no answer needs: reach the notebook's names (the checks'
among them) by a string, patch a module, rebind what a course cell imported, import the
course's checks, or build the path of ``solutions/``.

``spike-course grade`` reads every answer region with :func:`misuses` before it runs the
notebook: code that could rebind the check it is graded by (``globals()["checks"]``,
``math.isclose = ...``, ``importlib.import_module("spike_course.che" + "cks")``) or borrow
the course's own answer (``getattr(costmodel, "memory_" + "plan")``) is reported by name
and the check counts as failed, whatever the check cell then printed. The scan reads the
syntax tree, not the text, so a name split into pieces is still seen where it is used.
The checks guard the notebook as a learner runs it themselves (``checks._guard``).
"""

from __future__ import annotations

import ast
import re
from typing import NamedTuple

# Calls that turn a string into one of the notebook's objects, or run a string as code.
_REACHING_CALLS = {"globals", "vars", "locals", "eval", "exec", "compile", "__import__", "breakpoint"}
_ATTRIBUTE_CALLS = {"getattr", "setattr", "delattr", "hasattr"}
# Modules that reach any object by name or rewrite the running program.
# (operator's attrgetter and types' constructors reach nothing the calls above do not.)
_REACHING_MODULES = {"importlib", "sys", "builtins", "gc", "inspect", "ctypes", "pickle", "marshal",
                     "runpy", "code", "codeop", "dill", "cloudpickle", "IPython"}
# Attributes that lead from an object to the namespaces and code behind it.
_REACHING_ATTRIBUTES = {"__dict__", "__globals__", "__builtins__", "__code__", "__closure__", "__class__",
                        "__subclasses__", "__bases__", "__base__", "__mro__", "__module__", "__file__",
                        "__path__", "__loader__", "__spec__", "__self__", "__func__", "__defaults__",
                        "__kwdefaults__", "__wrapped__", "__getattribute__", "__setattr__", "__delattr__",
                        "__reduce__", "__reduce_ex__", "f_globals", "f_locals", "f_back", "gi_frame",
                        "cr_frame", "tb_frame", "user_ns", "shell"}
COURSE_NAMES = {"checks", "costmodel", "spike_course"}
_COURSE_CODE = re.compile(r"spike_course\s*\.\s*checks|\bsolutions\b")


class Misuse(NamedTuple):
    """One thing an answer does that no answer needs: its name and what it was."""
    name: str
    line: int
    what: str

    def message(self) -> str:
        why = {
            "NamespaceReach": "reaches the notebook's objects by name (the checks' among them); "
                              "an answer works with its own values and the arguments it is given",
            "ModulePatched": "changes a module the checks use; an answer leaves modules as they are",
            "RebindsCourseName": "rebinds a name a course cell imported; the check cell would call "
                                 "what the answer put there",
            "BorrowedAnswer": "uses the course's checks or its solutions; "
                              "the exercise asks for your own code",
        }[self.name]
        return f"{self.name}: line {self.line} of this cell, {self.what}, {why}"


def misuses(source: str, answer_lines: list[tuple[int, int]], imported: set[str],
            in_kernel: bool = True) -> list[Misuse]:
    """The misuses in ``source`` (a cell as grade runs it) on the lines of its answers
    (``answer_lines``: first and last line of each, from 1). ``imported``: the names course
    cells bound by an import. A cell that runs as a rank's script (``in_kernel=False``) cannot
    rebind the notebook's objects: only borrowing is looked for there."""
    try:
        tree = ast.parse(_as_python(source))
    except SyntaxError:
        return []  # the cell fails when it runs, and says why

    imported = imported | imported_names(source)  # the answer's own imports too

    def in_answer(node) -> bool:
        return any(first <= getattr(node, "lineno", 0) <= last for first, last in answer_lines)

    found = [Misuse("BorrowedAnswer", node.lineno, f"the text {text!r}")
             for node, text in _strings(tree) if in_answer(node) and _COURSE_CODE.search(text)]
    for node in ast.walk(tree):
        if not in_answer(node):
            continue
        found += _borrowed(node)
        if in_kernel:
            found += _reaching(node) + _patching(node, imported)
    found += _rebinding(tree, in_answer, imported) if in_kernel else []
    return sorted(set(found), key=lambda m: m.line)


def imported_names(source: str) -> set[str]:
    """The names a cell binds by ``import`` (at any depth: a course cell is trusted)."""
    try:
        tree = ast.parse(_as_python(source))
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def _as_python(source: str) -> str:
    """A cell's text as Python: IPython's magic and shell lines become blank lines (the line
    numbers stay), and a ``%%writefile`` cell is the script it writes."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.split("\n"))


def _strings(tree):
    """(node, text) for every string the code spells, and for each sum of strings folded."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node, node.value
        elif isinstance(node, (ast.BinOp, ast.JoinedStr)):
            text = _folded(node)
            if text is not None:
                yield node, text


def _folded(node) -> str | None:
    """The string an expression of string constants, + and f-string pieces makes, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _folded(node.left), _folded(node.right)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.JoinedStr):
        parts = [_folded(v) if not isinstance(v, ast.FormattedValue) else _folded(v.value) for v in node.values]
        return None if None in parts else "".join(parts)
    return None


def _dotted(node) -> str:
    """``a.b.c`` for an attribute chain on a name, else ''."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _root(node) -> str:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ""


def _borrowed(node) -> list[Misuse]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        names = [f"{node.module}.{alias.name}" for alias in node.names]
    else:
        dotted = _dotted(node) if isinstance(node, ast.Attribute) else ""
        names = [dotted] if dotted.startswith("checks.") or ".checks." in f".{dotted}" else []
    return [Misuse("BorrowedAnswer", node.lineno, f"{name!r}") for name in names
            if re.search(r"(^|\.)checks(\.|$)", name)]


def _reaching(node) -> list[Misuse]:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name = node.func.id
        # getattr(x, "name") is x.name; a name computed or split into pieces hides what it reaches.
        dynamic = len(node.args) > 1 and not (isinstance(node.args[1], ast.Constant)
                                              and node.args[1].value not in _REACHING_ATTRIBUTES)
        if name in _REACHING_CALLS or name in _ATTRIBUTE_CALLS and dynamic:
            return [Misuse("NamespaceReach", node.lineno, f"{name}(...)")]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        return [Misuse("NamespaceReach", node.lineno, f"import {m}") for m in modules
                if m.split(".")[0] in _REACHING_MODULES]
    if isinstance(node, ast.Attribute) and node.attr in _REACHING_ATTRIBUTES:
        return [Misuse("NamespaceReach", node.lineno, f".{node.attr}")]
    if isinstance(node, ast.Name) and node.id in _REACHING_MODULES | {"__builtins__", "get_ipython"}:
        return [Misuse("NamespaceReach", node.lineno, node.id)]
    return []


def _patching(node, imported: set[str]) -> list[Misuse]:
    """An assignment to an attribute (or item) of an imported module, or setattr on one."""
    targets = []
    if isinstance(node, (ast.Assign, ast.Delete)):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
        targets = node.args[:1]
        if targets and _root(targets[0]) in imported:
            return [Misuse("ModulePatched", node.lineno, f"{node.func.id}({_dotted(targets[0]) or '...'}, ...)")]
        return []
    found = []
    for target in targets:
        for part in ast.walk(target):
            if isinstance(part, (ast.Attribute, ast.Subscript)) and _root(part) in imported:
                found.append(Misuse("ModulePatched", node.lineno, f"{ast.unparse(part)} = ..."))
                break
    return found


def _rebinding(tree, in_answer, imported: set[str]) -> list[Misuse]:
    """Names a course cell imported, bound anew by the answer at the notebook's level (outside
    any function, or inside one that declares them global)."""
    found = []

    def visit(node, declared_global: set[str], top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                names = {n for g in ast.walk(child) if isinstance(g, ast.Global) for n in g.names}
                visit(child, names, False)
                continue
            if in_answer(child):
                bound = _bound_names(child)
                for name in bound & imported:
                    if top or name in declared_global:
                        found.append(Misuse("RebindsCourseName", child.lineno, f"{name} = ..."))
            visit(child, declared_global, top)

    visit(tree, set(), True)
    return found


def _bound_names(node) -> set[str]:
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.With, ast.NamedExpr)):
        targets = {ast.Assign: lambda n: n.targets, ast.For: lambda n: [n.target],
                   ast.With: lambda n: [i.optional_vars for i in n.items if i.optional_vars]}.get(
            type(node), lambda n: [n.target])(node)
        return {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        # Importing a module again binds the same module; only the course's own names taken
        # for something else count (import fake as checks).
        return {alias.asname for alias in node.names if alias.asname in COURSE_NAMES
                and not (getattr(node, "module", None) or alias.name).startswith("spike_course")}
    return set()
