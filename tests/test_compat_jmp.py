"""autocast.compat.jmp: jmp 0.0.4's API, checked side by side with the real jmp
(a test dependency): same results where jmp is right, the fix where it has a bug."""

import inspect
import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import jmp as real
import numpy as np
import pytest
from jmp._src import policy as real_policy  # dtype_to_names is not re-exported by jmp

import autocast.compat.jmp as jmp


def _dtypes(tree):
    return jax.tree.map(lambda x: str(x.dtype) if hasattr(x, "dtype") else type(x).__name__, tree)


# ---------------------------------------------------------------------------------
# The API surface.
# ---------------------------------------------------------------------------------


def test_every_name_jmp_exports_exists_with_jmps_parameters():
    assert set(real.__all__) <= set(jmp.__all__)
    assert jmp.__version__ == real.__version__ == "0.0.4"
    callables = (
        "get_policy",
        "cast_to_full",
        "cast_to_half",
        "half_dtype",
        "all_finite",
        "select_tree",
        "Policy",
        "StaticLossScale",
        "DynamicLossScale",
        "NoOpLossScale",
    )
    for name in callables:
        ours, theirs = inspect.signature(getattr(jmp, name)), inspect.signature(getattr(real, name))
        positional = [p for p in ours.parameters.values() if p.kind is not p.KEYWORD_ONLY]
        assert [p.name for p in positional] == list(theirs.parameters), name
    for cls, methods in {
        "Policy": ("cast_to_param", "cast_to_compute", "cast_to_output", "with_output_dtype"),
        "DynamicLossScale": ("scale", "unscale", "adjust"),
        "StaticLossScale": ("scale", "unscale", "adjust"),
        "NoOpLossScale": ("scale", "unscale", "adjust"),
    }.items():
        for method in methods:
            ours = inspect.signature(getattr(getattr(jmp, cls), method))
            theirs = inspect.signature(getattr(getattr(real, cls), method))
            assert list(ours.parameters) == list(theirs.parameters), (cls, method)
    ls = jmp.DynamicLossScale(jnp.float32(2.0**15))
    assert (ls.period, ls.factor, ls.min_loss_scale, int(ls.counter)) == (2000, 2, 1, 0)


# ---------------------------------------------------------------------------------
# Policies.
# ---------------------------------------------------------------------------------

GOOD_POLICIES = [
    "float32",
    "full",
    "f32",
    "half",
    "float16",
    "f16",
    "bf16",
    "bfloat16",
    "c=f16",
    "c=half",
    "p=f16",
    "p=f16,c=f32",
    "c=bf16,o=full",
    "p=f32,c=f16,o=f32",
    "params=bfloat16,compute=float16,output=float32",
    "o=f16",
    "c=f16,p=bf16",
]


@pytest.mark.parametrize("name", GOOD_POLICIES)
def test_get_policy_grammar_matches_jmp(name):
    ours, theirs = jmp.get_policy(name), real.get_policy(name)
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
        assert np.dtype(getattr(ours, field)) == np.dtype(getattr(theirs, field)), (name, field)
    assert str(ours) == str(theirs)
    assert jmp.get_policy(str(ours)) == ours  # str() round trips


@pytest.mark.parametrize("name", ["compute_float16", "x=f16", "c=f8", "c=", "", "c=f16=f32", "c=f16,"])
def test_get_policy_rejects_what_jmp_rejects(name):
    with pytest.raises(ValueError):
        real.get_policy(name)
    with pytest.raises(ValueError, match=r"Unknown|key=dtype"):
        jmp.get_policy(name)


def test_get_policy_errors_name_the_problem():
    with pytest.raises(ValueError, match="given twice"):
        jmp.get_policy("c=f16,c=bf16")  # jmp: the last one silently wins
    with pytest.raises(ValueError, match="'compute_float16'.*'half'"):
        jmp.get_policy("compute_float16")
    with pytest.raises(TypeError, match="policy_name"):
        jmp.get_policy(jnp.float16)
    with pytest.raises(TypeError, match="compute_dtype"):
        jmp.Policy(jnp.float32, jnp.int32, jnp.float32)
    assert str(jmp.get_policy(" p = f32 , c = f16 ")) == "p=full,c=f16,o=f16"


