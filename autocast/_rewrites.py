"""Whole-program rewrites: the one door through which a feature replaces spans of a jaxpr by
one equation of its own before amp plans it (the fused attention, `autocast._attention`).

Like the table of higher-order handlers (`autocast._registry`), this module holds a table
that feature modules fill at import, with one `register_rewrite` call each, and the code
that applies it; the interpreter calls `rewrite` on every jaxpr it evaluates and imports no
feature. A rewrite declares:

- `primitive`: the equation each span becomes. Its parameters are what `prepare` returned,
  plus `body` (the span's equations as a closed jaxpr, whose inputs are the span's inputs
  and then the other variables it reads) and `scopes` (the named scopes around the jaxpr);
- `rule`: the rule that binds that equation (`Rule.bind`), and the rule the policy must
  give `primitive` under the span's named scopes for the span to be rewritten: a policy
  maps a scope to another rule of `primitive` (a category such as `xla_attention`) to keep
  the spans in it as written;
- `find(jaxpr, consts, compute_dtype)`: the spans the rewrite proved (`Span`) and what it
  saw but leaves alone, with the reason (`Kept`);
- `prepare(span, setting)`: the parameters of the new equation, or a string saying why the
  span stays as written (no kernel for it on this machine; too small to pay). `setting` is
  amp's option of the rewrite's name (`amp(loss_head=4)`: `Context.rewrite_settings`), or
  None.

A span is also kept as written, whatever `find` said, if an equation of it has an effect,
if it is inside `amp_stop`, if the policy does not give `primitive` the rewrite's `rule`, or
if the rewrite is off for this transformation (`Context.rewrites_off`: `amp(attention="xla")`).
`autocast.explain` lists each span under the rewrite's `name` (the observer's `rewrite`
method): what was kept and why, here; what a rewritten span became, by its rule when it binds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import _compat, _rules

__all__ = [
    "REWRITES",
    "AsWritten",
    "Kept",
    "Rewrite",
    "Span",
    "primitives_by_name",
    "recomputable_primitives",
    "register_rewrite",
    "rewrite",
    "span_primitive",
]


def span_primitive(name: str, doc: str = "") -> Any:
    """The primitive a rewrite's spans become: its equation holds the span as written
    (`body`, plus the rewrite's own parameters), which its evaluation, abstract evaluation
    and lowering run; the rewrite's rule binds something else in its place."""
    prim = _compat.Primitive(name)
    prim.multiple_results = True

    def impl(*args: Any, body: Any, **params: Any) -> list[Any]:
        return _compat.jaxpr_as_fun(body)(*args)

    def abstract_eval(*avals: Any, body: Any, **params: Any) -> list[Any]:
        open_, _ = _compat.open_and_consts(body)
        return [v.aval for v in open_.outvars]

    prim.def_impl(impl)
    prim.def_abstract_eval(abstract_eval)
    _compat.register_lowering(prim, _compat.lower_fun(impl, multiple_results=True))
    return prim


class AsWritten(_rules.Rule):
    """The rule of a policy category that keeps a rewrite's spans as written (`xla_attention`,
    `xla_loss_head`): map a named scope to it and the spans in it are not rewritten; the
    scope's other equations keep their own rules."""

    role: _rules.Role = "opaque"

    def __init__(self, name: str, primitive: Any):
        self.name = name
        self.primitives = frozenset({primitive.name})

    def cast(self, compute_dtype, original_dtypes, invars, params, free):
        return list(invars), params


@dataclasses.dataclass(frozen=True)
class Span:
    """A span of equations a rewrite's finder proved.

    Attributes:
        eqns: The indices of the span's equations in the jaxpr, in order (the new equation
            takes the place of the last).
        inputs: The variables the new equation reads first (its body reads these, then the
            other variables of the jaxpr the span's equations read).
        outputs: The variables it makes (read after the span).
        what: What the span is, for `explain`.
        found: What the finder learned (the attention's `Match`), for `prepare`.
    """

    eqns: tuple[int, ...]
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    what: str
    found: Any = None


@dataclasses.dataclass(frozen=True)
class Kept:
    """Something a rewrite's finder saw and leaves as written (`what`), and why (`why`)."""

    what: str
    why: str


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """One registered rewrite (see the module docstring and `register_rewrite`)."""

    name: str
    primitive: Any
    find: Callable[[Any, Sequence[Any], Any], Sequence[Span | Kept]]
    rule: _rules.Rule
    prepare: Callable[[Span, Any], Mapping[str, Any] | str]
    recomputable: bool = False


REWRITES: dict[str, Rewrite] = {}
"""Name -> rewrite, in the order they were registered (and are applied)."""


def register_rewrite(
    name: str,
    primitive: Any,
    find: Callable[[Any, Sequence[Any], Any], Sequence[Span | Kept]],
    rule: _rules.Rule,
    prepare: Callable[[Span, Any], Mapping[str, Any] | str] | None = None,
    recomputable: bool = False,
) -> Rewrite:
    """Declare a whole-program rewrite (once, at its module's import).

    Args:
        name: Its name: the key of `Context.rewrites_off` and of `explain`'s entries.
        primitive: The primitive of the equation each span becomes (a policy file may name
            it: `autocast._policy` resolves the names of registered rewrites' primitives).
        find: `find(jaxpr, consts, compute_dtype)`: the spans (`Span`) and what is left
            alone (`Kept`) in an open jaxpr's top-level equations.
        rule: The rule that binds the new equation, and that the policy must give
            `primitive` for a span to be rewritten.
        prepare: `prepare(span, setting)`: the new equation's parameters, or why the span
            stays as written (None: the parameters are `{"found": span.found}`); `setting`
            is amp's option named `name` (`Context.rewrite_settings`), or None.
        recomputable: Whether the rule binds the equation so that, inside an autocast
            checkpoint (`RuleContext.recomputed`), the backward pass may recompute it from
            its inputs as it recomputes a float32 island (the fused attention). With
            `remat_float32="matmuls"` such an equation joins the checkpoint of the island
            whose matmuls feed it (`autocast._islands.chain_end`).

    Returns:
        The `Rewrite`.

    Raises:
        ValueError: Another rewrite of that name, or of that primitive, is registered.
    """
    rewrite_ = Rewrite(
        name, primitive, find, rule, prepare or (lambda span, setting: {"found": span.found}), recomputable
    )
    for other in REWRITES.values():
        if other.name == name or other.primitive is primitive:
            raise ValueError(f"register_rewrite({name!r}): {other.name!r} is registered for it already.")
    REWRITES[name] = rewrite_
    return rewrite_


def primitives_by_name() -> dict[str, list[Any]]:
    """The registered rewrites' primitives by name (the names a policy file may use)."""
    return {r.primitive.name: [r.primitive] for r in REWRITES.values()}


def recomputable_primitives() -> frozenset[str]:
    """The names of the registered rewrites' primitives declared `recomputable`."""
    return frozenset(r.primitive.name for r in REWRITES.values() if r.recomputable)


def rewrite(ctx: Any, jaxpr: Any, consts: Sequence[Any], scopes: tuple[str, ...]) -> Any:
    """`jaxpr` (open) with each span a registered rewrite proves, and may rewrite here,
    replaced by one equation of its primitive (`jaxpr` itself where there is none).

    Args:
        ctx: The interpreter's context (`compute_dtype`, `lookup`, `observer`,
            `rewrites_off`, `rewrite_settings`).
        jaxpr: The open jaxpr amp is about to plan.
        consts: The values of its constants (a finder may evaluate constant masks).
        scopes: The named scopes around it, outermost first.

    Returns:
        The jaxpr to plan and evaluate.
    """
    for rw in REWRITES.values():
        if rw.name not in ctx.rewrites_off:
            jaxpr = _apply(ctx, rw, jaxpr, consts, scopes)
    return jaxpr


def _apply(ctx: Any, rw: Rewrite, jaxpr: Any, consts: Sequence[Any], scopes: tuple[str, ...]) -> Any:
    found = rw.find(jaxpr, consts, ctx.compute_dtype)
    if not found:
        return jaxpr
    eqns = list(jaxpr.eqns)
    replaced: dict[int, Any] = {}
    for s in found:
        if isinstance(s, Kept):
            ctx.observer.rewrite(rw.name, s.what, s.why)
            continue
        span = [eqns[i] for i in s.eqns]
        span_scopes = [scopes + _compat.scope_names(e.source_info.name_stack) for e in span]
        rule = ctx.lookup.rule(rw.primitive, span_scopes[-1])
        params: Mapping[str, Any] | str
        if any(e.effects for e in span):
            params = "an effect in the span"
        elif any(ctx.lookup.stopped(sc) for sc in span_scopes) or rule is not rw.rule:
            params = f"the policy ({rule.name})"
        else:
            params = rw.prepare(s, ctx.rewrite_settings.get(rw.name))
        if isinstance(params, str):
            ctx.observer.rewrite(rw.name, s.what, f"as written: {params}")
            continue
        inputs = list(s.inputs) + _free_vars(span, s.inputs)
        body = _compat.jaxpr_of(inputs, s.outputs, span)
        params = {**params, "body": body, "scopes": scopes}
        replaced[s.eqns[-1]] = _compat.new_eqn(inputs, s.outputs, rw.primitive, params, span[-1].source_info)
        for i in s.eqns[:-1]:
            replaced[i] = None
    if not replaced:
        return jaxpr
    new = [replaced.get(i, e) for i, e in enumerate(eqns) if replaced.get(i, e) is not None]
    return _compat.with_eqns(jaxpr, _in_order(new))


def _in_order(eqns: Sequence[Any]) -> list[Any]:
    """`eqns` with each equation after the ones that make what it reads, otherwise as they
    were: a span's equation takes the place of its last equation, and an equation written
    between the span's first and last that reads what the span returns moves after it (the
    loss's mean, computed before an accuracy that reads the logits)."""
    made = {v for e in eqns for v in e.outvars}
    ready: set[Any] = set()
    out: list[Any] = []
    waiting: list[Any] = []

    def can(e: Any) -> bool:
        return all(isinstance(v, _compat.Literal) or v not in made or v in ready for v in e.invars)

    for e in eqns:
        if not can(e):
            waiting.append(e)
            continue
        out.append(e)
        ready.update(e.outvars)
        progress = True
        while progress and waiting:
            progress = False
            for w in list(waiting):
                if can(w):
                    waiting.remove(w)
                    out.append(w)
                    ready.update(w.outvars)
                    progress = True
    assert not waiting, "a rewritten jaxpr with a cycle"
    return out


def _free_vars(span: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """The variables the span's equations read that neither the span makes nor `inputs`
    holds (constants of the jaxpr the finder folded into what it found): its body takes them."""
    made = {v for e in span for v in e.outvars}
    have = set(inputs)
    out: list[Any] = []
    for e in span:
        for v in e.invars:
            if not isinstance(v, _compat.Literal) and v not in made and v not in have:
                have.add(v)
                out.append(v)
    return out
