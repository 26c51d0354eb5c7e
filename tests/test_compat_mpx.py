"""autocast.compat.mpx side by side with MPX itself (mixed-precision-for-jax 0.1.8, a test
dependency), plus float32 and hand-computed references.

Where MPX has a bug, the test asserts MPX's wrong output and our right one, so a change
in either is noticed.
"""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import mpx
import numpy as np
import optax
import pytest
from helpers import compute_op_dtypes, tree_max_rel_err, walk

import autocast.compat.mpx as ampx

F16_MAX = 65504.0
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


@pytest.fixture(autouse=True)
def _reset_half_dtype():
    """Both libraries keep the half dtype globally: start and end every test at float16."""
    mpx.set_half_precision_datatype(jnp.float16)
    ampx.set_half_precision_datatype(jnp.float16)
    yield
    mpx.set_half_precision_datatype(jnp.float16)
    ampx.set_half_precision_datatype(jnp.float16)


def _fields(tree):
    """Scaling states of either library as a tuple of their MPX fields."""
    kinds = (ampx.DynamicLossScaling, mpx.DynamicLossScaling)
    as_tuple = lambda s: (s.loss_scaling, s.min_loss_scaling, s.counter, s.factor, s.period)
    return jax.tree.map(
        lambda s: as_tuple(s) if isinstance(s, kinds) else s, tree, is_leaf=lambda s: isinstance(s, kinds)
    )


def _assert_same(a, b):
    """Same structure, and every array leaf with the same dtype and bits."""
    la, ta = jax.tree.flatten(_fields(a))
    lb, tb = jax.tree.flatten(_fields(b))
    assert ta == tb
    for x, y in zip(la, lb):
        if eqx.is_array(x):
            assert x.dtype == y.dtype, (x.dtype, y.dtype)
            np.testing.assert_array_equal(np.asarray(x, np.float64), np.asarray(y, np.float64))
        else:
            assert x == y


class _Model(eqx.Module):
    lin1: eqx.nn.Linear
    lin2: eqx.nn.Linear
    act: object = eqx.field(static=True)

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.lin1 = eqx.nn.Linear(4, 16, key=k1)
        self.lin2 = eqx.nn.Linear(16, 2, key=k2)
        self.act = jax.nn.tanh

    def __call__(self, x):
        return self.lin2(self.act(self.lin1(x)))


def _data(n=32):
    x = jax.random.normal(jax.random.key(1), (n, 4))
    y = jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1)
    return x, y


def _loss(model, x, y):
    pred = jax.vmap(model)(x)
    return jnp.mean((pred - y) ** 2)


def _loss_aux(model, x, y):
    pred = jax.vmap(model)(x)
    return jnp.mean((pred - y) ** 2), {"pred": pred}


def _scaling(lib, scale=2.0**10, period=2000, counter=None):
    return lib.DynamicLossScaling(
        loss_scaling=jnp.asarray(scale, jnp.float32),
        min_loss_scaling=jnp.ones((), jnp.float32),
        period=period,
        counter=counter,
    )


# ------------------------------------------------------------------------------------
# Names, signatures, constants
# ------------------------------------------------------------------------------------


def test_every_public_mpx_name_exists_with_compatible_signature():
    names = set(mpx.__all__) | {"FLOAT16_MAX", "BFLOAT16_MAX", "HALF_PRECISION_DATATYPE"}
    assert names <= set(ampx.__all__)
    for name in mpx.__all__:
        theirs, ours = getattr(mpx, name), getattr(ampx, name)
        if not callable(theirs):
            continue
        p_theirs = inspect.signature(theirs).parameters
        p_ours = inspect.signature(ours).parameters
        # Every MPX parameter, in the same position, with the same default.
        assert list(p_ours)[: len(p_theirs)] == list(p_theirs), name
        for pname, param in p_theirs.items():
            if param.default is not inspect.Parameter.empty and pname != "return_dtype":
                assert p_ours[pname].default == param.default, (name, pname)
        # Our extras are keyword-only or defaulted, so MPX calls still bind.
        for pname in list(p_ours)[len(p_theirs) :]:
            assert p_ours[pname].default is not inspect.Parameter.empty, (name, pname)


