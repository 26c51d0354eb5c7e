"""A per-row pick (`take_along_axis`) that amp reads in float32 is, for a TPU, a masked sum
over the row (`autocast._pick`): the same values as the gather, bit for bit, in every gather
mode, along any axis, with the batching axes in any order and NaNs or infinities elsewhere in
the row; the same values and gradients through amp, under `vmap` and forward mode too; a
gather of any other form is left a gather, and so is every pick where no TPU compiles."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import walk
from loss_head_cases import IDIOMS, inputs

import autocast
from autocast import _pick

MODES = [jax.lax.GatherScatterMode.FILL_OR_DROP, jax.lax.GatherScatterMode.CLIP]


def _gather_params(f, *args):
    """The parameters and the indices' shape of the first `gather` in `f`'s jaxpr."""
    eqn = next(e for e, _ in walk(jax.make_jaxpr(f)(*args)) if e.primitive.name == "gather")
    return dict(eqn.params), eqn.invars[1].aval.shape


def _same_as_gather(x, indices, params):
    axis = _pick.row_axis(params, x.shape, indices.shape)
    assert axis is not None
    want = jax.jit(lambda x, i: jax.lax.gather(x, i, **params))(x, indices)
    got = jax.jit(lambda x, i: _pick.masked(x, i, params, axis))(x, indices)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))  # (NaN == NaN)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_masked_sum_is_the_gather_in_every_mode_and_axis(axis, mode, dtype):
    rng = np.random.default_rng(axis)
    x = jnp.asarray(rng.standard_normal((3, 5, 11)), dtype)
    x = x.at[0, 0].set(jnp.inf).at[1, 1].set(jnp.nan)  # elsewhere in rows: never read by a pick
    shape = [3, 5, 11]
    shape[axis] = 1
    params, ishape = _gather_params(lambda x, i: jnp.take_along_axis(x, i, axis=axis), x, jnp.zeros(shape, jnp.int32))
    params["mode"] = mode
    size = x.shape[axis]
    indices = jnp.asarray(rng.integers(-3, size + 3, ishape), jnp.int32)  # out of bounds too
    _same_as_gather(x, indices, params)


def test_batching_axes_in_another_order_than_the_operands():
    """`start_indices_batching_dims` need not follow `operand_batching_dims`' order."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, 6, 7)), jnp.float32)
    dn = jax.lax.GatherDimensionNumbers(
        offset_dims=(),
        collapsed_slice_dims=(1,),
        start_index_map=(1,),
        operand_batching_dims=(0, 2),
        start_indices_batching_dims=(1, 0),
    )
    params = {
        "dimension_numbers": dn,
        "slice_sizes": (1, 1, 1),
        "indices_are_sorted": False,
        "unique_indices": False,
        "mode": jax.lax.GatherScatterMode.FILL_OR_DROP,
        "fill_value": None,
    }
    indices = jnp.asarray(rng.integers(-1, 8, (7, 4, 1)), jnp.int32)
    _same_as_gather(x, indices, params)


def test_other_gathers_are_not_picks():
    x = jnp.zeros((8, 5), jnp.float32)
    rows = jnp.array([3, 1])
    cases = {
        "embedding lookup (a row per index)": (lambda x, i: x[i], x, rows),
        "two picks per row": (lambda x, i: jnp.take_along_axis(x, i, axis=1), x, jnp.zeros((8, 2), jnp.int32)),
        "a window of 2": (lambda x, i: jax.lax.dynamic_slice_in_dim(x, i[0], 2, 1), x, rows),
    }
    for what, (f, x, i) in cases.items():
        try:
            params, ishape = _gather_params(f, x, i)
        except StopIteration:  # lowered to something else than a gather: not a pick either
            continue
        assert _pick.row_axis(params, x.shape, ishape) is None, what


def _ce(w, h, y, by_hand=False):
    logits = h @ w
    logits = logits.astype(jnp.float32) if by_hand else logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _problem(seed=3):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((16, 40)) / 4, jnp.float32)
    h = jnp.asarray(rng.standard_normal((2, 6, 16)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 40, (2, 6)), jnp.int32)
    return w, h, y


