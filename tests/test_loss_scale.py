"""Scaler states: arithmetic, validation, pytree behaviour, checkpoints, tree helpers."""

import io
import math
import pickle

import equinox as eqx
import flax.serialization
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import autocast
from autocast import (
    DynamicScalerState,
    NoOpScalerState,
    StaticScalerState,
    all_finite,
    select_tree,
)


@pytest.fixture(autouse=True)
def _strict_promotion():
    with jax.numpy_dtype_promotion("strict"):
        yield


def _values(state):
    """The dynamic values of a state as Python numbers."""
    out = {"scaler": float(state.scaler), "grads_finite": bool(state.grads_finite)}
    if isinstance(state, DynamicScalerState):
        out["count"] = int(state.count)
        out["total_resets"] = int(state.total_resets)
    return out


def _config(state):
    names = ("patience", "adjust_factor", "backoff_factor", "min_scaler", "max_scaler")
    return {name: getattr(state, name) for name in names}


# ---------------------------------------------------------------- construction


def test_defaults_and_dtypes():
    state = DynamicScalerState()
    assert _config(state) == {
        "patience": 2000,
        "adjust_factor": 2.0,
        "backoff_factor": 2.0,
        "min_scaler": 1.0,
        "max_scaler": 2.0**24,
    }
    assert _values(state) == {
        "scaler": 2.0**15,
        "count": 0,
        "total_resets": 0,
        "grads_finite": True,
    }
    assert state.scaler.dtype == jnp.float32
    assert state.count.dtype == jnp.int32
    assert state.total_resets.dtype == jnp.int32
    assert state.grads_finite.dtype == jnp.bool_
    # The configuration is static: only the four dynamic values are leaves.
    assert len(jax.tree.leaves(state)) == 4


def test_positional_fields_in_seed_order():
    state = DynamicScalerState(10, 4.0, 64, 3, 7)
    assert (state.patience, state.adjust_factor) == (10, 4.0)
    assert _values(state) == {
        "scaler": 64.0,
        "count": 3,
        "total_resets": 7,
        "grads_finite": True,
    }


def test_array_inputs_are_converted():
    # jmp#47: a float16 scale made `adjust` crash with a dtype mismatch.
    state = DynamicScalerState(scaler=jnp.float16(1024), count=np.int64(2), grads_finite=np.bool_(False))
    assert state.scaler.dtype == jnp.float32 and float(state.scaler) == 1024.0
    assert state.count.dtype == jnp.int32
    assert float(state.adjust(False).scaler) == 512.0


@pytest.mark.parametrize(
    "kwargs, error, fragments",
    [
        (dict(scaler=0.0), ValueError, ["`scaler`", "scaler=0.0", "positive power of two"]),
        (dict(scaler=-4.0), ValueError, ["`scaler`", "scaler=-4.0"]),
        (dict(scaler=65504.0), ValueError, ["`scaler`", "65504", "power of two"]),
        (dict(scaler=math.inf), ValueError, ["`scaler`", "inf"]),
        (dict(scaler=0.5), ValueError, ["[min_scaler, max_scaler]", "scaler=0.5"]),
        (dict(scaler=2.0**25), ValueError, ["[min_scaler, max_scaler]"]),
        (dict(scaler=jnp.ones(3)), ValueError, ["`scaler`", "scalar", "(3,)"]),
        (dict(scaler="big"), TypeError, ["`scaler`", "real number"]),
        (dict(adjust_factor=1.0), ValueError, ["`adjust_factor`", "> 1", "adjust_factor=1.0"]),
        (dict(adjust_factor=0.5), ValueError, ["`adjust_factor`", "> 1"]),
        (dict(adjust_factor=3.0), ValueError, ["`adjust_factor`", "power of two"]),
        (dict(backoff_factor=0.5), ValueError, ["`backoff_factor`", "> 1", "PyTorch"]),
        (dict(patience=-1), ValueError, ["`patience`", "patience=-1"]),
        (dict(patience=2.5), TypeError, ["`patience`", "int"]),
        (dict(patience=True), TypeError, ["`patience`"]),
        (dict(count=-1), ValueError, ["`count`", "count=-1"]),
        (dict(count=1.5), TypeError, ["`count`", "an int"]),
        (dict(total_resets=-2), ValueError, ["`total_resets`", "total_resets=-2"]),
        (dict(grads_finite=1), TypeError, ["`grads_finite`", "a bool"]),
        (dict(min_scaler=0.0), ValueError, ["`min_scaler`", "min_scaler=0.0"]),
        (dict(max_scaler=1000.0), ValueError, ["`max_scaler`", "power of two"]),
        (dict(max_scaler=2.0**127), ValueError, ["`max_scaler`", "2**126"]),
        (dict(min_scaler=4.0, max_scaler=2.0), ValueError, ["min_scaler=4.0", "max_scaler=2.0"]),
    ],
)
def test_invalid_dynamic_settings(kwargs, error, fragments):
    with pytest.raises(error) as info:
        DynamicScalerState(**kwargs)
    message = str(info.value)
    assert message.startswith("DynamicScalerState:")
    for fragment in fragments:
        assert fragment in message


