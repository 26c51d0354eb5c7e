"""Planning a jaxpr's evaluation: which rule each equation gets, which equations switch
to float32 because their results are only consumed in float32, and which runs of float32
equations are rematerialisation islands."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from . import _compat, _dtypes, _registry, _rules, _walk, _wide
from ._policy import AMP_STOP
from ._steps import (  # noqa: F401  (the vocabulary, read as _plan.X across the package)
    COMMUTES_WITH_ROUNDING,
    HIGHER,
    LAYOUT,
    LINEAR,
    RULE,
    SELECTED,
    STOP,
    Plan,
    Step,
    is_linear,
)


class _Analysis(NamedTuple):
    steps: list[Step]
    island: list[bool]
    wants32: dict  # var -> consumed only in float32
    narrow: set
    selected: set  # vars read in float32 only through selections that convert them


def plan(
    ctx: Any, jaxpr: Any, scopes: tuple[str, ...], out_float32: Sequence[bool], out_narrow: Sequence[bool] | None = None
) -> Plan:
    """For each equation: how it is evaluated, with which rule, and whether it belongs to a
    float32 island (with `ctx.remat`, runs of equations that compute in float32 are
    evaluated inside `jax.checkpoint` islands: their float32 results are recomputed in the
    backward pass from the half-precision values they came from, instead of being saved).

    `use_input_precision` equations whose results are only consumed in float32 (by a
    float32-rule operation, by an operation mixing them with a float32 result, or as a
    float32 output) are switched to float32: `x - max(x)` in a softmax is then computed
    from the half-precision logits in float32 instead of being rounded to half first.

    A higher-order equation (`jit`, `scan`, `custom_jvp_call`, ...) gets a
    `HIGHER` step with its handler and: which of its outputs are consumed only in
    float32 (its bodies then compute them in float32 too), which operands its bodies consume
    only in float32 (from the primitive's pull rule; the interpreter casts those once,
    outside, and the outer plan counts the equation as a float32 consumer of them), and which
    of its outputs every consumer reads in the compute dtype (a call's body then narrows them
    where they are made: `elu`'s `jit`).

    `Plan.narrow` holds the float vars that every consumer reads in the compute dtype
    (`out_narrow`: the outputs of `jaxpr` that its caller's consumers read so), directly
    (a matmul, a convolution) or through operations that commute with rounding (`relu`,
    data movement; see `narrow_inputs`). A float32 value such a var holds (a norm's
    result) is rounded where it is made, so `relu` between a BatchNorm and a convolution
    runs, and keeps its residual, in half precision. `Plan.wide`: matmuls whose
    results only float32 operations of this jaxpr read may store a float32 result
    (`autocast._wide`) instead of rounding it to half precision for nothing.

    Args:
        ctx: The interpreter's context (its policy lookup, compute dtype and `remat`).
        jaxpr: The open jaxpr.
        scopes: The named scopes around it, outermost first.
        out_float32: Per output of `jaxpr`, whether its caller consumes it only in
            float32.
        out_narrow: Per output of `jaxpr`, whether every consumer of its caller reads it
            in the compute dtype (None: none).
    """
    a = _plan(ctx, jaxpr, scopes, out_float32, out_narrow)
    wide = _wide_matmuls(jaxpr, a.steps, a.wants32)
    return Plan(a.steps, a.island, a.narrow, wide, _bias_sums(jaxpr, a.steps), _statistics(jaxpr, a.steps))


# Elementwise primitives that XLA:GPU counts as expensive (it does not fuse them into a
# reduction's kernel, where they would be computed again): transcendental functions.
_EXPENSIVE = frozenset(
    {
        "tanh", "logistic", "erf", "erfc", "erf_inv", "exp", "exp2", "expm1", "log", "log1p",
        "pow", "sin", "cos", "tan", "atan2", "asin", "acos", "atan", "sinh", "cosh", "asinh",
        "acosh", "atanh", "lgamma", "digamma", "cbrt",
    }
)  # fmt: skip
_REDUCTIONS = ("reduce_", "cum", "argmax", "argmin", "psum", "reduce_scatter")


def _computes(eqn: Any, kind: str) -> list[str]:
    """The primitives `eqn` computes: its own, or for a call (`kind` not `RULE`) those
    of its bodies at any depth."""
    if kind == RULE:
        return [eqn.primitive.name]
    return [e.primitive.name for body in _walk.bodies(eqn) for e, *_ in _walk.walk(body)]


def _bias_sums(jaxpr: Any, steps: list) -> frozenset:
    """The `add` equations' outputs that sum a matmul's result (or data movement of one)
    with something else, where the sum feeds an expensive elementwise function (GELU's
    `tanh`, SiLU's `logistic`) and, before the next matmul, no reduction. Such a sum,
    run in float32 inside an island, gets its bias's gradient summed apart from the island's
    backward kernel (`autocast._binding._bias_into_float32`); elsewhere (a loss
    head, a softmax) that would only round the bias's cotangent for nothing."""
    made: set = set()
    for eqn, step in zip(jaxpr.eqns, steps):
        if step.kind != RULE:
            continue
        floats = [v for v in eqn.invars if not isinstance(v, _compat.Literal) and _dtypes.is_castable(v.aval.dtype)]
        if step.computes or (
            eqn.primitive.name in LAYOUT | {"convert_element_type"} and len(floats) == 1 and floats[0] in made
        ):
            made.update(v for v in eqn.outvars if _dtypes.is_castable(v.aval.dtype))
    readers = _readers(jaxpr)
    found: set = set()
    for eqn, step in zip(jaxpr.eqns, steps):
        if step.kind != RULE or eqn.primitive.name not in ("add", "add_any") or len(eqn.outvars) != 1:
            continue
        if not any(v in made for v in eqn.invars if not isinstance(v, _compat.Literal)):
            continue
        expensive, reduced, todo, seen = False, False, [eqn.outvars[0]], set()
        while todo and not reduced:
            v = todo.pop()
            for k in readers.get(v, ()):
                if k in seen:
                    continue
                seen.add(k)
                reader, rstep = jaxpr.eqns[k], steps[k]
                if rstep.computes:
                    continue  # the next matmul: its own backward pass
                names = _computes(reader, rstep.kind)  # a call (GELU under jit): what its bodies compute
                expensive = expensive or any(n in _EXPENSIVE for n in names)
                reduced = any(n.startswith(_REDUCTIONS) for n in names)
                todo.extend(reader.outvars)
        if expensive and not reduced:
            found.add(eqn.outvars[0])
    return frozenset(found)


# A sum at least this many times smaller than its operand is a statistic (`_statistics`).
# Derived, not tuned: a norm's statistics reduce a row of d features to one value (d >= 64 in
# every model of the tests, the corpus and the benchmarks), a softmax's sum a row of keys;
# a sum over a small axis (heads, a batch of 2-4) is not a statistic and is recomputed. Any
# value between those (4 < x < 64) gives the same plans on all of them; 8 is the smallest
# power of two with a factor of 2 from both ends.
_STATISTIC_FRACTION = 8


def _statistics(jaxpr: Any, steps: list) -> frozenset:
    """The outputs of the `reduce_sum` equations that a recomputed island's checkpoint
    saves instead of recomputing: sums at least `_STATISTIC_FRACTION` times smaller than
    their float operand (a few bytes per row: a layer norm's sums for its mean and
    variance), whose operand is made without an expensive elementwise function.

    Saved, the backward pass recomputes the island's elementwise work from its inputs and
    these sums, in the kernels that use it, instead of reducing over the rows a second time
    (a layer norm's backward: one kernel fewer per norm). Not a sum of an expensive function
    (a softmax's sum of `exp`): XLA:GPU computes a softmax in one kernel, but with its sum
    as a second result it writes the float32 `exp` out for the normalisation to read back
    (the compiled ViT-Base step on the H100 target: 3.0 -> 3.9 ms forward attention). Nor a
    `max`: a softmax reads it only through `stop_gradient`."""
    producer = {v: (eqn, step) for eqn, step in zip(jaxpr.eqns, steps) for v in eqn.outvars}
    cheap: set = set()  # values found made without an expensive function

    def made_cheaply(v: Any) -> bool:
        todo, seen = [v], set()
        while todo:
            u = todo.pop()
            if u in seen or u in cheap or u not in producer:
                continue  # seen, known, or an input of this jaxpr (or a literal)
            seen.add(u)
            eqn, step = producer[u]
            if step.computes:
                continue  # a matmul's result: stored anyway
            if any(n in _EXPENSIVE for n in _computes(eqn, step.kind)):
                return False
            todo.extend(x for x in eqn.invars if not isinstance(x, _compat.Literal))
        cheap.update(seen)
        return True

    found: set = set()
    for eqn, step in zip(jaxpr.eqns, steps):
        if step.kind != RULE or eqn.primitive.name != "reduce_sum" or len(eqn.invars) != 1:
            continue
        (x,), (y,) = eqn.invars, eqn.outvars
        if isinstance(y, _compat.DropVar) or not _dtypes.is_floating(y.aval.dtype):
            continue
        if y.aval.size * _STATISTIC_FRACTION > x.aval.size:
            continue
        if made_cheaply(x):
            found.add(y)
    return frozenset(found)


def _readers(jaxpr: Any) -> dict[Any, list[int]]:
    """Each variable of `jaxpr` -> the indices of the equations that read it."""
    readers: dict[Any, list[int]] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, _compat.Literal):
                readers.setdefault(v, []).append(k)
    return readers


def _wide_matmuls(jaxpr: Any, steps: list, wants32: dict) -> dict[int, set[int]]:
    consumers = _readers(jaxpr)
    outs = {v for v in jaxpr.outvars if not isinstance(v, _compat.Literal)}
    wide: dict[int, set[int]] = {}
    for i, (eqn, step) in enumerate(zip(jaxpr.eqns, steps)):
        if not step.computes or eqn.primitive.name not in _wide.BILINEAR:
            continue
        floats = [v for v in eqn.outvars if _dtypes.is_castable(v.aval.dtype) and not isinstance(v, _compat.DropVar)]
        # read in float32 by every consumer, all of them equations of this jaxpr (what a
        # caller or a nested body does with the value is not seen here)
        if floats and all(
            wants32.get(v, False) and v not in outs and all(steps[k].kind == RULE for k in consumers.get(v, ()))
            for v in floats
        ):
            wide[i] = {k for v in floats for k in consumers.get(v, ())}
    return wide


def _plan(
    ctx: Any, jaxpr: Any, scopes: tuple[str, ...], out_float32: Sequence[bool], out_narrow: Sequence[bool] | None = None
) -> _Analysis:
    steps: list[Step] = []
    f32_made: set = set()  # vars computed in float32 by a float32 rule (or derived from one)
    for eqn in jaxpr.eqns:
        eqn_scopes = scopes + _compat.scope_names(eqn.source_info.name_stack)
        if AMP_STOP in eqn_scopes:
            steps.append(Step(STOP))
            continue
        handler = None if ctx.lookup.explicit(eqn.primitive) else _registry.handler_for(eqn)
        if handler is not None:
            steps.append(Step(HIGHER, handler=handler))
            continue
        rule = ctx.lookup.rule(eqn.primitive, eqn_scopes)
        steps.append(Step(RULE, rule))
        ins = [v for v in eqn.invars if not isinstance(v, _compat.Literal)]
        if rule.role == "float32" or (rule.role == "input" and any(v in f32_made for v in ins)):
            f32_made.update(v for v in eqn.outvars if _dtypes.is_castable(v.aval.dtype))

    # Backward: which float vars are consumed only in float32; and which of those a slice or
    # a gather that converts them itself reads (`selected`: they stay in the dtype they
    # arrive in, and so does data movement that only leads to such readers).
    wants32: dict[Any, bool] = {}
    selected: set = set()
    for v, is32 in zip(jaxpr.outvars, out_float32):
        if not isinstance(v, _compat.Literal):
            wants32[v] = wants32.get(v, True) and bool(is32)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn, step = jaxpr.eqns[i], steps[i]
        kind, rule = step.kind, step.rule
        pulls = False
        if kind == HIGHER:
            out32 = [isinstance(v, _compat.DropVar) or wants32.get(v, False) for v in eqn.outvars]
            pull_rule = _registry.PULL_RULES.get(eqn.primitive)
            eqn_scopes = scopes + _compat.scope_names(eqn.source_info.name_stack)
            flags = list(pull_rule(ctx, eqn, eqn_scopes, out32)) if pull_rule is not None else [False] * len(eqn.invars)
            steps[i] = step._replace(out_float32=out32, pulls=flags)
            for v, flag in zip(eqn.invars, flags):
                if not isinstance(v, _compat.Literal) and _dtypes.is_castable(v.aval.dtype):
                    wants32[v] = wants32.get(v, True) and bool(flag)
                    if flag == SELECTED:
                        selected.add(v)
            continue
        if kind == RULE and rule.role == "float32":
            pulls = True
        elif kind == RULE and rule.role == "input":
            float_outs = [v for v in eqn.outvars if _dtypes.is_castable(v.aval.dtype)]
            # (a `select_n` is exact in any dtype: it stays in the dtype its operands arrive
            # in and its float32 readers cast its result, so a `where` on a half activation
            # before `expm1` (`elu`) hands a half value, not a float32 copy, to the island)
            if float_outs and all(wants32.get(v, False) for v in float_outs) and eqn.primitive.name != "select_n":
                # (a slice or a gather that reads each element once takes a half operand
                # as it arrives and converts it itself, `_rules.select_in_float32`; data
                # movement on the way to one gains nothing in float32 and stays as it is)
                pulls = True
                passes_on = (
                    eqn.primitive.name in LAYOUT and len(eqn.invars) == 1 and any(v in selected for v in float_outs)
                )
                if reads_each_once(eqn):
                    steps[i] = Step(RULE, _rules.select_in_float32)
                elif not passes_on:
                    steps[i] = Step(RULE, _rules.use_float32_precision)
                if steps[i].rule is not _rules.use_float32_precision and not isinstance(eqn.invars[0], _compat.Literal):
                    selected.add(eqn.invars[0])  # (not a broadcast literal: nothing to hand over)
            elif any(v in f32_made for v in eqn.invars if not isinstance(v, _compat.Literal)):
                pulls = True  # mixes with a float32 result: runs in float32 anyway
        for v in eqn.invars:
            if isinstance(v, _compat.Literal) or not _dtypes.is_castable(v.aval.dtype):
                continue
            wants32[v] = wants32.get(v, True) and pulls

    narrow = _narrowed(ctx, jaxpr, steps, scopes, out_narrow) if ctx.compute_dtype != _dtypes.FLOAT32 else set()
    for i, (eqn, step) in enumerate(zip(jaxpr.eqns, steps)):
        if step.kind == HIGHER:
            steps[i] = step._replace(out_narrow=[v in narrow for v in eqn.outvars])

    # Forward again: which equations compute in float32 (rematerialisation islands).
    island, alone = _islands(ctx, jaxpr, steps, scopes, narrow)
    if alone:
        island, _ = _islands(ctx, jaxpr, steps, scopes, narrow, frozenset(alone))
    return _Analysis(steps, island, wants32, narrow, selected)


def reads_each_once(eqn: Any) -> bool:
    """Whether `eqn` only selects a part of its operand, reading each element at most once
    (a slice; a gather with unique indices or a single index tuple per batch element:
    `take_along_axis` of one label per row): it commutes with any rounding and its
    transpose writes each cotangent element once, summing nothing."""
    name = eqn.primitive.name
    if name in ("slice", "dynamic_slice"):
        return True
    if name != "gather":
        return False
    dnums, indices = eqn.params["dimension_numbers"], eqn.invars[1].aval
    if eqn.params.get("unique_indices", False) and all(
        eqn.params["slice_sizes"][d] == 1 for d in dnums.start_index_map
    ):
        return True  # (unique start indices of windows wider than 1 may still overlap)
    batching = set(getattr(dnums, "start_indices_batching_dims", ()))
    per_batch = 1
    for d in range(indices.ndim - 1):  # the last dimension holds the index vectors
        if d not in batching:
            per_batch *= indices.shape[d]
    return per_batch == 1


def _islands(
    ctx: Any, jaxpr: Any, steps: list, scopes: tuple[str, ...], narrow: set, alone: frozenset = frozenset()
) -> tuple[list[bool], list[int]]:
    """Which equations are part of a float32 island; and the float32-only `jit` calls
    (`_higher_order._float32_only_call`) that joined an island by themselves but are left
    out (`alone`) when the planner asks again: those that share no operand with it (the
    island would save nothing by recomputing them), and those whose island a much wider
    matmul reads (`_widens`). `jnp.var`'s `_var` in a layer norm reads the
    activation that the norm's mean and normalisation read: it joins."""
    island = [False] * len(steps)
    by_itself: list[int] = []
    if not ctx.remat:
        return island, by_itself
    f32: set = set()
    for i, (eqn, step) in enumerate(zip(jaxpr.eqns, steps)):
        kind, role = step.kind, step.role()
        if eqn.effects or kind == STOP:  # callbacks and other effects cannot be rematerialised
            continue
        ins = [v for v in eqn.invars if not isinstance(v, _compat.Literal)]
        outs32 = any(v.aval.dtype == _dtypes.FLOAT32 for v in eqn.outvars)
        if kind == HIGHER:
            # a call fed by the island (relu after a norm) joins it: its own residuals
            # (relu's zeros_like, a float32 activation) are recomputed too; so does a
            # call that computes in float32 itself (softplus's custom JVP rule)
            eqn_scopes = scopes + _compat.scope_names(eqn.source_info.name_stack)
            fed = any(v in f32 for v in ins) and _registry.narrow_body(eqn) is not None
            own = i not in alone and _registry.computes_in_float32(ctx, eqn, eqn_scopes, step.out_float32)
            joins = fed or own
            if own and not fed and eqn.primitive in (_compat.jit_p, _compat.closed_call_p):
                by_itself.append(i)
        else:
            joins = (
                role == "float32"
                or (role in ("input", "widest", "select_float32") and any(v in f32 for v in ins))
                or (role == "original" and outs32)
            )
        if joins:
            island[i] = True
            f32.update(v for v in eqn.outvars if _dtypes.is_castable(v.aval.dtype) and v not in narrow)
    _selections_join(jaxpr, steps, island)
    read_by_island: dict[Any, set[int]] = {}
    for j, eqn in enumerate(jaxpr.eqns):
        if island[j]:
            for v in eqn.invars:
                if not isinstance(v, _compat.Literal):
                    read_by_island.setdefault(v, set()).add(j)
    shares = lambda i: any(  # noqa: E731
        read_by_island.get(v, set()) - {i}
        for v in jaxpr.eqns[i].invars
        if not isinstance(v, _compat.Literal) and _dtypes.is_castable(v.aval.dtype)
    )
    return island, [i for i in by_itself if not shares(i) or _widens(jaxpr, steps, island, i)]


def _selections_join(jaxpr: Any, steps: list, island: list[bool]) -> None:
    """A slice or gather that converts a half-precision operand itself
    (`_rules.select_in_float32`) joins the island that every one of its readers is part of:
    the island's checkpoint then keeps the half-precision operand, not the float32
    selection, and a matmul that feeds the island through it keeps its half-precision result.
    Gemma's GeGLU, `gelu(h[..., 0, :]) * h[..., 1, :]`: without this, the gate's halves
    were kept in float32 (22 % more residual bytes on the corpus's Gemma 3)."""
    readers = _readers(jaxpr)
    outs = {v for v in jaxpr.outvars if not isinstance(v, _compat.Literal)}
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        step = steps[i]
        if island[i] or step.kind != RULE or step.rule is not _rules.select_in_float32:
            continue
        floats = [v for v in jaxpr.eqns[i].outvars if _dtypes.is_castable(v.aval.dtype)]
        if floats and all(v not in outs and readers.get(v) and all(island[k] for k in readers[v]) for v in floats):
            island[i] = True


# A float32-only call stays out of an island whose result a matmul reads into an output this
# many times larger than the call's input (an LM head's logits after the final layer norm).
# Measured (`_widens`), with a known limit: in-block matmuls read a norm into outputs 3x
# (QKV), 4x (MLP), up to 8x (Gemma's GeGLU) wider and join; GPT-2's head is 65x, Gemma's 125x.
# A head under 8x (Llama-2-7B: 32000 / 4096 = 7.8x) joins its island, and its logits-sized
# buffer shows in the GPU peak as GPT-2's did (16.7 -> 19.9 GiB at x4, H100 target, 2026-11-25).
_WIDENING = 8


def _widens(jaxpr: Any, steps: list, island: list[bool], i: int) -> bool:
    """Whether the island around equation `i` is read by a compute-rule equation (a
    matmul) whose float result is more than `_WIDENING` times the largest float operand
    of equation `i`. Measured, not derived: with GPT-2's final layer norm's `_var` in the
    island under its tied LM head, XLA:GPU's peak at batch x4 rose by a logits-sized buffer
    (16.7 -> 19.9 GiB); every layer norm inside the blocks (read by 3x and 4x wider matmuls)
    gains from joining."""
    a, b = i, i + 1
    while a > 0 and island[a - 1]:
        a -= 1
    while b < len(island) and island[b]:
        b += 1
    made = {v for eqn in jaxpr.eqns[a:b] for v in eqn.outvars}
    size = max((v.aval.size for v in jaxpr.eqns[i].invars if not isinstance(v, _compat.Literal)), default=0)
    for eqn, step in zip(jaxpr.eqns[b:], steps[b:]):
        if step.computes and any(v in made for v in eqn.invars):
            if any(v.aval.size > _WIDENING * size for v in eqn.outvars):
                return True
    return False


def _narrowed(ctx: Any, jaxpr: Any, steps: list, scopes: tuple[str, ...], out_narrow: Sequence[bool] | None) -> set:
    """The float vars whose every consumer reads them in the compute dtype (see `plan`)."""
    ok: dict[Any, bool] = {}
    for v, n in zip(jaxpr.outvars, out_narrow or [False] * len(jaxpr.outvars)):
        if not isinstance(v, _compat.Literal):
            ok[v] = ok.get(v, True) and bool(n)
    for eqn, step in zip(reversed(jaxpr.eqns), reversed(steps)):
        outs_ok = all(
            isinstance(v, _compat.DropVar) or ok.get(v, False) for v in eqn.outvars if _dtypes.is_castable(v.aval.dtype)
        )
        if step.computes:
            flags = [True] * len(eqn.invars)
        elif step.role() == "input" and eqn.primitive.name in COMMUTES_WITH_ROUNDING:
            flags = [outs_ok] * len(eqn.invars)
        elif (body := _registry.narrow_body(eqn)) is not None:  # a call, or a rewrite's span
            out_n = [isinstance(v, _compat.DropVar) or ok.get(v, False) for v in eqn.outvars]
            eqn_scopes = scopes + _compat.scope_names(eqn.source_info.name_stack)
            flags = narrow_inputs(ctx, body, eqn_scopes, out_n)
        else:
            flags = [False] * len(eqn.invars)
        for v, flag in zip(eqn.invars, flags):
            if not isinstance(v, _compat.Literal) and _dtypes.is_castable(v.aval.dtype):
                ok[v] = ok.get(v, True) and flag
    return {v for v, flag in ok.items() if flag}


def narrow_inputs(ctx: Any, jaxpr_like: Any, scopes: tuple[str, ...], out_narrow: Sequence[bool]) -> list[bool]:
    """Which inputs of a sub-jaxpr (whose invars are its equation's operands, one to one)
    reach half-precision consumers only through operations that commute with rounding,
    given which of its outputs do; memoised per jaxpr. `relu`'s `custom_jvp` body
    (`max(x, 0)`) passes its input on: a float32 value fed to `relu` and then to a
    convolution is rounded before the `relu`."""

    def build():
        open_, _ = _compat.open_and_consts(jaxpr_like)
        out32 = [False] * len(open_.outvars)
        narrow = _plan(ctx, open_, scopes, out32, out_narrow).narrow
        outs = {v for v in open_.outvars if not isinstance(v, _compat.Literal)}
        return [v in narrow and v not in outs for v in open_.invars]

    return list(ctx.cached(("narrow", scopes, tuple(bool(f) for f in out_narrow)), jaxpr_like, build))


# Equations whose backward pass does not need their float operands (linear in them, with
# integer indices at most): handing them a float32 value stores nothing more.
_NO_RESIDUAL = LINEAR | {"gather", "dynamic_update_slice"}


def input_pulls(ctx: Any, jaxpr_like: Any, scopes: tuple[str, ...], out_float32: Sequence[bool]) -> list[bool | str]:
    """Which inputs of a (closed or open) sub-jaxpr are consumed only in float32, given
    which of its outputs are; memoised per jaxpr. A flag is True (cast it outside), False,
    or `SELECTED` (read in float32 only through selections that convert it: hand it
    over as it arrives).

    With `ctx.remat` an input counts only if nothing inside the body would have to keep
    it, or a value derived from it, in float32 for the backward pass: it may flow through
    data movement and linear operations (`gather`, slices, additions, ...) to the body's
    outputs or into nested bodies that pull it, but not into a non-linear operation (a
    float32 island would then store the float32 value instead of the half-precision one;
    such inputs stay half and are cast inside the body's island). `x - mean(x)` followed
    by a square (a variance) keeps `x` half; the label gather of a cross-entropy takes
    the logits as they arrive (`SELECTED`).
    """

    def build():
        open_, _ = _compat.open_and_consts(jaxpr_like)
        a = _plan(ctx, open_, scopes, out_float32)
        wants32, selected = a.wants32, a.selected
        risky: set = set()  # vars whose float32 value a non-linear operation would keep
        for eqn, step in reversed(list(zip(open_.eqns, a.steps))):
            outs_risky = any(v in risky for v in eqn.outvars)
            for pos, v in enumerate(eqn.invars):
                if isinstance(v, _compat.Literal):
                    continue
                if step.kind == HIGHER:
                    ok = step.pulls[pos]
                else:
                    ok = (eqn.primitive.name in _NO_RESIDUAL or is_linear(eqn)) and not outs_risky
                if not ok:
                    risky.add(v)
        out_set = {v for v in open_.outvars if not isinstance(v, _compat.Literal)}
        flags = []
        for v in open_.invars:
            wanted = _dtypes.is_castable(v.aval.dtype) and v not in out_set and wants32.get(v, False)
            if wanted and v in selected:
                flags.append(SELECTED)
            else:
                flags.append(bool(wanted and (not ctx.remat or v not in risky)))
        return flags

    return list(ctx.cached(("pulls", scopes, tuple(bool(f) for f in out_float32)), jaxpr_like, build))
