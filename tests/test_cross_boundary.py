"""Rounding is consistent across nested bodies (defect class: "consumed only in float32, so
compute in float32" stopped at nested ``jit`` / custom-derivative boundaries).

``optax.softmax_cross_entropy_with_integer_labels`` computes the logsumexp in float32 from
the half-precision logits, but gathers the label logit inside a nested ``jit``
(``take_along_axis``). When that gather ran in half precision, XLA (which allows excess
precision by default) could feed one path the unrounded matmul result and the other the
rounded one, and confident examples got *negative* losses. Every test compares with the
float32 run.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import activation_jvps, kind, walk

import autocast

HALF = [jnp.float16, jnp.bfloat16]


def _mlp(seed, scale, n=2048, d=32, h=64, c=10):
    rng = np.random.default_rng(seed)
    w1 = jnp.asarray(rng.standard_normal((d, h), dtype=np.float32) / np.float32(np.sqrt(d)))
    w2 = jnp.asarray(rng.standard_normal((h, c), dtype=np.float32) / np.float32(np.sqrt(h)))
    x = jnp.asarray(rng.standard_normal((n, d), dtype=np.float32) * np.float32(scale))
    return (w1, w2), x


def _logits(params, x):
    w1, w2 = params
    return jax.nn.relu(x @ w1) @ w2


def _per_example_ce(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(_logits(params, x), y)


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
@pytest.mark.parametrize("scale", [30.0, 300.0])
def test_softmax_cross_entropy_is_never_negative_for_confident_logits(dtype, scale):
    params, x = _mlp(0, scale)
    y = jnp.argmax(_logits(params, x), -1)  # confident and correct: the loss is ~0, never < 0
    got = autocast.amp(_per_example_ce, compute_dtype=dtype)(params, x, y)
    ref = _per_example_ce(params, x, y)
    assert got.dtype == jnp.float32
    assert float(jnp.min(got)) >= 0.0, f"negative per-example losses: min {float(jnp.min(got))}"
    # and it is the float32 maths: close to the float32 run (half-precision logits of
    # magnitude ~scale differ from float32 ones by up to scale * eps)
    eps = float(jnp.finfo(dtype).eps)
    assert float(jnp.max(jnp.abs(got - ref))) <= 4 * eps * float(jnp.max(jnp.abs(_logits(params, x))))
    # also under jit + grad of the mean loss
    loss = autocast.amp(lambda p, x, y: jnp.mean(_per_example_ce(p, x, y)), compute_dtype=dtype)
    value, grads = jax.jit(jax.value_and_grad(loss))(params, x, y)
    assert float(value) >= 0.0 and all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


def test_label_logit_is_gathered_from_the_same_float32_value():
    """The label logit is read in float32 (the gather inside the nested ``jit`` takes the
    float32 logits), and with ``remat_float32=False`` the half-precision logits are
    converted to float32 exactly once in the whole program."""
    params, x = _mlp(1, 1.0, n=64)
    y = jnp.argmax(_logits(params, x), -1)
    closed = jax.make_jaxpr(autocast.amp(_per_example_ce, remat_float32=False))(params, x, y)
    gathers = [
        str(e.invars[0].aval.dtype)
        for e, _ in walk(closed)
        if e.primitive.name == "gather" and "float" in str(e.invars[0].aval.dtype)
    ]
    assert gathers and set(gathers) == {"float32"}, gathers
    logits_shape = (64, 10)
    converts = [
        e
        for e, _ in walk(closed)
        if e.primitive.name == "convert_element_type"
        and e.invars[0].aval.shape == logits_shape
        and e.params["new_dtype"] == jnp.float32
    ]
    assert len(converts) == 1, f"{len(converts)} converts of the logits to float32"


def test_two_nested_jits_read_one_float32_value():
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((16, 8), dtype=np.float32) / 4)
    x = jnp.asarray(rng.standard_normal((32, 16), dtype=np.float32))

    def f(w, x):
        y = x @ w
        a = jax.jit(lambda y: y[:, :4])(y)
        b = jax.jit(lambda y: jnp.take_along_axis(y, jnp.zeros((y.shape[0], 1), jnp.int32), axis=1))(y)
        return jnp.sum(jnp.exp(a)) + jnp.sum(jnp.exp(b)) + jnp.sum(jnp.exp(y))

    closed = jax.make_jaxpr(autocast.amp(f, remat_float32=False))(w, x)
    converts = [
        e
        for e, _ in walk(closed)
        if e.primitive.name == "convert_element_type"
        and e.invars[0].aval.shape == (32, 8)
        and e.params["new_dtype"] == jnp.float32
    ]
    assert len(converts) == 1, converts
    jits = [e for e in closed.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    assert len(jits) == 2 and all(str(e.invars[0].aval.dtype) == "float32" for e in jits)
    assert jits[0].invars[0] is jits[1].invars[0] is converts[0].outvars[0]
    got = autocast.amp(f)(w, x)
    np.testing.assert_allclose(got, f(w, x), rtol=2e-3)


def test_float32_consumer_outside_sees_into_the_jit_body():
    """Outward: a nested ``jit`` whose result is only consumed in float32 computes its
    elementwise body in float32 from the half-precision value (one rounding, not two)."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((16, 8), dtype=np.float32) / 4)
    x = jnp.asarray(rng.standard_normal((32, 16), dtype=np.float32))

    def f(w, x):
        h = jax.jit(lambda y: y * 3.0 + 1.0)(x @ w)
        return jnp.sum(jnp.log(jnp.abs(h) + 1.0))

    closed = jax.make_jaxpr(autocast.amp(f))(w, x)
    (jit,) = [e for e in closed.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    body = collections.Counter(
        (e.primitive.name, str(e.outvars[0].aval.dtype))
        for e, _ in walk(jit.params["jaxpr"])
        if e.primitive.name in ("mul", "add")
    )
    assert body == collections.Counter({("mul", "float32"): 1, ("add", "float32"): 1}), body
    np.testing.assert_allclose(autocast.amp(f)(w, x), f(w, x), rtol=2e-3)


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_custom_jvp_body_sees_float32_consumers(dtype):
    """Outward through a custom derivative: ``logaddexp`` (custom_jvp) consumed by a
    float32 ``log`` keeps its float32 result instead of rounding it to half."""
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal((16, 8), dtype=np.float32) / 4)
    x = jnp.asarray(rng.standard_normal((32, 16), dtype=np.float32))

    def f(w, x):
        return jnp.sum(jnp.log(jnp.logaddexp(x @ w, 0.5)))

    closed = jax.make_jaxpr(autocast.amp(f, compute_dtype=dtype))(w, x)
    # logaddexp's custom_jvp (either encoding), not the matmul's (a float32 weight cotangent is one too)
    calls = activation_jvps(closed)
    assert calls and all(str(e.outvars[0].aval.dtype) == "float32" for e in calls)
    np.testing.assert_allclose(autocast.amp(f, compute_dtype=dtype)(w, x), f(w, x), rtol=1e-2)