def test_static_config_must_be_concrete():
    with pytest.raises(TypeError, match="`adjust_factor` is static configuration"):
        jax.jit(lambda f: DynamicScalerState(adjust_factor=f))(2.0)


def test_traced_values_are_accepted_under_jit_and_vmap():
    state = jax.jit(lambda s: DynamicScalerState(scaler=s))(jnp.float32(8))
    assert float(state.scaler) == 8.0
    scales = jax.vmap(lambda s: DynamicScalerState(scaler=s, patience=1).adjust(True))(jnp.array([2.0, 4.0])).scaler
    np.testing.assert_array_equal(scales, [4.0, 8.0])


@pytest.mark.parametrize(
    "build, fragments",
    [
        (lambda: StaticScalerState(3.0), ["StaticScalerState:", "`scaler`", "scaler=3.0"]),
        (lambda: StaticScalerState(0), ["StaticScalerState:", "`scaler`"]),
        (lambda: NoOpScalerState(grads_finite=0.0), ["NoOpScalerState:", "`grads_finite`"]),
    ],
)
def test_invalid_static_and_noop_settings(build, fragments):
    with pytest.raises((TypeError, ValueError)) as info:
        build()
    for fragment in fragments:
        assert fragment in str(info.value)


# ---------------------------------------------------------------- adjust arithmetic

# (grads_finite, scaler, count, total_resets) after each step, computed by hand for
# patience=3, adjust_factor=2, backoff_factor=4, bounds [1, 32], starting at 8.
_HAND_SEQUENCE = [
    (True, 8.0, 1, 0),
    (True, 8.0, 2, 0),
    (True, 16.0, 0, 0),  # growth after exactly 3 finite steps
    (False, 4.0, 0, 1),  # backoff by 4, count reset
    (True, 4.0, 1, 1),
    (False, 1.0, 0, 2),  # 4 / 4
    (False, 1.0, 0, 3),  # 1 / 4 clamps to min_scaler = 1; still counted
    (True, 1.0, 1, 3),
    (True, 1.0, 2, 3),
    (True, 2.0, 0, 3),
    (True, 2.0, 1, 3),
    (True, 2.0, 2, 3),
    (True, 4.0, 0, 3),
    (True, 4.0, 1, 3),
    (True, 4.0, 2, 3),
    (True, 8.0, 0, 3),
    (True, 8.0, 1, 3),
    (True, 8.0, 2, 3),
    (True, 16.0, 0, 3),
    (True, 16.0, 1, 3),
    (True, 16.0, 2, 3),
    (True, 32.0, 0, 3),
    (True, 32.0, 1, 3),
    (True, 32.0, 2, 3),
    (True, 32.0, 0, 3),  # 32 * 2 clamps to max_scaler = 32; count still resets
    (True, 32.0, 1, 3),
    (False, 8.0, 0, 4),
]


def _hand_state():
    return DynamicScalerState(
        patience=3,
        adjust_factor=2.0,
        scaler=8.0,
        backoff_factor=4.0,
        min_scaler=1.0,
        max_scaler=32.0,
    )


@pytest.mark.parametrize("jit", [False, True])
def test_adjust_hand_computed_sequence(jit):
    adjust = jax.jit(type(_hand_state()).adjust) if jit else type(_hand_state()).adjust
    state = _hand_state()
    for step, (finite, scaler, count, resets) in enumerate(_HAND_SEQUENCE):
        state = adjust(state, finite)
        assert _values(state) == {
            "scaler": scaler,
            "count": count,
            "total_resets": resets,
            "grads_finite": finite,
        }, f"step {step}"
        assert state.scaler.dtype == jnp.float32
        assert state.count.dtype == jnp.int32
        assert _config(state) == _config(_hand_state())


