"""optimizer_update and the optax recipes: skipped steps, apply_if_finite, MultiSteps, clipping."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from autocast import (
    DynamicScalerState,
    NoOpScalerState,
    dynamic_scale_grad,
    dynamic_scale_value_and_grad,
    optimizer_update,
)

# No strict dtype promotion here: optax's own update rules mix int32 step counts
# with float32 values.


def _bits(tree):
    """Every array leaf as raw bytes (NaN payloads and signed zeros included)."""
    return [(x.dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree) if eqx.is_array(x)]


def _cast(dtype, tree):
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree)


def _params():
    return {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.float32(0.5)}


_GRADS = {"w": jnp.array([0.1, 0.2, -0.3]), "b": jnp.float32(1.0)}
_NAN_GRADS = {"w": jnp.array([0.1, jnp.nan, -0.3]), "b": jnp.float32(1.0)}

_update = eqx.filter_jit(optimizer_update)


def test_finite_step_matches_plain_optax():
    optim = optax.adam(1e-2)
    params = _params()
    opt_state = optim.init(params)
    new_params, new_state = _update(params, optim, opt_state, _GRADS, jnp.array(True))
    updates, ref_state = jax.jit(optim.update)(_GRADS, opt_state, params)
    ref_params = jax.jit(optax.apply_updates)(params, updates)
    assert _bits(new_params) == _bits(ref_params)
    assert _bits(new_state) == _bits(ref_state)


def test_non_finite_step_is_bit_identical():
    optim = optax.adam(1e-2)
    params = _params()
    opt_state = optim.update(_GRADS, optim.init(params), params)[1]  # count = 1
    new_params, new_state = _update(params, optim, opt_state, _NAN_GRADS, jnp.array(False))
    assert _bits(new_params) == _bits(params)
    assert _bits(new_state) == _bits(opt_state)
    assert int(new_state[0].count) == 1


def test_grads_finite_must_be_a_scalar_bool():
    optim = optax.sgd(0.1)
    with pytest.raises(ValueError, match="optimizer_update: `grads_finite` must be a scalar"):
        optimizer_update(_params(), optim, optim.init(_params()), _GRADS, jnp.array([True]))
    with pytest.raises(TypeError, match="optimizer_update: `grads_finite`.*float32"):
        optimizer_update(_params(), optim, optim.init(_params()), _GRADS, jnp.float32(1))


# ---------------------------------------------------------------- Equinox training step


def _loss(model, x, y, dtype):
    out = jax.vmap(_cast(dtype, model))(x.astype(dtype))
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


@eqx.filter_jit
def _train_step(model, opt_state, scaler_state, x, y, optim, dtype):
    scaler_state, (loss, grads) = dynamic_scale_value_and_grad(_loss)(
        model, x, y, dtype, dynamic_scaler_state=scaler_state
    )
    model, opt_state = optimizer_update(model, optim, opt_state, grads, scaler_state.grads_finite)
    return model, opt_state, scaler_state, loss


# One optimizer object for all Equinox tests, so `_train_step` compiles once per dtype.
_OPTIM = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-2))


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 2)), jnp.float32)
    y = jnp.concatenate([jnp.sin(x[:, :1]) + 0.5 * x[:, 1:], 0.3 * x[:, :1]], axis=1)
    model = eqx.nn.MLP(2, 2, 8, 1, key=jax.random.key(0))
    return model, x, y


def test_planted_overflow_is_skipped_in_an_equinox_step(problem):
    model, x, y = problem
    optim = _OPTIM
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    scaler = DynamicScalerState(patience=5, scaler=2.0**10)
    model, opt_state, scaler, _ = _train_step(model, opt_state, scaler, x, y, optim, jnp.float16)
    assert bool(scaler.grads_finite)

    bad_x = x.at[3, 0].set(1e6)  # inf in the float16 forward pass
    new_model, new_opt_state, new_scaler, loss = _train_step(model, opt_state, scaler, bad_x, y, optim, jnp.float16)
    assert not bool(new_scaler.grads_finite) and not np.isfinite(float(loss))
    assert float(new_scaler.scaler) == 2.0**9 and int(new_scaler.total_resets) == 1
    assert _bits(new_model) == _bits(model)
    assert _bits(new_opt_state) == _bits(opt_state)
    assert new_model.activation is model.activation


@pytest.mark.parametrize(
    "dtype, scaler",
    [(jnp.float16, DynamicScalerState(patience=5)), (jnp.bfloat16, NoOpScalerState())],
    ids=["float16-dynamic", "bfloat16-noop"],
)
def test_training_step_written_once(problem, dtype, scaler):
    model, x, y = problem
    optim = _OPTIM
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for _ in range(60):
        model, opt_state, scaler, loss = _train_step(model, opt_state, scaler, x, y, optim, dtype)
        losses.append(float(loss))
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.25 * losses[0]
    ref = float(_loss(model, x, y, jnp.float32))
    assert abs(float(_loss(model, x, y, dtype)) - ref) < 0.05 * ref + 1e-3
    if isinstance(scaler, DynamicScalerState):
        # It grew from 2**15 until float16 backward passes started to overflow, and
        # settled there: a few steps were skipped, most were applied.
        assert 2.0**15 < float(scaler.scaler) < 2.0**24
        assert 0 < int(scaler.total_resets) < 10


# ---------------------------------------------------------------- clipping


def test_clipping_acts_on_unscaled_gradients():
    def loss(w, x):
        return jnp.sum((w * x) ** 2)

    w, x = jnp.array([1.0, 2.0, 3.0]), jnp.array([4.0, 5.0, 6.0])
    optim = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    opt_state = optim.init(w)

    @jax.jit
    def scaled_step(w, opt_state):
        state, grads = dynamic_scale_grad(loss)(w, x, dynamic_scaler_state=DynamicScalerState())
        return optimizer_update(w, optim, opt_state, grads, state.grads_finite)

    new_w, _ = scaled_step(w, opt_state)
    ref_grads = jax.grad(loss)(w, x)
    assert float(optax.tree.norm(ref_grads)) > 1.0  # the clip is active
    expected = w - 0.1 * ref_grads / optax.tree.norm(ref_grads)
    np.testing.assert_allclose(new_w, expected, rtol=1e-6)


# ---------------------------------------------------------------- optax wrappers


def test_apply_if_finite_behind_optimizer_update_never_applies_nan():
    # optax.apply_if_finite alone applies the NaN update after max_consecutive_errors.
    optim = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=2)
    params = _params()

    direct_params, direct_state = params, optim.init(params)
    guarded_params, guarded_state = params, optim.init(params)
    for _ in range(5):
        updates, direct_state = optim.update(_NAN_GRADS, direct_state, direct_params)
        direct_params = optax.apply_updates(direct_params, updates)
        guarded_params, guarded_state = _update(guarded_params, optim, guarded_state, _NAN_GRADS, jnp.array(False))
    assert np.isnan(np.asarray(direct_params["w"])).any()  # why the recipe matters
    assert _bits(guarded_params) == _bits(params)
    assert int(guarded_state.notfinite_count) == 0

    guarded_params, guarded_state = _update(guarded_params, optim, guarded_state, _GRADS, jnp.array(True))
    np.testing.assert_allclose(guarded_params["w"], params["w"] - 0.1 * _GRADS["w"], rtol=1e-6)


@pytest.mark.parametrize("skip_fn", [None, optax.skip_not_finite], ids=["plain", "skip_not_finite"])
def test_multisteps_accumulation_drops_non_finite_micro_batches(skip_fn):
    optim = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2, should_skip_update_fn=skip_fn)
    params = _params()
    g2 = {"w": jnp.array([0.3, -0.1, 0.5]), "b": jnp.float32(-1.0)}

    state = optim.init(params)
    p = params
    for grads, finite in ((_GRADS, True), (_NAN_GRADS, False), (g2, True)):
        before = state
        p, state = _update(p, optim, state, grads, jnp.array(finite))
        if not finite:
            assert _bits(state) == _bits(before)  # nothing accumulated, no micro-step
            assert _bits(p) == _bits(params)
    expected = jax.tree.map(lambda x, a, b: x - (a + b) / 2, params, _GRADS, g2)
    for got, want in zip(jax.tree.leaves(p), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert int(state.gradient_step) == 1


def test_multisteps_with_a_changing_scale():
    # Each micro-batch is unscaled with its own scale before accumulation.
    def loss(w, x):
        return jnp.sum(w * x)

    w = jnp.ones(3)
    optim = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
    opt_state = optim.init(w)
    scaler = DynamicScalerState(patience=1, scaler=2.0**4)
    step = jax.jit(dynamic_scale_grad(loss))
    xs = [jnp.array([1.0, 2.0, 3.0]), jnp.array([3.0, 2.0, 1.0])]
    for x in xs:
        scaler, grads = step(w, x, dynamic_scaler_state=scaler)
        w, opt_state = _update(w, optim, opt_state, grads, scaler.grads_finite)
    assert float(scaler.scaler) == 2.0**6
    np.testing.assert_array_equal(w, 1.0 - (xs[0] + xs[1]) / 2)


def test_grads_of_another_structure_name_the_argument_and_both_structures():
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    optim = optax.adam(1e-3)
    opt_state = optim.init(params)
    with pytest.raises(ValueError, match=r"`grads` must have the structure.*missing from `grads`: \['b'\]") as info:
        optimizer_update(params, optim, opt_state, {"w": jnp.ones((2, 2))}, jnp.array(True))
    assert "grads: PyTreeDef({'w': *})" in str(info.value)
    assert "model: PyTreeDef({'b': *, 'w': *})" in str(info.value)
    # an Equinox model and the gradients of another one
    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    other = eqx.filter(eqx.nn.MLP(2, 2, 4, 2, key=jax.random.key(0)), eqx.is_inexact_array)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    with pytest.raises(ValueError, match=r"not in the model: .*layers\[2\]"):
        optimizer_update(model, optim, opt_state, other, jnp.array(True))
