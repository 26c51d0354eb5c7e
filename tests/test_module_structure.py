"""The modules of autocast, subpackages included (``autocast/_attention/``), import each other
in one direction: no import cycle; the interpreter, the planner and the higher-order handlers
do not import each other in a circle (handlers register into ``autocast._registry`` and the
planner reads it); the core (the evaluation loop, the planner, the binder, the policy and the
tables features register into) imports no feature module (``_attention``, ``_fp8``): a
feature plugs in through a declared door (``_rewrites.register_rewrite``,
``_rules.register_category``); and no module inside a subpackage imports its way back up to
the core that runs it."""

from __future__ import annotations

import ast
from pathlib import Path

import autocast
from autocast import _compat, _registry

PACKAGE = Path(autocast.__file__).parent

CORE = ("_interpreter", "_plan", "_steps", "_binding", "_islands", "_policy", "_rewrites", "_registry", "_rules")
"""The evaluation loop and what it stands on: they import no feature."""

FEATURES = ("_attention", "_fp8", "_fp8_cost", "_loss_head")
"""Modules (and subpackages: every module inside) that plug into the core through its doors."""

UP = ("_amp", "_interpreter", "_plan", "_binding", "_islands", "_policy", "_higher_order", "_explain", "_overflow")
"""What a module inside a subpackage must not import, even through another module: the
transform, the loop and the inspection tools that run it."""


def _module_name(path: Path) -> str:
    """`autocast/_attention/_fuse.py` -> `"_attention._fuse"`; a package's `__init__.py` ->
    the package's name."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _targets(node: ast.ImportFrom, package: str) -> list[str]:
    """The autocast modules an import statement in a module of `package` (`""`: autocast
    itself) loads: the module it names, or each name it imports that is a module."""
    if node.level:
        base = package.split(".") if package else []
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        module = ".".join([*base, *(node.module.split(".") if node.module else [])])
    elif (node.module or "").startswith("autocast"):
        module = node.module.split(".", 1)[1] if "." in node.module else ""
    else:
        return []
    # `from . import x` loads x (its own package is the one already importing)
    out = [module] if node.module and _is_module(module) else []
    for alias in node.names:
        sub = f"{module}.{alias.name}" if module else alias.name
        if _is_module(sub):
            out.append(sub)
    return out


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """(autocast modules imported at module level, imports made inside functions)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    nested: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            top.update(_targets(node, package))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and _targets(inner, package):
                    nested.append(f"{path.relative_to(PACKAGE)}:{inner.lineno}")
    # importing `pkg.mod` from outside `pkg` runs `pkg/__init__.py` first
    top |= {t.split(".")[0] for t in top if "." in t and not name.startswith(t.split(".")[0])}
    top.discard(name)
    return top, nested


def _private_modules() -> list[Path]:
    """The private modules: `autocast/_*.py` and every module of a private subpackage."""
    paths = list(PACKAGE.glob("_*.py"))
    for sub in PACKAGE.glob("_*/__init__.py"):
        paths += sorted(sub.parent.rglob("*.py"))
    return [p for p in paths if p != PACKAGE / "__init__.py"]


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    graph: dict[str, set[str]] = {}
    deferred: list[str] = []
    for path in _private_modules():
        graph[_module_name(path)], nested = _imports(path)
        deferred += nested
    return graph, deferred


def _reach(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module `start` imports, directly or not -> one chain of imports to it."""
    seen: dict[str, list[str]] = {}
    todo = [(start, [start])]
    while todo:
        mod, chain = todo.pop()
        for dep in sorted(graph.get(mod, ())):
            if dep not in seen:
                seen[dep] = [*chain, dep]
                todo.append((dep, seen[dep]))
    return seen


def _in(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(f"{r}.") for r in roots)


def _violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import chain against the direction above: from the core to a feature, and from
    inside a subpackage up to the transform, the loop or the tools that run it."""
    out = []
    for mod in sorted(graph):
        for roots, applies in ((FEATURES, _in(mod, CORE)), (UP, "." in mod)):
            if applies:  # each chain up to the first module it must not reach
                chains = _reach(graph, mod).values()
                out += [" -> ".join(c) for c in chains if _in(c[-1], roots) and not _in(c[-2], roots)]
    return sorted(out)


def test_no_import_cycle_and_no_deferred_imports_between_autocast_modules():
    graph, deferred = _graph()
    assert "_attention._fuse" in graph and "_attention" in graph  # subpackages are read
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


def test_the_core_imports_no_feature_and_no_subpackage_imports_back_up():
    graph, _ = _graph()
    assert not _violations(graph)


def test_an_arrow_from_a_subpackage_back_up_or_from_the_core_to_a_feature_is_caught():
    graph, _ = _graph()
    up = {m: set(d) for m, d in graph.items()}
    up["_attention._vocab"] = up["_attention._vocab"] | {"_interpreter"}
    assert any(v.startswith("_attention._vocab -> _interpreter") for v in _violations(up))
    # through another module: _attention._find -> _attention._vocab -> _interpreter
    assert any(v.startswith("_attention._find -> ") and v.endswith("_interpreter") for v in _violations(up))
    down = {m: set(d) for m, d in graph.items()}
    down["_policy"] = down["_policy"] | {"_fp8"}
    assert "_policy -> _fp8" in _violations(down)


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
