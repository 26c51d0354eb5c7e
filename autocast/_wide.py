"""Matmuls with a float32 result or float32 operand cotangents, and a half-precision
backward pass.

Two things a plain half-precision matmul `dot(a16, w16)` gets wrong:

- **Its result, when only float32 consumers read it.** It is stored in half precision and
  converted back: rounded for nothing. With `wide=True` `bind` binds the primitive
  with `preferred_element_type=float32` instead: the same half-precision operands and
  float32 accumulation, no rounding of the result (and no half-precision output pass on
  backends without half-precision GEMMs, such as XLA-CPU).
- **The cotangent of a parameter narrowed from float32** (a free operand: see
  `autocast._interpreter`; a computed weight, such as a LoRA sum, is not one). JAX
  transposes `dot(a16, w16)` into `dW = a16^T . dy16` with a half-precision result, and
  only then converts it to float32: per-device partial sums are rounded to half before a
  partitioner's all-reduce or reduce-scatter, a `psum`, or a scan's accumulation over
  steps. For each operand `i` in `float32_cotangent` (its float32 value is passed in
  `arrived`), `bind` makes the tangent path from that float32 value a
  `tangent_product` (`autocast._compat`), whose transpose is the same
  half-precision dot with a float32 result: the weight gradient leaves the matmul in
  float32 (same operands and FLOPs; a weight-sized float32 output). The activation
  gradient stays half.

Only `dot_general`: a convolution keeps its half-precision result, forward and backward,
and its weight cotangent is converted to float32 after the convolution (as in PyTorch's
autocast). GPUs have no half-operand convolution with a float32 output (cuDNN computes
in float32 and stores half); XLA:GPU would run a float32-result convolution on float32
operands, twice the bytes of the half ones and no tensor cores. Same program, same
numerics, on every platform.

The forward stays a plain `dot_general` (checkpoint policies
such as `dots_saveable` and the interpreter's island checkpoints see it by name). The
derivative is a `custom_jvp` rule: the tangent of a half operand is the half-precision
matmul of the tangent (converted to float32 for a float32 result, so a float32 cotangent
is rounded to half once and both transposed matmuls run in half precision, rather than
JAX's float32 x half transpose of a float32-result matmul).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat, _cpu_matmul, _dtypes, _tangent_product

BILINEAR = frozenset({"dot_general"})
"""Primitives that get a float32 result or float32 cotangent from half operands; bilinear in
their two operands (`ad.defbilinear` in JAX): the tangent is the sum of the primitive
applied to one operand's tangent and the other's primal. Not `conv_general_dilated`
(see the module docstring)."""


def applies(prim: Any, ops: Sequence[Any], params: dict[str, Any]) -> bool:
    """Whether `bind` can stand in for binding `prim` on `ops`: a bilinear
    primitive with two operands of one half dtype, storing its result in that dtype."""
    if prim.name not in BILINEAR or len(ops) != 2:
        return False
    dtypes = {_dtypes.dtype_of(x) for x in ops}
    if len(dtypes) != 1:
        return False
    (dtype,) = dtypes
    pref = params.get("preferred_element_type")
    return dtype in _dtypes.CASTABLE and dtype != _dtypes.FLOAT32 and (pref is None or np.dtype(pref) == dtype)


def narrowed(arrived: Sequence[Any], ops: Sequence[Any], free: Sequence[Any]) -> list[int]:
    """The free operands (parameters, or values only reshaped, sliced or summed from them:
    not activations) that arrived in float32 and were narrowed to half precision, as traced
    values (they may have a gradient): those whose cotangent `bind` keeps in float32.
    An activation's gradient stays half."""
    return [
        i
        for i, (x, y, f) in enumerate(zip(arrived, ops, free))
        if f
        and _compat.is_tracer(x)
        and _dtypes.dtype_of(x) == _dtypes.FLOAT32
        and _dtypes.dtype_of(y) != _dtypes.FLOAT32
        and np.shape(x) == np.shape(y)
    ]


def bind(
    prim: Any,
    ops: Sequence[Any],
    params: dict[str, Any],
    *,
    wide: bool = False,
    arrived: Sequence[Any] | None = None,
    float32_cotangent: Sequence[int] = (),
) -> list[Any]:
    """Bind `prim` on half-precision `ops` (see the module docstring): with a float32
    result if `wide`; with a float32 cotangent for each operand `i` in
    `float32_cotangent`, whose float32 value (`ops[i]` is its cast) is `arrived[i]`.
    Requires `applies`."""
    half = _dtypes.dtype_of(ops[0])
    out_dtype = _dtypes.FLOAT32 if wide else half
    half_params = dict(params, preferred_element_type=half)
    out_params = dict(params, preferred_element_type=out_dtype)
    f32 = tuple(float32_cotangent)
    extra = [arrived[i] for i in f32] if f32 and arrived is not None else []

    def primal(a, b, *_float32_values):
        return _cpu_matmul.bind(prim, [a, b], out_params)[0]

    def jvp(primals, tangents):
        a, b = primals[:2]
        terms = []
        for i in (0, 1):
            if i in f32:
                # the tangent of the float32 value this operand was narrowed from (the
                # tangent of the narrowed operand itself is its cast: not counted twice)
                t = tangents[2 + f32.index(i)]
                if not _compat.is_zero(t):
                    other = primals[1 - i]
                    terms.append(_tangent_product.tangent_product(prim, params, other, t, i, half, out_dtype))
                continue
            t = tangents[i]
            if not _compat.is_zero(t):
                args = [a, b]
                args[i] = t
                term = _cpu_matmul.bind(prim, args, half_params)[0]
                terms.append(lax.convert_element_type(term, out_dtype) if term.dtype != out_dtype else term)
        out = primal(*primals)
        tangent = sum(terms[1:], terms[0]) if terms else jnp.zeros(out.shape, out.dtype)
        return out, tangent

    parts = (["float32_result"] if wide else []) + [f"float32_cotangent{i}" for i in f32]
    primal.__name__ = primal.__qualname__ = f"{prim.name}_{'_'.join(parts)}"  # its name in jaxprs
    call = jax.custom_jvp(primal)
    call.defjvp(jvp, symbolic_zeros=True)
    return [call(*ops, *extra)]
