"""A matmul (not a convolution: see ``autocast/_wide.py``) whose result only float32 operations read stores a float32
result: half-precision operands, float32 accumulation, no rounding of the result. Its
backward pass is unchanged: the cotangent is rounded to half precision once and both
transposed matmuls run in half precision (``autocast/_wide.py``).

It keeps the half-precision result where a float32 one would cost memory: when it feeds a
float32 island that is recomputed (the island's checkpoint saves its inputs), inside a user
checkpoint whose policy may save matmul results, and when the result is returned or read
by another matmul.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import walk

import autocast

HALF = [jnp.float16, jnp.bfloat16]
F32 = np.dtype(np.float32)


def _matmuls(fn, *args):
    """(operand dtypes, result dtype) of every dot_general / conv in ``make_jaxpr(fn)``
    (the same on every backend: XLA:CPU's widening of bfloat16 operands happens in the
    lowering, see ``_cpu_matmul.prepare``)."""
    closed = jax.make_jaxpr(fn)(*args)
    return [
        (tuple(np.dtype(v.aval.dtype) for v in e.invars), np.dtype(e.outvars[0].aval.dtype))
        for e, _ in walk(closed)
        if e.primitive.name in ("dot_general", "conv_general_dilated")
    ]


def _data(n=64, k=48, m=32):
    kx, kw = jax.random.split(jax.random.key(0))
    return jax.random.normal(kx, (n, k)), jax.random.normal(kw, (k, m)) / np.sqrt(k)


def sigmoid_of_matmul(x, w):
    return jnp.sum(jax.nn.sigmoid(x @ w) ** 2)


@pytest.mark.parametrize("dtype", HALF)
def test_result_read_only_in_float32_is_not_rounded(dtype):
    x, w = _data()
    f = autocast.amp(lambda x, w: jax.nn.sigmoid(x @ w) * 1.0, compute_dtype=dtype, remat_float32=False)
    # what is computed: products of the half-precision operands, summed in float32
    exact = np.asarray(x.astype(dtype), np.float32) @ np.asarray(w.astype(dtype), np.float32)
    got = np.asarray(f(x, w))
    np.testing.assert_allclose(got, jax.nn.sigmoid(exact), rtol=1e-5, atol=1e-6)
    # ... and not the result rounded to half precision first (which the test can tell apart)
    rounded = jax.nn.sigmoid(jnp.asarray(exact).astype(dtype).astype(jnp.float32))
    assert np.max(np.abs(np.asarray(rounded) - jax.nn.sigmoid(exact))) > 10 * np.max(
        np.abs(got - jax.nn.sigmoid(exact))
    )
    assert _matmuls(f, x, w) == [((np.dtype(dtype),) * 2, F32)]


@pytest.mark.parametrize("dtype", HALF)
def test_backward_pass_stays_in_half_precision(dtype):
    x, w = _data()
    f = autocast.amp(sigmoid_of_matmul, compute_dtype=dtype, remat_float32=False)
    mms = _matmuls(jax.grad(f, argnums=(0, 1)), x, w)
    assert len(mms) == 3  # forward, and the two transposes
    assert all(ops == (np.dtype(dtype),) * 2 for ops, _ in mms), mms  # no float32 x half matmul
    g = jax.grad(f, argnums=(0, 1))(x, w)
    g32 = jax.grad(sigmoid_of_matmul, argnums=(0, 1))(x, w)
    for a, b in zip(g, g32):
        assert a.dtype == b.dtype == jnp.float32
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2


def test_forward_mode_and_vmap():
    x, w = _data()
    f = autocast.amp(sigmoid_of_matmul, compute_dtype=jnp.bfloat16, remat_float32=False)
    tx, tw = jnp.ones_like(x) * 0.1, jnp.ones_like(w) * 0.01
    (v, t), (v32, t32) = jax.jvp(f, (x, w), (tx, tw)), jax.jvp(sigmoid_of_matmul, (x, w), (tx, tw))
    np.testing.assert_allclose(v, v32, rtol=1e-2)
    np.testing.assert_allclose(t, t32, rtol=3e-2)
    batched = jax.vmap(f, in_axes=(0, None))(jnp.stack([x, 2 * x]), w)
    np.testing.assert_allclose(batched, [f(x, w), f(2 * x, w)], rtol=1e-6)


def test_recomputed_island_reads_half_precision_result():
    """``sigmoid(x @ w)``: the island is recomputed in ``auto`` (its float32 result is twice
    its input): the matmul keeps a half-precision result, which is what the island saves."""
    x, w = _data()
    f = autocast.amp(sigmoid_of_matmul, compute_dtype=jnp.bfloat16)
    assert _matmuls(f, x, w) == [((np.dtype(jnp.bfloat16),) * 2, np.dtype(jnp.bfloat16))]
    saved = [a for a, src in autocast._compat.saved_residuals(f, x, w) if a.size >= x.shape[0] * w.shape[1]]
    assert saved and all(a.dtype == jnp.bfloat16 for a in saved), saved


def test_half_precision_consumers_outputs_and_saving_checkpoints_keep_half_results():
    x, w = _data(m=48)
    bf16 = np.dtype(jnp.bfloat16)

    def chain(x, w):  # the first result is read by a matmul, the second is returned
        return (x @ w) @ w

    assert [out for _, out in _matmuls(autocast.amp(chain, compute_dtype=bf16, remat_float32=False), x, w)] == [
        bf16,
        bf16,
    ]

    def saving(x, w):
        inner = jax.checkpoint(lambda x: jnp.tanh(x @ w), policy=jax.checkpoint_policies.dots_saveable)
        return jnp.sum(inner(x))

    def recomputing(x, w):
        return jnp.sum(jax.checkpoint(lambda x: jnp.tanh(x @ w))(x))

    amp_ = lambda f: autocast.amp(f, compute_dtype=bf16, remat_float32=False)  # noqa: E731
    assert [out for _, out in _matmuls(amp_(saving), x, w)] == [bf16]
    assert [out for _, out in _matmuls(amp_(recomputing), x, w)] == [F32]


class _LSTM(eqx.Module):
    cell: eqx.nn.LSTMCell

    def __call__(self, xs):
        init = (jnp.zeros(self.cell.hidden_size), jnp.zeros(self.cell.hidden_size))
        (h, _), _ = jax.lax.scan(lambda c, x: (self.cell(x, c), None), init, xs)
        return jnp.sum(h)


def _cell_by_hand(cell, x, state, round_result):
    h, c = state
    bf16 = jnp.bfloat16

    def mm(w, v):
        out = jnp.matmul(w.astype(bf16), v.astype(bf16), preferred_element_type=jnp.float32)
        # rounded to bfloat16 (reduce_precision: XLA may not elide it as excess precision)
        return jax.lax.reduce_precision(out, exponent_bits=8, mantissa_bits=7) if round_result else out

    lin = mm(cell.weight_ih, x) + mm(cell.weight_hh, h) + cell.bias
    i, f, g, o = jnp.split(lin, 4)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


def test_lstm_gates_under_scan_in_auto():
    """The LSTM cell's island (gates and the float32 cell state) is not recomputed in
    ``auto``, so its two matmuls store float32 results: the step computes exactly the cell
    with ``preferred_element_type=float32`` matmuls written by hand."""
    model = _LSTM(eqx.nn.LSTMCell(16, 32, key=jax.random.key(1)))
    xs = jax.random.normal(jax.random.key(2), (24, 16))
    f = autocast.amp(model.__call__, compute_dtype=jnp.bfloat16)
    got = float(jax.jit(f)(xs))

    def by_hand(round_result):
        init = (jnp.zeros(32), jnp.zeros(32))
        (h, _), _ = jax.lax.scan(lambda c, x: (_cell_by_hand(model.cell, x, c, round_result), None), init, xs)
        return float(jnp.sum(h))

    wide, rounded = by_hand(False), by_hand(True)
    assert abs(got - wide) <= 1e-5 * abs(wide)
    assert abs(rounded - wide) > 10 * abs(got - wide)  # the two are told apart
    assert all(out == F32 for _, out in _matmuls(f, xs))
    g = jax.grad(lambda m: autocast.amp(m.__call__, compute_dtype=jnp.bfloat16)(xs))(model)
    g32 = jax.grad(lambda m: m(xs))(model)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g32)):
        assert a.dtype == jnp.float32
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: np.dtype(d).name)
def test_float32_result_runs_in_every_layout(dtype):
    """XLA:CPU has no bfloat16 x bfloat16 -> float32 kernel for a matmul whose transpose is
    folded into it (``DotThunk::Execute: BF16 x BF16 = F32``): such matmuls, and the last
    layer of an ``eqx.nn.MLP`` under ``vmap`` read by a squared error, must still run and
    give the float32 product of the half-precision operands."""
    x, w = _data()
    fn = autocast.amp(
        lambda w, x: jnp.sum(jnp.tanh(x) @ w * 0.5, axis=0) + (jnp.tanh(x) @ w).T[:, 0], compute_dtype=dtype
    )
    got = jax.jit(fn)(w, x)
    h = jnp.tanh(x).astype(dtype).astype(jnp.float32)
    p = h @ w.astype(dtype).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.sum(p * 0.5, axis=0) + p.T[:, 0]), rtol=2e-2, atol=2e-2)

    model = eqx.nn.MLP(2, 2, 64, 2, key=jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (32, 2))

    def loss(model, x):
        return jnp.mean((jax.vmap(model)(x) - x) ** 2)

    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(autocast.amp(loss, compute_dtype=dtype)))(model, xs)
    ref = loss(model, xs)
    assert abs(float(value) - float(ref)) < 5e-2 * max(1.0, abs(float(ref)))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_array)))
