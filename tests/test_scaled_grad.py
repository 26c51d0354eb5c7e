"""dynamic_scale_grad / dynamic_scale_value_and_grad against jax.grad and eqx.filter_grad."""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autocast import (
    DynamicScalerState,
    NoOpScalerState,
    StaticScalerState,
    dynamic_scale_grad,
    dynamic_scale_value_and_grad,
)


@pytest.fixture(autouse=True)
def _strict_promotion():
    with jax.numpy_dtype_promotion("strict"):
        yield


def _to(dtype, tree):
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree)


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if eqx.is_array(x):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
        else:
            assert x is y


@pytest.fixture(scope="module")
def mlp_data():
    rng = np.random.default_rng(0)
    model = eqx.nn.MLP(2, 2, 8, 1, key=jax.random.key(0))
    x = jnp.asarray(rng.normal(size=(16, 2)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(16, 2)), jnp.float32)
    return model, x, y


def _mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


# ---------------------------------------------------------------- reference parity


@pytest.mark.parametrize(
    "state",
    [DynamicScalerState(), StaticScalerState(2.0**10), NoOpScalerState()],
    ids=["dynamic", "static", "noop"],
)
def test_filter_value_and_grad_matches_equinox(mlp_data, state):
    model, x, y = mlp_data
    new_state, (value, grads) = eqx.filter_jit(dynamic_scale_value_and_grad(_mse))(
        model, x, y, dynamic_scaler_state=state
    )
    ref_value, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(_mse))(model, x, y)
    assert value.dtype == ref_value.dtype and float(value) == float(ref_value)
    # Power-of-two scaling in float32 is exact, so the gradients agree bit for bit
    # up to XLA's freedom to fuse differently.
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert grads.activation is None  # non-array leaves get no gradient
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert g.dtype == r.dtype
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=0)
    assert type(new_state) is type(state) and bool(new_state.grads_finite)


def test_grad_without_filter_matches_jax_grad_with_argnums():
    def loss(a, n, b, *, power):
        return jnp.sum(a**power * b) + n

    a, b = jnp.array([1.0, 2.0, 3.0]), jnp.array([0.5, -1.0, 2.0])
    state = DynamicScalerState(scaler=2.0**12)
    _, grads = dynamic_scale_grad(loss, filter=False, argnums=(0, 2))(
        a, jnp.float32(1), b, power=2, dynamic_scaler_state=state
    )
    ref = jax.grad(loss, argnums=(0, 2))(a, jnp.float32(1), b, power=2)
    assert isinstance(grads, tuple) and len(grads) == 2
    _assert_trees_equal(grads, ref)


def test_filter_with_argnums_and_non_float_leaves():
    def loss(config, params):
        return jnp.sum(params["w"] * config["scale"]) * config["n"].astype(jnp.float32)

    config = {"scale": jnp.float32(3.0), "n": jnp.int32(2), "act": jax.nn.relu}
    params = {"w": jnp.ones(3), "steps": jnp.int32(5)}
    state = DynamicScalerState()
    _, grads = dynamic_scale_grad(loss, argnums=1)(config, params, dynamic_scaler_state=state)
    ref = eqx.filter_grad(lambda p, c: loss(c, p))(params, config)
    _assert_trees_equal(grads, ref)
    assert grads["steps"] is None
    _, (g0, g1) = dynamic_scale_grad(loss, argnums=(0, 1))(config, params, dynamic_scaler_state=state)
    assert g0["n"] is None and g0["act"] is None and float(g0["scale"]) == 6.0
    _assert_trees_equal(g1, ref)


def test_return_conventions_with_aux():
    def loss(w):
        return jnp.sum(w**2), {"norm": jnp.linalg.norm(w), "tag": "aux"}

    w = jnp.array([1.0, 2.0])
    state = DynamicScalerState()
    s1, (grads, aux) = dynamic_scale_grad(loss, has_aux=True)(w, dynamic_scaler_state=state)
    s2, ((value, aux2), grads2) = dynamic_scale_value_and_grad(loss, has_aux=True)(w, dynamic_scaler_state=state)
    np.testing.assert_array_equal(grads, 2 * w)
    np.testing.assert_array_equal(grads2, 2 * w)
    assert float(value) == 5.0 and aux["tag"] == "aux" and aux2["tag"] == "aux"
    assert float(aux["norm"]) == float(jnp.linalg.norm(w))
    s3, plain = dynamic_scale_grad(lambda w: jnp.sum(w**2))(w, dynamic_scaler_state=state)
    np.testing.assert_array_equal(plain, 2 * w)
    for s in (s1, s2, s3):
        assert int(s.count) == 1 and bool(s.grads_finite)


