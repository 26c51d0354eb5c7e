"""Loss heads as model code writes them, and the checks tests/test_loss_head_idioms.py runs on them.

Each idiom is a function `loss(h, p, w, y)` of the hidden states before a small body (`h`,
[B,T,D]), the body's weight (`p`, [D,D]), the head weight (`w`, [V,D], as an embedding table
is laid out) and the labels (`y`, [B,T] int32): the body is `tanh(h @ p)`, so a gradient the
rewrite dropped or mis-scaled on its way to the hidden states shows in `p`'s and `h`'s
gradients as well as in the head's own. The checks compare `amp(loss, loss_head=k)` (the
logits computed on `k` token chunks) with `amp(loss, loss_head="xla")` (the same bfloat16
arithmetic per row, the logits whole: only the summation order across chunks differs) and
with the float32 function as written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import common_utils

import autocast

B, T, D, V = 4, 8, 16, 128
"""Batch, tokens per example, width, vocabulary: the logits are 8 times the hidden states."""

IGNORE = -100
"""The ignore index of PyTorch and Hugging Face: a label the loss skips."""

CHUNKED = "chunked"
"""How `explain` says a head was rewritten: its `how` starts with this."""

SAME_RTOL, SAME_ATOL = 1e-5, 1e-6
"""Chunked against as written: float32 rounding of a different summation order. The atol is
relative to the largest magnitude of the reference (a gradient entry near zero)."""

FLIP_TOL = 1e-4
"""Chunked against as written where a value lands on the other side of a half-precision
rounding boundary in one of the two programs: the float32 values before the rounding differ
in their last bit (a sum in another order), and now and then the rounded ones by one ulp.
One bfloat16 ulp in one of 4,096 logits' cotangents moves its row of the hidden-state
gradient by 2e-3 of the largest entry, the gradients 3e-5 norm-wise: compared norm-wise.
A bfloat16 rounding everywhere is 1e-3; a dropped or misplaced cotangent O(1)."""

F32_TOL = 3e-2
"""Chunked against float32 as written: bfloat16 logits (8 bits of mantissa) through a width-16
matmul, as a norm-wise relative error per leaf (measured: at most about 1e-2 on these shapes)."""


def inputs(seed: int = 0, b: int = B, t: int = T, d: int = D, v: int = V) -> tuple[Any, ...]:
    """`(h, p, w, y)`: normal hidden states, body and head weights scaled so that the logits
    are O(1) and the loss is about log(V), labels uniform over the vocabulary."""
    kh, kp, kw, ky = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(kh, (b, t, d), jnp.float32)
    p = jax.random.normal(kp, (d, d), jnp.float32) / np.sqrt(d)
    w = 2.0 * jax.random.normal(kw, (v, d), jnp.float32) / np.sqrt(d)
    y = jax.random.randint(ky, (b, t), 0, v, jnp.int32)
    return h, p, w, y


def body(h: Any, p: Any) -> Any:
    """The model before the head: one layer, so that gradients reach a parameter through the
    hidden states' cotangent."""
    return jnp.tanh(h @ p)


def logits_of(h: Any, p: Any, w: Any) -> Any:
    """`[B,T,V]` logits: the body, then the head `x @ w.T`."""
    return body(h, p) @ w.T


def with_ignored(y: Any) -> Any:
    """`y` with every third label set to `IGNORE` (padding, a prompt the loss skips)."""
    flat = y.reshape(-1)
    flat = jnp.where(jnp.arange(flat.size) % 3 == 1, IGNORE, flat)
    return flat.reshape(y.shape)


def _optax_flat(h, p, w, y):
    logits = logits_of(h, p, w)
    return optax.softmax_cross_entropy_with_integer_labels(logits.reshape(-1, w.shape[0]), y.reshape(-1)).mean()


def _optax_btv(h, p, w, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits_of(h, p, w), y).mean()


def _optax_one_hot(h, p, w, y):
    return optax.softmax_cross_entropy(logits_of(h, p, w), jax.nn.one_hot(y, w.shape[0])).mean()