def test_scan_reads_its_inputs_from_one_float32_value():
    """Into loop bodies: the rows a ``scan`` runs over are consumed only in float32, so the
    half-precision matrix is converted once, outside, and shared with the float32
    consumer outside the loop (``remat_float32=False``: no islands in between)."""
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((16, 8), dtype=np.float32) / 4)
    x = jnp.asarray(rng.standard_normal((32, 16), dtype=np.float32))

    def f(w, x):
        y = x @ w
        total, rows = jax.lax.scan(lambda c, row: (c + jnp.sum(jnp.exp(row)), jnp.log(jnp.abs(row) + 1.0)), 0.0, y)
        return total + jnp.sum(rows) + jnp.sum(jnp.exp(y))

    closed = jax.make_jaxpr(autocast.amp(f, remat_float32=False))(w, x)
    converts = [
        e
        for e, _ in walk(closed)
        if e.primitive.name == "convert_element_type"
        and e.params["new_dtype"] == jnp.float32
        and e.invars[0].aval.shape in ((32, 8), (8,))
    ]
    assert len(converts) == 1, converts
    (scan,) = [e for e in closed.jaxpr.eqns if kind(e) == "scan"]
    assert scan.invars[-1] is converts[0].outvars[0]
    np.testing.assert_allclose(autocast.amp(f)(w, x), f(w, x), rtol=2e-3)
