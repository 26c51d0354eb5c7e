"""bfloat16 parameters and optimizer state with stochastic rounding: half_state, to_half_params,
optimizer_update(..., key=), with Equinox, Flax linen/NNX, amp, the loss scalers, fp8 and sharding."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import fp8_every_matmul
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autocast
from autocast import (
    HalfOptState,
    half_state,
    optimizer_update,
    to_float32_opt_state,
    to_float32_params,
    to_half_opt_state,
    to_half_params,
)

BF16 = jnp.bfloat16


def _bits(tree):
    return [(str(x.dtype), np.asarray(jax.random.key_data(x) if _is_key(x) else x).tobytes()) for x in _arrays(tree)]


def _is_key(x):
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _arrays(tree):
    return [x for x in jax.tree.leaves(tree) if eqx.is_array(x)]


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": jax.random.normal(k1, (16, 8)), "b": jax.random.normal(k2, (8,))}


def test_half_state_stores_moments_in_bfloat16_and_keeps_integers_and_scalars():
    optim = half_state(optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(1e-3)))
    state = optim.init(_params())
    assert isinstance(state, HalfOptState) and _is_key(state.key)
    adam = state.inner[1].inner_state[0]
    assert {adam.mu["w"].dtype, adam.nu["w"].dtype, adam.mu["b"].dtype} == {jnp.dtype(BF16)}
    assert adam.count.dtype == jnp.int32
    assert state.inner[1].hyperparams["learning_rate"].dtype == jnp.float32  # a scalar: kept
    grads = jax.tree.map(jnp.ones_like, _params())
    updates, new_state = jax.jit(optim.update)(grads, state, _params())
    assert jax.tree.map(lambda x: x.dtype, new_state) == jax.tree.map(lambda x: x.dtype, state)
    assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(updates))
    assert int(new_state.inner[1].inner_state[0].count) == 1
    assert _bits(new_state.key) != _bits(state.key)  # split on every update


def test_half_state_is_pure_and_reproducible():
    optim = half_state(optax.adam(1e-2), key=jax.random.key(7))
    params = _params()
    grads = jax.tree.map(lambda x: 0.1 * x, params)
    a = optim.update(grads, optim.init(params), params)
    b = optim.update(grads, optim.init(params), params)
    assert _bits(a) == _bits(b)


def _one_step_reference(params32, grads32, opt32, optim):
    updates, new_state = optim.update(grads32, opt32, params32)
    return optax.apply_updates(params32, updates), new_state


def test_bf16_sr_step_matches_float32_in_expectation():
    """One AdamW step on bfloat16 parameters and moments, averaged over many keys, equals the
    float32 step from the same (representable) starting point."""
    inner = optax.adamw(3e-2, weight_decay=0.1)
    optim = half_state(inner)
    params = to_half_params(_params())
    grads = jax.tree.map(lambda x: (0.3 * x + 0.01).astype(BF16), params)
    state = optim.init(params)
    # a step in, so the moments are non-trivial and not representable in bfloat16
    params, state = optimizer_update(params, optim, state, grads, jnp.array(True), key=jax.random.key(1))

    ref_params, ref_state = _one_step_reference(
        to_float32_params(params), to_float32_params(grads), to_float32_opt_state(state), inner
    )

    n = 4000

    def sample(k):
        s = eqx.tree_at(lambda s: s.key, state, k)
        return optimizer_update(params, optim, s, grads, jnp.array(True), key=jax.random.fold_in(k, 1))

    keys = jax.random.split(jax.random.key(2), n)
    new_params, new_state = jax.jit(jax.vmap(sample))(keys)
    for got, want in [
        (new_params, ref_params),
        (new_state.inner[0].mu, ref_state[0].mu),
        (new_state.inner[0].nu, ref_state[0].nu),
    ]:
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            g = np.asarray(g, np.float64)
            w = np.asarray(w, np.float64)
            spacing = np.abs(w) * 2.0**-7 + 1e-30  # bfloat16's spacing is at most 2**-7 relative
            # the mean of n draws is within 6 standard deviations (<= spacing / 2 / sqrt(n)) of the float32 value
            assert np.all(np.abs(g.mean(0) - w) <= 6 * spacing / 2 / np.sqrt(n)), np.max(
                np.abs(g.mean(0) - w) / spacing
            )
            assert np.any(g.std(0) > 0)  # really stochastic


def test_non_finite_step_with_a_key_is_bit_identical():
    optim = half_state(optax.adam(1e-2))
    params = to_half_params(_params())
    state = optim.init(params)
    grads = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), params)
    new_params, new_state = eqx.filter_jit(optimizer_update)(
        params, optim, state, grads, jnp.array(False), key=jax.random.key(1)
    )
    assert _bits(new_params) == _bits(params) and _bits(new_state) == _bits(state)


def test_float32_leaves_with_a_key_are_updated_as_without():
    optim = optax.adamw(1e-2)
    params = _params()
    state = optim.init(params)
    grads = jax.tree.map(lambda x: 0.1 * x, params)
    with_key = eqx.filter_jit(optimizer_update)(params, optim, state, grads, jnp.array(True), key=jax.random.key(3))
    without = eqx.filter_jit(optimizer_update)(params, optim, state, grads, jnp.array(True))
    assert _bits(with_key) == _bits(without)


def test_conversions_between_modes():
    params = _params()
    half = to_half_params(params)
    assert all(x.dtype == BF16 for x in jax.tree.leaves(half))
    assert to_half_params({"n": jnp.int32(3)})["n"].dtype == jnp.int32
    np.testing.assert_array_equal(to_float32_params(half)["w"], params["w"].astype(BF16).astype(jnp.float32))
    inner = optax.adamw(1e-3)
    opt32 = inner.update(params, inner.init(params), params)[1]
    h = to_half_opt_state(opt32, jax.random.key(0))
    assert isinstance(h, HalfOptState) and h.inner[0].nu["w"].dtype == BF16 and h.inner[0].count.dtype == jnp.int32
    # the converted state is what half_state(inner) expects
    optim = half_state(inner)
    assert jax.tree.structure(h) == jax.tree.structure(optim.init(params))
    back = to_float32_opt_state(h)
    assert jax.tree.structure(back) == jax.tree.structure(opt32)
    np.testing.assert_array_equal(back[0].mu["w"], opt32[0].mu["w"].astype(BF16).astype(jnp.float32))


def test_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match="half_state: `inner` must be an optax.GradientTransformation"):
        half_state("adam")
    with pytest.raises(ValueError, match="half_state: `dtype` must be jnp.bfloat16 or jnp.float16"):
        half_state(optax.adam(1e-3), jnp.float32)
    with pytest.raises(TypeError, match="half_state: `key` must be a PRNG key"):
        half_state(optax.adam(1e-3), key=3)
    with pytest.raises(TypeError, match="`state` must be the HalfOptState"):
        half_state(optax.adam(1e-3)).update(_params(), optax.adam(1e-3).init(_params()), _params())
    with pytest.raises(TypeError, match="optimizer_update: `key` must be a PRNG key"):
        optimizer_update(_params(), optax.sgd(0.1), optax.sgd(0.1).init(_params()), _params(), jnp.array(True), key=1)
    with pytest.raises(ValueError, match="to_half_params: `dtype`"):
        to_half_params(_params(), jnp.int8)
    with pytest.raises(TypeError, match="to_float32_opt_state: `opt_state` must be a HalfOptState"):
        to_float32_opt_state(optax.adam(1e-3).init(_params()))
    with pytest.raises(TypeError, match="already a HalfOptState"):
        to_half_opt_state(half_state(optax.adam(1e-3)).init(_params()), jax.random.key(0))


# ---------------------------------------------------------------- with models, amp, scalers


def _data():
    x = jax.random.normal(jax.random.key(10), (64, 4))
    y = jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1)
    return x, y


def _train(model, loss, steps=20, compute_dtype=BF16, scaler=None, policy=None, lr=3e-2):
    """Train `model` (bf16 params) with amp, half_state(adamw) and SR; returns (model, losses, scaler)."""
    x, y = _data()
    optim = half_state(optax.adamw(lr))
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    scaler = autocast.NoOpScalerState() if scaler is None else scaler
    grad_fn = autocast.dynamic_scale_value_and_grad(autocast.amp(loss, compute_dtype=compute_dtype, amp_policy=policy))

    @eqx.filter_jit
    def step(model, opt_state, scaler, key):
        scaler, (value, grads) = grad_fn(model, x, y, dynamic_scaler_state=scaler)
        model, opt_state = optimizer_update(model, optim, opt_state, grads, scaler.grads_finite, key=key)
        return model, opt_state, scaler, value

    losses = []
    for i in range(steps):
        model, opt_state, scaler, value = step(model, opt_state, scaler, jax.random.fold_in(jax.random.key(5), i))
        losses.append(float(value))
    return model, losses, scaler


def _mlp_loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def test_equinox_mlp_trains_in_bfloat16_with_amp():
    model = to_half_params(eqx.nn.MLP(4, 2, 32, 2, key=jax.random.key(0)))
    trained, losses, _ = _train(model, _mlp_loss)
    assert trained.layers[0].weight.dtype == BF16 and trained.activation is model.activation
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0]


def test_float16_compute_with_the_dynamic_scaler_and_bfloat16_params():
    model = to_half_params(eqx.nn.MLP(4, 2, 32, 2, key=jax.random.key(0)))
    scaler = autocast.DynamicScalerState(patience=5, scaler=2.0**10)
    trained, losses, scaler = _train(model, _mlp_loss, compute_dtype=jnp.float16, scaler=scaler)
    assert losses[-1] < 0.5 * losses[0] and float(scaler.scaler) > 2.0**10


def test_fp8_policy_with_bfloat16_params():
    model = to_half_params(eqx.nn.MLP(4, 2, 32, 2, key=jax.random.key(0)))
    # the width-32 MLP's matmuls are too small for float8 to pay on a GPU: the cost check off
    _, losses, _ = _train(model, _mlp_loss, policy=fp8_every_matmul())
    assert np.isfinite(losses).all() and losses[-1] < 0.7 * losses[0]


def test_flax_linen_params():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.gelu(nn.Dense(32)(x)))

    net = Net()
    x, _ = _data()
    params = to_half_params(net.init(jax.random.key(0), x[:1]))
    assert all(p.dtype == BF16 for p in jax.tree.leaves(params))
    trained, losses, _ = _train(params, lambda p, x, y: jnp.mean((net.apply(p, x) - y) ** 2))
    assert all(p.dtype == BF16 for p in jax.tree.leaves(trained))
    assert losses[-1] < 0.5 * losses[0]


def test_flax_nnx_state():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Sequential(nnx.Linear(4, 32, rngs=nnx.Rngs(0)), nnx.gelu, nnx.Linear(32, 2, rngs=nnx.Rngs(1)))
    graphdef, state = nnx.split(model)
    state = to_half_params(state)
    trained, losses, _ = _train(state, lambda s, x, y: jnp.mean((nnx.merge(graphdef, s)(x) - y) ** 2))
    assert all(p.dtype == BF16 for p in jax.tree.leaves(trained))
    assert losses[-1] < 0.5 * losses[0]
    merged = nnx.merge(graphdef, trained)
    assert merged.layers[0].kernel.value.dtype == BF16


def test_sharded_parameters_round_per_shard_reproducibly():
    """Parameters sharded over 4 devices get the same bits as on one device."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("m",))
    params = to_half_params({"w": jax.random.normal(jax.random.key(0), (32, 16)), "b": jnp.zeros(16)})
    optim = half_state(optax.adamw(1e-2))
    grads = jax.tree.map(lambda p: (0.01 * p + 1e-3).astype(BF16), params)
    shard = {"w": NamedSharding(mesh, P("m", None)), "b": NamedSharding(mesh, P())}

    def run(params, grads):
        state = optim.init(params)
        for i in range(2):
            params, state = optimizer_update(params, optim, state, grads, jnp.array(True), key=jax.random.key(i))
        return params, state

    single = jax.jit(run)(params, grads)
    sharded = jax.jit(run)(jax.device_put(params, shard), jax.device_put(grads, shard))
    assert sharded[0]["w"].sharding.is_equivalent_to(shard["w"], 2)
    assert _bits(single) == _bits(sharded)
