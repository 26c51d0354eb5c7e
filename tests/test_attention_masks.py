"""Every row as written (issue 47): the masks and biases a span carries, and what the
extracted call gives on every query row, fully masked rows included, against the original
equations in float32.

The call runs with ``implementation="xla"`` and its compute dtype set to float32, so that
the comparison is exact up to float32 rounding: a fully masked row that the call gets wrong
differs by the values' spread, not by a rounding error. Flax's own masking functions
(``flax.linen.dot_product_attention``, ``combine_masks``, ``make_attention_mask``,
``make_causal_mask``) build the real models' masks. The property test draws combinations of
masks, biases, fills, lengths and padded plans.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from attention_cases import evaluate
from hypothesis import given, settings
from hypothesis import strategies as st

from autocast import _attention as attention
from autocast._attention import LeftAlone, MaskKind, Match

B, T, N, H = 2, 4, 2, 8
MIN = float(np.finfo(np.float32).min)
JAXNN = float(np.float32(-0.7 * np.finfo(np.float32).max))


def _qkv(t: int = T, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, t, N, H)).astype(np.float32) for _ in range(3)]


def _found(fn, args) -> tuple[Match | LeftAlone, object]:
    jaxpr = jax.make_jaxpr(fn)(*args)
    (found,) = attention.find(jaxpr, compute_dtype=jnp.bfloat16)
    return found, jaxpr


def _check_rows(fn, args, multiple: int = 1) -> Match | LeftAlone:
    """The extracted call (float32, XLA) against the original on every row: equal up to
    float32 rounding, NaN where and only where the original is NaN. A span left alone
    is the original itself."""
    found, jaxpr = _found(fn, args)
    if isinstance(found, Match):
        m = dataclasses.replace(found, compute_dtype=np.dtype(np.float32))
        if multiple > 1:
            m = attention.pad_sequences(m, multiple)
        ref = np.asarray(evaluate(jaxpr, args)[0])
        new = np.asarray(evaluate(jaxpr, args, [m])[0])
        np.testing.assert_allclose(new, ref, rtol=2e-5, atol=2e-5, equal_nan=True, err_msg=found.describe())
    return found


LEFT_PADDED = np.array([[0, 0, 1, 1], [1, 1, 1, 1]], np.int32)  # batch 0: two padding tokens first


def _padding_bias(am):
    """Flax's and Hugging Face's padding bias: 0 where attended, finfo.min elsewhere."""
    keep = am[:, None, None, :] > 0
    return jax.lax.select(keep, jnp.zeros(keep.shape), jnp.full(keep.shape, MIN))


# --- bug 1: a row that a traced additive bias masks completely ---------------------------


def test_flax_linen_left_padding_with_a_causal_mask():
    """``flax.linen.dot_product_attention(bias=padding_bias, mask=causal)``, left padding:
    the padded queries see only padding keys, every value finfo.min (bias and fill alike),
    so the original averages v over all keys there. Before: the kernel's own mask value
    replaced the fill (XLA: the future keys only), 9e-2 off."""

    def fn(q, k, v, am):
        causal = nn.make_causal_mask(jnp.ones((B, T)))
        return nn.dot_product_attention(q, k, v, bias=_padding_bias(am), mask=causal)

    args = [*_qkv(), LEFT_PADDED]
    m = _check_rows(fn, args)
    assert isinstance(m, Match) and m.mask.kind == MaskKind.CAUSAL | MaskKind.MASK, m
    assert m.mask.may_empty and not m.mask.empty_nan
    out = np.asarray(evaluate(jax.make_jaxpr(fn)(*args), args)[0])
    np.testing.assert_allclose(out[0, :2], np.broadcast_to(args[2][0].mean(0), (2, N, H)), rtol=1e-5, atol=1e-6)


def test_causal_neg_inf_fill_beside_a_padding_bias_is_left_alone():
    """``where(causal, s + bias, -inf)``: a padded query's past keys are finfo.min, its
    future keys -inf, so the original averages the past keys' values; the masked values
    differ, and the span is left alone with that reason (before: fused, the mean over
    every key)."""

    def fn(q, k, v, am):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s + _padding_bias(am), -jnp.inf)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)

    found = _check_rows(fn, [*_qkv(), LEFT_PADDED])
    assert isinstance(found, LeftAlone)
    assert "different values where masked (-inf, -3.40282e+38)" in found.reason, found.reason


def test_a_learned_bias_beside_a_causal_mask_takes_the_mask():
    """A traced bias of unknown provenance (here it holds finfo.min for the padding, as a
    precomputed bias passed in does) beside ``is_causal``: the mask is folded into the
    bias, so a row the bias masks completely is the original's (before: the kernel's mask
    value decided it)."""
    bias = np.where(LEFT_PADDED[:, None, None, :] > 0, 0.0, MIN).astype(np.float32)
    bias = bias + np.random.default_rng(3).standard_normal((B, N, T, T)).astype(np.float32)

    def fn(q, k, v, b):
        return jax.nn.dot_product_attention(q, k, v, bias=b, is_causal=True)

    m = _check_rows(fn, [*_qkv(), bias])
    assert isinstance(m, Match) and m.mask.kind == MaskKind.BIAS and m.mask.folded, m
    assert "bias (the masks folded into it)" in m.describe()


def test_a_learned_bias_and_a_mask_bias_summed():
    """T5's form: a learned position bias plus the padding bias, one sum: split, the
    padding part a mask (and, beside the learned part, folded into it)."""
    pos = np.random.default_rng(4).standard_normal((1, N, T, T)).astype(np.float32)

    def fn(q, k, v, pos, am):
        s = jnp.einsum("btnh,bsnh->bnts", q, k)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s + (pos + _padding_bias(am)), MIN)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)

    m = _check_rows(fn, [*_qkv(), pos, LEFT_PADDED])
    assert isinstance(m, Match) and m.mask.folded, m


def test_neg_inf_rows_are_nan_where_the_original_is():
    """A ``-inf`` fill and a traced mask that empties one row: NaN on that row, as the
    original, and nowhere else."""
    mask = np.ones((B, T, T), bool)
    mask[1, 2] = False

    def fn(q, k, v, mask):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
        s = jnp.where(mask[:, None], s, -jnp.inf)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)

    args = [*_qkv(), mask]
    m = _check_rows(fn, args)
    assert isinstance(m, Match) and m.mask.empty_nan
    out = np.asarray(evaluate(jax.make_jaxpr(fn)(*args), args)[0])
    assert np.isnan(out[1, 2]).all() and np.isfinite(np.delete(out.reshape(B * T, -1), T + 2, axis=0)).all()
    # the gradients: NaN where the original's are (a loss that ignores the NaN row: the
    # original's value product still multiplies its NaN probabilities, dv is NaN; the
    # masking where keeps dq and dk finite)
    jaxpr = jax.make_jaxpr(fn)(*args)
    m32 = dataclasses.replace(m, compute_dtype=np.dtype(np.float32))

    def loss(matches, q, k, v):
        out = evaluate(jaxpr, [q, k, v, mask], matches)[0]
        return jnp.sum(jnp.where(jnp.isnan(out), 0.0, out) ** 2)

    ref = jax.grad(lambda *a: loss([], *a), argnums=(0, 1, 2))(*args[:3])
    new = jax.grad(lambda *a: loss([m32], *a), argnums=(0, 1, 2))(*args[:3])
    assert [bool(np.isnan(r).any()) for r in ref] == [False, False, True]
    for r, n in zip(ref, new):
        np.testing.assert_array_equal(np.isnan(n), np.isnan(r))
        np.testing.assert_allclose(n, r, rtol=2e-5, atol=2e-5, equal_nan=True)


def test_a_padding_bias_that_does_not_absorb_the_scores():
    """``select(keep, 0, -1e9)``: ``s - 1e9`` keeps the score's rounding, so a fully masked
    row depends on the scores. Alone it is a bias (the kernel adds it as written); beside
    ``is_causal`` with an absorbing fill the mask is folded into it; beside a -1e9 fill
    the span is left alone."""

    def alone(q, k, v, am):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) + jnp.where(am[:, None, None, :] > 0, 0.0, -1e9)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)

    def causal(fill):
        def fn(q, k, v, am):
            s = jnp.einsum("btnh,bsnh->bnts", q, k) + jnp.where(am[:, None, None, :] > 0, 0.0, -1e9)
            s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, fill)
            return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)

        return fn

    args = [*_qkv(), LEFT_PADDED]
    m = _check_rows(alone, args)
    assert isinstance(m, Match) and m.mask.kind == MaskKind.BIAS and not m.mask.folded
    m = _check_rows(causal(MIN), args)
    assert isinstance(m, Match) and m.mask.folded
    left = _check_rows(causal(-1e9), args)
    assert isinstance(left, LeftAlone) and "does not absorb the scores" in left.reason, left


# --- the masks real models pass -------------------------------------------------------------


def test_flax_combine_masks_is_causal_plus_a_padding_mask():
    """``combine_masks(make_attention_mask(pad, pad), make_causal_mask(...))`` reaches the
    ``where`` as ``ne(convert(and(...)), 0)``: the causal triangle is seen through it."""

    def fn(q, k, v, am):
        mask = nn.combine_masks(nn.make_attention_mask(am > 0, am > 0), nn.make_causal_mask(jnp.ones((B, T))))
        return nn.dot_product_attention(q, k, v, mask=mask)

    m = _check_rows(fn, [*_qkv(), LEFT_PADDED])
    assert isinstance(m, Match) and m.mask.kind == MaskKind.CAUSAL | MaskKind.MASK, m
    assert "causal + mask" in m.describe()


def test_hugging_face_causal_and_padding_bias_is_causal_plus_a_padding_mask():
    """Every HF Flax decoder: ``select(combine_masks(padding, causal) > 0, 0, finfo.min)``
    as one float32 ``[B, 1, T, S]`` bias: ``is_causal`` and a boolean key-padding mask, no
    bias read (nor its gradient written)."""

    def fn(q, k, v, am):
        causal = nn.make_causal_mask(jnp.ones((B, T), bool), dtype="bool")
        combined = nn.combine_masks(jnp.broadcast_to(am[:, None, None, :], causal.shape), causal)
        bias = jax.lax.select(combined > 0, jnp.full(combined.shape, 0.0), jnp.full(combined.shape, MIN))
        return nn.dot_product_attention(q, k, v, bias=bias)

    m = _check_rows(fn, [*_qkv(), LEFT_PADDED])
    assert isinstance(m, Match) and m.mask.kind == MaskKind.CAUSAL | MaskKind.MASK, m
    assert not m.program.biases and m.program.const_bias is None


def test_near_misses_of_the_real_models_masks():
    """A triangle that is not causal stays a mask; a bias that is not a mask (a float
    input times -1e9: its values are not provably two) stays a bias; a padding fill
    different from the causal one with rows that may be empty is left alone."""

    def upper(q, k, v, am):
        mask = nn.combine_masks(nn.make_attention_mask(am > 0, am > 0), jnp.triu(jnp.ones((1, 1, T, T))))
        return nn.dot_product_attention(q, k, v, mask=mask)

    m = _check_rows(upper, [*_qkv(), LEFT_PADDED])
    assert isinstance(m, Match) and MaskKind.CAUSAL not in m.mask.kind and MaskKind.MASK in m.mask.kind

    def float_keep(q, k, v, keep):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) + (1.0 - keep[:, None, None, :]) * MIN
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, MIN)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)

    m = _check_rows(float_keep, [*_qkv(), LEFT_PADDED.astype(np.float32)])
    assert isinstance(m, Match) and m.mask.kind == MaskKind.BIAS and m.mask.folded

    def two_fills(q, k, v, am):
        s = jnp.einsum("btnh,bsnh->bnts", q, k)
        s = jnp.where(am[:, None, None, :] > 0, s, -1e9)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, MIN)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)

    left = _check_rows(two_fills, [*_qkv(), LEFT_PADDED])
    assert isinstance(left, LeftAlone) and "different values where masked (-3.40282e+38, -1e+09)" in left.reason


# --- the property: drawn combinations, every row ---------------------------------------------

FILLS = [MIN, -1e9, -float("inf"), JAXNN]


def _drawn(causal: str, pad_side: str, pad_as: str, fills: tuple[float, float], learned: str, scale_after: bool):
    """An attention with a causal part (`causal`), a padding part (`pad_side`, expressed as
    `pad_as`), their fills, and a learned bias (`learned`)."""

    def fn(q, k, v, lengths, lbias):
        t = q.shape[1]
        pos = jnp.arange(t)
        if pad_side == "left":
            keep_k = pos[None, :] >= (t - lengths)[:, None]
        else:
            keep_k = pos[None, :] < lengths[:, None]
        s = jnp.einsum("btnh,bsnh->bnts", q, k)
        s = s if scale_after else s * 0.25
        if learned != "none":
            s = s + lbias
        if pad_as == "bias":
            s = s + jax.lax.select(
                jnp.broadcast_to(keep_k[:, None, None, :], s.shape), jnp.zeros(s.shape), jnp.full(s.shape, fills[0])
            )
        elif pad_as == "where":
            s = jnp.where(keep_k[:, None, None, :], s, fills[0])
        if causal != "none":
            tri = jnp.tril(jnp.ones((t, t), bool)) if causal == "tril" else jnp.triu(jnp.ones((t, t), bool))
            s = jnp.where(tri, s, fills[1])
        s = s * 0.25 if scale_after else s
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)

    return fn


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    causal=st.sampled_from(["none", "tril", "triu"]),
    pad_side=st.sampled_from(["left", "right"]),
    pad_as=st.sampled_from(["none", "bias", "where"]),
    fills=st.tuples(st.sampled_from(FILLS), st.sampled_from(FILLS)),
    learned=st.sampled_from(["none", "small", "masking"]),
    scale_after=st.booleans(),
    lengths=st.tuples(st.integers(0, 5), st.integers(0, 5)),
    multiple=st.sampled_from([1, 2, 4]),
)
def test_drawn_masks_give_every_row_as_written(
    causal, pad_side, pad_as, fills, learned, scale_after, lengths, multiple
):
    """Any combination either is left alone or gives the original's value on every row,
    NaN where and only where it has NaN (padded plans included: 5 tokens padded to 6 or 8)."""
    t = 5
    rng = np.random.default_rng(sum(lengths) + 7 * multiple)
    lbias = rng.standard_normal((B, 1, t, t)).astype(np.float32)
    if learned == "masking":  # a learned bias that masks a whole row on its own
        lbias[0, 0, 1] = MIN
    fn = _drawn(causal, pad_side, pad_as, fills, learned, scale_after)
    _check_rows(fn, [*_qkv(t), np.asarray(lengths, np.int32), lbias], multiple)
