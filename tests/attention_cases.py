"""Attention idioms and near misses for the recogniser's tests (tests/test_attention_*.py),
and a small jaxpr evaluator that replaces a match's equations by its extracted call."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autocast import _attention as attention
from autocast import _compat
from autocast._attention import MaskKind

B, T, N, H = 2, 4, 4, 8
SCALE = 1 / np.sqrt(H)


def _rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _qkv(t: int = T, s: int = T, n: int = N, kv: int | None = None, h: int = H, hv: int | None = None, seed: int = 0):
    kv = n if kv is None else kv
    return _rand(B, t, n, h, seed=seed), _rand(B, s, kv, h, seed=seed + 1), _rand(B, s, kv, hv or h, seed=seed + 2)


def _lengths() -> np.ndarray:
    return np.array([3, 4], np.int32)


# --- the idioms -------------------------------------------------------------------------


def einsum_where(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def additive_1e9(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    s = s + (1.0 - jnp.tril(jnp.ones((T, T), s.dtype))) * -1e9
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)


def additive_neg_inf(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    bias = jnp.where(jnp.tril(jnp.ones((T, T), bool)), 0.0, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(bias + s), v)


def bias_commuted(q, k, v, bias):
    s = bias + jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)


def bnth_matmul(q, k, v):  # heads-first layout, q @ k^T, scale by multiplication of the query
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    p = jax.nn.softmax((q * SCALE) @ k.swapaxes(-1, -2), axis=-1)
    return (p @ v).transpose(0, 2, 1, 3)


def softmax_in_jit(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    return jnp.einsum("bnts,bsnh->btnh", jax.jit(jax.nn.softmax)(s), v)


def rope(q, k, v):
    pos = np.arange(T)[:, None] / (10000 ** (np.arange(H // 2) / (H // 2)))
    cos, sin = (jnp.asarray(np.repeat(f(pos), 2, axis=-1))[None, :, None, :] for f in (np.cos, np.sin))

    def rot(x):
        x2 = jnp.stack([-x[..., 1::2], x[..., ::2]], axis=-1).reshape(x.shape)
        return x * cos + x2 * sin

    return einsum_where(rot(q), rot(k), v)


def causal_padding(q, k, v, lengths):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    keep = jnp.tril(jnp.ones((T, T), bool))[None, None] & (jnp.arange(T)[None, :] < lengths[:, None])[:, None, None, :]
    s = jnp.where(keep, s, -1e9)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)


def traced_mask(q, k, v, mask):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    s = jnp.where(mask[:, None], s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)


def repeat_kv(q, k, v):
    g = q.shape[2] // k.shape[2]
    return einsum_where(q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2))


def wrong_axis_key(q, k, v):  # pytorch#195320: k transposed on the wrong axes (N == S == T)
    s = jnp.einsum("btnh,bsnh->bnts", q, k.transpose(0, 2, 1, 3)) * SCALE
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)


def where_neg_inf(q, k, v):  # a -inf fill is exact where the constant mask leaves no row empty
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)


def additive_traced(q, k, v, keep):  # Hugging Face style: (1 - mask) * -1e9 from a traced mask
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    s = s + (1.0 - keep[:, None, None, :]) * -1e9
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)


def query_padding(q, k, v, lengths):  # queries past the length masked, the output not zeroed
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    pos = jnp.arange(T)
    keep = (pos[None, :, None] < lengths[:, None, None]) & (pos[None, None, :] < lengths[:, None, None])
    s = jnp.where(keep[:, None], s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)


def two_layers(q, k, v):
    return einsum_where(einsum_where(q, k, v), k, v)


# --- near misses ------------------------------------------------------------------------


def value_wrong_axis(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    return jnp.einsum("bnts,btnh->bsnh", jax.nn.softmax(s), v)


def softmax_query_axis(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-2), v)


def scores_twice(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v), jnp.max(s)


def probs_returned(q, k, v):
    p = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE)
    return jnp.einsum("bnts,bsnh->btnh", p, v), p


def dropout(q, k, v):
    p = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE)
    keep = jax.random.bernoulli(jax.random.key(0), 0.9, p.shape)
    return jnp.einsum("bnts,bsnh->btnh", jnp.where(keep, p / 0.9, 0), v)


def upper_triangle(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    s = jnp.where(jnp.triu(jnp.ones((T, T), bool)), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)


def traced_scale(q, k, v, scale):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)


def softcap(q, k, v):
    s = jnp.tanh(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE / 30.0) * 30.0
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)


def neg_inf_traced(q, k, v, mask):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    s = jnp.where(mask[:, None], s, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)


def causal_neg_inf_bias(q, k, v, pad):  # a finfo.min padding bias under a -inf causal fill
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    bias = jax.lax.select(pad[:, None, None, :] > 0, jnp.zeros((B, 1, 1, T)), jnp.full((B, 1, 1, T), -3.4028235e38))
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s + bias, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)


# --- library idioms (imported lazily: the modules are built when a test asks) --------------


def _flax_linen():
    import flax.linen as nn

    m = nn.MultiHeadDotProductAttention(
        num_heads=N, qkv_features=N * H, decode=False, dropout_rate=0.0, deterministic=True
    )
    x = _rand(B, T, N * H, seed=3)
    params = m.init(jax.random.key(0), x)
    mask = nn.make_causal_mask(jnp.ones((B, T)))
    return (lambda p, x: m.apply(p, x, mask=mask)), (params, x)


def _flax_nnx():
    from flax import nnx

    m = nnx.MultiHeadAttention(
        num_heads=N, in_features=32, qkv_features=N * H, decode=False, dropout_rate=0.0, rngs=nnx.Rngs(0)
    )
    graphdef, state = nnx.split(m)
    mask = nnx.make_causal_mask(jnp.ones((B, T)))
    return (lambda st, x: nnx.merge(graphdef, st)(x, mask=mask)), (state, _rand(B, T, N * H, seed=4))


def _equinox(dropout: float = 0.0):
    import equinox as eqx

    m = eqx.nn.MultiheadAttention(
        num_heads=N, query_size=32, key=jax.random.key(1), dropout_p=dropout, inference=not dropout
    )
    params, static = eqx.partition(m, eqx.is_array)
    mask = jnp.tril(jnp.ones((T, T), bool))

    def fn(params, x):
        mod = eqx.combine(params, static)
        keys = jax.random.split(jax.random.key(2), x.shape[0])
        return jax.vmap(lambda x, key: mod(x, x, x, mask=mask, key=key))(x, keys)

    return fn, (params, _rand(B, T, N * H, seed=5))


# --- the cases --------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """An idiom: ``make()`` gives ``(fn, args)``; a match is expected with mask ``kind``
    (and ``expect`` checks more), or a :class:`LeftAlone` whose reason holds ``reason``."""

    name: str
    make: Callable[[], tuple[Callable, tuple]]
    kind: MaskKind | None = None
    reason: str | None = None
    expect: Callable[[Any], None] | None = None

    def __repr__(self) -> str:
        return self.name


def _qkv_case(fn, *extra, **shape):
    return lambda: (fn, (*_qkv(**shape), *extra))


def _roles(q=None, k=None, v=None, **attrs):
    def check(m):
        for name, want in (("q", q), ("k", k), ("v", v)):
            if want is not None:
                assert getattr(m, name).roles == tuple(want), (name, getattr(m, name).roles)
        for key, want in attrs.items():
            got = getattr(m, key) if key != "window" else m.mask.window
            assert got == want if not isinstance(want, float) else np.isclose(got, want), (key, got, want)

    return check


def _traced_bool_mask(empty_row: bool = True) -> np.ndarray:
    mask = np.random.default_rng(7).random((B, T, T)) < 0.7
    mask[:, :, 0] = True
    if empty_row:
        mask[1, 2, :] = False  # a fully masked query row
    return mask


MATCHES = [
    Case("einsum_where", _qkv_case(einsum_where), MaskKind.CAUSAL, expect=_roles("BTNH", "BSNH", "BSNH", scale=SCALE)),
    Case("additive_1e9", _qkv_case(additive_1e9), MaskKind.CAUSAL, expect=_roles(scale=SCALE)),
    Case("additive_neg_inf", _qkv_case(additive_neg_inf), MaskKind.CAUSAL),
    Case("bias_commuted", _qkv_case(bias_commuted, _rand(B, 1, T, T, seed=9)), MaskKind.BIAS),
    Case("bnth_matmul", _qkv_case(bnth_matmul), MaskKind.NONE, expect=_roles("BTNH", "BSNH", "BSNH", scale=SCALE)),
    Case("softmax_in_jit", _qkv_case(softmax_in_jit), MaskKind.NONE),
    Case(
        "jaxnn_causal",
        _qkv_case(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
        MaskKind.CAUSAL,
        expect=_roles(scale=SCALE, groups=1, kv_heads=N),
    ),
    Case(
        "jaxnn_plain",  # no mask: the row maximum is taken before a transpose
        _qkv_case(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=0.1)),
        MaskKind.NONE,
        expect=_roles(scale=0.1),
    ),
    Case(
        "jaxnn_q_lengths",
        _qkv_case(lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, query_seq_lengths=n), _lengths()),
        MaskKind.Q_LENGTHS,
    ),
    Case(
        "jaxnn_mask",
        _qkv_case(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m), _traced_bool_mask()[:, None]),
        MaskKind.MASK,
    ),
    Case(
        "jaxnn_lengths",
        _qkv_case(
            lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, query_seq_lengths=n, key_value_seq_lengths=n),
            _lengths(),
        ),
        MaskKind.KV_LENGTHS | MaskKind.Q_LENGTHS,
    ),
    Case(
        "jaxnn_window",
        _qkv_case(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(1, 0))),
        MaskKind.CAUSAL | MaskKind.WINDOW,
        expect=_roles(window=1),
    ),
    Case(
        "jaxnn_gqa",
        _qkv_case(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), kv=N // 2),
        MaskKind.CAUSAL,
        expect=_roles("BTNGH", "BSNH", "BSNH", groups=2, kv_heads=N // 2),
    ),
    Case(
        "repeat_kv",
        _qkv_case(repeat_kv, kv=N // 2),
        MaskKind.CAUSAL,
        expect=_roles("BTNH", "BSNH", "BSNH", groups=2, kv_heads=N // 2),
    ),
    Case("flax_linen", _flax_linen, MaskKind.CAUSAL, expect=_roles(scale=SCALE)),
    Case("flax_nnx", _flax_nnx, MaskKind.CAUSAL, expect=_roles(scale=SCALE)),
    Case("equinox_vmapped", _equinox, MaskKind.CAUSAL, expect=_roles("BTNH", "BSNH", "BSNH", scale=SCALE)),
    Case("rope", _qkv_case(rope), MaskKind.CAUSAL),
    Case(
        "causal_padding", _qkv_case(causal_padding, np.array([3, 0], np.int32)), MaskKind.CAUSAL | MaskKind.KV_LENGTHS
    ),
    Case("fully_masked_rows", _qkv_case(traced_mask, _traced_bool_mask()), MaskKind.MASK),
    Case("upper_triangle", _qkv_case(upper_triangle), MaskKind.MASK),
    Case("causal_t_ne_s", _qkv_case(einsum_where, s=2 * T), MaskKind.MASK),
    Case("cross_t_ne_s", _qkv_case(bnth_matmul, s=2 * T), MaskKind.NONE),
    Case("wrong_axis_key", _qkv_case(wrong_axis_key), MaskKind.NONE, expect=_roles(k="BNSH")),
    Case("where_neg_inf", _qkv_case(where_neg_inf), MaskKind.CAUSAL),
    Case(
        "additive_traced", _qkv_case(additive_traced, np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)), MaskKind.BIAS
    ),
    Case("query_padding", _qkv_case(query_padding, _lengths()), MaskKind.KV_LENGTHS | MaskKind.MASK),
    Case(
        "jaxnn_bias_mask",
        _qkv_case(
            lambda q, k, v, b, m: jax.nn.dot_product_attention(q, k, v, bias=b, mask=m),
            _rand(B, N, T, T, seed=13),
            _traced_bool_mask(False)[:, None],
        ),
        MaskKind.BIAS,  # the mask folded into the traced bias (it could mask a row on its own)
        expect=lambda m: m.mask.folded,
    ),
    Case("neg_inf_traced", _qkv_case(neg_inf_traced, _traced_bool_mask(False)), MaskKind.MASK),
]

LEFT_ALONE = [
    Case("value_wrong_axis", _qkv_case(value_wrong_axis), reason="does not contract the softmax axis"),
    Case("softmax_query_axis", _qkv_case(softmax_query_axis), reason="does not contract the softmax axis"),
    Case("scores_twice", _qkv_case(scores_twice), reason="scores are also read outside"),
    Case("probs_returned", _qkv_case(probs_returned), reason="probabilities are read more than once"),
    Case("dropout", _qkv_case(dropout), reason="dropout"),
    Case("equinox_dropout", lambda: _equinox(0.1), reason="dropout"),
    Case("traced_scale", _qkv_case(traced_scale, np.float32(0.3)), reason="traced scale"),
    Case("softcap", _qkv_case(softcap), reason="softcapping"),
    Case(
        "neg_inf_beside_finfo_min",
        _qkv_case(causal_neg_inf_bias, np.array([[0, 1, 1, 1], [1, 1, 1, 1]], np.int32)),
        reason="masks with different values where masked (-inf, -3.40282e+38)",
    ),
    Case("head_dim_12", _qkv_case(einsum_where, h=12), reason="head dimension 12"),
    Case("mla", _qkv_case(einsum_where, hv=2 * H), reason=f"differs from v's {2 * H}"),
]


# --- issue 47: grouped query heads as reshaped scores, a factor on the probabilities -------


def gqa_reshaped_scores(q, k, v, mask):  # Gemma, Flax NNX: scores [B, T, K, G, S] -> [B, T, N, S] and back
    b, t, n, h = q.shape
    kv = k.shape[2]
    s = jnp.einsum("btkgh,bskh->btkgs", q.reshape(b, t, kv, n // kv, h), k) * SCALE
    s = jnp.where(mask[:, :, None], s.reshape(b, t, n, -1), -0.7 * float(np.finfo(np.float32).max))
    p = jax.nn.softmax(s).reshape(b, t, kv, n // kv, -1)
    return jnp.einsum("btkgs,bskh->btkgh", p, v).reshape(b, t, n, h)


def head_mask(q, k, v, heads):  # a factor per head on the probabilities (Hugging Face: a head mask)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s) * heads[:, None, None], v)


def gqa_regrouped(q, k, v):  # probabilities split [.., G, K, ..] where the scores merged [.., K, G, ..]
    b, t, n, h = q.shape
    kv = k.shape[2]
    s = jnp.einsum("btkgh,bskh->btkgs", q.reshape(b, t, kv, n // kv, h), k) * SCALE
    p = jax.nn.softmax(s.reshape(b, t, n, -1)).reshape(b, t, n // kv, kv, -1)
    return jnp.einsum("btgks,bskh->btgkh", p, v)


def key_factor(q, k, v, w):  # a factor along the keys after the softmax: not one on the output
    p = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) * SCALE)
    return jnp.einsum("bnts,bsnh->btnh", p * w[:, None, None, :], v)


MATCHES += [
    Case(
        "gqa_reshaped_scores",
        _qkv_case(gqa_reshaped_scores, _traced_bool_mask(False), kv=N // 2),
        MaskKind.MASK,
        expect=_roles("BTNGH", "BSNH", "BSNH", groups=2, kv_heads=N // 2),
    ),
    Case("head_mask", _qkv_case(head_mask, np.array([0.5, 1.0, 0.0, 2.0], np.float32)), MaskKind.CAUSAL),
]

LEFT_ALONE += [
    Case("gqa_regrouped", _qkv_case(gqa_regrouped, n=6, kv=2), reason="otherwise than the scores' reshape merged"),
    Case("key_factor", _qkv_case(key_factor, _rand(B, T, seed=8)), reason="varies along the keys"),
]


# --- tracing and evaluating -------------------------------------------------------------

SOFTMAX_FORMS = ["inline", "custom_jvp"] + (["custom_jvp3"] if _compat.has_flag("custom_jvp3") else [])


def _form(form: str) -> contextlib.AbstractContextManager:
    stack = contextlib.ExitStack()
    if form != "inline":
        stack.enter_context(_compat.with_flag("softmax_custom_jvp", True))
    if form == "custom_jvp3":
        stack.enter_context(_compat.with_flag("custom_jvp3", True))
    return stack


@dataclass
class Traced:
    fn: Callable  # flat leaves -> flat outputs
    leaves: list[np.ndarray]
    jaxpr: Any  # closed
    found: list[Any]

    @property
    def matches(self) -> list[Any]:
        return [r for r in self.found if isinstance(r, attention.Match)]


@functools.cache
def made(case: Case) -> tuple[Callable, tuple]:
    return case.make()


@functools.cache
def traced(case: Case, form: str = "inline", dtype: str = "bfloat16") -> Traced:
    fn, args = made(case)
    leaves, tree = jax.tree_util.tree_flatten(args)
    leaves = [np.asarray(x) for x in leaves]

    def flat(*xs):
        with _form(form):
            return jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(tree, xs)))

    with _form(form):
        jaxpr = jax.make_jaxpr(flat)(*leaves)
    return Traced(flat, leaves, jaxpr, attention.find(jaxpr, compute_dtype=dtype))


def evaluate(jaxpr: Any, args: Sequence[Any], matches: Sequence[Any] = (), implementation: str = "xla") -> list[Any]:
    """``jaxpr`` on ``args``, each match's equations replaced by its call (at the place of
    its last equation, as amp will emit it)."""
    open_, consts = _compat.open_and_consts(jaxpr)
    env = {v: x for v, x, _ in _compat.bind_inputs(open_, consts, args)}
    at = {max(m.eqns): m for m in matches}
    skip = {i for m in matches for i in m.eqns}

    def read(v):
        return v.val if isinstance(v, _compat.Literal) else env[v]

    for i, eqn in enumerate(open_.eqns):
        if i in at:
            m = at[i]
            env.update(zip(m.outputs, attention.call(m, [env[v] for v in m.inputs], implementation=implementation)))
        if i in skip:
            continue
        outs = _compat.bind(eqn.primitive, [read(v) for v in eqn.invars], eqn.params)
        env.update((v, o) for v, o in zip(eqn.outvars, outs) if not isinstance(v, _compat.DropVar))
    return [read(v) for v in open_.outvars]


def replaced(jaxpr: Any, matches: Sequence[Any] = ()) -> Callable[..., list[Any]]:
    """``jaxpr`` as a function, each match's equations replaced by its call."""
    return lambda *args: evaluate(jaxpr, args, matches)


