"""compute_dtype=float32: amp is an exact identity (bit for bit) on float32 inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autocast import amp

UNARY = [
    jnp.exp,
    jnp.log1p,
    jnp.tanh,
    jnp.sin,
    jnp.cos,
    jnp.abs,
    jnp.sqrt,
    jax.nn.relu,
    jax.nn.gelu,
    jax.nn.silu,
    jax.nn.softplus,
    jax.nn.sigmoid,
    jax.nn.swish,
    jax.nn.elu,
    jax.scipy.special.erf,
    lambda x: x**2,
    lambda x: x**3,
    lambda x: 1.0 / (1.0 + x * x),
    lambda x: jnp.clip(x, -0.5, 0.5),
    lambda x: jnp.where(x > 0, x, 0.1 * x),
    lambda x: jax.lax.rsqrt(x * x + 1.0),
    lambda x: jnp.cumsum(x, axis=-1),
    lambda x: jax.nn.softmax(x, axis=-1),
    lambda x: jax.nn.log_softmax(x, axis=-1),
    lambda x: x - jnp.mean(x, axis=-1, keepdims=True),
    lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True).clip(1e-3),
    lambda x: jnp.sort(x, axis=-1),
    lambda x: jnp.flip(x, axis=0),
    lambda x: x.T.reshape(x.shape),
]
BINARY = [
    jnp.add,
    jnp.subtract,
    jnp.multiply,
    jnp.maximum,
    jnp.minimum,
    lambda a, b: a @ b.T @ a,
    lambda a, b: jnp.where(a > b, a, b),
    lambda a, b: jnp.concatenate([a, b], axis=0)[: a.shape[0]],
    lambda a, b: jax.lax.stop_gradient(a) * b,
    lambda a, b: a / (jnp.abs(b) + 1.0),
    lambda a, b: jnp.arctan2(a, b),
]
REDUCE = [
    jnp.sum,
    jnp.mean,
    jnp.max,
    lambda x: jax.nn.logsumexp(x),
    lambda x: jnp.var(x),
    lambda x: jnp.prod(jnp.tanh(x)),
    lambda x: jnp.argmax(x).astype(jnp.float32),
]


@st.composite
def programs(draw):
    steps = draw(st.lists(st.tuples(st.sampled_from(["u", "b"]), st.integers(0, 100)), min_size=1, max_size=6))
    final = draw(st.integers(0, len(REDUCE) - 1))
    return steps, final


def _build(steps, final):
    def f(x, y):
        for kind, i in steps:
            if kind == "u":
                x = UNARY[i % len(UNARY)](x)
            else:
                x = BINARY[i % len(BINARY)](x, y)
        return REDUCE[final](x), x

    return f


def _bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.integers(0, 2**16))
def test_float32_compute_dtype_is_bit_identical(program, seed):
    f = _build(*program)
    kx, ky = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (4, 4))
    y = jax.random.normal(ky, (4, 4))
    ref = jax.jit(f)(x, y)
    out = jax.jit(amp(f, compute_dtype=jnp.float32))(x, y)
    jax.tree_util.tree_map(_bits_equal, out, ref)


@pytest.mark.parametrize("fn", UNARY + REDUCE, ids=range(len(UNARY) + len(REDUCE)))
def test_each_op_identity_and_grad_identity(fn):
    x = jax.random.normal(jax.random.key(0), (3, 5))

    def f(x):
        return jnp.sum(fn(x))

    _bits_equal(jax.jit(amp(f, compute_dtype="float32"))(x), jax.jit(f)(x))
    _bits_equal(jax.jit(jax.grad(amp(f, compute_dtype="float32")))(x), jax.jit(jax.grad(f))(x))


def test_identity_through_control_flow():
    def f(w, x):
        y = jax.lax.scan(lambda c, xs: (jnp.tanh(c @ w) + xs, c.sum()), x[0], x)[0]
        y = jax.lax.cond(y.sum() > 0, jnp.sin, jnp.cos, y)
        y = jax.checkpoint(lambda z: jax.nn.gelu(z @ w))(y)
        return jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), y).sum()

    w = jax.random.normal(jax.random.key(1), (4, 4))
    x = jax.random.normal(jax.random.key(2), (3, 4))
    _bits_equal(jax.jit(amp(f, compute_dtype=jnp.float32))(w, x), jax.jit(f)(w, x))
    ga = jax.jit(jax.grad(amp(f, compute_dtype=jnp.float32), argnums=(0, 1)))(w, x)
    g = jax.jit(jax.grad(f, argnums=(0, 1)))(w, x)
    jax.tree_util.tree_map(_bits_equal, ga, g)
