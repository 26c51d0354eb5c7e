"""Transforming the bodies of primitives that hold jaxprs.

Each handler registers into the table of :mod:`autocast._registry` at import (like JAX's
``ad.primitive_jvps[p] = rule`` lines); the planner reads the table.

One generic path covers every primitive without a handler of its own: its operands go
back to their traced dtypes and each jaxpr parameter is transformed with the same policy
*keeping its boundary types*, so the primitive's other parameters (reducers, sharding
annotations, ...) stay valid without surgery. The primitives that are everywhere in real
models get a handler that lets half-precision values cross the boundary, because a round
trip through float32 at each boundary would cost memory and converts:

- ``jit`` / ``closed_call`` / ``checkpoint``: the body is specialised to the dtypes its
  operands arrive in; outputs keep whatever dtype the body computes. Operands the body
  consumes only in float32 (through data movement, additions) are cast once, outside;
  those it reads only through slices or gathers that read each element once are handed
  over as they arrive (``_plan.SELECTED``: the selection converts them itself).
- ``custom_jvp_call`` / ``custom_vjp_call``: rebuilt through ``jax.custom_jvp`` /
  ``jax.custom_vjp`` (their pieces, and those of the hijax encodings that
  :mod:`autocast._hijax` dispatches here, come through ``_compat`` adapters). The body, the JVP rule and the forward rule run in the dtypes their
  operands arrive in, under the same policy; the user's ``bwd`` is called with the
  residuals and cotangents as they arrive, and adapted at its boundary if it cannot take
  them. So ``relu(x16)`` stays half and saves half (or boolean) residuals.
- ``scan`` / ``while``: constants and scanned-over inputs are specialised; loop carries keep
  the dtype their initial value arrives in, except a float32 one made from parameters or
  inputs that the body turns half (it starts half, as in the unrolled loop; see
  ``_narrowed_carries``); stacked outputs are specialised.
- ``cond``: operands are specialised; an output whose dtype differs between branches is
  cast back to its traced dtype.
- ``shard_map``: the body is re-staged through ``jax.shard_map`` so collectives see their
  mesh axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _constructs, _dtypes, _plan, _registry, _rules
from ._interpreter import LITERAL, Context, eval_jaxpr, original_dtypes, transform_jaxpr
from ._registry import Handler, jaxpr_params, register_fallback, register_higher_order


def _current_dtypes(invals: Sequence[Any], orig: Sequence[Any]) -> list[Any]:
    return [_dtypes.dtype_of(x) if _dtypes.is_castable(o) else o for x, o in zip(invals, orig)]


def _boundary_dtypes(jaxpr_like: Any) -> tuple[list[Any], list[Any]]:
    open_, _ = _compat.open_and_consts(jaxpr_like)
    return [v.aval.dtype for v in open_.invars], [v.aval.dtype for v in open_.outvars]


def _cast_castable(x: Any, dtype: Any) -> Any:
    """``x`` cast to ``dtype`` when both are float16/bfloat16/float32; else ``x``."""
    if _dtypes.is_castable(dtype) and _dtypes.is_castable(_dtypes.dtype_of(x)):
        return _dtypes.cast(x, dtype)
    return x


# --- the generic path --------------------------------------------------------------------


@register_fallback
def _generic(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool] = ()):
    orig = original_dtypes(eqn)
    invals = [_dtypes.cast(x, d) if _dtypes.is_castable(d) else x for x, d in zip(invals, orig)]
    params = dict(eqn.params)
    for key in jaxpr_params(params):
        val = params[key]
        items = val if type(val) is tuple else (val,)
        new_items = []
        for sub in items:
            ins, outs = _boundary_dtypes(sub)
            new, extra, _ = transform_jaxpr(ctx, sub, ins, [False] * len(ins), scopes, out_dtypes=outs)
            if extra:  # an open body that now needs constants: keep the traced one
                new = sub
            new_items.append(new)
        params[key] = tuple(new_items) if type(val) is tuple else new_items[0]
    outs = _compat.bind(eqn.primitive, invals, params)
    return outs, [False] * len(outs)


# --- call-like primitives: specialise the body to the incoming dtypes ----------------------


def _call_like(param: str) -> Handler:
    def handler(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]):
        params = dict(eqn.params)
        in_dtypes = _current_dtypes(invals, original_dtypes(eqn))
        new, extra, out_free = transform_jaxpr(
            ctx, params[param], in_dtypes, in_free, scopes, out_float32=out32, out_narrow=ctx.out_narrow, closed=True
        )
        params[param] = new
        outs = _compat.bind(eqn.primitive, [*extra, *invals], params)
        return outs, out_free

    return handler


def _body_pulls(param: str):
    """The pull rule of a primitive whose body's invars are its operands, one to one."""

    def pulls(ctx: Context, eqn: Any, scopes: tuple, out32: Sequence[bool]) -> list[bool | str]:
        return _plan.input_pulls(ctx, eqn.params[param], scopes, out32)

    return pulls