def test_growth_after_exactly_patience_steps_default():
    def step(state, _):
        state = state.adjust(True)
        return state, state.scaler

    _, scales = jax.lax.scan(step, DynamicScalerState(), length=4000)
    scales = np.asarray(scales)
    assert np.all(scales[:1999] == 2.0**15)  # steps 1..1999
    assert np.all(scales[1999:3999] == 2.0**16)  # step 2000 grows
    assert scales[3999] == 2.0**17  # step 4000 grows again


def test_patience_two_doubles_every_second_step():
    # jaxamp grows every patience + 1 steps: [S, S, 2S, 2S, 2S, 4S, ...].
    state = DynamicScalerState(patience=2, scaler=4.0)
    scales = []
    for _ in range(6):
        state = state.adjust(True)
        scales.append(float(state.scaler))
    assert scales == [4.0, 8.0, 8.0, 16.0, 16.0, 32.0]


def test_patience_zero_grows_on_every_finite_step():
    state = DynamicScalerState(patience=0, scaler=4.0, max_scaler=16.0)
    scales = []
    for _ in range(4):
        state = state.adjust(True)
        scales.append(float(state.scaler))
    assert scales == [8.0, 16.0, 16.0, 16.0]


def test_never_inf_at_the_top_never_zero_at_the_bottom():
    # jaxamp: scaler=2**127, patience=0 becomes inf; persistent NaNs drive it to 0.
    top = DynamicScalerState(patience=0, adjust_factor=2.0**8, scaler=2.0**126, max_scaler=2.0**126)
    bottom = DynamicScalerState(scaler=2.0**-120, min_scaler=2.0**-126, backoff_factor=2.0**8)
    for _ in range(5):
        top = top.adjust(True)
        bottom = bottom.adjust(False)
    assert float(top.scaler) == 2.0**126
    assert float(bottom.scaler) == 2.0**-126
    assert int(bottom.total_resets) == 5


@jax.jit
def _run_flags(state, flags):
    def step(state, finite):
        state = state.adjust(finite)
        return state, (state.scaler, state.count, state.total_resets)

    return jax.lax.scan(step, state, flags)[1]


@settings(max_examples=40, deadline=None)
@given(
    flags=st.lists(st.booleans(), min_size=64, max_size=64),
    patience=st.sampled_from([0, 1, 3]),
    start=st.integers(-3, 6),
)
def test_adjust_matches_python_model(flags, patience, start):
    state = DynamicScalerState(
        patience=patience,
        scaler=2.0**start,
        backoff_factor=4.0,
        min_scaler=2.0**-3,
        max_scaler=2.0**6,
    )

    scales, counts, resets = map(np.asarray, _run_flags(state, jnp.array(flags)))

    scaler, count, total = 2.0**start, 0, 0
    for i, finite in enumerate(flags):
        if finite:
            count += 1
            if count >= patience:
                scaler, count = min(scaler * 2, 2.0**6), 0
        else:
            scaler, count, total = max(scaler / 4, 2.0**-3), 0, total + 1
        assert (float(scales[i]), int(counts[i]), int(resets[i])) == (scaler, count, total)
        mantissa, _ = math.frexp(float(scales[i]))
        assert mantissa == 0.5  # a power of two


@pytest.mark.parametrize("bad", [jnp.array([True, False]), jnp.float32(1.0)])
def test_adjust_rejects_bad_flag(bad):
    with pytest.raises((TypeError, ValueError), match="grads_finite"):
        DynamicScalerState().adjust(bad)


# ---------------------------------------------------------------- static / no-op


def test_static_scaler_interface():
    state = StaticScalerState(2.0**10)
    assert float(state.scaler) == 1024.0 and bool(state.grads_finite)
    after = state.adjust(False).adjust(False)
    assert float(after.scaler) == 1024.0 and not bool(after.grads_finite)
    assert float(state.scale(jnp.float32(3.0))) == 3072.0
    assert float(state.unscale(jnp.float32(3072.0))) == 3.0


def test_noop_scaler_interface():
    state = NoOpScalerState()
    loss = jnp.bfloat16(3.0)
    grads = {"w": jnp.ones(2, jnp.bfloat16)}
    assert state.scale(loss) is loss
    assert state.unscale(grads) is grads
    assert float(state.scaler) == 1.0 and state.scaler.dtype == jnp.float32
    assert not bool(state.adjust(False).grads_finite)
    assert len(jax.tree.leaves(state)) == 1


