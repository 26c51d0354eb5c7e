"""Flax NNX objects under `amp`: their state updates reach the caller's objects.

An NNX module updates its own state as it runs (`BatchNorm`'s running statistics,
`Dropout`'s and every `nnx.Rngs`' counters). `amp` traces `fn` on copies of its
arguments, so those updates happened on the copies and were lost: running statistics never
moved, and every step drew the same dropout mask. As NNX's own transforms do, a call whose
arguments (or `fn` itself) hold NNX graph nodes is split into a graph definition and a
state (`nnx.split`), the state goes through `amp` as data, and the function's updated
`nnx.Variable` state comes back as an extra output and is written into the caller's
objects (`nnx.update`), in the dtypes the variables had (float32 statistics stay float32).

Flax stays optional: nothing here imports it; a call can only hold NNX objects once the
program has imported `flax.nnx`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


def holds_graph_nodes(fn: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether `fn` or an argument (at any depth of its pytree) is an NNX object that can
    update its own state: a graph node other than a single `nnx.Variable` (an `nnx.State`
    of variables, the functional split/merge style, is data: its updates are returned)."""
    nnx = _nnx()
    if nnx is None:
        return False
    is_node = nnx.graph.is_graph_node
    leaves = jax.tree_util.tree_leaves((fn, args, kwargs), is_leaf=is_node)
    return any(is_node(x) and not isinstance(x, nnx.Variable) for x in leaves)


def pure(fn: Callable) -> Callable:
    """`fn` as a function of `(graphdef, state)` returning `(out, updated variables)`."""

    def split_call(graphdef: Any, state: Any) -> tuple[Any, Any]:
        nnx = _nnx()
        node_fn, args, kwargs = nnx.merge(graphdef, state)
        out = (fn if node_fn is None else node_fn)(*args, **kwargs)
        return out, nnx.state((node_fn, args, kwargs), nnx.Variable)

    return split_call


def call(fn: Callable, core: Callable, args: tuple, kwargs: dict) -> Any:
    """`fn(*args, **kwargs)` through `core` (`amp` of `pure` `(fn)`), the
    updated variables written back into the caller's objects."""
    nnx = _nnx()
    tree = (fn if nnx.graph.is_graph_node(fn) else None, args, kwargs)
    graphdef, state = nnx.split(tree)
    out, updated = core(graphdef, state)
    nnx.update(tree, updated)
    return out
