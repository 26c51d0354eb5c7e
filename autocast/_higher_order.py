"""Transforming the bodies of primitives that hold jaxprs.

Each handler registers into the table of `autocast._registry` at import (like JAX's
`ad.primitive_jvps[p] = rule` lines); the planner reads the table.

One generic path covers every primitive without a handler of its own: its operands go
back to their traced dtypes and each jaxpr parameter is transformed with the same policy
*keeping its boundary types*, so the primitive's other parameters (reducers, sharding
annotations, ...) stay valid without surgery. The primitives that are everywhere in real
models get a handler that lets half-precision values cross the boundary, because a round
trip through float32 at each boundary would cost memory and converts:

- `jit` / `closed_call` / `checkpoint`: the body is specialised to the dtypes its
  operands arrive in; outputs keep whatever dtype the body computes. Operands the body
  consumes only in float32 (through data movement, additions) are cast once, outside;
  those it reads only through slices or gathers that read each element once are handed
  over as they arrive (`_plan.SELECTED`: the selection converts them itself).
- `custom_jvp_call` / `custom_vjp_call`: `autocast._custom_derivatives`.
- `scan` / `while`: constants and scanned-over inputs are specialised; loop carries keep
  the dtype their initial value arrives in, except a float32 one made from parameters or
  inputs that the body turns half (it starts half, as in the unrolled loop; see
  `_narrowed_carries`); stacked outputs are specialised.
- `cond`: operands are specialised; an output whose dtype differs between branches is
  cast back to its traced dtype.
- `shard_map`: the body is re-staged through `jax.shard_map` so collectives see their
  mesh axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from . import _compat, _constructs, _dtypes, _plan, _registry
from ._interpreter import LITERAL, Context, eval_jaxpr, original_dtypes, transform_jaxpr
from ._registry import Handler, jaxpr_params, register_fallback, register_higher_order


def current_dtypes(invals: Sequence[Any], orig: Sequence[Any]) -> list[Any]:
    return [_dtypes.dtype_of(x) if _dtypes.is_castable(o) else o for x, o in zip(invals, orig)]


def boundary_dtypes(jaxpr_like: Any) -> tuple[list[Any], list[Any]]:
    open_, _ = _compat.open_and_consts(jaxpr_like)
    return [v.aval.dtype for v in open_.invars], [v.aval.dtype for v in open_.outvars]


def cast_castable(x: Any, dtype: Any) -> Any:
    """`x` cast to `dtype` when both are float16/bfloat16/float32; else `x`."""
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
            ins, outs = boundary_dtypes(sub)
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
        in_dtypes = current_dtypes(invals, original_dtypes(eqn))
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
    """The island test of a call-like primitive (see `autocast._registry.FLOAT32_CALLS`):
    a `jit` whose body computes in float32 and holds no half-precision work (no matmul,
    convolution or other compute-rule equation, no effect, at any depth), such as
    `jnp.var`'s `_var` or `logsumexp`'s `jit`, is part of the float32 island around
    it. A layer norm's statistics are then computed inside the island that normalises with
    them: the island's checkpoint keeps only the half-precision input, and XLA fuses the
    statistics and the normalisation (one kernel forward) instead of storing the
    statistics as the island's inputs."""

    def test(ctx: Context, eqn: Any, scopes: tuple, out32: Sequence[bool]) -> bool:
        if not ctx.remat or eqn.effects:
            return False

        def build():
            body = eqn.params[param]
            return _float32_only(ctx, body, scopes) and body_computes_in_float32(ctx, body, scopes, out32)

        return bool(ctx.cached(("call32only", scopes, tuple(map(bool, out32))), eqn, build))

    return test


def _float32_only(ctx: Context, jaxpr_like: Any, scopes: tuple) -> bool:
    """Whether a body holds no compute-rule equation, no effect and no primitive other than
    first-order ones and nested `jit`s / `closed_call`s of the same kind."""
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


