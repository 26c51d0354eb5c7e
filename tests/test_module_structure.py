"""The interpreter, the planner and the higher-order handlers do not import each other in
a circle: handlers register into ``autocast._registry`` and the planner reads it."""

from __future__ import annotations

import ast
from pathlib import Path

import autocast
from autocast import _compat, _registry

PACKAGE = Path(autocast.__file__).parent


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """(autocast modules imported at module level, imports made inside functions)."""
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    nested: list[str] = []

    def names(node) -> list[str]:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            return [node.module] if node.module else [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autocast"):
            return [node.module.split(".", 1)[1]] if "." in node.module else [a.name for a in node.names]
        return []

    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            top.update(names(node))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and names(inner):
                    nested.append(f"{path.name}:{inner.lineno}")
    return {n for n in top if (PACKAGE / f"{n}.py").exists()}, nested


def test_no_import_cycle_and_no_deferred_imports_between_autocast_modules():
    graph, deferred = {}, []
    for path in PACKAGE.glob("_*.py"):
        graph[path.stem], nested = _imports(path)
        deferred += nested
    assert not deferred, f"imports of autocast modules inside functions: {deferred}"
    state: dict[str, int] = {}

    def visit(mod, stack):
        if state.get(mod) == 1:
            raise AssertionError(f"import cycle: {' -> '.join([*stack, mod])}")
        if state.get(mod) == 2:
            return
        state[mod] = 1
        for dep in graph.get(mod, ()):
            visit(dep, [*stack, mod])
        state[mod] = 2

    for mod in graph:
        visit(mod, [])
    assert "_higher_order" not in graph["_interpreter"] | graph["_plan"]


def test_handlers_are_registered_for_the_higher_order_primitives():
    for prim in (
        _compat.jit_p,
        _compat.custom_jvp_call_p,
        _compat.custom_vjp_call_p,
        _compat.scan_p,
        _compat.while_p,
        _compat.cond_p,
    ):
        assert prim in _registry.HIGHER_ORDER_RULES, prim
    assert _compat.jit_p in _registry.PULL_RULES and _compat.scan_p in _registry.PULL_RULES