def _float32_only_call(param: str):
    """The island test of a call-like primitive (see :data:`autocast._registry.FLOAT32_CALLS`):
    a ``jit`` whose body computes in float32 and holds no half-precision work (no matmul,
    convolution or other compute-rule equation, no effect, at any depth), such as
    ``jnp.var``'s ``_var`` or ``logsumexp``'s ``jit``, is part of the float32 island around
    it. A layer norm's statistics are then computed inside the island that normalises with
    them: the island's checkpoint keeps only the half-precision input, and XLA fuses the
    statistics and the normalisation (one kernel forward) instead of storing the
    statistics as the island's inputs."""

    def test(ctx: Context, eqn: Any, scopes: tuple, out32: Sequence[bool]) -> bool:
        if not ctx.remat or eqn.effects:
            return False

        def build():
            body = eqn.params[param]
            return _float32_only(ctx, body, scopes) and _body_computes_in_float32(ctx, body, scopes, out32)

        return bool(ctx.cached(("call32only", scopes, tuple(map(bool, out32))), eqn, build))

    return test


def _float32_only(ctx: Context, jaxpr_like: Any, scopes: tuple) -> bool:
    """Whether a body holds no compute-rule equation, no effect and no primitive other than
    first-order ones and nested ``jit``s / ``closed_call``s of the same kind."""
    open_, _ = _compat.open_and_consts(jaxpr_like)
    for eqn in open_.eqns:
        if eqn.effects:
            return False
        inner = scopes + _compat.scope_names(eqn.source_info.name_stack)
        if eqn.primitive in (_compat.jit_p, _compat.closed_call_p):
            body = eqn.params["jaxpr" if eqn.primitive is _compat.jit_p else "call_jaxpr"]
            if not _float32_only(ctx, body, inner):
                return False
            continue
        if _registry.handler_for(eqn) is not None and not ctx.lookup.explicit(eqn.primitive):
            return False
        rule = ctx.lookup.rule(eqn.primitive, inner)
        if rule.role in ("compute", "original"):
            return False
    return True


for _prim, _param in ((_compat.jit_p, "jaxpr"), (_compat.closed_call_p, "call_jaxpr")):
    register_higher_order(_prim, pulls=_body_pulls(_param), body=_param, float32_call=_float32_only_call(_param))(
        _call_like(_param)
    )


def checkpoint_pulls(ctx: Context, eqn: Any, scopes: tuple, out32: Sequence[bool]) -> list[bool | str]:
    """The pull rule of a checkpoint (``checkpoint`` or ``RematTraced``)."""
    parts = _constructs.remat_parts(eqn)
    if parts is None:
        return [False] * len(eqn.invars)
    return _plan.input_pulls(ctx, parts[0], scopes, out32)


