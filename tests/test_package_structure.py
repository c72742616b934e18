"""The package's shape, computed from the source (ast): no import cycle among deqzoo modules (module-level and
function-level imports counted), one error base class, no runtime module that knows the repository layout,
nothing in deqzoo importing benchmarks/, examples/ or utils/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deqzoo"
# a link into the clone (model_cards/), not library modules
LINKED = ("_model_cards",)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[1] in LINKED:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the deqzoo modules it imports anywhere in its body (a `from X import name` where name is a
    submodule counts as importing that submodule)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node)
                targets = [f"{base}.{alias.name}" for alias in node.names]
                # `from pkg import name` reads pkg's namespace unless every name is a submodule (then only
                # the submodules count, as for `from pkg.sub import x`: a parent package runs either way)
                if any(t not in modules for t in targets):
                    targets.append(base)
            for target in targets:
                while target and target not in modules:  # deqzoo.a.b.name -> deqzoo.a.b
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); components with more than one module, or a self-loop."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_analysis_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_deqzoo_modules_outside_the_engine():
    cycles = strongly_connected(import_graph())
    outside_core = [c for c in cycles if not all(m.startswith("deqzoo.core") for m in c)]
    assert outside_core == [], outside_core


def test_no_import_cycle_inside_the_engine():
    inside_core = [c for c in strongly_connected(import_graph())
                   if all(m.startswith("deqzoo.core") for m in c)]
    assert inside_core == [], inside_core


def test_every_relative_import_names_an_existing_module():
    """A moved file keeps no stale relative import (they fail only when the function runs)."""
    modules = _modules()
    missing = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                base = _resolve(module, path.name == "__init__.py", node)
                if base not in modules and not any(f"{base}.{a.name}" in modules for a in node.names):
                    missing.append(f"{module}: from {'.' * node.level}{node.module or ''}")
    assert missing == []


def test_nothing_in_deqzoo_imports_repository_tooling():
    graph_targets = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph_targets |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                graph_targets.add(node.module.split(".")[0])
    assert not graph_targets & {"benchmarks", "examples", "utils", "conversion", "deqzoo_app"}


def test_no_runtime_module_knows_the_repository_layout():
    offenders = []
    for module, path in _modules().items():
        text = path.read_text()
        if "REPO_ROOT" in text or ".parent.parent.parent" in text or '/ "model_cards"' in text:
            offenders.append(module)
    assert offenders == []


def test_every_deqzoo_error_derives_from_deqzoo_error():
    """Each exception class defined in deqzoo (outside the engine, whose errors are its issue's) names
    DeqzooError or another deqzoo error among its bases; importing them confirms the hierarchy."""
    import importlib

    from deqzoo.errors import DeqzooError

    checked = []
    for module, path in _modules().items():
        if module.startswith("deqzoo.core") or module.startswith(("deqzoo.pipelines", "deqzoo.integrations")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ClassDef) and node.name.endswith("Error")
                    and not node.name.startswith("_")):
                cls = getattr(importlib.import_module(module), node.name)
                assert issubclass(cls, DeqzooError), f"{module}.{node.name}"
                checked.append(node.name)
    assert {"CheckpointError", "ConfigError", "HyperSolverError", "HyperSolverConfigError", "CLIError",
            "SaveInProgressError", "MissingExtraError"} <= set(checked), checked


def test_no_link_in_the_package_but_the_embedded_checkpoints_and_no_repository_programs():
    """The package is the library: no link into the clone except deqzoo/_model_cards (setup.py copies the
    catalog's files there in a wheel), no deqzoo/tasks or deqzoo/conversion (examples/, conversion/)."""
    links = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*") if p.is_symlink())
    assert links == ["deqzoo/_model_cards"]
    assert not (PACKAGE / "tasks").exists() and not (PACKAGE / "conversion").exists()