def _log_softmax_take(h, p, w, y):
    logp = jax.nn.log_softmax(logits_of(h, p, w), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
    """Flax's examples/lm1b/train.py, as written there (with `common_utils.onehot`)."""
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(
        confidence * jnp.log(confidence) + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
    )
    soft_targets = common_utils.onehot(targets, vocab_size, on_value=confidence, off_value=low_confidence)
    loss = -jnp.sum(soft_targets * jax.nn.log_softmax(logits), axis=-1)
    loss = loss - normalizing_constant
    normalizing_factor = np.prod(targets.shape)
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()
    return loss.sum(), normalizing_factor


def _flax_lm1b(h, p, w, y):
    weights = jnp.where(y > 0, 1, 0).astype(jnp.float32)  # lm1b: token 0 is padding
    loss, norm = compute_weighted_cross_entropy(logits_of(h, p, w), y, weights, label_smoothing=0.1)
    return loss / norm


def _hf_gpt2_shift(h, p, w, y):
    logits = logits_of(h, p, w)
    shift_logits, shift_labels = logits[:, :-1], y[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(shift_logits, shift_labels).mean()


def _ignore_index(h, p, w, y):
    y = with_ignored(y)
    mask = y != IGNORE
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_of(h, p, w), jnp.where(mask, y, 0))
    return jnp.sum(ce * mask) / jnp.sum(mask)


def _smooth_optax(h, p, w, y):
    labels = optax.smooth_labels(jax.nn.one_hot(y, w.shape[0]), 0.1)
    return optax.softmax_cross_entropy(logits_of(h, p, w), labels).mean()


def _smooth_by_hand(h, p, w, y):
    eps = 0.1
    logp = jax.nn.log_softmax(logits_of(h, p, w))
    nll = -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
    return jnp.mean((1 - eps) * nll - eps * logp.mean(axis=-1))


def _z_loss(h, p, w, y):
    logits = logits_of(h, p, w)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(ce + 1e-4 * jax.nn.logsumexp(logits, axis=-1) ** 2)


def _soft_cap(h, p, w, y):
    logits = 10.0 * logits_of(h, p, w)  # large enough for the cap to bend them
    logits = jnp.tanh(logits / 30.0) * 30.0
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _temperature(h, p, w, y):
    logits = logits_of(h, p, w) / 0.7
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


IDIOMS: dict[str, Callable[..., Any]] = {
    "optax_integer_labels_flat": _optax_flat,
    "optax_integer_labels_btv": _optax_btv,
    "optax_one_hot": _optax_one_hot,
    "log_softmax_take_along_axis": _log_softmax_take,
    "flax_lm1b_weighted_smoothed": _flax_lm1b,
    "hf_gpt2_shifted": _hf_gpt2_shift,
    "ignore_index_masked_mean": _ignore_index,
    "label_smoothing_optax": _smooth_optax,
    "label_smoothing_by_hand": _smooth_by_hand,
    "z_loss": _z_loss,
    "gemma2_soft_cap": _soft_cap,
    "temperature": _temperature,
}
"""Name -> `loss(h, p, w, y)`: the head and its loss as each source writes it."""


def equinox_head(key: Any = None, d: int = D, v: int = V) -> eqx.nn.Linear:
    """An `eqx.nn.Linear` head (weight [V,D] and a bias), as the Equinox examples build one."""
    return eqx.nn.Linear(d, v, key=jax.random.key(7) if key is None else key)


def equinox_loss(head: eqx.nn.Linear, h: Any, p: Any, y: Any) -> Any:
    """The Equinox examples' loss: the module applied per token by `jax.vmap(jax.vmap(head))`,
    then optax's integer-label cross entropy, mean."""
    logits = jax.vmap(jax.vmap(head))(body(h, p))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def heads(fn: Callable[..., Any], args: Sequence[Any], k: int = 4, dtype: Any = jnp.bfloat16) -> list[dict[str, str]]:
    """`explain`'s list of the loss heads of `amp(fn, dtype, loss_head=k)` on `args`."""
    report = autocast.explain(fn, compute_dtype=dtype, loss_head=k)(*args)
    return report.totals["loss_head"]


def assert_chunked(fn: Callable[..., Any], args: Sequence[Any], k: int = 4, count: int = 1) -> None:
    """`explain` finds `count` loss heads in `fn` and says each is computed on `k` chunks."""
    found = heads(fn, args, k)
    assert len(found) == count, found
    for head in found:
        assert head["how"].startswith(CHUNKED), head
        assert f"{k} token chunks" in head["how"], head


def strict(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`jax.jit(fn)(*args, **kwargs)`, compiled without XLA's excess precision.

    XLA may keep a value the program rounds to bfloat16 in float32 inside a fusion
    (`xla_allow_excess_precision`, on by default), and fuses the chunked program (a scan
    body) differently from the program as written: left on, the two differ by a bfloat16
    rounding where the jaxprs round alike (measured: 2e-3 of the head weight's gradient).
    Off, each program rounds exactly where its jaxpr does.
    """
    return jax.jit(fn).lower(*args, **kwargs).compile(EXACT)(*args, **kwargs)


EXACT = {"xla_allow_excess_precision": False}
"""XLA compile options under which a program rounds exactly where its jaxpr says (`strict`)."""


def assert_same(actual: Any, desired: Any, rtol: float = SAME_RTOL, atol: float = SAME_ATOL) -> None:
    """Every leaf equal within float32 rounding: `rtol`, and `atol` times the leaf's largest
    magnitude; same dtypes, all finite."""
    a_leaves, d_leaves = jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(desired)
    assert len(a_leaves) == len(d_leaves)
    for a, d in zip(a_leaves, d_leaves):
        assert a.dtype == d.dtype, (a.dtype, d.dtype)
        a, d = np.asarray(a, np.float64), np.asarray(d, np.float64)
        assert np.all(np.isfinite(a)) and np.all(np.isfinite(d))
        np.testing.assert_allclose(a, d, rtol=rtol, atol=atol * max(np.max(np.abs(d)), 1e-30))


def assert_near(actual: Any, desired: Any, tol: float = F32_TOL) -> None:
    """Every leaf within `tol` of `desired`'s, norm-wise, and `desired` not all zero."""
    a_leaves, d_leaves = jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(desired)
    assert len(a_leaves) == len(d_leaves)
    for a, d in zip(a_leaves, d_leaves):
        a, d = np.asarray(a, np.float64), np.asarray(d, np.float64)
        assert np.linalg.norm(d) > 0
        err = np.linalg.norm(a - d) / np.linalg.norm(d)
        assert err < tol, f"relative error {err:.3g} (shape {d.shape})"


def grad_fn(
    fn: Callable[..., Any], argnums: tuple[int, ...], loss_head: Any, dtype: Any = jnp.bfloat16, has_aux: bool = False
) -> Callable[..., Any]:
    """`jax.value_and_grad(amp(fn, dtype, loss_head=...), argnums)`, as users call it."""
    amped = autocast.amp(fn, compute_dtype=dtype, loss_head=loss_head)
    return jax.value_and_grad(amped, argnums=argnums, has_aux=has_aux)


def check(fn: Callable[..., Any], args: Sequence[Any], argnums: tuple[int, ...], k: int = 4) -> None:
    """The checks of an idiom: `explain` says its head is chunked; under `jax.jit`, loss and
    gradients with `loss_head=k` equal those with `loss_head="xla"` within float32 rounding
    (`assert_same`); called eagerly, both near each other and the float32 function's."""
    assert_chunked(fn, args, k)
    chunked, written = grad_fn(fn, argnums, k), grad_fn(fn, argnums, "xla")
    if all(FORWARD in h["how"] for h in heads(fn, args, k)):
        assert_forward_gradients(
            strict(chunked, *args), strict(written, *args), jax.value_and_grad(fn, argnums=argnums)(*args)
        )
    else:  # the same arithmetic per row: float32 rounding, or a bfloat16 flip on a few entries
        (loss_c, grads_c), (loss_w, grads_w) = strict(chunked, *args), strict(written, *args)
        assert_same(loss_c, loss_w)
        assert_near(grads_c, grads_w, FLIP_TOL)
    eager = chunked(*args)
    assert_near(eager, written(*args), EAGER_TOL)
    assert_near(eager, jax.value_and_grad(fn, argnums=argnums)(*args))


FORWARD = "gradients with the forward pass"
"""What explain says of a head whose gradients the loop makes (`autocast._loss_head._forward`)."""

BF16_TOL = 2**-7
"""Two bfloat16 roundings, norm-wise."""


def assert_forward_gradients(chunked: Any, written: Any, reference: Any) -> None:
    """A head differentiated with its forward pass (`_forward`): the loss is the same
    arithmetic (equal within float32 rounding); each gradient is made at cotangent 1 and then
    scaled (`c * (dL/dlogits . W)` where as written the GEMM reads `c * dL/dlogits`), so the
    two round the cotangent to bfloat16 at different points: equal within two bfloat16
    roundings, and about as far from the float32 function's gradient as written (at most 1.5x:
    measured 0.80x to 1.12x on the idioms, both JAX ends)."""
    (loss_c, grads_c), (loss_w, grads_w), (_, grads_32) = chunked, written, reference
    assert_same(loss_c, loss_w)
    assert_near(grads_c, grads_w, BF16_TOL)
    for c, w, r in zip(*(jax.tree_util.tree_leaves(t) for t in (grads_c, grads_w, grads_32))):
        c, w, r = (np.asarray(t, np.float64) for t in (c, w, r))
        err_c, err_w = np.linalg.norm(c - r), np.linalg.norm(w - r)
        assert err_c <= 1.5 * err_w + 1e-6 * np.linalg.norm(r), (err_c, err_w)


EAGER_TOL = 1e-2
"""Chunked against as written, both called eagerly: the as-written program runs one
operation at a time, each rounded to bfloat16, while the chunked one's scan is compiled
whole, where XLA's excess precision keeps fused values in float32 (`strict`). Measured: at
most 7e-3 norm-wise (the soft cap's tanh chain); a dropped or mis-scaled gradient is O(1)."""