def custom_jvp_pulls(ctx: Context, eqn: Any, scopes: tuple, out32: Sequence[bool]) -> list[bool | str]:
    """The pull rule of a custom JVP call that is part of a float32 island
    (:func:`call_computes_in_float32`: ``jax.nn.softmax`` under ``jax_softmax_custom_jvp``,
    ``softplus``): the operands its body consumes only in float32 are taken in float32, so
    their producer is computed in float32 inside the island, as for the same operations
    written out. ``softmax(scores + mask)`` with a float32 additive mask passed as an
    argument then adds in float32 (``finfo(float32).min`` stays finite; rounded to half
    first it was ``-inf``, and a fully masked row NaN). Nothing more is kept: the island is
    recomputed from the half-precision scores. Any other custom JVP call takes its
    operands as they arrive (its rule would otherwise run, and save, in float32)."""
    parts = _constructs.custom_jvp_parts(eqn)  # its body's invars: the operands, one to one
    if parts is None or not call_computes_in_float32(ctx, eqn, scopes, out32):
        return [False] * len(eqn.invars)
    # inside the island nothing is kept at the body's boundary: no input is too risky to pull
    return _plan.input_pulls(ctx.without_islands(), parts.body, scopes, out32)


def checkpoint(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]):
    """A checkpoint (``checkpoint`` or ``RematTraced``): its body specialised to the arriving
    dtypes, rebuilt with the same policy and ``prevent_cse``."""
    parts = _constructs.remat_parts(eqn)
    if parts is None:
        return hi_original(ctx, eqn, invals, in_free, scopes)
    body, policy = parts
    if policy is not None:
        # a checkpoint that may save matmul results: keep them in half precision
        ctx = ctx.without_widening()
    elif not ctx.recomputed:
        # it saves nothing and recomputes its body: its islands need no checkpoint of their
        # own (under jax_remat3 a nested one is recomputed once more)
        ctx = ctx.inside_recomputed_island()
    in_dtypes = _current_dtypes(invals, original_dtypes(eqn))
    new, extra, out_free = transform_jaxpr(
        ctx, body, in_dtypes, in_free, scopes, out_float32=out32, out_narrow=ctx.out_narrow
    )
    return _constructs.remat_bind(eqn, new, extra, invals), out_free


register_higher_order(_compat.remat_p, pulls=checkpoint_pulls, body="jaxpr")(checkpoint)


# --- custom derivatives: body and rules in the arriving dtypes ------------------------------


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
    in_dtypes = _current_dtypes(invals, traced_in)
    floats = [(d, f) for d, f, o in zip(in_dtypes, in_free, traced_in) if _dtypes.is_castable(o)]
    deciders = [d for d, f in floats if not f] or [d for d, _ in floats]
    half = _dtypes.widest(deciders) if deciders else None
    if half == _dtypes.FLOAT32:
        half = None
    _, traced_out = _boundary_dtypes(jaxpr_like)
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
    """Whether a custom JVP call computes in float32 (softplus: ``logaddexp(x, 0)``), judged
    from its body: the jaxpr JAX traced for the primal function, through nested calls. Its
    call is then recomputed in the backward pass from the half-precision primals instead of
    saving the float32 intermediates of its rule, as any other float32 island (the planner
    makes it part of one; memoised per equation).

    The JVP rule itself is never traced to decide this: it is user code that JAX runs only
    when the call is differentiated, and it may refuse to be (``eqx.nondifferentiable``
    raises when traced). A rule that computes in float32 behind a body that does not keeps
    its float32 residuals (more memory, same values)."""
    if not ctx.remat:
        return False

    def build():
        parts = _constructs.custom_jvp_parts(eqn)
        return parts is not None and _body_computes_in_float32(ctx, parts.body, scopes, out32)

    return ctx.cached(("call32", scopes, tuple(map(bool, out32))), eqn, build)


