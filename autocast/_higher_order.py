"""Transforming the bodies of primitives that hold jaxprs.

One generic path covers every such primitive: its operands go back to their traced dtypes
and each jaxpr parameter is transformed with the same policy *keeping its boundary
types*, so the primitive's other parameters (custom derivative rules, reducers, sharding
annotations, ...) stay valid without surgery. A few primitives get a more specific rule
that lets half-precision values cross the boundary, because they are everywhere in real
models and a round trip through float32 at each boundary would cost memory:

- ``jit`` / ``closed_call`` / ``checkpoint``: the body is specialised to the dtypes its
  operands arrive in; outputs keep whatever dtype the body computes.
- ``scan`` / ``while``: constants and scanned-over inputs are specialised; loop carries keep
  the dtype their initial value arrives in; stacked outputs are specialised.
- ``cond``: operands are specialised; an output whose dtype differs between branches is
  cast back to its traced dtype.
- ``shard_map``: the body is re-staged through ``jax.shard_map`` so collectives see their
  mesh axes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from . import _compat, _dtypes
from ._interpreter import Context, eval_jaxpr, original_dtypes

Handler = Callable[[Context, Any, list, list, tuple], tuple[list, list]]


def _jaxpr_params(params: dict[str, Any]) -> list[str]:
    keys = []
    for key, val in params.items():
        if _compat.is_jaxpr_like(val) or (type(val) is tuple and val and all(_compat.is_jaxpr_like(v) for v in val)):
            keys.append(key)
    return keys


def transform_jaxpr(
    ctx: Context,
    jaxpr_like: Any,
    in_dtypes: Sequence[Any],
    in_free: Sequence[bool],
    scopes: tuple[str, ...],
    out_dtypes: Sequence[Any | None] | None = None,
) -> tuple[Any, list[Any], list[bool]]:
    """Transform a (closed or open) jaxpr for operands of ``in_dtypes``.

    Outputs are cast to ``out_dtypes`` where given (``None`` entries: any dtype). Returns
    ``(new, extra_consts, out_free)``: a closed jaxpr comes back closed with
    ``extra_consts == []``; an open one comes back open, with any constants it needs turned
    into leading invars and returned as ``extra_consts`` (to be passed as leading
    operands). ``out_free`` tells which outputs are free values.
    """
    key = (tuple(map(str, in_dtypes)), tuple(in_free), scopes, None if out_dtypes is None else tuple(map(str, out_dtypes)))

    def build():
        open_, consts = _compat.open_and_consts(jaxpr_like)
        in_avals = [_compat.aval_with_dtype(v.aval, d) for v, d in zip(open_.invars, in_dtypes)]
        out_free: list[bool] = []

        def fun(*args):
            out32 = None if out_dtypes is None else [d is not None and d == _dtypes.FLOAT32 for d in out_dtypes]
            outs, free = eval_jaxpr(ctx, open_, consts, args, in_free, scopes, out32)
            if out_dtypes is not None:
                outs = [x if d is None else _dtypes.cast(x, d) for x, d in zip(outs, out_dtypes)]
            out_free[:] = free
            return outs

        new_open, new_consts = _compat.trace_to_jaxpr(fun, in_avals)
        if _compat.is_closed(jaxpr_like):
            return (_compat.close_jaxpr(new_open, new_consts), []), list(out_free)
        if new_consts:
            return (_compat.constvars_to_invars(new_open), list(new_consts)), list(out_free)
        return (new_open, []), list(out_free)

    (new, extra), out_free = ctx.cached(key, jaxpr_like, build)
    return new, extra, list(out_free)


def _current_dtypes(invals: Sequence[Any], orig: Sequence[Any]) -> list[Any]:
    return [_dtypes.dtype_of(x) if _dtypes.is_castable(o) else o for x, o in zip(invals, orig)]


def _boundary_dtypes(jaxpr_like: Any) -> tuple[list[Any], list[Any]]:
    open_, _ = _compat.open_and_consts(jaxpr_like)
    return [v.aval.dtype for v in open_.invars], [v.aval.dtype for v in open_.outvars]


# --- the generic path --------------------------------------------------------------------


def _generic(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple):
    orig = original_dtypes(eqn)
    invals = [_dtypes.cast(x, d) if _dtypes.is_castable(d) else x for x, d in zip(invals, orig)]
    params = dict(eqn.params)
    for key in _jaxpr_params(params):
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


# --- custom derivatives: the body and the rules, with the traced boundary types ---------


def _custom_derivative(thunk_param: str) -> Handler:
    """``custom_jvp_call`` / ``custom_vjp_call``: the generic path for the primal body, and
    the JVP rule / forward rule transformed the same way when JAX asks for it under AD, so
    matmuls inside them run in the compute dtype too. Their inputs and outputs (including
    ``custom_vjp`` residuals) keep the traced dtypes, so the user's rules apply unchanged."""

    def handler(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple):
        thunk = eqn.params.get(thunk_param)
        if thunk is None or not hasattr(thunk, "call_wrapped"):
            return _generic(ctx, eqn, invals, in_free, scopes)

        def transform(jaxpr: Any, consts: list) -> tuple[Any, list]:
            in_avals = [v.aval for v in _compat.arg_invars(jaxpr, len(consts))]
            out_dtypes = [v.aval.dtype for v in jaxpr.outvars]

            def fun(*args):
                outs, _ = eval_jaxpr(ctx, jaxpr, consts, args, [False] * len(args), scopes, [d == _dtypes.FLOAT32 for d in out_dtypes])
                return [_dtypes.cast(x, d) if _dtypes.is_castable(d) else x for x, d in zip(outs, out_dtypes)]

            return _compat.trace_to_jaxpr(fun, in_avals)

        new_eqn = eqn.replace(params={**eqn.params, thunk_param: _compat.wrap_jaxpr_thunk(thunk, transform)})
        return _generic(ctx, new_eqn, invals, in_free, scopes)

    return handler


