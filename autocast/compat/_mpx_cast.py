"""MPX-compatible half-precision configuration and pytree casting (see `autocast.compat.mpx`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._amp import amp
from .._dtypes import canonical_compute_dtype, is_castable

_HALF_DTYPES = {np.dtype(jnp.float16): jnp.float16, np.dtype(jnp.bfloat16): jnp.bfloat16}
_HALF_NAMES = {
    "float16": jnp.float16,
    "fp16": jnp.float16,
    "f16": jnp.float16,
    "half": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
}

# The one piece of global state, kept for MPX compatibility. Every function that reads it
# also takes the dtype explicitly, and reads it once (when it is called or a wrapper is
# built), never from inside a traced computation.
_config = {"half": jnp.float16}


def _half_dtype(datatype: Any, argument: str) -> Any:
    """`jnp.float16` or `jnp.bfloat16` for a dtype or name; a clear error otherwise."""
    allowed = "jnp.float16, jnp.bfloat16 or one of the strings " + ", ".join(map(repr, _HALF_NAMES))
    if isinstance(datatype, str):
        key = datatype.strip().lower()
        if key not in _HALF_NAMES:
            raise ValueError(f"{argument}={datatype!r} is not a half-precision dtype name; allowed: {allowed}.")
        return _HALF_NAMES[key]
    try:
        parsed = np.dtype(datatype)
    except TypeError:
        raise TypeError(f"{argument}={datatype!r} is not a dtype; allowed: {allowed}.") from None
    if parsed not in _HALF_DTYPES:
        raise TypeError(f"{argument}={parsed.name} is not a half-precision dtype; allowed: {allowed}.")
    return _HALF_DTYPES[parsed]


def set_half_precision_datatype(datatype: Any) -> None:
    """Set the dtype that `cast_to_half_precision` and the gradient wrappers use.

    Fixes MPX 0.1.8, which accepts the strings `'float16'`/`'bfloat16'` but silently
    ignores them (only dtype objects take effect there).

    Args:
        datatype: `jnp.float16`, `jnp.bfloat16` or a name (`"float16"`, `"bfloat16"`,
            `"fp16"`, `"bf16"`, ...).

    Raises:
        ValueError: `datatype` is a string that names no half-precision dtype (as in MPX).
        TypeError: `datatype` is anything else but float16 or bfloat16 (as in MPX).

    Example:
        ```python
        mpx.set_half_precision_datatype("bfloat16")
        assert mpx.half_precision_datatype() == jnp.bfloat16
        mpx.set_half_precision_datatype(jnp.float16)  # back to the default
        ```
    """
    _config["half"] = _half_dtype(datatype, "datatype")


def half_precision_datatype() -> Any:
    """The configured half-precision dtype: `jnp.float16` (the default) or `jnp.bfloat16`.

    Returns:
        The dtype `set_half_precision_datatype` configured.

    Example:
        ```python
        assert mpx.half_precision_datatype() == jnp.float16  # the default
        ```
    """
    return _config["half"]


def _resolve_half(half_dtype: Any) -> Any:
    return half_precision_datatype() if half_dtype is None else _half_dtype(half_dtype, "half_dtype")


def cast_tree(tree: Any, dtype: Any) -> Any:
    """Cast every float16/bfloat16/float32 array leaf of `tree` to `dtype`.

    Integer, boolean, PRNG-key, float64 and complex arrays, Python numbers and other
    non-array leaves are returned as they are, as in MPX. Objects that are not pytree
    nodes (a plain class holding arrays) are leaves and are not entered.

    Args:
        tree: Any pytree (Equinox modules, dicts, lists, ...).
        dtype: `float16`, `bfloat16` or `float32` (a dtype or a name such as `"bf16"`).

    Returns:
        A pytree with the same structure.

    Raises:
        ValueError: `dtype` is not float16, bfloat16 or float32.

    Example:
        ```python
        out = mpx.cast_tree({"w": jnp.ones(3), "step": 1}, jnp.bfloat16)
        assert out["w"].dtype == jnp.bfloat16 and out["step"] == 1
        ```
    """
    target = canonical_compute_dtype(dtype, argument="dtype")

    def leaf(x: Any) -> Any:
        if eqx.is_array(x) and is_castable(x.dtype) and x.dtype != target:
            return x.astype(target)
        return x

    return jax.tree.map(leaf, tree)


def cast_to_float32(x: Any) -> Any:
    """`cast_tree(x, jnp.float32)`.

    Args:
        x: Any pytree.

    Returns:
        The tree with its floating array leaves in float32.

    Example:
        ```python
        assert mpx.cast_to_float32(params)["w1"].dtype == jnp.float32
        ```
    """
    return cast_tree(x, jnp.float32)


def cast_to_float16(x: Any) -> Any:
    """`cast_tree(x, jnp.float16)`.

    Args:
        x: Any pytree.

    Returns:
        The tree with its floating array leaves in float16.

    Example:
        ```python
        assert mpx.cast_to_float16(params)["w1"].dtype == jnp.float16
        ```
    """
    return cast_tree(x, jnp.float16)


def cast_to_bfloat16(x: Any) -> Any:
    """`cast_tree(x, jnp.bfloat16)`.

    Args:
        x: Any pytree.

    Returns:
        The tree with its floating array leaves in bfloat16.

    Example:
        ```python
        assert mpx.cast_to_bfloat16(params)["w1"].dtype == jnp.bfloat16
        ```
    """
    return cast_tree(x, jnp.bfloat16)


def cast_to_full_precision(x: Any) -> Any:
    """`cast_tree(x, jnp.float32)`.

    Args:
        x: Any pytree.

    Returns:
        The tree with its floating array leaves in float32.

    Example:
        ```python
        assert mpx.cast_to_full_precision(params)["w1"].dtype == jnp.float32
        ```
    """
    return cast_tree(x, jnp.float32)


def cast_to_half_precision(x: Any, half_dtype: Any = None) -> Any:
    """Cast the floating array leaves of `x` to the half-precision dtype.

    Args:
        x: Any pytree.
        half_dtype: `float16` or `bfloat16` (an autocast extension); default: the dtype
            set with `set_half_precision_datatype`, read now.

    Returns:
        The cast pytree.

    Example:
        ```python
        assert mpx.cast_to_half_precision(params)["w1"].dtype == jnp.float16
        assert mpx.cast_to_half_precision(params, half_dtype="bfloat16")["w1"].dtype == jnp.bfloat16
        ```
    """
    return cast_tree(x, _resolve_half(half_dtype))


def _input_dtype(args: Any) -> Any:
    """The dtype that holds every castable array input exactly (None if there are none)."""
    dtypes = {np.dtype(x.dtype) for x in jax.tree.leaves(args) if eqx.is_array(x) and is_castable(x.dtype)}
    return jnp.result_type(*dtypes) if dtypes else None


def cast_function(
    func: Callable,
    dtype: Any,
    return_dtype: Any = None,
    *,
    automatic: bool = False,
    amp_policy: Any = None,
) -> Callable:
    """Wrap `func` so that it computes in `dtype`.

    By default (as in MPX) every floating array in the positional and keyword arguments
    is cast to `dtype` and the outputs to `return_dtype`. Unlike MPX 0.1.8, which casts
    only a tuple or a single array and returns lists and dicts uncast, every output
    pytree is cast.

    With `automatic=True` the arguments are not cast: `func` runs under
    `autocast.amp(func, compute_dtype=dtype, amp_policy=amp_policy)`, so matmuls and
    convolutions run in `dtype` while reductions, softmax, normalisation and other
    sensitive operations stay in float32, primitive by primitive. The outputs keep the
    dtypes `func` returns unless `return_dtype` is given.

    Args:
        func: The function.
        dtype: `float16`, `bfloat16` or `float32`.
        return_dtype: The dtype of the floating outputs; default `dtype` (or, with
            `automatic=True`, the dtypes `func` returns).
        automatic: Use per-primitive rules instead of casting everything (an autocast
            extension).
        amp_policy: A policy for `amp`, with `automatic=True` (an autocast extension).

    Returns:
        The wrapped function.

    Raises:
        ValueError: `dtype` or `return_dtype` is not float16, bfloat16 or float32, or
            `amp_policy` is given without `automatic=True`.

    Example:
        ```python
        fast = mpx.cast_function(model, jnp.bfloat16, automatic=True)
        assert jnp.allclose(fast(x[0]), model(x[0]), atol=5e-2)
        plain = mpx.cast_function(model, jnp.bfloat16)  # arguments and outputs in bfloat16
        assert plain(x[0]).dtype == jnp.bfloat16
        ```
    """
    compute = canonical_compute_dtype(dtype, argument="dtype")
    out_dtype = None if return_dtype is None else canonical_compute_dtype(return_dtype, argument="return_dtype")
    if not automatic:
        if amp_policy is not None:
            raise ValueError("cast_function: amp_policy is only used with automatic=True; got automatic=False.")
        out_dtype = compute if out_dtype is None else out_dtype
        inner = func
    else:
        inner = amp(func, compute_dtype=compute, amp_policy=amp_policy)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not automatic:
            args, kwargs = cast_tree((args, kwargs), compute)
        out = inner(*args, **kwargs)
        return out if out_dtype is None else cast_tree(out, out_dtype)

    return wrapper


def force_full_precision(func: Callable, return_dtype: Any = None) -> Callable:
    """Decorator: run `func` with every floating array argument in float32.

    MPX 0.1.8 casts the outputs to `return_dtype=jnp.float16` by default, even when
    bfloat16 is configured and even when the inputs were float32. Here the default
    casts the outputs back to the dtype of the inputs (the dtype that holds all floating
    array inputs exactly), so half-precision callers get half precision back and float32
    callers keep float32; outputs stay float32 if no floating array was passed.

    Args:
        func: The function.
        return_dtype: The dtype of the floating outputs; default: that of the inputs.

    Returns:
        The wrapped function.

    Raises:
        ValueError: `return_dtype` is not float16, bfloat16 or float32.

    Example:
        ```python
        @mpx.force_full_precision
        def logsumexp(x):
            return jax.nn.logsumexp(x)

        assert logsumexp(jnp.ones(3, jnp.float16)).dtype == jnp.float16  # computed in float32
        ```
    """
    out_dtype = None if return_dtype is None else canonical_compute_dtype(return_dtype, argument="return_dtype")

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        target = out_dtype if out_dtype is not None else _input_dtype((args, kwargs))
        args, kwargs = cast_tree((args, kwargs), jnp.float32)
        out = func(*args, **kwargs)
        return out if target is None else cast_tree(out, target)

    return wrapper
