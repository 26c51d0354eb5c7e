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
import functools

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


def _float32_converts_read_half(closed, shape):
    """Every conversion of a ``shape``-shaped value to float32 reads a half-precision value
    (none reads a value that was gathered or sliced in half precision first), and every
    float gather or slice reads float32: so XLA, which may drop a rounding between a
    matmul and a conversion, drops it on every path alike."""
    converts = [
        e
        for e, _ in walk(closed)
        if e.primitive.name == "convert_element_type"
        and e.invars[0].aval.shape == shape
        and e.params["new_dtype"] == jnp.float32
    ]
    assert converts and all(e.invars[0].aval.dtype in (jnp.bfloat16, jnp.float16) for e in converts)
    selects = [
        str(e.invars[0].aval.dtype)
        for e, _ in walk(closed)
        if e.primitive.name in ("gather", "slice") and "float" in str(e.invars[0].aval.dtype)
    ]
    assert selects and set(selects) == {"float32"}, selects


def _cotangent_dtypes(grad_jaxpr, shape):
    """The dtypes of the ``shape``-shaped float values that the backward pass's scatters and
    pads (the transposes of gathers and slices) write."""
    return {
        str(e.outvars[0].aval.dtype)
        for e, _ in walk(grad_jaxpr)
        if e.primitive.name in ("scatter-add", "scatter_add", "pad", "dynamic_update_slice")
        and e.outvars[0].aval.shape == shape
    }


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_label_logit_is_gathered_from_a_float32_conversion_and_scattered_back_in_half(dtype):
    """The label logit is read in float32: the gather inside the nested ``jit`` selects
    from a float32 conversion of the half-precision logits, the conversion the logsumexp
    makes too. The backward pass scatters its cotangent into a half-precision buffer of the
    logits' size (which XLA adds into the logsumexp's cotangent in place), not a float32
    one converted afterwards: on GPT-2 small (50,257 entries, batch 8 x 1024) that was
    4.6 GiB of the H100 program's modeled traffic per step."""
    params, x = _mlp(1, 1.0, n=64)
    y = jnp.argmax(_logits(params, x), -1)
    for remat in (False, True):
        f = autocast.amp(_per_example_ce, compute_dtype=dtype, remat_float32=remat)
        _float32_converts_read_half(jax.make_jaxpr(f)(params, x, y), (64, 10))
        loss = autocast.amp(_mean_ce, compute_dtype=dtype, remat_float32=remat)
        assert _cotangent_dtypes(jax.make_jaxpr(jax.grad(loss))(params, x, y), (64, 10)) == {jnp.dtype(dtype).name}
        # the program JAX derives for the old placement (a policy running every gather in
        # float32) scatters in float32
        old = autocast.amp(_mean_ce, compute_dtype=dtype, remat_float32=remat, amp_policy=_GATHER_IN_FLOAT32)
        assert _cotangent_dtypes(jax.make_jaxpr(jax.grad(old))(params, x, y), (64, 10)) == {"float32"}
        # same value and gradients, bit for bit, as casting the logits to float32 by hand
        # (the recipe of MPX and of PyTorch's autocast for losses), compiled
        by_hand = autocast.amp(_mean_ce_of_float32_logits, compute_dtype=dtype, remat_float32=remat)
        vg = lambda f: jax.jit(jax.value_and_grad(f))(params, x, y)  # noqa: E731
        for g, w in zip(jax.tree.leaves(vg(loss)), jax.tree.leaves(vg(by_hand))):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _mean_ce(params, x, y):
    return jnp.mean(_per_example_ce(params, x, y))


def _mean_ce_of_float32_logits(params, x, y):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(_logits(params, x).astype(jnp.float32), y))


_GATHER_IN_FLOAT32 = autocast.extend_policy(
    {jax.lax.gather_p: autocast.use_float32_precision, jax.lax.slice_p: autocast.use_float32_precision}
)