# --- call-like primitives: specialise the body to the incoming dtypes ----------------------


def _call_like(param: str) -> Handler:
    def handler(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple):
        params = dict(eqn.params)
        in_dtypes = _current_dtypes(invals, original_dtypes(eqn))
        new, extra, out_free = transform_jaxpr(ctx, params[param], in_dtypes, in_free, scopes)
        params[param] = new
        outs = _compat.bind(eqn.primitive, [*extra, *invals], params)
        return outs, out_free

    return handler


# --- loops: carries keep the dtype of their initial value ---------------------------------


def _scan(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple):
    params = dict(eqn.params)
    n_consts, n_carry = _compat.scan_counts(params)
    body = params["jaxpr"]
    in_dtypes = _current_dtypes(invals, original_dtypes(eqn))
    free = list(in_free)
    free[n_consts : n_consts + n_carry] = [False] * n_carry
    _, body_outs = _boundary_dtypes(body)
    out_dtypes = [*in_dtypes[n_consts : n_consts + n_carry], *([None] * (len(body_outs) - n_carry))]
    new, _, body_free = transform_jaxpr(ctx, body, in_dtypes, free, scopes, out_dtypes=out_dtypes)
    out_free = [False] * n_carry + body_free[n_carry:]
    params["jaxpr"] = new
    return _compat.bind(eqn.primitive, invals, params), out_free


def _while(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple):
    params = dict(eqn.params)
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    in_dtypes = _current_dtypes(invals, original_dtypes(eqn))
    cond_consts, body_consts, carry = in_dtypes[:nc], in_dtypes[nc : nc + nb], in_dtypes[nc + nb :]
    cfree, bfree = in_free[:nc], in_free[nc : nc + nb]
    no = [False] * len(carry)
    _, cond_outs = _boundary_dtypes(params["cond_jaxpr"])
    params["cond_jaxpr"], _, _ = transform_jaxpr(ctx, params["cond_jaxpr"], [*cond_consts, *carry], [*cfree, *no], scopes, out_dtypes=cond_outs)
    params["body_jaxpr"], _, _ = transform_jaxpr(ctx, params["body_jaxpr"], [*body_consts, *carry], [*bfree, *no], scopes, out_dtypes=carry)
    outs = _compat.bind(eqn.primitive, invals, params)
    return outs, [False] * len(outs)


def _cond(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple):
    params = dict(eqn.params)
    branches = params["branches"]
    in_dtypes = _current_dtypes(invals[1:], original_dtypes(eqn)[1:])
    free = list(in_free[1:])
    first = [transform_jaxpr(ctx, b, in_dtypes, free, scopes) for b in branches]
    out_dtypes_per_branch = [[v.aval.dtype for v in new.jaxpr.outvars] for new, _, _ in first]
    _, traced_outs = _boundary_dtypes(branches[0])
    out_dtypes = [
        ds[0] if len(set(map(str, ds))) == 1 else traced
        for ds, traced in zip(zip(*out_dtypes_per_branch), traced_outs)
    ]
    new_branches, frees = [], []
    for b, (new, _, branch_free), dts in zip(branches, first, out_dtypes_per_branch):
        if list(map(str, dts)) != list(map(str, out_dtypes)):  # re-trace only disagreeing branches
            new, _, branch_free = transform_jaxpr(ctx, b, in_dtypes, free, scopes, out_dtypes=out_dtypes)
        new_branches.append(new)
        frees.append(branch_free)
    params["branches"] = tuple(new_branches)
    outs = _compat.bind(eqn.primitive, invals, params)
    return outs, [all(fs) for fs in zip(*frees)] if frees else []


# --- shard_map: re-staged through the public API so collectives see their axes -------------


def _shard_map(ctx: Context, eqn: Any, invals: list, in_free: list, scopes: tuple):
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


_HANDLERS: dict[Any, Handler] = {}
for _prim, _param in ((_compat.jit_p, "jaxpr"), (_compat.closed_call_p, "call_jaxpr"), (_compat.remat_p, "jaxpr")):
    if _prim is not None:
        _HANDLERS[_prim] = _call_like(_param)
for _prim, _param in ((_compat.custom_jvp_call_p, "jvp_jaxpr_fun"), (_compat.custom_vjp_call_p, "fwd_jaxpr_thunk")):
    if _prim is not None:
        _HANDLERS[_prim] = _custom_derivative(_param)
for _prim, _handler in ((_compat.scan_p, _scan), (_compat.while_p, _while), (_compat.cond_p, _cond), (_compat.shard_map_p, _shard_map)):
    if _prim is not None:
        _HANDLERS[_prim] = _handler


def handler_for(eqn: Any) -> Handler | None:
    """The handler for a higher-order equation, or None for a first-order one."""
    handler = _HANDLERS.get(eqn.primitive)
    if handler is not None:
        return handler
    return _generic if _jaxpr_params(eqn.params) else None