def test_max_constants_match_mpx_and_finfo():
    for name, dtype in [("FLOAT16_MAX", jnp.float16), ("BFLOAT16_MAX", jnp.bfloat16)]:
        ours, theirs = getattr(ampx, name), getattr(mpx, name)
        assert ours.dtype == theirs.dtype == jnp.float32 and ours.shape == theirs.shape == ()
        assert float(ours) == float(theirs) == float(jnp.finfo(dtype).max)
    assert float(ampx.FLOAT16_MAX) == F16_MAX


def test_half_precision_datatype_attribute_follows_the_setting():
    assert ampx.HALF_PRECISION_DATATYPE == jnp.float16 == mpx.HALF_PRECISION_DATATYPE
    ampx.set_half_precision_datatype(jnp.bfloat16)
    mpx.set_half_precision_datatype(jnp.bfloat16)
    assert ampx.HALF_PRECISION_DATATYPE == jnp.bfloat16
    assert mpx.HALF_PRECISION_DATATYPE == jnp.float16  # MPX: a copy taken at import


# ------------------------------------------------------------------------------------
# Casting
# ------------------------------------------------------------------------------------


def _mixed_tree():
    return {
        "f32": jnp.linspace(-3, 3, 5, dtype=jnp.float32),
        "f16": jnp.array([1.5, -2.25], jnp.float16),
        "bf16": jnp.array([0.1, 7.0], jnp.bfloat16),
        "int": jnp.arange(3, dtype=jnp.int32),
        "bool": jnp.array([True, False]),
        "np": np.array([0.3, 70000.0], np.float32),
        "py": 0.5,
        "none": None,
        "model": _Model(jax.random.key(0)),
    }


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 70000 -> inf in float16, in both
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_cast_tree_matches_mpx(dtype):
    tree = _mixed_tree()
    ours = ampx.cast_tree(tree, dtype)
    _assert_same(ours, mpx.cast_tree(tree, dtype))
    assert ours["int"].dtype == jnp.int32 and ours["bool"].dtype == jnp.bool_
    assert ours["py"] == 0.5 and ours["model"].lin1.weight.dtype == dtype
    assert ours["f32"].dtype == dtype


def test_cast_tree_leaves_keys_and_plain_objects_alone():
    class Holder:  # not a pytree node: a leaf, not entered (as in MPX)
        def __init__(self):
            self.w = jnp.ones(2)

    key = jax.random.key(0)
    tree = {"key": key, "holder": Holder(), "w": jnp.ones(2)}
    out = ampx.cast_tree(tree, jnp.float16)
    assert out["key"] is key and out["holder"].w.dtype == jnp.float32
    assert out["w"].dtype == jnp.float16
    with pytest.raises(ValueError, match="dtype=int32"):
        ampx.cast_tree(tree, jnp.int32)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_cast_helpers_match_mpx():
    tree = _mixed_tree()
    for name in [
        "cast_to_float32",
        "cast_to_float16",
        "cast_to_bfloat16",
        "cast_to_full_precision",
        "cast_to_half_precision",
    ]:
        _assert_same(getattr(ampx, name)(tree), getattr(mpx, name)(tree))
    assert ampx.cast_to_half_precision(tree)["f32"].dtype == jnp.float16
    assert ampx.cast_to_half_precision(tree, half_dtype="bf16")["f32"].dtype == jnp.bfloat16


def test_set_half_precision_datatype_with_dtype_matches_mpx():
    mpx.set_half_precision_datatype(jnp.bfloat16)
    ampx.set_half_precision_datatype(jnp.bfloat16)
    assert ampx.half_precision_datatype() == mpx.half_precision_datatype() == jnp.bfloat16
    x = jnp.ones(3)
    _assert_same(ampx.cast_to_half_precision(x), mpx.cast_to_half_precision(x))


def test_set_half_precision_datatype_string_bug_fixed():
    mpx.set_half_precision_datatype("bfloat16")
    ampx.set_half_precision_datatype("bfloat16")
    assert mpx.half_precision_datatype() == jnp.float16  # MPX: silently ignored
    assert ampx.half_precision_datatype() == jnp.bfloat16
    assert ampx.cast_to_half_precision(jnp.ones(2)).dtype == jnp.bfloat16
    ampx.set_half_precision_datatype("float16")
    assert ampx.half_precision_datatype() == jnp.float16


