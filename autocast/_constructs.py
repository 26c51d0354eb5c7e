"""One shape per construct, whichever way JAX encoded it: the adapters the handlers use.

The handlers of `autocast._higher_order` and `autocast._hijax` transform a
construct's body and call its rules in the dtypes values arrive in; these adapters give them
the same pieces whichever way JAX encoded it: `custom_jvp_call` / `custom_vjp_call` /
`checkpoint` equations, or one `call_hi_primitive` equation holding a `CustomJVPTraced` /
`CustomVJPTraced` / `RematTraced` / `Scan3` (JAX 0.12 with `jax_custom_jvp3` /
`jax_custom_vjp3` / `jax_remat3` / `jax_scan3`; JAX 0.9.2 has `CustomVJPTraced` with
`jax_custom_vjp3`, applied to the arguments only, with its rules taken as the user wrote
them). They read the attributes of JAX's construct objects (`HiPrim.params`, `.traced`,
`.jvp_rule`, ...), the second of the two places (with `autocast._compat`, which finds
the classes) that a JAX upgrade may have to touch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from . import _compat
from ._compat import hi_prim, is_zero, trace_to_jaxpr

# --- custom derivatives: the thunks JAX stores in custom_jvp_call / custom_vjp_call -------
# JAX >= 0.12 (``custom_vjp.defvjp_with_logs``): the flattened ``bwd`` returns
# ``(cotangents, logs)``; before, the cotangents alone.
_BWD_RETURNS_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")


def call_jvp_rule_thunk(thunk: Any, zeros: Sequence[bool]) -> tuple[Any, list[Any], list[bool]]:
    """The JVP rule of a `custom_jvp_call` traced for these symbolic-zero tangent flags:
    `(open_jaxpr, consts, out_zeros)`; the jaxpr takes the primals, then the nonzero
    tangents, and returns the primal outputs, then the nonzero output tangents.

    JAX 0.9.2 .. 0.12: `jvp_jaxpr_fun` is an `lu.WrappedFun` called with the flags.
    """
    jaxpr, consts, out_zeros = thunk.call_wrapped(*zeros)
    return jaxpr, list(consts), list(out_zeros)


def call_custom_bwd(bwd: Any, res: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
    """Call the flattened `bwd` of a `custom_vjp_call` equation on flat residuals and
    output cotangents; returns one cotangent per non-constant operand (zeros may be
    symbolic: see `is_zero`)."""
    out = bwd.call_wrapped(*res, *cts)
    if _BWD_RETURNS_LOGS:  # JAX >= 0.12
        out = out[0]
    return list(out)


# --- the adapters --------------------------------------------------------------------


def _is_a(prim: Any, cls: type | None) -> bool:
    return cls is not None and isinstance(prim, cls)


def _leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(tree)


class CustomJVPParts(NamedTuple):
    """A custom JVP construct: `body` (a jaxpr whose invars are the operands, one to one);
    the first `n_consts` operands carry no tangent; `rule(zeros)` traces the JVP rule for
    these symbolic-zero flags (one per operand after `n_consts`) and returns `(open_jaxpr,
    consts, out_zeros)`: the jaxpr takes the operands from `rule_skip` on, then the nonzero
    tangents, and returns the primal outputs, then the nonzero output tangents."""

    body: Any
    n_consts: int
    rule: Callable[[Sequence[bool]], tuple[Any, list[Any], list[bool]]]
    rule_skip: int
    symbolic_zeros: bool


class CustomVJPParts(NamedTuple):
    """A custom VJP construct: `body` as for `CustomJVPParts`; `fwd(perturbed)`
    (one flag per operand after `n_consts`) traces the forward rule: `(open_jaxpr, consts,
    input_fwds)`; the jaxpr takes the operands from `fwd_skip` on and returns the computed
    residuals, then the primal outputs; `input_fwds[i]` is None for a computed residual or
    the index of the operand residual `i` is. `bwd(res, cts)` calls the user's backward
    rule on flat residuals and output cotangents: one cotangent per operand after
    `n_consts` (zeros may be symbolic: `is_zero`)."""

    body: Any
    n_consts: int
    fwd: Callable[[Sequence[bool]], tuple[Any, list[Any], list[Any]]]
    fwd_skip: int
    bwd: Callable[[Sequence[Any], Sequence[Any]], list[Any]]
    symbolic_zeros: bool


def custom_jvp_parts(eqn: Any) -> CustomJVPParts | None:
    """The pieces of a `custom_jvp_call` or `CustomJVPTraced` equation (None if this
    JAX stores them in a form autocast does not know)."""
    prim: Any = hi_prim(eqn)
    if prim is None:
        params = eqn.params
        thunk = params.get("jvp_jaxpr_fun")
        if not hasattr(thunk, "call_wrapped"):
            return None
        n = params["num_consts"]
        old_rule = functools.partial(call_jvp_rule_thunk, thunk)
        return CustomJVPParts(params["call_jaxpr"], n, old_rule, n, bool(params.get("symbolic_zeros", False)))
    if not _is_a(prim, _compat.CustomJVPTraced):
        return None
    # JAX 0.12: applications take ``(consts, *args)``; the rule gets the same structure
    # (``Static`` leaves for nondiff arguments) with internal ``Zero`` tangents.
    n = len(_leaves(prim.in_avals[0]))
    avals = list(prim.in_avals_flat)

    def rule(zeros: Sequence[bool]) -> tuple[Any, list[Any], list[bool]]:
        flags = [True] * n + list(zeros)
        out_zeros: list[bool] = []

        def fun(*args):
            primals, rest = args[: len(avals)], iter(args[len(avals) :])
            tangents = [_compat.Zero(a.to_tangent_aval()) if z else next(rest) for a, z in zip(avals, flags)]
            p_out, t_out = prim.jvp_rule(
                jax.tree_util.tree_unflatten(prim.in_tree, primals),
                jax.tree_util.tree_unflatten(prim.in_tree, tangents),
            )
            t_flat = prim.out_tree.flatten_up_to(t_out)
            out_zeros[:] = [is_zero(t) for t in t_flat]
            return [*prim.out_tree.flatten_up_to(p_out), *(t for t in t_flat if not is_zero(t))]

        tangent_avals = [a.to_tangent_aval() for a, z in zip(avals, flags) if not z]
        jaxpr, consts = trace_to_jaxpr(fun, [*avals, *tangent_avals])
        return jaxpr, consts, out_zeros

    return CustomJVPParts(prim.traced.jaxpr, n, rule, 0, bool(prim.symbolic_zeros))


def custom_vjp_parts(eqn: Any) -> CustomVJPParts | None:
    """The pieces of a `custom_vjp_call` or `CustomVJPTraced` equation (None if this
    JAX stores them in a form autocast does not know)."""
    prim: Any = hi_prim(eqn)
    if prim is None:
        params = eqn.params
        fwd_thunk, flat_bwd, out_trees = params.get("fwd_jaxpr_thunk"), params.get("bwd"), params.get("out_trees")
        if not (hasattr(fwd_thunk, "call_wrapped") and hasattr(flat_bwd, "call_wrapped") and callable(out_trees)):
            return None

        def old_fwd(perturbed: Sequence[bool]) -> tuple[Any, list[Any], list[Any]]:
            jaxpr, consts = fwd_thunk.call_wrapped(*perturbed)
            _, _, input_fwds = out_trees()  # filled by the call above
            return jaxpr, list(consts), list(input_fwds)

        n = params["num_consts"]
        return CustomVJPParts(
            params["call_jaxpr"],
            n,
            old_fwd,
            n,
            functools.partial(call_custom_bwd, flat_bwd),
            bool(params.get("symbolic_zeros", False)),
        )
    if not _is_a(prim, _compat.CustomVJPTraced):
        return None
    # JAX 0.12: applications take ``(consts, fwd_consts, *args)`` and ``bwd`` returns
    # ``(cotangents of args, logs)``; JAX 0.9.2: ``(*args)`` and ``vjp_bwd_retval``.
    with_slots = hasattr(type(prim), "drop_fwd_consts")
    n = len(_leaves(prim.in_avals[:2])) if with_slots else 0
    avals = list(prim.in_avals_flat)
    res_tree: list[Any] = []

    def fwd(perturbed: Sequence[bool]) -> tuple[Any, list[Any], list[Any]]:
        nzs = jax.tree_util.tree_unflatten(prim.in_tree, [False] * n + list(perturbed))

        def fun(*args):
            out = prim.vjp_fwd(nzs, *jax.tree_util.tree_unflatten(prim.in_tree, args))
            res_flat, tree = jax.tree_util.tree_flatten(out[1])
            res_tree[:] = [tree]
            return [*res_flat, *prim.out_tree.flatten_up_to(out[0])]

        jaxpr, consts = trace_to_jaxpr(fun, avals)
        return jaxpr, consts, [None] * res_tree[0].num_leaves

    def bwd(res: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
        cts = [_compat.Zero(a.to_tangent_aval()) if is_zero(c) else c for c, a in zip(cts, prim.out_avals_flat)]
        res_val = jax.tree_util.tree_unflatten(res_tree[0], list(res))
        out_ct = jax.tree_util.tree_unflatten(prim.out_tree, cts)
        if with_slots:  # JAX 0.12
            in_cts, _ = prim.bwd(res_val, out_ct)
            args_tree: Any = jax.tree_util.tree_structure(prim.in_avals[2:])
            return args_tree.flatten_up_to(in_cts)
        return prim.in_tree.flatten_up_to(prim.vjp_bwd_retval(res_val, out_ct))

    return CustomVJPParts(prim.traced.jaxpr, n, fwd, 0, bwd, bool(prim.symbolic_zeros))


def remat_parts(eqn: Any) -> tuple[Any, Any] | None:
    """`(body, policy)` of a `checkpoint` or `RematTraced` equation (the body's invars
    are the operands, one to one), else None."""
    if _compat.remat_p is not None and eqn.primitive is _compat.remat_p:
        return eqn.params["jaxpr"], eqn.params.get("policy")
    prim: Any = hi_prim(eqn)
    if _is_a(prim, _compat.RematTraced) and "jaxpr" in prim.params and "prevent_cse" in prim.params:  # JAX 0.12
        return prim.params["jaxpr"], prim.params["policy"]
    return None


def remat_bind(eqn: Any, body: Any, extra: Sequence[Any], invals: Sequence[Any]) -> list[Any]:
    """The checkpoint of `eqn` (same policy and `prevent_cse`) around a new `body` that
    takes `extra` constants before the operands."""
    prim: Any = hi_prim(eqn)
    if prim is None:
        return _compat.bind(eqn.primitive, [*extra, *invals], dict(eqn.params, jaxpr=body))
    prevent_cse = prim.params["prevent_cse"]
    if not isinstance(prevent_cse, bool):
        prevent_cse = (False,) * len(extra) + tuple(prevent_cse)
    return list(type(prim)(body, prim.params["policy"], prevent_cse)(*extra, *invals))


def scan3_parts(eqn: Any) -> tuple[Any, list[bool]] | None:
    """`(body, extensives)` of a `Scan3` equation: the body's invars are the operands one
    to one (loop carries are refs among them); `extensives[i]`: operand `i` is scanned
    over. None for any other equation."""
    prim: Any = hi_prim(eqn)
    if _is_a(prim, _compat.Scan3):
        return prim.params["jaxpr"], list(prim.params["extensives"])
    return None


def scan3_bind(eqn: Any, body: Any, extra: Sequence[Any], invals: Sequence[Any]) -> list[Any]:
    """The `Scan3` of `eqn` (same length, `reverse`, `unroll`) over a new `body`
    that takes `extra` loop-invariant constants first."""
    prim: Any = hi_prim(eqn)
    p = prim.params
    ext = [False] * len(extra) + list(p["extensives"])
    return list(type(prim)(ext, p["length"], body, p["reverse"], p["unroll"])([*extra, *invals]))


def is_checkpoint_name(eqn: Any) -> bool:
    """A `checkpoint_name` under `jax_remat3` (`CheckpointName` / `CheckpointNameFwd`)."""
    prim: Any = hi_prim(eqn)
    return _is_a(prim, _compat.CheckpointName) or _is_a(prim, _compat.CheckpointNameFwd)


def checkpoint_name_bind(eqn: Any, x: Any) -> list[Any]:
    """The `checkpoint_name` of `eqn` applied to `x` in the dtype `x` has."""
    prim: Any = hi_prim(eqn)
    return [type(prim)(prim.params["name"], _compat.typeof(x))(x)]


def narrow_body(eqn: Any) -> Any | None:
    """The body of a `RematTraced` or `CustomJVPTraced` equation (invars: its operands,
    one to one), else None."""
    parts = remat_parts(eqn)
    if parts is not None:
        return parts[0]
    prim: Any = hi_prim(eqn)
    return prim.traced.jaxpr if _is_a(prim, _compat.CustomJVPTraced) else None
