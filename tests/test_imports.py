"""No import cycles in the package: a static walk over every ``import`` statement, function-level ones included.

A cycle that only function-level (lazy) imports close does not fail at import time, but it still ties two modules
together (neither can be understood, tested or moved without the other), and the next top-level import turns it into
an ``ImportError`` that depends on import order. So every ``import``/``from … import`` anywhere in a module counts,
those under ``if TYPE_CHECKING:`` too: a type-only cycle still makes two modules one (issue 12 names
modules/es <-> modules/es_sharded, which only such an import closes).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "es_lightning"

#: cycles another change is removing; an entry whose modules all still exist must still be a cycle, so it is deleted
#: as soon as its cycle is gone (issue 12's modules/es <-> modules/es_sharded is gone: es_sharded became an evaluator)
KNOWN_CYCLES: list[set[str]] = []


def _modules(package: Path) -> dict[str, Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported_names(tree: ast.AST, module: str, is_package: bool, known: set[str]):
    """Every module name an import statement of ``tree`` names (``from a import b`` names ``a.b`` if that is a module)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package upwards
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: {package modules it imports}}``; ``a.b.c`` that is not a module resolves to its nearest module."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    root = package.name
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for target in _imported_names(tree, name, path.name == "__init__.py", set(modules)):
            if target != root and not target.startswith(root + "."):
                continue
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(component)
    return out


def test_cycle_finder_on_a_hand_made_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set(), "g": {"g"}}
    assert sorted(map(sorted, cycles(graph))) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_reads_lazy_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import x\n")
    (pkg / "sub" / "leaf.py").write_text("x = 1\ndef f():\n    from pkg import top\n")
    (pkg / "top.py").write_text(
        "from typing import TYPE_CHECKING\nimport pkg.sub.leaf\nif TYPE_CHECKING:\n    from pkg import other\n"
    )
    (pkg / "other.py").write_text("from pkg.top import thing\n")
    graph = import_graph(pkg)
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.leaf"}, "pkg.sub.leaf": {"pkg.top"},
                     "pkg.top": {"pkg.sub.leaf", "pkg.other"}, "pkg.other": {"pkg.top"}}
    assert sorted(map(sorted, cycles(graph))) == [["pkg.other", "pkg.sub.leaf", "pkg.top"]]


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "es_lightning.cli" in graph and "es_lightning.analysis.runs" in graph  # the walk found the package
    assert "es_lightning.lightning_cli" in graph["es_lightning.analysis.runs"]  # analyses reach the CLI one way only
    found = cycles(graph)
    unexpected = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not unexpected, f"import cycles among es_lightning modules: {unexpected}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found and all(m in graph for m in c)]
    assert not gone, f"these cycles are gone: delete them from KNOWN_CYCLES in {Path(__file__).name}: {gone}"


@pytest.mark.parametrize("first, second", [("es_lightning.cli", "es_lightning.analysis"),
                                           ("es_lightning.analysis", "es_lightning.cli")])
def test_cli_and_analysis_import_in_either_order(first, second):
    """The once-circular pair, each first in a fresh interpreter (a static walk cannot see a failing import)."""
    import subprocess
    import sys

    code = f"import {first}, {second}, es_lightning.analysis.runs; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=PACKAGE.parent)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
