"""The API of MPX (`mixed-precision-for-jax` 0.1.8, `import mpx`) on autocast's casting and
loss-scaling code: `import autocast.compat.mpx as mpx` and an MPX training step runs
unchanged.

Same names, call signatures and return structures as MPX, with MPX's bugs fixed:

- `filter_grad`/`filter_value_and_grad` unscale the gradients (and the value) with the
  scale the loss was multiplied by. MPX adjusts the scale first and unscales with the new
  one, so on every growth step the gradients and the returned loss are halved.
- The loss is multiplied by the scale in float32. MPX multiplies a float16 loss by a
  float16 copy of the scale, so with its recommended initial scale `FLOAT16_MAX` any
  float16 loss above 1 becomes `inf`, and the value `filter_value_and_grad` returns is
  `inf` (the gradients survive: the backward pass only sees the scale).
- `set_half_precision_datatype("bfloat16")` takes effect (MPX ignores strings silently).
- `DynamicLossScaling` bounds the scale by the maximum of its half dtype, not always
  float16's (and `scale` does not cast the scale to float16).
- `force_full_precision` returns the dtype of its inputs by default (MPX: float16, even
  for float32 inputs or with bfloat16 configured).
- `cast_function` casts every output pytree (MPX casts only a tuple or a single array).

Kept for compatibility: `filter_grad` returns `(scaling, grads_finite, grads[, aux])` but
`filter_value_and_grad` returns `(value[, aux]), scaling, grads_finite, grads`;
`use_mixed_precision=False` reports `grads_finite=True` without checking.

Extensions (keyword-only, optional): `half_dtype=` on the casting and gradient functions
pins the dtype without the global setting; `automatic=True` on `cast_function`,
`filter_grad`, `filter_value_and_grad` and `calculate_scaled_grad` replaces
"cast every argument to half" by `autocast.amp`'s per-primitive rules.

`FLOAT16_MAX`, `BFLOAT16_MAX` (float32 scalars) and `HALF_PRECISION_DATATYPE` (the
configured dtype, read on access) are computed when first read, not at import.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from ._mpx_cast import cast_function as cast_function
from ._mpx_cast import cast_to_bfloat16 as cast_to_bfloat16
from ._mpx_cast import cast_to_float16 as cast_to_float16
from ._mpx_cast import cast_to_float32 as cast_to_float32
from ._mpx_cast import cast_to_full_precision as cast_to_full_precision
from ._mpx_cast import cast_to_half_precision as cast_to_half_precision
from ._mpx_cast import cast_tree as cast_tree
from ._mpx_cast import force_full_precision as force_full_precision
from ._mpx_cast import half_precision_datatype as half_precision_datatype
from ._mpx_cast import set_half_precision_datatype as set_half_precision_datatype
from ._mpx_scaling import DynamicLossScaling as DynamicLossScaling
from ._mpx_scaling import all_finite as all_finite
from ._mpx_scaling import calculate_scaled_grad as calculate_scaled_grad
from ._mpx_scaling import filter_grad as filter_grad
from ._mpx_scaling import filter_value_and_grad as filter_value_and_grad
from ._mpx_scaling import optimizer_update as optimizer_update
from ._mpx_scaling import scaled as scaled
from ._mpx_scaling import select_tree as select_tree

__all__ = [
    "cast_tree",
    "cast_to_float32",
    "cast_to_float16",
    "cast_to_bfloat16",
    "cast_to_full_precision",
    "cast_to_half_precision",
    "force_full_precision",
    "cast_function",
    "half_precision_datatype",
    "set_half_precision_datatype",
    "DynamicLossScaling",
    "all_finite",
    "scaled",
    "select_tree",
    "filter_grad",
    "filter_value_and_grad",
    "optimizer_update",
    "calculate_scaled_grad",
    "FLOAT16_MAX",
    "BFLOAT16_MAX",
    "HALF_PRECISION_DATATYPE",
]

_MAXIMA = {"FLOAT16_MAX": jnp.float16, "BFLOAT16_MAX": jnp.bfloat16}


def __getattr__(name: str) -> Any:
    if name in _MAXIMA:
        return jnp.asarray(jnp.finfo(_MAXIMA[name]).max, dtype=jnp.float32)
    if name == "HALF_PRECISION_DATATYPE":
        return half_precision_datatype()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
