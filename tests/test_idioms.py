"""Idioms of real model code that once broke under ``amp``, each named by its idiom.

Found by running unedited third-party models (tests/real_models/): masking attention with
``jnp.finfo(jnp.float32).min`` (BERT, Flax's LM1B, Gemma), a custom JVP whose rule raises
when traced (``eqx.nondifferentiable``, every ``eqx.filter_custom_vjp`` user: diffrax), a
custom VJP whose backward rule recomputes the forward pass (diffrax's checkpointed loop),
and a jit / loop body that closes over array constants (diffrax's ``diffeqsolve``). Each is
checked against float32 JAX on the same inputs, in float16 and bfloat16, forward and
backward. This file runs in every lane (oldest and newest JAX, and the next-JAX flags).
"""

from __future__ import annotations

import collections

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import operand_dtypes, tree_max_rel_err, walk

import autocast
from autocast import _compat

HALF = [jnp.float16, jnp.bfloat16]
TOL = {jnp.float16: 3e-3, jnp.bfloat16: 2e-2}
F32_MIN = jnp.finfo(jnp.float32).min

# one query row fully masked (row 2), two partly
MASK = np.array([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)


def _qk():
    q = jax.random.normal(jax.random.key(0), (4, 8))
    k = jax.random.normal(jax.random.key(1), (4, 8))
    return q, k


def _attend(logits, v):
    return jax.nn.softmax(logits, axis=-1) @ v


MASKINGS = {
    "where_finfo_float32_min": lambda q, k, m: _attend(jnp.where(m, q @ k.T, F32_MIN), k),
    "where_minus_1e9": lambda q, k, m: _attend(jnp.where(m, q @ k.T, -1e9), k),
    "additive_bias_from_literals": lambda q, k, m: _attend(q @ k.T + jnp.where(m, 0.0, F32_MIN), k),
    "additive_bias_as_input": lambda q, k, m: _attend(q @ k.T + m, k),
    "maximum_with_finfo_min": lambda q, k, m: jnp.maximum(q @ k.T, F32_MIN) @ k,
    "where_minus_inf": lambda q, k, m: _attend(jnp.where(m, q @ k.T, -jnp.inf), k),
}


def _close_to_float32(out, ref, dtype):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))  # NaN exactly where float32 has it
    fin = np.isfinite(ref)
    assert np.all(np.isfinite(out[fin])), "non-finite where float32 is finite"
    if not fin.any():
        return
    err = np.max(np.abs(out[fin] - ref[fin])) / (np.max(np.abs(ref[fin])) + 1e-12)
    assert err < TOL[dtype], err


