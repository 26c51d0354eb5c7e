"""Grouped-query attention written as reshaped scores, and a factor on the probabilities
(issue 47).

GQA as Gemma (``gemma/gm/nn/_modules.py``) and Flax NNX (``flax.nnx.dot_product_attention``
with dropout configured, the path ``nnx.MultiHeadAttention(num_kv_heads=...)`` takes) write
it: the scores ``[B, T, K, G, S]`` reshaped to ``[B, T, K * G, S]`` before the softmax and the
probabilities reshaped back before the value product. Hugging Face's Flax BERT family
multiplies the probabilities by a head mask (``einsum("...hqk,h->...hqk", p, head_mask)``, a
traced array of ones unless given); a factor that does not vary along the keys commutes with
the value product and is folded onto the output.

Each match is checked three ways: the extracted call run in float32 against the original
equations in float32 (values and gradients, tight); the call in the half dtypes against
float32 (3 epsilons, as tests/test_attention_call.py); and amp with the fused call emitted on
CPU against ``attention="xla"`` and float32 (as tests/test_attention_amp.py). Each near miss is
left alone with a reason that says what it is, in ``find`` and in ``explain``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import B, H, T, _rand, _traced_bool_mask, errors, evaluate, replaced, value_and_grads
from helpers import walk

import autocast
from autocast import _attention as attention
from autocast._attention import LeftAlone, MaskKind, Match, _fuse

N, K = 4, 2
G = N // K
K_MASK = -2.3819763e38  # Gemma's masked value


# --- grouped-query attention as reshaped scores ---------------------------------------------


def gemma_gqa(q, k, v, attn_mask, *, order="KG"):
    """Gemma's `Attention.__call__` (use_gqa): q [B, T, N, H], k and v [B, S, K, H], attn_mask
    [B, T, S] (``order="GK"``: the query heads grouped the other way, n = g * K + k)."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    split = (kv, n // kv) if order == "KG" else (n // kv, kv)
    heads = "KG" if order == "KG" else "GK"
    query_scaled = (q * h**-0.5).reshape(b, t, *split, h)
    logits = jnp.einsum(f"BT{heads}H,BSKH->BT{heads}S", query_scaled, k)
    logits = logits.reshape(b, t, n, -1)
    padded_logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
    probs = jax.nn.softmax(padded_logits, axis=-1).astype(k.dtype)
    probs = probs.reshape(b, t, *split, -1)
    encoded = jnp.einsum(f"BT{heads}S,BSKH->BT{heads}H", probs, v)
    return encoded.reshape(b, t, n, h)


def gemma_causal(q, k, v):
    return gemma_gqa(q, k, v, jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))[None])


def gemma_g_major(q, k, v, attn_mask):
    return gemma_gqa(q, k, v, attn_mask, order="GK")


def nnx_dot_product_attention(q, k, v):
    from flax import nnx

    return nnx.dot_product_attention(q, k, v, dropout_rate=0.1, deterministic=True, is_causal=True)


def _nnx_mha():
    from flax import nnx

    m = nnx.MultiHeadAttention(
        num_heads=N,
        num_kv_heads=K,
        in_features=32,
        qkv_features=N * H,
        dropout_rate=0.1,
        deterministic=True,
        decode=False,
        keep_rngs=False,  # (evaluation: no dropout key in the state)
        rngs=nnx.Rngs(0),
    )
    graphdef, state = nnx.split(m)
    mask = nnx.make_causal_mask(jnp.ones((B, T)))
    return (lambda st, x: nnx.merge(graphdef, st)(x, mask=mask)), (state, _rand(B, T, 32, seed=4))


