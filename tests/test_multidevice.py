"""``amp`` on 8 (simulated CPU) devices: data parallelism gives the one-device result.

A small classifier (two matmuls, GELU, a LayerNorm-style normalisation, softmax
cross-entropy) is trained for a few SGD steps:

- on one device, under ``jax.jit``;
- data parallel under ``jax.jit`` with ``NamedSharding``: batch sharded over the 8
  devices, parameters replicated (``Auto`` mesh axes, and ``Explicit`` ones:
  sharding in types);
- data parallel with ``jax.shard_map``, with ``amp`` inside the per-device body (gradients
  averaged with ``lax.pmean``), and with ``amp`` around a loss that itself uses
  ``shard_map``.

With ``amp`` inside, the data-parallel runs must match the one-device run (under ``jit``
within float32 noise: weight gradients are all-reduced in float32; with ``shard_map`` also
the half-precision rounding of each device's own activation cotangents), keep every matmul in half precision, and keep
the parameters replicated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import compute_op_dtypes, tree_max_rel_err, walk
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autocast

N_DEV = 8
BATCH, D_IN, HIDDEN, N_CLASSES = 32, 16, 32, 4  # 4 examples per device
STEPS = 3

# Data-parallel vs one-device, both with amp. Under ``jit`` the weight gradients leave their
# matmuls in float32 and are all-reduced in float32, so the only difference is the order of
# float32 sums. Measured (max over dtypes): loss 9.6e-8, grads 1.1e-7, params 1.0e-7.
# (Before the weight cotangents were float32, per-device partial products were rounded to
# half before the all-reduce: grads 1.4e-3 in float16.)
JIT_DP_TOL = dict(loss=1e-6, grad=1e-5, params=1e-5)
# With shard_map each device differentiates its own 4-row mean, so its half-precision
# activation cotangents are 8 times those of the 32-row mean: rounded differently (and
# nearer the float16 subnormal range without a loss scale), as much as amp differs from
# float32. Measured (max over the shard_map variants), float16: loss 1.1e-4, grads 6.5e-4,
# params 6.9e-4; bfloat16: loss 1.4e-3, grads 5.2e-3, params 3.7e-3.
DP_TOL = {"float16": dict(loss=5e-4, grad=5e-3, params=3e-3), "bfloat16": dict(loss=3e-3, grad=2e-2, params=1e-2)}
# float32 data parallel vs float32 one device: summation order only.
F32_TOL = dict(loss=1e-6, grad=1e-5, params=1e-6)
# amp vs float32 (to show the runs are not trivially equal because amp did nothing).
AMP_VS_F32_MIN_GRAD_DIFF = 1e-6

DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) == N_DEV, "tests/conftest.py should give 8 CPU devices"
    return Mesh(np.array(jax.devices()), ("data",))


def _init():
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    params = {
        "w1": normal(D_IN, HIDDEN) / np.float32(np.sqrt(D_IN)),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": normal(HIDDEN, N_CLASSES) / np.float32(np.sqrt(HIDDEN)),
        "b2": np.zeros(N_CLASSES, np.float32),
    }
    x = normal(BATCH, D_IN)
    y = rng.integers(0, N_CLASSES, (BATCH,), dtype=np.int32)
    return jax.tree_util.tree_map(jnp.asarray, (params, x, y))


def loss_fn(params, x, y):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
    logits = h @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


OPT = optax.sgd(0.5)


def _apply(params, opt_state, grads):
    updates, opt_state = OPT.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state


def _maybe_amp(fn, dtype_name):
    return fn if dtype_name == "float32" else autocast.amp(fn, compute_dtype=DTYPES[dtype_name])


def jit_step(dtype_name):
    """One training step; the same function runs on one device and data parallel."""
    value_and_grad = jax.value_and_grad(_maybe_amp(loss_fn, dtype_name))

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = value_and_grad(params, x, y)
        params, opt_state = _apply(params, opt_state, grads)
        return params, opt_state, loss, grads

    return step


def shard_map_step(mesh, dtype_name, amp_inside=True):
    """Data parallel with shard_map: per-device gradients, then ``pmean`` over devices."""
    if amp_inside:

        def local(params, x, y):
            # per-device gradients: make the replicated parameters device-varying first
            # (the gradient of an invariant value would already be summed over devices)
            params = jax.lax.pcast(params, "data", to="varying")
            loss, grads = jax.value_and_grad(_maybe_amp(loss_fn, dtype_name))(params, x, y)
            return jax.lax.pmean((loss, grads), "data")

        grads_fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())
    else:
        # amp around a loss that is itself a shard_map (with a cross-device mean inside)
        def global_loss(params, x, y):
            local = lambda p, x, y: jax.lax.pmean(loss_fn(p, x, y), "data")
            return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())(params, x, y)

        grads_fn = jax.value_and_grad(_maybe_amp(global_loss, dtype_name))

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = grads_fn(params, x, y)
        params, opt_state = _apply(params, opt_state, grads)
        return params, opt_state, loss, grads

    return step


def train(step, params, x, y):
    opt_state = OPT.init(params)
    losses, grads0 = [], None
    for i in range(STEPS):
        params, opt_state, loss, grads = step(params, opt_state, x, y)
        losses.append(float(loss))
        if i == 0:
            grads0 = grads
    return dict(losses=np.array(losses), grads0=grads0, params=params)


def _on_one_device(tree):
    return jax.device_put(tree, jax.devices()[0])


def _replicated(mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, P()))


def _batch_sharded(mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, P("data")))


@functools.cache
def one_device(dtype_name):
    params, x, y = _init()
    return train(jit_step(dtype_name), *_on_one_device((params, x, y)))


def assert_matches(run, ref, tol, what):
    loss_err = float(np.max(np.abs(run["losses"] - ref["losses"]) / np.abs(ref["losses"])))
    grad_err = tree_max_rel_err(run["grads0"], ref["grads0"])
    param_err = tree_max_rel_err(run["params"], ref["params"])
    assert loss_err < tol["loss"], f"{what}: loss rel. error {loss_err:.2e} vs one device"
    assert grad_err < tol["grad"], f"{what}: grad rel. error {grad_err:.2e} vs one device"
    assert param_err < tol["params"], f"{what}: param rel. error {param_err:.2e} vs one device"
    assert run["losses"][-1] < run["losses"][0], f"{what}: loss did not decrease: {run['losses']}"


def assert_replicated(mesh, tree):
    for leaf in jax.tree_util.tree_leaves(tree):
        assert leaf.sharding.is_fully_replicated, leaf.sharding
        assert len(leaf.sharding.device_set) == N_DEV, leaf.sharding


def test_eight_devices(mesh):
    assert mesh.devices.size == N_DEV


def test_float32_data_parallel_matches_one_device(mesh):
    """Sanity check of the harness: without amp, sharding changes nothing but sum order."""
    params, x, y = _init()
    run = train(jit_step("float32"), _replicated(mesh, params), *_batch_sharded(mesh, (x, y)))
    assert_matches(run, one_device("float32"), F32_TOL, "float32 data parallel")


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_jit_named_sharding_matches_one_device(mesh, dtype_name):
    params, x, y = _init()
    params_r, (x_s, y_s) = _replicated(mesh, params), _batch_sharded(mesh, (x, y))
    run = train(jit_step(dtype_name), params_r, x_s, y_s)
    ref = one_device(dtype_name)
    assert_matches(run, ref, JIT_DP_TOL, f"jit+NamedSharding/{dtype_name}")
    # parameters stay replicated; amp really ran in half precision (differs from float32)
    assert_replicated(mesh, run["params"])
    assert_replicated(mesh, run["grads0"])
    assert tree_max_rel_err(ref["grads0"], one_device("float32")["grads0"]) > AMP_VS_F32_MIN_GRAD_DIFF
    # every matmul of the sharded step (forward and backward) is in half precision
    census = compute_op_dtypes(jit_step(dtype_name), params_r, OPT.init(params_r), x_s, y_s)
    assert census and {dt for (_, dt, _) in census} == {dtype_name}, census


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_jit_explicit_mesh_axes_match_one_device(dtype_name):
    """Sharding in types (``AxisType.Explicit``): amp keeps the sharded avals valid."""
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Explicit,))
    params, x, y = _init()
    with jax.set_mesh(mesh):
        params_r, (x_s, y_s) = _replicated(mesh, params), _batch_sharded(mesh, (x, y))
        run = train(jit_step(dtype_name), params_r, x_s, y_s)
        assert jax.typeof(run["params"]["w1"]).sharding.spec == P(None, None)
    # bfloat16 on an explicit mesh: XLA-CPU rewrites bfloat16 dots to float32 and does not do it
    # alike with and without sharding in types (float16 agrees to 1e-7): measured loss 1.7e-4,
    # grads 5.1e-4, params 8.3e-4.
    tol = JIT_DP_TOL if dtype_name == "float16" else DP_TOL[dtype_name]
    assert_matches(run, one_device(dtype_name), tol, f"explicit mesh/{dtype_name}")
    assert_replicated(mesh, run["params"])


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_shard_map_amp_inside_matches_one_device(mesh, dtype_name):
    params, x, y = _init()
    params_r, (x_s, y_s) = _replicated(mesh, params), _batch_sharded(mesh, (x, y))
    step = shard_map_step(mesh, dtype_name, amp_inside=True)
    run = train(step, params_r, x_s, y_s)
    assert_matches(run, one_device(dtype_name), DP_TOL[dtype_name], f"shard_map(amp)/{dtype_name}")
    assert_replicated(mesh, run["params"])
    census = compute_op_dtypes(step, params_r, OPT.init(params_r), x_s, y_s)
    assert census and {dt for (_, dt, _) in census} == {dtype_name}, census


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_amp_around_shard_map_matches_one_device(mesh, dtype_name):
    """amp transforms the body of a shard_map it finds in the traced function."""
    params, x, y = _init()
    params_r, (x_s, y_s) = _replicated(mesh, params), _batch_sharded(mesh, (x, y))
    step = shard_map_step(mesh, dtype_name, amp_inside=False)
    run = train(step, params_r, x_s, y_s)
    assert_matches(run, one_device(dtype_name), DP_TOL[dtype_name], f"amp(shard_map)/{dtype_name}")
    assert_replicated(mesh, run["params"])
    closed = jax.make_jaxpr(step)(params_r, OPT.init(params_r), x_s, y_s)
    shard_maps = [e for e, _ in walk(closed) if e.primitive.name == "shard_map"]
    assert shard_maps, "the shard_map disappeared"
    inner = [
        str(e.invars[0].aval.dtype)
        for s in shard_maps
        for e, _ in walk(s.params["jaxpr"])
        if e.primitive.name == "dot_general"
    ]
    assert inner and set(inner) == {dtype_name}, inner


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_sharding_constraint_on_activations_is_kept(mesh, dtype_name):
    """``with_sharding_constraint`` inside the amp'd loss survives, with its sharding."""
    sharding = NamedSharding(mesh, P("data", None))

    def constrained_loss(params, x, y):
        h = jax.lax.with_sharding_constraint(x @ params["w1"], sharding)
        return jnp.mean(jnp.tanh(h) @ params["w2"]) + 0.0 * y.sum()

    params, x, y = _init()
    params_r, (x_s, y_s) = _replicated(mesh, params), _batch_sharded(mesh, (x, y))
    fn = jax.jit(jax.value_and_grad(_maybe_amp(constrained_loss, dtype_name)))
    closed = jax.make_jaxpr(fn)(params_r, x_s, y_s)
    constraints = [e for e, _ in walk(closed) if e.primitive.name == "sharding_constraint"]
    assert constraints, "with_sharding_constraint was dropped"
    assert any(e.params["sharding"] == sharding for e in constraints), [e.params["sharding"] for e in constraints]
    assert any(str(e.invars[0].aval.dtype) == dtype_name for e in constraints), "constraint not on the half activation"
    loss, grads = fn(params_r, x_s, y_s)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(constrained_loss))(params_r, x_s, y_s)
    assert abs(float(loss) - float(ref_loss)) <= 1e-2 * abs(float(ref_loss)) + 1e-3
    assert (
        tree_max_rel_err({k: grads[k] for k in ("w1", "w2")}, {k: ref_grads[k] for k in ("w1", "w2")})
        < DP_TOL[dtype_name]["grad"] * 2
    )