def _masking_matches_float32(idiom, dtype):
    """``MASKINGS[idiom]`` under ``amp``: its value and its gradient are float32's."""
    f = MASKINGS[idiom]
    q, k = _qk()
    m = jnp.where(MASK, 0.0, F32_MIN) if idiom == "additive_bias_as_input" else MASK
    ref = f(q, k, m)
    out = autocast.amp(f, compute_dtype=dtype)(q, k, m)
    _close_to_float32(out, ref, dtype)

    def loss(fn):
        return lambda q, k: jnp.nansum(fn(q, k, m).astype(jnp.float32))

    g_ref = jax.grad(loss(f), argnums=(0, 1))(q, k)
    g = jax.grad(loss(autocast.amp(f, compute_dtype=dtype)), argnums=(0, 1))(q, k)
    for a, b in zip(g, g_ref):
        _close_to_float32(a, b, dtype)


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
@pytest.mark.parametrize("idiom", MASKINGS)
def test_masking_with_a_fill_outside_the_half_range_gives_float32s_value(idiom, dtype):
    """``jnp.where(mask, logits, jnp.finfo(jnp.float32).min)``: the fill reaches the
    ``select_n`` through ``jnp.where``'s jit; cast to half it would be -inf and a fully masked
    row NaN. It saturates instead (``-inf`` stays ``-inf``: NaN where float32 gives NaN)."""
    _masking_matches_float32(idiom, dtype)


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
@pytest.mark.parametrize("idiom", ["additive_bias_as_input", "additive_bias_from_literals", "where_finfo_float32_min"])
def test_masking_with_softmax_custom_jvp_gives_float32s_value(idiom, dtype):
    """Under JAX's flag ``jax_softmax_custom_jvp`` the softmax is a custom JVP call; being a
    float32 island, it takes in float32 what its body reads only in float32, so ``scores +
    mask`` with a float32 argument mask adds in float32 (rounded to half first,
    ``finfo(float32).min`` was ``-inf`` and the fully masked row NaN)."""
    with _compat.hijax_flags()["softmax_custom_jvp"](True):  # JAX 0.9.2 through 0.12 have it
        _masking_matches_float32(idiom, dtype)


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
def test_flax_attention_with_a_fully_padded_sequence(dtype):
    """Flax's ``dot_product_attention_weights`` masks with ``finfo(float32).min``; a sequence
    that is all padding has every query row masked."""
    x = jax.random.normal(jax.random.key(2), (2, 4, 8))
    pad = jnp.array([[1, 1, 1, 0], [0, 0, 0, 0]], bool)
    mask = nn.make_attention_mask(pad, pad)
    mod = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
    params = mod.init(jax.random.key(3), x, x, mask=mask)

    def loss(p, x):
        return jnp.sum(mod.apply(p, x, x, mask=mask) ** 2)

    ref, g_ref = jax.value_and_grad(loss)(params, x)
    val, g = jax.value_and_grad(autocast.amp(loss, compute_dtype=dtype))(params, x)
    assert np.isfinite(float(val)) and abs(float(val) - float(ref)) / float(ref) < 5 * TOL[dtype]
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(g))
    assert _global_rel_err(g, g_ref) < 10 * TOL[dtype]


def _global_rel_err(a, b):
    """Relative L2 error of the whole gradient vector (a key bias's gradient is zero in float32)."""
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(t)])  # noqa: E731
    return float(np.linalg.norm(flat(a) - flat(b)) / np.linalg.norm(flat(b)))


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
def test_equinox_attention_with_a_fully_padded_sequence(dtype):
    """``eqx.nn.MultiheadAttention`` masks with ``finfo(logits.dtype).min`` (float32 as traced)."""
    x = jax.random.normal(jax.random.key(2), (2, 4, 8))
    pad = jnp.array([[1, 1, 1, 0], [0, 0, 0, 0]], bool)
    mask = pad[:, :, None] & pad[:, None, :]
    att = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(4))

    def loss(att, x):
        return jnp.sum(jax.vmap(lambda xx, mm: att(xx, xx, xx, mask=mm))(x, mask) ** 2)

    ref, g_ref = eqx.filter_value_and_grad(loss)(att, x)
    val, g = eqx.filter_value_and_grad(autocast.amp(loss, compute_dtype=dtype))(att, x)
    assert np.isfinite(float(val)) and abs(float(val) - float(ref)) / float(ref) < 5 * TOL[dtype]
    leaves = jax.tree.leaves(eqx.filter(g, eqx.is_array))
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in leaves)
    assert _global_rel_err(eqx.filter(g, eqx.is_array), eqx.filter(g_ref, eqx.is_array)) < 10 * TOL[dtype]


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
def test_arithmetic_with_a_constant_outside_the_half_range_runs_in_float32(dtype):
    """``x * 1e5 / 1e5`` on a half activation: the constant does not fit float16, so the
    product runs in float32 as traced (saturating it would change the product's value)."""
    x = jax.random.normal(jax.random.key(5), (8, 8))

    def f(x):
        return (x @ x) * 1e39 / 1e39 if dtype == jnp.bfloat16 else (x @ x) * 1e5 / 1e5

    ref = f(x)
    out = autocast.amp(f, compute_dtype=dtype)(x)
    _close_to_float32(out, ref, dtype)


# --- a custom JVP whose rule raises when traced ------------------------------------------


@jax.custom_jvp
def _refuses_derivatives(x):
    return jnp.exp(x) - 1.0  # computes in float32 under the policy


