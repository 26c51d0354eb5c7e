"""Attention on TPU (issue 48): the recogniser's matches get a TPU branch in the platform
choice, Pallas's splash attention (autocast/_attention/_splash.py), where it is the same
computation.

On this CPU machine the tests make splash the branch that runs (``_fuse.emitting("cpu",
"splash")``: Pallas's interpret mode) and compare amp's values and gradients with the span as
written (``attention="xla"``) and with float32, for the idioms the TPU kernel takes: GPT-2's
causal einsum/where/tril, ``jax.nn.dot_product_attention``'s XLA path with ``is_causal``, a
padding mask from key lengths and from a traced key mask (a batch with no key: fully masked
rows), a ViT's 197 tokens (padded to 256), grouped-query attention, a local window, a constant
per-head mask, Flax linen's and Equinox's attention layers; forward mode, a Hessian-vector
product and a Hessian through the kernel; ``explain``'s text; the near misses the kernel
refuses, left as written with the reason; the switch and the policy scope; the CPU program
unchanged by the TPU branch (by default, on every machine); and, in the TPU lane's virtualenv
(``.venv-tpu``, libtpu), a causal attention layer's amp train step compiled for a v5e holds
splash's Mosaic kernels and no float32 ``[T, S]`` buffer.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import require_libtpu, walk

import autocast
from autocast._attention import _fuse

BF16 = jnp.bfloat16


def _rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _qkv(b=1, t=128, n=2, h=64, s=None, kv=None, seed=0):
    s, kv = s or t, kv or n
    return _rand(b, t, n, h, seed=seed), _rand(b, s, kv, h, seed=seed + 1), _rand(b, s, kv, h, seed=seed + 2)


def _tril(t, s):
    return jnp.tril(jnp.ones((t, s), bool))


# --- the idioms -----------------------------------------------------------------------------


def gpt2_causal(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(_tril(q.shape[1], k.shape[1]), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def jaxnn_causal(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def jaxnn_lengths(q, k, v, q_lengths, kv_lengths):
    return jax.nn.dot_product_attention(
        q, k, v, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths, implementation="xla"
    )


def kv_lengths(q, k, v, lengths):  # BERT-style padding by lengths; a length 0 masks every row
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    keep = jnp.arange(k.shape[1])[None, :] < lengths[:, None]
    s = jnp.where(keep[:, None, None, :], s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def key_mask_bias(q, k, v, attention_mask):  # Hugging Face's padding bias from a traced [B, S] mask
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    bias = jax.lax.select(
        attention_mask[:, None, None, :] > 0,
        jnp.zeros(attention_mask.shape[:1] + (1, 1) + attention_mask.shape[1:], jnp.float32),
        jnp.full(attention_mask.shape[:1] + (1, 1) + attention_mask.shape[1:], jnp.finfo(jnp.float32).min),
    )
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s + bias, axis=-1), v)


def vit_tokens(q, k, v):  # no mask, 197 tokens
    p = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q * (q.shape[-1] ** -0.5), k), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p, v)


def gqa_causal(q, k, v):  # 4 query heads on 2 kv heads, repeated
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    return gpt2_causal(q, k, v)


WINDOW = 40


def local_window(q, k, v):
    rows, cols = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where((cols <= rows) & (rows - cols <= WINDOW), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def window_and_lengths(q, k, v, lengths):  # rows whose window holds no key below the length
    rows, cols = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    keep = (cols <= rows) & (rows - cols <= WINDOW) & (cols[None] < lengths[:, None, None])
    s = jnp.where(keep[:, None], s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def _per_head_mask(n, t):  # a prefix-LM mask per head: head i sees a prefix of 16 * (i + 1) keys
    rows, cols = np.indices((t, t))
    return np.stack([(cols <= rows) | (cols < 16 * (i + 1)) for i in range(n)])


def per_head_mask(q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(_per_head_mask(q.shape[2], q.shape[1])[None], s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def traced_bias(q, k, v, bias):
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1]) + bias
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def _flax_linen():
    import flax.linen as nn

    m = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=128, dropout_rate=0.0, deterministic=True)
    x = _rand(1, 128, 64, seed=3)
    params = m.init(jax.random.key(0), x)
    mask = nn.make_causal_mask(jnp.ones((1, 128)))
    return (lambda p, x: m.apply(p, x, mask=mask)), (params, x)


def _equinox():
    import equinox as eqx

    m = eqx.nn.MultiheadAttention(num_heads=2, query_size=128, key=jax.random.key(1))
    params, static = eqx.partition(m, eqx.is_array)
    mask = _tril(128, 128)

    def fn(params, x):
        mod = eqx.combine(params, static)
        return jax.vmap(lambda x: mod(x, x, x, mask=mask))(x)

    return fn, (params, _rand(1, 128, 128, seed=5))


CASES = {
    "gpt2_causal": lambda: (gpt2_causal, _qkv()),
    "jaxnn_causal_head_dim_128": lambda: (jaxnn_causal, _qkv(h=128)),
    "jaxnn_query_and_key_lengths": lambda: (
        jaxnn_lengths,
        (*_qkv(b=2), jnp.array([128, 60], jnp.int32), jnp.array([100, 0], jnp.int32)),
    ),
    "kv_lengths_with_an_empty_batch": lambda: (kv_lengths, (*_qkv(b=2), jnp.array([100, 0], jnp.int32))),
    "key_mask_bias": lambda: (key_mask_bias, (*_qkv(b=2), jnp.asarray(np.arange(128)[None] < [[90], [128]]))),
    "vit_197_tokens": lambda: (vit_tokens, _qkv(t=197)),
    "gqa_causal": lambda: (gqa_causal, _qkv(n=4, kv=2)),
    "local_window": lambda: (local_window, _qkv()),
    "window_and_lengths_with_empty_rows": lambda: (window_and_lengths, (*_qkv(b=2), jnp.array([50, 128], jnp.int32))),
    "per_head_mask": lambda: (per_head_mask, _qkv()),
    "flax_linen": _flax_linen,
    "equinox": _equinox,
}


def _problem(fn, args):
    """(loss, its floating leaves, its other leaves): the output squared and summed in float32;
    the loss takes the floating leaves, then the others (lengths, masks: traced too)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    leaves = [jnp.asarray(x) for x in leaves]
    floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]
    others = [i for i in range(len(leaves)) if i not in floats]

    def loss(*xs):
        full = [None] * len(leaves)
        for i, x in zip(floats + others, xs):
            full[i] = x
        out = fn(*jax.tree_util.tree_unflatten(tree, full))
        return sum(jnp.sum(jnp.asarray(o, jnp.float32) ** 2) for o in jax.tree_util.tree_leaves(out))

    return loss, [leaves[i] for i in floats], [leaves[i] for i in others]


