"""The loss-head finder (autocast/_loss_head, issue 49): its primitive vocabulary against the
installed JAX, the per-primitive token-axis relations of `_axes` on equations JAX itself
traced, and the near misses: heads the finder must leave as written, each with a true reason
in `explain` and a program identical to `loss_head="xla"`'s (values and gradients, bit for
bit), beside the idioms close to them that it chunks.

Relations are read from real equations (`jax.make_jaxpr`), so the parameters each test hands
`_axes.relate` are the ones this JAX writes (both ends of the supported range run the suite).
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autocast
from autocast._loss_head import _axes, _vocab
from tests.helpers import tree_max_rel_err, walk

ROOT = pathlib.Path(__file__).resolve().parents[1] / "autocast" / "_loss_head"


# --- the vocabulary -------------------------------------------------------------------------


def _jax_primitive_names() -> set[str]:
    jnp.zeros(1)  # (imports the modules that define the primitives)
    jax.nn.softmax(jnp.zeros(2))
    names = set()
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("jax"):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, jax.extend.core.Primitive):
                names.add(value.name)
    return names


PRIMITIVES = _jax_primitive_names()

_ONE_END = {"ragged_dot_general"}
"""Names of the finder's families that only some supported JAX versions define (the newer
matmul; the attention vocabulary's test allows it for the same reason)."""


def test_the_collection_sees_jax_primitives():
    assert {"dot_general", "exp", "gather", "reduce_max", "cumsum", "copy"} <= PRIMITIVES
    assert "copy_p" not in PRIMITIVES and "expand_dims" not in PRIMITIVES


@pytest.mark.parametrize("family", ["ELEMENTWISE", "REDUCTIONS", "MATMULS"])
def test_every_family_name_is_a_jax_primitive(family):
    """A misspelt or retired name (JAX named `copy` `copy_p` until 2022; the oldest JAX this
    project supports is 0.9.2) matches nothing and silently drops the primitive."""
    unknown = sorted(n for n in getattr(_vocab, family) if n not in PRIMITIVES and n not in _ONE_END)
    assert not unknown, f"_loss_head._vocab.{family} names no JAX {jax.__version__} primitive: {unknown}"


def test_the_head_and_every_relation_name_jax_primitives():
    assert _vocab.HEAD in PRIMITIVES
    unknown = sorted(n for n in _axes._RULES if n not in PRIMITIVES)
    assert not unknown, f"_axes._RULES names no JAX {jax.__version__} primitive: {unknown}"
    assert not set(_axes._RULES) & _vocab.ELEMENTWISE, "a primitive is both elementwise and ruled"


def _compared_names(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants compared with a primitive's name: `x.name == "exp"` or, as `_axes`
    writes it, the bare parameter `name in ("iota", ...)`."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(
            (isinstance(s, ast.Attribute) and s.attr == "name") or (isinstance(s, ast.Name) and s.id == "name")
            for s in sides
        )
        if named:
            out += [
                (c.lineno, c.value)
                for s in sides
                for c in ast.walk(s)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            ]
    return out


@pytest.mark.parametrize("path", sorted(ROOT.glob("*.py")), ids=lambda p: p.name)
def test_names_compared_in_the_modules_are_jax_primitives(path):
    unknown = [(line, n) for line, n in _compared_names(ast.parse(path.read_text())) if n not in PRIMITIVES]
    assert not unknown, f"{path.name} compares primitive names JAX {jax.__version__} lacks: {unknown}"


# --- _axes.relate on equations JAX traced -------------------------------------------------


def _eqn(fn, *args, prim: str, nth: int = 0):
    """(name, params, operand avals, result avals) of the `nth` `prim` equation, any depth."""
    eqns = [e for e, _ in walk(jax.make_jaxpr(fn)(*args)) if e.primitive.name == prim]
    e = eqns[nth]
    return e.primitive.name, e.params, [v.aval for v in e.invars], [v.aval for v in e.outvars]


def _relate(eqn, **known):
    """`_axes.relate` with `in0=1, out0=0`-style keywords for the known axes."""
    return _axes.relate(*eqn, {(k[:-1], int(k[-1])): v for k, v in known.items()})


IN0, IN1, OUT0 = ("in", 0), ("in", 1), ("out", 0)