def _mixed_tree():
    return {
        "f32": jnp.ones(3),
        "f16": jnp.ones(3, jnp.float16),
        "bf16": jnp.ones(3, jnp.bfloat16),
        "np64": np.ones(3),  # NumPy's default float: float32 once on a device
        "np32": np.ones(3, np.float32),
        "int": jnp.arange(3),
        "bool": jnp.ones(3, bool),
        "key": jax.random.key(0),
        "py": 1.5,
        "fn": jax.nn.relu,
    }


@pytest.mark.parametrize("policy", ["c=f16", "c=bf16", "p=f16,c=f32", "full", "half"])
def test_policy_casts_give_jmps_dtypes(policy):
    ours, theirs = jmp.get_policy(policy), real.get_policy(policy)
    tree = _mixed_tree()
    for cast in ("cast_to_param", "cast_to_compute", "cast_to_output"):
        got = getattr(ours, cast)(tree)
        assert _dtypes(got) == _dtypes(getattr(theirs, cast)(tree)), cast
        assert type(got["np64"]) is np.ndarray  # NumPy stays NumPy, as in jmp
        assert got["fn"] is jax.nn.relu and got["py"] == 1.5
        assert got["int"] is tree["int"] and got["key"] is tree["key"]
        np.testing.assert_array_equal(np.asarray(got["f32"], np.float32), np.ones(3, np.float32))
    assert _dtypes(jmp.cast_to_half(tree)) == _dtypes(real.cast_to_half(tree))
    assert _dtypes(jmp.cast_to_full(tree)) == _dtypes(real.cast_to_full(tree))


def test_policy_with_dtype_copies():
    policy = jmp.get_policy("p=f32,c=f16,o=f32")
    assert policy.with_output_dtype(jnp.bfloat16) == jmp.Policy(jnp.float32, jnp.float16, jnp.bfloat16)
    assert policy.with_compute_dtype(jnp.bfloat16).compute_dtype == jnp.bfloat16
    assert policy.with_param_dtype(jnp.float16).param_dtype == jnp.float16
    assert policy.compute_dtype == jnp.float16  # frozen: the original is unchanged
    for dtype in (jnp.bfloat16, jnp.float16, np.float32, jnp.float64):
        assert jmp.dtype_to_names[dtype] == real_policy.dtype_to_names[dtype]
    assert jmp.dtype_to_names[np.dtype("float16")] == ("f16", "float16")
    assert jnp.float64 in jmp.dtype_to_names and jnp.int32 not in jmp.dtype_to_names
    assert jmp.half_dtype() == real.half_dtype() == jnp.float16  # CPU


def test_float64_is_not_rounded_to_half_under_x64():
    with jax.enable_x64(True):
        tree = {"f64": jnp.ones(3, jnp.float64), "f32": jnp.ones(3, jnp.float32)}
        assert _dtypes(real.cast_to_half(tree)) == {"f64": "float16", "f32": "float16"}  # jmp's bug
        assert _dtypes(jmp.cast_to_half(tree)) == {"f64": "float64", "f32": "float16"}
        assert _dtypes(jmp.get_policy("c=bf16").cast_to_compute(tree)) == {"f64": "float64", "f32": "bfloat16"}
        f8 = {"f8": jnp.ones(3, jnp.float8_e4m3fn)}
        assert _dtypes(real.cast_to_half(f8)) == {"f8": "float16"}
        assert _dtypes(jmp.cast_to_half(f8)) == {"f8": "float8_e4m3fn"}
        # An explicit float64 policy still widens float32.
        assert _dtypes(jmp.get_policy("p=f64").cast_to_param(tree)) == {"f64": "float64", "f32": "float64"}


def test_policy_drives_a_mixed_precision_step_close_to_float32():
    policy = jmp.get_policy("p=f32,c=f16,o=f32")
    w = jax.random.normal(jax.random.key(1), (16, 4))
    x = jax.random.normal(jax.random.key(2), (8, 16))

    def loss(w, x, policy):
        w, x = policy.cast_to_compute((w, x))
        y = policy.cast_to_output(jnp.tanh(x @ w))
        return jnp.mean(y**2)

    full = jmp.get_policy("full")
    ref_loss, ref_grad = jax.value_and_grad(loss)(w, x, full)
    val, grad = jax.jit(jax.value_and_grad(loss), static_argnums=2)(w, x, policy)
    assert grad.dtype == jnp.float32  # param dtype
    np.testing.assert_allclose(val, ref_loss, rtol=5e-3)
    np.testing.assert_allclose(grad, ref_grad, rtol=2e-2, atol=2e-3)
    assert not np.array_equal(grad, ref_grad)  # it really ran in half precision