def test_set_half_precision_datatype_rejects_like_mpx_with_clear_messages():
    for bad, exc in [("float32", ValueError), (jnp.float32, TypeError), (3, TypeError)]:
        with pytest.raises(exc):
            mpx.set_half_precision_datatype(bad)
        with pytest.raises(exc, match="datatype=.*allowed: jnp.float16, jnp.bfloat16"):
            ampx.set_half_precision_datatype(bad)
    assert ampx.half_precision_datatype() == jnp.float16


# ------------------------------------------------------------------------------------
# cast_function / force_full_precision
# ------------------------------------------------------------------------------------


def _two_outputs(x, w):
    return x @ w, jnp.sum(x)


def test_cast_function_matches_mpx_on_tuples_and_arrays():
    x = jax.random.normal(jax.random.key(2), (4, 8))
    w = jax.random.normal(jax.random.key(3), (8, 3))
    for args in [(jnp.float16,), (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.float16)]:
        _assert_same(ampx.cast_function(_two_outputs, *args)(x, w), mpx.cast_function(_two_outputs, *args)(x, w))
        _assert_same(ampx.cast_function(jnp.matmul, *args)(x, w), mpx.cast_function(jnp.matmul, *args)(x, w))
    out = ampx.cast_function(_two_outputs, jnp.float16)(x, w)
    np.testing.assert_allclose(out[0], x @ w, rtol=1e-2, atol=1e-2)


def test_cast_function_casts_dict_outputs_mpx_does_not():
    def f(x):
        return {"y": x * 2}

    x = jnp.ones(3, jnp.float16)
    assert mpx.cast_function(f, jnp.float16, jnp.float32)(x)["y"].dtype == jnp.float16  # MPX: uncast
    assert ampx.cast_function(f, jnp.float16, jnp.float32)(x)["y"].dtype == jnp.float32


def test_cast_function_automatic_uses_per_primitive_rules():
    def f(x, w):
        return jax.nn.logsumexp(x @ w, axis=-1).mean()

    x = jax.random.normal(jax.random.key(4), (16, 32))
    w = jax.random.normal(jax.random.key(5), (32, 8))
    auto = ampx.cast_function(f, jnp.float16, automatic=True)
    out = auto(x, w)
    assert out.dtype == jnp.float32  # the dtype f returns
    np.testing.assert_allclose(out, f(x, w), rtol=2e-3)
    counts = compute_op_dtypes(auto, x, w)
    assert counts[("dot_general", "float16", False)] == 1 and sum(counts.values()) == 1
    # Plain casting runs the whole function (logsumexp too) in float16.
    assert ampx.cast_function(f, jnp.float16)(x, w).dtype == jnp.float16
    with pytest.raises(ValueError, match="automatic=True"):
        ampx.cast_function(f, jnp.float16, amp_policy={})


def test_force_full_precision_computes_in_float32():
    def norm(x):
        return jnp.sqrt(jnp.sum(x * x)), x.dtype == jnp.float32

    x = jnp.full((4,), 1000.0, jnp.float16)  # x * x overflows float16
    assert not np.isfinite(float(norm(x)[0]))
    for lib in (mpx, ampx):
        value, was_f32 = lib.force_full_precision(norm)(x)
        assert float(value) == 2000.0 and value.dtype == jnp.float16 and bool(was_f32)


def test_force_full_precision_return_dtype_default_fixed():
    def f(x):
        return x * 3

    x32 = jnp.ones(2, jnp.float32)
    assert mpx.force_full_precision(f)(x32).dtype == jnp.float16  # MPX: float32 caller gets float16
    assert ampx.force_full_precision(f)(x32).dtype == jnp.float32
    mpx.set_half_precision_datatype(jnp.bfloat16)
    ampx.set_half_precision_datatype(jnp.bfloat16)
    xb = jnp.ones(2, jnp.bfloat16)
    assert mpx.force_full_precision(f)(xb).dtype == jnp.float16  # MPX: bfloat16 caller gets float16
    assert ampx.force_full_precision(f)(xb).dtype == jnp.bfloat16
    # An explicit return_dtype behaves as in MPX.
    _assert_same(ampx.force_full_precision(f, jnp.bfloat16)(x32), mpx.force_full_precision(f, jnp.bfloat16)(x32))