def _rel(a, b) -> float:
    a, b = (
        jnp.concatenate([jnp.ravel(jnp.asarray(x, jnp.float32)) for x in jax.tree_util.tree_leaves(t)]) for t in (a, b)
    )
    return float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))


def _grad(loss, xs, rest, **amp_kwargs):
    """(value and gradients, the jaxpr they ran)."""
    fn = autocast.amp(loss, **amp_kwargs) if amp_kwargs else loss
    traced = jax.jit(jax.value_and_grad(fn, argnums=tuple(range(len(xs))))).trace(*xs, *rest)
    return traced.lower().compile()(*xs, *rest), traced.jaxpr


def _splash_calls(closed) -> int:
    """The splash kernels in a jaxpr (Pallas calls named splash_*), at any depth."""

    def name(e):
        return str(e.params.get("name") or e.params.get("name_and_src_info"))  # (JAX 0.12 | 0.9)

    return sum(e.primitive.name == "pallas_call" and "splash" in name(e) for e, _ in walk(closed))


@pytest.fixture
def splash_on_cpu():
    with _fuse.emitting("cpu", "splash"):
        yield


@pytest.mark.parametrize("name", sorted(CASES))
def test_splash_matches_the_span_as_written_and_float32(name, splash_on_cpu):
    """amp(bfloat16) with splash running the span: values and gradients within the unfused
    program's distance from float32 (times a small margin), and close to the unfused program
    itself; the jaxpr holds splash's kernel in the platform choice."""
    loss, xs, rest = _problem(*CASES[name]())
    ref, _ = _grad(loss, xs, rest)
    got, closed = _grad(loss, xs, rest, compute_dtype=BF16)
    xla, _ = _grad(loss, xs, rest, compute_dtype=BF16, attention="xla")
    assert _splash_calls(closed) >= 2, "the span was not fused with splash"  # (its forward and backward)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(got))
    err, unfused = _rel(got, ref), _rel(xla, ref)
    assert err <= 3 * unfused + 2e-2, (err, unfused)
    assert _rel(got, xla) <= 3 * unfused + 2e-2, (_rel(got, xla), unfused)


