"""The dependency direction of the package, read from the source with ``ast`` (no imports run):
core modules import nothing above the core, and no vegas modules import each other in a
circle. Imports inside functions count; ``if TYPE_CHECKING:`` imports do not."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vegas"

#: the core: the abstract roles, the loop and the plugin host, below every backend and selector
CORE = {
    "vegas.config",
    "vegas.interfaces",
    "vegas.selection",
    "vegas.acceptance",
    "vegas.sampling",
    "vegas.loop",
    "vegas.draft_policy",
    "vegas.outputs",
    "vegas.hookspecs",
    "vegas.plugins",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The vegas modules ``name`` imports (``from pkg import sub`` resolves to ``pkg.sub`` when
    ``sub`` is a module, else to ``pkg``)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vegas":
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "vegas":
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in modules else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    found.discard(name)
    return {m for m in found if m in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_core_imports_nothing_above_the_core():
    graph = _graph()
    assert CORE <= set(graph), sorted(CORE - set(graph))
    bad = {name: sorted(graph[name] - CORE) for name in CORE if graph[name] - CORE}
    assert not bad, f"core modules import non-core vegas modules: {bad}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, f"vegas modules that import each other in a circle: {cycles}"


def test_the_checks_see_a_cycle_and_a_core_violation():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    graph = _graph()
    assert "vegas.backends.hf" in graph["vegas.backends.base"] | graph["vegas.backends.hf"] | {"vegas.backends.hf"}
    assert "vegas.plugins" in graph["vegas.backends.hf"]  # function-level and module-level alike