# ------------------------------------------------------------------------------------
# DynamicLossScaling
# ------------------------------------------------------------------------------------


def test_scaling_fields_and_pytree_match_mpx():
    ours, theirs = _scaling(ampx), _scaling(mpx)
    for field in ["loss_scaling", "min_loss_scaling", "counter"]:
        _assert_same(getattr(ours, field), getattr(theirs, field))
    assert (ours.factor, ours.period) == (theirs.factor, theirs.period) == (2, 2000)
    assert len(jax.tree.leaves(ours)) == len(jax.tree.leaves(theirs))
    # Through jit and back, configuration intact.
    back = eqx.filter_jit(lambda s: s)(ours)
    assert back.period == 2000 and float(back.loss_scaling) == 2.0**10


def test_scale_and_unscale_match_mpx_for_float32():
    tree = {"a": jnp.array([1.0, -3.0, 1e-3]), "b": [jnp.array([7.0])]}
    for scale in [2.0**10, F16_MAX, 3.0]:
        ours, theirs = _scaling(ampx, scale), _scaling(mpx, scale)
        _assert_same(ours.scale(tree), theirs.scale(tree))
        _assert_same(ours.unscale(tree), theirs.unscale(tree))
        np.testing.assert_allclose(ours.unscale(ours.scale(tree))["a"], tree["a"], rtol=1e-6)


def test_scale_float16_loss_in_float32_mpx_overflows():
    loss = jnp.asarray(3.0, jnp.float16)
    assert np.isinf(float(_scaling(mpx, 2.0**15).scale(loss)))  # MPX: float16 product
    out = _scaling(ampx, 2.0**15).scale(loss)
    assert out.dtype == jnp.float32 and float(out) == 3.0 * 2**15
    # unscale returns float32, as in MPX (so scaled float16 gradients keep their precision).
    g = jnp.asarray(2.0**12, jnp.float16)
    _assert_same(_scaling(ampx, 2.0**15).unscale(g), _scaling(mpx, 2.0**15).unscale(g))


def test_adjust_sequence_matches_mpx():
    flags = [True, True, True, False, True, True, True, True, False, False] + [True] * 12
    for start in [2.0**10, 3.0, F16_MAX, 2.0]:
        ours, theirs = _scaling(ampx, start, period=3), _scaling(mpx, start, period=3)
        for flag in flags:
            ours, theirs = ours.adjust(jnp.array(flag)), theirs.adjust(jnp.array(flag))
            _assert_same((ours.loss_scaling, ours.counter), (theirs.loss_scaling, theirs.counter))
    # Hand-computed: period 3, start 4 -> growth on the 3rd finite step, halving on a bad one.
    s = _scaling(ampx, 4.0, period=3)
    seen = []
    for flag in [True, True, True, False, True]:
        s = s.adjust(jnp.array(flag))
        seen.append((float(s.loss_scaling), int(s.counter)))
    assert seen == [(4.0, 1), (4.0, 2), (8.0, 0), (4.0, 0), (4.0, 1)]


def test_adjust_bound_follows_half_dtype_mpx_always_float16():
    mpx.set_half_precision_datatype(jnp.bfloat16)
    ampx.set_half_precision_datatype(jnp.bfloat16)
    ours, theirs = _scaling(ampx, 2.0**15, period=1), _scaling(mpx, 2.0**15, period=1)
    assert ours.half_dtype == jnp.bfloat16
    ours, theirs = ours.adjust(jnp.array(True)), theirs.adjust(jnp.array(True))
    assert float(theirs.loss_scaling) == F16_MAX  # MPX: float16 bound with bfloat16
    assert float(ours.loss_scaling) == 2.0**16
    # float16 (explicit here): the bound is float16's maximum, as in MPX.
    f16 = ampx.DynamicLossScaling(jnp.float32(2.0**15), jnp.float32(1.0), period=1, half_dtype="float16")
    assert float(f16.adjust(jnp.array(True)).loss_scaling) == F16_MAX
    # bfloat16 bound: never above bfloat16's maximum.
    big = ampx.DynamicLossScaling(jnp.float32(BF16_MAX), jnp.float32(1.0), period=1)
    assert float(big.adjust(jnp.array(True)).loss_scaling) == BF16_MAX


