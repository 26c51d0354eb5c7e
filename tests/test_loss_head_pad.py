"""The chunked head's vocabulary padded for its matmuls (`autocast._loss_head._pad`).

A vocabulary that is not a multiple of 128 (GPT-2's 50,257; here 200) is padded once with
zero rows of the weight, each chunk's logits sliced back before the loss reads them: the same
computation. Checked as the idioms are (tests/loss_head_cases.py: values and gradients
against the head as written and against float32), on the idioms whose head is written in each
of the ways the padding meets it (`x @ W.T` through a transpose, Equinox's `weight @ x`
vmapped per token, a tied embedding whose table is also read by the lookup), in both
differentiated forms (bfloat16 with the forward pass, float16 with scan + checkpoint), and on
the program: the padded weight is made once, outside the loop. Runs on both JAX ends.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import walk
from loss_head_cases import (
    FLIP_TOL,
    IDIOMS,
    assert_near,
    assert_same,
    body,
    check,
    equinox_head,
    equinox_loss,
    heads,
    inputs,
    strict,
)

import autocast
from autocast import _compat
from autocast._loss_head import _pad

V = 1000
"""A vocabulary not a multiple of 128: padded to 1,024 for the chunks' matmuls (2.4 % more)."""
ARGS = inputs(v=V)
HPW = (0, 1, 2)
PADDED = "the matmuls' vocabulary padded 1,000 -> 1,024"


@pytest.mark.parametrize(
    "name", ["optax_integer_labels_btv", "flax_lm1b_weighted_smoothed", "z_loss", "gemma2_soft_cap"]
)
def test_padded_head_equals_the_head_as_written(name):
    assert [PADDED in h["how"] for h in heads(IDIOMS[name], ARGS)] == [True]
    check(IDIOMS[name], ARGS, HPW)


def test_equinox_linear_head_padded():
    """`weight @ x` vmapped per token: the weight's vocabulary is the matmul's left free axis;
    the bias (added after the slice) keeps its shape."""
    h, p, _, y = ARGS
    args = (equinox_head(v=V), h, p, y)
    assert [PADDED in x["how"] for x in heads(equinox_loss, args)] == [True]
    check(equinox_loss, args, (0, 1, 2))


def _tied(emb, p, tokens, y):
    logits = body(emb[tokens], p) @ emb.T
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_tied_embedding_padded_only_for_the_head():
    """The table is read by the lookup outside the span and by the head inside it: the head's
    copy is padded, the lookup reads the table as it is, the gradient sums both."""
    _, p, w, y = ARGS
    args = (w, p, jnp.roll(y, 1, axis=1), y)
    assert [PADDED in h["how"] for h in heads(_tied, args)] == [True]
    check(_tied, args, (0, 1))


def test_float16_scan_and_checkpoint_padded():
    """float16: the scan + checkpoint form on the padded weight, under the dynamic scaler."""
    fn = IDIOMS["optax_integer_labels_btv"]
    hows = [h["how"] for h in heads(fn, ARGS, dtype=jnp.float16)]
    assert len(hows) == 1 and "checkpoint" in hows[0] and PADDED in hows[0], hows

    def scaled(head):
        amped = autocast.amp(fn, compute_dtype=jnp.float16, loss_head=head)
        return autocast.dynamic_scale_value_and_grad(amped, argnums=HPW, filter=False)

    state = autocast.DynamicScalerState()
    new, chunked = strict(scaled(4), *ARGS, dynamic_scaler_state=state)
    _, written = strict(scaled("xla"), *ARGS, dynamic_scaler_state=state)
    assert bool(new.grads_finite)
    assert_same(chunked[0], written[0])
    assert_near(chunked[1], written[1], FLIP_TOL)


def test_padded_weight_made_once_outside_the_loop():
    """The gradient's program pads the weight once, before the loop; in the loop each chunk's
    matmul reads the padded weight and the weight's float32 cotangent is carried padded."""
    fn = IDIOMS["optax_integer_labels_btv"]
    jaxpr = jax.make_jaxpr(jax.grad(autocast.amp(fn, compute_dtype=jnp.bfloat16, loss_head=4), argnums=2))(*ARGS)
    top = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pad"]
    # (the weight's cotangent leaves the loop through the pad's transpose, a pad to (1000, 16))
    assert [tuple(e.outvars[0].aval.shape) for e in top if e.outvars[0].aval.shape[0] > V] == [(1024, 16)], top
    scans = [e for e, _ in walk(jaxpr) if e.primitive.name == "scan"]
    assert scans
    inner_pads = [e for s in scans for e, _ in walk(s.params["jaxpr"]) if e.primitive.name == "pad"]
    # (in the loop: only the logits' cotangent, the transpose of their slice)
    assert not [e for e in inner_pads if e.outvars[0].aval.shape in ((1024, 16), (16, 1024))], inner_pads
    consts, carry = _compat.scan_counts(scans[0].params)
    carried = [v.aval for v in scans[0].invars[consts : consts + carry] if v.aval.shape == (1024, 16)]
    assert carried and all(a.dtype == jnp.float32 for a in carried), carried


