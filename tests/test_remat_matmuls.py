"""``remat_float32="matmuls"``: every float32 island recomputed, and the matmuls between two
recomputed steps recomputed with them (``autocast._islands.chain_end``).

A pre-LN block's chains: the first norm, q, k, v and the attention (with the output
projection's result saved); the second norm, the MLP's up-projection, GELU and the
down-projection. A post-LN block's: the attention, its output projection, the residual add,
the first norm, the MLP and the second norm (the chain closes there, where the first norm's
output is read by the second residual add), then the next block's q, k, v. Kept for the
backward pass: each block's inputs and the saved matmul results, not q, k, v (pre-LN), the
MLP's hidden activation, nor a float32 norm output the next chain reads. The values are
those of ``remat_float32=True`` up to rounding (the same operations, recomputed), on Equinox
and Flax blocks, with the fused attention as written (CPU) and as splash's kernel (Pallas
interpret mode), in reverse and forward mode, a Hessian-vector product, under ``vmap`` and
over blocks in a ``lax.scan``.
"""

from __future__ import annotations

import collections

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import bodies, kind, walk

import autocast
from autocast import _compat
from autocast._attention import _fuse

D, HIDDEN, HEADS, T, BATCH = 128, 256, 2, 128, 2


class _Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    ln2: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    post_ln: bool = eqx.field(static=True)

    def __init__(self, post_ln: bool, key):
        a, b, c = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
        self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=a)
        self.up, self.down = eqx.nn.Linear(D, HIDDEN, key=b), eqx.nn.Linear(HIDDEN, D, key=c)
        self.post_ln = post_ln

    def mlp(self, x):
        return jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(x)))

    def __call__(self, x):
        if self.post_ln:  # BERT
            x = jax.vmap(self.ln1)(x + self.attn(x, x, x))
            return jax.vmap(self.ln2)(x + self.mlp(x))
        y = jax.vmap(self.ln1)(x)  # GPT-2, ViT
        x = x + self.attn(y, y, y)
        return x + self.mlp(jax.vmap(self.ln2)(x))


def _model(post_ln: bool, n: int = 2):
    blocks = [_Block(post_ln, k) for k in jax.random.split(jax.random.key(0), n)]
    params, static = eqx.partition(blocks, eqx.is_inexact_array)
    x = jax.random.normal(jax.random.key(1), (BATCH, T, D))

    def loss(params, x):
        def one(x):
            for block in eqx.combine(params, static):
                x = block(x)
            return jnp.mean(x.astype(jnp.float32) ** 2)

        return jnp.mean(jax.vmap(one)(x))

    return loss, params, x


def _rel(a, b) -> float:
    a, b = (np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree_util.tree_leaves(t)]) for t in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _kept(f, *args) -> collections.Counter:
    """What the backward pass keeps of `f`'s activations, by (dtype, shape) (not the arguments)."""
    return collections.Counter(
        (str(a.dtype), tuple(a.shape))
        for a, src in _compat.saved_residuals(f, *args)
        if not src.startswith("from the argument") and a.size > 1
    )


def _value_and_grad(loss, params, x, **options):
    f = autocast.amp(loss, compute_dtype=jnp.bfloat16, **options) if options else loss
    return jax.jit(jax.value_and_grad(f))(params, x)