def test_scaling_accepts_shape_one_and_python_numbers():
    s = ampx.DynamicLossScaling(loss_scaling=jnp.array([2.0**4]), min_loss_scaling=1.0, period=1)
    s = s.adjust(jnp.array(True))
    assert s.loss_scaling.shape == (1,) and s.counter.shape == (1,) and float(s.loss_scaling[0]) == 32.0
    assert ampx.DynamicLossScaling(8.0, 1.0).loss_scaling.dtype == jnp.float32


def test_scaling_rejects_bad_values_with_clear_messages():
    with pytest.raises(ValueError, match="`loss_scaling` must be a scalar.*shape \\(3,\\)"):
        ampx.DynamicLossScaling(jnp.ones(3), jnp.ones(()))
    with pytest.raises(ValueError, match="`min_loss_scaling` must be a positive number"):
        ampx.DynamicLossScaling(jnp.ones(()), jnp.zeros(()))
    with pytest.raises(ValueError, match="`factor` must be > 1; got 1"):
        ampx.DynamicLossScaling(jnp.ones(()), jnp.ones(()), factor=1)
    with pytest.raises(ValueError, match="`period` must be a positive integer; got 0"):
        ampx.DynamicLossScaling(jnp.ones(()), jnp.ones(()), period=0)
    with pytest.raises(TypeError, match="grads_finite"):
        _scaling(ampx).adjust(jnp.array(1.0))


# ------------------------------------------------------------------------------------
# Tree helpers and the optimizer step
# ------------------------------------------------------------------------------------


def test_all_finite_and_select_tree_match_mpx():
    good = {"a": jnp.ones(3), "b": [jnp.array(2.0, jnp.float16)], "i": jnp.arange(2)}
    bad = {"a": jnp.array([1.0, jnp.nan, 0.0]), "b": [jnp.array(2.0, jnp.float16)], "i": jnp.arange(2)}
    for tree in [good, bad, {}, {"x": float("inf")}, {"x": 1.0}]:
        assert bool(ampx.all_finite(tree)) == bool(mpx.all_finite(tree))
    assert bool(ampx.all_finite(good)) and not bool(ampx.all_finite(bad))
    for pred in [True, False]:
        _assert_same(ampx.select_tree(jnp.array(pred), good, bad), mpx.select_tree(jnp.array(pred), good, bad))
    # Non-array leaves (an activation function) come from the first tree; MPX fails there.
    out = ampx.select_tree(
        jnp.array(False), {"f": jax.nn.relu, "w": jnp.ones(1)}, {"f": jax.nn.relu, "w": jnp.zeros(1)}
    )
    assert out["f"] is jax.nn.relu and float(out["w"][0]) == 0.0


def test_optimizer_update_matches_mpx():
    model = _Model(jax.random.key(0))
    optim = optax.adam(1e-2)
    state = optim.init(eqx.filter(model, eqx.is_array))
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), eqx.filter(model, eqx.is_array))
    for finite in [True, False]:
        ours = ampx.optimizer_update(model, optim, state, grads, jnp.array(finite))
        theirs = mpx.optimizer_update(model, optim, state, grads, jnp.array(finite))
        _assert_same(eqx.filter(ours, eqx.is_array), eqx.filter(theirs, eqx.is_array))
    unchanged = ampx.optimizer_update(model, optim, state, grads, jnp.array(False))
    _assert_same(eqx.filter(unchanged[0], eqx.is_array), eqx.filter(model, eqx.is_array))


# ------------------------------------------------------------------------------------
# scaled / calculate_scaled_grad / filter_grad / filter_value_and_grad
# ------------------------------------------------------------------------------------