def _big_selects(hlo: str) -> list[str]:
    """The gather and scatter instructions of a compiled program that come from the label
    pick (`take_along_axis`, forward or transposed)."""
    return [
        line for line in hlo.splitlines() if re.search(r"= \S+ (gather|scatter)\(", line) and "take_along_axis" in line
    ]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_amp_picks_the_label_logit_with_a_masked_sum_where_asked(dtype):
    """Through amp, the masked sum on this machine's platform (`masked_on("cpu")`): the
    compiled step has no gather and no scatter of the logits' size; its value and gradients
    are bit for bit those of converting the logits to float32 by hand (where the gather
    reads float32), also under `vmap` and forward mode."""
    w, h, y = _problem()
    by_hand = autocast.amp(functools.partial(_ce, by_hand=True), compute_dtype=dtype)
    with _pick.masked_on(jax.default_backend()):
        new = autocast.amp(_ce, compute_dtype=dtype)
        step = jax.jit(jax.value_and_grad(new))
        assert not _big_selects(step.lower(w, h, y).compile().as_text())
        got = step(w, h, y)
        batched = jax.vmap(jax.grad(new), in_axes=(None, 0, 0))(w, h, y)
        t = jnp.ones_like(w)
        tangent = jax.jvp(lambda w: new(w, h, y), (w,), (t,))[1]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(jax.value_and_grad(by_hand))(w, h, y))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(batched, jax.vmap(jax.grad(by_hand), in_axes=(None, 0, 0))(w, h, y))
    np.testing.assert_array_equal(tangent, jax.jvp(lambda w: by_hand(w, h, y), (w,), (t,))[1])


def test_the_gather_stays_where_no_tpu_compiles(monkeypatch):
    """Without a TPU compiler here the program is the gather alone, as before (no platform
    branch); with one, a `platform_dependent` whose TPU branch is the masked sum and whose
    other branch, the one this CPU runs, is the gather."""
    w, h, y = _problem()

    def conds(closed):
        return [e for e, _ in walk(closed) if e.primitive.name == "cond"]

    def gathers(closed):
        return [e for e, _ in walk(closed) if e.primitive.name == "gather" and e.invars[0].aval.size == 2 * 6 * 40]

    monkeypatch.setattr(autocast._compat, "tpu_compiler", lambda: False)
    plain = jax.make_jaxpr(autocast.amp(_ce))(w, h, y)
    assert gathers(plain) and not conds(plain)
    monkeypatch.setattr(autocast._compat, "tpu_compiler", lambda: True)
    f = autocast.amp(_ce)
    branched = jax.make_jaxpr(f)(w, h, y)
    assert len(conds(branched)) == 1 and len(gathers(branched)) == 1
    assert _big_selects(jax.jit(f).lower(w, h, y).compile().as_text())  # the CPU runs the gather
    np.testing.assert_array_equal(f(w, h, y), autocast.amp(functools.partial(_ce, by_hand=True))(w, h, y))


def test_amp_keeps_the_fill_of_an_out_of_range_label():
    """A label past the vocabulary: the gather's NaN fill, as written (nothing hides it)."""
    w = jnp.ones((4, 10), jnp.float32)
    h = jnp.ones((3, 4), jnp.float32)
    y = jnp.array([1, 10, 2], jnp.int32)
    f = lambda w, h, y: optax.softmax_cross_entropy_with_integer_labels(h @ w, y)  # noqa: E731
    with _pick.masked_on(jax.default_backend()):
        got = autocast.amp(f, compute_dtype=jnp.bfloat16)(w, h, y)
    np.testing.assert_array_equal(np.isnan(np.asarray(got)), np.isnan(np.asarray(f(w, h, y))))
    assert bool(jnp.isnan(got[1])) and not bool(jnp.isnan(got[0]))


PICKING = (
    "gemma2_soft_cap",
    "hf_gpt2_shifted",
    "ignore_index_masked_mean",
    "label_smoothing_by_hand",
    "log_softmax_take_along_axis",
    "optax_integer_labels_btv",
    "optax_integer_labels_flat",
    "temperature",
    "z_loss",
)
"""The idioms that gather from the logits (the others, one-hot and optax's smoothing, pick nothing)."""


@pytest.mark.parametrize("name", PICKING)
def test_loss_head_idioms_chunked_the_same_with_the_masked_sum(name):
    """Each loss-head idiom (tests/loss_head_cases.py), chunked: with the masked sum on this
    machine's platform the compiled step's value and gradients are the gather's (the pick is
    exact; XLA may sum the loss over the tokens in another order: 1 ulp of float32 on two
    idioms under JAX 0.9.2)."""
    fn, args = IDIOMS[name], inputs(v=1000)
    picks = [
        e for e, _ in walk(jax.make_jaxpr(fn)(*args)) if e.primitive.name == "gather" and e.invars[0].aval.size >= 1000
    ]
    assert picks, f"{name} gathers nothing from its logits: not one for this test"

    def step():
        return jax.jit(jax.value_and_grad(autocast.amp(fn, compute_dtype=jnp.bfloat16, loss_head=4), argnums=(0, 1, 2)))

    want = step()(*args)
    with _pick.masked_on(jax.default_backend()):
        got = step()(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-7, atol=0)
