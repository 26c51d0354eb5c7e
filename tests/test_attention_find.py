"""The attention recogniser's decisions (autocast._attention.find): per idiom, a match with
the right roles, scale and mask class, or the attention left alone with the right reason;
in both of JAX's softmax forms and at any nesting level."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import LEFT_ALONE, MATCHES, SOFTMAX_FORMS, B, H, N, T, einsum_where, traced, two_layers

from autocast import _attention as attention
from autocast import _compat, _walk
from autocast._attention import LeftAlone, MaskKind, Match, _roles


@pytest.mark.parametrize("form", SOFTMAX_FORMS)
@pytest.mark.parametrize("case", MATCHES, ids=repr)
def test_idiom_is_matched(case, form):
    tr = traced(case, form)
    assert [type(r) for r in tr.found] == [Match], [r.describe() for r in tr.found]
    m = tr.found[0]
    assert m.mask.kind == case.kind, m.describe()
    if case.expect is not None:
        case.expect(m)
    eqns = tr.jaxpr.jaxpr.eqns if hasattr(tr.jaxpr, "jaxpr") else tr.jaxpr.eqns
    names = [_walk.kind(eqns[i]) for i in m.eqns]
    assert names.count("dot_general") == 2 and list(m.eqns) == sorted(set(m.eqns))
    for op in (m.q, m.k, m.v):
        assert m.inputs[op.input].aval.shape == op.shape and len(op.roles) == len(op.shape)
    assert m.describe().startswith("attention (") and "jax.nn.dot_product_attention" in m.describe()


@pytest.mark.parametrize("form", SOFTMAX_FORMS)
@pytest.mark.parametrize("case", LEFT_ALONE, ids=repr)
def test_near_miss_is_left_alone(case, form):
    tr = traced(case, form)
    assert [type(r) for r in tr.found] == [LeftAlone], [r.describe() for r in tr.found]
    assert case.reason in tr.found[0].reason
    assert tr.found[0].describe().endswith(tr.found[0].reason)


def test_span_and_inputs_of_the_hand_written_idiom():
    """The span holds the two products, the mask's ``where``, the softmax and the scale; the
    constant mask's equations stay outside (they are folded); the inputs are q, k, v."""
    tr = traced(MATCHES[0])
    m = tr.matches[0]
    jaxpr = tr.jaxpr.jaxpr if hasattr(tr.jaxpr, "jaxpr") else tr.jaxpr
    assert m.inputs == tuple(jaxpr.invars)
    assert m.outputs == tuple(jaxpr.outvars)
    inside = {_walk.label(jaxpr.eqns[i]) for i in m.eqns}
    assert {"dot_general", "jit(_where)", "div", "exp", "reduce_max"} <= inside
    assert "jit(tril)" not in inside
    assert (m.q.roles, m.k.roles, m.v.roles) == (("B", "T", "N", "H"), ("B", "S", "N", "H"), ("B", "S", "N", "H"))


def test_roles_come_from_the_dimension_numbers():
    """A key transposed so that its heads meet the queries' sequence axis (pytorch#195320):
    the roles are those the products use, not a guessed layout."""
    case = next(c for c in MATCHES if c.name == "wrong_axis_key")
    m = traced(case).matches[0]
    assert m.k.roles == ("B", "N", "S", "H")  # k's axis 1 is paired with q's heads
    assert m.v.roles == ("B", "S", "N", "H")


def _outer(f):
    def outer(q, k, v):
        return jnp.tanh(f(q * 2.0, k, v)) + 1.0

    return outer


def _scanned(q, k, v):
    def body(carry, _):
        return einsum_where(carry, k, v), None

    return jax.lax.scan(body, q, None, length=2)[0]


@jax.custom_vjp
def _custom(q, k, v):
    return einsum_where(q, k, v)


_custom.defvjp(lambda q, k, v: (einsum_where(q, k, v), (q, k, v)), lambda res, g: res)


@jax.custom_jvp
def _custom_jvp(q, k, v):
    return einsum_where(q, k, v)


_custom_jvp.defjvp(lambda primals, tangents: (einsum_where(*primals), jnp.zeros_like(primals[0])))