def test_scaled_and_calculate_scaled_grad_match_mpx():
    model, (x, y) = _Model(jax.random.key(0)), _data()
    for has_aux, fn in [(False, _loss), (True, _loss_aux)]:
        ours = ampx.scaled(fn, _scaling(ampx), has_aux=has_aux)(model, x, y)
        theirs = mpx.scaled(fn, _scaling(mpx), has_aux=has_aux)(model, x, y)
        _assert_same(ours, theirs)
        for mixed in [True, False]:
            ours = ampx.calculate_scaled_grad(fn, _scaling(ampx), has_aux, mixed)(model, x, y)
            theirs = mpx.calculate_scaled_grad(fn, _scaling(mpx), has_aux, mixed)(model, x, y)
            # float16 loss times 2**10: float16 (MPX) or float32 (ours), same value.
            ours_np = jax.tree.map(lambda a: np.asarray(a, np.float32) if eqx.is_array(a) else a, ours)
            theirs_np = jax.tree.map(lambda a: np.asarray(a, np.float32) if eqx.is_array(a) else a, theirs)
            _assert_same(ours_np, theirs_np)


@pytest.mark.parametrize("has_aux", [False, True])
@pytest.mark.parametrize("half", [jnp.float16, jnp.bfloat16])
def test_gradient_wrappers_match_mpx_and_float32(has_aux, half):
    mpx.set_half_precision_datatype(half)
    ampx.set_half_precision_datatype(half)
    model, (x, y) = _Model(jax.random.key(0)), _data()
    fn = _loss_aux if has_aux else _loss
    ref_value, ref_grads = eqx.filter_value_and_grad(_loss)(model, x, y)

    ours = ampx.filter_value_and_grad(fn, _scaling(ampx), has_aux=has_aux)(model, x, y)
    theirs = mpx.filter_value_and_grad(fn, _scaling(mpx), has_aux=has_aux)(model, x, y)
    _assert_same(ours, theirs)  # no growth step: bit-identical
    value, new, finite, grads = ours
    value = value[0] if has_aux else value
    assert value.dtype == jnp.float32 and bool(finite) and int(new.counter) == 1
    tol = 2e-2 if half == jnp.float16 else 6e-2
    assert abs(float(value) - float(ref_value)) < tol * float(ref_value)
    assert tree_max_rel_err(grads, ref_grads) < tol
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))

    ours = ampx.filter_grad(fn, _scaling(ampx), has_aux=has_aux)(model, x, y)
    theirs = mpx.filter_grad(fn, _scaling(mpx), has_aux=has_aux)(model, x, y)
    _assert_same(ours, theirs)
    assert len(ours) == (4 if has_aux else 3)
    assert ampx.filter_grad(fn, _scaling(ampx)).__name__ == fn.__name__  # functools.wraps
    _assert_same(ours[2], grads)


@pytest.mark.parametrize("has_aux", [False, True])
def test_use_mixed_precision_false_matches_mpx(has_aux):
    model, (x, y) = _Model(jax.random.key(0)), _data()
    fn = _loss_aux if has_aux else _loss
    for name in ["filter_grad", "filter_value_and_grad"]:
        ours = getattr(ampx, name)(fn, _scaling(ampx), has_aux, False)(model, x, y)
        theirs = getattr(mpx, name)(fn, _scaling(mpx), has_aux, False)(model, x, y)
        _assert_same(ours, theirs)
    _, ref = eqx.filter_value_and_grad(_loss)(model, x, y)
    _assert_same(ours[-1], ref)


def test_growth_step_unscales_with_the_scale_used_mpx_halves():
    """period=1: every finite step doubles the scale. MPX unscales with the doubled one."""
    model, (x, y) = _Model(jax.random.key(0)), _data()
    steady = ampx.filter_value_and_grad(_loss, _scaling(ampx))(model, x, y)
    ours = ampx.filter_value_and_grad(_loss, _scaling(ampx, period=1))(model, x, y)
    theirs = mpx.filter_value_and_grad(_loss, _scaling(mpx, period=1))(model, x, y)
    assert float(ours[1].loss_scaling) == float(theirs[1].loss_scaling) == 2.0**11
    _assert_same(ours[0], steady[0])
    _assert_same(ours[3], steady[3])
    assert float(theirs[0]) == float(ours[0]) / 2  # MPX: logged loss halved
    _assert_same(theirs[3], jax.tree.map(lambda g: g / 2, ours[3]))  # MPX: gradients halved
    g_ours = ampx.filter_grad(_loss, _scaling(ampx, period=1))(model, x, y)[2]
    g_theirs = mpx.filter_grad(_loss, _scaling(mpx, period=1))(model, x, y)[2]
    _assert_same(g_ours, ours[3])
    _assert_same(g_theirs, theirs[3])