def _body_computes_in_float32(ctx: Context, jaxpr_like: Any, scopes: tuple, out32: Sequence[bool]) -> bool:
    open_, _ = _compat.open_and_consts(jaxpr_like)
    out32 = [*out32, *[False] * (len(open_.outvars) - len(out32))][: len(open_.outvars)]
    if any(_plan.plan(ctx, open_, scopes, out32).island):
        return True
    for eqn in open_.eqns:  # a jit or checkpoint inside the body (an island is local to its body)
        body = _registry.narrow_body(eqn)
        if body is not None and eqn.primitive is not _compat.custom_jvp_call_p:
            inner = scopes + _compat.scope_names(eqn.source_info.name_stack)
            if _body_computes_in_float32(ctx, body, inner, [False] * len(eqn.outvars)):
                return True
    return False


def custom_jvp(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]):
    """A custom JVP (``custom_jvp_call`` or ``CustomJVPTraced``) rebuilt with
    ``jax.custom_jvp``: the body specialised to the arriving dtypes, and a JVP rule that
    evaluates the user's rule (the jaxpr JAX traces for it) with the same policy on the
    arriving primals and tangents. Its outputs are cast to the body's output dtypes, which
    ``custom_jvp`` requires. A rule that computes in float32 is recomputed in the backward
    pass: a checkpoint around the call (JAX cannot linearize a checkpoint inside a custom
    JVP rule under ``jax_remat3``)."""
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
        primals_out = [_cast_castable(x, a.dtype) for x, a in zip(outs[:k], out_avals)]
        nonzero = iter(outs[k:])
        tangents_out = [
            _zero_tangent(a) if z else _cast_castable(next(nonzero), a.dtype) for a, z in zip(out_avals, out_zeros)
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
    """A custom VJP (``custom_vjp_call`` or ``CustomVJPTraced``) rebuilt with
    ``jax.custom_vjp``: the body and the forward rule (the jaxpr JAX traces for the user's
    ``fwd``) run with the same policy in the arriving dtypes, so residuals may be half
    precision.

    The user's ``bwd`` runs under the forward's policy too (``ctx.custom_vjp_bwd == "amp"``,
    the default; PyTorch's ``custom_bwd``): it is traced as JAX would call it (residuals and
    cotangents in their traced dtypes) and that jaxpr is evaluated with the same rules on the
    residuals and cotangents as they arrive, so a backward pass that recomputes the forward
    (``jax.vjp`` inside ``bwd``: diffrax's checkpointed loop) has half-precision matmuls and
    float32 reductions. With ``"original"`` the ``bwd`` is called as written on the
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
        return [_cast_castable(x, a.dtype) for x, a in zip(outs[n_res:], out_avals)], res

    def call_bwd(res, cts, res_dtypes, ct_dtypes):
        res = [_cast_castable(r, d) for r, d in zip(res, res_dtypes)]
        cts = [c if _compat.is_zero(c) else _cast_castable(c, d) for c, d in zip(cts, ct_dtypes)]
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
        out = [None if _compat.is_zero(c) or c is None else _cast_castable(c, d) for c, d in zip(cts_in, in_dtypes[n:])]
        return (*[None] * n, *out)

    call = jax.custom_vjp(body)
    call.defvjp(fwd, bwd_rule, symbolic_zeros=True)
    return list(call(*invals)), out_free


def _traced_aval(x: Any, dtype: Any) -> Any:
    """The abstract value of ``x`` with the dtype it was traced with (float dtypes only)."""
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
    """A custom VJP's ``bwd`` evaluated under the policy: traced on residuals and
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
        vals = [next(it) if t else _cast_castable(x, d) for x, d, t in zip(values, dtypes, dynamic)]
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


def hi_original(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool] = ()):
    """An equation whose bodies autocast does not transform: ``call_hi_primitive`` of an
    opaque construct (its operands back in their traced dtypes, bound as is; refs are
    never cast), else the generic path."""
    if _compat.hi_prim(eqn) is None:
        return _generic(ctx, eqn, invals, in_free, scopes)
    orig = original_dtypes(eqn)
    invals = [_dtypes.cast(x, d) if _dtypes.is_castable(d) else x for x, d in zip(invals, orig)]
    outs = _compat.bind(eqn.primitive, invals, dict(eqn.params))
    return outs, [False] * len(outs)


