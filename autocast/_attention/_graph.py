"""A jaxpr seen through its small helper calls: the recogniser's view of one jaxpr.

`jnp.where` is a `jit[_where]`, `jnp.tril` a `jit[tril]`, `jax.nn.softmax` a
`custom_jvp_call[_softmax]` (or a `CustomJVPTraced`) when `jax_softmax_custom_jvp` is
on: an attention span crosses those boundaries. `Graph` inlines every `jit` whose
body computes no matmul and every softmax `custom_jvp` into one list of first-order
nodes (`Node`), each remembering the top-level equation it came from, with fresh integer ids
for its values (a body traced once and called twice is inlined twice). Everything else
(`jit` bodies with matmuls, `scan`, `cond`, checkpoints, other custom derivatives) stays
one opaque node: amp calls the recogniser once per body it evaluates.

The graph also knows which values are *constants*: they depend on no input of the jaxpr
(`iota`, literals, the jaxpr's constants when their values are given, and pure equations of
constants). `Graph.value` evaluates one at trace time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .. import _compat, _walk
from . import _vocab

FOLD_LIMIT = 1 << 26
"""The most elements a constant mask or bias may have to be evaluated at trace time (a
causal mask of 8192 x 8192 booleans, 64 MiB); a larger one is computed by the rewrite
like a traced one."""


@dataclass(frozen=True)
class Lit:
    """A literal operand: its value and abstract value."""

    val: Any
    aval: Any


Atom = int | Lit
"""An operand: a value id of the graph, or a literal."""


@dataclass(eq=False)
class Node:
    """One first-order equation of the inlined view (or an opaque higher-order one)."""

    prim: Any
    params: dict[str, Any]
    ins: tuple[Atom, ...]
    outs: tuple[int, ...]  # -1 for a dropped output
    top: int  # index of the top-level equation it belongs to
    opaque: bool = False
    source: Any = None  # its equation's source info, the name stack of the calls inlined around it included

    @property
    def name(self) -> str:
        return str(self.prim.name)


def _is_softmax_jvp(eqn: Any) -> bool:
    if _walk.kind(eqn) != "custom_jvp":
        return False
    name = eqn.params.get("name") or _compat.fun_name(eqn) or _compat.hi_param(eqn, "name")
    return name == _vocab.SOFTMAX_JVP_NAME


class Graph:
    """The inlined view of one jaxpr's top-level equations (see the module docstring).

    Args:
        jaxpr: The open jaxpr.
        known: Its top-level variables (constants, usually) mapped to values that the
            recogniser may fold at trace time.
    """

    def __init__(self, jaxpr: Any, known: Mapping[Any, Any]):
        self.jaxpr = jaxpr
        self.nodes: list[Node] = []
        self.avals: dict[int, Any] = {}
        self.producer: dict[int, int] = {}
        self.readers: dict[int, list[int]] = {}
        self.top_of_var: dict[Any, int] = {}  # top-level Var -> id
        self.var_of_id: dict[int, Any] = {}  # id -> top-level Var
        self.top_nodes: list[list[int]] = []
        self.top_outs: list[tuple[int, ...]] = []
        self.outside: set[int] = set()  # ids the jaxpr returns
        self._consts: dict[int, Any] = {}
        self._values: dict[int, Any] = {}
        self._unfoldable: set[int] = set()
        self._dot_free: dict[int, bool] = {}
        self._next = 0
        env: dict[Any, Atom] = {}
        for var in [*jaxpr.constvars, *jaxpr.invars]:
            i = self._fresh(var.aval)
            env[var] = i
            self.top_of_var[var] = i
            self.var_of_id[i] = var
            if var in known:
                self._consts[i] = known[var]
        for index, eqn in enumerate(jaxpr.eqns):
            start = len(self.nodes)
            outs = self._add(eqn, env, index)
            self.top_nodes.append(list(range(start, len(self.nodes))))
            ids = []
            for var, atom in zip(eqn.outvars, outs):
                if isinstance(var, _compat.DropVar):
                    ids.append(-1)
                    continue
                if not isinstance(atom, int):  # a body returning a literal: give it an id
                    atom = self._literal_node(atom, index)
                env[var] = atom
                self.top_of_var[var] = atom
                self.var_of_id.setdefault(atom, var)
                ids.append(atom)
            self.top_outs.append(tuple(ids))
        for var in jaxpr.outvars:
            if not isinstance(var, _compat.Literal) and isinstance(env.get(var), int):
                self.outside.add(env[var])  # type: ignore[arg-type]
        for n, node in enumerate(self.nodes):
            for atom in node.ins:
                if isinstance(atom, int):
                    self.readers.setdefault(atom, []).append(n)
        self.const_ids = self._constness()

    # --- building ---------------------------------------------------------------------

    def _fresh(self, aval: Any) -> int:
        i = self._next
        self._next += 1
        self.avals[i] = aval
        return i

    def _literal_node(self, lit: Lit, top: int) -> int:
        """A value id for a literal a body returns (a `copy` of it)."""
        out = self._fresh(lit.aval)
        node = Node(jax.lax.copy_p, {}, (lit,), (out,), top)
        self.producer[out] = len(self.nodes)
        self.nodes.append(node)
        return out

    def _atom(self, x: Any, env: Mapping[Any, Atom]) -> Atom:
        if isinstance(x, _compat.Literal):
            return Lit(x.val, x.aval)
        return env[x]

    def _inline_body(self, eqn: Any) -> Any | None:
        kind = _walk.kind(eqn)
        if kind == "jit" or _is_softmax_jvp(eqn):
            subs = _walk.bodies(eqn)
            if len(subs) != 1:
                return None
            body, consts = _compat.open_and_consts(subs[0])
            if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
                return None
            if len(body.constvars) != len(consts) or eqn.effects:
                return None
            if kind == "jit" and not self._free_of_matmuls(body):
                return None
            return subs[0]
        return None

    def _free_of_matmuls(self, jaxpr: Any) -> bool:
        key = id(jaxpr)
        if key not in self._dot_free:
            self._dot_free[key] = all(
                e.primitive.name not in _vocab.MATMULS and all(self._free_of_matmuls(b) for b in _walk.bodies(e))
                for e in _compat.open_and_consts(jaxpr)[0].eqns
            )
        return self._dot_free[key]

    def _add(self, eqn: Any, env: dict[Any, Atom], top: int, outer: Any = None) -> list[Atom]:
        ins = tuple(self._atom(x, env) for x in eqn.invars)
        body = self._inline_body(eqn)
        source = eqn.source_info
        if outer is not None:
            source = source.replace(name_stack=outer.name_stack + source.name_stack)
        if body is None:
            outs = tuple(-1 if isinstance(v, _compat.DropVar) else self._fresh(v.aval) for v in eqn.outvars)
            opaque = bool(_walk.bodies(eqn)) or _compat.hi_prim(eqn) is not None
            node = Node(eqn.primitive, dict(eqn.params), ins, outs, top, opaque or bool(eqn.effects), source)
            for o in outs:
                if o >= 0:
                    self.producer[o] = len(self.nodes)
            self.nodes.append(node)
            return list(outs)
        open_, consts = _compat.open_and_consts(body)
        inner: dict[Any, Atom] = {}
        for var, val in zip(open_.constvars, consts):
            i = self._fresh(var.aval)
            self._consts[i] = val
            inner[var] = i
        for var, atom in zip(open_.invars, ins):
            inner[var] = atom
        for e in open_.eqns:
            for var, atom in zip(e.outvars, self._add(e, inner, top, source)):
                if not isinstance(var, _compat.DropVar):
                    inner[var] = atom
        return [self._atom(v, inner) for v in open_.outvars]

    def _constness(self) -> set[int]:
        const = set(self._consts)
        for node in self.nodes:
            if node.opaque or node.name in _vocab.RANDOM:
                continue
            if all(not isinstance(a, int) or a in const for a in node.ins):
                const.update(o for o in node.outs if o >= 0)
        return const

    # --- reading ----------------------------------------------------------------------

    def node_of(self, atom: Atom) -> Node | None:
        """The node that computes `atom` (None for an input, a constant or a literal)."""
        if not isinstance(atom, int) or atom not in self.producer:
            return None
        return self.nodes[self.producer[atom]]

    def aval(self, atom: Atom) -> Any:
        return atom.aval if isinstance(atom, Lit) else self.avals[atom]

    def shape(self, atom: Atom) -> tuple[int, ...]:
        return tuple(self.aval(atom).shape)

    def is_const(self, atom: Atom) -> bool:
        return not isinstance(atom, int) or atom in self.const_ids

    def foldable(self, atom: Atom) -> bool:
        """A constant that evaluates at trace time, of at most `FOLD_LIMIT` elements
        (one whose evaluation fails is treated as traced)."""
        if not self.is_const(atom) or int(np.prod(self.shape(atom), dtype=np.int64)) > FOLD_LIMIT:
            return False
        if isinstance(atom, int) and atom in self._unfoldable:
            return False
        try:
            self.value(atom)
        except Exception:  # a primitive that does not evaluate eagerly here
            if isinstance(atom, int):
                self._unfoldable.add(atom)
            return False
        return True

    def known(self, i: int) -> bool:
        """Whether `i` has a value given to the graph (a constant of the jaxpr or a body)."""
        return i in self._consts

    def n_readers(self, i: int) -> int:
        """How many times `i` is read (by nodes, and once more if the jaxpr returns it)."""
        return len(self.readers.get(i, ())) + (i in self.outside)

    def value(self, atom: Atom) -> np.ndarray:
        """The value of a constant, evaluated at trace time (NumPy)."""
        if isinstance(atom, Lit):
            return np.asarray(atom.val, dtype=atom.aval.dtype)
        if atom not in self._values:
            if atom not in self.const_ids:
                raise ValueError(f"value {atom} depends on an input of the jaxpr")
            order = sorted(self._const_dag([atom]))
            with jax.ensure_compile_time_eval():
                for n in order:
                    node = self.nodes[n]
                    ins = [self._get(a) for a in node.ins]
                    outs = _compat.bind(node.prim, ins, node.params)
                    for o, val in zip(node.outs, outs):
                        if o >= 0:
                            self._values[o] = np.asarray(val)
        return self._get(atom)

    def _get(self, atom: Atom) -> Any:
        if isinstance(atom, Lit):
            return np.asarray(atom.val, dtype=atom.aval.dtype)
        if atom in self._consts:
            return np.asarray(self._consts[atom])
        return self._values[atom]

    def _const_dag(self, roots: Iterable[int]) -> set[int]:
        """The node indices that compute `roots` from known values (not yet evaluated)."""
        seen: set[int] = set()
        stack = [r for r in roots if r not in self._consts and r not in self._values]
        while stack:
            i = stack.pop()
            n = self.producer[i]
            if n in seen:
                continue
            seen.add(n)
            for a in self.nodes[n].ins:
                if isinstance(a, int) and a not in self._consts and a not in self._values:
                    stack.append(a)
        return seen


def evaluate(nodes: Sequence[Node], env: dict[int, Any]) -> dict[int, Any]:
    """Evaluate `nodes` (first-order, in order) on `env` (id -> value), in place."""
    for node in nodes:
        ins = [np.asarray(a.val, dtype=a.aval.dtype) if isinstance(a, Lit) else env[a] for a in node.ins]
        for o, val in zip(node.outs, _compat.bind(node.prim, ins, node.params)):
            if o >= 0:
                env[o] = val
    return env