@pytest.mark.parametrize("v", [128, 200], ids=["aligned", "too_much_padding"])
def test_vocabulary_not_padded(v):
    """Already a multiple of 128, or padding would add more than `_pad.GROWTH` (200 -> 256)."""
    hows = [x["how"] for x in heads(IDIOMS["optax_integer_labels_btv"], inputs(v=v))]
    assert len(hows) == 1 and "padded" not in hows[0], hows


def test_pad_find_units():
    """`_pad.find` on the plans the finder makes: the vocabulary axis of the weight and of
    the logits for `x @ W.T`, `x @ W` ([D, V]) and Equinox's `weight @ x`."""
    from autocast._loss_head import _find

    h, p, w, y = ARGS

    def plan_of(fn, *args):
        jaxpr = jax.make_jaxpr(fn)(*args)
        found = [f for f in _find.find(jaxpr.jaxpr, jaxpr.consts) if not isinstance(f, _find.Refused)]
        assert len(found) == 1, found
        return found[0][1]

    def xwt(h, w, y):
        return optax.softmax_cross_entropy_with_integer_labels(h @ w.T, y).mean()

    def xw(h, wt, y):
        return optax.softmax_cross_entropy_with_integer_labels(h @ wt, y).mean()

    pad = plan_of(xwt, h, w, y).pad
    assert (pad.axis, pad.size, pad.padded, pad.out_axis) == (0, 1000, 1024, 2)
    pad = plan_of(xw, h, w.T, y).pad
    assert (pad.axis, pad.size, pad.padded, pad.out_axis) == (1, 1000, 1024, 2)
    head = equinox_head(v=V)
    pad = plan_of(lambda hd, h, y: equinox_loss(hd, h, jnp.eye(16), y), head, h, y).pad
    assert (pad.size, pad.padded) == (1000, 1024)
    h2, _, w2, y2 = inputs(v=1024)
    assert plan_of(xwt, h2, w2, y2).pad is None


def test_padding_helpers_round_trip():
    w = jnp.arange(6.0).reshape(3, 2)
    pad = _pad.Pad(input=0, axis=0, size=3, padded=8, out_axis=1)
    wp = _pad.weight(w, pad)
    assert wp.shape == (8, 2) and np.all(np.asarray(wp[3:]) == 0) and np.all(np.asarray(wp[:3]) == np.asarray(w))
    x = jnp.ones((4, 2))
    assert _pad.logits(x @ wp.T, pad).shape == (4, 3)
    np.testing.assert_array_equal(np.asarray(_pad.logits(x @ wp.T, pad)), np.asarray(x @ w.T))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["forward", "checkpoint"])
def test_unrolled_loop_for_measurement_is_the_same_computation(dtype, monkeypatch):
    """`_forward.UNROLL` (the TPU benchmark's `--unroll-loss-head`, so XLA's cost analysis
    counts every chunk) unrolls the loops and leaves the values and gradients, in both forms."""
    from autocast._loss_head import _forward

    fn = IDIOMS["optax_integer_labels_btv"]
    step = lambda: jax.jit(jax.value_and_grad(autocast.amp(fn, compute_dtype=dtype, loss_head=4), argnums=HPW))  # noqa: E731
    looped = step()(*ARGS)
    monkeypatch.setattr(_forward, "UNROLL", True)
    unrolled_fn = step()
    scans = [e for e, _ in walk(jax.make_jaxpr(unrolled_fn)(*ARGS)) if e.primitive.name == "scan"]
    assert scans and all(e.params["unroll"] == e.params["length"] for e in scans), scans  # (lowered unrolled)
    assert_near(unrolled_fn(*ARGS), looped, FLIP_TOL)


def test_not_padded_where_a_tpu_compiles(monkeypatch):
    """Where a TPU compiles the program the vocabulary is not padded (XLA:TPU tiles it
    itself; the slice and pad around each chunk keep its cotangent out of the matmuls), and the
    head is the same computation."""
    fn = IDIOMS["optax_integer_labels_btv"]
    monkeypatch.setattr(_compat, "tpu_compiler", lambda: True)
    hows = [h["how"] for h in heads(fn, ARGS)]
    assert len(hows) == 1 and hows[0].startswith("chunked") and "padded" not in hows[0], hows
    jaxpr = jax.make_jaxpr(jax.grad(autocast.amp(fn, compute_dtype=jnp.bfloat16, loss_head=4), argnums=2))(*ARGS)
    assert not [e for e, _ in walk(jaxpr) if e.primitive.name == "pad"]
    check(fn, ARGS, HPW)