# --- loops: carries keep the dtype of their initial value (or the unrolled loop's) ----


def _scan_pulls(ctx: Context, eqn: Any, scopes: tuple, out32: Sequence[bool]) -> list[bool | str]:
    """Constants and scanned-over inputs the body consumes only in float32 (carries keep
    the dtype their initial value arrives in, so they are never pulled)."""
    n_consts, n_carry = _compat.scan_counts(eqn.params)
    flags = _plan.input_pulls(ctx, eqn.params["jaxpr"], scopes, [*[False] * n_carry, *out32[n_carry:]])
    flags[n_consts : n_consts + n_carry] = [False] * n_carry
    return flags


def _narrowed_carries(
    ctx: Context,
    body: Any,
    in_dtypes: list,
    in_free: Sequence,
    scopes: tuple,
    n_consts: int,
    n_carry: int,
    out32: Sequence[bool],
) -> list[int]:
    """Float32 initial carries made from parameters or inputs (free, not from literals
    alone) that the body, as in its first unrolled iteration, turns into the compute dtype:
    an embedding entering a ``scan`` over layers adds half-precision block outputs to
    itself. They start in the compute dtype, as the unrolled loop would have them. Carries
    initialised from constants (``jnp.zeros``: a running sum, an LSTM cell state) are
    accumulators and keep float32."""
    carries = range(n_consts, n_consts + n_carry)
    cands = [i for i in carries if in_dtypes[i] == _dtypes.FLOAT32 and in_free[i] and in_free[i] != LITERAL]
    if not cands or ctx.compute_dtype == _dtypes.FLOAT32:
        return []
    free = [bool(f) if i in cands or i not in carries else False for i, f in enumerate(in_free)]
    out_dtypes = [None if n_consts + k in cands else in_dtypes[n_consts + k] for k in range(n_carry)]
    _, body_outs = _boundary_dtypes(body)
    out_dtypes += [None] * (len(body_outs) - n_carry)
    body_out32 = [*(d == _dtypes.FLOAT32 for d in out_dtypes[:n_carry]), *out32[n_carry:]]
    trial, _, _ = transform_jaxpr(ctx, body, in_dtypes, free, scopes, out_dtypes=out_dtypes, out_float32=body_out32)
    _, trial_outs = _boundary_dtypes(trial)
    return [i for i in cands if trial_outs[i - n_consts] == ctx.compute_dtype]


@register_higher_order(_compat.scan_p, pulls=_scan_pulls)
def _scan(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]):
    params = dict(eqn.params)
    n_consts, n_carry = _compat.scan_counts(params)
    body = params["jaxpr"]
    in_dtypes = _current_dtypes(invals, original_dtypes(eqn))
    invals = list(invals)
    for i in _narrowed_carries(ctx, body, in_dtypes, in_free, scopes, n_consts, n_carry, out32):
        invals[i] = _dtypes.cast(invals[i], ctx.compute_dtype)
        in_dtypes[i] = ctx.compute_dtype
    free = list(in_free)
    free[n_consts : n_consts + n_carry] = [False] * n_carry
    _, body_outs = _boundary_dtypes(body)
    out_dtypes = [*in_dtypes[n_consts : n_consts + n_carry], *([None] * (len(body_outs) - n_carry))]
    body_out32 = [*(d == _dtypes.FLOAT32 for d in out_dtypes[:n_carry]), *out32[n_carry:]]
    new, _, body_free = transform_jaxpr(
        ctx, body, in_dtypes, free, scopes, out_dtypes=out_dtypes, out_float32=body_out32, closed=True
    )
    out_free = [False] * n_carry + body_free[n_carry:]
    params["jaxpr"] = new
    return _compat.bind(eqn.primitive, invals, params), out_free