# ---------------------------------------------------------------- scale / unscale


def test_scale_widens_float16_so_it_does_not_overflow():
    # MPX multiplies in float16: 3 * 2**15 = inf.
    scaled = DynamicScalerState().scale(jnp.float16(3.0))
    assert scaled.dtype == jnp.float32
    assert float(scaled) == 3.0 * 2**15


@pytest.mark.parametrize(
    "dtype, scaled_dtype",
    [
        (jnp.float16, jnp.float32),
        (jnp.bfloat16, jnp.float32),
        (jnp.float32, jnp.float32),
        (jnp.complex64, jnp.complex64),
    ],
)
def test_unscale_keeps_dtype_and_is_exact(dtype, scaled_dtype):
    state = DynamicScalerState(scaler=2.0**12)
    x = jnp.array([1.5, -0.25, 3.0], dtype)
    assert state.scale(x).dtype == scaled_dtype
    unscaled = state.unscale(x * jnp.asarray(2**12, dtype))  # e.g. a scaled gradient
    assert unscaled.dtype == dtype
    np.testing.assert_array_equal(unscaled, x)


def test_scale_and_unscale_leave_non_floating_leaves():
    state = DynamicScalerState(scaler=4.0)
    tree = {"i": jnp.arange(3), "b": jnp.array(True), "f": jax.nn.relu, "n": None}
    for method in (state.scale, state.unscale):
        out = method(tree)
        assert out["i"] is tree["i"] and out["b"] is tree["b"]
        assert out["f"] is jax.nn.relu and out["n"] is None


# ---------------------------------------------------------------- all_finite


@pytest.mark.parametrize(
    "tree, expected",
    [
        ({}, True),
        ((None, jax.nn.relu, 1.5, "text"), True),
        ({"i": jnp.arange(3), "w": jnp.ones(3)}, True),
        ({"w": jnp.array([1.0, jnp.nan])}, False),
        ([jnp.ones(2), jnp.array([jnp.inf], jnp.float16)], False),
        ({"b": jnp.array([-jnp.inf], jnp.bfloat16)}, False),
        ({"c": jnp.array([1 + 1j, complex(0, math.nan)], jnp.complex64)}, False),
        ({"np": np.array([1.0, np.inf])}, False),
    ],
)
def test_all_finite(tree, expected):
    result = all_finite(tree)
    assert result.shape == () and result.dtype == jnp.bool_
    assert bool(result) is expected
    assert bool(eqx.filter_jit(all_finite)(tree)) is expected


# ---------------------------------------------------------------- select_tree


@pytest.fixture(scope="module")
def mlp():
    # Module scope: built before the strict-promotion fixture, like the other test
    # files' models, so the initialisation is compiled once per session.
    return eqx.nn.MLP(2, 2, 8, 1, key=jax.random.key(0))


def test_select_tree_with_non_array_leaves(mlp):
    # jmp's select_tree raises on the activation-function leaf of an Equinox MLP.
    a = mlp
    b = jax.tree.map(lambda x: x + 1 if eqx.is_array(x) else x, a)
    for pred, expected in ((True, a), (False, b)):
        out = eqx.filter_jit(select_tree)(pred, a, b)
        assert out.activation is a.activation
        for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
            if eqx.is_array(x):
                np.testing.assert_array_equal(x, y)


def test_select_tree_is_bit_identical():
    payload = np.array([0x7FC00001, 0x7F800000, 0x00000001], np.uint32).view(np.float32)
    out = select_tree(jnp.array(False), {"x": jnp.zeros(3)}, {"x": jnp.asarray(payload)})
    np.testing.assert_array_equal(np.asarray(out["x"]).view(np.uint32), payload.view(np.uint32))


@pytest.mark.parametrize(
    "pred, a, b, error, match",
    [
        (jnp.array([True, False]), jnp.ones(2), jnp.ones(2), ValueError, "scalar"),
        (jnp.float32(1), jnp.ones(2), jnp.ones(2), TypeError, "boolean"),
        (True, jnp.ones(2), jnp.ones(3), TypeError, "same shape and dtype"),
        (True, jnp.ones(2), jnp.ones(2, jnp.float16), TypeError, "float16"),
    ],
)
def test_select_tree_errors(pred, a, b, error, match):
    with pytest.raises(error, match=match):
        select_tree(pred, {"x": a}, {"x": b})


