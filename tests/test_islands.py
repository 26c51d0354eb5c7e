"""Float32 islands and ``remat_float32``: which islands are recomputed in the backward pass.

``"auto"`` (the default) recomputes an island only if that at least halves the memory it
keeps for the backward pass: a softmax or layer norm of a half-precision activation is
recomputed (its float32 intermediates are twice the size of its input); an LSTM cell that
updates a float32 carry is not (its float32 input is as large as its intermediates).
``True`` recomputes every island, ``False`` none. All three are mixed precision of the same
float32 function; they differ in rounding only: a recomputed island reads the half-precision
matmul results it is fed (that is what its checkpoint saves), while a matmul that only
float32 operations read, and no recomputed island, stores a float32 result.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import activation_jvps, bodies, kind, label, of_kind, walk

import autocast
from autocast import _compat

MODES = ("auto", True, False)


def _keys(n):
    return jax.random.split(jax.random.key(0), n)


def softmax_layernorm(p, x):
    h = x @ p["w"]
    h = jax.nn.softmax(h, axis=-1) @ p["w2"]
    mu = h.mean(-1, keepdims=True)
    h = (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * p["g"]
    return jnp.sum(h @ p["w3"])


def softmax_params():
    k = _keys(5)
    p = {
        "w": jax.random.normal(k[0], (32, 64)) / 6,
        "w2": jax.random.normal(k[1], (64, 64)) / 8,
        "g": jnp.ones(64),
        "w3": jax.random.normal(k[2], (64, 4)) / 8,
    }
    return p, jax.random.normal(k[3], (256, 32))


def lstm(p, xs):
    """An LSTM cell under ``lax.scan`` with a float32 carry (the cell update is an island
    whose inputs are the half-precision gates and the float32 cell state)."""

    def body(carry, x):
        h, c = carry
        gates = x @ p["wi"] + h @ p["wh"] + p["b"]
        i, f, g, o = jnp.split(gates, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), None

    b, hidden = xs.shape[1], p["wh"].shape[0]
    (h, _), _ = jax.lax.scan(body, (jnp.zeros((b, hidden)), jnp.zeros((b, hidden))), xs)
    return jnp.mean(h @ p["wo"])


def lstm_params():
    k = _keys(5)
    hidden = 32
    p = {
        "wi": jax.random.normal(k[0], (16, 4 * hidden)) / 4,
        "wh": jax.random.normal(k[1], (hidden, 4 * hidden)) / 6,
        "b": jnp.zeros(4 * hidden),
        "wo": jax.random.normal(k[2], (hidden, 1)) / 6,
    }
    return p, jax.random.normal(k[3], (12, 8, 16))


CASES = {"softmax+layernorm": (softmax_layernorm, softmax_params), "LSTM cell (scan)": (lstm, lstm_params)}


def _float32_residuals(f, p, x) -> list:
    """The float32 residuals of ``jax.grad`` that are not parameters."""
    return [a for a, src in _compat.saved_residuals(f, p, x) if a.dtype == jnp.float32 and "argument" not in src]


def _float32_residual_bytes(f, p, x) -> int:
    """Bytes of float32 residuals of ``jax.grad`` that are larger than one value per row of
    the batch (256 rows): activations. Parameters, scalars and per-row statistics (a
    norm's sums, which a recomputed island saves) excluded."""
    return sum(a.size * 4 for a in _float32_residuals(f, p, x) if a.size > 256)


def _float32_row_statistics(f, p, x) -> list[tuple[int, ...]]:
    """Shapes of the float32 residuals of ``jax.grad`` holding one value per row (256)."""
    return [tuple(a.shape) for a in _float32_residuals(f, p, x) if a.size == 256]


def _n_checkpoints(f, p, x) -> int:
    closed = jax.make_jaxpr(f)(p, x)
    return len(of_kind(closed, "checkpoint"))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_softmax_layernorm_island_is_recomputed_in_auto(dtype):
    p, x = softmax_params()
    auto = autocast.amp(softmax_layernorm, compute_dtype=dtype)
    assert _n_checkpoints(auto, p, x) >= 2
    assert _float32_residual_bytes(auto, p, x) == 0
    off = autocast.amp(softmax_layernorm, compute_dtype=dtype, remat_float32=False)
    assert _n_checkpoints(off, p, x) == 0
    assert _float32_residual_bytes(off, p, x) >= 2 * 256 * 64 * 4  # softmax and norm intermediates


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_recomputed_island_saves_a_norms_sums_not_a_softmaxs(dtype):
    """A recomputed island keeps the layer norm's two row sums (mean and variance: one float
    per row each), so the backward pass does not reduce over the rows again; not the
    softmax's sum of ``exp`` (saving it makes XLA:GPU write the float32 ``exp`` out) nor its
    ``max``."""
    p, x = softmax_params()
    auto = autocast.amp(softmax_layernorm, compute_dtype=dtype)
    assert _float32_row_statistics(auto, p, x) == [(256,), (256,)]

    # a softmax alone: its island saves no statistic
    def softmax_only(p, x):
        return jnp.sum(jax.nn.softmax(x @ p["w"], axis=-1) @ p["w2"])

    f = autocast.amp(softmax_only, compute_dtype=dtype)
    assert _n_checkpoints(f, p, x) >= 1
    assert _float32_row_statistics(f, p, x) == []
    # the saved sums are the values the recomputation would make: same gradients as float32
    g = jax.jit(jax.grad(auto))(p, x)
    g32 = jax.grad(softmax_layernorm)(p, x)
    assert _tree_rel(g, g32) < 5e-2


def test_lstm_island_with_float32_carry_is_not_recomputed_in_auto():
    p, x = lstm_params()
    auto = autocast.amp(lstm, compute_dtype=jnp.bfloat16)
    on = autocast.amp(lstm, compute_dtype=jnp.bfloat16, remat_float32=True)
    off = autocast.amp(lstm, compute_dtype=jnp.bfloat16, remat_float32=False)
    assert _n_checkpoints(auto, p, x) == _n_checkpoints(off, p, x) == 0
    assert _n_checkpoints(on, p, x) >= 1
    res = {name: _float32_residual_bytes(f, p, x) for name, f in (("auto", auto), ("on", on), ("off", off))}
    assert res["auto"] == res["off"] > res["on"], res


def _tree_rel(a, b) -> float:
    a = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(a)]).astype(np.float32)
    b = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(b)]).astype(np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("case, auto_is", [("softmax+layernorm", True), ("LSTM cell (scan)", False)])
def test_modes_compute_the_same_function(case, auto_is):
    """``auto`` computes what the mode it picks for the island computes; recomputing or not
    changes rounding only (half-precision level: the island's matmul inputs and the backward
    pass); all are mixed precision of the float32 function."""
    f, make = CASES[case]
    p, x = make()
    results = {
        m: jax.jit(jax.value_and_grad(autocast.amp(f, compute_dtype=jnp.bfloat16, remat_float32=m)))(p, x)
        for m in MODES
    }
    v32, g32 = jax.value_and_grad(f)(p, x)
    # same program; XLA may still fuse (and so round) differently from one compile to the next
    np.testing.assert_allclose(results["auto"][0], results[auto_is][0], rtol=1e-4)
    assert _tree_rel(results["auto"][1], results[auto_is][1]) < 1e-3
    np.testing.assert_allclose(results[True][0], results[False][0], rtol=4e-3)  # bfloat16 eps: 7.8e-3
    assert _tree_rel(results[True][1], results[False][1]) < 1e-2
    for m in MODES:
        np.testing.assert_allclose(results[m][0], v32, rtol=5e-2, atol=1e-2)
        assert _tree_rel(results[m][1], g32) < 5e-2


@pytest.mark.parametrize("bad", ["yes", "Auto", 1, None, 0.0])
def test_bad_remat_float32_is_rejected(bad):
    with pytest.raises(ValueError, match=r"remat_float32=.*True, False, 'auto' or 'matmuls'"):
        autocast.amp(softmax_layernorm, remat_float32=bad)


def norm_relu(p, x):
    """conv-like matmul -> batch norm (a float32 island) -> relu -> matmul, then
    -> norm -> relu -> mean (a float32 consumer) -> head."""

    def bn(h):
        mu = h.mean(0, keepdims=True)
        return (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(0, keepdims=True) + 1e-5)

    h = jax.nn.relu(bn(x @ p["w1"]))  # rounded before relu: its consumer is a matmul
    h = jax.nn.relu(bn(h @ p["w2"]))  # joins the island: its consumer, the mean, reads float32
    return jnp.sum(h.mean(0) @ p["w3"])


def norm_relu_params():
    k = _keys(4)
    p = {
        "w1": jax.random.normal(k[0], (16, 64)) / 4,
        "w2": jax.random.normal(k[1], (64, 64)) / 8,
        "w3": jax.random.normal(k[2], (64, 3)) / 8,
    }
    return p, jax.random.normal(k[3], (256, 16))


def _relu_operand_dtypes(f, p, x) -> list[str]:
    closed = jax.make_jaxpr(f)(p, x)
    # relu's custom_jvp (not the custom_jvp of a matmul with a float32 weight cotangent)
    return [str(e.invars[0].aval.dtype) for e in activation_jvps(closed)]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_relu_between_a_norm_and_a_matmul_runs_in_half_and_keeps_no_float32_activation(dtype):
    p, x = norm_relu_params()
    f = autocast.amp(norm_relu, compute_dtype=dtype)
    # the first relu is handed the norm's result rounded (max commutes with rounding: same
    # values); the second reads float32 (its consumer does) inside the recomputed island
    assert _relu_operand_dtypes(f, p, x) == [np.dtype(dtype).name, "float32"]
    assert _float32_residual_bytes(f, p, x) == 0
    assert _float32_residual_bytes(norm_relu, p, x) >= 2 * 256 * 64 * 4  # not vacuous: relu's zeros_like residuals
    v, g = jax.jit(jax.value_and_grad(f))(p, x)
    v32, g32 = jax.value_and_grad(norm_relu)(p, x)
    np.testing.assert_allclose(v, v32, rtol=2e-2, atol=2e-2)
    assert _tree_rel(g, g32) < 3e-2

    # the rounding point moved, not the values: the same as rounding after the relu
    def rounded_after(p, x):
        def bn(h):
            mu = h.mean(0, keepdims=True)
            return (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(0, keepdims=True) + 1e-5)

        h = (x.astype(dtype) @ p["w1"].astype(dtype)).astype(jnp.float32)
        h = jax.nn.relu(bn(h)).astype(dtype)
        h = (h @ p["w2"].astype(dtype)).astype(jnp.float32)
        return jnp.sum((jax.nn.relu(bn(h)).mean(0)).astype(dtype) @ p["w3"].astype(dtype))

    np.testing.assert_allclose(np.float32(f(p, x)), np.float32(rounded_after(p, x)), rtol=1e-2)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_matmul_after_a_recomputed_island_does_not_save_its_operand(dtype):
    """The matmul that reads a softmax or a layer norm evaluates inside the island's
    checkpoint, which saves only matmul outputs: its half-precision operand (the island's
    result) is recomputed with the island instead of being kept. What is kept of the
    ``(256, 64)`` activations: the two matmul outputs the islands are recomputed from."""
    p, x = softmax_params()
    f = autocast.amp(softmax_layernorm, compute_dtype=dtype)
    kept = [(a.dtype, src.split(" from ")[0]) for a, src in _compat.saved_residuals(f, p, x) if a.shape == (256, 64)]
    # two half-precision matmul outputs (named after the dot, or after the custom JVP that
    # wraps it for a float32 weight gradient, by encoding); never an island's cast result
    assert len(kept) == 2 and all(d == dtype for d, _ in kept), kept
    assert not any("convert_element_type" in src for _, src in kept), kept
    off = autocast.amp(softmax_layernorm, compute_dtype=dtype, remat_float32=False)
    assert len([a for a, _ in _compat.saved_residuals(off, p, x) if a.shape == (256, 64)]) > 2
    v, g = jax.jit(jax.value_and_grad(f))(p, x)
    v32, g32 = jax.value_and_grad(softmax_layernorm)(p, x)
    np.testing.assert_allclose(v, v32, rtol=5e-2, atol=1e-2)
    assert _tree_rel(g, g32) < 5e-2


def _attention(p, x, mask=None):
    """One-head attention with a residual and an MLP; ``mask``: a causal ``where`` (jitted,
    as ``jnp.where`` in Equinox's attention)."""
    q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
    s = (q / np.sqrt(q.shape[-1])) @ k.T
    if mask is not None:
        s = jnp.where(mask, s, jnp.finfo(s.dtype).min)
    h = x + jax.nn.softmax(s, axis=-1) @ v @ p["wo"]
    return jnp.sum(jax.nn.gelu(h @ p["w1"]) @ p["w2"])


def _attention_params(t=128, d=32):
    k = _keys(7)
    p = {n: jax.random.normal(k[i], (d, d)) / np.sqrt(d) for i, n in enumerate(("wq", "wk", "wv", "wo"))}
    p["w1"] = jax.random.normal(k[4], (d, 3 * d)) / np.sqrt(d)
    p["w2"] = jax.random.normal(k[5], (3 * d, 1)) / np.sqrt(3 * d)
    return p, jax.random.normal(k[6], (t, d))


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_attention_scores_are_recomputed_with_the_softmax_island(masked, dtype, monkeypatch):
    """``q @ k.T`` (T x T, larger than q and k) is read only by the softmax island, through a
    scale and a mask's ``where``: evaluated in the island's checkpoint, it is recomputed from
    q and k (kept anyway: its own derivative reads them) instead of saved. No T x T value
    (scores, probabilities, the broadcast mask) is kept; the result and gradients are those of the
    scores saved, up to rounding."""
    p, x = _attention_params()
    t = x.shape[0]
    mask = jnp.tril(jnp.ones((t, t), bool)) if masked else None
    loss = lambda p, x: _attention(p, x, mask)

    def square(f):  # T x T activations kept (the mask itself is the caller's constant)
        saved = _compat.saved_residuals(f, p, x)
        return [(str(a.dtype), src) for a, src in saved if a.size >= t * t and not src.startswith("from a constant")]

    f = autocast.amp(loss, compute_dtype=dtype)
    assert square(f) == [], square(f)
    v, g = jax.jit(jax.value_and_grad(f))(p, x)
    # the lead-in turned off: the scores are saved (the island's input), as before
    monkeypatch.setattr(autocast._islands, "lead_ins", lambda *a: {})
    saved = autocast.amp(loss, compute_dtype=dtype)
    assert len(square(saved)) >= 1, square(saved)
    v_saved, g_saved = jax.jit(jax.value_and_grad(saved))(p, x)
    # the same mixed-precision function: XLA may keep excess precision in one of the two
    # evaluations of the scores (xla_allow_excess_precision), a rounding difference
    np.testing.assert_allclose(np.float32(v), np.float32(v_saved), rtol=1e-3)
    assert _tree_rel(g, g_saved) < 1e-3
    v32, g32 = jax.value_and_grad(loss)(p, x)
    np.testing.assert_allclose(np.float32(v), np.float32(v32), rtol=5e-2)
    assert _tree_rel(g, g32) < 5e-2


def test_weight_products_and_remat_off_keep_their_results():
    """Only products of two computed values lead into an island: ``x @ w1`` before GELU is
    not recomputed (a weight matmul: a whole GEMM for the backward pass), so its result is
    kept; with ``remat_float32=False`` the scores are kept too."""
    p, x = _attention_params()
    t, d = x.shape
    f = autocast.amp(_attention, compute_dtype=jnp.bfloat16)
    hidden = [a for a, _ in _compat.saved_residuals(f, p, x) if a.size == t * 3 * d and a.dtype == jnp.bfloat16]
    assert len(hidden) == 1, hidden
    off = autocast.amp(_attention, compute_dtype=jnp.bfloat16, remat_float32=False)
    assert any(a.size == t * t for a, _ in _compat.saved_residuals(off, p, x))


def _layernorm_var(p, x):
    """A layer norm as Equinox writes it: the variance from ``jnp.var`` (a ``jit``, ``_var``)."""
    h = x @ p["w"] + x
    mean = jnp.mean(h, -1, keepdims=True)
    var = jnp.maximum(jnp.var(h, -1, keepdims=True), 0.0)
    h = (h - mean) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]
    return jnp.sum(h @ p["w3"])