def test_reshape_merging_the_tokens_keeps_the_leading_axis_of_the_group():
    """[B,T,V] -> [B*T,V]: chunks of B are chunks of B*T; chunks of T (B > 1) are not
    contiguous in B*T, and the vocabulary axis moves to its new place."""
    merge = _eqn(lambda a: a.reshape(6, 5), jnp.zeros((2, 3, 5)), prim="reshape")
    assert _relate(merge, in0=0) == {IN0: 0, OUT0: 0}
    assert _relate(merge, out0=0) == {IN0: 0, OUT0: 0}
    assert _relate(merge, in0=2) == {IN0: 2, OUT0: 1}
    with pytest.raises(_axes.NotLocal, match="does not survive"):
        _relate(merge, in0=1)
    single = _eqn(lambda a: a.reshape(3, 5), jnp.zeros((1, 3, 5)), prim="reshape")  # B = 1: T leads
    assert _relate(single, in0=1) == {IN0: 1, OUT0: 0}


def test_reshape_splitting_the_tokens_chunks_only_the_leading_axis():
    """[B*T,V] -> [B,T,V]: the result chunked along B is the operand chunked along B*T; the
    result chunked along T (B > 1) comes from no chunk of the operand, so the reshape is not
    row-local there (taking the operand whole would reshape B*T rows into B*T/k of them)."""
    split = _eqn(lambda a: a.reshape(2, 3, 5), jnp.zeros((6, 5)), prim="reshape")
    assert _relate(split, in0=0) == {IN0: 0, OUT0: 0}
    assert _relate(split, out0=0) == {IN0: 0, OUT0: 0}
    with pytest.raises(_axes.NotLocal):
        _relate(split, out0=1)


def test_broadcast_in_dim_keeps_the_token_axis_or_makes_a_whole_operand():
    column = _eqn(lambda a: a[:, None], jnp.zeros(6), prim="broadcast_in_dim")
    assert _relate(column, in0=0) == {IN0: 0, OUT0: 0}
    assert _relate(column, out0=0) == {IN0: 0, OUT0: 0}
    # a class-weight vector broadcast over the tokens: the same for every chunk
    rows = _eqn(lambda w: jnp.broadcast_to(w, (6, 5)), jnp.zeros(5), prim="broadcast_in_dim")
    assert _relate(rows, out0=0) == {IN0: None, OUT0: 0}
    ones = _eqn(lambda w: jnp.broadcast_to(w, (6, 5)), jnp.zeros((1, 5)), prim="broadcast_in_dim")
    assert _relate(ones, out0=0) == {IN0: None, OUT0: 0}
    widen = _eqn(lambda a: jnp.broadcast_to(a, (6, 5)), jnp.zeros((6, 1)), prim="broadcast_in_dim")
    assert _relate(widen, in0=0) == {IN0: 0, OUT0: 0}


def _take_along_axis(logits, labels):
    return jnp.take_along_axis(logits, labels[:, None], axis=-1)


def test_gather_of_take_along_axis_is_per_row():
    """`take_along_axis` gathers with the tokens as batching dimensions of the operand and
    the indices: chunk i of the logits and of the labels give chunk i of the result."""
    eqn = _eqn(_take_along_axis, jnp.zeros((8, 5)), jnp.zeros(8, jnp.int32), prim="gather")
    expect = {IN0: 0, IN1: 0, OUT0: 0}
    assert _relate(eqn, in0=0) == expect
    assert _relate(eqn, in1=0) == expect
    assert _relate(eqn, out0=0) == expect
    assert _axes.at_chunk("gather", eqn[1], expect, 4)["slice_sizes"] == eqn[1]["slice_sizes"]


def test_gather_of_optax_take_slices_the_tokens_at_chunk_size():
    """optax's integer-label loss reads the label logit back with `_take` (`x[:, 0]` as a
    gather whose offset dimension is the tokens, sliced whole): per row, with the slice size
    divided by the chunk count."""

    def loss(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)

    eqn = _eqn(loss, jnp.zeros((8, 5)), jnp.zeros(8, jnp.int32), prim="gather", nth=1)
    assert eqn[1]["dimension_numbers"].offset_dims, "optax's `_take` is an offset-form gather"
    rel = _relate(eqn, in0=0)
    assert rel == {IN0: 0, IN1: None, OUT0: 0}
    assert _axes.at_chunk("gather", eqn[1], rel, 4)["slice_sizes"] == (2, 1)


def test_gather_picking_rows_is_not_row_local():
    eqn = _eqn(lambda a, i: a[i], jnp.zeros((8, 5)), jnp.zeros(3, jnp.int32), prim="gather")
    with pytest.raises(_axes.NotLocal, match="along the tokens"):
        _relate(eqn, in0=0)