def test_pre_ln_keeps_no_q_k_v_and_no_mlp_activation():
    loss, params, x = _model(post_ln=False)
    chained = _kept(autocast.amp(loss, compute_dtype=jnp.bfloat16, remat_float32="matmuls"), params, x)
    every = _kept(autocast.amp(loss, compute_dtype=jnp.bfloat16, remat_float32=True), params, x)
    hidden = ("bfloat16", (BATCH, T, HIDDEN)), ("bfloat16", (HIDDEN, BATCH, T))
    heads = ("bfloat16", (BATCH, T, HEADS, D // HEADS))  # q, k, v
    assert sum(every[h] for h in hidden) >= 2 and every[heads] >= 6, every  # not vacuous
    assert sum(chained[h] for h in hidden) == 0 and chained[heads] == 0, chained
    width = sum(n * np.prod(s) * np.dtype(d).itemsize for (d, s), n in chained.items())
    assert width < 0.5 * sum(n * np.prod(s) * np.dtype(d).itemsize for (d, s), n in every.items())


def test_post_ln_keeps_no_mlp_activation_and_one_float32_norm_output_a_block():
    """The chain from the attention closes at the second norm: the first norm's float32
    output (read by the second residual add) is made and read inside it, not kept."""
    loss, params, x = _model(post_ln=True, n=3)
    chained = _kept(autocast.amp(loss, compute_dtype=jnp.bfloat16, remat_float32="matmuls"), params, x)
    every = _kept(autocast.amp(loss, compute_dtype=jnp.bfloat16, remat_float32=True), params, x)
    stream = ("float32", (BATCH, T, D))
    hidden = ("bfloat16", (BATCH, T, HIDDEN)), ("bfloat16", (HIDDEN, BATCH, T))
    assert every[stream] >= 2 * 3 - 1 and sum(every[h] for h in hidden) >= 3, every  # not vacuous
    assert chained[stream] <= 3 - 1 and sum(chained[h] for h in hidden) == 0, chained


@pytest.mark.parametrize("post_ln", [False, True], ids=["pre-LN", "post-LN"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_values_and_gradients_are_those_of_every_island_recomputed(post_ln, dtype):
    loss, params, x = _model(post_ln)
    v32, g32 = _value_and_grad(loss, params, x)
    got = jax.jit(jax.value_and_grad(autocast.amp(loss, compute_dtype=dtype, remat_float32="matmuls")))(params, x)
    ref = jax.jit(jax.value_and_grad(autocast.amp(loss, compute_dtype=dtype, remat_float32=True)))(params, x)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-3)
    assert _rel(got[1], ref[1]) < 1e-2, _rel(got[1], ref[1])
    np.testing.assert_allclose(got[0], v32, rtol=2e-2)
    assert _rel(got[1], g32) < max(5e-2, 1.5 * _rel(ref[1], g32)), (_rel(got[1], g32), _rel(ref[1], g32))


def _checkpoints(closed) -> list:
    """The checkpoints at the top level of an amp'd function's jaxpr (its own jit inlined)."""
    eqns = list(closed.jaxpr.eqns)
    while len(eqns) == 1 and kind(eqns[0]) == "jit":
        (body,) = bodies(eqns[0])
        eqns = list(getattr(body, "jaxpr", body).eqns)
    return [e for e in eqns if kind(e) == "checkpoint"]


def test_each_chain_stays_inside_its_block():
    """Two chains a pre-LN block (attention; MLP), each with one block's matmuls: a chain that
    ran on across blocks would recompute them all at once in the backward pass."""
    n = 3
    loss, params, x = _model(post_ln=False, n=n)
    closed = jax.make_jaxpr(autocast.amp(loss, compute_dtype=jnp.bfloat16, remat_float32="matmuls"))(params, x)
    checkpoints = _checkpoints(closed)
    dots = [sum(e.primitive.name == "dot_general" for b in bodies(c) for e, _ in walk(b)) for c in checkpoints]
    assert len(checkpoints) == 2 * n, dots
    assert max(dots) <= 6, dots  # q, k, v, scores, probabilities x values, output projection


@pytest.fixture
def splash_on_cpu():
    with _fuse.emitting("cpu", "splash"):
        yield


def test_splash_kernel_in_a_chain_is_recomputed_once(splash_on_cpu):
    """With splash running the attention (Pallas interpret mode), the kernel is inside its
    block's chain and adds no checkpoint of its own: values and gradients as with every island
    recomputed, and its forward kernel is in the program twice (once recomputed), not three times."""
    loss, params, x = _model(post_ln=False, n=1)
    f = autocast.amp(loss, compute_dtype=jnp.bfloat16, remat_float32="matmuls")
    closed = jax.jit(jax.value_and_grad(f)).trace(params, x).jaxpr

    def splash(e):
        name = str(e.params.get("name") or e.params.get("name_and_src_info"))  # (JAX 0.12 | 0.9)
        return e.primitive.name == "pallas_call" and "splash" in name and "fwd" in name

    assert sum(splash(e) for e, _ in walk(closed)) == 2
    got = jax.jit(jax.value_and_grad(f))(params, x)
    ref = jax.jit(jax.value_and_grad(autocast.amp(loss, compute_dtype=jnp.bfloat16, remat_float32=True)))(params, x)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-3)
    assert _rel(got[1], ref[1]) < 1e-2


def test_forward_mode_hessian_vector_product_and_vmap():
    loss, params, x = _model(post_ln=True, n=1)
    chained = autocast.amp(loss, compute_dtype=jnp.bfloat16, remat_float32="matmuls")
    every = autocast.amp(loss, compute_dtype=jnp.bfloat16, remat_float32=True)
    tangent = jax.tree_util.tree_map(lambda p: jnp.ones_like(p) / p.size, params)

    def jvp(f):
        return jax.jit(lambda p: jax.jvp(lambda p: f(p, x), (p,), (tangent,)))(params)

    def hvp(f):
        return jax.jit(lambda p: jax.jvp(jax.grad(lambda p: f(p, x)), (p,), (tangent,))[1])(params)

    def per_example(f):
        return jax.jit(jax.vmap(jax.grad(lambda p, x: f(p, x[None])), in_axes=(None, 0)))(params, x)

    for a, b in ((jvp(chained), jvp(every)), (hvp(chained), hvp(every)), (per_example(chained), per_example(every))):
        assert _rel(a, b) < 2e-2, _rel(a, b)


def test_blocks_in_a_scan():
    """Blocks stacked and run by `lax.scan` (Equinox's scan-over-layers): the chains are in
    the scan's body; the MLP's activation is not among its residuals."""
    blocks = [_Block(False, k) for k in jax.random.split(jax.random.key(0), 3)]
    params, static = eqx.partition(blocks, eqx.is_inexact_array)
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *params)
    block_static = static[0]
    x = jax.random.normal(jax.random.key(1), (T, D))

    def loss(stacked, x):
        def body(x, p):
            return eqx.combine(p, block_static)(x), None

        return jnp.mean(jax.lax.scan(body, x, stacked)[0] ** 2)

    chained = autocast.amp(loss, compute_dtype=jnp.bfloat16, remat_float32="matmuls")
    every = autocast.amp(loss, compute_dtype=jnp.bfloat16, remat_float32=True)
    kept = _kept(chained, stacked, x)
    assert not any(HIDDEN in s for _, s in kept), kept
    assert any(HIDDEN in s for _, s in _kept(every, stacked, x))
    got, ref = (jax.jit(jax.value_and_grad(f))(stacked, x) for f in (chained, every))
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-3)
    assert _rel(got[1], ref[1]) < 1e-2