_rule_calls = collections.Counter()


@_refuses_derivatives.defjvp
def _refuses_derivatives_jvp(primals, tangents):
    _rule_calls["traced"] += 1
    raise RuntimeError("Unexpected tangent: this operation cannot be autodifferentiated.")


def test_a_raising_custom_jvp_rule_is_never_traced_on_a_forward_pass():
    """``eqx.nondifferentiable``'s rule raises when traced: JAX traces a rule only when the
    call is differentiated, and so does ``amp`` (a forward pass never touches it)."""
    w = jax.random.normal(jax.random.key(0), (8, 8))

    def f(w, x):
        return jnp.sum(_refuses_derivatives(x @ w) * 2.0)

    x = jax.random.normal(jax.random.key(1), (4, 8)) / 4
    _rule_calls.clear()
    out = autocast.amp(f, compute_dtype=jnp.float16)(w, x)
    np.testing.assert_allclose(float(out), float(f(w, x)), rtol=3e-3)
    assert _rule_calls["traced"] == 0
    with pytest.raises(RuntimeError, match="Unexpected tangent"):  # as float32 JAX does
        jax.grad(autocast.amp(f, compute_dtype=jnp.float16))(w, x)


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
def test_equinox_nondifferentiable_and_filter_custom_vjp_run_under_amp(dtype):
    """The two Equinox wrappers every diffrax solve uses: a forward pass, and a gradient
    through ``filter_custom_vjp`` (its ``nondifferentiable`` parts are not differentiated)."""
    nondifferentiable = getattr(eqx, "nondifferentiable", None) or eqx.internal.nondifferentiable

    @eqx.filter_custom_vjp
    def scaled(vjp_arg, scale):
        return jax.tree.map(lambda a: a * scale, vjp_arg)

    @scaled.def_fwd
    def _fwd(perturbed, vjp_arg, scale):
        return scaled(vjp_arg, scale), None

    @scaled.def_bwd
    def _bwd(residuals, grad_obj, perturbed, vjp_arg, scale):
        return jax.tree.map(lambda g: g * scale, grad_obj)

    def loss(w, x):
        h = x @ w
        stat = nondifferentiable(jnp.max(jnp.abs(jax.lax.stop_gradient(h))))
        return jnp.sum(scaled(h, 0.5) ** 2) + 0.0 * stat

    w = jax.random.normal(jax.random.key(0), (8, 8))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    ref, g_ref = jax.value_and_grad(loss)(w, x)
    val, g = jax.value_and_grad(autocast.amp(loss, compute_dtype=dtype))(w, x)
    np.testing.assert_allclose(float(val), float(ref), rtol=10 * TOL[dtype])
    assert tree_max_rel_err(g, g_ref) < 10 * TOL[dtype]


# --- a custom VJP whose backward rule recomputes the forward pass -------------------------


@jax.custom_vjp
def _block(w, x):
    return jnp.tanh(x @ w) @ w


def _block_fwd(w, x):
    return _block(w, x), (w, x)


def _block_bwd(res, g):
    w, x = res  # saved inputs: the forward is recomputed and differentiated here
    _, vjp = jax.vjp(lambda w, x: jnp.tanh(x @ w) @ w, w, x)
    return vjp(g)


_block.defvjp(_block_fwd, _block_bwd)


def _block_loss(w, x):
    return jnp.sum(_block(w, x) ** 2)


