"""Stochastic rounding from float32 to bfloat16 or float16, by integer arithmetic on the bits.

Round-to-nearest loses every update smaller than half a unit in the last place: a bfloat16
weight of 1.0 ignores `+ 1e-4` forever (its spacing there is 2**-7). Stochastic rounding
rounds up with probability equal to the distance to the lower neighbour in units of the
spacing, so the rounded value equals the float32 value in expectation and small updates
accumulate on average.

How it is computed (exactly, without floating-point arithmetic):

- bfloat16 keeps the upper 16 bits of a float32. Add 16 uniform random bits to the lower
  16 and truncate: the carry into bit 16 happens with probability `low / 2**16`. Float32
  bit patterns are ordered like their magnitudes, so this also holds across binades,
  subnormals and the sign (rounding acts on the magnitude).
- float16 has a smaller exponent range. With `x = m * 2**(e - 23)` (24-bit significand
  `m`), the float16 spacing at `x` is `2**(max(e, -14) - 10)`, i.e. `d` bits of `m`
  are dropped, `d = 13` for normal float16 values and more below `2**-14` (subnormals).
  Then `k = (m + r) >> d` with `r` uniform on `[0, 2**d)` is the rounded value in units
  of the spacing, and the float16 bits are `k + ((max(e, -14) + 14) << 10)`: carries
  into the next binade, out of the subnormal range and into infinity come out right.

Sharp edges:

- Values beyond the largest finite value round to infinity with the probability of their
  distance to it in units of the spacing (float16: `|x|` in (65504, 65536)); `|x| >= 65536`
  gives float16 infinity, as a plain cast does. Non-finite values pass through.
- float16 only: below `2**-32` (far below float16's smallest subnormal, `2**-24`) the
  probability of rounding up is truncated to a multiple of `2**-32`: a bias below `2**-56`.
  Everything else is exactly unbiased.
- The random bits: one `jax.random.bits(key, (n, 2))` call gives each of the `n` rounded
  leaves a 64-bit seed, and each element gets `fmix32(fmix32(index + seed[0]) ^ seed[1])`
  (MurmurHash3's finaliser) of its flat index. One threefry block per call, not one per
  leaf (each is a large block of HLO to compile), and the bits depend only on the global
  index: a sharded array is rounded per shard, identically to the unsharded one. For a
  fixed element, uniform seeds give exactly uniform bits, so the rounding is unbiased
  over keys.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["stochastic_round"]

_HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_ROUNDED = (np.dtype(jnp.float32), *_HALF)


def _half_dtype(dtype: Any, where: str) -> np.dtype:
    """`dtype` as bfloat16 or float16, or an error naming the argument."""
    try:
        parsed = np.dtype(dtype)
    except TypeError:
        parsed = None
    if parsed not in _HALF:
        raise ValueError(f"{where}: `dtype` must be jnp.bfloat16 or jnp.float16; got dtype={dtype!r}.")
    return parsed


def _check_key(key: Any, where: str) -> jax.Array:
    """A scalar typed PRNG key or a raw uint32[2] key, or an error naming the argument."""
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(f"{where}: `key` must be a single PRNG key; got a key array of shape {key.shape}.")
        return key
    if isinstance(key, jax.Array | np.ndarray) and key.dtype == np.uint32 and key.shape == (2,):
        return jnp.asarray(key)
    raise TypeError(
        f"{where}: `key` must be a PRNG key (jax.random.key(seed) or jax.random.PRNGKey(seed)); got key={key!r}."
    )


def _round_bfloat16(x: jax.Array, bits: jax.Array) -> jax.Array:
    u = lax.bitcast_convert_type(x, jnp.uint32)
    rounded = ((u + bits.astype(jnp.uint32)) >> 16).astype(jnp.uint16)  # bits: uint16, so no wrap-around
    return lax.bitcast_convert_type(rounded, jnp.bfloat16)


def _round_float16(x: jax.Array, bits: jax.Array) -> jax.Array:
    u = lax.bitcast_convert_type(x, jnp.uint32)
    one = jnp.uint32(1)
    sign = u >> 31
    biased = ((u >> 23) & 0xFF).astype(jnp.int32)
    m = (u & 0x7FFFFF) | jnp.where(biased > 0, jnp.uint32(1 << 23), jnp.uint32(0))  # 24-bit significand
    e = jnp.maximum(biased, 1) - 127  # x = m * 2**(e - 23), float32 subnormals included
    e16 = jnp.maximum(e, -14)
    d = e16 - e + 13  # significand bits below the float16 spacing: 13 .. 125
    small = jnp.minimum(d, 31).astype(jnp.uint32)
    k_small = (m + (bits & ((one << small) - one))) >> small  # exact for d <= 31
    big_shift = jnp.clip(d - 32, 0, 31).astype(jnp.uint32)
    k_big = (bits < (m >> big_shift)).astype(jnp.uint32)  # P(up) = floor(m / 2**(d-32)) / 2**32
    k = jnp.where(d <= 31, k_small, k_big)
    magnitude = k + ((e16 + 14).astype(jnp.uint32) << 10)
    magnitude = jnp.where(e >= 16, jnp.uint32(0x7C00), jnp.minimum(magnitude, jnp.uint32(0x7C00)))
    return lax.bitcast_convert_type((magnitude | (sign << 15)).astype(jnp.uint16), jnp.float16)


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijection on uint32 with full avalanche."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _element_bits(shape: tuple[int, ...], seed: jax.Array) -> jax.Array:
    """32 random bits per element: a hash of the element's flat index and a 64-bit seed.

    Counter-based, so it depends only on the global index (a sharded array gets the same
    bits, computed per shard) and compiles to a few integer operations. For a fixed index,
    a uniform seed gives exactly uniform bits (both hash steps are bijections).
    """
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return _fmix32(_fmix32(index + seed[0]) ^ seed[1])


def _round_with_seed(x: jax.Array, dtype: np.dtype, seed: jax.Array) -> jax.Array:
    """One floating array (float32, float16 or bfloat16) rounded stochastically to `dtype`."""
    wide = x.astype(jnp.float32)  # exact from float16/bfloat16
    bits = _element_bits(x.shape, seed)
    if dtype == np.dtype(jnp.bfloat16):
        rounded = _round_bfloat16(wide, (bits >> 16).astype(jnp.uint16))
    else:
        rounded = _round_float16(wide, bits)
    return jnp.where(jnp.isfinite(wide), rounded, wide.astype(dtype))


def _round_leaves(xs: list[jax.Array], dtypes: list[np.dtype], key: jax.Array) -> list[jax.Array]:
    """Each `xs[i]` rounded to `dtypes[i]`, with seed `i` of `jax.random.bits(key, (n, 2))`.

    One threefry call for all the leaves (each call is a large block of HLO to compile),
    then a cheap counter-based hash per element.
    """
    if not xs:
        return []
    seeds = jax.random.bits(key, (len(xs), 2), jnp.uint32)
    return [x if x.dtype == d else _round_with_seed(x, d, seeds[i]) for i, (x, d) in enumerate(zip(xs, dtypes))]


def _rounds(x: Any) -> bool:
    return eqx.is_array(x) and np.dtype(x.dtype) in _ROUNDED


def stochastic_round(tree: Any, dtype: Any, key: Any) -> Any:
    """Round every float32 leaf of `tree` to `dtype` stochastically: unbiased, exact where representable.

    A value between two neighbours `lo < x < hi` of `dtype` becomes `hi` with probability
    `(x - lo) / (hi - lo)` and `lo` otherwise, so `E[stochastic_round(x)] == x`: updates
    smaller than the spacing of `dtype` are not lost on average, as they are with
    round-to-nearest. Values that `dtype` represents come back exactly; inf and NaN pass
    through. Computed with integer arithmetic on the float32 bits (see the module
    docstring), with independent random bits for every leaf and element.

    Args:
        tree: An array or any pytree (an Equinox module, Flax params or NNX state,
            an optax state). float32 leaves are rounded; float16/bfloat16 leaves of the other
            half dtype as well; leaves already in `dtype`, integer, boolean, float8, complex and
            non-array leaves are returned as they are. float64 leaves raise (cast them first).
        dtype: `jnp.bfloat16` or `jnp.float16`.
        key: A PRNG key (`jax.random.key` or `jax.random.PRNGKey`). The same key gives
            the same result. The `i`-th rounded leaf (in `jax.tree.leaves` order) gets the
            64-bit seed `jax.random.bits(key, (n, 2))[i]`, and each element the hash of that
            seed and its index (a counter-based generator: cheap to compile, and the same bits
            however the array is sharded).

    Returns:
        `tree` with its float32 leaves (and those of the other half dtype) in `dtype`.

    Raises:
        ValueError: `dtype` is not bfloat16 or float16, or `key` is an array of several keys.
        TypeError: A leaf is float64, or `key` is not a PRNG key.

    Example:
        ```python
        x = jnp.full((10_000,), 1.0 + 2.0**-10)  # between bfloat16's 1.0 and 1.0078125
        y = autocast.optim.stochastic_round(x, jnp.bfloat16, jax.random.key(0))
        assert y.dtype == jnp.bfloat16 and set(np.unique(np.asarray(y, np.float32))) == {1.0, 1.0078125}
        assert abs(float(jnp.mean(y.astype(jnp.float32))) - (1.0 + 2.0**-10)) < 2e-4  # unbiased
        assert x.astype(jnp.bfloat16)[0] == 1.0  # round-to-nearest always gives 1.0
        ```
    """
    half = _half_dtype(dtype, "stochastic_round")
    key = _check_key(key, "stochastic_round")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    for path, x in leaves:
        if eqx.is_array(x) and x.dtype == np.float64:
            raise TypeError(
                f"stochastic_round: leaf `tree{jax.tree_util.keystr(path)}` is float64; "
                "only float32, float16 and bfloat16 leaves are rounded (cast it to float32 first)."
            )
    chosen = [i for i, (_, x) in enumerate(leaves) if _rounds(x) and x.dtype != half]
    rounded = _round_leaves([jnp.asarray(leaves[i][1]) for i in chosen], [half] * len(chosen), key)
    out = [x for _, x in leaves]
    for i, r in zip(chosen, rounded):
        out[i] = r
    return jax.tree_util.tree_unflatten(treedef, out)
