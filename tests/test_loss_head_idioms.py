"""The loss-head rewrite (issue 49) on the losses model code writes: optax, Flax's lm1b,
Equinox's examples, Hugging Face's shifted GPT-2 loss, masks, label smoothing, z-loss, soft
caps, tied embeddings, per-token losses, under every transformation and the float16 scaler.

Each test asserts that `explain` says the head is computed on token chunks, and compares
`amp(f, loss_head=k)` with `amp(f, loss_head="xla")` (the head as written: the same bfloat16
arithmetic per row, so under `jax.jit` without XLA's excess precision the two differ only by
the order of float32 sums across chunks) and with the float32 function. The cases and the
comparisons are in tests/loss_head_cases.py. This file runs on the oldest and newest JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import walk
from loss_head_cases import (
    EAGER_TOL,
    FLIP_TOL,
    IDIOMS,
    assert_chunked,
    assert_near,
    assert_same,
    body,
    check,
    equinox_head,
    equinox_loss,
    grad_fn,
    heads,
    inputs,
    logits_of,
    strict,
)

import autocast
from autocast import _compat

ARGS = inputs()
HPW = (0, 1, 2)  # every float input: hidden states, body weight, head weight


@pytest.mark.parametrize("name", sorted(IDIOMS))
def test_idiom_is_chunked_and_equals_the_head_as_written(name):
    check(IDIOMS[name], ARGS, HPW)


def test_equinox_linear_head_vmapped_per_token():
    """The head is the module's weight [V,D] on the left (`weight @ x`) and its bias, both
    differentiated as the module's leaves."""
    h, p, _, y = ARGS
    check(equinox_loss, (equinox_head(), h, p, y), (0, 1, 2))


def _tied(emb, p, tokens, y):
    """A tied embedding: the table `emb` [V,D] looks the tokens up and is the head."""
    logits = body(emb[tokens], p) @ emb.T
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_tied_embedding_weight_gradient_sums_both_uses():
    _, p, w, y = ARGS
    tokens = jnp.roll(y, 1, axis=1)
    args = (w, p, tokens, y)
    check(_tied, args, (0, 1))
    # the lookup's share is not negligible, so the check above sees a dropped path
    _, (g_emb, _) = strict(grad_fn(_tied, (0, 1), 4), *args)
    head_only = jax.grad(lambda e: _untied(w, e, p, tokens, y))(w)
    assert np.linalg.norm(np.asarray(g_emb - head_only)) > 0.1 * np.linalg.norm(np.asarray(g_emb))


def _untied(table, head, p, tokens, y):
    logits = body(table[tokens], p) @ head.T
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _per_token(h, p, w, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits_of(h, p, w), y)


def test_reduction_none_per_token_loss_comes_back_whole():
    """The per-token loss [B,T] returned: each token's value as written, and the cotangent
    a caller puts on each token reaches every input."""
    assert_chunked(_per_token, ARGS)
    chunked = autocast.amp(_per_token, compute_dtype=jnp.bfloat16, loss_head=4)
    written = autocast.amp(_per_token, compute_dtype=jnp.bfloat16, loss_head="xla")
    out = strict(chunked, *ARGS)
    assert out.shape == ARGS[3].shape
    assert_same(out, strict(written, *ARGS))
    weights = jax.random.uniform(jax.random.key(3), ARGS[3].shape)  # a different cotangent per token

    def weighted(f):
        return jax.value_and_grad(lambda *a: jnp.sum(weights * f(*a)), argnums=HPW)

    # FLIP_TOL: measured, one logit's cotangent of 4,096 one bfloat16 ulp apart
    assert_near(strict(weighted(chunked), *ARGS), strict(weighted(written), *ARGS), FLIP_TOL)
    assert_near(weighted(chunked)(*ARGS), weighted(_per_token)(*ARGS))


def _sum_and_per_token(h, p, w, y):
    ce = _per_token(h, p, w, y)
    return ce.sum(), ce


def test_reduction_none_and_its_sum_returned_together():
    assert_chunked(_sum_and_per_token, ARGS)
    chunked = strict(grad_fn(_sum_and_per_token, HPW, 4, has_aux=True), *ARGS)
    written = strict(grad_fn(_sum_and_per_token, HPW, "xla", has_aux=True), *ARGS)
    assert_same(chunked, written)
    (total, per_token), _ = chunked
    np.testing.assert_allclose(total, per_token.sum(), rtol=1e-6)


def _flat(h, p, w, y):
    return IDIOMS["optax_integer_labels_flat"](h, p, w, y)


def _micro_batches(h2, p, w, y2):
    """Gradient accumulation's loop: the head inside a `lax.scan` body, one micro-batch a step."""

    def step(total, xs):
        h, y = xs
        return total + _flat(h, p, w, y), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (h2, y2))
    return total / h2.shape[0]


def _per_example(h, p, w, y):
    """One example's loss: `h` [T,D], `y` [T]."""
    return optax.softmax_cross_entropy_with_integer_labels(body(h, p) @ w.T, y).mean()


def _vmap_inside(h, p, w, y):
    return jax.vmap(_per_example, in_axes=(0, None, None, 0))(h, p, w, y).mean()


def _two_micro_batches():
    h, p, w, y = inputs(b=8)
    return h.reshape(2, 4, *h.shape[1:]), p, w, y.reshape(2, 4, *y.shape[1:])


LONG = inputs(b=2, t=32)
"""Two examples of 32 tokens: one example's logits [32,V] are larger than the head weight
[V,D] (a head the finder takes: more tokens than the width)."""


TRANSFORMED = {
    "inside_jit": (jax.jit(_flat), ARGS),
    "inside_checkpoint": (jax.checkpoint(_flat), ARGS),
    "inside_lax_scan_body": (_micro_batches, _two_micro_batches()),
    "amp_of_vmap": (_vmap_inside, ARGS),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMED))
