"""The extracted call (autocast._attention.call) computes what the replaced equations did:
values and gradients of every idiom against float32, in float16 and bfloat16, with
tolerances from the same function computed in half precision; padding, fully masked rows,
and the cuDNN support query (the platform choice amp emits: tests/test_attention_amp.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    MATCHES,
    SOFTMAX_FORMS,
    B,
    H,
    N,
    T,
    einsum_where,
    errors,
    evaluate,
    replaced,
    traced,
    two_layers,
    value_and_grads,
)

from autocast import _attention as attention
from autocast._attention import _call, _graph, _layout


@functools.cache
def _float32(case):
    tr = traced(case)
    return [np.asarray(x) for x in value_and_grads(replaced(tr.jaxpr), tr.leaves)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", MATCHES, ids=repr)
def test_call_computes_the_replaced_equations(case, dtype):
    """Each output and each gradient (w.r.t. every float input: q, k, v, biases, module
    parameters) with the span replaced by ``call(implementation="xla")`` is within 3
    epsilons of the dtype of float32's (``attention_cases.errors``). Measured
    (``python tests/attention_cases.py``, JAX 0.12.0.1 on CPU, 2026-11-27): the original
    functions run in the half dtype are up to 3.5 epsilons off (float16 NaN for the additive
    -1e9 mask, which overflows), the rewrites up to 1.4."""
    tr = traced(case)
    matches = [r for r in attention.find(tr.jaxpr, compute_dtype=dtype) if isinstance(r, attention.Match)]
    assert len(matches) == 1
    ref = _float32(case)
    new = value_and_grads(replaced(tr.jaxpr, matches), tr.leaves)
    assert all(np.all(np.isfinite(n)) for n in new)
    eps = float(jnp.finfo(dtype).eps)
    assert max(errors(new, ref)) <= 3 * eps, [f"{e / eps:.2f}" for e in errors(new, ref)]


@pytest.mark.parametrize("form", SOFTMAX_FORMS[1:])
def test_call_against_the_custom_jvp_softmax(form):
    """The original's gradient through ``custom_jvp[_softmax]`` (``jax_softmax_custom_jvp``)."""
    for case in (MATCHES[0], next(c for c in MATCHES if c.name == "jaxnn_causal")):
        tr = traced(case, form)
        ref = [np.asarray(x) for x in value_and_grads(replaced(tr.jaxpr), tr.leaves)]
        new = value_and_grads(replaced(tr.jaxpr, tr.matches), tr.leaves)
        assert max(errors(new, ref)) <= 3 * float(jnp.finfo(jnp.bfloat16).eps), case


def _padded_case(t):
    q, k, v = (np.random.default_rng(i).standard_normal((B, t, N, H)).astype(np.float32) for i in range(3))
    mask = np.random.default_rng(5).random((B, t, t)) < 0.8
    mask[:, :, 0] = True

    def fn(q, k, v, mask):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) * 0.25
        s = jnp.where(mask[:, None] & jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        return [jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)]

    return fn, [q, k, v, mask]


def test_padded_sequences_compute_the_same():
    """Odd lengths (a vision transformer's 197 tokens) padded for cuDNN: padded keys masked,
    padded queries sliced off, the mask padded to match; values and gradients."""
    fn, args = _padded_case(T - 1)  # padded to T: the kernel's shapes are the other tests' ones
    jaxpr = jax.make_jaxpr(fn)(*args)
    (m,) = attention.find(jaxpr, compute_dtype=jnp.bfloat16)
    assert m.mask.kind == attention.MaskKind.CAUSAL | attention.MaskKind.MASK
    ref = [np.asarray(x) for x in value_and_grads(replaced(jaxpr), args)]
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    for multiple in (2, T):  # both pad T - 1 to T
        padded = attention.pad_sequences(m, multiple)
        assert padded.seq_multiple == multiple and "padded to a multiple" in padded.describe()
        new = value_and_grads(replaced(jaxpr, [padded]), args)
        assert max(errors(new, ref)) <= 3 * eps, multiple
    with pytest.raises(ValueError, match="multiple=0"):
        attention.pad_sequences(m, 0)