# ---------------------------------------------------------------------------------
# Loss scales.
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make", [lambda m: m.StaticLossScale(2.0**10), lambda m: m.DynamicLossScale(jnp.float32(2.0**10))]
)
def test_scale_and_unscale_match_jmp_on_float32(make):
    tree = {"a": jnp.linspace(-3.0, 3.0, 7), "b": jnp.float32(0.1)}
    ours, theirs = make(jmp), make(real)
    for a, b in zip(jax.tree.leaves(ours.scale(tree)), jax.tree.leaves(theirs.scale(tree)), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(ours.unscale(tree)), jax.tree.leaves(theirs.unscale(tree)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_scaling_is_in_float32_and_leaves_integers_and_dtypes_alone():
    loss16 = jnp.float16(3.0)
    assert np.isinf(real.StaticLossScale(2.0**15).scale(loss16))  # jmp: float16 overflow
    scaled = jmp.StaticLossScale(2.0**15).scale(loss16)
    assert scaled.dtype == jnp.float32 and float(scaled) == 3.0 * 2**15
    tree = {"i": jnp.arange(3), "g": jnp.full(2, 2.0**12, jnp.float16)}
    assert _dtypes(real.StaticLossScale(jnp.float32(4.0)).scale(tree))["i"] == "float32"  # jmp
    ours = jmp.StaticLossScale(4.0)
    assert ours.scale(tree)["i"] is tree["i"]
    unscaled = jmp.DynamicLossScale(jnp.float32(4.0)).unscale(tree)
    assert unscaled["g"].dtype == jnp.float16  # jmp returns float32 here
    np.testing.assert_array_equal(unscaled["g"], np.full(2, 2.0**10, np.float16))
    noop = jmp.NoOpLossScale()
    assert noop.scale(tree) is tree and noop.unscale(tree) is tree and noop.loss_scale == 1


def test_dynamic_state_machine_matches_jmp_step_by_step():
    rng = np.random.default_rng(0)
    flags = rng.random(120) < 0.8
    flags[40:46] = False  # a run of bad steps: down to min_loss_scale and back up
    ours = jmp.DynamicLossScale(jnp.float32(2.0**4), period=5, factor=2, min_loss_scale=jnp.float32(1.0))
    theirs = real.DynamicLossScale(jnp.float32(2.0**4), jnp.int32(0), 5, 2)
    adjust = jax.jit(lambda s, f: s.adjust(f))
    grew = shrank = 0
    for flag in flags:
        before = float(ours.loss_scale)
        ours = adjust(ours, jnp.bool_(flag))
        theirs = theirs.adjust(jnp.bool_(flag))
        assert float(ours.loss_scale) == float(theirs.loss_scale)
        assert int(ours.counter) == int(theirs.counter)
        assert ours.loss_scale.dtype == jnp.float32 and ours.counter.dtype == jnp.int32
        grew += float(ours.loss_scale) > before
        shrank += float(ours.loss_scale) < before
    assert grew > 3 and shrank > 3 and (ours.period, ours.factor) == (5, 2)


def test_dynamic_scale_does_not_grow_into_inf():
    ours = jmp.DynamicLossScale(jnp.float32(2.0**127), period=1)
    theirs = real.DynamicLossScale(jnp.float32(2.0**127), jnp.int32(0), 1, 2)
    ours, theirs = ours.adjust(jnp.bool_(True)), theirs.adjust(jnp.bool_(True))
    assert float(ours.loss_scale) == float(theirs.loss_scale) == 2.0**127


def test_min_loss_scale_survives_flatten_jit_and_checkpoints():
    kwargs = dict(period=7, factor=4)
    ours = jmp.DynamicLossScale(jnp.float32(2.0**15), jnp.int32(3), min_loss_scale=jnp.float32(0.5), **kwargs)
    theirs = real.DynamicLossScale(jnp.float32(2.0**15), jnp.int32(3), min_loss_scale=jnp.float32(0.5), **kwargs)
    # jmp's hand-written tree_flatten drops min_loss_scale: it is back to 1 after any transform.
    assert float(jax.tree.map(lambda x: x, theirs).min_loss_scale) == 1.0
    assert float(jax.jit(lambda s: s)(theirs).min_loss_scale) == 1.0
    assert jax.tree.leaves(ours) == [ours.loss_scale, ours.counter]
    for restored in (
        jax.tree.map(lambda x: x, ours),
        jax.jit(lambda s: s)(ours),
        pickle.loads(pickle.dumps(ours)),
        jax.tree.unflatten(jax.tree.structure(ours), jax.tree.leaves(ours)),
    ):
        assert (restored.min_loss_scale, restored.period, restored.factor) == (0.5, 7, 4)
        assert int(restored.counter) == 3
    # And it is honoured: five bad steps go 2**15 -> ... -> 0.5, not 1.
    state = jax.jit(lambda s: s)(ours)
    for _ in range(10):
        state = state.adjust(jnp.bool_(False))
    assert float(state.loss_scale) == 0.5


def test_float16_initial_scale_no_longer_crashes_adjust():
    with pytest.raises(TypeError, match="same dtypes"):
        real.DynamicLossScale(jnp.float16(2.0**15)).adjust(jnp.bool_(False))  # jmp#47
    ours = jmp.DynamicLossScale(jnp.float16(2.0**15))
    assert ours.loss_scale.dtype == jnp.float32
    assert float(ours.adjust(jnp.bool_(False)).loss_scale) == 2.0**14
    assert float(jmp.DynamicLossScale(jnp.float16(2.0**15), period=1).adjust(jnp.bool_(True)).loss_scale) == 2.0**16


def test_bad_configuration_is_rejected_with_the_argument_named():
    with pytest.raises(ValueError, match="period"):
        jmp.DynamicLossScale(2.0**15, period=0)
    with pytest.raises(ValueError, match="period"):
        jmp.DynamicLossScale(2.0**15, period=2.5)
    with pytest.raises(ValueError, match="factor"):
        jmp.DynamicLossScale(2.0**15, factor=0.5)
    with pytest.raises(ValueError, match="loss_scale"):
        jmp.DynamicLossScale(jnp.ones(2))
    with pytest.raises(TypeError, match="counter"):
        jmp.DynamicLossScale(2.0**15, counter=jnp.float32(1))
    with pytest.raises(ValueError, match="loss_scale"):
        jmp.StaticLossScale(-1.0)
    with pytest.raises(TypeError, match="min_loss_scale.*concrete"):
        jax.jit(lambda m: jmp.DynamicLossScale(2.0**15, min_loss_scale=m))(jnp.float32(1.0))
    with pytest.raises(AssertionError, match="expected boolean scalar"):
        jmp.DynamicLossScale(2.0**15).adjust(jnp.ones(2, bool))
    with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
        assert jmp.DynamicLossScale(jnp.int32(8)).loss_scale.dtype == jnp.float32


def test_loss_scale_states_pass_through_jit_and_vmap():
    ls = jmp.DynamicLossScale(jnp.float32(2.0**15), period=2)

    @jax.jit
    def step(ls, x):
        grads = ls.unscale(jax.grad(lambda x: ls.scale(jnp.sum(x**2)))(x))
        finite = jmp.all_finite(grads)
        return ls.adjust(finite), grads

    x = jnp.arange(4.0)
    for _ in range(2):
        ls, grads = step(ls, x)
    np.testing.assert_array_equal(grads, 2 * x)
    assert float(ls.loss_scale) == 2.0**16 and int(ls.counter) == 0
    batched = jax.vmap(lambda s: jmp.DynamicLossScale(s, period=2).adjust(jnp.bool_(False)))(jnp.array([4.0, 8.0]))
    np.testing.assert_array_equal(batched.loss_scale, [2.0, 4.0])
    assert jax.tree.leaves(jmp.StaticLossScale(jnp.float32(4.0))) == [] and jax.tree.leaves(jmp.NoOpLossScale()) == []


# ---------------------------------------------------------------------------------
# Tree helpers.
# ---------------------------------------------------------------------------------


def test_select_tree_keeps_non_array_leaves():
    new = {"w": jnp.arange(3.0), "act": jax.nn.relu, "step": jnp.int32(2)}
    old = {"w": jnp.zeros(3), "act": jax.nn.relu, "step": jnp.int32(1)}
    with pytest.raises(TypeError):
        real.select_tree(jnp.bool_(True), new, old)  # jmp: lax.select on a function
    for flag, want in ((True, new), (False, old)):
        got = eqx.filter_jit(jmp.select_tree)(jnp.bool_(flag), new, old)
        for name in ("w", "step"):
            np.testing.assert_array_equal(got[name], want[name])
            assert got[name].dtype == want[name].dtype
        assert got["act"] is jax.nn.relu
    with pytest.raises(AssertionError, match="expected boolean scalar"):
        jmp.select_tree(jnp.ones([1]), None, None)
    with pytest.raises(AssertionError, match="dtype float32"):
        jmp.select_tree(jnp.float32(1), None, None)


def test_all_finite_matches_jmp_and_ignores_non_float_leaves():
    for tree in (
        {},
        None,
        {"a": jnp.ones(2)},
        {"a": jnp.ones(2), "b": jnp.array([1.0, jnp.nan])},
        {"a": jnp.array(jnp.inf, jnp.float16)},
        {"i": jnp.arange(3), "f": jnp.ones(1)},
    ):
        assert bool(jmp.all_finite(tree)) == bool(real.all_finite(tree))
    with pytest.raises(TypeError):
        real.all_finite({"act": jax.nn.relu, "w": jnp.ones(2)})
    assert bool(jmp.all_finite({"act": jax.nn.relu, "w": jnp.ones(2)}))
    assert not bool(jmp.all_finite({"act": jax.nn.relu, "w": jnp.array([jnp.nan])}))


def test_compat_code_runs_under_strict_dtype_promotion():
    with jax.numpy_dtype_promotion("strict"):
        tree = {"g": jnp.ones(2, jnp.float16), "w": jnp.ones(2), "i": jnp.arange(2)}
        ls = jmp.DynamicLossScale(jnp.float16(4.0), period=1)
        assert _dtypes(ls.unscale(tree)) == _dtypes(tree)
        assert _dtypes(ls.scale(tree)) == {"g": "float32", "w": "float32", "i": "int32"}
        ls = ls.adjust(jmp.all_finite(tree)).adjust(jnp.bool_(False))
        assert float(ls.loss_scale) == 4.0 and int(ls.counter) == 0
        assert float(jmp.StaticLossScale(2).scale(jnp.float16(3.0))) == 6.0
        assert _dtypes(jmp.get_policy("c=bf16").cast_to_compute(tree))["w"] == "bfloat16"
        assert jmp.select_tree(jnp.bool_(False), tree, tree)["i"].dtype == jnp.int32


def _train_with(module, steps=12):
    """A jmp-style float16 training loop; only the `jmp` module differs between runs."""
    policy = module.get_policy("p=f32,c=f16,o=f32")
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (8, 16)) * 0.3, "w2": jax.random.normal(k2, (16, 1)) * 0.3}
    x = jax.random.normal(k3, (32, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True))

    def loss_fn(params, loss_scale):
        p, xc = policy.cast_to_compute((params, x))
        out = policy.cast_to_output(jnp.tanh(xc @ p["w1"]) @ p["w2"])
        return loss_scale.scale(jnp.mean((out - y) ** 2))

    @jax.jit
    def step(params, loss_scale):
        grads = loss_scale.unscale(jax.grad(loss_fn)(params, loss_scale))
        finite = module.all_finite(grads)
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return module.select_tree(finite, new, params), loss_scale.adjust(finite), finite

    loss_scale = module.DynamicLossScale(jnp.float32(2.0**24), jnp.int32(0), 3)  # too high at first
    history = []
    for _ in range(steps):
        params, loss_scale, finite = step(params, loss_scale)
        history.append((bool(finite), float(loss_scale.loss_scale)))
    return params, history


def test_migration_is_an_import_change_same_training_trajectory():
    ours, our_history = _train_with(jmp)
    theirs, their_history = _train_with(real)
    assert our_history == their_history
    assert not our_history[0][0] and our_history[-1][0]  # backed off from 2**24, then trained
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])
