"""The package layout's rules, read from the source with ``ast`` (nothing is imported), so that a
change that breaks one fails here with what broke it:

- no import cycle between kvfuse's modules, nor between its packages (``kvfuse.engine``,
  ``kvfuse.config``, ...). Every import counts: at module level, inside a function, or under
  ``if TYPE_CHECKING:`` (a cycle there is still two modules that need each other). An edge goes
  to the module imported: ``from .pkg import mod`` to ``pkg.mod`` when that is a module, else to
  ``pkg``; a package's ``__init__`` that runs first is not an edge of its own (that would make
  every ``from . import sibling`` a cycle with the package that lists it);
- the environment is read only in ``kvfuse/config/`` (``os.environ``, ``os.getenv``), except
  where ``ENV_ALLOWED`` says why;
- only ``kvfuse/calibration/`` imports ``kvfuse.calibration`` (it runs the engine to measure: the
  engine reads its results from ``kvfuse.config.profiles``), except where ``CALIBRATION_ALLOWED``
  says why;
- no function in ``kvfuse/`` or ``bench/`` is longer than ``MAX_FUNCTION_LINES`` (from its ``def``
  line to its last line, decorators not counted), except those ``LONG_FUNCTIONS_ALLOWED`` names: a
  function that needs a scroll bar is two functions. Code vendored from other projects
  (``VENDORED``) is kept as its authors wrote it and not measured.

An exception that is no longer needed fails too, so that the tables stay true.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvfuse"

ENV_ALLOWED = {
    "kvfuse/entropy/pool.py": "passes this process's environment whole to its worker processes "
    "(they import kvfuse as it does), with one thread per math library; it reads no setting",
}
CALIBRATION_ALLOWED = {
    "kvfuse.cli": "the kvfuse calibrate command runs the measurement (calibration.calibrate, "
    "calibration.codec_level): the command line sits above every package",
}
_ENV_NAMES = {"environ", "environb", "getenv", "getenvb"}
MAX_FUNCTION_LINES = 60
FUNCTION_ROOTS = ("kvfuse", "bench")
VENDORED = ("bench/vendor/",)  # other projects' code, run as they wrote it (each folder's README)
# Split once the edits in progress to kvfuse/server/responses_api.py land (another branch is
# changing these functions now); then this table goes.
LONG_FUNCTIONS_ALLOWED: set[str] = set()


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of kvfuse by dotted name (a package by its name, for its ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


@functools.cache
def tree(name: str) -> ast.Module:
    return ast.parse(modules()[name].read_text(), str(modules()[name]))


def _known(target: str) -> str | None:
    """The kvfuse module ``target`` names, or the closest package above it (None: not kvfuse)."""
    while target and target not in modules():
        target = target.rpartition(".")[0]
    return target or None


def imported(name: str) -> set[str]:
    """The kvfuse modules ``name`` imports, wherever in the file the import is."""
    is_package = modules()[name].name == "__init__.py"
    targets = import_targets(tree(name), name, is_package, modules())
    return {m for t in targets if (m := _known(t)) not in (None, name)}


def import_targets(module: ast.Module, name: str, is_package: bool, known) -> list[str]:
    """The kvfuse names the imports of ``module`` (named ``name``) bring in, relative imports
    resolved: ``from X import y`` names ``X.y`` when that is a module in ``known``, else ``X``."""
    out = []
    for node in ast.walk(module):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    parent = parent.rpartition(".")[0]
                base = f"{parent}.{base}" if base else parent
            out += [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    return [t for t in out if t.split(".")[0] == "kvfuse"]


def package_of(module: str) -> str:
    """The package a module belongs to for the package-level check: ``kvfuse.<first part>``."""
    return ".".join(module.split(".")[:2])


def graph(level: str) -> dict[str, set[str]]:
    """Import edges between modules, or between packages (edges inside a package dropped)."""
    node = (lambda m: m) if level == "module" else package_of
    out: dict[str, set[str]] = {}
    for m in modules():
        deps = {node(d) for d in imported(m)} - {node(m)}
        out.setdefault(node(m), set()).update(deps)
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``a, b, ..., a``) per strongly connected group of nodes (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_loop(g, edges) for g in groups]


def _loop(group: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the group's first node, inside the group (breadth first)."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, set()) & members):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return group  # unreachable: a strongly connected group has a cycle through every member


def environment_readers() -> dict[str, list[int]]:
    """Files outside kvfuse/config/ that use ``os.environ`` / ``os.getenv`` (and the lines)."""
    out: dict[str, list[int]] = {}
    for name, path in modules().items():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("kvfuse/config/"):
            continue
        lines = [
            node.lineno
            for node in ast.walk(tree(name))
            if (
                isinstance(node, ast.Attribute)
                and node.attr in _ENV_NAMES
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
            )
            or (
                isinstance(node, ast.ImportFrom)
                and node.module == "os"
                and any(a.name in _ENV_NAMES for a in node.names)
            )
        ]
        if lines:
            out[rel] = lines
    return out


def calibration_importers() -> dict[str, list[str]]:
    """Modules outside kvfuse.calibration that import it (and what they import of it)."""
    inside = "kvfuse.calibration"
    out = {}
    for m in modules():
        if m == inside or m.startswith(inside + "."):
            continue
        used = sorted(d for d in imported(m) if d == inside or d.startswith(inside + "."))
        if used:
            out[m] = used
    return out


def function_lengths(module: ast.Module) -> list[tuple[str, int, int]]:
    """``(qualified name, line, lines)`` of every function and method of ``module``, nested ones
    included (``Class.method``, ``outer.inner``); lines from the ``def`` line to the last one, so
    decorators are not counted."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                out.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(module, "")
    return out