def test_fully_masked_rows_are_the_mean_of_the_values_or_nan(splash_on_cpu):
    """A batch whose length is 0: every row of it is the mean of the values, as in the
    original (its softmax is uniform over equal fills) and in the cuDNN branch; NaN where the
    fill is -inf, as in the original. The other batch's rows are the original's."""
    q, k, v = _qkv(b=2)
    lengths = jnp.array([100, 0], jnp.int32)
    out = autocast.amp(kv_lengths, compute_dtype=BF16)(q, k, v, lengths)
    want = jnp.broadcast_to(jnp.mean(v[1].astype(BF16).astype(jnp.float32), axis=0), out[1].shape)
    np.testing.assert_allclose(np.asarray(out[1], np.float32), np.asarray(want), atol=1e-2)
    np.testing.assert_allclose(np.asarray(out[0], np.float32), np.asarray(kv_lengths(q, k, v, lengths)[0]), atol=5e-2)

    def neg_inf(q, k, v, lengths):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
        s = jnp.where((jnp.arange(k.shape[1])[None, :] < lengths[:, None])[:, None, None, :], s, -jnp.inf)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)

    closed = jax.make_jaxpr(autocast.amp(neg_inf, compute_dtype=BF16))(q, k, v, lengths)
    assert _splash_calls(closed) >= 1
    out = autocast.amp(neg_inf, compute_dtype=BF16)(q, k, v, lengths)
    assert bool(jnp.all(jnp.isnan(out[1]))) and bool(jnp.all(jnp.isfinite(out[0])))


# --- every transformation ---------------------------------------------------------------------


def test_forward_mode_hvp_and_hessian_through_the_tpu_branch(splash_on_cpu):
    """jvp, a Hessian-vector product and a Hessian (of a scalar scale on q) through the
    splash branch: XLA's attention in float32 takes those derivatives, within bfloat16
    rounding of the unfused program's."""
    q, k, v = _qkv()
    t = _qkv(seed=7)

    def loss(q, k, v):
        return jnp.sum(gpt2_causal(q, k, v) ** 2)

    def run(**kw):
        f = autocast.amp(loss, compute_dtype=BF16, **kw)
        jvp = jax.jvp(f, (q, k, v), t)[1]
        hvp = jax.jvp(jax.grad(f, argnums=(0, 1, 2)), (q, k, v), t)[1]
        hess = jax.hessian(lambda a: f(a * q, k, v))(jnp.float32(1.0))
        return jvp, hvp, hess

    assert _splash_calls(jax.make_jaxpr(autocast.amp(loss, compute_dtype=BF16))(q, k, v)) >= 1
    got, xla = jax.jit(run)(), jax.jit(lambda: run(attention="xla"))()
    ref = (jax.jvp(loss, (q, k, v), t)[1], None, jax.hessian(lambda a: loss(a * q, k, v))(jnp.float32(1.0)))
    for i in (0, 2):
        assert _rel(got[i], ref[i]) <= 3 * _rel(xla[i], ref[i]) + 2e-2, i
    assert _rel(got[1], xla[1]) <= 3e-2, _rel(got[1], xla[1])


# --- explain, near misses, switches -----------------------------------------------------------


def _kernels(fn, *args, **kw):
    return [a["kernel"] for a in autocast.explain(fn, compute_dtype=BF16, **kw)(*args).totals["attention"]]


@pytest.fixture
def tpu_compiler(monkeypatch):
    """A machine that can compile for a TPU (libtpu installed, or a TPU backend)."""
    from autocast import _compat

    monkeypatch.setattr(_compat, "tpu_compiler", lambda: True)


def test_no_tpu_branch_without_a_tpu_compiler(monkeypatch):
    """Neither a TPU backend nor libtpu: no TPU branch (it would only cost its trace), the
    program as before the TPU branch existed, and explain says why."""
    from autocast import _compat

    monkeypatch.setattr(_compat, "tpu_compiler", lambda: False)
    args = _qkv()
    (kernel,) = _kernels(gpt2_causal, *args)
    assert "splash: no TPU compiler here" in kernel, kernel
    closed = jax.make_jaxpr(autocast.amp(gpt2_causal, compute_dtype=BF16))(*args)
    assert not any(e.primitive.name in ("platform_index", "pallas_call") for e, _ in walk(closed))
    written = jax.make_jaxpr(autocast.amp(gpt2_causal, compute_dtype=BF16, attention="xla"))(*args)
    addresses = re.compile(r"0x[0-9a-f]+")  # (a checkpoint policy's function, printed by JAX 0.9)
    assert addresses.sub("0x", str(closed)) == addresses.sub("0x", str(written))