def is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def value_and_grads(fn: Callable, leaves: Sequence[Any], cotangent_seed: int = 11) -> list[np.ndarray]:
    """``fn``'s outputs and its gradients w.r.t. every float leaf (for fixed random output
    cotangents), all as float32 NumPy arrays."""
    idx = [i for i, x in enumerate(leaves) if is_float(x)]

    def f(*floats):
        full = list(leaves)
        for i, x in zip(idx, floats):
            full[i] = x
        return fn(*full)

    outs, vjp = jax.vjp(f, *(leaves[i] for i in idx))
    cts = [jnp.asarray(_rand(*np.shape(o), seed=cotangent_seed + j), o.dtype) for j, o in enumerate(outs)]
    grads = vjp(cts)
    return [jnp.asarray(x, jnp.float32) for x in [*outs, *grads]]


def errors(new: Sequence[Any], ref: Sequence[Any]) -> list[float]:
    """The error of each array of ``new`` against ``ref`` (float32): the largest absolute
    difference over the array's largest magnitude, or over a tenth of the largest magnitude
    of all of ``ref`` where that is larger (a gradient that cancels to zero in exact
    arithmetic, a key bias's, carries rounding noise at the scale of its terms)."""
    scale = 0.1 * max(float(np.max(np.abs(r))) for r in ref)
    return [float(np.max(np.abs(np.asarray(n) - r))) / max(float(np.max(np.abs(r))), scale) for n, r in zip(new, ref)]


