"""The JAX surface ``autocast/_compat.py`` reads: every ``module.attribute`` it names directly
(not through ``getattr`` with a default, the feature-detected ones) exists in the installed JAX,
and no other module of the package imports JAX's internals.

``_compat`` is the one file that touches JAX's internals; a name JAX removes (as 0.12 removed
``batching.not_mapped``) fails here, in every lane, before any test has to reach the code path
that reads it (a batched derivative of ``amp``, there).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import autocast._compat

SOURCE = Path(autocast._compat.__file__)


def _jax_modules(tree: ast.Module) -> dict[str, str]:
    """Local name -> JAX module, for ``import jax...``, ``from jax... import m`` and
    ``name = importlib.import_module("jax...")``."""
    modules = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update({a.asname or a.name: a.name for a in node.names if a.name.startswith("jax")})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax"):
            for a in node.names:
                name = f"{node.module}.{a.name}"
                try:
                    importlib.import_module(name)
                except ImportError:
                    continue  # an object, not a module
                modules[a.asname or a.name] = name
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            f, args = node.value.func, node.value.args
            if (
                isinstance(f, ast.Attribute)
                and f.attr == "import_module"
                and args
                and isinstance(args[0], ast.Constant)
            ):
                if str(args[0].value).startswith("jax"):
                    modules.update({t.id: args[0].value for t in node.targets if isinstance(t, ast.Name)})
    return modules


def test_every_jax_attribute_compat_names_exists():
    tree = ast.parse(SOURCE.read_text())
    modules = _jax_modules(tree)
    assert {"_batching", "_ad", "_pe"} <= set(modules), modules  # the reader still sees the file's imports
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if not hasattr(importlib.import_module(modules[node.value.id]), node.attr):
                missing.append(f"line {node.lineno}: {modules[node.value.id]}.{node.attr}")
    assert not missing, "names autocast/_compat.py reads that this JAX does not have:\n" + "\n".join(missing)


def _imports_jax_internals(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("jax._src")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
            found.append(node.module or "")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            found += [
                str(a.value)
                for a in node.args[:1]
                if isinstance(a, ast.Constant) and str(a.value).startswith("jax._src")
            ]
    return found


def test_only_compat_imports_jax_internals():
    """Every other module reads JAX's internals through ``_compat``: a JAX upgrade starts there."""
    offenders = {}
    for path in sorted(SOURCE.parent.rglob("*.py")):
        if path == SOURCE:
            continue
        found = _imports_jax_internals(ast.parse(path.read_text()))
        if found:
            offenders[str(path.relative_to(SOURCE.parent))] = found
    assert not offenders, f"modules importing jax._src outside autocast/_compat.py: {offenders}"
