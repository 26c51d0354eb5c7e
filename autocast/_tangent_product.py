"""`tangent_product_p`: a bilinear product whose transpose yields a float32 cotangent.

`tangent_product(inner, params, a, t, index, half, out_dtype)` binds `inner`
(`dot_general` or `conv_general_dilated`) on `a` (a half-precision primal) and the
tangent `t` of an operand that was narrowed from float32, rounded to the half dtype:
`inner(a, t.astype(half))`, result in `out_dtype`. It is `inner` in every respect (shape,
sharding and varying-axes rules, lowering) except its transpose with respect to `t`: JAX's
own transpose of `inner` called with `preferred_element_type` set to `t`'s dtype
(float32), so the cotangent is accumulated into a float32 result straight from
half-precision operands (the dot `ct16^T . a16` with a float32 output) instead of being
rounded to half and converted. Every reduction after it (a partitioner's all-reduce,
`psum`, a scan's accumulation) then runs in float32. `autocast._wide` builds the JVP of
a matmul with a narrowed parameter from it.

The primitive's rules go into JAX's tables through `autocast._compat` (JAX 0.9.2 ..
0.12: `ad.primitive_jvps` / `primitive_transposes` (0.12 also keeps `fancy_transposes`,
consulted first, for primitives that register there; this one does not),
`batching.primitive_batchers`, `mlir.register_lowering` and `lower_fun`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _compat, _cpu_matmul


class _Params:
    """The inner primitive's parameters as a hashable value (a primitive parameter must be)."""

    __slots__ = ("items",)

    def __init__(self, params: dict[str, Any]):
        self.items = tuple(sorted(params.items()))

    def as_dict(self) -> dict[str, Any]:
        return dict(self.items)

    def __hash__(self) -> int:
        return hash(self.items)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Params) and self.items == other.items

    def __repr__(self) -> str:
        return "{...}"


tangent_product_p = _compat.Primitive("tangent_product")


def tangent_product(
    inner: _compat.Primitive, params: dict[str, Any], a: Any, t: Any, index: int, half: Any, out_dtype: Any
):
    """`inner` on `a` and `t.astype(half)` (`t` at operand position `index`), the
    result in `out_dtype`; its transpose in `t` is a float32 (`t`'s dtype) result."""
    return tangent_product_p.bind(
        a, t, inner=inner, inner_params=_Params(params), index=index, half=np.dtype(half), out_dtype=np.dtype(out_dtype)
    )


def _ordered(a, t, index):
    return [a, t] if index == 1 else [t, a]


def _tp_inner_params(inner_params, half):
    return dict(inner_params.as_dict(), preferred_element_type=half)


def _tp_impl(a, t, *, inner, inner_params, index, half, out_dtype):
    (out,) = _compat.bind(inner, _ordered(a, t.astype(half), index), _tp_inner_params(inner_params, half))
    return out.astype(out_dtype) if out.dtype != out_dtype else out


def _tp_abstract_eval(a, t, *, inner, inner_params, index, half, out_dtype):
    out, effects = inner.abstract_eval(
        *_ordered(a, _compat.aval_with_dtype(t, half), index), **_tp_inner_params(inner_params, half)
    )
    return _compat.aval_with_dtype(out, out_dtype), effects


def _tp_jvp(primals, tangents, **params):
    a, t = primals
    ta, tt = tangents
    out = tangent_product_p.bind(a, t, **params)
    terms = []
    if type(ta) is not _compat.Zero:
        terms.append(tangent_product_p.bind(ta, t, **params))
    if type(tt) is not _compat.Zero:
        terms.append(tangent_product_p.bind(a, tt, **params))
    if not terms:
        return out, _compat.Zero.from_primal_value(out)
    return out, sum(terms[1:], terms[0])


def _tp_transpose(ct, a, t, *, inner, inner_params, index, half, out_dtype):
    rule = _compat.get_primitive_transpose(inner)
    if _compat.is_undefined_primal(t):
        if type(ct) is _compat.Zero:
            return [None, _compat.Zero(t.aval)]
        ct = ct.astype(half) if ct.dtype != half else ct
        # the cotangent of ``t`` accumulated into ``t``'s own dtype (float32), straight from
        # the half-precision operands (see half_matmul_operands)
        ct, a = _cpu_matmul.prepare(inner, [ct, a], t.aval.dtype)
        cts = rule(ct, *_ordered(a, t, index), **dict(inner_params.as_dict(), preferred_element_type=t.aval.dtype))
        return [None, cts[index]]
    # the cotangent of ``a``: the ordinary half-precision transpose
    if type(ct) is _compat.Zero:
        return [_compat.Zero(a.aval), None]
    ct = ct.astype(half) if ct.dtype != half else ct
    cts = rule(ct, *_ordered(a, t.astype(half), index), **_tp_inner_params(inner_params, half))
    return [cts[1 - index], None]


def _tp_batch(args, dims, *, inner, inner_params, index, half, out_dtype):
    """`dot_general`: the batch axes folded into the dimension numbers (as JAX's own rule
    does), so a batched product is still a `tangent_product`. Other primitives (or a
    `dot_general` with an explicit `out_sharding`): the inner primitive's own batching
    rule on the half-precision tangent (the float32 cotangent is not kept there)."""
    a, t = args
    params = inner_params.as_dict()
    if inner.name == "dot_general" and params.get("out_sharding") is None:
        lhs, rhs = _ordered(a, t, index)
        ld, rd = _ordered(*dims, index)
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        shift = lambda ds: tuple(d + 1 for d in ds)  # noqa: E731
        not_mapped = _compat.NOT_MAPPED
        if ld is not not_mapped:
            lhs = _compat.moveaxis(lhs, ld, 0)
            lc, lb = shift(lc), shift(lb)
        if rd is not not_mapped:
            rhs = _compat.moveaxis(rhs, rd, 0)
            rc, rb = shift(rc), shift(rb)
        if ld is not not_mapped and rd is not not_mapped:
            lb, rb, out_dim = (0, *lb), (0, *rb), 0
        elif ld is not not_mapped:
            out_dim = len(lb)
        else:
            out_dim = len(lb) + (lhs.ndim - len(lc) - len(lb))
        new = dict(params, dimension_numbers=((lc, rc), (lb, rb)))
        a2, t2 = (lhs, rhs) if index == 1 else (rhs, lhs)
        out = tangent_product(inner, new, a2, t2, index, half, out_dtype)
        return out, out_dim
    t16 = t.astype(half)
    out, out_dim = _compat.primitive_batchers[inner](
        _ordered(a, t16, index), _ordered(dims[0], dims[1], index), **_tp_inner_params(inner_params, half)
    )
    return out.astype(out_dtype), out_dim


tangent_product_p.def_impl(_tp_impl)
tangent_product_p.def_effectful_abstract_eval(_tp_abstract_eval)
_compat.primitive_jvps[tangent_product_p] = _tp_jvp
_compat.primitive_transposes[tangent_product_p] = _tp_transpose
_compat.primitive_batchers[tangent_product_p] = _tp_batch
_compat.register_lowering(tangent_product_p, _compat.lower_fun(_tp_impl, multiple_results=False))
