"""Finite where float32 is finite (issue 42): a mask fill or additive bias that amp narrows to
half precision never becomes an infinity, whatever holds it; a genuine activation that
overflows stays visible.

A published named-axis library fills masked logits with ``masked_out_value =
jnp.array(-2.3819763e38, float32)``, a pytree field applied through ``vmap(jnp.where)``. With
left padding a query row is fully masked: float32 gives a uniform softmax there; float16 turned
the fill into ``-inf`` and the loss into NaN. The rule (docs/how-it-works.md): a free value (a
function input, a closure constant, a parameter or pytree field, a literal, or data movement of
those) that a selecting operation (``where``, ``max``, ``clamp``, ...) narrows saturates to the
half dtype's largest finite value; additive biases before a softmax are summed in float32.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autocast
from autocast import _compat

HALVES = [jnp.float16, jnp.bfloat16]
B, T, D = 2, 8, 16
FILL = -2.3819763e38
# left padding: batch 0 has 3 padding tokens; their query rows (and key columns) are masked
VALID = np.arange(T)[None, :] >= np.array([3, 0])[:, None]
MASK = VALID[:, None, :] & VALID[:, :, None]


def _inputs():
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (B, T, D))
    params = {"q": jax.random.normal(k[1], (D, D)) / 4, "k": jax.random.normal(k[2], (D, D)) / 4}
    v = jax.random.normal(k[3], (B, T, D))
    return params, x, v


def _scores(params, x):
    return jnp.einsum("btd,bsd->bts", x @ params["q"], x @ params["k"])


def _attend(s, v):
    return jnp.sum(jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, axis=-1), v) ** 2)


class _Masker(eqx.Module):
    masked_out_value: jax.Array  # a pytree field, as the named-axis library holds it

    def __call__(self, s):
        return jax.vmap(lambda m, si: jnp.where(m, si, self.masked_out_value))(jnp.asarray(MASK), s)


_CLOSURE_FILL = jnp.array(FILL, jnp.float32)
_BIAS = jnp.where(jnp.asarray(MASK), 0.0, -1e9).astype(jnp.float32)

# holder -> loss(params, x, v, extra)
HOLDERS = {
    "literal": lambda p, x, v, e: _attend(jnp.where(MASK, _scores(p, x), FILL), v),
    "closure constant": lambda p, x, v, e: _attend(jnp.where(MASK, _scores(p, x), _CLOSURE_FILL), v),
    "argument": lambda p, x, v, e: _attend(jnp.where(MASK, _scores(p, x), e), v),
    "pytree field through vmap(where)": lambda p, x, v, e: _attend(e(_scores(p, x)), v),
    "inside a jit": lambda p, x, v, e: _attend(jax.jit(jnp.where)(MASK, _scores(p, x), e), v),
    "additive bias argument": lambda p, x, v, e: _attend(_scores(p, x) + e, v),
    "additive bias closure": lambda p, x, v, e: _attend(_scores(p, x) + _BIAS, v),
    "additive bias through vmap": lambda p, x, v, e: jax.vmap(lambda s, b, vv: _attend((s + b)[None], vv[None]))(
        _scores(p, x), e, v
    ).sum(),
}
EXTRA = {
    "argument": jnp.array(FILL, jnp.float32),
    "pytree field through vmap(where)": _Masker(jnp.array(FILL, jnp.float32)),
    "inside a jit": jnp.array(FILL, jnp.float32),
    "additive bias argument": _BIAS,
    "additive bias through vmap": _BIAS,
}


@pytest.mark.parametrize("holder", list(HOLDERS))
@pytest.mark.parametrize("dtype", HALVES)
def test_fully_masked_rows_stay_finite_whatever_holds_the_fill(holder, dtype):
    loss = HOLDERS[holder]
    params, x, v = _inputs()
    extra = EXTRA.get(holder)
    ref, gref = jax.value_and_grad(loss)(params, x, v, extra)
    assert np.isfinite(float(ref))  # float32: a uniform softmax on the masked rows
    val, g = jax.value_and_grad(autocast.amp(loss, compute_dtype=dtype))(params, x, v, extra)
    assert np.isfinite(float(val)), f"{holder}: {float(val)} where float32 gives {float(ref)}"
    tol = 3e-2 if dtype == jnp.bfloat16 else 5e-3
    assert abs(float(val) - float(ref)) <= tol * abs(float(ref)), (float(val), float(ref))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gref)):
        assert bool(jnp.all(jnp.isfinite(a)))
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 5 * tol


@pytest.mark.parametrize("dtype", HALVES)
def test_a_fill_in_a_max_or_clamp_saturates_too(dtype):
    """``max(x, floor)`` / ``clamp`` with a float32 bound held as an argument."""

    def loss(p, x, lo):
        s = jnp.maximum(_scores(p, x), lo)
        return jnp.sum(jnp.clip(s, lo, -lo) ** 2)

    params, x, _ = _inputs()
    lo = jnp.array(FILL, jnp.float32)
    val = autocast.amp(loss, compute_dtype=dtype)(params, x, lo)
    assert np.isfinite(float(val)) and abs(float(val) - float(loss(params, x, lo))) < 0.05 * float(loss(params, x, lo))


def test_a_genuine_overflow_stays_visible():
    """A computed activation beyond float16's range still overflows (a loss scaler sees it,
    find_overflow names it): only free values are saturated."""

    def loss(p, x):
        big = (x @ p["q"]) * 3e4  # a computed activation far beyond 65,504
        return jnp.sum(jnp.where(jnp.abs(big) > 0, big, 0.0) ** 2)

    params, x, _ = _inputs()
    assert np.isfinite(float(loss(params, x)))
    assert not np.isfinite(float(autocast.amp(loss, compute_dtype=jnp.float16)(params, x)))
    findings = autocast.find_overflow(loss, compute_dtype=jnp.float16)(params, x)
    assert any("overflow" in str(f).lower() or "inf" in str(f).lower() for f in findings), findings


def test_find_overflow_says_when_float16_range_is_the_limit():
    """A sum beyond 65,504 that float32 holds (a graph potential's summed features): the
    finding points to bfloat16, which has float32's range."""

    def loss(p, x):
        feats = 20.0 * (jnp.tanh(x @ p["q"]) + 1.0)  # positive features, summed to ~1e5
        total = jax.ops.segment_sum(feats, jnp.zeros(x.shape[0], jnp.int32), 1)  # summed in float32
        return jnp.sum(total @ p["k"])  # the sum, beyond float16's range, read by a half matmul

    params, _, _ = _inputs()
    x = jax.random.normal(jax.random.key(5), (6000, D))
    assert np.isfinite(float(loss(params, x)))
    findings = autocast.find_overflow(loss, compute_dtype=jnp.float16)(params, x)
    overflows = [f for f in findings if f.kind == "overflow"]
    assert overflows and "bfloat16" in overflows[0].suggestion and "65,504" in overflows[0].suggestion, findings
    assert np.isfinite(float(autocast.amp(loss, compute_dtype=jnp.bfloat16)(params, x)))


def test_explain_lists_float32_sums_rounded_to_float16():
    def loss(p, x):
        total = jax.ops.segment_sum(jnp.tanh(x @ p["q"]), jnp.zeros(x.shape[0], jnp.int32), 1)
        return jnp.sum(total @ p["k"])

    params, _, _ = _inputs()
    x = jax.random.normal(jax.random.key(5), (64, D))
    f16 = autocast.explain(loss, compute_dtype=jnp.float16)(params, x)
    assert any("scatter-add" in s for s in f16.totals["float16_sums"]), f16.totals["float16_sums"]
    assert "float16 range" in str(f16) and "bfloat16" in str(f16)
    assert autocast.explain(loss, compute_dtype=jnp.bfloat16)(params, x).totals["float16_sums"] == []


@pytest.mark.parametrize("dtype", HALVES, ids=["float16", "bfloat16"])
def test_a_saturated_parameter_keeps_nothing_for_the_backward_pass(dtype):
    """A parameter narrowed by a selecting operation saturates on the way, with the
    conversion's derivative: a class token broadcast over the batch and concatenated with
    half-precision patches keeps no float32 copy and no masks (Equimo's ViT kept both), and
    its gradient is float32's within the half dtype's rounding."""
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    params = {"cls": jax.random.normal(k1, (1, D)), "w": jax.random.normal(k2, (D, D)) / 4}
    x = jax.random.normal(k3, (B, T, D))

    def loss(p, x):
        h = jnp.concatenate([jnp.broadcast_to(p["cls"], (B, 1, D)), x @ p["w"]], axis=1)
        return jnp.sum(jnp.tanh(h @ p["w"]) ** 2)

    f = autocast.amp(loss, compute_dtype=dtype)
    kept = [(a.dtype, src) for a, src in _compat.saved_residuals(lambda p: f(p, x), params)]
    assert not [s for d, s in kept if d == jnp.bool_ or (d == jnp.float32 and "argument" not in s)], kept
    ref = jax.grad(loss)(params, x)
    got = jax.jit(jax.grad(f))(params, x)
    for name in params:
        err = float(jnp.linalg.norm(got[name] - ref[name]) / jnp.linalg.norm(ref[name]))
        assert err < 3e-2, (name, err)