def _layernorm_params(n=256, d=64):
    k = _keys(4)
    p = {
        "w": jax.random.normal(k[0], (d, d)) / np.sqrt(d),
        "g": 1 + 0.1 * jax.random.normal(k[1], (d,)),
        "b": 0.1 * jax.random.normal(k[2], (d,)),
        "w3": jax.random.normal(k[3], (d, 4)) / np.sqrt(d),
    }
    return p, jax.random.normal(k[0], (n, d))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_a_float32_jit_joins_its_island(dtype, monkeypatch):
    """``jnp.var``'s ``jit`` computes only in float32: it is part of the layer norm's island,
    so the statistics are recomputed with the normalisation from the half-precision input,
    and the island's checkpoint takes no float32 statistic as an input (XLA:GPU then fuses
    the statistics and the normalisation into one kernel instead of storing the statistics
    between kernels). Same function as before, up to rounding."""
    p, x = _layernorm_params()
    f = autocast.amp(_layernorm_var, compute_dtype=dtype)
    jaxpr = jax.make_jaxpr(f)(p, x).jaxpr
    top = [e for e in jaxpr.eqns if kind(e) == "jit"]
    assert top == [], [label(e) for e in top]  # no jit outside an island
    islands = [e for e in jaxpr.eqns if kind(e) == "checkpoint"]
    assert islands and any(kind(e) == "jit" for i in islands for e, _ in walk(bodies(i)[0]))
    stats_in = [v.aval for i in islands for v in i.invars if v.aval.dtype == jnp.float32 and v.aval.shape == (256, 1)]
    assert stats_in == [], stats_in
    v, g = jax.jit(jax.value_and_grad(f))(p, x)
    v32, g32 = jax.value_and_grad(_layernorm_var)(p, x)
    np.testing.assert_allclose(np.float32(v), np.float32(v32), rtol=2e-2, atol=1e-2)
    assert _tree_rel(g, g32) < 2e-2
    # before: the jit evaluated on its own, its statistic handed to the island
    monkeypatch.delitem(autocast._registry.FLOAT32_CALLS, _compat.jit_p)
    before = autocast.amp(_layernorm_var, compute_dtype=dtype)
    outer = [e for e in jax.make_jaxpr(before)(p, x).jaxpr.eqns if kind(e) == "jit"]
    assert outer, "the control should evaluate the jit outside the island"
    v_b, g_b = jax.jit(jax.value_and_grad(before))(p, x)
    np.testing.assert_allclose(np.float32(v), np.float32(v_b), rtol=1e-3, atol=1e-3)
    assert _tree_rel(g, g_b) < 1e-2


