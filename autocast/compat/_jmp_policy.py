"""jmp's precision policies and pytree casts (see `autocast.compat.jmp`)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from .. import _dtypes

T = TypeVar("T")


class _DtypeKeyed(dict):
    """A dict keyed by numpy dtypes that also accepts `jnp.float16`, `np.float32`, ..."""

    def __missing__(self, key: Any) -> Any:
        try:
            dtype = jnp.dtype(key)
        except TypeError:
            raise KeyError(key) from None
        if dtype is key or not dict.__contains__(self, dtype):
            raise KeyError(key)
        return dict.__getitem__(self, dtype)

    def __contains__(self, key: object) -> bool:
        try:
            self[key]
        except KeyError:
            return False
        return True

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default


dtype_to_names: dict[Any, tuple[str, ...]] = _DtypeKeyed(
    {
        jnp.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
        jnp.dtype(jnp.float16): ("f16", "float16"),
        jnp.dtype(jnp.float32): ("full", "f32", "float32"),
        jnp.dtype(jnp.float64): ("f64", "float64"),
    }
)
"""Dtype -> its names in the policy grammar (the first is the one `str(policy)` uses)."""

name_to_dtype: dict[str, np.dtype] = {name: dtype for dtype, names in dtype_to_names.items() for name in names}
"""Name in the policy grammar -> dtype (`"half"` is resolved by `half_dtype`)."""


def half_dtype() -> np.dtype:
    """The half-precision dtype for the default backend: bfloat16 on TPU, float16 elsewhere.

    Returns:
        `jnp.bfloat16` or `jnp.float16`.

    Example:
        ```python
        policy = jmp.get_policy("params=float32,compute=half,output=float32")
        assert policy.compute_dtype == jmp.half_dtype()
        ```
    """
    on_tpu = jax.local_devices()[0].platform == "tpu"
    return jnp.dtype(jnp.bfloat16 if on_tpu else jnp.float16)


def _as_dtype(value: Any, argument: str) -> np.dtype:
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"Policy: `{argument}` must be a floating dtype (e.g. jnp.float16, jnp.bfloat16, "
            f"jnp.float32); got {argument}={value!r}."
        )
    return dtype


def _casts_from(dtype: np.dtype) -> bool:
    """float16/bfloat16/float32 leaves are cast; float64 only when x64 is off (JAX would
    store it as float32 anyway): a float64 value made on purpose is never rounded."""
    if _dtypes.is_castable(dtype):
        return True
    return dtype == np.float64 and not jax.config.jax_enable_x64


def _cast_floating_to(tree: T, dtype: Any) -> T:
    dtype = jnp.dtype(dtype)

    def leaf(x: Any) -> Any:
        if isinstance(x, (np.ndarray, jax.Array)) and x.dtype != dtype and _casts_from(x.dtype):
            return x.astype(dtype)
        return x

    return jax.tree.map(leaf, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters, computation and outputs use (jmp's `Policy`).

    The three dtypes are stored as NumPy dtypes, which compare equal to `jnp.float16`
    and the like. The `cast_to_*` methods cast the float16/bfloat16/float32 array leaves
    of a pytree; integers, booleans, PRNG keys, float8 and non-array leaves are left
    alone, and so is float64 when `jax_enable_x64` is on.

    Args:
        param_dtype: The floating dtype of the parameters.
        compute_dtype: The floating dtype of the computation.
        output_dtype: The floating dtype of the outputs.

    Raises:
        TypeError: A dtype is not a floating dtype.

    Example:
        ```python
        policy = jmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
        assert policy == jmp.get_policy("p=f32,c=bf16,o=f32")
        assert policy.cast_to_compute(params)["w1"].dtype == jnp.bfloat16
        ```
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, _as_dtype(getattr(self, field), field))

    def cast_to_param(self, x: T) -> T:
        """`x` with its floating leaves in `param_dtype`."""
        return _cast_floating_to(x, self.param_dtype)

    def cast_to_compute(self, x: T) -> T:
        """`x` with its floating leaves in `compute_dtype`."""
        return _cast_floating_to(x, self.compute_dtype)

    def cast_to_output(self, x: T) -> T:
        """`x` with its floating leaves in `output_dtype`."""
        return _cast_floating_to(x, self.output_dtype)

    def with_param_dtype(self, param_dtype: Any) -> Policy:
        """A copy with another `param_dtype` (an addition to jmp's API)."""
        return dataclasses.replace(self, param_dtype=param_dtype)

    def with_compute_dtype(self, compute_dtype: Any) -> Policy:
        """A copy with another `compute_dtype` (an addition to jmp's API)."""
        return dataclasses.replace(self, compute_dtype=compute_dtype)

    def with_output_dtype(self, output_dtype: Any) -> Policy:
        """A copy with another `output_dtype`."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        names = (dtype_to_names.get(d, (d.name,))[0] for d in (self.param_dtype, self.compute_dtype, self.output_dtype))
        return "p={},c={},o={}".format(*names)


def parse_dtype(value: str) -> np.dtype:
    """A dtype from its name: `"half"` (see `half_dtype`), `"full"`, `"f32"`,
    `"float16"`, `"bf16"`, ... (the names in `dtype_to_names`).

    Args:
        value: A dtype name.

    Returns:
        The NumPy dtype.

    Raises:
        ValueError: `value` is not one of these names.

    Example:
        ```python
        assert jmp.parse_dtype("bf16") == jnp.bfloat16
        assert jmp.parse_dtype("full") == jnp.float32
        ```
    """
    name = value.strip() if isinstance(value, str) else value
    if name == "half":
        return half_dtype()
    if isinstance(name, str) and name in name_to_dtype:
        return name_to_dtype[name]
    raise ValueError(f"Unknown dtype {value!r}: must be 'half' or one of {', '.join(repr(n) for n in name_to_dtype)}.")


_KEYS = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}


def get_policy(policy_name: str) -> Policy:
    """A `Policy` from a string.

    Args:
        policy_name: Either one dtype name for all three (`"float32"`, `"half"`,
            `"bf16"`, ...), or comma-separated `key=dtype` pairs with keys `p`/`params`,
            `c`/`compute`, `o`/`output`. Params default to float32, compute follows
            params and output follows compute.

    Returns:
        The policy.

    Raises:
        TypeError: `policy_name` is not a string.
        ValueError: A part is not `key=dtype`, a key is unknown or given twice, or a
            dtype name is unknown.

    Example:
        ```python
        assert jmp.get_policy("c=f16") == jmp.Policy(jnp.float32, jnp.float16, jnp.float16)
        policy = jmp.get_policy("p=f32,c=bf16,o=full")  # computes in bfloat16, returns float32
        assert (policy.compute_dtype, policy.output_dtype) == (jnp.bfloat16, jnp.float32)
        ```
    """
    if not isinstance(policy_name, str):
        raise TypeError(f"get_policy: `policy_name` must be a string such as 'p=f32,c=f16'; got {policy_name!r}.")
    if "=" not in policy_name:
        dtype = parse_dtype(policy_name)
        return Policy(dtype, dtype, dtype)
    chosen: dict[str, np.dtype] = {}
    for part in policy_name.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or "=" in value:
            raise ValueError(f"get_policy: {part!r} in {policy_name!r} is not of the form key=dtype (e.g. 'c=f16').")
        if key not in _KEYS:
            raise ValueError(
                f"Unknown key {key!r} in {policy_name!r}: should be 'params', 'compute' or 'output' (or 'p', 'c', 'o')."
            )
        field = _KEYS[key]
        if field in chosen:
            raise ValueError(f"get_policy: {field} is given twice in {policy_name!r}.")
        chosen[field] = parse_dtype(value)
    param = chosen.get("param_dtype", jnp.dtype(jnp.float32))
    compute = chosen.get("compute_dtype", param)
    output = chosen.get("output_dtype", compute)
    return Policy(param, compute, output)


def cast_to_full(tree: T) -> T:
    """`tree` with its floating leaves in float32.

    Args:
        tree: Any pytree.

    Returns:
        The same tree, floating leaves in float32.

    Example:
        ```python
        half = jmp.cast_to_half(params)
        assert jmp.cast_to_full(half)["w1"].dtype == jnp.float32
        ```
    """
    return _cast_floating_to(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
    """`tree` with its floating leaves in `half_dtype`.

    Args:
        tree: Any pytree.

    Returns:
        The same tree, floating leaves in the half dtype.

    Example:
        ```python
        assert jmp.cast_to_half(params)["w1"].dtype == jmp.half_dtype()
        ```
    """
    return _cast_floating_to(tree, half_dtype())