def test_two_nested_jits_select_from_float32_conversions():
    """A slice and a gather in two nested ``jit`` s whose results only float32 operations
    read: each takes the half-precision value and selects from its float32 conversion (the
    conversion ``exp`` reads too); their transposes write half-precision cotangents."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((16, 8), dtype=np.float32) / 4)
    x = jnp.asarray(rng.standard_normal((32, 16), dtype=np.float32))

    def f(w, x, by_hand=False):
        y = (x @ w).astype(jnp.float32) if by_hand else x @ w
        a = jax.jit(lambda y: y[:, :4])(y)
        b = jax.jit(lambda y: jnp.take_along_axis(y, jnp.zeros((y.shape[0], 1), jnp.int32), axis=1))(y)
        return jnp.sum(jnp.exp(a)) + jnp.sum(jnp.exp(b)) + jnp.sum(jnp.exp(y))

    closed = jax.make_jaxpr(autocast.amp(f, compute_dtype=jnp.bfloat16, remat_float32=False))(w, x)
    _float32_converts_read_half(closed, (32, 8))
    jits = [e for e in closed.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    assert len(jits) == 2 and all(str(e.invars[0].aval.dtype) == "bfloat16" for e in jits)
    assert jits[0].invars[0] is jits[1].invars[0]
    grad_jaxpr = jax.make_jaxpr(jax.grad(autocast.amp(f, compute_dtype=jnp.bfloat16)))(w, x)
    assert _cotangent_dtypes(grad_jaxpr, (32, 8)) == {"bfloat16"}
    got = autocast.amp(f)(w, x)
    np.testing.assert_allclose(got, f(w, x), rtol=2e-3)
    old = autocast.amp(f, compute_dtype=jnp.bfloat16, amp_policy=_GATHER_IN_FLOAT32)
    assert _cotangent_dtypes(jax.make_jaxpr(jax.grad(old))(w, x), (32, 8)) == {"float32"}
    # bit for bit what casting the matmul's result to float32 by hand gives, compiled
    new = autocast.amp(f, compute_dtype=jnp.bfloat16)
    by_hand = autocast.amp(functools.partial(f, by_hand=True), compute_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(jax.jit(jax.grad(new))(w, x), jax.jit(jax.grad(by_hand))(w, x))


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


_IDX = jnp.array([3, 1, 3, 0, 5, 3])  # repeats: a gather that reads rows 3 three times
_SELECTS = {
    "slice": (lambda y: y[:, 2:6], "bfloat16"),
    "dynamic_slice": (
        lambda y: jax.lax.dynamic_slice_in_dim(y, jnp.argmax(y[0, :2]).astype(jnp.int32), 4, 1),
        "bfloat16",
    ),
    "take_along_axis": (lambda y: jnp.take_along_axis(y, jnp.argmax(y, -1, keepdims=True), axis=1), "bfloat16"),
    "unique_rows": (lambda y: y.at[jnp.array([4, 0, 2])].get(unique_indices=True), "bfloat16"),
    "repeated_rows": (lambda y: y[_IDX], "float32"),
}


@pytest.mark.parametrize("case", sorted(_SELECTS))
def test_selects_read_in_float32_scatter_back_in_half_unless_they_sum(case):
    """A selection from a half-precision activation whose result only float32 operations
    read: it selects from the float32 conversion (same values and gradients, bit for bit,
    as converting by hand first); its transpose writes a half-precision cotangent when it
    writes each element once, and keeps JAX's float32 scatter when it may sum repeated
    rows (those sums then stay in float32)."""
    select, ct_dtype = _SELECTS[case]
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal((16, 8), dtype=np.float32) / 4)
    x = jnp.asarray(rng.standard_normal((6, 16), dtype=np.float32))

    def f(w, x, by_hand=False):
        y = x @ w
        y = y.astype(jnp.float32) if by_hand else y
        return jnp.sum(jnp.exp(select(y))) + jnp.sum(jnp.tanh(y @ w.T))  # (a matmul reads y in half)

    new = autocast.amp(f, compute_dtype=jnp.bfloat16)
    by_hand = autocast.amp(functools.partial(f, by_hand=True), compute_dtype=jnp.bfloat16)
    assert _cotangent_dtypes(jax.make_jaxpr(jax.grad(new))(w, x), (6, 8)) == {ct_dtype}
    for g, want in zip(jax.jit(jax.value_and_grad(new))(w, x), jax.jit(jax.value_and_grad(by_hand))(w, x)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(want))
    # forward mode and second order go through the selection's custom JVP too
    t = jnp.ones_like(w)
    np.testing.assert_allclose(
        jax.jvp(lambda w: new(w, x), (w,), (t,))[1], jax.jvp(lambda w: by_hand(w, x), (w,), (t,))[1], rtol=1e-6
    )
    hvp = lambda fn: jax.jvp(jax.grad(lambda w: fn(w, x)), (w,), (t,))[1]  # noqa: E731
    np.testing.assert_allclose(hvp(new), hvp(by_hand), rtol=1e-5, atol=1e-6)


def test_selection_of_a_broadcast_constant_read_in_float32():
    """A slice of a broadcast literal (``jnp.full``) that a float32 operation reads: the
    planner looks through the broadcast to a literal operand (it crashed on it once)."""

    def f(w, x):
        y = x @ w
        fill = jnp.broadcast_to(jnp.float32(0.5), y.shape)
        return jnp.sum(jnp.exp(fill[:, 2:4])) + jnp.sum(jnp.exp((fill * y)[:, 1:3])) + jnp.sum(y @ w.T)

    w = jnp.linspace(-1.0, 1.0, 128).reshape(16, 8)
    x = jnp.linspace(-2.0, 2.0, 96).reshape(6, 16)
    amp_f = autocast.amp(f, compute_dtype=jnp.bfloat16)
    np.testing.assert_allclose(amp_f(w, x), f(w, x), rtol=2e-2)
    np.testing.assert_allclose(jax.grad(amp_f)(w, x), jax.grad(f)(w, x), rtol=5e-2, atol=5e-2)
