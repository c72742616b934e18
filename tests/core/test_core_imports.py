"""The engine's import graph: no cycle among deqzoo.core's modules, function-level imports counted, and core
imports nothing outside itself (it knows no model)."""

import ast
from pathlib import Path

import deqzoo.core

CORE = Path(deqzoo.core.__file__).parent
ROOT = CORE.parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every deqzoo module `path` imports, at any level of the file (functions included). ``from P import n``
    counts as importing P.n when that is a module, else P."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("deqzoo"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if not target.startswith("deqzoo"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in modules else target)
    return out


def _graph() -> dict[str, set[str]]:
    files = sorted(CORE.rglob("*.py"))
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, modules) for p in files}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (a list of modules, first = last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt in graph and state.get(nxt) == 1:
                return [*path, node, nxt]
            if nxt in graph and nxt not in state and (found := visit(nxt, [*path, node])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_no_import_cycle_in_core():
    graph = _graph()
    assert "deqzoo.core.solvers.anderson" in graph and "deqzoo.core.hyper" in graph
    assert "deqzoo.core.hyper" in graph["deqzoo.core.solvers.hyperanderson"]
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_core_imports_nothing_else_of_deqzoo():
    for name, targets in _graph().items():
        outside = sorted(t for t in targets if not t.startswith("deqzoo.core"))
        assert not outside, (name, outside)


def test_the_checker_sees_a_function_level_cycle(tmp_path):
    """A cycle closed by an import inside a function is found (so a passing test above means something)."""
    pkg = tmp_path / "deqzoo" / "core"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    files = sorted(pkg.rglob("*.py"))
    names = {str(p.relative_to(tmp_path).with_suffix("")).replace("/", ".") for p in files}
    names = {n.removesuffix(".__init__") for n in names}
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        graph = {_module_name(p): _imports(p, names) for p in files}
    finally:
        ROOT = root
    assert graph["deqzoo.core.b"] == {"deqzoo.core.a"}
    assert _find_cycle(graph) in (["deqzoo.core.a", "deqzoo.core.b", "deqzoo.core.a"],
                                  ["deqzoo.core.b", "deqzoo.core.a", "deqzoo.core.b"])