@register_higher_order(_compat.while_p)
def _while(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]):
    params = dict(eqn.params)
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    in_dtypes = _current_dtypes(invals, original_dtypes(eqn))
    invals = list(invals)
    n_carry = len(invals) - nc - nb
    for i in _narrowed_carries(
        ctx, params["body_jaxpr"], in_dtypes[nc:], in_free[nc:], scopes, nb, n_carry, [False] * n_carry
    ):
        invals[nc + i] = _dtypes.cast(invals[nc + i], ctx.compute_dtype)
        in_dtypes[nc + i] = ctx.compute_dtype
    cond_consts, body_consts, carry = in_dtypes[:nc], in_dtypes[nc : nc + nb], in_dtypes[nc + nb :]
    cfree, bfree = in_free[:nc], in_free[nc : nc + nb]
    no = [False] * len(carry)
    _, cond_outs = _boundary_dtypes(params["cond_jaxpr"])
    params["cond_jaxpr"], _, _ = transform_jaxpr(
        ctx, params["cond_jaxpr"], [*cond_consts, *carry], [*cfree, *no], scopes, out_dtypes=cond_outs, closed=True
    )
    params["body_jaxpr"], _, _ = transform_jaxpr(
        ctx, params["body_jaxpr"], [*body_consts, *carry], [*bfree, *no], scopes, out_dtypes=carry, closed=True
    )
    outs = _compat.bind(eqn.primitive, invals, params)
    return outs, [False] * len(outs)


@register_higher_order(_compat.cond_p)
def _cond(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]):
    params = dict(eqn.params)
    branches = params["branches"]
    in_dtypes = _current_dtypes(invals[1:], original_dtypes(eqn)[1:])
    free = list(in_free[1:])
    first = [transform_jaxpr(ctx, b, in_dtypes, free, scopes, closed=True) for b in branches]
    out_dtypes_per_branch = [[v.aval.dtype for v in new.jaxpr.outvars] for new, _, _ in first]
    _, traced_outs = _boundary_dtypes(branches[0])
    out_dtypes = [
        ds[0] if len(set(map(str, ds))) == 1 else traced for ds, traced in zip(zip(*out_dtypes_per_branch), traced_outs)
    ]
    new_branches, frees = [], []
    for b, (new, _, branch_free), dts in zip(branches, first, out_dtypes_per_branch):
        if list(map(str, dts)) != list(map(str, out_dtypes)):  # re-trace only disagreeing branches
            new, _, branch_free = transform_jaxpr(ctx, b, in_dtypes, free, scopes, out_dtypes=out_dtypes, closed=True)
        new_branches.append(new)
        frees.append(branch_free)
    params["branches"] = tuple(new_branches)
    outs = _compat.bind(eqn.primitive, invals, params)
    return outs, [all(fs) for fs in zip(*frees)] if frees else []


# --- shard_map: re-staged through the public API so collectives see their axes -------------


@register_higher_order(_compat.shard_map_p)
def _shard_map(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]):
    params = eqn.params
    body = params["jaxpr"]
    open_, consts = _compat.open_and_consts(body)
    out_free: list[bool] = []

    def fun(*args):
        outs, free = eval_jaxpr(ctx, open_, consts, args, in_free, scopes)
        out_free[:] = free
        return tuple(outs)

    kwargs = dict(
        mesh=params["mesh"],
        in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]),
        check_vma=params.get("check_vma", True),
    )
    if "newly_manual_axes" in params:  # JAX >= 0.7: partial manual axes
        kwargs["axis_names"] = set(params["newly_manual_axes"])
    outs = jax.shard_map(fun, **kwargs)(*invals)
    return list(outs), [False] * len(outs)