def test_kwargs_are_passed_through_and_decorator_forms():
    @dynamic_scale_value_and_grad
    def plain(w, *, k):
        """Docstring kept."""
        return jnp.sum(w) * k

    @dynamic_scale_value_and_grad(has_aux=True, filter=False)
    def with_aux(w, *, k):
        return jnp.sum(w) * k, k

    w = jnp.ones(3)
    state = DynamicScalerState()
    _, (value, grads) = plain(w, k=jnp.float32(2.0), dynamic_scaler_state=state)
    _, ((_, aux), grads2) = with_aux(w, k=jnp.float32(2.0), dynamic_scaler_state=state)
    assert float(value) == 6.0 and float(aux) == 2.0
    np.testing.assert_array_equal(grads, [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(grads2, [2.0, 2.0, 2.0])
    assert plain.__name__ == "plain" and plain.__doc__ == "Docstring kept."
    # The extra keyword is in the signature, so equinox.filter_jit can bind it.
    assert str(inspect.signature(plain)) == "(w, *, k, dynamic_scaler_state)"
    _, (value, _) = eqx.filter_jit(plain)(w, k=jnp.float32(3.0), dynamic_scaler_state=state)
    assert float(value) == 9.0


# ---------------------------------------------------------------- unscaling


@pytest.mark.parametrize(
    "state",
    [
        DynamicScalerState(patience=1, scaler=1024.0),
        DynamicScalerState(scaler=1024.0, count=1999),  # the 2000th finite step
    ],
    ids=["patience=1", "count=1999"],
)
def test_unscale_uses_the_applied_scale_when_it_grows(state):
    # MPX unscales with the grown scale: value 1.5 and grad 0.5 instead of 3 and 1.
    def loss(w, x):
        return jnp.sum(w * x)

    w, x = jnp.ones(3), jnp.ones(3)
    new_state, (value, grads) = jax.jit(dynamic_scale_value_and_grad(loss))(w, x, dynamic_scaler_state=state)
    assert float(new_state.scaler) == 2048.0  # the scale did change in this step
    assert float(value) == 3.0
    np.testing.assert_array_equal(grads, [1.0, 1.0, 1.0])


def test_value_is_returned_unscaled_in_its_own_dtype():
    def loss(w):
        return jnp.sum(w.astype(jnp.float16) * jnp.float16(0.1))

    state, (value, grads) = dynamic_scale_value_and_grad(loss)(jnp.ones(3), dynamic_scaler_state=DynamicScalerState())
    assert value.dtype == jnp.float16
    assert float(value) == float(loss(jnp.ones(3)))
    assert grads.dtype == jnp.float32
    np.testing.assert_array_equal(grads, np.full(3, float(jnp.float16(0.1)), np.float32))


def test_grads_keep_each_parameter_dtype():
    params = {"f32": jnp.ones(2), "bf16": jnp.ones(2, jnp.bfloat16), "f16": jnp.ones(2, jnp.float16)}

    def loss(p):
        return sum(jnp.sum(v.astype(jnp.float32)) for v in p.values())

    _, grads = dynamic_scale_grad(loss)(params, dynamic_scaler_state=DynamicScalerState())
    for name, g in grads.items():
        assert g.dtype == params[name].dtype
        np.testing.assert_array_equal(g.astype(jnp.float32), [1.0, 1.0])


# ---------------------------------------------------------------- float16 underflow


def _f16_scaled_product(w):
    # d/dw = a * b = 2**-26, below the smallest float16 subnormal (2**-24).
    a = b = jnp.float16(2.0**-13)
    return jnp.sum(((w.astype(jnp.float16) * a) * b).astype(jnp.float32))


def test_float16_gradient_underflow_is_recovered_exactly():
    w = jnp.ones(4)
    assert np.all(np.asarray(jax.grad(_f16_scaled_product)(w)) == 0)  # underflow
    _, grads = dynamic_scale_grad(_f16_scaled_product)(w, dynamic_scaler_state=NoOpScalerState())
    assert np.all(np.asarray(grads) == 0)  # no scaling: still zero
    _, grads = dynamic_scale_grad(_f16_scaled_product)(w, dynamic_scaler_state=DynamicScalerState())
    np.testing.assert_array_equal(grads, np.full(4, 2.0**-26, np.float32))


def test_float16_mlp_gradients_recovered(mlp_data):
    model, x, y = mlp_data

    def loss(model, x, y, dtype):
        out = jax.vmap(_to(dtype, model))(x.astype(dtype))
        return 1e-7 * jnp.mean((out.astype(jnp.float32) - y) ** 2)

    ref = eqx.filter_jit(eqx.filter_grad(loss))(model, x, y, jnp.float32)
    raw = eqx.filter_jit(eqx.filter_grad(loss))(model, x, y, jnp.float16)
    state, scaled = eqx.filter_jit(dynamic_scale_grad(loss))(
        model, x, y, jnp.float16, dynamic_scaler_state=DynamicScalerState()
    )
    assert bool(state.grads_finite)
    for r, a, s in zip(*(jax.tree.leaves(t) for t in (ref, raw, scaled))):
        assert s.dtype == jnp.float32
        assert np.all(np.asarray(a) == 0)  # every gradient underflows without scaling
        np.testing.assert_allclose(s, r, rtol=0, atol=5e-3 * float(jnp.max(jnp.abs(r))))


# ---------------------------------------------------------------- non-finite steps


def _f16_overflow(w):
    # The cotangent reaching the float16 product is scale * 2**10, which overflows
    # float16 (max 65504) for scales >= 2**6.
    return jnp.sum((w.astype(jnp.float16) * jnp.float16(2.0**10)).astype(jnp.float32))


def test_overflow_backs_off_and_is_reported():
    state = DynamicScalerState(scaler=2.0**9, count=5)
    new_state, (value, grads) = dynamic_scale_value_and_grad(_f16_overflow)(jnp.ones(2), dynamic_scaler_state=state)
    assert not bool(new_state.grads_finite)
    assert not np.all(np.isfinite(np.asarray(grads)))
    assert float(value) == 2048.0  # the forward value itself was fine
    assert (float(new_state.scaler), int(new_state.count), int(new_state.total_resets)) == (
        2.0**8,
        0,
        1,
    )


def test_nan_in_aux_does_not_count():
    # jaxamp halves the scale when only aux is NaN.
    def loss(w):
        return jnp.sum(w), jnp.float32(jnp.nan)

    state, (grads, aux) = dynamic_scale_grad(loss, has_aux=True)(jnp.ones(3), dynamic_scaler_state=DynamicScalerState())
    assert bool(state.grads_finite) and float(state.scaler) == 2.0**15
    assert int(state.total_resets) == 0 and np.isnan(float(aux))


@pytest.mark.parametrize(
    "redo, finite, scaler, resets",
    [
        # attempts at 2**9, 2**8: both overflow; the returned state backs off again.
        (1, False, 2.0**7, 2),
        # 2**9, 2**8, 2**7, 2**6 overflow; 2**5 (32 * 1024 = 32768) is finite.
        (4, True, 2.0**5, 4),
        (10, True, 2.0**5, 4),  # stops at the first finite attempt
    ],
)
def test_redo_on_nan(redo, finite, scaler, resets):
    calls = []

    def loss(w):
        jax.debug.callback(lambda: calls.append(1))
        return _f16_overflow(w)

    grad_fn = jax.jit(dynamic_scale_value_and_grad(loss, redo_on_nan=redo))
    state, (value, grads) = grad_fn(jnp.ones(2), dynamic_scaler_state=DynamicScalerState(scaler=2.0**9))
    jax.effects_barrier()
    assert bool(state.grads_finite) is finite
    assert float(state.scaler) == scaler and int(state.total_resets) == resets
    assert len(calls) == min(redo, resets) + 1  # forward passes actually run
    assert float(value) == 2048.0
    if finite:
        np.testing.assert_array_equal(grads, [1024.0, 1024.0])  # unscaled with 2**5
        assert int(state.count) == 1


def test_redo_on_nan_is_not_run_for_finite_steps_or_static_scales():
    calls = []

    def loss(w):
        jax.debug.callback(lambda: calls.append(1))
        return _f16_overflow(w)

    for state in (DynamicScalerState(scaler=2.0**2), StaticScalerState(2.0**9)):
        calls.clear()
        grad_fn = jax.jit(dynamic_scale_grad(loss, redo_on_nan=3))
        grad_fn(jnp.ones(2), dynamic_scaler_state=state)
        jax.effects_barrier()
        assert len(calls) == 1


def test_recovers_after_a_run_of_nan_batches():
    # jaxamp: 16 NaN batches with redo_on_nan=10 drive the scale to 0 for good.
    def loss(w, x):
        return jnp.mean((w * x) ** 2)

    step = jax.jit(dynamic_scale_value_and_grad(loss, redo_on_nan=10))
    state = DynamicScalerState(patience=2)
    w = jnp.ones(3)
    for _ in range(16):
        state, _ = step(w, jnp.full(3, jnp.nan), dynamic_scaler_state=state)
    assert float(state.scaler) == 1.0  # the floor, not 0
    assert int(state.total_resets) == 16 * 11
    state, (value, grads) = step(w, jnp.full(3, 2.0), dynamic_scaler_state=state)
    assert bool(state.grads_finite) and float(value) == 4.0
    np.testing.assert_array_equal(grads, jax.grad(loss)(w, jnp.full(3, 2.0)))
    state, _ = step(w, jnp.full(3, 2.0), dynamic_scaler_state=state)
    assert float(state.scaler) == 2.0  # growing again


def test_redo_on_nan_with_non_array_aux():
    def loss(w):
        return _f16_overflow(w), ("label", jnp.sum(w))

    state, ((value, (label, total)), grads) = dynamic_scale_value_and_grad(loss, has_aux=True, redo_on_nan=5)(
        jnp.ones(2), dynamic_scaler_state=DynamicScalerState(scaler=2.0**9)
    )
    assert label == "label" and float(total) == 2.0
    assert bool(state.grads_finite)
    np.testing.assert_array_equal(grads, [1024.0, 1024.0])


def test_vmap_over_an_ensemble_of_states():
    def loss(w):
        return _f16_overflow(w)

    states = jax.vmap(lambda s: DynamicScalerState(scaler=s))(jnp.array([2.0**4, 2.0**9]))
    grad_fn = dynamic_scale_grad(loss, redo_on_nan=5)
    new, grads = jax.vmap(lambda s: grad_fn(jnp.ones(2), dynamic_scaler_state=s))(states)
    np.testing.assert_array_equal(new.scaler, [2.0**4, 2.0**5])
    np.testing.assert_array_equal(new.total_resets, [0, 4])
    np.testing.assert_array_equal(grads, np.full((2, 2), 1024.0))


# ---------------------------------------------------------------- errors


def _state_kw():
    return {"dynamic_scaler_state": DynamicScalerState()}


@pytest.mark.parametrize("wrapper", [dynamic_scale_grad, dynamic_scale_value_and_grad])
@pytest.mark.parametrize(
    "fun, has_aux, call, error, fragments",
    [
        (lambda w: w * 2, False, None, TypeError, ["scalar floating-point", "shape (3,)"]),
        (lambda w: jnp.sum(w).astype(jnp.int32), False, None, TypeError, ["dtype int32"]),
        (lambda w: jnp.sum(w), True, None, TypeError, ["has_aux=True", "pair", "an array of shape ()"]),
        (lambda w: (jnp.sum(w), 1, 2), True, None, TypeError, ["pair", "tuple of length 3"]),
        (lambda w: (jnp.sum(w), 1), False, None, TypeError, ["did you mean has_aux=True"]),
        (lambda w: "loss", False, None, TypeError, ["got a str"]),
        (lambda w: jnp.sum(w), False, {}, TypeError, ["missing", "dynamic_scaler_state"]),
        (
            lambda w: jnp.sum(w),
            False,
            {"dynamic_scaler_state": 2.0**15},
            TypeError,
            ["`dynamic_scaler_state`", "got float"],
        ),
    ],
)
def test_call_errors(wrapper, fun, has_aux, call, error, fragments):
    g = wrapper(fun, has_aux=has_aux)
    with pytest.raises(error) as info:
        g(jnp.ones(3), **(_state_kw() if call is None else call))
    message = str(info.value)
    assert message.startswith(wrapper.__name__)
    for fragment in fragments:
        assert fragment in message


def test_positional_state_gets_a_hint():
    with pytest.raises(TypeError, match="passed positionally"):
        dynamic_scale_grad(lambda w, s: jnp.sum(w))(jnp.ones(3), DynamicScalerState())


def test_argnums_out_of_range():
    for filter_ in (True, False):
        with pytest.raises(ValueError, match="argnums=1 .* only 1 positional"):
            dynamic_scale_grad(jnp.sum, argnums=1, filter=filter_)(jnp.ones(3), **_state_kw())


@pytest.mark.parametrize("wrapper", [dynamic_scale_grad, dynamic_scale_value_and_grad])
@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        (dict(redo_on_nan=-1), ValueError, "redo_on_nan=-1"),
        (dict(redo_on_nan=True), TypeError, "redo_on_nan=True"),
        (dict(redo_on_nan=1.5), TypeError, "redo_on_nan=1.5"),
        (dict(argnums=-1), ValueError, "argnums=-1"),
        (dict(argnums=()), ValueError, "argnums=()"),
        (dict(argnums=(0, 0)), ValueError, "argnums=(0, 0)"),
        (dict(has_aux=1), TypeError, "has_aux=1"),
        (dict(filter="yes"), TypeError, "filter='yes'"),
    ],
)
def test_option_errors(wrapper, kwargs, error, fragment):
    with pytest.raises(error, match=wrapper.__name__) as info:
        wrapper(jnp.sum, **kwargs)
    assert fragment in str(info.value)


def test_fun_must_be_callable():
    with pytest.raises(TypeError, match="`fun` must be callable; got int"):
        dynamic_scale_grad(3)


def test_redo_default_is_zero_for_both():
    for wrapper in (dynamic_scale_grad, dynamic_scale_value_and_grad):
        assert inspect.signature(wrapper).parameters["redo_on_nan"].default == 0