def _gelu_mlp(p, x):
    """A tanh-GELU MLP with biases (``x @ w1 + b1`` is summed in float32: GELU's cube reads it)."""
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    return jnp.sum((h @ p["w2"] + p["b2"]) ** 2)


def _gelu_params(n=512, d=64, hidden=256):
    k = _keys(5)
    p = {
        "w1": jax.random.normal(k[0], (d, hidden)) / np.sqrt(d),
        "b1": 0.5 * jax.random.normal(k[1], (hidden,)),
        "w2": jax.random.normal(k[2], (hidden, d)) / np.sqrt(hidden),
        "b2": 0.1 * jax.random.normal(k[3], (d,)),
    }
    return p, jax.random.normal(k[4], (n, d))


def _barrier_operands(jaxpr) -> collections.Counter:
    """The optimisation barriers of a jaxpr at any depth, each as its operands' (dtype, shape)."""
    return collections.Counter(
        tuple(sorted((str(v.aval.dtype), v.aval.shape) for v in e.invars))
        for e in of_kind(jaxpr, "optimization_barrier")
    )


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_bias_gradient_is_summed_from_the_half_cotangent_apart_from_the_island(dtype, monkeypatch):
    """``x @ w1 + b1`` feeds GELU's float32 island, so the sum runs in float32; the bias's
    gradient is summed in float32 from the cotangent the matmul result gets anyway (rounded
    to half once, as the weight gradient ``x.T @ dh`` reads it), behind an optimisation
    barrier: a kernel of its own, so XLA:GPU can fuse the island's recomputed ``tanh`` into
    its backward kernel instead of writing it to memory in float32 (the reduction it would
    otherwise be fused with does not take expensive producers; see
    ``tests/test_gpu_program.py``). Values unchanged; gradients as close to float32's as
    before."""
    p, x = _gelu_params()
    f = autocast.amp(_gelu_mlp, compute_dtype=dtype)
    after_barriers = _barrier_operands(jax.make_jaxpr(jax.grad(f))(p, x))
    g = jax.jit(jax.grad(f))(p, x)
    g32 = jax.grad(_gelu_mlp)(p, x)
    err = _tree_rel(g, g32)
    # before: the bias gradient summed from the float32 cotangent
    monkeypatch.setattr(autocast._binding, "_bias_into_float32", lambda *a: [])
    before = autocast.amp(_gelu_mlp, compute_dtype=dtype)
    before_barriers = _barrier_operands(jax.make_jaxpr(jax.grad(before))(p, x))
    # one barrier more than without the change (JAX's own, e.g. remat3's, in both), on the
    # half cotangent of b1's sum; not b2's: the loss head has no expensive function
    half = np.dtype(dtype).name
    assert list((after_barriers - before_barriers).elements()) == [((half, (512, 256)),)], after_barriers
    assert not before_barriers - after_barriers, (before_barriers, after_barriers)
    g_before = jax.jit(jax.grad(before))(p, x)
    err_before = _tree_rel(g_before, g32)
    assert err <= 1.05 * err_before, (err, err_before)
    assert _tree_rel(g["b1"], g32["b1"]) <= 1.5 * _tree_rel(g_before["b1"], g32["b1"]) + 1e-4
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(p, x)), np.asarray(jax.jit(before)(p, x)))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_forward_mode_through_a_bias_summed_apart(dtype):
    """The bias sum before GELU (above) rounds its cotangent through a `custom_jvp`, so forward
    mode works: `jax.jvp` and a Hessian-vector product (forward over reverse) of amp's MLP are
    within half-precision rounding of float32's (a `custom_vjp` there made every transformer
    MLP with a GELU refuse `jax.jvp` and `jax.hessian`)."""
    p, x = _gelu_params()
    f = autocast.amp(_gelu_mlp, compute_dtype=dtype)
    assert _barrier_operands(jax.make_jaxpr(jax.grad(f))(p, x))  # the path is taken
    t = jax.tree_util.tree_map(lambda a: jnp.ones_like(a) / np.sqrt(a.size), p)

    # (t and x arguments of the jit: as its constants, XLA:CPU folds float32's jvp to NaN)
    def jvp(g):
        return jax.jit(lambda p, t, x: jax.jvp(lambda p: g(p, x), (p,), (t,))[1])(p, t, x)

    def hvp(g):
        return jax.jit(lambda p, t, x: jax.jvp(jax.grad(lambda p: g(p, x)), (p,), (t,))[1])(p, t, x)

    (jvp, jvp32), (hvp, hvp32) = (jvp(f), jvp(_gelu_mlp)), (hvp(f), hvp(_gelu_mlp))
    np.testing.assert_allclose(jvp, jvp32, rtol=3e-2)
    assert _tree_rel(hvp, hvp32) < 5e-2, _tree_rel(hvp, hvp32)