def test_flax_linen_block():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(y, y)
            y = nn.LayerNorm()(x)
            return x + nn.Dense(D)(nn.gelu(nn.Dense(HIDDEN)(y)))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = Block()(x)
            return x

    model = Model()
    x = jax.random.normal(jax.random.key(1), (BATCH, T, D))
    params = model.init(jax.random.key(0), x)

    def loss(params, x):
        return jnp.mean(model.apply(params, x).astype(jnp.float32) ** 2)

    chained = autocast.amp(loss, compute_dtype=jnp.bfloat16, remat_float32="matmuls")
    every = autocast.amp(loss, compute_dtype=jnp.bfloat16, remat_float32=True)
    assert not any(HIDDEN in s for _, s in _kept(chained, params, x))
    assert any(HIDDEN in s for _, s in _kept(every, params, x))
    v32, g32 = jax.value_and_grad(loss)(params, x)
    got, ref = (jax.jit(jax.value_and_grad(f))(params, x) for f in (chained, every))
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-3)
    assert _rel(got[1], ref[1]) < 1e-2
    assert _rel(got[1], g32) < 5e-2


def test_explain_and_find_overflow_take_the_option():
    loss, params, x = _model(post_ln=False, n=1)
    report = autocast.explain(loss, compute_dtype=jnp.bfloat16, remat_float32="matmuls")(params, x)
    assert "recomputed" in str(report)
    found = autocast.find_overflow(loss, compute_dtype=jnp.float16, remat_float32="matmuls")(params, x)
    assert found is None or not found
