"""autocast.compat.jaxamp: jaxamp 0.0.4's API on autocast.

jaxamp (a test dependency) is used as the reference where it still works on current JAX:
its rules and its loss scaler. Its ``amp`` fails on the first equation of any function
(``get_bind_params`` changed), so ``amp`` is checked against float32 references, against
hand-written half-precision code and against ``autocast.amp``.
"""

import inspect

import equinox as eqx
import flax.serialization
import jax
import jax.numpy as jnp
import jaxamp as real
import numpy as np
import pytest
from helpers import walk

import autocast
import autocast.compat.jaxamp as jaxamp

PUBLIC = sorted(n for n in dir(real) if not n.startswith("_"))


def _dtypes_of(prim_name, fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [tuple(str(v.aval.dtype) for v in eqn.invars) for eqn, _ in walk(jaxpr) if eqn.primitive.name == prim_name]


# ---------------------------------------------------------------------------------
# The API surface.
# ---------------------------------------------------------------------------------


def test_every_public_jaxamp_name_exists_with_jaxamps_signature():
    assert PUBLIC == [
        "DynamicScalerState",
        "amp",
        "amp_stop",
        "default_amp_policy",
        "dynamic_scale_grad",
        "dynamic_scale_tx",
        "dynamic_scale_value_and_grad",
        "use_compute_precision",
        "use_original_precision",
    ]
    assert set(PUBLIC) <= set(jaxamp.__all__) and jaxamp.__version__ == real.__version__
    for name in (
        "amp",
        "amp_stop",
        "dynamic_scale_grad",
        "dynamic_scale_value_and_grad",
        "dynamic_scale_tx",
        "use_compute_precision",
        "use_original_precision",
    ):
        ours = inspect.signature(getattr(jaxamp, name)).parameters
        theirs = inspect.signature(getattr(real, name)).parameters
        var_kw = [p for p, v in theirs.items() if v.kind is v.VAR_KEYWORD]  # **bind_params / **params
        if var_kw:
            assert list(ours.values())[-1].kind is inspect.Parameter.VAR_KEYWORD, name
        ours = {p: v for p, v in ours.items() if v.kind is not v.VAR_KEYWORD}
        theirs = {p: v for p, v in theirs.items() if v.kind is not v.VAR_KEYWORD}
        extra = [p for p in ours if p not in theirs]
        assert [p for p in ours if p in theirs] == list(theirs), name
        assert all(ours[p].kind is ours[p].KEYWORD_ONLY for p in extra), name
        for p in theirs:
            assert ours[p].kind == theirs[p].kind, (name, p)
            default = theirs[p].default
            if isinstance(default, (int, float, type(None))) or default is jnp.float16:
                assert ours[p].default == default, (name, p)
    assert inspect.signature(jaxamp.amp).parameters["amp_policy"].default is jaxamp.default_amp_policy
    assert inspect.signature(jaxamp.dynamic_scale_value_and_grad).parameters["redo_on_nan"].default == 10
    fields = list(inspect.signature(jaxamp.DynamicScalerState).parameters)[:5]
    assert fields == list(real.DynamicScalerState._fields)
    ours, theirs = jaxamp.DynamicScalerState(), real.DynamicScalerState()
    for field in fields:
        assert float(getattr(ours, field)) == float(getattr(theirs, field)), field


def test_default_policy_has_jaxamps_keys_and_casts_like_jaxamps_rules():
    assert isinstance(jaxamp.default_amp_policy, dict)
    assert set(jaxamp.default_amp_policy) == set(real.default_amp_policy)
    x32, y16 = jnp.ones((2, 2)), jnp.ones((2, 2), jnp.float16)
    for key, rule in real.default_amp_policy.items():
        for compute in (jnp.float16, jnp.bfloat16):
            params = {"preferred_element_type": jnp.float32} if key is jax.lax.dot_general_p else {}
            theirs, their_params = rule(compute, [jnp.float32, jnp.float32], x32, y16, **params)
            ours, our_params = jaxamp.default_amp_policy[key](compute, [jnp.float32, jnp.float32], x32, y16, **params)
            assert [o.dtype for o in ours] == [t.dtype for t in theirs], (key, compute)
            assert {k: np.dtype(v) for k, v in our_params.items()} == {k: np.dtype(v) for k, v in their_params.items()}
    with jax.enable_x64(True):  # jaxamp casts every inexact array (float64, complex)
        x64, c64 = jnp.ones(2, jnp.float64), jnp.ones(2, jnp.complex64)
        theirs, _ = real.use_compute_precision(jnp.float16, [jnp.float64], x64)
        assert theirs[0].dtype == jnp.float16
        ours, _ = jaxamp.use_compute_precision(jnp.float16, [jnp.float64, jnp.complex64], x64, c64)
        assert ours[0] is x64 and ours[1] is c64


# ---------------------------------------------------------------------------------
# amp.
# ---------------------------------------------------------------------------------


def _linear(w, b, x):
    return x @ w + b


def _params():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return jax.random.normal(k1, (8, 4)), jax.random.normal(k2, (4,)), jax.random.normal(k3, (3, 8))


def test_amp_follows_jaxamps_table_bit_for_bit():
    w, b, x = _params()
    out = jaxamp.amp(_linear)(w, b, x)
    by_hand = (x.astype(jnp.float16) @ w.astype(jnp.float16) + b.astype(jnp.float16)).astype(jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, by_hand)  # matmul and bias add in float16, as in jaxamp
    np.testing.assert_allclose(out, _linear(w, b, x), rtol=1e-2, atol=1e-2)
    assert _dtypes_of("dot_general", jaxamp.amp(_linear), w, b, x) == [("float16", "float16")]
    assert _dtypes_of("add", jaxamp.amp(_linear), w, b, x) == [("float16", "float16")]
    # autocast's own table keeps the bias add in float32: closer to the float32 result.
    ours = autocast.amp(_linear)(w, b, x)
    assert np.abs(ours - _linear(w, b, x)).max() <= np.abs(out - _linear(w, b, x)).max()


def test_amp_sensitive_ops_in_float32_others_as_traced():
    def f(w, x):
        h = x @ w
        return jnp.sum(jnp.tanh(h) * jnp.exp(h) / 2.0)

    w, _, x = _params()
    amp_f = jaxamp.amp(f)
    assert _dtypes_of("dot_general", amp_f, w, x) == [("float16", "float16")]
    assert _dtypes_of("exp", amp_f, w, x) == [("float32",)]
    assert _dtypes_of("tanh", amp_f, w, x) == [("float32",)]  # not in jaxamp's table: traced dtype
    assert all(d == ("float32", "float32") for d in _dtypes_of("mul", amp_f, w, x))
    np.testing.assert_allclose(amp_f(w, x), f(w, x), rtol=1e-2)
    g_amp, g_ref = jax.grad(amp_f)(w, x), jax.grad(f)(w, x)
    assert g_amp.dtype == jnp.float32
    np.testing.assert_allclose(g_amp, g_ref, rtol=5e-2, atol=5e-2 * np.abs(g_ref).max())


def test_amp_reaches_into_nested_jit_and_checkpoint_bodies():
    inner = jax.jit(lambda w, x: x @ w)

    def f(w, x):
        return jax.checkpoint(lambda w, x: inner(w, x) @ w.T)(w, x)

    w, _, x = _params()
    # jaxamp bound nested jit/checkpoint bodies unchanged (in float32); here they are transformed.
    assert _dtypes_of("dot_general", jaxamp.amp(f), w, x) == [("float16", "float16")] * 2
    np.testing.assert_allclose(jaxamp.amp(f)(w, x), f(w, x), rtol=2e-2, atol=2e-2)


def test_amp_stop_scopes_and_compute_dtype():
    def f(w, x):
        h = x @ w
        with jaxamp.amp_stop():
            h = h @ w.T
        return jax.named_scope("head")(lambda h: h @ w)(h)

    w, _, x = _params()
    assert _dtypes_of("dot_general", jaxamp.amp(f), w, x) == [
        ("float16", "float16"),
        ("float32", "float32"),
        ("float16", "float16"),
    ]
    policy = jaxamp.default_amp_policy | {"head": jaxamp.use_original_precision}
    assert _dtypes_of("dot_general", jaxamp.amp(f, amp_policy=policy), w, x)[2] == ("float32", "float32")
    bf16 = jaxamp.amp(compute_dtype=jnp.bfloat16)(f)
    assert _dtypes_of("dot_general", bf16, w, x)[0] == ("bfloat16", "bfloat16")
    stopped = jaxamp.amp(jaxamp.amp_stop(f))
    np.testing.assert_array_equal(stopped(w, x), jax.jit(f)(w, x))


# ---------------------------------------------------------------------------------
# Loss scaling, side by side with jaxamp's scaler.
# ---------------------------------------------------------------------------------


def _loss(p, x):
    return jnp.sum((p * x) ** 2)


def _values(state):
    return float(state.scaler), int(state.count), int(state.total_resets)


@pytest.mark.parametrize("transform", ["dynamic_scale_grad", "dynamic_scale_value_and_grad"])
def test_scaler_schedule_matches_jaxamp_step_by_step(transform):
    ours_fn = jax.jit(getattr(jaxamp, transform)(_loss, filter=False, redo_on_nan=0))
    theirs_fn = jax.jit(getattr(real, transform)(_loss, filter=False, redo_on_nan=0))
    ours = jaxamp.DynamicScalerState(patience=3, scaler=2.0**10)
    theirs = real.DynamicScalerState(patience=3, scaler=2.0**10)
    p = jnp.arange(1.0, 5.0)
    bad = np.zeros(40, bool)
    bad[[5, 6, 17, 30]] = True
    for step, is_bad in enumerate(bad):
        x = jnp.array([1.0, jnp.nan, 1.0, 1.0]) if is_bad else jnp.ones(4)
        ours, our_out = ours_fn(p, x, dynamic_scaler_state=ours)
        theirs, their_out = theirs_fn(p, x, dynamic_scaler_state=theirs)
        assert _values(ours) == _values(theirs), step
        assert bool(ours.grads_finite) is not bool(is_bad)
        if not is_bad:
            for a, b in zip(jax.tree.leaves(our_out), jax.tree.leaves(their_out), strict=True):
                np.testing.assert_array_equal(a, b)
    assert _values(ours)[2] == 4 and _values(ours)[0] > 2.0**10 / 16


def test_scale_has_a_floor_and_recovers():
    def always_nan(p):
        return jnp.sum(p) * jnp.nan

    theirs, _ = real.dynamic_scale_grad(always_nan, redo_on_nan=200)(
        jnp.ones(2), dynamic_scaler_state=real.DynamicScalerState()
    )
    assert float(theirs.scaler) == 0.0  # jaxamp: the scale decays to 0 and never recovers
    grad_nan = jax.jit(jaxamp.dynamic_scale_grad(always_nan, redo_on_nan=200))
    ours, grads = grad_nan(jnp.ones(2), dynamic_scaler_state=jaxamp.DynamicScalerState(patience=1))
    assert float(ours.scaler) == ours.min_scaler == 1.0 and not bool(ours.grads_finite)
    assert np.isnan(grads).all()
    grad_ok = jax.jit(jaxamp.dynamic_scale_grad(_loss))
    for _ in range(4):  # patience=1: grows every second finite step
        ours, grads = grad_ok(jnp.ones(2), jnp.ones(2), dynamic_scaler_state=ours)
    assert float(ours.scaler) == 4.0
    np.testing.assert_array_equal(grads, [2.0, 2.0])


def test_scale_never_grows_to_inf():
    small = jnp.full(2, 1e-3)
    theirs, _ = real.dynamic_scale_grad(_loss)(
        small, small, dynamic_scaler_state=real.DynamicScalerState(patience=0, scaler=2.0**127)
    )
    assert np.isinf(float(theirs.scaler))  # jaxamp
    state = jaxamp.DynamicScalerState(patience=0, scaler=2.0**24)
    ours, _ = jaxamp.dynamic_scale_grad(_loss)(small, small, dynamic_scaler_state=state)
    assert float(ours.scaler) == 2.0**24 == ours.max_scaler


def test_loss_value_is_exact_and_only_gradients_are_checked():
    def big(x):
        return 20000.0 * x, jnp.float32(jnp.nan)  # float16 value 40000; NaN metric in aux

    x = jnp.float16(2.0)
    state = jaxamp.DynamicScalerState(scaler=2.0)
    theirs, ((value, _), grad) = real.dynamic_scale_value_and_grad(big, has_aux=True, redo_on_nan=0)(
        x, dynamic_scaler_state=real.DynamicScalerState(scaler=2.0)
    )
    assert np.isinf(float(value)) and float(theirs.scaler) == 1.0  # jaxamp: 80000 overflows float16
    assert grad.dtype == jnp.float32  # jaxamp: the scale's dtype
    ours, ((value, aux), grad) = jaxamp.dynamic_scale_value_and_grad(big, has_aux=True)(x, dynamic_scaler_state=state)
    assert value.dtype == jnp.float16 and float(value) == 40000.0
    assert grad.dtype == jnp.float16 and float(grad) == 20000.0  # parameters' dtype (jaxamp: float32)
    assert np.isnan(aux)
    assert _values(ours) == (2.0, 1, 0) and bool(ours.grads_finite)


def test_redo_on_nan_finds_the_largest_safe_scale_like_jaxamp():
    def cube(x):
        return x**3

    x = jnp.float16(2.0)
    for name in ("dynamic_scale_grad", "dynamic_scale_value_and_grad"):
        ours, g_ours = getattr(jaxamp, name)(cube, redo_on_nan=100)(
            x, dynamic_scaler_state=jaxamp.DynamicScalerState(patience=10)
        )
        theirs, g_theirs = getattr(real, name)(cube, redo_on_nan=100)(
            x, dynamic_scaler_state=real.DynamicScalerState(patience=10)
        )
        assert _values(ours) == _values(theirs) == (2.0**12, 1, 3)
        assert [float(v) for v in jax.tree.leaves(g_ours)] == [float(v) for v in jax.tree.leaves(g_theirs)]


def test_dynamic_scale_tx_matches_jaxamp_on_a_hessian():
    def f(x):
        return jnp.sum(jnp.sin(x) * x**2)

    x = jnp.linspace(-1.0, 1.0, 4)
    ours, h_ours = jax.jit(jaxamp.dynamic_scale_tx(jax.hessian)(f))(
        x, dynamic_scaler_state=jaxamp.DynamicScalerState(patience=0, scaler=2.0**8)
    )
    theirs, h_theirs = jax.jit(real.dynamic_scale_tx(jax.hessian)(f))(
        x, dynamic_scaler_state=real.DynamicScalerState(patience=0, scaler=2.0**8)
    )
    np.testing.assert_allclose(h_ours, jax.jit(jax.hessian(f))(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(h_ours, h_theirs)
    assert _values(ours) == _values(theirs) == (2.0**9, 0, 0)
    # With the default functions it is dynamic_scale_grad.
    state = jaxamp.DynamicScalerState(scaler=2.0**8)
    s1, g1 = jax.jit(jaxamp.dynamic_scale_tx(jax.grad, redo_on_nan=3)(f))(x, dynamic_scaler_state=state)
    s2, g2 = jax.jit(jaxamp.dynamic_scale_grad(f, filter=False, redo_on_nan=3))(x, dynamic_scaler_state=state)
    np.testing.assert_array_equal(g1, g2)
    assert _values(s1) == _values(s2)


def test_filter_true_differentiates_equinox_modules():
    model = eqx.nn.MLP(3, 1, 8, 1, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 3))

    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    state, (value, grads) = eqx.filter_jit(jaxamp.dynamic_scale_value_and_grad(loss))(
        model, x, dynamic_scaler_state=jaxamp.DynamicScalerState()
    )
    ref_value, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert grads.activation is None or not eqx.is_array(grads.activation)


def test_state_checkpoints_and_rejects_bad_input():
    state = jaxamp.DynamicScalerState(patience=5, scaler=2.0**9, count=3, total_resets=2)
    restored = flax.serialization.from_bytes(jaxamp.DynamicScalerState(patience=5), flax.serialization.to_bytes(state))
    assert type(restored) is jaxamp.DynamicScalerState and _values(restored) == (2.0**9, 3, 2)
    with pytest.raises(TypeError, match="holomorphic"):
        jaxamp.dynamic_scale_grad(_loss, holomorphic=True)
    with pytest.raises(TypeError, match="dynamic_scaler_state"):
        jaxamp.dynamic_scale_grad(_loss)(jnp.ones(2), jnp.ones(2))
    with pytest.raises(TypeError, match="dynamic_scaler_state"):
        jaxamp.dynamic_scale_tx(jax.grad)(_loss)(jnp.ones(2), jnp.ones(2))
    with pytest.raises(ValueError, match="power of two"):
        jaxamp.DynamicScalerState(scaler=3.0)
    with pytest.raises(ValueError, match="redo_on_nan"):
        jaxamp.dynamic_scale_tx(jax.grad, redo_on_nan=-1)


def _train_with(module, steps=12):
    """A jaxamp-style training loop (float16 matmuls written by hand, since jaxamp's own
    `amp` no longer runs); only the `jaxamp` module differs between runs."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (8, 16)) * 0.3, "w2": jax.random.normal(k2, (16, 1)) * 0.3}
    x = jax.random.normal(k3, (32, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True))

    def loss_fn(params, x, y):
        h = jnp.tanh(x.astype(jnp.float16) @ params["w1"].astype(jnp.float16))
        out = (h @ params["w2"].astype(jnp.float16)).astype(jnp.float32)
        return jnp.mean((out - y) ** 2)

    grad_fn = jax.jit(module.dynamic_scale_value_and_grad(loss_fn, redo_on_nan=0))
    state = module.DynamicScalerState(patience=2, scaler=2.0**20)  # too high at first
    history = []
    for _ in range(steps):
        state, (loss, grads) = grad_fn(params, x, y, dynamic_scaler_state=state)
        finite = bool(jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)])))
        if finite:
            params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        history.append((finite, float(state.scaler), int(state.count), float(loss) if finite else None))
    return params, history


def test_migration_is_an_import_change_same_training_trajectory():
    ours, our_history = _train_with(jaxamp)
    theirs, their_history = _train_with(real)
    assert our_history == their_history
    assert not our_history[0][0] and our_history[-1][0]  # backed off from 2**20, then trained
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])