def test_head_inside_a_transformation(name):
    fn, args = TRANSFORMED[name]
    check(fn, args, HPW)


def test_vmap_of_amp_over_the_batch():
    """`jax.vmap(amp(per_example))`: amp sees one example ([T,D] hidden states, chunked along
    T); vmap batches the chunked loop."""
    h, p, w, y = LONG
    assert_chunked(_per_example, (h[0], p, w, y[0]))

    def loss(head):
        def f(h, p, w, y):
            amped = autocast.amp(_per_example, compute_dtype=jnp.bfloat16, loss_head=head)
            return jax.vmap(amped, in_axes=(0, None, None, 0))(h, p, w, y).mean()

        return jax.value_and_grad(f, argnums=HPW)

    assert_same(strict(loss(4), *LONG), strict(loss("xla"), *LONG))
    eager = loss(4)(*LONG)
    assert_near(eager, loss("xla")(*LONG), EAGER_TOL)
    assert_near(eager, jax.value_and_grad(_vmap_inside, argnums=HPW)(*LONG))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_dynamic_loss_scaler_gradients_equal_the_head_as_written(dtype):
    """The scaled loss's cotangent (2**15) enters the chunked loop: the unscaled gradients
    equal those as written, finite, and the scaler sees them finite."""
    assert [h["how"].startswith("chunked") for h in heads(_flat, ARGS, dtype=dtype)] == [True]

    def scaled(head):
        amped = autocast.amp(_flat, compute_dtype=dtype, loss_head=head)
        return autocast.dynamic_scale_value_and_grad(amped, argnums=HPW, filter=False)

    state = autocast.DynamicScalerState()
    new, (loss, grads) = strict(scaled(4), *ARGS, dynamic_scaler_state=state)
    new_w, written = strict(scaled("xla"), *ARGS, dynamic_scaler_state=state)
    assert bool(new.grads_finite) and bool(new_w.grads_finite)
    assert float(new.scaler) == float(state.scaler)
    assert_same((loss, grads), written)
    assert_near((loss, grads), jax.value_and_grad(_flat, argnums=HPW)(*ARGS), 5e-2 if dtype == jnp.float16 else 3e-2)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_an_outer_scale_reaches_every_gradient(dtype):
    """grad(2 L) == 2 grad(L) through the chunked program, for the hidden states' gradient
    (and the body weight's behind it) as well as the head weight's: MaxText's vocabulary
    tiling scaled only the head's for 11 months (a dropped scale is off by a factor of 2).
    In bfloat16 (float32's exponent range) doubling is exact; in float16 the cotangents'
    subnormals gain a bit when doubled, as they do as written (measured 4e-5 norm-wise,
    the same in both), so there the doubled gradients are compared with those as written."""
    grads = {}
    for head in (4, "xla"):
        amped = autocast.amp(_flat, compute_dtype=dtype, loss_head=head)
        once = strict(jax.grad(amped, argnums=HPW), *ARGS)
        twice = strict(jax.grad(lambda *a, f=amped: 2.0 * f(*a), argnums=HPW), *ARGS)
        grads[head] = once, twice
    (once, twice), (once_w, twice_w) = grads[4], grads["xla"]
    assert_same(once, once_w)
    # FLIP_TOL in float16: measured, one row of the doubled hidden-state gradient one float16
    # rounding apart (1.6e-4 of it; 5e-6 norm-wise)
    if dtype == jnp.float16:
        assert_near(twice, twice_w, FLIP_TOL)
    else:
        assert_same(twice, twice_w)
    for g1, g2 in zip(once, twice):
        assert np.linalg.norm(np.asarray(g1, np.float64)) > 0
        if dtype == jnp.bfloat16:
            np.testing.assert_array_equal(np.asarray(g2), 2 * np.asarray(g1))
    assert_near(jax.tree_util.tree_map(lambda g: g / 2, twice), once, 1e-3)


def _carries(jaxpr):
    """The carry avals of every scan at any depth."""
    out = []
    for eqn, _ in walk(jaxpr):
        if eqn.primitive.name == "scan":
            consts, carry = _compat.scan_counts(eqn.params)
            out.append([v.aval for v in eqn.invars[consts : consts + carry]])
    return out


def test_weight_gradient_accumulates_in_float32_across_chunks():
    """The backward loop carries the head weight's cotangent in float32 (the weight enters the
    loop as it arrived and is cast inside), not in the compute dtype."""
    w = ARGS[2]
    jaxpr = jax.make_jaxpr(jax.grad(autocast.amp(_flat, compute_dtype=jnp.bfloat16, loss_head=4), argnums=2))(*ARGS)
    weight_shapes = {w.shape, w.shape[::-1]}
    carried = [a for carry in _carries(jaxpr) for a in carry if a.shape in weight_shapes]
    assert carried, _carries(jaxpr)
    assert all(a.dtype == jnp.float32 for a in carried), carried


def test_many_chunks_weight_gradient_within_float32_rounding():
    """16 chunks of 4 tokens: the head weight's gradient, a sum of 16 partial products, equals
    the one as written to float32 rounding (a bfloat16 accumulator would be off by ~4e-3)."""
    h, p, w, y = inputs(b=64, t=1)
    args = (h[:, 0], p, w, y[:, 0])
    assert_chunked(_flat_2d, args, k=16)
    chunked = strict(grad_fn(_flat_2d, HPW, 16), *args)
    assert_same(chunked, strict(grad_fn(_flat_2d, HPW, "xla"), *args))


def _flat_2d(h, p, w, y):
    return optax.softmax_cross_entropy_with_integer_labels(body(h, p) @ w.T, y).mean()