@pytest.mark.parametrize(
    ("reduce", "prim", "kind"),
    [(jnp.sum, "reduce_sum", _axes.SUM), (jnp.max, "reduce_max", _axes.MAX), (jnp.min, "reduce_min", _axes.MAX)],
)
def test_a_reduction_over_the_tokens_ends_the_chain(reduce, prim, kind):
    everything = _eqn(reduce, jnp.zeros((8, 5)), prim=prim)
    assert _relate(everything, in0=0) == {IN0: 0, OUT0: kind}
    per_row = _eqn(lambda a: reduce(a, axis=1), jnp.zeros((8, 5)), prim=prim)
    assert _relate(per_row, in0=0) == {IN0: 0, OUT0: 0}


def test_an_argmax_over_the_tokens_is_not_row_local():
    assert _relate(_eqn(lambda a: jnp.argmax(a, 1), jnp.zeros((8, 5)), prim="argmax"), in0=0) == {IN0: 0, OUT0: 0}
    with pytest.raises(_axes.NotLocal, match="reduces over the tokens"):
        _relate(_eqn(lambda a: jnp.argmax(a, 0), jnp.zeros((8, 5)), prim="argmax"), in0=0)


def test_iota_along_the_token_axis_is_refused():
    down = _eqn(lambda: jax.lax.broadcasted_iota(jnp.int32, (8, 5), 0), prim="iota")
    with pytest.raises(_axes.NotLocal, match="counts along the tokens"):
        _relate(down, out0=0)
    across = _eqn(lambda: jax.lax.broadcasted_iota(jnp.int32, (8, 5), 1), prim="iota")  # a one-hot's
    assert _relate(across, out0=0) == {OUT0: 0}
    assert _axes.at_chunk("iota", across[1], {OUT0: 0}, 4)["shape"] == (2, 5)


def test_slice_along_the_tokens_is_refused():
    shift = _eqn(lambda a: jax.lax.slice(a, (1, 0), (8, 5)), jnp.zeros((8, 5)), prim="slice")
    with pytest.raises(_axes.NotLocal, match="does not survive"):
        _relate(shift, in0=0)
    vocab = _eqn(lambda a: jax.lax.slice(a, (0, 1), (8, 5)), jnp.zeros((8, 5)), prim="slice")
    assert _relate(vocab, in0=0) == {IN0: 0, OUT0: 0}


def test_cumsum_along_the_tokens_is_refused_and_across_the_vocabulary_kept():
    with pytest.raises(_axes.NotLocal, match="acts along the tokens"):
        _relate(_eqn(lambda a: jnp.cumsum(a, 0), jnp.zeros((8, 5)), prim="cumsum"), in0=0)
    assert _relate(_eqn(lambda a: jnp.cumsum(a, 1), jnp.zeros((8, 5)), prim="cumsum"), in0=0)[OUT0] == 0


def test_elementwise_operands_on_two_token_axes_are_refused():
    eqn = _eqn(lambda a, b: a + b, jnp.zeros((5, 5)), jnp.zeros((5, 5)), prim="add")
    assert _relate(eqn, in0=0) == {IN0: 0, IN1: 0, OUT0: 0}
    with pytest.raises(_axes.NotLocal, match="different axes"):
        _relate(eqn, in0=0, in1=1)


# --- near misses, end to end ----------------------------------------------------------------

N, D, V = 16, 4, 64
"""16 tokens, width 4, vocabulary 64: a head (the vocabulary 16 times the width, over
`_find.AMPLIFY`) whose chunk count 4 divides N."""


def _data():
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (N, D))
    w = jax.random.normal(k[1], (V, D)) * 0.3
    y = jax.random.randint(k[2], (N,), 0, V)
    return x, w, y


def _ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


_M = np.random.default_rng(1).standard_normal((V, 4)).astype(np.float32)


@jax.custom_jvp
def _softcap(z):
    return jnp.tanh(z / 5) * 5


_softcap.defjvp(lambda p, t: (_softcap(p[0]), t[0] * (1 - jnp.tanh(p[0] / 5) ** 2)))


def _logits_returned(x, w, y):
    logits = x @ w.T
    return _ce(logits, y).mean(), logits


def _log_softmax_over_the_batch(x, w, y):
    return -jnp.mean(_take_along_axis(jax.nn.log_softmax(x @ w.T, axis=0), y))


