"""Fused attention through ``amp`` (issue 41): the rewrite of autocast/_attention/_fuse.py
wired into the interpreter, the ``attention=`` switch, the policy's per-scope switch and
``explain``'s report.

On this CPU machine the cuDNN call does not trace, so by default no span is fused and the
program is exactly the one ``attention="xla"`` gives. To run the rewrite itself here, the
tests that need it emit the fused call on CPU with ``implementation="xla"``
(``_fuse.emitting("cpu", "xla")``): the same platform choice, equations, residuals and gradients as on a GPU,
with XLA's attention in place of cuDNN's. Its values and gradients are compared with
float32 and with the unfused program, for every idiom the recogniser matches, in bfloat16
(XLA:CPU cannot compile jax.nn's float16 attention: no F16_F16_F32 dot; the float16
extraction itself is tested against the original equations in tests/test_attention_call.py).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import LEFT_ALONE, MATCHES, made
from helpers import kind, walk

import autocast
from autocast._attention import _fuse

CASES = {c.name: c for c in MATCHES}


def _flat(case):
    fn, args = made(case)
    leaves, tree = jax.tree_util.tree_flatten(args)
    leaves = [jnp.asarray(x) for x in leaves]

    def loss(*xs):
        out = fn(*jax.tree_util.tree_unflatten(tree, xs))
        return sum(jnp.sum(jnp.asarray(o, jnp.float32) ** 2) for o in jax.tree_util.tree_leaves(out))

    return loss, leaves


def _floats(leaves):
    return [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]


def _value_and_grad(loss, leaves, **amp_kwargs):
    idx = _floats(leaves)
    fn = autocast.amp(loss, **amp_kwargs) if amp_kwargs else loss
    return jax.value_and_grad(fn, argnums=idx)(*leaves)


def _rel(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))


def _text(closed) -> str:
    return re.sub(r"0x[0-9a-fA-F]+", "0x", str(closed))  # (function reprs hold addresses)


@pytest.fixture
def emit_on_cpu():
    with _fuse.emitting("cpu", "xla"):
        yield


@pytest.mark.parametrize("name", ["einsum_where", "jaxnn_causal", "equinox_vmapped", "flax_nnx", "causal_padding"])
def test_cpu_program_is_unchanged_without_a_fused_kernel(name):
    """No cuDNN here: every span stays as written, the jaxpr is attention="xla"'s, and
    explain says why."""
    loss, leaves = _flat(CASES[name])
    auto = jax.make_jaxpr(autocast.amp(loss, compute_dtype=jnp.bfloat16))(*leaves)
    xla = jax.make_jaxpr(autocast.amp(loss, compute_dtype=jnp.bfloat16, attention="xla"))(*leaves)
    report = autocast.explain(loss, compute_dtype=jnp.bfloat16)(*leaves)
    found = report.totals["attention"]
    assert found and all(a["attention"].startswith("attention (") for a in found), found
    cudnn_here = any(a["kernel"].startswith("fused") for a in found)
    if not cudnn_here:  # this machine (CI): the cuDNN call does not trace
        assert _text(auto) == _text(xla)
        assert all("as written: no fused kernel here (cuDNN" in a["kernel"] for a in found), found
    else:  # a machine with cuDNN: the span is one platform choice
        assert any(e.primitive.name == "platform_index" for e, _ in walk(auto))


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_fused_rewrite_matches_float32_and_the_unfused_program(name, emit_on_cpu):
    """Each idiom under amp(bfloat16) with the span fused: values and gradients within the
    unfused program's distance from float32 (times a small margin), and the span really is
    one platform choice holding jax.nn.dot_product_attention's equations."""
    loss, leaves = _flat(CASES[name])
    ref_v, ref_g = _value_and_grad(loss, leaves)
    v, g = jax.jit(lambda *xs: _value_and_grad(loss, list(xs), compute_dtype=jnp.bfloat16))(*leaves)
    xla_v, xla_g = _value_and_grad(loss, leaves, compute_dtype=jnp.bfloat16, attention="xla")
    assert np.isfinite(float(v)) and all(bool(jnp.all(jnp.isfinite(x))) for x in g)
    err = max([_rel(v, ref_v)] + [_rel(a, b) for a, b in zip(g, ref_g)])
    unfused = max([_rel(xla_v, ref_v)] + [_rel(a, b) for a, b in zip(xla_g, ref_g)])
    assert err <= 3 * unfused + 2e-2, (err, unfused)
    closed = jax.make_jaxpr(autocast.amp(loss, compute_dtype=jnp.bfloat16))(*leaves)
    assert any(e.primitive.name == "platform_index" for e, _ in walk(closed)), "the span was not fused"