def too_long(module: ast.Module, rel: str) -> dict[str, tuple[int, int]]:
    """The functions of ``module`` (the file ``rel``) longer than ``MAX_FUNCTION_LINES``, as
    ``rel::qualified name`` -> (line, lines)."""
    return {
        f"{rel}::{name}": (line, lines)
        for name, line, lines in function_lengths(module)
        if lines > MAX_FUNCTION_LINES
    }


def long_functions() -> dict[str, tuple[int, int]]:
    """The functions of kvfuse/ and bench/ longer than ``MAX_FUNCTION_LINES`` (see ``too_long``)."""
    out = {}
    for root in FUNCTION_ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(VENDORED):
                continue
            out.update(too_long(ast.parse(path.read_text(), rel), rel))
    return out


def test_no_function_is_longer_than_the_limit():
    found = long_functions()
    broken = sorted((k, v) for k, v in found.items() if k not in LONG_FUNCTIONS_ALLOWED)
    stale = sorted(LONG_FUNCTIONS_ALLOWED - set(found))
    assert not broken, (
        f"functions longer than {MAX_FUNCTION_LINES} lines (split each along its seams):\n"
        + "\n".join(f"  {k.replace('::', f':{line} ')}: {n} lines" for k, (line, n) in broken)
    )
    assert not stale, f"no longer too long, remove from LONG_FUNCTIONS_ALLOWED: {stale}"


@pytest.mark.parametrize("level", ["module", "package"])
def test_no_import_cycles(level):
    found = cycles(graph(level))
    assert not found, f"import cycles between kvfuse's {level}s:\n" + "\n".join(
        "  " + " -> ".join(c) for c in found
    )


RULES = {
    "the environment is read only in kvfuse/config/": (environment_readers, ENV_ALLOWED),
    "only kvfuse/calibration/ imports kvfuse.calibration": (
        calibration_importers,
        CALIBRATION_ALLOWED,
    ),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_layout_rule(rule):
    find, allowed = RULES[rule]
    found = find()
    broken = {k: v for k, v in found.items() if k not in allowed}
    stale = sorted(set(allowed) - set(found))
    assert not broken, f"{rule}; broken by: {broken} (add a reason to the table only if justified)"
    assert not stale, f"{rule}: exceptions no longer needed, remove them from the table: {stale}"


def test_the_checks_see_what_they_look_for():
    """The finders on known input: a cycle test that saw no edges would pass whatever the tree."""
    source = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "from . import b, util\n"
        "from ..other import thing\n"
        "import kvfuse.x.c\n"
        "if TYPE_CHECKING:\n"
        "    from .d import D\n"
        "def f():\n"
        "    from kvfuse.e import g\n"
    )
    known = {"kvfuse.x.b", "kvfuse.x.c", "kvfuse.x.d", "kvfuse.other"}
    assert import_targets(source, "kvfuse.x.a", False, known) == [
        "kvfuse.x.b",
        "kvfuse.x",  # util: no such module, a name of the package
        "kvfuse.other",
        "kvfuse.x.c",
        "kvfuse.x.d",  # under TYPE_CHECKING
        "kvfuse.e",  # inside a function
    ]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert len(modules()) > 100 and "kvfuse.config" in graph("package")["kvfuse.cli"]
    assert "kvfuse/entropy/pool.py" in environment_readers()
    n = MAX_FUNCTION_LINES
    source = ast.parse(
        "@decorator\ndef fits():\n"
        + _statements(n - 1, 4)
        + "class C:\n    async def method(self):\n"
        + _statements(n - 2, 8)
        + "        def inner():\n            return 1\n"
        + "def outer():\n    def too_long():\n"
        + _statements(n, 8)
    )
    assert {name: lines for name, _, lines in function_lengths(source)} == {
        "fits": n,  # its decorator not counted
        "C.method": n + 1,
        "C.method.inner": 2,
        "outer": n + 2,
        "outer.too_long": n + 1,
    }
    assert set(too_long(source, "x.py")) == {
        "x.py::C.method",
        "x.py::outer",
        "x.py::outer.too_long",
    }


def _statements(count: int, indent: int) -> str:
    return "".join(f"{' ' * indent}x = {i}\n" for i in range(count))


def test_test_modules_have_unique_names():
    """pytest imports test modules by basename (no packages under tests/): two files of one name
    in different folders stop the default run at collection."""
    tests = Path(__file__).resolve().parents[1]
    seen: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a name: {clashes}"
