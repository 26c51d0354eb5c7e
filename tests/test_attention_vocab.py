"""The attention recogniser's primitive vocabulary (autocast/_attention/_vocab.py) against the
installed JAX: every name it spells, and every name a module of `autocast/_attention` compares
a primitive's name with, is a primitive of this JAX (the suite runs on the newest and the
oldest supported JAX). A misspelt name ("copy_p", "iota_32x2_shape") matches nothing and
silently turns a rule off; a set of primitive names outside `_vocab` (or the scores chain's
rule table) is a second spelling of a family."""

from __future__ import annotations

import ast
import pathlib
import sys

import jax
import jax.extend.core
import jax.nn
import jax.numpy as jnp
import jax.random
import numpy as np
import pytest

from autocast import _steps
from autocast._attention import _scores, _vocab

ROOT = pathlib.Path(__file__).resolve().parents[1] / "autocast" / "_attention"


def _jax_primitive_names() -> set[str]:
    jnp.zeros(1)  # (imports the modules that define the primitives)
    jax.random.key(0)
    jax.nn.softmax(jnp.zeros(2))
    names = set()
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("jax"):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, jax.extend.core.Primitive):
                names.add(value.name)
    return names


PRIMITIVES = _jax_primitive_names()


def test_the_collection_sees_jax_primitives():
    assert {"dot_general", "exp", "select_n", "random_bits", "transpose"} <= PRIMITIVES
    assert "copy_p" not in PRIMITIVES and "expand_dims" not in PRIMITIVES


@pytest.mark.parametrize(
    "family", ["LAYOUT", "PASS_THROUGH", "RESTORE", "FORWARD", "RANDOM", "COMPARISONS", "MATMULS", "ALL"]
)
def test_every_family_name_is_a_jax_primitive(family):
    names = getattr(_vocab, family)
    unknown = sorted(n for n in names if n not in PRIMITIVES and n != "ragged_dot_general")
    assert not unknown, f"_vocab.{family} names no JAX {jax.__version__} primitive: {unknown}"


@pytest.mark.parametrize("family", ["LAYOUT", "LINEAR", "COMMUTES_WITH_ROUNDING"])
def test_the_planners_families_name_jax_primitives(family):
    """The same for the planner's families (autocast/_steps.py)."""
    unknown = sorted(n for n in getattr(_steps, family) if n not in PRIMITIVES)
    assert not unknown, f"_steps.{family} names no JAX {jax.__version__} primitive: {unknown}"


def test_the_scores_table_names_jax_primitives():
    unknown = sorted(n for n in _scores.RULES if n not in PRIMITIVES)
    assert not unknown, f"_scores.RULES names no JAX {jax.__version__} primitive: {unknown}"


def _is_dtype_name(s: str) -> bool:
    try:
        np.dtype(s)
    except TypeError:
        return False
    return True


def _compared_names(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants compared with a `.name` (`node.name == "exp"`, `x.name in (...)`),
    less dtype names (`dtype.name in ("bfloat16", "float16")`)."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides):
            continue
        for s in sides:
            for c in ast.walk(s):
                if isinstance(c, ast.Constant) and isinstance(c.value, str) and not _is_dtype_name(c.value):
                    out.append((c.lineno, c.value))
    return out


@pytest.mark.parametrize("path", sorted(ROOT.glob("*.py")), ids=lambda p: p.name)
def test_names_compared_in_the_modules_are_jax_primitives(path):
    tree = ast.parse(path.read_text())
    unknown = [(line, n) for line, n in _compared_names(tree) if n not in PRIMITIVES]
    assert not unknown, f"{path.name} compares primitive names JAX {jax.__version__} lacks: {unknown}"


@pytest.mark.parametrize("path", sorted(ROOT.glob("*.py")), ids=lambda p: p.name)
def test_no_second_spelling_of_a_family(path):
    """Sets of primitive names live in `_vocab` (and the scores chain's table in `_scores`)."""
    if path.name in ("_vocab.py", "_scores.py"):
        return
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Set | ast.Tuple | ast.List):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            spelled = [n for n in names if n in PRIMITIVES]
            assert len(spelled) < 3, f"{path.name}:{node.lineno} spells a family of primitives {spelled}: use _vocab"
