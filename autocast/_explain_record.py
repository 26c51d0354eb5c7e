"""What `autocast.explain` observes while amp transforms a function: one record per equation
(the rule, why it applies, operand dtypes before and after, the island it belongs to, the
float8 decision), gathered by an observer the interpreter calls around each equation."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from . import _dtypes, _fp8, _plan, _rules, _walk
from ._binding import rule_name as _rule_name
from ._interpreter import Context
from ._interpreter import Observer as _NoOpObserver
from ._policy import CATEGORIES


@dataclasses.dataclass(frozen=True)
class Float32Matmul:
    """A `dot_general` / `conv_general_dilated` that does not run in the compute dtype."""

    primitive: str
    shape: tuple[tuple[int, ...], ...]
    """The operand shapes."""
    dtype: str
    """The operand dtypes it runs with (after its rule)."""
    reason: str
    scopes: tuple[str, ...]
    path: tuple[str, ...]
    """The higher-order primitives it is nested in, outermost first (`("jit(block)", "scan(4)")`)."""
    source: str
    """`"path/to/file.py:LINE"`: the user line that traced it."""


@dataclasses.dataclass(frozen=True)
class Float8Matmul:
    """A `dot_general` that runs as a scaled float8 product (policy `"fp8"`)."""

    shape: tuple[tuple[int, ...], ...]
    """The operand shapes."""
    count: int
    """How many times it runs (loop trip counts multiplied in)."""
    bytes_saved: int
    """Bytes the backward pass's residuals shrink by: its operands kept in float8 instead of
    the compute dtype (an operand the backward quantizes again, a parameter or a value a
    checkpoint recomputes, is kept as it is: 0)."""
    scopes: tuple[str, ...]
    path: tuple[str, ...]
    source: str
    reason: str = ""
    """Why the float8 rule ran it in float8, or (`Explanation.float8_declined`) why not:
    its GEMM sizes against `min_dim`, its operands, or the roofline of its target GPU."""


@dataclasses.dataclass(frozen=True)
class Record:
    primitive: str
    rule: str
    why: str
    scopes: tuple[str, ...]
    path: tuple[str, ...]
    mult: int
    before: tuple[str, ...]
    after: tuple[str, ...]
    result: tuple[str, ...]
    island: Any
    source: str
    shapes: tuple[tuple[int, ...], ...]
    eqn_id: int = 0
    float8: bool = False
    float8_kept: tuple[bool, ...] = ()  # per operand: its float8 copy kept for the backward
    float8_why: str = ""  # what the float8 rule decided for this matmul, and why
    site: tuple[int, ...] = ()
    """ids of the enclosing higher-order equations: one call site of a body."""


class Observer(_NoOpObserver):
    """Collects one `Record` per equation the interpreter evaluates (see
    `autocast._interpreter.Observer`, whose no-op methods it overrides); keeps the stack of
    enclosing higher-order equations."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        # each policy category's rule -> its name (read from the table features add to when
        # explain runs), and the planner's `select_in_float32` -> "float32"
        self.rule_names = {rule: name for name, rule in CATEGORIES.items()} | {_rules.select_in_float32: "float32"}
        self.stack: list[Any] = []
        self.starts: list[int] = []
        self.records: list[Record] = []
        # ids of the equations a float8 rule bound in float8 (`_fp8._Float8Rule.bind`)
        # id(eqn) -> per operand, whether the backward pass quantizes it again (see _fp8)
        self.float8_eqns: dict[int, tuple[bool, ...]] = {}
        # id(eqn) -> the float8 rule's reason for binding it in float8 or not
        self.float8_why: dict[int, str] = {}
        # rewrite name -> each span it found: (what it is, what amp does with it)
        self.rewrites: dict[str, list[tuple[str, str]]] = {}
        # off once the program is transformed: rules JAX traces later (`jax.vjp` in `_explain`)
        # run in copies of the context that still hold this observer
        self.active = True

    def enter(self, eqn: Any) -> None:
        if not self.active:
            return
        self.stack.append(eqn)
        self.starts.append(len(self.records))

    def rewrite(self, name: str, what: str, how: str) -> None:
        self.rewrites.setdefault(name, []).append((what, how))

    def float8(self, eqn: Any, why: str, requantize: tuple[bool, ...] | None) -> None:
        self.float8_why[id(eqn)] = why
        if requantize is not None:
            self.float8_eqns[id(eqn)] = requantize

    def exit(self, eqn, kind, rule, scopes, arrived, bound, outs, island) -> None:
        if not self.active:
            return
        self.stack.pop()
        start = self.starts.pop()
        if kind == _plan.HIGHER:
            # a body traced again (a cond's branches or a scan's carry to agree on dtypes, a
            # custom rule's primal): keep the last trace of each equation at each call site
            body = self.records[start:]
            last = {(r.eqn_id, r.site): i for i, r in enumerate(body)}
            self.records[start:] = [r for i, r in enumerate(body) if last[(r.eqn_id, r.site)] == i]
            return
        path = tuple(_walk.label(e) for e in self.stack)
        mult = int(np.prod([_walk.multiplier(e) for e in self.stack], dtype=np.int64))
        if kind == _plan.STOP:  # bound as traced (the interpreter casts inside _bind_original)
            if _walk.bodies(eqn):  # a jit/scan/... inside amp_stop: its body runs as traced
                site = (*(id(e) for e in self.stack), id(eqn))
                for sub in _walk.bodies(eqn):
                    for k, (e, sc, p, m) in enumerate(
                        _walk.walk(sub, tuple(scopes), (*path, _walk.label(eqn)), mult * _walk.multiplier(eqn))
                    ):
                        avals = [v.aval for v in e.invars]
                        self._add(e, "original", "amp_stop", sc, p, m, avals, avals, [v.aval for v in e.outvars], None)
                        # each equation of the walk is its own site (a body may call one function twice)
                        self.records[-1] = dataclasses.replace(self.records[-1], site=(*site, id(sub), k))
                return
            avals = [v.aval for v in eqn.invars]
            self._add(eqn, "original", "amp_stop", scopes, path, mult, arrived, avals, outs, island)
            return
        rule_name = self.rule_names.get(rule) or _rule_name(rule)
        looked, why = self.ctx.lookup.rule_and_reason(eqn.primitive, scopes)
        if rule in (_rules.use_float32_precision, _rules.select_in_float32) and looked is not rule:
            why = "pulled to float32 by its consumers"
        if rule is _rules.select_in_float32 and _dtype(arrived[0]) != _dtypes.FLOAT32:
            why += "; selects from its own float32 conversion, cotangent in half"
        self._add(eqn, rule_name, why, scopes, path, mult, arrived, bound, outs, island)

    def _add(self, eqn, rule_name, why, scopes, path, mult, arrived, bound, outs, island) -> None:
        if island is not None:
            why += "; island, recomputed" if island[1] else "; island"
        float8 = id(eqn) in self.float8_eqns
        float8_why = self.float8_why.get(id(eqn), "")
        if float8_why and not float8:
            why += "; not float8"
        if float8:
            why += "; float8"
            bound = [jax.ShapeDtypeStruct(np.shape(x), _fp8.E4M3) for x in bound]
        self.records.append(
            Record(
                primitive=eqn.primitive.name,
                rule=rule_name,
                why=why,
                scopes=tuple(scopes),
                path=tuple(path),
                mult=int(mult),
                before=tuple(_walk.dtype_name(_dtype(x)) for x in arrived),
                after=tuple(_walk.dtype_name(_dtype(x)) for x in bound),
                result=tuple(_walk.dtype_name(_dtype(x)) for x in outs),
                island=island,
                source=_walk.source(eqn.source_info),
                shapes=tuple(tuple(getattr(x, "shape", np.shape(x))) for x in bound),
                eqn_id=id(eqn),
                float8=float8,
                float8_kept=tuple(not r for r in self.float8_eqns.get(id(eqn), ())),
                float8_why=float8_why,
                site=tuple(id(e) for e in self.stack),
            )
        )


def _dtype(x: Any) -> Any:
    dtype = getattr(x, "dtype", None)  # arrays, tracers and avals
    if dtype is not None:
        return dtype
    try:
        return _dtypes.dtype_of(x)
    except TypeError:
        return getattr(getattr(x, "aval", None), "dtype", "?")


class ExplainContext(Context):
    """A context that re-transforms every body at every call site (no cache), so each
    call of a nested `jit` is observed and counted."""

    def cached(self, key, jaxpr_like, build):
        return build()


def runs(names: tuple[str, ...]) -> str:
    """`("f16", "f16", "f32")` -> `"f16×2 f32"`."""
    if not names:
        return "-"
    parts: list[list[Any]] = []
    for n in names:
        if parts and parts[-1][0] == n:
            parts[-1][1] += 1
        else:
            parts.append([n, 1])
    return " ".join(n if c == 1 else f"{n}×{c}" for n, c in parts)