def test_float16_max_initial_scale_value_is_finite_mpx_reports_inf():
    """MPX's recommended start, FLOAT16_MAX, times a float16 loss above 1."""
    model, (x, y) = _Model(jax.random.key(0)), _data()
    y = y * 10  # loss well above 1
    ref_value, ref_grads = eqx.filter_value_and_grad(_loss)(model, x, y)
    assert float(ref_value) > 1
    ours = ampx.filter_value_and_grad(_loss, _scaling(ampx, ampx.FLOAT16_MAX))(model, x, y)
    theirs = mpx.filter_value_and_grad(_loss, _scaling(mpx, mpx.FLOAT16_MAX))(model, x, y)
    assert np.isinf(float(theirs[0]))  # MPX: inf logged
    assert abs(float(ours[0]) - float(ref_value)) < 2e-2 * float(ref_value)
    assert bool(ours[2]) == bool(theirs[2])  # both see the same gradients
    if bool(ours[2]):
        assert tree_max_rel_err(ours[3], ref_grads) < 2e-2


def test_nonfinite_loss_skips_and_backs_off_like_mpx():
    model, (x, y) = _Model(jax.random.key(0)), _data()

    def bad(model, x, y):
        return jnp.inf * _loss(model, x, y)

    ours = ampx.filter_value_and_grad(bad, _scaling(ampx))(model, x, y)
    theirs = mpx.filter_value_and_grad(bad, _scaling(mpx))(model, x, y)
    assert not bool(ours[2]) and not bool(theirs[2])
    assert float(ours[1].loss_scaling) == float(theirs[1].loss_scaling) == 2.0**9


def test_gradient_wrapper_errors_name_the_argument():
    model, (x, y) = _Model(jax.random.key(0)), _data()
    with pytest.raises(TypeError, match="`scaling` must be an mpx.DynamicLossScaling"):
        ampx.filter_grad(_loss, scaling=2.0**10)(model, x, y)
    with pytest.raises(TypeError, match="scalar floating-point"):
        ampx.filter_value_and_grad(lambda m, x, y: jax.vmap(m)(x), _scaling(ampx))(model, x, y)
    with pytest.raises(ValueError, match="half_dtype='float32'"):
        ampx.filter_grad(_loss, _scaling(ampx), half_dtype="float32")


def test_automatic_keyword_runs_matmuls_in_half_and_matches_float32():
    model, (x, y) = _Model(jax.random.key(0)), _data()
    ref_value, ref_grads = eqx.filter_value_and_grad(_loss)(model, x, y)
    fn = ampx.filter_value_and_grad(_loss, _scaling(ampx), automatic=True)
    value, new, finite, grads = fn(model, x, y)
    assert bool(finite) and value.dtype == jnp.float32
    assert abs(float(value) - float(ref_value)) < 1e-2 * float(ref_value)
    assert tree_max_rel_err(grads, ref_grads) < 2e-2
    counts = compute_op_dtypes(lambda m: fn(m, x, y)[3], model)
    assert counts[("dot_general", "float16", False)] >= 2
    assert counts[("dot_general", "float32", False)] == 0


# ------------------------------------------------------------------------------------
# The training step of MPX's README, unchanged, with either module
# ------------------------------------------------------------------------------------


def _train(lib, steps=40):
    model = _Model(jax.random.key(0))
    optimizer = optax.adam(1e-2)
    optimizer_state = optimizer.init(eqx.filter(model, eqx.is_array))
    loss_scaling = lib.DynamicLossScaling(
        loss_scaling=lib.FLOAT16_MAX, min_loss_scaling=jnp.ones((), dtype=jnp.float32), period=2000
    )
    x, y = _data(64)
    y = 3 * y  # a loss above 1

    @eqx.filter_jit
    def make_step(model, optimizer_state, loss_scaling, x, y):
        (loss_value, _), loss_scaling, grads_finite, grads = lib.filter_value_and_grad(
            _loss_aux, scaling=loss_scaling, has_aux=True
        )(model, x, y)
        model, optimizer_state = lib.optimizer_update(model, optimizer, optimizer_state, grads, grads_finite)
        return model, optimizer_state, loss_scaling, loss_value

    losses = []
    for _ in range(steps):
        model, optimizer_state, loss_scaling, loss = make_step(model, optimizer_state, loss_scaling, x, y)
        losses.append(float(loss))
    return model, losses, loss_scaling


