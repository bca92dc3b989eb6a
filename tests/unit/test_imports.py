"""sparknet's imports flow one way: no cycle among modules, none among packages.

Every import of a sparknet module is read from the source with :mod:`ast` — at module level
and inside functions alike (a lazy import is still a dependency; it only moves the moment the
cycle bites). Imports under ``if TYPE_CHECKING:`` are left out: they never run.

How an import becomes edges of the module graph
    * ``import sparknet.a.b`` and ``from sparknet.a import b`` (``b`` a module) are an edge
      to ``sparknet.a.b``; ``from sparknet.a import name`` (``name`` not a module) is an edge
      to ``sparknet.a``; relative imports resolve the same way; so does
      ``importlib.import_module("sparknet....")`` with a literal name.
    * Python runs a package's ``__init__`` before any of its submodules. So an import of
      ``sparknet.a.b`` from *outside* the package ``sparknet.a`` is also an edge to
      ``sparknet.a`` (its ``__init__``). From *inside* the package (a submodule importing a
      sibling, or the ``__init__`` importing its own submodules) it is not: that ``__init__``
      is already running. Hence a package's ``__init__`` re-exporting its submodules is no
      cycle by itself, while a submodule that imports names from its own package's
      ``__init__`` is one. The root package ``sparknet`` contains every module and so is never
      such an implied edge.

The package graph
    Its nodes are sparknet's sub-packages and top-level modules (``sparknet.spark``,
    ``sparknet.cli``, ...; the root ``__init__`` is the node ``sparknet``); every edge of the
    module graph between two different nodes is an edge between them.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = "sparknet"

def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def _imported(name: str, node: ast.AST) -> list[str]:
    """The sparknet modules one import statement (or ``import_module`` call) names."""
    package = name if _is_package(name) else name.rpartition(".")[0]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        if base != ROOT and not base.startswith(ROOT + "."):
            return []
        out = []
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            out.append(sub if sub in MODULES else base)
        return [m for m in out if m in MODULES]
    if (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args
            and isinstance(node.args[0], ast.Constant) and node.args[0].value in MODULES):
        return [node.args[0].value]
    return []


def _edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> the places (``file:line``) that make the edge."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            for target in _imported(name, node):
                where = f"{path.relative_to(SRC.parent)}:{node.lineno}"
                parts = target.split(".")
                # The packages Python runs first: those that do not already contain the importer.
                for i in range(2, len(parts)):
                    parent = ".".join(parts[:i])
                    if name != parent and not name.startswith(parent + "."):
                        edges[(name, parent)].append(where)
                if target != name:
                    edges[(name, target)].append(where)
    return {edge: sorted(set(where)) for edge, where in edges.items()}


EDGES = _edges()


def _node(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _report(cycles: list[list[str]], edges: dict[tuple[str, str], list[str]], node=lambda m: m) -> str:
    lines = []
    for component in cycles:
        members = set(component)
        lines.append("cycle among " + ", ".join(component) + ":")
        for (a, b), where in sorted(edges.items()):
            if node(a) in members and node(b) in members and node(a) != node(b):
                lines.append(f"    {a} -> {b}  ({', '.join(where)})")
    return "\n".join(lines)


def test_the_import_reader_sees_imports_at_module_level_and_inside_functions():
    # Module level, resolved to the submodule: train.py imports sparknet._app.
    assert ("sparknet.train", "sparknet._app") in EDGES
    # A name from a package's __init__ from outside it: an edge to the package.
    assert ("sparknet.train", "sparknet.config") in EDGES
    # Inside a function: predict loads the Spark ML classes (pyspark) only when it scores.
    assert ("sparknet.tools.predict", "sparknet.spark.ml") in EDGES
    # A relative import (zoo.py: from .layers import ...).
    assert ("sparknet.zoo", "sparknet.layers") in EDGES
    # From outside a package, its __init__ runs first: cli imports sparknet.ps.config.
    assert ("sparknet.cli", "sparknet.ps") in EDGES
    # From inside it, not: predict's import of sparknet.spark.ml adds no edge to the tools package.
    assert ("sparknet.tools.predict", "sparknet.tools") not in EDGES
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_cycle_among_modules():
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in EDGES:
        graph[a].add(b)
    cycles = _cycles(graph)
    assert not cycles, "import cycles among modules:\n" + _report(cycles, EDGES)


def test_no_cycle_among_packages():
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in EDGES:
        if _node(a) != _node(b):
            graph[_node(a)].add(_node(b))
    cycles = _cycles(graph)
    assert not cycles, "import cycles among packages:\n" + _report(cycles, EDGES, _node)


def test_the_caffe_package_exports_what_its_modules_export():
    """sparknet.caffe names its modules' exports without importing them (they load torch): its lists are theirs."""
    import sparknet.caffe as caffe
    from sparknet.caffe import caffemodel, prototxt, solver

    assert list(caffe._PROTOTXT) == prototxt.__all__ and list(caffe._CAFFEMODEL) == caffemodel.__all__
    assert {name: getattr(caffe, name) for name in caffe.__all__} == {
        name: getattr(module, name) for module in (prototxt, caffemodel, solver) for name in caffe.__all__
        if hasattr(module, name)}