def _logsumexp_over_the_batch(x, w, y):
    logits = x @ w.T
    return -jnp.mean(_take_along_axis(logits - jax.nn.logsumexp(logits, axis=0, keepdims=True), y))


def _normalised_by_the_largest(x, w, y):
    ce = _ce(x @ w.T, y)
    return jnp.sum(ce / ce.max())


def _centred_over_rows(x, w, y):
    logits = x @ w.T
    return _ce(logits - logits.mean(axis=0), y).mean()


def _cumsum_over_the_tokens(x, w, y):
    return _ce(jnp.cumsum(x @ w.T, axis=0), y).mean()


def _second_matmul(x, w, y):
    logits = x @ w.T
    return _ce(logits, y).mean() + jnp.sum(logits @ _M)


def _custom_jvp_on_the_logits(x, w, y):
    return _ce(_softcap(x @ w.T), y).mean()


NEAR_MISSES = {
    _logits_returned: "the logits (or a value as large) are read after the loss",
    _log_softmax_over_the_batch: "mixes rows",
    _logsumexp_over_the_batch: "mixes rows",
    _normalised_by_the_largest: "mixes rows",
    _centred_over_rows: "mixes rows",
    _cumsum_over_the_tokens: "it acts along the tokens",
    _second_matmul: "a second `dot_general` reads the logits",
    _custom_jvp_on_the_logits: "a call amp does not look into",
}
"""Each near miss and the words its reason must hold."""


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _run(fn, loss_head, args):
    amped = autocast.amp(fn, compute_dtype=jnp.bfloat16, loss_head=loss_head)
    grads = jax.grad(lambda x, w: _first(amped(x, w, args[2])), argnums=(0, 1))(*args[:2])
    return amped(*args), grads


def _hows(fn, args, **options):
    report = autocast.explain(fn, compute_dtype=jnp.bfloat16, **options)(*args)
    # how the chunks are differentiated (`_forward` or `scan` + `checkpoint`) and whether the
    # vocabulary is padded (tests/test_loss_head_pad.py) are not what these tests check
    return [
        re.sub(r", the matmuls' vocabulary padded .*$", "", h["how"]).replace(
            ", gradients with the forward pass)", " + checkpoint)"
        )
        for h in report.totals["loss_head"]
    ]


def _assert_identical(a, b):
    for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(q))


@pytest.mark.parametrize("fn", list(NEAR_MISSES), ids=lambda f: f.__name__.strip("_"))
def test_a_near_miss_is_left_as_written_with_its_reason(fn):
    reason = NEAR_MISSES[fn]
    args = _data()
    hows = _hows(fn, args, loss_head=4)
    assert hows and all(h.startswith("as written: ") for h in hows), hows
    assert any(reason in h for h in hows), hows
    _assert_identical(_run(fn, 4, args), _run(fn, "xla", args))


def test_one_chunk_is_as_written():
    args = _data()
    fn = lambda x, w, y: _ce(x @ w.T, y).mean()  # noqa: E731
    assert _hows(fn, args, loss_head=1) == ["as written: loss_head=1"]
    _assert_identical(_run(fn, 1, args), _run(fn, "xla", args))


def test_too_small_to_pay_under_auto(monkeypatch):
    monkeypatch.setattr(jax, "device_count", lambda: 1)  # one device's budget
    args = _data()
    fn = lambda x, w, y: _ce(x @ w.T, y).mean()  # noqa: E731
    (how,) = _hows(fn, args)
    assert how.startswith("as written: too small to pay") and f"{N * V * 4 >> 20} MiB" in how, how
    _assert_identical(_run(fn, "auto", args), _run(fn, "xla", args))


def _assert_close(a, b):
    """Equal within bfloat16's rounding of the logits: both jaxprs round the matmul's result
    to bfloat16 before the float32 softmax, but XLA on CPU drops that rounding when it
    compiles the unchunked program and keeps it in the scan's body (measured: each program's
    per-token losses within 4e-7 of a float64 reference with and without the rounding
    respectively; 3.6e-3 apart, 6e-5 on their mean). Each float leaf is within 2**-8 of the
    unchunked one in norm; integers (predictions) are equal."""
    for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        p, q = np.asarray(p), np.asarray(q)
        if np.issubdtype(q.dtype, np.integer):
            np.testing.assert_array_equal(p, q)
        else:
            assert tree_max_rel_err(p, q) <= 2**-8, (p, q)


def _argmax_after(x, w, y):
    logits = x @ w.T
    loss = _ce(logits, y).mean()
    return loss, jnp.argmax(logits, axis=-1)


