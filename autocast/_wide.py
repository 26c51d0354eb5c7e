"""Matmuls whose result only float32 consumers read: a float32 result, a half-precision
derivative.

A matmul (or convolution) in the compute dtype normally stores its result in half
precision, and a float32 consumer (the LSTM's gates, a loss) converts it back: the result
is rounded for nothing. When every consumer reads it in float32, :func:`bind` binds the
primitive with ``preferred_element_type=float32`` instead: the same half-precision
operands and float32 accumulation, no rounding of the result (and no half-precision
output pass on backends without half-precision GEMMs, such as XLA-CPU).

Its derivative stays what it was. JAX would transpose a float32-result matmul into
float32 x half matmuls (a float32 GEMM on GPUs); here a ``custom_jvp`` rule gives the
tangent as the half-precision matmul of the tangent, converted to float32, so the backward
pass rounds the cotangent to half precision once and runs both transposed matmuls in half
precision, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat, _dtypes

BILINEAR = frozenset({"dot_general", "conv_general_dilated"})
"""Primitives bilinear in their two operands (``ad.defbilinear`` in JAX): the tangent is
the sum of the primitive applied to one operand's tangent and the other's primal."""


def applies(prim: Any, ops: Sequence[Any], params: dict[str, Any]) -> bool:
    """Whether :func:`bind` can stand in for binding ``prim`` on ``ops``: a bilinear
    primitive with two operands of one half dtype, storing its result in that dtype."""
    if prim.name not in BILINEAR or len(ops) != 2:
        return False
    dtypes = {_dtypes.dtype_of(x) for x in ops}
    if len(dtypes) != 1:
        return False
    (dtype,) = dtypes
    pref = params.get("preferred_element_type")
    return dtype in _dtypes.CASTABLE and dtype != _dtypes.FLOAT32 and (pref is None or np.dtype(pref) == dtype)


def bind(prim: Any, ops: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    """Bind ``prim`` with a float32 result, its tangent computed in the operands' dtype
    (see the module docstring). Requires :func:`applies`."""
    half_params = dict(params, preferred_element_type=_dtypes.dtype_of(ops[0]))
    wide_params = dict(params, preferred_element_type=_dtypes.FLOAT32)

    def primal(a, b):
        return _compat.bind(prim, [a, b], wide_params)[0]

    def jvp(primals, tangents):
        terms = []
        for i, t in enumerate(tangents):
            if not _compat.is_zero(t):
                args = list(primals)
                args[i] = t
                terms.append(lax.convert_element_type(_compat.bind(prim, args, half_params)[0], _dtypes.FLOAT32))
        out = primal(*primals)
        tangent = sum(terms[1:], terms[0]) if terms else jnp.zeros(out.shape, out.dtype)
        return out, tangent

    primal.__name__ = primal.__qualname__ = f"{prim.name}_float32_result"  # its name in jaxprs
    call = jax.custom_jvp(primal)
    call.defjvp(jvp, symbolic_zeros=True)
    return [call(*ops)]