def _gqa_scores(q, k):
    b, t, n, h = q.shape
    return jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(b, t, K, n // K, h) * h**-0.5, k)


def t_merged(q, k, v):  # the groups folded into the queries: [B, K, T * G, S] (exact: nothing varies along it)
    b, t, n, h = q.shape
    s = _gqa_scores(q, k).transpose(0, 2, 1, 3, 4).reshape(b, K, t * G, -1)
    p = jax.nn.softmax(s).reshape(b, K, t, G, -1)
    return jnp.einsum("BKTGS,BSKH->BTKGH", p, v)


# near misses


def regrouped(q, k, v):  # probabilities split as [.., G, K, ..] where the scores merged [.., K, G, ..]
    b, t, n, h = q.shape
    p = jax.nn.softmax(_gqa_scores(q, k).reshape(b, t, n, -1))
    return jnp.einsum("BTGKS,BSKH->BTGKH", p.reshape(b, t, n // K, K, -1), v)  # (K != G: another grouping)


def merged_probs(q, k, v):  # the probabilities stay merged: the value product reads repeated values
    b, t, n, h = q.shape
    p = jax.nn.softmax(_gqa_scores(q, k).reshape(b, t, n, -1))
    return jnp.einsum("BTNS,BSNH->BTNH", p, jnp.repeat(v, n // K, axis=2))


def softmax_merged(q, k, v):  # the groups merged into the keys: the softmax runs over G * S
    b, t, n, h = q.shape
    p = jax.nn.softmax(_gqa_scores(q, k).reshape(b, t, K, -1))
    return jnp.einsum("BTKGS,BSKH->BTKGH", p.reshape(b, t, K, G, -1), v)


def head_bias(q, k, v, bias):  # a traced bias per merged head [N, T, S]
    b, t, n, h = q.shape
    s = _gqa_scores(q, k).reshape(b, t, n, -1) + bias.transpose(1, 0, 2)[None]
    p = jax.nn.softmax(s).reshape(b, t, K, n // K, -1)
    return jnp.einsum("BTKGS,BSKH->BTKGH", p, v)


def t_merged_mask(q, k, v, mask):  # a traced mask varying along the merged queries x groups
    b, t, n, h = q.shape
    s = _gqa_scores(q, k).transpose(0, 2, 1, 3, 4).reshape(b, K, t * G, -1)
    s = jnp.where(mask[:, None], s, -1e9)
    p = jax.nn.softmax(s).reshape(b, K, t, G, -1)
    return jnp.einsum("BKTGS,BSKH->BTKGH", p, v)


# --- a factor on the probabilities (Hugging Face's head mask) ------------------------------


def hf_bert(q, k, v, attention_mask, head_mask, *, deterministic=True, output_attentions=False):
    """`FlaxBertSelfAttention.__call__`'s attention (transformers' modeling_flax_bert.py):
    the additive bias from the attention mask, Flax linen's weights (dropout configured),
    the head mask, the value product."""
    import flax.linen as nn

    mask = jnp.expand_dims(attention_mask, axis=(-3, -2))
    attention_bias = jax.lax.select(
        mask > 0, jnp.full(mask.shape, 0.0), jnp.full(mask.shape, jnp.finfo(jnp.float32).min)
    )
    attn_weights = nn.dot_product_attention_weights(
        q,
        k,
        bias=attention_bias,
        dropout_rng=jax.random.key(0),
        dropout_rate=0.1,
        broadcast_dropout=True,
        deterministic=deterministic,
        precision=None,
    )
    attn_weights = jnp.einsum("...hqk,h->...hqk", attn_weights, head_mask)
    attn_output = jnp.einsum("...hqk,...khd->...qhd", attn_weights, v)
    return (attn_output, attn_weights) if output_attentions else attn_output


def _softmax_probs(q, k):
    return jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) * H**-0.5)


def head_factor_broadcast(q, k, v, head_mask):  # probs * head_mask[:, None, None]
    return jnp.einsum("bnts,bsnh->btnh", _softmax_probs(q, k) * head_mask[:, None, None], v)


def const_head_factor(q, k, v):
    f = jnp.asarray(np.array([1.0, 0.5, 0.0, 2.0], np.float32))
    return jnp.einsum("bnts,bsnh->btnh", _softmax_probs(q, k) * f[:, None, None], v)


def query_factor(q, k, v, w):  # varies along the queries: out[t] = w[t] * (p . v)[t]
    return jnp.einsum("bnts,bsnh->btnh", _softmax_probs(q, k) * w[:, None, :, None], v)


def key_factor(q, k, v, w):  # varies along the keys: a mask after the softmax
    return jnp.einsum("bnts,bsnh->btnh", _softmax_probs(q, k) * w[:, None, None, :], v)


def gqa_head_mask(q, k, v, head_mask):  # a head mask on Gemma's split probabilities
    b, t, n, h = q.shape
    p = jax.nn.softmax(_gqa_scores(q, k).reshape(b, t, n, -1)) * head_mask[:, None]
    return jnp.einsum("BTKGS,BSKH->BTKGH", p.reshape(b, t, K, n // K, -1), v)


# --- the cases ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: object  # () -> (fn, args)
    kind: MaskKind | None = None
    reason: str | None = None
    groups: int = 1

    def __repr__(self) -> str:
        return self.name


def _gqa_qkv(n=N, kv=K):
    return _rand(B, T, n, H, seed=0), _rand(B, T, kv, H, seed=1), _rand(B, T, kv, H, seed=2)


def _mha_qkv():
    return _rand(B, T, N, H, seed=0), _rand(B, T, N, H, seed=1), _rand(B, T, N, H, seed=2)


def _case(fn, qkv, *extra):
    return lambda: (fn, (*qkv(), *extra))


_PAD = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)
_HEADS = np.array([0.5, 1.0, 0.0, 2.0], np.float32)

MATCHES = [
    Case("gemma_causal", _case(gemma_causal, _gqa_qkv), MaskKind.CAUSAL, groups=G),
    Case("gemma_mask", _case(gemma_gqa, _gqa_qkv, _traced_bool_mask(False)), MaskKind.MASK, groups=G),
    Case("gemma_empty_row", _case(gemma_gqa, _gqa_qkv, _traced_bool_mask()), MaskKind.MASK, groups=G),
    Case("gemma_g_major", _case(gemma_g_major, _gqa_qkv, _traced_bool_mask(False)), MaskKind.MASK, groups=G),
    Case("nnx_dot_product_attention", _case(nnx_dot_product_attention, _gqa_qkv), MaskKind.CAUSAL, groups=G),
    Case("nnx_mha_gqa", _nnx_mha, MaskKind.CAUSAL, groups=G),
    Case("t_merged", _case(t_merged, _gqa_qkv), MaskKind.NONE, groups=G),
    Case("hf_head_mask_ones", _case(hf_bert, _mha_qkv, _PAD, np.ones(N, np.float32))),
    Case("hf_head_mask", _case(hf_bert, _mha_qkv, _PAD, _HEADS)),
    Case("head_factor_broadcast", _case(head_factor_broadcast, _mha_qkv, _HEADS), MaskKind.NONE),
    Case("const_head_factor", _case(const_head_factor, _mha_qkv), MaskKind.NONE),
    Case("query_factor", _case(query_factor, _mha_qkv, _rand(B, T, seed=8)), MaskKind.NONE),
]

LEFT_ALONE = [
    Case("regrouped", _case(regrouped, functools.partial(_gqa_qkv, n=6)), reason="otherwise than the scores' reshape"),
    Case("regrouped_same_sizes", _case(regrouped, _gqa_qkv), reason="pairs other axes than the scores' batch axes"),
    Case("merged_probs", _case(merged_probs, _gqa_qkv), reason="value product with axes a reshape merged"),
    Case("softmax_merged", _case(softmax_merged, _gqa_qkv), reason="softmax runs over axes of the product a reshape"),
    Case("head_bias", _case(head_bias, _gqa_qkv, _rand(T, N, T, seed=9)), reason="varies along axes of the scores"),
    Case(
        "t_merged_mask",
        _case(t_merged_mask, _gqa_qkv, np.random.default_rng(3).random((B, T * G, T)) < 0.7),
        reason="varies along axes of the scores a reshape merged",
    ),
    Case("key_factor", _case(key_factor, _mha_qkv, _rand(B, T, seed=8)), reason="varies along the keys"),
    Case("gqa_head_mask", _case(gqa_head_mask, _gqa_qkv, _HEADS), reason="varies along axes of the scores a reshape"),
    Case(
        "hf_dropout",
        _case(functools.partial(hf_bert, deterministic=False), _mha_qkv, _PAD, _HEADS),
        reason="dropout on the probabilities",
    ),
    Case(
        "hf_attentions_returned",
        _case(functools.partial(hf_bert, output_attentions=True), _mha_qkv, _PAD, _HEADS),
        reason="the probabilities are read more than once",
    ),
]


@functools.cache
def _traced(case: Case):
    fn, args = case.make()
    leaves, tree = jax.tree_util.tree_flatten(args)
    leaves = [np.asarray(x) for x in leaves]

    def flat(*xs):
        return jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(tree, xs)))

    jaxpr = jax.make_jaxpr(flat)(*leaves)
    return flat, leaves, jaxpr


def _found(case: Case, dtype="bfloat16"):
    return attention.find(_traced(case)[2], compute_dtype=dtype)


# --- the recogniser ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", MATCHES, ids=repr)
def test_matched(case):
    (m,) = _found(case)
    assert isinstance(m, Match), m.describe()
    assert case.kind is None or m.mask.kind == case.kind, m.describe()
    assert m.groups == case.groups and m.kv_heads * m.groups == N, m.describe()
    if case.groups > 1:
        assert "scores reshaped" in m.idiom or case.name.startswith("nnx") and "scores reshaped" in m.idiom
        assert sorted(m.q.roles) == sorted("BTNGH") and m.k.roles == m.v.roles == ("B", "S", "N", "H")
    else:
        assert "factor on the probabilities" in m.idiom or case.name == "hf_head_mask_ones"


@pytest.mark.parametrize("case", LEFT_ALONE, ids=repr)
def test_near_miss_left_alone(case):
    (res,) = _found(case)
    assert isinstance(res, LeftAlone), res.describe()
    assert case.reason in res.reason, res.reason


# --- the extracted call against the original equations ----------------------------------------


def _rewrite_errors(case: Case, dtype: str, compute: str):
    flat, leaves, jaxpr = _traced(case)
    matches = [r for r in attention.find(jaxpr, compute_dtype=dtype) if isinstance(r, Match)]
    assert len(matches) == 1
    matches = [dataclasses.replace(m, compute_dtype=np.dtype(compute)) for m in matches]
    ref = [np.asarray(x) for x in value_and_grads(replaced(jaxpr), leaves)]
    new = value_and_grads(lambda *xs: evaluate(jaxpr, xs, matches), leaves)
    assert all(np.all(np.isfinite(x)) for x in new)
    return errors(new, ref)


@pytest.mark.parametrize("case", MATCHES, ids=repr)
def test_call_in_float32_is_the_original(case):
    """The call run in float32 (the match's compute dtype replaced) computes the replaced
    equations in float32: values and the gradients w.r.t. every float input (head masks
    included), to float32 rounding."""
    errs = _rewrite_errors(case, "bfloat16", "float32")
    assert max(errs) <= 2e-6, errs


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", MATCHES, ids=repr)
def test_call_in_half_precision(case, dtype):
    """As tests/test_attention_call.py: within 3 epsilons of the dtype of float32."""
    errs = _rewrite_errors(case, dtype, dtype)
    eps = float(jnp.finfo(dtype).eps)
    assert max(errs) <= 3 * eps, [f"{e / eps:.2f}" for e in errs]


def test_head_mask_gradient_is_the_originals():
    """The traced head mask's gradient goes through the output factor: a zero head has a
    nonzero gradient (what its output would have contributed), as in the original."""
    case = next(c for c in MATCHES if c.name == "hf_head_mask")
    flat, leaves, jaxpr = _traced(case)
    (m,) = attention.find(jaxpr, compute_dtype="bfloat16")
    m = dataclasses.replace(m, compute_dtype=np.dtype("float32"))
    hm = len(leaves) - 1

    cotangent = _rand(B, T, N, H, seed=11)

    def loss(fn, head_mask):
        xs = [*leaves[:hm], head_mask]
        return jnp.sum(fn(*xs)[0] * cotangent)

    ref = jax.grad(functools.partial(loss, replaced(jaxpr)))(leaves[hm])
    new = jax.grad(functools.partial(loss, lambda *xs: evaluate(jaxpr, xs, [m])))(leaves[hm])
    assert abs(float(ref[2])) > 1e-3  # the zero head's gradient
    np.testing.assert_allclose(new, ref, rtol=2e-6, atol=1e-6)


# --- amp with the fused call emitted on CPU ---------------------------------------------------


@pytest.fixture
def emit_on_cpu():
    with _fuse.emitting("cpu", "xla"):
        yield


def _loss_and_leaves(case: Case):
    flat, leaves, _ = _traced(case)

    def loss(*xs):
        return sum(jnp.sum(jnp.asarray(o, jnp.float32) ** 2) for o in flat(*xs))

    return loss, [jnp.asarray(x) for x in leaves]


def _value_and_grad(loss, leaves, **amp_kwargs):
    idx = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]
    fn = autocast.amp(loss, **amp_kwargs) if amp_kwargs else loss
    v, g = jax.value_and_grad(fn, argnums=idx)(*leaves)
    return [v, *g]


def _rel(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))


@pytest.mark.parametrize("case", MATCHES, ids=repr)
def test_amp_fused_matches_xla_and_float32(case, emit_on_cpu):
    """amp(bfloat16) with the span fused: one platform choice, values and gradients within
    the unfused program's distance from float32 (as tests/test_attention_amp.py), and close to
    the unfused program's own."""
    loss, leaves = _loss_and_leaves(case)
    closed = jax.make_jaxpr(autocast.amp(loss, compute_dtype=jnp.bfloat16))(*leaves)
    assert any(e.primitive.name == "platform_index" for e, _ in walk(closed)), "the span was not fused"
    ref = _value_and_grad(loss, leaves)
    fused = jax.jit(lambda *xs: _value_and_grad(loss, list(xs), compute_dtype=jnp.bfloat16))(*leaves)
    xla = _value_and_grad(loss, leaves, compute_dtype=jnp.bfloat16, attention="xla")
    err = max(_rel(a, b) for a, b in zip(fused, ref))
    unfused = max(_rel(a, b) for a, b in zip(xla, ref))
    assert err <= 3 * unfused + 2e-2, (err, unfused)
    assert max(_rel(a, b) for a, b in zip(fused, xla)) <= 3 * unfused + 2e-2


@pytest.mark.parametrize("case", [*MATCHES[:2], *MATCHES[7:9]], ids=repr)
def test_explain_says_fused(case, emit_on_cpu):
    loss, leaves = _loss_and_leaves(case)
    report = autocast.explain(loss, compute_dtype=jnp.bfloat16)(*leaves)
    (a,) = report.totals["attention"]
    assert a["kernel"].startswith("fused"), a
    assert ("scores reshaped" if case.groups > 1 else "factor on the probabilities") in a["attention"], a


@pytest.mark.parametrize("case", LEFT_ALONE, ids=repr)
def test_explain_gives_the_near_miss_reason(case, emit_on_cpu):
    loss, leaves = _loss_and_leaves(case)
    report = autocast.explain(loss, compute_dtype=jnp.bfloat16)(*leaves)
    found = report.totals["attention"]
    assert found and all(a["kernel"] == "left alone" for a in found), found
    assert case.reason in found[0]["attention"], found
    closed = jax.make_jaxpr(autocast.amp(loss, compute_dtype=jnp.bfloat16))(*leaves)
    assert not any(e.primitive.name == "platform_index" for e, _ in walk(closed))