def _matmul_dtypes(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    return collections.Counter(operand_dtypes(e) for e, _ in walk(closed) if e.primitive.name == "dot_general")


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
def test_a_custom_vjp_backward_that_recomputes_the_forward_runs_under_the_policy(dtype):
    """As ``torch.amp.custom_bwd``: the backward rule's matmuls (the recomputed forward and
    its transposes) run in half precision, like ``jax.checkpoint`` of the same block; the
    gradient stays close to float32's. ``custom_vjp_bwd="original"`` is the opt-out."""
    w = jax.random.normal(jax.random.key(0), (16, 16)) / 4
    x = jax.random.normal(jax.random.key(1), (8, 16))
    g_ref = jax.grad(_block_loss)(w, x)
    name = jnp.dtype(dtype).name

    amp_loss = autocast.amp(_block_loss, compute_dtype=dtype)
    counts = _matmul_dtypes(jax.grad(amp_loss), w, x)
    assert set(counts) == {(name, name)} and counts[(name, name)] >= 8, counts  # 2 forward, 2 recomputed, 4 transposed
    assert tree_max_rel_err(jax.grad(amp_loss)(w, x), g_ref) < 5 * TOL[dtype]

    as_written = autocast.amp(_block_loss, compute_dtype=dtype, custom_vjp_bwd="original")
    counts = _matmul_dtypes(jax.grad(as_written), w, x)
    assert counts[("float32", "float32")] >= 6 and counts[(name, name)] == 2, counts

    summary = autocast.explain(_block_loss, compute_dtype=dtype)(w, x).to_markdown()
    assert "custom_vjp backward rules: 1, run under this policy" in summary
    summary = autocast.explain(_block_loss, compute_dtype=dtype, custom_vjp_bwd="original")(w, x).to_markdown()
    assert "custom_vjp_bwd='original'" in summary


def test_custom_vjp_bwd_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="custom_vjp_bwd='half'.*'amp' or 'original'"):
        autocast.amp(_block_loss, custom_vjp_bwd="half")


def test_a_custom_vjp_backward_gets_concrete_residuals_as_concrete():
    """A forward rule may return Python values among its residuals (Equinox's perturbed
    flags): the backward rule gets them as they are, not as traced arrays."""

    @jax.custom_vjp
    def f(x):
        return x @ x

    def fwd(x):
        return f(x), (x, np.bool_(True))

    def bwd(res, g):
        x, flag = res
        assert not isinstance(flag, jax.core.Tracer)
        return ((g @ x.T + x.T @ g) if bool(flag) else g,)

    f.defvjp(fwd, bwd)
    x = jax.random.normal(jax.random.key(0), (4, 4))
    g = jax.grad(lambda x: jnp.sum(autocast.amp(f, compute_dtype=jnp.bfloat16)(x)))(x)
    g_ref = jax.grad(lambda x: jnp.sum(f(x)))(x)
    assert tree_max_rel_err(g, g_ref) < 5 * TOL[jnp.bfloat16]


# --- bodies that close over array constants ------------------------------------------------


@pytest.mark.parametrize("construct", ["jit", "scan", "while", "cond"])
def test_a_body_closing_over_array_constants_is_differentiable(construct):
    """``diffeqsolve``'s jit closes over arrays (solver tableaux): its transformed body keeps
    them as constants (JAX >= 0.11 would otherwise see more operands than shardings)."""
    table = np.linspace(0.5, 1.5, 8, dtype=np.float32)

    def body(w, x):
        return jnp.tanh((x @ w) * jnp.asarray(table))

    def f(w, x):
        if construct == "jit":
            return jnp.sum(jax.jit(body)(w, x))
        if construct == "scan":
            return jnp.sum(jax.lax.scan(lambda c, _: (body(w, c), None), x, None, length=3)[0])
        if construct == "while":
            out = jax.lax.fori_loop(0, 3, lambda i, c: body(w, c), x)
            return jnp.sum(out)
        return jnp.sum(jax.lax.cond(jnp.sum(x) > 0, body, lambda w, x: body(w, -x), w, x))

    w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
    x = jax.random.normal(jax.random.key(1), (4, 8))
    amp_f = autocast.amp(f, compute_dtype=jnp.bfloat16)
    np.testing.assert_allclose(float(jax.jit(amp_f)(w, x)), float(f(w, x)), rtol=5e-2, atol=5e-2)
    if construct == "while":  # a fori_loop of unknown trip count is not reverse-differentiable
        return
    g = jax.jit(jax.grad(amp_f))(w, x)
    assert tree_max_rel_err(g, jax.grad(f)(w, x)) < 5e-2
