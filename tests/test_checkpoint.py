"""save_train_state / restore_train_state in one process: exact round trips, shape-only
templates (typed PRNG keys, both optimizer modes), sharding, and clear errors for mismatched
templates and bad arguments. Killed processes: test_checkpoint_kills.py; damaged files:
test_checkpoint_corruption.py."""

import functools
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("orbax.checkpoint")

import autocast  # noqa: E402
import autocast.optim  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from checkpoint_worker import state_bits  # noqa: E402


def _state():
    return dict(_cached_state())  # a new dict of the same (immutable) leaves: built once


@functools.cache
def _cached_state():
    params = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4, jnp.bfloat16)}
    optim = autocast.optim.half_state(optax.adamw(1e-3))
    return {
        "params": params,
        "opt_state": optim.init(params),
        "dynamic": autocast.DynamicScalerState(patience=7, scaler=2.0**9, count=3, total_resets=2, grads_finite=False),
        "static": autocast.StaticScalerState(2.0**4),
        "noop": autocast.NoOpScalerState(grads_finite=False),
        "key": jax.random.key(5),
        "raw_key": jax.random.PRNGKey(6),
        "step": 41,
        "lr": 0.5,
        "name": "run-a",
        "fn": jax.nn.gelu,
    }


def test_round_trip_is_exact_for_scalers_keys_and_python_values(tmp_path):
    state = _state()
    autocast.save_train_state(tmp_path / "c", state)
    zeros = jax.tree.map(jnp.zeros_like, state["params"])
    like = {**state, "params": zeros, "key": jax.random.key(0), "step": 0, "lr": 0.0, "name": ""}  # other values
    restored = autocast.restore_train_state(tmp_path / "c", like=like)
    assert state_bits(restored) == state_bits(state)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert restored["dynamic"].patience == 7 and int(restored["dynamic"].total_resets) == 2
    assert restored["step"] == 41 and isinstance(restored["step"], int) and restored["lr"] == 0.5
    assert restored["name"] == "run-a" and restored["fn"] is jax.nn.gelu
    assert jax.random.key_impl(restored["key"]) == jax.random.key_impl(state["key"])
    with pytest.raises(FileExistsError, match="overwrite=True"):
        autocast.save_train_state(tmp_path / "c", state)
    # overwritten in the same process: the new arrays are read, not a cached copy of the old
    changed = {**state, "params": jax.tree.map(lambda x: x + 1, state["params"]), "step": 42, "name": "run-b"}
    autocast.save_train_state(tmp_path / "c", changed, overwrite=True)
    assert state_bits(autocast.restore_train_state(tmp_path / "c", like=_state())) == state_bits(changed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temporary or old directory left


def test_sharded_state_restores_onto_like_sharding(tmp_path):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    sharding = NamedSharding(mesh, P("d", None))
    w = jax.device_put(jnp.arange(32.0, dtype=jnp.float32).reshape(8, 4).astype(jnp.bfloat16), sharding)
    autocast.save_train_state(tmp_path / "s", {"w": w})
    like = {"w": jax.device_put(jnp.zeros((8, 4), jnp.bfloat16), sharding)}
    for template in (like, {"w": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=sharding)}):
        restored = autocast.restore_train_state(tmp_path / "s", like=template)["w"]
        assert restored.sharding.is_equivalent_to(sharding, 2)
        np.testing.assert_array_equal(np.asarray(restored).view(np.uint16), np.asarray(w).view(np.uint16))


def test_mismatched_checkpoints_name_the_leaf_and_what_differs(tmp_path):
    state = _state()
    autocast.save_train_state(tmp_path / "c", state)
    with pytest.raises(
        ValueError,
        match=r"leaf `\['params'\]\['w'\]` is float32\[3, 4\] in the checkpoint .* but bfloat16\[3, 4\] in `like`; nothing is cast.*to_half_params",
    ):
        autocast.restore_train_state(
            tmp_path / "c", {**_state(), "params": autocast.optim.to_half_params(_state()["params"])}
        )
    with pytest.raises(ValueError, match=r"leaf `\['params'\]\['w'\]` is float32\[3, 4\] .* float32\[4, 3\]"):
        autocast.restore_train_state(
            tmp_path / "c", {**_state(), "params": {"w": jnp.zeros((4, 3)), "b": jnp.ones(4, jnp.bfloat16)}}
        )
    # float32-master state into a bf16+SR template: another structure, with the conversion hint
    plain = {**_state(), "opt_state": autocast.optim.to_float32_opt_state(_state()["opt_state"])}
    with pytest.raises(
        ValueError,
        match=r"another structure than `like`.*in the checkpoint but not in `like`: \['opt_state'\]\.inner.*to_float32_opt_state",
    ):
        autocast.restore_train_state(tmp_path / "c", plain)
    with pytest.raises(
        ValueError, match=r"leaf `\['step'\]` is a Python int in the checkpoint .* but int32\[\] in `like`"
    ):
        autocast.restore_train_state(tmp_path / "c", {**_state(), "step": jnp.int32(0)})
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        autocast.restore_train_state(tmp_path / "nothing", _state())


