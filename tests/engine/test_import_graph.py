"""engine/ imports without a cycle, counting every import: at the top of a module and inside functions.

The graph is read from the source (ast), not from a running interpreter, so an import that only runs
when a function is called counts as much as one at the top. Edges:

- `import a.b.c` and `from a.b import c` where a.b.c is a module of engine/: to that module;
- `from a.b import name` (a function, class or constant): to a.b (its __init__ when a package);
- importing a module inside a package the importer is not in also runs that package's __init__
  first, so it adds an edge to every such enclosing package (engine.progress importing
  engine.align.x depends on engine/align/__init__.py, which imports every aligner);
- imports under `if TYPE_CHECKING:` (type hints only, never run) do not count; its `else:` does.

A cycle is reported as its strongly connected component, with each edge inside it and its line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_files(root: Path, package: str = "engine") -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under root/package (a package is its __init__)."""
    out = {}
    for p in sorted((root / package).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node at any depth, skipping the bodies of `if TYPE_CHECKING:`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _type_checking(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path = ROOT, package: str = "engine") -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first import}, over the modules of root/package."""
    files = module_files(root, package)
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]  # the package it is in
        targets: list[tuple[str, int]] = []
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [(alias.name, node.lineno) for alias in node.names]
                continue
            if node.level:  # relative: from . import x, from ..y import z
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                targets.append((sub if sub in files else mod, node.lineno))
        graph[name] = _edges(name, targets, files)
    return graph


def _edges(name: str, targets: list[tuple[str, int]], files: dict[str, Path]) -> dict[str, int]:
    """Module `name`'s edges to the modules of `files`, from its (dotted target, line) imports."""
    mine = {*_ancestors(name), name}
    edges: dict[str, int] = {}
    for target, line in targets:
        while target and target not in files:  # engine.models.base.Arch -> engine.models.base
            target = target.rpartition(".")[0]
        for t in [*_ancestors(target), target] if target else []:  # enclosing packages' __init__ run first
            if t in files and t not in mine:
                edges[t] = min(edges.get(t, line), line)
    return edges


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start, nexts in graph.items():
        if start in index:
            continue
        work = [(start, iter(nexts))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph.get(w, {}))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def describe(graph: dict[str, dict[str, int]], comp: list[str]) -> str:
    edges = [f"  {v} -> {w} (line {graph[v][w]})" for v in comp for w in sorted(graph[v]) if w in comp]
    return f"{len(comp)} modules import each other: {', '.join(comp)}\n" + "\n".join(edges)


def test_engine_imports_have_no_cycle():
    graph = import_graph()
    assert len(graph) > 30 and "engine.align" in graph and "engine.resources" in graph  # the scan found engine/
    found = cycles(graph)
    assert not found, "Import cycle in engine/ (imports inside functions count):\n" + "\n".join(
        describe(graph, c) for c in found)


def test_the_scan_counts_function_imports_and_skips_type_checking(tmp_path):
    pkg = tmp_path / "engine"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from engine.sub import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("X = 1\n")
    (pkg / "a.py").write_text("from engine import b\n")
    (pkg / "b.py").write_text("def f():\n    from engine.a import thing\n")  # a <-> b, through a function
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.d import T\n"
                              "else:\n    import engine.sub.leaf\n")
    (pkg / "d.py").write_text("from engine.c import U\n")  # c -> d only for type hints: no cycle
    graph = import_graph(tmp_path)
    assert graph["engine.b"] == {"engine.a": 2} and graph["engine.a"] == {"engine.b": 1}
    assert graph["engine.c"] == {"engine.sub": 5, "engine.sub.leaf": 5}  # the package's __init__ runs first
    assert graph["engine.sub"] == {"engine.sub.leaf": 1}  # a package importing its own module
    assert cycles(graph) == [["engine.a", "engine.b"]]
    assert "engine.b -> engine.a (line 2)" in describe(graph, ["engine.a", "engine.b"])
