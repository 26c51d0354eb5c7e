"""Custom derivatives: the body and the rules of `jax.custom_jvp` / `jax.custom_vjp` in the
arriving dtypes.

`custom_jvp_call` / `custom_vjp_call` equations are rebuilt through `jax.custom_jvp` /
`jax.custom_vjp` (their pieces, and those of the hijax encodings that `autocast._hijax`
dispatches here, come through the `autocast._constructs` adapters). The body, the JVP
rule and the forward rule run in the dtypes their operands arrive in, under the same policy;
the user's `bwd` runs under the forward's policy (`custom_vjp_bwd="amp"`) or is called
with the residuals and cotangents as they arrive (`"original"`), adapted at its boundary
if it cannot take them. So `relu(x16)` stays half and saves half (or boolean) residuals.
A custom JVP whose body computes in float32 (softplus) is part of a float32 island.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _constructs, _dtypes, _plan
from ._higher_order import body_computes_in_float32, boundary_dtypes, cast_castable, current_dtypes, hi_original
from ._interpreter import Context, eval_jaxpr, original_dtypes, transform_jaxpr
from ._registry import register_higher_order


def custom_jvp_pulls(ctx: Context, eqn: Any, scopes: tuple, out32: Sequence[bool]) -> list[bool | str]:
    """The pull rule of a custom JVP call that is part of a float32 island
    (`call_computes_in_float32`: `jax.nn.softmax` under `jax_softmax_custom_jvp`,
    `softplus`): the operands its body consumes only in float32 are taken in float32, so
    their producer is computed in float32 inside the island, as for the same operations
    written out. `softmax(scores + mask)` with a float32 additive mask passed as an
    argument then adds in float32 (`finfo(float32).min` stays finite; rounded to half
    first it was `-inf`, and a fully masked row NaN). Nothing more is kept: the island is
    recomputed from the half-precision scores. Any other custom JVP call takes its
    operands as they arrive (its rule would otherwise run, and save, in float32)."""
    parts = _constructs.custom_jvp_parts(eqn)  # its body's invars: the operands, one to one
    if parts is None or not call_computes_in_float32(ctx, eqn, scopes, out32):
        return [False] * len(eqn.invars)
    # inside the island nothing is kept at the body's boundary: no input is too risky to pull
    return _plan.input_pulls(ctx.without_islands(), parts.body, scopes, out32)


def _specialised(
    ctx: Context, eqn: Any, jaxpr_like: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]
):
    """A custom-derivative body specialised to the arriving dtypes, as a function, with
    its output avals.

    The call behaves like one elementwise operation: when its float operands arrive in
    half precision, its float outputs that are not consumed only in float32 leave in that
    half dtype too (the body may compute them in float32 inside), so that the activation
    and the residuals kept for its backward pass are half precision."""
    traced_in = original_dtypes(eqn)
    in_dtypes = current_dtypes(invals, traced_in)
    floats = [(d, f) for d, f, o in zip(in_dtypes, in_free, traced_in) if _dtypes.is_castable(o)]
    deciders = [d for d, f in floats if not f] or [d for d, _ in floats]
    half = _dtypes.widest(deciders) if deciders else None
    if half == _dtypes.FLOAT32:
        half = None
    _, traced_out = boundary_dtypes(jaxpr_like)
    out_dtypes = [
        half if half is not None and _dtypes.is_castable(d) and not w else None for d, w in zip(traced_out, out32)
    ]
    new, extra, out_free = transform_jaxpr(
        ctx, jaxpr_like, in_dtypes, in_free, scopes, out_dtypes=out_dtypes, out_float32=out32
    )
    open_, consts = _compat.open_and_consts(new)
    fun = _compat.jaxpr_as_fun(_compat.close_jaxpr(open_, consts))

    def specialised(*args):
        return list(fun(*extra, *args))

    # the rebuilt custom_jvp/custom_vjp keeps the user's function name (jaxprs, explain)
    specialised.__name__ = specialised.__qualname__ = _compat.fun_name(eqn) or "specialised"
    return specialised, [v.aval for v in open_.outvars], out_free, in_dtypes


def _zero_tangent(aval: Any) -> Any:
    if _dtypes.is_floating(aval.dtype):
        return jnp.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def call_computes_in_float32(ctx: Context, eqn: Any, scopes: tuple, out32: Sequence[bool]) -> bool:
    """Whether a custom JVP call computes in float32 (softplus: `logaddexp(x, 0)`), judged
    from its body: the jaxpr JAX traced for the primal function, through nested calls. Its
    call is then recomputed in the backward pass from the half-precision primals instead of
    saving the float32 intermediates of its rule, as any other float32 island (the planner
    makes it part of one; memoised per equation).

    The JVP rule itself is never traced to decide this: it is user code that JAX runs only
    when the call is differentiated, and it may refuse to be (`eqx.nondifferentiable`
    raises when traced). A rule that computes in float32 behind a body that does not keeps
    its float32 residuals (more memory, same values)."""
    if not ctx.remat:
        return False

    def build():
        parts = _constructs.custom_jvp_parts(eqn)
        return parts is not None and body_computes_in_float32(ctx, parts.body, scopes, out32)

    return ctx.cached(("call32", scopes, tuple(map(bool, out32))), eqn, build)


def custom_jvp(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]):
    """A custom JVP (`custom_jvp_call` or `CustomJVPTraced`) rebuilt with
    `jax.custom_jvp`: the body specialised to the arriving dtypes, and a JVP rule that
    evaluates the user's rule (the jaxpr JAX traces for it) with the same policy on the
    arriving primals and tangents. Its outputs are cast to the body's output dtypes, which
    `custom_jvp` requires. A rule that computes in float32 is recomputed in the backward
    pass: a checkpoint around the call (JAX cannot linearize a checkpoint inside a custom
    JVP rule under `jax_remat3`)."""
    parts = _constructs.custom_jvp_parts(eqn)
    if parts is None:
        return hi_original(ctx, eqn, invals, in_free, scopes)
    n = parts.n_consts
    body, out_avals, out_free, _ = _specialised(ctx, eqn, parts.body, invals, in_free, scopes, out32)
    rule_ctx = ctx.without_islands()

    def rule(primals, tangents):
        tangents = list(tangents[n:])  # like JAX: constants of the body carry no tangent
        zeros = [_compat.is_zero(t) for t in tangents]
        jaxpr, consts, out_zeros = parts.rule(zeros)
        args = [*primals[parts.rule_skip :], *(t for t, z in zip(tangents, zeros) if not z)]
        rule_out32 = [*out32, *[False] * (len(jaxpr.outvars) - len(out32))]
        outs = eval_jaxpr(rule_ctx, jaxpr, consts, args, [False] * len(args), scopes, rule_out32)[0]
        k = len(out_avals)
        primals_out = [cast_castable(x, a.dtype) for x, a in zip(outs[:k], out_avals)]
        nonzero = iter(outs[k:])
        tangents_out = [
            _zero_tangent(a) if z else cast_castable(next(nonzero), a.dtype) for a, z in zip(out_avals, out_zeros)
        ]
        return primals_out, tangents_out

    call = jax.custom_jvp(body)
    call.defjvp(rule, symbolic_zeros=parts.symbolic_zeros)
    if not ctx.recomputed and call_computes_in_float32(ctx, eqn, scopes, out32):
        # not in a recomputed island: a checkpoint of its own
        return list(_compat.checkpoint(lambda *args: list(call(*args)))(*invals)), out_free
    return list(call(*invals)), out_free


register_higher_order(
    _compat.custom_jvp_call_p, pulls=custom_jvp_pulls, body="call_jaxpr", float32_call=call_computes_in_float32
)(custom_jvp)


def custom_vjp(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]):
    """A custom VJP (`custom_vjp_call` or `CustomVJPTraced`) rebuilt with
    `jax.custom_vjp`: the body and the forward rule (the jaxpr JAX traces for the user's
    `fwd`) run with the same policy in the arriving dtypes, so residuals may be half
    precision.

    The user's `bwd` runs under the forward's policy too (`ctx.custom_vjp_bwd == "amp"`,
    the default; PyTorch's `custom_bwd`): it is traced as JAX would call it (residuals and
    cotangents in their traced dtypes) and that jaxpr is evaluated with the same rules on the
    residuals and cotangents as they arrive, so a backward pass that recomputes the forward
    (`jax.vjp` inside `bwd`: diffrax's checkpointed loop) has half-precision matmuls and
    float32 reductions. With `"original"` the `bwd` is called as written on the
    residuals and cotangents as they arrive (if it raises, again on them cast to the traced
    dtypes). Either way its cotangents are cast to the dtypes the operands arrived in."""
    parts = _constructs.custom_vjp_parts(eqn)
    if parts is None:
        return hi_original(ctx, eqn, invals, in_free, scopes)
    n = parts.n_consts
    symbolic = parts.symbolic_zeros
    traced_in = original_dtypes(eqn)
    traced_out = [v.aval.dtype for v in eqn.outvars]
    body, out_avals, out_free, in_dtypes = _specialised(ctx, eqn, parts.body, invals, in_free, scopes, out32)
    traced_res: list[Any] = []

    def fwd(*args):
        vals = [a.value for a in args]
        perturbed = [bool(a.perturbed) for a in args]
        if any(perturbed[:n]):
            raise _compat.CustomVJPException()  # JAX's own error: a closed-over value is differentiated
        jaxpr, consts, input_fwds = parts.fwd(perturbed[n:])
        n_res = sum(f is None for f in input_fwds)
        out32_fwd = [*[False] * n_res, *out32]
        fwd_args = vals[parts.fwd_skip :]
        outs, _ = eval_jaxpr(ctx, jaxpr, consts, fwd_args, [False] * len(fwd_args), scopes, out32_fwd)
        res_iter, res_dt = iter(outs[:n_res]), iter(v.aval.dtype for v in jaxpr.outvars[:n_res])
        res, dts = [], []
        for f in input_fwds:
            res.append(next(res_iter) if f is None else vals[f])
            dts.append(next(res_dt) if f is None else traced_in[f])
        traced_res[:] = dts
        return [cast_castable(x, a.dtype) for x, a in zip(outs[n_res:], out_avals)], res

    def call_bwd(res, cts, res_dtypes, ct_dtypes):
        res = [cast_castable(r, d) for r, d in zip(res, res_dtypes)]
        cts = [c if _compat.is_zero(c) else cast_castable(c, d) for c, d in zip(cts, ct_dtypes)]
        return parts.bwd(res, cts)

    def bwd_rule(res, cts):
        cts = list(cts)
        if not symbolic:  # the user's rule expects dense cotangents
            cts = [_zero_tangent(a) if _compat.is_zero(c) else c for c, a in zip(cts, out_avals)]
        if ctx.custom_vjp_bwd == "amp":
            cts_in = _bwd_under_policy(ctx, parts.bwd, res, cts, traced_res, traced_out, in_dtypes[n:], scopes)
        else:
            try:
                cts_in = call_bwd(res, cts, [_dtypes.dtype_of(r) for r in res], [a.dtype for a in out_avals])
            except Exception:  # noqa: BLE001 - a rule that cannot take half precision: adapt its boundary
                cts_in = call_bwd(res, cts, traced_res, traced_out)
        out = [None if _compat.is_zero(c) or c is None else cast_castable(c, d) for c, d in zip(cts_in, in_dtypes[n:])]
        return (*[None] * n, *out)

    call = jax.custom_vjp(body)
    call.defvjp(fwd, bwd_rule, symbolic_zeros=True)
    return list(call(*invals)), out_free


def _traced_aval(x: Any, dtype: Any) -> Any:
    """The abstract value of `x` with the dtype it was traced with (float dtypes only)."""
    aval = _compat.typeof(x)
    if _dtypes.is_castable(dtype) and _dtypes.is_castable(aval.dtype):
        return _compat.aval_with_dtype(aval, dtype)
    return aval


def _bwd_under_policy(
    ctx: Context,
    bwd: Any,
    res: Sequence[Any],
    cts: Sequence[Any],
    res_dtypes: Sequence[Any],
    ct_dtypes: Sequence[Any],
    in_dtypes: Sequence[Any],
    scopes: tuple,
) -> list[Any]:
    """A custom VJP's `bwd` evaluated under the policy: traced on residuals and
    cotangents of the traced dtypes (symbolic zeros passed as they are), then re-evaluated
    with the casting rules on the values as they arrive. Returns its cotangents (None where
    it returns None or a symbolic zero)."""
    zeros = [_compat.is_zero(c) for c in cts]
    # traced values become the jaxpr's inputs; concrete ones (flags, counts, constants a
    # forward rule returns) are handed to ``bwd`` as they are, as JAX would
    values = [*res, *(c for c, z in zip(cts, zeros) if not z)]
    dtypes = [*res_dtypes, *(d for d, z in zip(ct_dtypes, zeros) if not z)]
    dynamic = [_compat.is_tracer(x) for x in values]
    avals = [_traced_aval(x, d) for x, d, t in zip(values, dtypes, dynamic) if t]
    kept: list[bool] = []

    def traced(*args):
        it = iter(args)
        vals = [next(it) if t else cast_castable(x, d) for x, d, t in zip(values, dtypes, dynamic)]
        r, rest = vals[: len(res)], iter(vals[len(res) :])
        out = bwd(r, [c if z else next(rest) for c, z in zip(cts, zeros)])
        kept[:] = [not (c is None or _compat.is_zero(c)) for c in out]
        return [c for c in out if not (c is None or _compat.is_zero(c))]

    jaxpr, consts = _compat.trace_to_jaxpr(traced, avals)
    out32 = [_dtypes.is_castable(d) and np.dtype(d) == _dtypes.FLOAT32 for d, k in zip(in_dtypes, kept) if k]
    args = [x for x, t in zip(values, dynamic) if t]
    bctx = ctx.inside_recomputed_island()  # nothing in a backward pass is saved for another
    outs, _ = eval_jaxpr(bctx, jaxpr, consts, args, [False] * len(args), scopes, out32)
    it = iter(outs)
    return [next(it) if k else None for k in kept]


register_higher_order(_compat.custom_vjp_call_p)(custom_vjp)