def test_explain_says_which_kernel_runs_where(tpu_compiler):
    q, k, v = _qkv()
    (kernel,) = _kernels(gpt2_causal, q, k, v)
    assert kernel.startswith("fused: splash (make_splash_mha) on tpu, else as written"), kernel
    (kernel,) = _kernels(vit_tokens, *_qkv(t=197))
    assert "splash (make_splash_mha, sequences padded to a multiple of 128) on tpu" in kernel, kernel
    (kernel,) = _kernels(gqa_causal, *_qkv(n=4, kv=2))
    assert "splash (make_splash_mqa per kv head) on tpu" in kernel, kernel


NEAR_MISSES = {
    "traced_bias": (traced_bias, lambda: (*_qkv(), _rand(1, 2, 128, 128, seed=9)), "splash: a traced bias"),
    "short_sequences": (gpt2_causal, lambda: _qkv(t=16), "shorter than the kernel's block of 128"),
    "float16": (gpt2_causal, _qkv, "float16 operands"),
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_near_misses_stay_as_written_with_the_reason(name, splash_on_cpu):
    fn, make, reason = NEAR_MISSES[name]
    args = make()
    dtype = jnp.float16 if name == "float16" else BF16
    kernels = [a["kernel"] for a in autocast.explain(fn, compute_dtype=dtype)(*args).totals["attention"]]
    assert len(kernels) == 1 and kernels[0].startswith("as written: no fused kernel here (") and reason in kernels[0]
    closed = jax.make_jaxpr(autocast.amp(fn, compute_dtype=dtype))(*args)
    assert not any(e.primitive.name == "platform_index" for e, _ in walk(closed))


def test_a_traced_mask_over_the_queries_is_refused(tpu_compiler):
    """A traced mask that varies along the queries is no segment id: tpu_plan says so."""

    def fn(q, k, v, m):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / 8.0
        s = jnp.where(m[:, None], s, jnp.finfo(s.dtype).min)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)

    m = jnp.asarray(np.random.default_rng(1).random((1, 128, 128)) < 0.8) | jnp.eye(128, dtype=bool)
    (kernel,) = _kernels(fn, *_qkv(), m)
    assert "splash: a traced mask that varies along the queries or heads" in kernel, kernel


def test_the_switch_and_the_policy_turn_the_tpu_branch_off(tmp_path, tpu_compiler):
    q, k, v = _qkv()

    def model(q, k, v):
        with jax.named_scope("encoder"):
            h = gpt2_causal(q, k, v)
        with jax.named_scope("decoder"):
            return gpt2_causal(h, k, v)

    def fused(**kw):
        return _splash_calls(jax.make_jaxpr(autocast.amp(model, compute_dtype=BF16, **kw))(q, k, v))

    assert fused() == 2
    assert fused(attention="xla") == 0
    table = tmp_path / "policy.toml"
    table.write_text('schema = 1\nextends = "default"\n\n[scopes]\n"decoder" = "xla_attention"\n')
    assert fused(amp_policy=autocast.load_policy(table)) == 1


def test_several_tpus_outside_shard_map_keep_the_span_as_written(monkeypatch):
    """XLA cannot partition a Mosaic kernel: where a program may run on several TPUs (the
    default backend a TPU with more than one device) splash is refused, with the reason, unless
    amp traces inside a shard_map manual over every mesh axis."""
    from jax.sharding import PartitionSpec

    from autocast import _compat

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    n = jax.device_count()
    assert _compat.partitioned_tpus() == n
    mesh = jax.make_mesh((n,), ("x",))
    seen = []

    def body(x):
        seen.append(_compat.partitioned_tpus())
        return x

    shard_map = jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec())
    jax.jit(shard_map).trace(jnp.ones((n,)))
    assert seen == [1]
    if n > 1:  # (the suite's eight simulated devices, tests/conftest.py)
        (kernel,) = _kernels(gpt2_causal, *_qkv())
        assert f"splash: {n} TPU devices outside shard_map" in kernel, kernel


