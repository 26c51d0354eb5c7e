"""stochastic_round: exact where representable, unbiased elsewhere, pass-through, sharding, errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autocast.optim import stochastic_round

HALF = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
KEY = jax.random.key(0)


def _all_finite_values(dtype):
    """Every finite value of a 16-bit float dtype, as float32 (exact)."""
    bits = np.arange(2**16, dtype=np.uint16)
    values = bits.view(np.dtype(dtype)).astype(np.float32)
    return values[np.isfinite(values)]


@pytest.mark.parametrize("name", HALF)
def test_representable_values_are_exact(name):
    dtype = HALF[name]
    x = _all_finite_values(dtype)  # subnormals, both zeros and the largest finite included
    y = np.asarray(stochastic_round(jnp.asarray(x), dtype, KEY))
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(y.view(np.uint16), x.astype(np.dtype(dtype)).view(np.uint16))


@pytest.mark.parametrize("name", HALF)
def test_non_finite_values_pass_through(name):
    x = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 1.0], jnp.float32)
    y = np.asarray(stochastic_round(x, HALF[name], KEY)).astype(np.float32)
    assert y[0] == np.inf and y[1] == -np.inf and np.isnan(y[2]) and y[3] == 1.0


def _neighbours(x, dtype):
    """(lo, hi): the values of `dtype` around float32 `x`, toward and away from zero."""
    d = np.dtype(dtype)
    rne = np.float32(x).astype(d)
    toward = rne if abs(float(rne)) <= abs(float(x)) else np.nextafter(rne, d.type(0))
    if float(toward) == float(x):
        return float(toward), float(toward)
    away = np.nextafter(toward, d.type(np.copysign(np.inf, x)))
    return float(toward), float(away)


# Values at and near binade edges, negative ones, and subnormals of each target.
UNBIASED = {
    "bfloat16": [
        1.0 + 2.0**-10,
        -(1.0 + 2.0**-10),
        3.14159265,
        -2.71828,
        1.0 - 2.0**-12,
        2.0 - 2.0**-20,
        1e-3,
        1.3 * 2.0**-130,
    ],
    "float16": [1.0 + 2.0**-13, -3.14159265, 1.0 - 2.0**-14, 2.0**-14 - 2.0**-30, 1e-6, -3e-8, 60000.5, 1e-3],
}


@pytest.mark.parametrize("name", HALF)
def test_unbiased_near_binade_edges_and_subnormals(name):
    dtype = HALF[name]
    n = 100_000
    values = UNBIASED[name]
    x = jnp.repeat(jnp.asarray(values, jnp.float32), n).reshape(len(values), n)
    y = np.asarray(stochastic_round(x, dtype, KEY)).astype(np.float64)
    for row, v in zip(y, values):
        v32 = float(np.float32(v))
        lo, hi = _neighbours(v32, dtype)
        assert lo != hi, v
        assert set(np.unique(row)) <= {lo, hi}, (v, np.unique(row))
        p = (v32 - lo) / (hi - lo)
        # the mean of n Bernoulli(p) draws, in units of the spacing: 6 standard deviations
        tol = 6 * np.sqrt(p * (1 - p) / n) * abs(hi - lo)
        assert abs(row.mean() - v32) < tol, (v, row.mean(), v32, tol)


def test_float16_overflow_and_largest_values():
    x = jnp.array([65519.0, 65535.0, 65536.0, 1e6, -1e6], jnp.float32)
    y = np.asarray(stochastic_round(jnp.repeat(x[:, None], 4000, 1), jnp.float16, KEY)).astype(np.float64)
    assert set(np.unique(y[0])) == {65504.0, np.inf}  # rounds up to inf with p = 15/32
    assert abs(np.mean(y[0] == np.inf) - 15 / 32) < 0.04
    assert abs(np.mean(y[1] == np.inf) - 31 / 32) < 0.02
    assert np.all(y[2:4] == np.inf) and np.all(y[4] == -np.inf)


def test_same_key_same_bits_and_leaves_get_independent_bits():
    x = jnp.full((4096,), 1.0 + 2.0**-8, jnp.float32)  # halfway: p = 1/2
    a = stochastic_round({"a": x, "b": x}, jnp.bfloat16, KEY)
    again = stochastic_round({"a": x, "b": x}, jnp.bfloat16, KEY)
    other = stochastic_round({"a": x, "b": x}, jnp.bfloat16, jax.random.key(1))
    bits = lambda t: np.asarray(t).view(np.uint16)
    np.testing.assert_array_equal(bits(a["a"]), bits(again["a"]))
    assert 0.4 < np.mean(bits(a["a"]) != bits(a["b"])) < 0.6  # the two leaves are independent
    assert 0.4 < np.mean(bits(a["a"]) != bits(other["a"])) < 0.6
    # a raw uint32[2] key works too
    raw = stochastic_round(x, jnp.bfloat16, jax.random.PRNGKey(0))
    assert raw.dtype == jnp.bfloat16


def test_non_float32_leaves_are_not_touched():
    tree = {
        "count": jnp.int32(7),
        "mask": jnp.array([True, False]),
        "already": jnp.array([1.5], jnp.bfloat16),
        "fn": jax.nn.relu,
        "f8": jnp.array([1.0], jnp.float8_e4m3fn),
        "w": jnp.array([1.0, 2.0], jnp.float32),
    }
    out = stochastic_round(tree, jnp.bfloat16, KEY)
    for name in ("count", "mask", "already", "fn", "f8"):
        assert out[name] is tree[name], name
    assert out["w"].dtype == jnp.bfloat16
    # float16 leaves are rounded to bfloat16 as well (through their exact float32 values)
    assert stochastic_round(jnp.array([1.0], jnp.float16), jnp.bfloat16, KEY).dtype == jnp.bfloat16


def test_stale_update_round_to_nearest_never_moves_stochastic_tracks_float32():
    steps, delta, copies = 1000, 1e-4, 64

    def body(i, state):
        nearest, stochastic, exact = state
        nearest = (nearest.astype(jnp.float32) + delta).astype(jnp.bfloat16)
        stochastic = stochastic_round(stochastic.astype(jnp.float32) + delta, jnp.bfloat16, jax.random.fold_in(KEY, i))
        return nearest, stochastic, exact + delta

    one = jnp.ones((copies,), jnp.bfloat16)
    nearest, stochastic, exact = jax.jit(lambda s: jax.lax.fori_loop(0, steps, body, s))(
        (one, one, jnp.ones((copies,), jnp.float32))
    )
    assert np.all(np.asarray(nearest, np.float32) == 1.0)  # 1e-4 < half of bfloat16's 2**-7 at 1.0
    s = np.asarray(stochastic, np.float64)
    target = float(exact[0])  # 1.1 in float32
    assert abs(s.mean() - target) / target < 0.01
    assert np.all(np.abs(s - target) / target < 0.1)


def test_sharded_rounding_is_per_shard_and_matches_unsharded():
    devices = np.array(jax.devices()[:4])
    mesh = Mesh(devices, ("d",))
    x = jax.random.normal(jax.random.key(3), (64, 48), jnp.float32)
    sharding = NamedSharding(mesh, P("d", None))
    xs = jax.device_put(x, sharding)
    f = jax.jit(lambda x, k: stochastic_round(x, jnp.bfloat16, k))
    single = f(x, KEY)
    sharded = f(xs, KEY)
    assert sharded.sharding.is_equivalent_to(sharding, 2)
    assert len(sharded.addressable_shards) == 4
    np.testing.assert_array_equal(np.asarray(sharded).view(np.uint16), np.asarray(single).view(np.uint16))


def test_bad_arguments_name_the_argument():
    x = jnp.ones(3)
    with pytest.raises(ValueError, match=r"`dtype` must be jnp.bfloat16 or jnp.float16; got dtype=.*float32"):
        stochastic_round(x, jnp.float32, KEY)
    with pytest.raises(ValueError, match="`dtype`"):
        stochastic_round(x, "int8", KEY)
    with pytest.raises(TypeError, match=r"`key` must be a PRNG key.*got key=0"):
        stochastic_round(x, jnp.bfloat16, 0)
    with pytest.raises(ValueError, match="single PRNG key"):
        stochastic_round(x, jnp.bfloat16, jax.random.split(KEY, 2))
    with pytest.raises(TypeError, match=r"leaf `tree\['w'\]` is float64"):
        stochastic_round({"w": np.ones(2, np.float64)}, jnp.bfloat16, KEY)


def test_bfloat16_matches_ml_dtypes_truncation_bounds():
    # every result is one of the two neighbours: truncation toward zero or one step away
    x = jax.random.normal(jax.random.key(5), (20_000,), jnp.float32) * 1e3
    y = np.asarray(stochastic_round(x, jnp.bfloat16, KEY)).astype(np.float64)
    xf = np.asarray(x)
    toward = (xf.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    away = np.nextafter(toward.astype(ml_dtypes.bfloat16), np.copysign(np.inf, xf).astype(ml_dtypes.bfloat16))
    assert np.all((y == toward) | (y == away.astype(np.float64)))
