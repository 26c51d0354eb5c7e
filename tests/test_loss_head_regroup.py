"""The chunked head's matmul makes its result in the shape the loss reshapes it to
(`autocast._loss_head._regroup`).

`logits.reshape(-1, vocab)` of `[batch, seq, vocab]` logits (nanoGPT, the benchmark models):
each chunk's matmul reads the hidden states with their token axes merged and makes the
flattened logits itself, so the loss's reshape of the `[tokens, vocab]` chunk (a relayout copy
on XLA:TPU, and the reason the cotangent was kept in memory there) is gone. Checked: the
program (the loop's matmul makes `[tokens, vocab]`, no reshape of a vocabulary-sized value in
the loop), the same values and gradients bit for bit as the head with the reshape where the
user wrote it (both differentiated forms, the vocabulary padded or not, and the benchmark's
head `vmap`ped per sequence), and where it does not apply. Runs on both JAX ends.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import walk
from loss_head_cases import BF16_TOL, IDIOMS, assert_same, body, heads, inputs, strict

import autocast
from autocast._loss_head import _find, _regroup

FLAT = IDIOMS["optax_integer_labels_flat"]
HPW = (0, 1, 2)


def _step(fn, dtype, k=4):
    return jax.value_and_grad(autocast.amp(fn, compute_dtype=dtype, loss_head=k), argnums=HPW)


def _loop_eqns(fn, args, dtype=jnp.bfloat16):
    jaxpr = jax.make_jaxpr(_step(fn, dtype))(*args)
    scans = [e for e, _ in walk(jaxpr) if e.primitive.name == "scan"]
    assert scans, "no chunk loop"
    return [e for s in scans for e, _ in walk(s.params["jaxpr"])]


def _vmapped_per_sequence(h, p, w, y):
    """The benchmark's GPT loss: the model `vmap`ped over the sequences, the logits flattened."""
    logits = jax.vmap(lambda x: body(x, p) @ w.T)(h)
    return optax.softmax_cross_entropy_with_integer_labels(logits.reshape(-1, w.shape[0]), y.reshape(-1)).mean()


@pytest.mark.parametrize("v", [128, 1000], ids=["aligned", "padded"])
@pytest.mark.parametrize("fn", [FLAT, _vmapped_per_sequence], ids=["flat", "vmapped"])
def test_the_chunk_matmul_makes_the_flattened_logits(fn, v):
    args = inputs(v=v)
    b, t, d = args[0].shape
    tokens = b * t // 4
    padded = 1024 if v == 1000 else v
    eqns = _loop_eqns(fn, args)
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    logits = [e for e in dots if padded in e.outvars[0].aval.shape and e.outvars[0].aval.dtype == jnp.bfloat16]
    assert logits and all(e.outvars[0].aval.shape == (tokens, padded) for e in logits), logits
    assert all(e.invars[0].aval.shape == (tokens, d) for e in logits), logits
    # the backward matmuls read the flat cotangent: the weight's gradient and the hidden states'
    backward = [e for e in dots if e.outvars[0].aval.shape in ((padded, d), (tokens, d))]
    assert len(backward) == 2 and all(e.invars[0].aval.shape == (tokens, padded) for e in backward), backward
    big = [e for e in eqns if e.primitive.name == "reshape" and v in e.outvars[0].aval.shape]
    assert not big, big