def test_saved_statistics_change_no_gradient_of_an_equinox_block(monkeypatch):
    """The sums a recomputed island saves are the values its recomputation would make: an
    Equinox pre-LN transformer block's loss (bfloat16, jit) with them saved equals the loss
    with every island recomputing its sums, its gradients differ by a fraction of bfloat16's
    epsilon and are no further from float32's; the saving is not vacuous (the block's
    checkpoints keep float32 row statistics)."""
    import equinox as eqx

    from autocast import _plan

    k = _keys(4)
    ln, attn = eqx.nn.LayerNorm(32), eqx.nn.MultiheadAttention(4, 32, key=k[0])
    mlp = eqx.nn.MLP(32, 32, 64, 1, activation=jax.nn.gelu, key=k[1])
    model = (ln, attn, mlp)
    x = jax.random.normal(k[2], (16, 32))

    def loss(model, x):
        ln, attn, mlp = model
        h = jax.vmap(ln)(x)
        x = x + attn(h, h, h)
        return jnp.mean(jax.vmap(mlp)(jax.vmap(ln)(x)) ** 2)

    params, static = eqx.partition(model, eqx.is_array)

    def step():
        f = autocast.amp(lambda p, x: loss(eqx.combine(p, static), x), compute_dtype=jnp.bfloat16)
        return f, jax.jit(jax.value_and_grad(f))(params, x)

    f, with_sums = step()
    kept = [r for r in _compat.saved_residuals(f, params, x) if r[0].dtype == jnp.float32 and r[0].shape == (16,)]
    assert len(kept) >= 2, kept
    monkeypatch.setattr(_plan, "_statistics", lambda jaxpr, steps: frozenset())
    _, without = step()
    g32 = jax.grad(lambda p, x: loss(eqx.combine(p, static), x))(params, x)
    np.testing.assert_allclose(with_sums[0], without[0], rtol=1e-6)
    # float32 sums reduced in another order (another kernel) may flip a bfloat16 rounding in
    # the backward pass: a fraction of bfloat16's epsilon (7.8e-3), and no further from float32
    assert _tree_rel(with_sums[1], without[1]) < 2e-3
    assert _tree_rel(with_sums[1], g32) <= 1.1 * _tree_rel(without[1], g32)