# ---------------------------------------------------------------- pytree behaviour


def test_config_survives_tree_map_and_jit():
    # jmp drops min_loss_scale on unflatten: 8 backoffs under jit reach 128, not 1024.
    state = DynamicScalerState(scaler=2.0**15, min_scaler=1024.0)
    state = jax.tree.map(lambda x: x, state)
    adjust = jax.jit(lambda s: s.adjust(False))
    for _ in range(8):
        state = adjust(state)
    assert float(state.scaler) == 1024.0
    assert state.min_scaler == 1024.0


def test_vmap_over_stacked_states():
    states = jax.tree.map(
        lambda *xs: jnp.stack(xs),
        DynamicScalerState(patience=1, scaler=4.0),
        DynamicScalerState(patience=1, scaler=64.0),
    )
    new = jax.vmap(DynamicScalerState.adjust)(states, jnp.array([True, False]))
    np.testing.assert_array_equal(new.scaler, [8.0, 32.0])
    np.testing.assert_array_equal(new.total_resets, [0, 1])
    np.testing.assert_array_equal(new.grads_finite, [True, False])


def test_donation():
    step = jax.jit(lambda s: s.adjust(False), donate_argnums=0)
    state = DynamicScalerState(scaler=16.0)
    new = step(state)
    assert float(new.scaler) == 8.0
    assert state.scaler.is_deleted()


def test_while_loop_carry():
    out = jax.lax.fori_loop(0, 3, lambda i, s: s.adjust(i != 1), DynamicScalerState(scaler=8.0))
    assert _values(out) == {"scaler": 4.0, "count": 1, "total_resets": 1, "grads_finite": True}


# ---------------------------------------------------------------- checkpoints


def _non_default_states():
    dynamic = DynamicScalerState(
        patience=7,
        adjust_factor=4.0,
        scaler=2.0**9,
        count=5,
        total_resets=11,
        backoff_factor=8.0,
        min_scaler=2.0**-4,
        max_scaler=2.0**20,
        grads_finite=False,
    )
    return [dynamic, StaticScalerState(2.0**7, grads_finite=False), NoOpScalerState(grads_finite=False)]


def _template(state):
    """A state with the same configuration and different values."""
    return jax.tree.map(lambda x: jnp.zeros_like(x), state)


def _assert_same(restored, original):
    assert type(restored) is type(original)
    assert _values(restored) == _values(original)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(original)):
        assert a.dtype == b.dtype
    if isinstance(original, DynamicScalerState):
        assert _config(restored) == _config(original)


@pytest.mark.parametrize("state", _non_default_states(), ids=lambda s: type(s).__name__)
def test_pickle_round_trip(state):
    _assert_same(pickle.loads(pickle.dumps(state)), state)


@pytest.mark.parametrize("state", _non_default_states(), ids=lambda s: type(s).__name__)
def test_flax_serialization_round_trip(state):
    data = flax.serialization.to_bytes({"scaler": state, "step": jnp.int32(3)})
    restored = flax.serialization.from_bytes({"scaler": _template(state), "step": jnp.int32(0)}, data)
    _assert_same(restored["scaler"], state)
    # The state dict names the values, so other tools can read it.
    assert set(flax.serialization.to_state_dict(state)) == set(state._leaf_fields)


def test_flax_restore_reports_missing_values():
    with pytest.raises(ValueError, match="lacks \\['count'"):
        flax.serialization.from_state_dict(
            DynamicScalerState(),
            {"scaler": 1.0, "total_resets": 0, "grads_finite": True},
        )


@pytest.mark.parametrize("state", _non_default_states(), ids=lambda s: type(s).__name__)
def test_equinox_serialisation_round_trip(state):
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, state)
    buffer.seek(0)
    _assert_same(eqx.tree_deserialise_leaves(buffer, _template(state)), state)


def test_public_exports():
    for name in (
        "DynamicScalerState",
        "StaticScalerState",
        "NoOpScalerState",
        "all_finite",
        "select_tree",
        "dynamic_scale_grad",
        "dynamic_scale_value_and_grad",
        "optimizer_update",
    ):
        assert name in autocast.__all__ and hasattr(autocast, name)