@pytest.mark.parametrize("v", [128, 1000], ids=["aligned", "padded"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["forward", "checkpoint"])
@pytest.mark.parametrize("fn", [FLAT, _vmapped_per_sequence], ids=["flat", "vmapped"])
def test_regrouped_head_is_the_head_with_the_users_reshape(fn, dtype, v, monkeypatch):
    """The same dot products, the hidden states' gradient reshaped back: the loss bit for bit;
    the gradients bit for bit on JAX 0.12, within float32 rounding on 0.9.2, whose XLA sums the
    weight gradient's contraction over the tokens in another order for a 2-D operand than for a
    3-D one (measured: 7e-9 absolute, on 4-5 % of the entries)."""
    args = inputs(v=v)
    regrouped = strict(_step(fn, dtype), *args)
    monkeypatch.setattr(_regroup, "find", lambda *a, **k: None)
    as_written = strict(_step(fn, dtype), *args)
    np.testing.assert_array_equal(np.asarray(regrouped[0]), np.asarray(as_written[0]))
    assert_same(regrouped, as_written)
    if jax.__version_info__ >= (0, 12):
        for a, b in zip(jax.tree_util.tree_leaves(regrouped), jax.tree_util.tree_leaves(as_written)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    monkeypatch.undo()  # (explain says so)
    assert [h["how"].endswith(", the logits made flat by the matmul") for h in heads(fn, args, dtype=dtype)] == [True]


def _plan(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    found = [f for f in _find.find(jaxpr.jaxpr, jaxpr.consts) if not isinstance(f, _find.Refused)]
    assert len(found) == 1, found
    return found[0][1]


def test_find_the_reshape_only_where_it_reads_the_head_alone():
    h, p, w, y = inputs()
    plan = _plan(FLAT, h, p, w, y)
    r = _regroup.find(plan.nodes, plan.head, plan.axes, plan.outputs)
    assert r is not None and plan.nodes[r].name == "reshape"
    assert plan.nodes[r].ins[0] == plan.nodes[plan.head].outs[0]
    # the logits read as [B, T, V]: nothing to regroup
    plan = _plan(IDIOMS["optax_integer_labels_btv"], h, p, w, y)
    assert _regroup.find(plan.nodes, plan.head, plan.axes, plan.outputs) is None

    def scaled_then_flat(h, p, w, y):  # the reshape reads the scaled logits, not the matmul's
        logits = logits_of_scaled(h, p, w)
        return optax.softmax_cross_entropy_with_integer_labels(logits.reshape(-1, w.shape[0]), y.reshape(-1)).mean()

    def logits_of_scaled(h, p, w):
        return (body(h, p) @ w.T) / 0.7

    plan = _plan(scaled_then_flat, h, p, w, y)
    assert _regroup.find(plan.nodes, plan.head, plan.axes, plan.outputs) is None


def test_bind_leaves_a_reshape_that_moves_the_vocabulary():
    """`bind` regroups only the hidden states' leading axes; a reshape that splits or merges
    the vocabulary axis, or a matmul contracting a leading axis, runs as written (None)."""
    h, p, w, y = inputs()
    plan = _plan(FLAT, h, p, w, y)
    node = plan.nodes[plan.head]
    assert node.params["dimension_numbers"] == (((2,), (0,)), ((), ())), node.params  # x @ W.T, W.T made before
    x = jax.random.normal(jax.random.key(1), (2, 8, 16), jnp.bfloat16)
    wt = jax.random.normal(jax.random.key(2), (16, 128), jnp.bfloat16)
    params = dict(node.params)
    assert _regroup.bind(node, [x, wt], params, (16, 128), None).shape == (16, 128)
    assert _regroup.bind(node, [x, wt], params, (16, 64, 2), None) is None  # the vocabulary split
    assert _regroup.bind(node, [x, wt], params, (2048,), None) is None  # merged with the tokens
    assert _regroup.bind(node, [x, wt], params, (4, 4, 128), None).shape == (4, 4, 128)  # regrouped
    if "out_sharding" in params:  # (JAX >= 0.5: explicit sharding names the result's axes)
        assert _regroup.bind(node, [x, wt], {**params, "out_sharding": object()}, (16, 128), None) is None
    transposed = {**params, "dimension_numbers": (((0,), (0,)), ((), ()))}
    assert _regroup.bind(node, [jnp.ones((16, 2, 8), jnp.bfloat16), wt], transposed, (16, 128), None) is None
    written = jax.lax.dot_general(x, wt, **{k: v for k, v in params.items() if k != "out_sharding"})
    got = _regroup.bind(node, [x, wt], params, (16, 128), None)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(written.reshape(16, 128), np.float32))


@pytest.mark.parametrize("fn", [FLAT, _vmapped_per_sequence], ids=["flat", "vmapped"])
def test_regrouped_head_under_jvp_and_grad_of_grad(fn, monkeypatch):
    """Forward mode and a Hessian-vector product (grad of grad) through the chunked head with
    the flat logits, compiled without excess precision: within two bfloat16 roundings of the
    head with the reshape where the user wrote it (measured: the tangent equal, the product
    3.5e-3 apart on JAX 0.12, 2e-7 on 0.9.2) and as near the float32 function's (0.55 % against
    0.60 %): the loop's derivative rules are `jax.vjp`'s, differentiated again."""
    h, p, w, y = inputs()
    kh, kw = jax.random.split(jax.random.key(3))
    tangents = (0.1 * jax.random.normal(kh, h.shape), jnp.zeros_like(p), 0.1 * jax.random.normal(kw, w.shape))

    def derivatives(f):
        loss = lambda h, p, w: f(h, p, w, y)  # noqa: E731
        _, tangent = jax.jvp(loss, (h, p, w), tangents)
        hvp = jax.grad(lambda w: jnp.vdot(jax.grad(loss, argnums=2)(h, p, w), tangents[2]))(w)
        return tangent, hvp

    def amped(h, p, w, y):
        return autocast.amp(fn, compute_dtype=jnp.bfloat16, loss_head=4)(h, p, w, y)

    assert [x["how"].endswith("made flat by the matmul") for x in heads(fn, (h, p, w, y))] == [True]
    regrouped = strict(lambda: derivatives(amped))
    monkeypatch.setattr(_regroup, "find", lambda *a, **k: None)
    as_written = strict(lambda: derivatives(amped))
    reference = derivatives(fn)
    for a, b, r in zip(regrouped, as_written, reference):
        err = lambda x, y: float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))  # noqa: E731
        assert err(a, b) <= BF16_TOL, err(a, b)
        assert err(a, r) <= 1.5 * err(b, r) + 1e-6, (err(a, r), err(b, r))