def body_computes_in_float32(ctx: Context, jaxpr_like: Any, scopes: tuple, out32: Sequence[bool]) -> bool:
    """Whether a body (or a jit or checkpoint inside it) has a float32 island."""
    open_, _ = _compat.open_and_consts(jaxpr_like)
    out32 = [*out32, *[False] * (len(open_.outvars) - len(out32))][: len(open_.outvars)]
    if any(_plan.plan(ctx, open_, scopes, out32).island):
        return True
    for eqn in open_.eqns:  # a jit or checkpoint inside the body (an island is local to its body)
        body = _registry.narrow_body(eqn)
        if body is not None and eqn.primitive is not _compat.custom_jvp_call_p:
            inner = scopes + _compat.scope_names(eqn.source_info.name_stack)
            if body_computes_in_float32(ctx, body, inner, [False] * len(eqn.outvars)):
                return True
    return False


def checkpoint_pulls(ctx: Context, eqn: Any, scopes: tuple, out32: Sequence[bool]) -> list[bool | str]:
    """The pull rule of a checkpoint (`checkpoint` or `RematTraced`)."""
    parts = _constructs.remat_parts(eqn)
    if parts is None:
        return [False] * len(eqn.invars)
    return _plan.input_pulls(ctx, parts[0], scopes, out32)


def checkpoint(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]):
    """A checkpoint (`checkpoint` or `RematTraced`): its body specialised to the arriving
    dtypes, rebuilt with the same policy and `prevent_cse`."""
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
    in_dtypes = current_dtypes(invals, original_dtypes(eqn))
    new, extra, out_free = transform_jaxpr(
        ctx, body, in_dtypes, in_free, scopes, out_float32=out32, out_narrow=ctx.out_narrow
    )
    return _constructs.remat_bind(eqn, new, extra, invals), out_free


register_higher_order(_compat.remat_p, pulls=checkpoint_pulls, body="jaxpr")(checkpoint)


def hi_original(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool] = ()):
    """An equation whose bodies autocast does not transform: `call_hi_primitive` of an
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
    an embedding entering a `scan` over layers adds half-precision block outputs to
    itself. They start in the compute dtype, as the unrolled loop would have them. Carries
    initialised from constants (`jnp.zeros`: a running sum, an LSTM cell state) are
    accumulators and keep float32."""
    carries = range(n_consts, n_consts + n_carry)
    cands = [i for i in carries if in_dtypes[i] == _dtypes.FLOAT32 and in_free[i] and in_free[i] != LITERAL]
    if not cands or ctx.compute_dtype == _dtypes.FLOAT32:
        return []
    free = [bool(f) if i in cands or i not in carries else False for i, f in enumerate(in_free)]
    out_dtypes = [None if n_consts + k in cands else in_dtypes[n_consts + k] for k in range(n_carry)]
    _, body_outs = boundary_dtypes(body)
    out_dtypes += [None] * (len(body_outs) - n_carry)
    body_out32 = [*(d == _dtypes.FLOAT32 for d in out_dtypes[:n_carry]), *out32[n_carry:]]
    trial, _, _ = transform_jaxpr(ctx, body, in_dtypes, free, scopes, out_dtypes=out_dtypes, out_float32=body_out32)
    _, trial_outs = boundary_dtypes(trial)
    return [i for i in cands if trial_outs[i - n_consts] == ctx.compute_dtype]


@register_higher_order(_compat.scan_p, pulls=_scan_pulls)
def _scan(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple, out32: Sequence[bool]):
    params = dict(eqn.params)
    n_consts, n_carry = _compat.scan_counts(params)
    body = params["jaxpr"]
    in_dtypes = current_dtypes(invals, original_dtypes(eqn))
    invals = list(invals)
    for i in _narrowed_carries(ctx, body, in_dtypes, in_free, scopes, n_consts, n_carry, out32):
        invals[i] = _dtypes.cast(invals[i], ctx.compute_dtype)
        in_dtypes[i] = ctx.compute_dtype
    free = list(in_free)
    free[n_consts : n_consts + n_carry] = [False] * n_carry
    _, body_outs = boundary_dtypes(body)
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
    in_dtypes = current_dtypes(invals, original_dtypes(eqn))
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
    _, cond_outs = boundary_dtypes(params["cond_jaxpr"])
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
    in_dtypes = current_dtypes(invals[1:], original_dtypes(eqn)[1:])
    free = list(in_free[1:])
    first = [transform_jaxpr(ctx, b, in_dtypes, free, scopes, closed=True) for b in branches]
    out_dtypes_per_branch = [[v.aval.dtype for v in new.jaxpr.outvars] for new, _, _ in first]
    _, traced_outs = boundary_dtypes(branches[0])
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