def test_conversion_between_modes_through_a_checkpoint(tmp_path):
    """A float32-master checkpoint continues in bfloat16 + SR, and back, by explicit conversion."""
    params = {"w": jax.random.normal(jax.random.key(0), (8, 4))}
    inner = optax.adamw(1e-3)
    f32 = {"params": params, "opt_state": inner.init(params)}
    autocast.save_train_state(tmp_path / "f32", f32)
    restored = autocast.restore_train_state(tmp_path / "f32", like=f32)
    half = {
        "params": autocast.optim.to_half_params(restored["params"]),
        "opt_state": autocast.optim.to_half_opt_state(restored["opt_state"], jax.random.key(1)),
    }
    assert jax.tree.structure(half["opt_state"]) == jax.tree.structure(autocast.optim.half_state(inner).init(params))
    autocast.save_train_state(tmp_path / "half", half)
    back = autocast.restore_train_state(tmp_path / "half", like=half)
    f32_again = {
        "params": autocast.optim.to_float32_params(back["params"]),
        "opt_state": autocast.optim.to_float32_opt_state(back["opt_state"]),
    }
    assert jax.tree.structure(f32_again) == jax.tree.structure(f32)
    np.testing.assert_array_equal(f32_again["params"]["w"], params["w"].astype(jnp.bfloat16).astype(jnp.float32))


def _optim(mode):
    return autocast.optim.half_state(optax.adamw(1e-2)) if mode == "sr" else optax.adamw(1e-2)


def _make(mode, module):
    """A fresh train state of one optimizer mode: float32 master weights and AdamW, or
    bfloat16 parameters with half_state(AdamW) (whose state carries a typed key). `module`:
    an Equinox MLP (static fields, activation functions) and a string, which only
    eqx.filter_eval_shape can trace, rather than a dict of arrays."""
    k = jax.random.key(0)
    model = eqx.nn.MLP(3, 2, 4, 1, key=k) if module else {"w": jax.random.normal(k, (3, 4)), "b": jnp.zeros(4)}
    if mode == "sr":
        model = autocast.optim.to_half_params(model)
    state = {
        "model": model,
        "opt_state": _optim(mode).init(eqx.filter(model, eqx.is_inexact_array)),
        "dynamic": autocast.DynamicScalerState(patience=5),
        "static": autocast.StaticScalerState(2.0**4),
        "noop": autocast.NoOpScalerState(),
        "key": jax.random.key(1),
        "legacy_key": jax.random.PRNGKey(2),
        "h": jnp.ones(3, jnp.float16),
        "count": jnp.int32(0),
        "flag": jnp.bool_(False),
        "step": 0,
        "lr": 1e-3,
        "warm": True,
    }
    return {**state, "name": "run"} if module else state


@eqx.filter_jit
def _one_step(state, mode):
    """One update in the state's mode (a stochastic-rounding key in bf16 + SR): every leaf moves."""
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.25), eqx.filter(state["model"], eqx.is_inexact_array))
    key, round_key = jax.random.split(state["key"])
    model, opt_state = autocast.optimizer_update(
        state["model"],
        _optim(mode),
        state["opt_state"],
        grads,
        jnp.bool_(True),
        key=round_key if mode == "sr" else None,
    )
    dynamic = state["dynamic"].adjust(jnp.bool_(False))
    moved = {"h": state["h"] * 3, "count": state["count"] + 7, "flag": ~state["flag"]}
    return {**state, **moved, "model": model, "opt_state": opt_state, "dynamic": dynamic, "key": key}


TEMPLATES = {
    "jax.eval_shape": lambda mode: jax.eval_shape(lambda: _make(mode, module=False)),
    "eqx.filter_eval_shape": lambda mode: eqx.filter_eval_shape(lambda: _make(mode, module=True)),
    "ShapeDtypeStruct": lambda mode: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, _make(mode, module=True)
    ),
}


