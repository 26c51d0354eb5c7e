"""Which dtypes autocast may change, and how it changes them."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat

# The only dtypes autocast ever casts from or to. float64, complex, float8, integers,
# booleans and PRNG keys are never touched.
CASTABLE = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32))
FLOAT32 = np.dtype(jnp.float32)
HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))

_ALIASES = {
    "float16": jnp.float16,
    "f16": jnp.float16,
    "half": jnp.float16,
    "fp16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float32": jnp.float32,
    "f32": jnp.float32,
    "fp32": jnp.float32,
    "full": jnp.float32,
    "single": jnp.float32,
}
ALLOWED_COMPUTE = (
    "float16, bfloat16 or float32 (a dtype, or one of the strings " + ", ".join(repr(k) for k in _ALIASES) + ")"
)


def canonical_compute_dtype(dtype: Any, *, argument: str = "compute_dtype") -> np.dtype:
    """Parse a compute dtype; a ValueError that lists the allowed values otherwise."""
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        if key in _ALIASES:
            return np.dtype(_ALIASES[key])
        raise ValueError(f"{argument}={dtype!r} is not a known dtype name; allowed: {ALLOWED_COMPUTE}.")
    try:
        parsed = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"{argument}={dtype!r} is not a dtype; allowed: {ALLOWED_COMPUTE}.") from None
    if parsed not in CASTABLE:
        raise ValueError(f"{argument}={parsed.name} is not supported; allowed: {ALLOWED_COMPUTE}.")
    return parsed


def dtype_of(x: Any) -> Any:
    """`x`'s dtype: a NumPy dtype, or an extended dtype as JAX has it (a PRNG key's)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return np.dtype(np.result_type(x))
    try:
        return np.dtype(dtype)
    except TypeError:  # extended dtypes (PRNG keys) are not numpy dtypes
        return dtype


def is_castable(dtype: Any) -> bool:
    """float16, bfloat16 or float32: the dtypes mixed precision moves between."""
    try:
        return np.dtype(dtype) in CASTABLE
    except TypeError:  # extended dtypes (PRNG keys) are not numpy dtypes
        return False


def is_floating(dtype: Any) -> bool:
    try:
        return jnp.issubdtype(dtype, jnp.floating)
    except TypeError:
        return False


def widest(dtypes: Any) -> np.dtype:
    """The narrowest castable dtype that represents all of `dtypes` exactly."""
    dtypes = {np.dtype(d) for d in dtypes}
    if len(dtypes) == 1:
        return next(iter(dtypes))
    return FLOAT32  # {f16, bf16} or anything with f32


# One cast per (value, dtype) within one jaxpr evaluation: several consumers that need the
# same value in float32 share one convert. Keyed by id(); the value is kept alive with it.
_cast_memo: contextvars.ContextVar[dict | None] = contextvars.ContextVar("cast_memo", default=None)


@contextlib.contextmanager
def memoised_casts() -> Iterator[None]:
    """Share casts of the same value to the same dtype within this block (one trace). The
    overrides of an enclosing block (`cast_override`) hold here too: a rule that evaluates
    equations (the loss head's chunks) may hand them a cast made once, outside."""
    outer = _cast_memo.get() or {}
    token = _cast_memo.set({k: v for k, v in outer.items() if isinstance(v[1], _Lazy)})
    try:
        yield
    finally:
        _cast_memo.reset(token)


class _Lazy:
    """A memo entry built on first use (see `cast_override`)."""

    def __init__(self, make):
        self.make, self.value = make, None

    def get(self) -> Any:
        if self.value is None:
            self.value = self.make()
        return self.value


@contextlib.contextmanager
def cast_override(x: Any, dtype: Any, make) -> Iterator[None]:
    """Within the block, `cast(x, dtype)` returns `make()` (built once, on first use)
    instead of a plain convert. Needs an enclosing `memoised_casts`."""
    memo = _cast_memo.get()
    if memo is None:
        yield
        return
    key = (id(x), np.dtype(dtype))
    before = memo.get(key)
    memo[key] = (x, _Lazy(make))
    try:
        yield
    finally:
        if before is None:
            del memo[key]
        else:
            memo[key] = before