# --- the CPU program ------------------------------------------------------------------------


def _compiled(fn, *args) -> str:
    text = jax.jit(fn).lower(*args).compile().as_text().split("\nFileNames")[0]
    return re.sub(r"(, metadata=\{[^}]*\})|(stack_frame_id=\d+)", "", text)


@pytest.mark.parametrize("name", ["gpt2_causal", "key_mask_bias"])
def test_the_cpu_program_is_unchanged_by_the_tpu_branch(name, tpu_compiler):
    """By default (cuDNN on CUDA, splash on TPU) the span is a platform choice on a machine
    that can compile for a TPU (a CPU one with libtpu: deviceless compiles); lowered for the CPU, only its default branch is: the compiled program is the one
    attention="xla" gives, and no Mosaic kernel reaches the CPU's StableHLO."""
    loss, xs, rest = _problem(*CASES[name]())
    auto = jax.make_jaxpr(autocast.amp(loss, compute_dtype=BF16))(*xs, *rest)
    assert _splash_calls(auto) >= 1
    grad = jax.grad(autocast.amp(loss, compute_dtype=BF16), argnums=tuple(range(len(xs))))
    grad_xla = jax.grad(autocast.amp(loss, compute_dtype=BF16, attention="xla"), argnums=tuple(range(len(xs))))
    assert "tpu_custom_call" not in jax.jit(grad).lower(*xs, *rest).as_text()
    assert _compiled(grad, *xs, *rest) == _compiled(grad_xla, *xs, *rest)


# --- the v5e program (the TPU lane's virtualenv) ----------------------------------------------


def v5e_attention_step(batch=4, tokens=1024, heads=12, head_dim=64, **amp_kwargs):
    """A causal attention layer's amp(bfloat16) train step (the q/k/v and output projections,
    SGD) compiled for a one-chip v5e with no TPU present: (compiled, HLO text)."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    topo = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu")
    sharding = NamedSharding(topologies.make_mesh(topo, (1,), ("x",)), PartitionSpec())
    width = heads * head_dim

    def layer(p, x):
        q, k, v = (jnp.reshape(x @ p[n], (batch, tokens, heads, head_dim)) for n in ("q", "k", "v"))
        return jnp.reshape(gpt2_causal(q, k, v), (batch, tokens, width)) @ p["o"]

    def step(p, x):
        loss = lambda p: jnp.mean(autocast.amp(layer, compute_dtype=BF16, **amp_kwargs)(p, x).astype(jnp.float32) ** 2)
        g = jax.grad(loss)(p)
        return jax.tree_util.tree_map(lambda a, b: a - 1e-3 * b, p, g)

    w = jax.ShapeDtypeStruct((width, width), jnp.float32, sharding=sharding)
    x = jax.ShapeDtypeStruct((batch, tokens, width), jnp.float32, sharding=sharding)
    compiled = jax.jit(step, donate_argnums=0).lower({n: w for n in "qkvo"}, x).compile()
    return compiled, compiled.as_text()


def _cost(compiled) -> tuple[int, float]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # (a list of one on older JAX)
    return compiled.memory_analysis().peak_memory_in_bytes, float(cost["bytes accessed"])


def test_v5e_attention_step_runs_splash_and_holds_no_float32_scores():
    """The step holds splash's forward and backward kernels, no float32 [T, S] buffer, and less
    peak memory and fewer bytes accessed than the same step with the attention as written."""
    require_libtpu()
    batch, tokens, heads = 4, 1024, 12
    compiled, hlo = v5e_attention_step(batch, tokens, heads)
    kernels = re.findall(r"splash_mha_(fwd|dq|dkv)\w*", hlo)
    assert hlo.count('custom_call_target="tpu_custom_call"') >= 3, sorted(set(kernels))
    assert {"fwd", "dq", "dkv"} <= set(kernels), sorted(set(kernels))
    scores = re.compile(rf"f32\[[^\]]*\b{tokens},{tokens}\]")  # a float32 buffer with [T, S] minor axes
    assert not scores.search(hlo), scores.search(hlo).group(0)
    written, written_hlo = v5e_attention_step(batch, tokens, heads, attention="xla")
    assert scores.search(written_hlo), "the step as written holds float32 scores"
    (peak, accessed), (peak_written, accessed_written) = _cost(compiled), _cost(written)
    assert peak < peak_written and accessed < 0.5 * accessed_written, (peak, peak_written, accessed, accessed_written)
