"""The scaler on 8 simulated CPU devices: global finite check, axis_name agreement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autocast import DynamicScalerState, all_finite, dynamic_scale_grad

N = 8


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) >= N, "tests/conftest.py should provide 8 CPU devices"
    return Mesh(np.array(jax.devices()[:N]), ("d",))


def _loss(w, x):
    return jnp.mean(jnp.sum(w * x, axis=-1) ** 2)


def _batch(bad_device=None, value=jnp.inf):
    x = jnp.ones((N * 2, 3)) * jnp.arange(1.0, 4.0)
    if bad_device is not None:
        x = x.at[2 * bad_device, 1].set(value)  # a row held by that device
    return x


def _per_device(state):
    """Inside shard_map: each device's copy of the state values, stacked."""
    return jax.tree.map(lambda v: v[None], (state.scaler, state.count, state.grads_finite))


# ---------------------------------------------------------------- jit + sharding


@pytest.mark.parametrize("bad_device", [None, 5])
def test_jit_with_sharded_batch_checks_globally(mesh, bad_device):
    x = jax.device_put(_batch(bad_device), NamedSharding(mesh, P("d")))
    w = jax.device_put(jnp.array([0.5, -1.0, 2.0]), NamedSharding(mesh, P()))
    state = jax.device_put(DynamicScalerState(scaler=2.0**10), NamedSharding(mesh, P()))

    step = jax.jit(dynamic_scale_grad(_loss))
    new_state, grads = step(w, x, dynamic_scaler_state=state)
    ref_state, ref_grads = step(
        jnp.array([0.5, -1.0, 2.0]), _batch(bad_device), dynamic_scaler_state=DynamicScalerState(scaler=2.0**10)
    )

    assert bool(new_state.grads_finite) is (bad_device is None)
    assert float(new_state.scaler) == float(ref_state.scaler)
    assert float(new_state.scaler) == (2.0**10 if bad_device is None else 2.0**9)
    assert new_state.scaler.sharding.is_fully_replicated
    if bad_device is None:
        np.testing.assert_allclose(grads, ref_grads, rtol=1e-6)
        np.testing.assert_allclose(grads, jax.jit(jax.grad(_loss))(w, x), rtol=1e-6)


# ---------------------------------------------------------------- shard_map / pmap


def _tile(w):
    """Per-device copies of the parameters, as in classic data parallelism (pmap).

    (Parameters passed with `P()` are device-invariant: JAX then sums their gradients
    over the mesh itself, so the finite check would be global even without
    axis_name.)
    """
    return jnp.tile(w[None], (N, 1))


def _shard_map_step(mesh, axis_name, redo_on_nan=0, loss=_loss):
    grad_fn = dynamic_scale_grad(loss, axis_name=axis_name, redo_on_nan=redo_on_nan)

    def local(w, x, state):
        state, grads = grad_fn(w[0], x, dynamic_scaler_state=state)
        return _per_device(state), jax.lax.pmean(grads, "d")

    in_specs = (P("d"), P("d"), P())
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(P("d"), P())))


def test_shard_map_axis_name_makes_devices_agree(mesh):
    step = _shard_map_step(mesh, "d")
    (scales, counts, finite), _ = step(_tile(jnp.ones(3)), _batch(5), DynamicScalerState(scaler=2.0**10))
    np.testing.assert_array_equal(finite, [False] * N)
    np.testing.assert_array_equal(scales, [2.0**9] * N)
    np.testing.assert_array_equal(counts, [0] * N)


def test_shard_map_without_axis_name_diverges(mesh):
    # What jmp/MPX/jaxamp do: each device checks only its own shard (anchors C-6).
    step = _shard_map_step(mesh, None)
    (scales, _, finite), _ = step(_tile(jnp.ones(3)), _batch(5), DynamicScalerState(scaler=2.0**10))
    assert list(np.asarray(finite)) == [d != 5 for d in range(N)]
    assert float(scales[5]) == 2.0**9 and float(scales[0]) == 2.0**10


def test_shard_map_returns_a_replicated_state(mesh):
    # With axis_name the new state is provably device-invariant: shard_map accepts
    # it with out_specs=P() under its replication (vma) check.
    grad_fn = dynamic_scale_grad(_loss, axis_name="d")

    def local(w, x, state):
        return grad_fn(w[0], x, dynamic_scaler_state=state)[0]

    in_specs = (P("d"), P("d"), P())
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P()))
    state = step(_tile(jnp.ones(3)), _batch(2), DynamicScalerState(scaler=2.0**10, total_resets=3))
    assert float(state.scaler) == 2.0**9 and int(state.total_resets) == 4


def _f16_overflow_on_device_3(w, x):
    # Only device 3's shard has the large factor 2**10 (see test below): its float16
    # cotangent scale * 2**10 overflows for scales >= 2**6.
    prod = w.astype(jnp.float16) * x.astype(jnp.float16)
    return jnp.sum(prod.astype(jnp.float32))


def test_redo_on_nan_iterates_in_lockstep(mesh):
    step = _shard_map_step(mesh, "d", redo_on_nan=10, loss=_f16_overflow_on_device_3)
    x = jnp.ones((N, 2)).at[3].set(2.0**10)
    (scales, counts, finite), grads = step(_tile(jnp.ones(2)), x, DynamicScalerState(scaler=2.0**9))
    # 2**9, 2**8, 2**7, 2**6 overflow on device 3; all devices back off together.
    np.testing.assert_array_equal(finite, [True] * N)
    np.testing.assert_array_equal(scales, [2.0**5] * N)
    np.testing.assert_array_equal(counts, [1] * N)
    np.testing.assert_array_equal(grads, np.full(2, (7 + 2.0**10) / N, np.float32))


def test_pmap_axis_name(mesh):
    grad_fn = dynamic_scale_grad(_loss, axis_name="i")
    step = jax.pmap(
        lambda w, x, s: grad_fn(w, x, dynamic_scaler_state=s)[0],
        axis_name="i",
        in_axes=(None, 0, None),
    )
    x = _batch(6).reshape(N, 2, 3)
    state = step(jnp.ones(3), x, DynamicScalerState(scaler=2.0**10))
    np.testing.assert_array_equal(state.scaler, [2.0**9] * N)
    np.testing.assert_array_equal(state.grads_finite, [False] * N)
    np.testing.assert_array_equal(state.total_resets, [1] * N)


def test_all_finite_axis_name(mesh):
    def local(x):
        return all_finite(x)[None], all_finite(x, axis_name="d")[None]

    check = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    x = jnp.ones(N).at[4].set(jnp.nan)
    per_shard, agreed = check(x)
    assert list(np.asarray(per_shard)) == [d != 4 for d in range(N)]
    assert not np.asarray(agreed).any()