def _train_float32(steps=40):
    model = _Model(jax.random.key(0))
    optimizer = optax.adam(1e-2)
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    x, y = _data(64)
    y = 3 * y

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss

    for _ in range(steps):
        model, state, _ = step(model, state)
    return model


def test_mpx_readme_training_step_runs_unchanged_and_matches_float32():
    ours, ours_losses, ours_scaling = _train(ampx)
    theirs, theirs_losses, theirs_scaling = _train(mpx)
    ref = _train_float32()
    assert ours_losses[-1] < 0.7 * ours_losses[0]
    assert all(np.isfinite(ours_losses))
    assert np.isinf(theirs_losses[0])  # MPX logs inf at FLOAT16_MAX
    finite = np.isfinite(theirs_losses)  # where MPX's value survives, it is ours
    np.testing.assert_allclose(np.array(ours_losses)[finite], np.array(theirs_losses)[finite], rtol=1e-3)
    assert float(ours_scaling.loss_scaling) == float(theirs_scaling.loss_scaling)
    params = eqx.filter(ours, eqx.is_array)
    assert tree_max_rel_err(params, eqx.filter(ref, eqx.is_array)) < 1e-2
    assert tree_max_rel_err(params, eqx.filter(theirs, eqx.is_array)) < 1e-3
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))


def test_sharded_step_as_in_mpx_readme_matches_one_device():
    """MPX's README shards the batch and replicates model and scaling with eqx.filter_shard."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("batch",))
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    model, (x, y) = _Model(jax.random.key(0)), _data(64)

    @eqx.filter_jit
    def step(model, loss_scaling, x, y):
        x, y = eqx.filter_shard((x, y), batch_sharding)
        model = eqx.filter_shard(model, replicated)
        value, loss_scaling, finite, grads = ampx.filter_value_and_grad(_loss, scaling=loss_scaling)(model, x, y)
        return value, eqx.filter_shard(loss_scaling, replicated), finite, grads

    sharded = step(model, _scaling(ampx, period=1), x, y)
    single = ampx.filter_value_and_grad(_loss, _scaling(ampx, period=1))(model, x, y)
    assert sharded[1].loss_scaling.sharding.is_fully_replicated
    assert float(sharded[1].loss_scaling) == float(single[1].loss_scaling) == 2.0**11
    np.testing.assert_allclose(float(sharded[0]), float(single[0]), rtol=1e-3)
    assert tree_max_rel_err(sharded[3], single[3]) < 1e-2


def test_half_dtype_is_read_when_the_wrapper_is_built_or_pinned_per_call():
    model, (x, y) = _Model(jax.random.key(0)), _data()
    scaling = _scaling(ampx)
    assert scaling.half_dtype == jnp.float16

    @eqx.filter_jit
    def step(model, scaling, x, y):
        return ampx.filter_value_and_grad(_loss, scaling)(model, x, y)[3]

    def jaxpr_dtypes(fn):
        jaxpr = jax.make_jaxpr(lambda x: fn(x)[3])(x)
        return {str(e.invars[0].aval.dtype) for e, _ in walk(jaxpr) if e.primitive.name == "dot_general"}

    first = step(model, scaling, x, y)
    ampx.set_half_precision_datatype("bfloat16")
    _assert_same(step(model, scaling, x, y), first)  # compiled: keeps float16
    assert scaling.half_dtype == jnp.float16 and _scaling(ampx).half_dtype == jnp.bfloat16
    assert jaxpr_dtypes(lambda x: ampx.filter_value_and_grad(_loss, scaling)(model, x, y)) == {"bfloat16"}
    pinned = lambda x: ampx.filter_value_and_grad(_loss, scaling, half_dtype="float16")(model, x, y)
    assert jaxpr_dtypes(pinned) == {"float16"}