@pytest.mark.parametrize("mode", ["f32", "sr"])
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_shape_only_templates_restore_every_leaf_kind(tmp_path, mode, template):
    module = template != "jax.eval_shape"
    state = _one_step(_make(mode, module), mode)
    state = {**state, "legacy_key": jax.random.split(state["legacy_key"])[0], "step": 7, "lr": 5e-4, "warm": False}
    if module:
        state["name"] = "run-2"
    autocast.save_train_state(tmp_path / "c", state)
    like = TEMPLATES[template](mode)
    assert jnp.issubdtype(like["key"].dtype, jax.dtypes.prng_key) and isinstance(like["key"], jax.ShapeDtypeStruct)
    if mode == "sr":
        assert isinstance(like["opt_state"], autocast.optim.HalfOptState)
        assert jnp.issubdtype(like["opt_state"].key.dtype, jax.dtypes.prng_key)
    restored = autocast.restore_train_state(tmp_path / "c", like)
    # bit for bit, every leaf: dtypes (bfloat16 parameters and moments in SR), key data and
    # implementations, and Python values as Python values (jax.eval_shape made them scalars)
    assert state_bits(restored) == state_bits(state)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(eqx.filter(restored, eqx.is_array)))
    assert restored["step"] == 7 and type(restored["step"]) is int and type(restored["lr"]) is float
    assert restored["warm"] is False
    # the restored keys work as keys
    assert state_bits(jax.random.split(restored["key"])) == state_bits(jax.random.split(state["key"]))
    if module:
        assert restored["model"].activation is state["model"].activation and restored["name"] == "run-2"


def test_shape_only_templates_are_checked_like_arrays(tmp_path):
    state = {"key": jax.random.key(1), "step": 3, "w": jnp.ones(2, jnp.bfloat16)}
    autocast.save_train_state(tmp_path / "c", state)
    rbg = jax.eval_shape(lambda: jax.random.key(0, impl="rbg"))
    with pytest.raises(ValueError, match=r"leaf `\['key'\]` is a PRNG key array \(threefry2x32\) .* \(rbg\)"):
        autocast.restore_train_state(tmp_path / "c", {**state, "key": rbg})
    with pytest.raises(
        ValueError, match=r"leaf `\['step'\]` is a Python int in the checkpoint .* but float32\[\] in `like`"
    ):
        autocast.restore_train_state(tmp_path / "c", jax.eval_shape(lambda: {**state, "step": 0.0}))
    with pytest.raises(ValueError, match=r"leaf `\['w'\]` is bfloat16\[2\] in the checkpoint .* but float16\[2\]"):
        autocast.restore_train_state(tmp_path / "c", {**state, "w": jax.ShapeDtypeStruct((2,), jnp.float16)})


def test_bad_arguments_raise_clear_errors(tmp_path):
    state = {"w": jnp.ones(3), "step": 1}
    with pytest.raises(TypeError, match=r"save_train_state: `path` must be a str or os.PathLike .* got int 7"):
        autocast.save_train_state(7, state)
    with pytest.raises(ValueError, match=r"restore_train_state: `path` is empty"):
        autocast.restore_train_state("", state)
    with pytest.raises(TypeError, match=r"`overwrite` must be True or False, got 'yes'"):
        autocast.save_train_state(tmp_path / "c", state, overwrite="yes")
    with pytest.raises(
        TypeError, match=r"leaf `\['step'\]` of `state` is a shape-only .*\(shape-only trees are for `like`\)"
    ):
        autocast.save_train_state(tmp_path / "c", jax.eval_shape(lambda: state))
    with pytest.raises(TypeError, match=r"leaf `\['w'\]` of `state` is a traced value .* outside jit"):
        jax.jit(lambda w: autocast.save_train_state(tmp_path / "c", {"w": w}))(jnp.ones(3))
    (tmp_path / "file").write_text("x")
    for fn, args in ((autocast.save_train_state, (state,)), (autocast.restore_train_state, (state,))):
        with pytest.raises(NotADirectoryError, match=rf"{fn.__name__}: `path` .*file' is a file"):
            fn(tmp_path / "file", *args)
    # overwrite=True replaces checkpoints only: another directory is left as it is
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match=r"exists and is not a checkpoint \(no manifest.json\)"):
            autocast.save_train_state(tmp_path / "mine", state, overwrite=overwrite)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    with pytest.raises(
        ValueError, match=r"'.*mine' is not a complete save_train_state checkpoint: .*manifest.json' is missing"
    ):
        autocast.restore_train_state(tmp_path / "mine", state)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        autocast.restore_train_state(tmp_path / "nothing", state)
    assert not (tmp_path / "c").exists() and not list(tmp_path.glob(".c.*"))  # the failed saves left nothing