def _argmax_before(x, w, y):
    logits = x @ w.T
    predicted = jnp.argmax(logits, axis=-1)
    return _ce(logits, y).mean(), predicted


def _accuracy(x, w, y):
    logits = x @ w.T
    loss = _ce(logits, y).mean()
    return loss, jnp.mean(jnp.argmax(logits, axis=-1) == y)


def _softmax_then_log(x, w, y):  # jax.nn.softmax: a custom_jvp of its own under JAX_SOFTMAX_CUSTOM_JVP
    return -jnp.mean(jnp.log(_take_along_axis(jax.nn.softmax(x @ w.T, axis=-1), y)))


@pytest.mark.parametrize("fn", [_argmax_after, _argmax_before, _accuracy, _softmax_then_log], ids=lambda f: f.__name__)
def test_per_token_readers_and_softmax_are_chunked(fn):
    """Not near misses: a per-token prediction or an accuracy returned beside the loss is
    small (one value per token) and is computed per chunk, whichever of the two the code
    writes first; softmax's own derivative rule is row-local."""
    args = _data()
    assert _hows(fn, args, loss_head=4) == ["chunked: 4 token chunks (lax.scan + checkpoint), float32 accumulation"]
    _assert_close(_run(fn, 4, args), _run(fn, "xla", args))


def test_labels_laid_out_otherwise_than_the_logits():
    """Time-major logits [T, B, V] and batch-major flat labels [B*T] (reshaped, transposed):
    chunked along T, the labels' reshape cannot be computed per chunk from the whole labels;
    amp must slice its result (or leave the head as written), not fail to compile."""
    t, b = 4, 2
    k = jax.random.split(jax.random.key(1), 3)
    args = (
        jax.random.normal(k[0], (t, b, D)),
        jax.random.normal(k[1], (V, D)),
        jax.random.randint(k[2], (b * t,), 0, V),
    )
    assert _hows(lambda x, w, y: _ce(x @ w.T, y.reshape(b, t).T).mean(), args, loss_head=2)

    def time_major(x, w, y):
        return _ce(x @ w.T, y.reshape(b, t).T).mean()

    _assert_close(_run(time_major, 2, args), _run(time_major, "xla", args))


_U = np.random.default_rng(2).standard_normal((D, 4)).astype(np.float32)


def _value_head_after(x, w, y):
    loss = _ce(x @ w.T, y).mean()
    return loss + jnp.sum(jnp.tanh(x @ _U))  # a second, small head on the same hidden states


def _value_head_before(x, w, y):
    value = jnp.sum(jnp.tanh(x @ _U))
    return _ce(x @ w.T, y).mean() + value


def _penalty_after(x, w, y):
    loss = _ce(x @ w.T, y).mean()
    return loss + 1e-3 * jnp.sum(x**2)  # an activation penalty on the hidden states


def _penalty_before(x, w, y):
    penalty = 1e-3 * jnp.sum(x**2)
    return _ce(x @ w.T, y).mean() + penalty


_X2 = np.random.default_rng(3).standard_normal((N, D)).astype(np.float32)


def _two_heads_one_labels(x, w, y):
    first = _ce(x @ w.T, y).mean()
    return first + _ce(_X2 @ w.T, y).mean()  # a second head, on other hidden states, with the same labels


@pytest.mark.parametrize(
    "fn", [_value_head_after, _value_head_before, _penalty_after, _penalty_before], ids=lambda f: f.__name__
)
def test_other_readers_of_the_hidden_states_do_not_decide(fn):
    """The hidden states are an input of the head, not a value of the loss: another matmul or
    a penalty reading them (before or after the loss, the order of two independent
    statements) neither joins the span nor stops the head being chunked."""
    args = _data()
    assert _hows(fn, args, loss_head=4) == ["chunked: 4 token chunks (lax.scan + checkpoint), float32 accumulation"]
    _assert_close(_run(fn, 4, args), _run(fn, "xla", args))


def test_two_heads_reading_the_same_labels_are_both_chunked():
    """The labels are an input of each head: the second head's reading them does not make it
    part of the first head's loss."""
    args = _data()
    assert (
        _hows(_two_heads_one_labels, args, loss_head=4)
        == ["chunked: 4 token chunks (lax.scan + checkpoint), float32 accumulation"] * 2
    )
    _assert_close(_run(_two_heads_one_labels, 4, args), _run(_two_heads_one_labels, "xla", args))