def test_fully_masked_rows_average_the_values(monkeypatch):
    """A query row with every key masked: the original's softmax is uniform there, so its
    output is the mean of the values; the call sets that explicitly, whatever the kernel
    returns for the row (here a kernel returning zeros everywhere)."""
    case = next(c for c in MATCHES if c.name == "fully_masked_rows")
    tr = traced(case)
    (m,) = tr.matches
    assert m.mask.may_empty
    ins = dict(zip(tr.jaxpr.jaxpr.invars if hasattr(tr.jaxpr, "jaxpr") else tr.jaxpr.invars, tr.leaves))
    original = np.asarray(evaluate(tr.jaxpr, tr.leaves)[0])
    v = tr.leaves[2]
    np.testing.assert_allclose(original[1, 2], v[1].mean(axis=0), rtol=1e-5, atol=1e-6)  # row 2 of batch 1
    monkeypatch.setattr(_call.jax.nn, "dot_product_attention", lambda q, *a, **k: jnp.zeros_like(q))
    out = np.asarray(attention.call(m, [ins[x] for x in m.inputs])[0])
    np.testing.assert_allclose(out[1, 2], v[1].mean(axis=0), rtol=2e-2, atol=2e-2)
    assert np.all(out[0] == 0)  # rows with a key kept: the (patched) kernel's result


def test_cudnn_support_query_on_this_machine():
    """Without cuDNN the query answers with JAX's own error text (the fallback signal);
    ``cudnn_plan`` does not pad around it."""
    m = traced(MATCHES[0]).matches[0]
    err = attention.cudnn_error(m)
    if "cuda" not in {d.platform for d in jax.devices()}:
        assert isinstance(err, str) and "cudnn" in err.lower(), err
        assert attention.cudnn_plan(m) == err
    else:  # a CUDA machine: the plan is a match to emit, or the reason there is none
        plan = attention.cudnn_plan(m)
        assert (err is None) == isinstance(plan, attention.Match)


def test_call_rejects_bad_arguments():
    m = traced(MATCHES[0]).matches[0]
    with pytest.raises(ValueError, match=r"implementation='triton'.*xla.*cudnn"):
        attention.call(m, [None] * 3, implementation="triton")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"3 values expected.*got 2"):
        attention.call(m, [None] * 2)


def test_side_values_reach_the_kernel_layout():
    """``side_to_kernel`` keeps broadcast batch and head axes at size 1 and broadcasts the
    queries and keys to their full extent (cuDNN rejects a broadcast T or S)."""
    m = traced(next(c for c in MATCHES if c.name == "jaxnn_gqa")).matches[0]
    lay = m.layout
    mask = np.zeros([1] * len(lay.lout_shape), bool)
    mask = np.broadcast_to(mask, [d if a == lay.s else 1 for a, d in enumerate(lay.lout_shape)])
    out = _layout.side_to_kernel(jnp.asarray(mask), lay)
    assert out.shape == (1, 1, lay.lout_shape[lay.t], lay.lout_shape[lay.s])


def test_two_attentions_replaced_in_one_jaxpr():
    q, k, v = (np.random.default_rng(i).standard_normal((B, T, N, H)).astype(np.float32) for i in range(3))
    jaxpr = jax.make_jaxpr(two_layers)(q, k, v)
    matches = attention.find(jaxpr, compute_dtype=jnp.bfloat16)
    ref = [np.asarray(evaluate(jaxpr, [q, k, v])[0])]
    new = evaluate(jaxpr, [q, k, v], matches)
    assert len(matches) == 2 and max(errors(new, ref)) <= 3 * float(jnp.finfo(jnp.bfloat16).eps)


def test_a_constant_mask_too_large_to_fold(monkeypatch):
    """Past ``FOLD_LIMIT`` elements a constant mask is not evaluated at trace time: it goes
    to the kernel as a mask the rewrite computes, and the result is the same."""
    monkeypatch.setattr(_graph, "FOLD_LIMIT", 4)
    q, k, v = (np.random.default_rng(i).standard_normal((B, T, N, H)).astype(np.float32) for i in range(3))
    jaxpr = jax.make_jaxpr(einsum_where)(q, k, v)
    (m,) = attention.find(jaxpr, compute_dtype=jnp.bfloat16)
    assert m.mask.kind == attention.MaskKind.MASK and m.mask.may_empty
    ref = [np.asarray(evaluate(jaxpr, [q, k, v])[0])]
    assert max(errors(evaluate(jaxpr, [q, k, v], [m]), ref)) <= 3 * float(jnp.finfo(jnp.bfloat16).eps)