def cast(x: Any, dtype: Any) -> Any:
    """Cast `x` to `dtype` if it is castable and not already of that dtype.

    A concrete value (a literal, a NumPy or JAX constant) saturates: a finite value beyond
    the target dtype's range becomes its largest finite value instead of an infinity
    (infinities and NaNs stay as they are), so `jnp.finfo(jnp.float32).min` used as a mask
    value stays a large negative number in float16 and bfloat16 and a fully masked softmax
    row does not become NaN. Traced values convert as they are (see `saturating_cast`).
    """
    if not is_castable(dtype):  # never to an integer, boolean or key dtype (nor from one, below)
        return x
    dtype = np.dtype(dtype)
    src = dtype_of(x)
    if src == dtype or not is_castable(src) or _compat.is_ref(x):
        return x
    memo = _cast_memo.get()
    if memo is not None:
        key = (id(x), dtype)
        hit = memo.get(key)
        if hit is not None:
            return hit[1].get() if isinstance(hit[1], _Lazy) else hit[1]
        out = _convert(x, dtype)
        memo[key] = (x, out)
        return out
    return _convert(x, dtype)


def narrower(dtype: Any, than: Any) -> bool:
    """Whether `dtype` has a smaller range than `than` (float16 or bfloat16 below float32)."""
    return bool(jnp.finfo(dtype).max < jnp.finfo(than).max)


def fits(x: Any, dtype: Any) -> bool:
    """Whether every finite value of the concrete `x` is within `dtype`'s finite range."""
    a = np.asarray(x, dtype=np.float32)
    limit = float(jnp.finfo(dtype).max)
    return bool(np.all(~np.isfinite(a) | (np.abs(a) <= limit)))


def is_concrete(x: Any) -> bool:
    """A value known at trace time: a Python or NumPy number or array, or a JAX array that is
    not a tracer."""
    return not _compat.is_tracer(x) and not _compat.is_ref(x)


def saturating_cast(x: Any, dtype: Any) -> Any:
    """`x` cast to `dtype`, a finite value beyond its range clamped to its largest
    finite value (infinities and NaNs kept): the cast of a fill or constant that autocast
    narrows (`jnp.where(mask, logits, jnp.finfo(jnp.float32).min)`, where the fill reaches
    the `where` through a call). Its derivative is the conversion's, as the float32
    original's is the identity: the backward pass keeps nothing for it (a parameter
    saturated on its way into a `concatenate`, a class token, kept no float32 copy and
    masks)."""
    dtype = np.dtype(dtype)
    src = dtype_of(x)
    if is_concrete(x) or src == dtype or not narrower(dtype, src):
        return cast(x, dtype)
    return _saturate(x, dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _saturate(x: Any, dtype: np.dtype) -> Any:
    limit = np.asarray(jnp.finfo(dtype).max, dtype=dtype_of(x))
    clamped = lax.clamp(-limit, x, limit)
    return lax.convert_element_type(lax.select(lax.is_finite(x), clamped, x), dtype)


@_saturate.defjvp
def _saturate_jvp(dtype: np.dtype, primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    return _saturate(primals[0], dtype), lax.convert_element_type(tangents[0], dtype)


def _convert(x: Any, dtype: np.dtype) -> Any:
    host = isinstance(x, (np.ndarray, np.generic, float))
    if (host or is_concrete(x)) and narrower(dtype, dtype_of(x)) and not fits(x, dtype):
        limit = float(jnp.finfo(dtype).max)
        a = np.asarray(x, dtype=np.float32)
        return np.asarray(np.where(np.isfinite(a), np.clip(a, -limit, limit), a), dtype=dtype)
    if host:
        return np.asarray(x, dtype=dtype)
    return lax.convert_element_type(x, dtype)