def measure() -> None:
    """Print, per idiom and half dtype, the largest error (:func:`errors`) against float32
    of the original function run in that dtype and of the rewrite, in units of the dtype's
    epsilon: the measurement behind test_attention_call's tolerance.
    ``JAX_PLATFORMS=cpu .venv-newest/bin/python tests/attention_cases.py``"""
    print(f"JAX {jax.__version__}, {jax.devices()[0].device_kind}")
    for case in MATCHES:
        tr = traced(case)
        ref = [np.asarray(x) for x in value_and_grads(replaced(tr.jaxpr), tr.leaves)]
        row = []
        for dtype in ("bfloat16", "float16"):
            eps = float(jnp.finfo(dtype).eps)
            found = [r for r in attention.find(tr.jaxpr, compute_dtype=dtype) if isinstance(r, attention.Match)]
            new = value_and_grads(replaced(tr.jaxpr, found), tr.leaves)
            half = value_and_grads(tr.fn, [x.astype(dtype) if is_float(x) else x for x in tr.leaves])
            row.append(
                f"{dtype}: original {max(errors(half, ref)) / eps:.2f} eps, rewrite {max(errors(new, ref)) / eps:.2f} eps"
            )
        print(f"{case.name:18s} " + " | ".join(row))


if __name__ == "__main__":
    measure()