@pytest.mark.parametrize("case", LEFT_ALONE[:5], ids=lambda c: c.name)
def test_left_alone_spans_are_reported_and_not_fused(case, emit_on_cpu):
    loss, leaves = _flat(case)
    report = autocast.explain(loss, compute_dtype=jnp.bfloat16)(*leaves)
    kinds = [a["kernel"] for a in report.totals["attention"]]
    assert kinds and all(k == "left alone" for k in kinds), report.totals["attention"]
    assert case.reason in " ".join(a["attention"] for a in report.totals["attention"])
    closed = jax.make_jaxpr(autocast.amp(loss, compute_dtype=jnp.bfloat16))(*leaves)
    assert not any(e.primitive.name == "platform_index" for e, _ in walk(closed))


def _two_layers(q, k, v):
    def layer(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, jnp.finfo(s.dtype).min)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)

    with jax.named_scope("encoder"):
        h = layer(q, k, v)
    with jax.named_scope("decoder"):
        return jnp.sum(layer(h, k, v) ** 2)


def _qkv():
    r = np.random.default_rng(0)
    return [jnp.asarray(r.standard_normal((2, 8, 4, 8)), jnp.float32) for _ in range(3)]


def test_the_switch_and_the_policy_scope_turn_fusion_off(emit_on_cpu, tmp_path):
    qkv = _qkv()

    def fused(**kw):
        closed = jax.make_jaxpr(autocast.amp(_two_layers, compute_dtype=jnp.bfloat16, **kw))(*qkv)
        return sum(e.primitive.name == "platform_index" for e, _ in walk(closed))

    assert fused() == 2
    assert fused(attention="xla") == 0
    table = tmp_path / "no_decoder_fusion.toml"
    table.write_text('schema = 1\nextends = "default"\n\n[scopes]\n"decoder" = "xla_attention"\n')
    policy = autocast.load_policy(table)
    assert fused(amp_policy=policy) == 1
    report = autocast.explain(_two_layers, compute_dtype=jnp.bfloat16, amp_policy=policy)(*qkv)
    kernels = sorted(a["kernel"] for a in report.totals["attention"])
    assert kernels[0].startswith("as written: the policy (xla_attention)") and kernels[1].startswith("fused"), kernels
    # the scope's other equations keep their own rules: its matmuls still run in bfloat16
    assert not report.float32_matmuls
    v = autocast.amp(_two_layers, compute_dtype=jnp.bfloat16, amp_policy=policy)(*qkv)
    assert abs(float(v) - float(_two_layers(*qkv))) < 2e-2 * abs(float(_two_layers(*qkv)))


def test_the_fused_call_is_recomputed_as_remat_float32_says(emit_on_cpu):
    """remat_float32=True recomputes the fused call in the backward pass (one more forward
    kernel, none of its residuals kept); False and "auto" keep them (for sequences the kernel
    takes as they are)."""
    qkv = _qkv()

    def checkpointed(**kw):
        closed = jax.make_jaxpr(autocast.amp(_two_layers, compute_dtype=jnp.bfloat16, **kw))(*qkv)
        branches = [e for e, _ in walk(closed) if e.primitive.name == "cond"]
        return sum(
            any(kind(b) == "checkpoint" for b, _ in walk(e.params["branches"][0]))  # (either encoding)
            for e in branches
        )

    assert checkpointed(remat_float32=True) == 2
    assert checkpointed(remat_float32="auto") == 0 and checkpointed(remat_float32=False) == 0
    g = jax.grad(autocast.amp(_two_layers, compute_dtype=jnp.bfloat16, remat_float32=True))(*qkv)
    g_ref = jax.grad(_two_layers)(*qkv)
    assert _rel(g, g_ref) < 3e-2


def test_attention_option_is_checked():
    with pytest.raises(ValueError, match=r"attention='cudnn' is not allowed; use 'auto' or 'xla'"):
        autocast.amp(_two_layers, attention="cudnn")
    with pytest.raises(ValueError, match=r"attention="):
        autocast.explain(_two_layers, attention=None)