@pytest.mark.parametrize(
    "wrap",
    [jax.jit(einsum_where), jax.checkpoint(einsum_where), _scanned, _custom, _custom_jvp],
    ids=["jit", "checkpoint", "scan", "custom_vjp", "custom_jvp"],
)
def test_nested_bodies(wrap):
    """The recogniser reads one jaxpr's top-level equations: an attention inside a body is
    found when amp calls it on that body, and not from the outer jaxpr."""
    qkv = [np.ones((B, T, N, H), np.float32)] * 3
    jaxpr = jax.make_jaxpr(_outer(wrap))(*qkv)
    assert attention.find(jaxpr, compute_dtype=jnp.bfloat16) == []
    found = []
    stack = list(jaxpr.jaxpr.eqns)
    while stack:
        eqn = stack.pop()
        for body in _walk.bodies(eqn):
            found += attention.find(body, compute_dtype=jnp.bfloat16)
            stack += _compat.open_and_consts(body)[0].eqns
    assert [type(r) for r in found] == [Match] and found[0].mask.kind == MaskKind.CAUSAL


def test_open_jaxpr_with_and_without_its_constants():
    """Flax linen's causal mask is a captured constant: given its value the mask is causal;
    without it, it is a traced mask (still exact, just slower)."""
    case = next(c for c in MATCHES if c.name == "flax_linen")
    closed = traced(case).jaxpr
    jaxpr, consts = _compat.open_and_consts(closed)
    jaxpr = _compat.constvars_to_invars(jaxpr)  # the constants as leading inputs (JAX 0.12's form)
    with_consts = attention.find(jaxpr, compute_dtype=jnp.float16, consts=consts)
    without = attention.find(jaxpr, compute_dtype=jnp.float16)
    assert with_consts[0].mask.kind == MaskKind.CAUSAL
    assert without[0].mask.kind == MaskKind.MASK and len(without[0].inputs) == len(with_consts[0].inputs) + 1


def test_softmax_that_is_not_attention_is_ignored():
    def classifier(x, w, labels):
        p = jax.nn.softmax(x @ w)
        return -jnp.sum(labels * jnp.log(p))

    args = (np.ones((4, 16), np.float32), np.ones((16, 10), np.float32), np.ones((4, 10), np.float32))
    assert attention.find(jax.make_jaxpr(classifier)(*args), compute_dtype=jnp.bfloat16) == []


def test_bad_arguments_are_named():
    jaxpr = traced(MATCHES[0]).jaxpr
    with pytest.raises(ValueError, match=r"compute_dtype='float32'.*float16.*bfloat16"):
        attention.find(jaxpr, compute_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"max_head_dim=4"):
        attention.find(jaxpr, compute_dtype=jnp.float16, max_head_dim=4)


def test_two_attentions_in_one_jaxpr():
    """Two layers: two disjoint spans, the second reading the first's output."""
    qkv = [np.ones((B, T, N, H), np.float32)] * 3
    jaxpr = jax.make_jaxpr(two_layers)(*qkv)
    first, second = attention.find(jaxpr, compute_dtype=jnp.bfloat16)
    assert isinstance(first, Match) and isinstance(second, Match)
    assert not set(first.eqns) & set(second.eqns) and max(first.eqns) < min(second.eqns)
    assert second.inputs[second.q.input] == first.outputs[0]


def test_a_half_precision_program():
    """A program written in bfloat16 (scores, fill and softmax in bfloat16) is matched."""
    qkv = [np.ones((B, T, N, H), jnp.bfloat16)] * 3
    (m,) = attention.find(jax.make_jaxpr(einsum_where)(*qkv), compute_dtype=jnp.float16)
    assert m.mask.kind == MaskKind.CAUSAL and m.q.dtype == jnp.bfloat16 and m.compute_dtype == jnp.float16


def test_an_unexpected_error_leaves_the_attention_alone(monkeypatch):
    """The recogniser never fails amp's trace: an error inside it is a reason."""

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(_roles, "product", broken)
    (res,) = attention.find(
        jax.make_jaxpr(einsum_where)(*[np.ones((B, T, N, H), np.float32)] * 3), compute_dtype=jnp.bfloat16
    )
    assert isinstance(res, LeftAlone) and res.reason == "not recognised (RuntimeError: boom)"
