"""save_train_state / restore_train_state: a killed run resumes bit for bit (float32 master and
bfloat16 + stochastic rounding), exact round trips, and clear errors for mismatched and damaged
checkpoints."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("orbax.checkpoint")

import autocast  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import checkpoint_worker as worker  # noqa: E402

WORKER = Path(__file__).with_name("checkpoint_worker.py")
SAVE_AT, STEPS = 6, 14


def _run(*args, expect=0):
    proc = subprocess.run(
        [sys.executable, str(WORKER), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_killed_run_resumes_bit_for_bit_in_both_modes(tmp_path):
    # process 1: the uninterrupted run, then a run saved at step 6 that dies at step 8
    _run("crash", tmp_path, SAVE_AT, STEPS, tmp_path / "uninterrupted.npz", expect=17)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["f32", "sr"]
    # process 2: restore, continue to the end
    _run("resume", tmp_path, STEPS, tmp_path / "resumed.npz")
    uninterrupted = dict(np.load(tmp_path / "uninterrupted.npz"))
    resumed = dict(np.load(tmp_path / "resumed.npz"))
    assert resumed.keys() == uninterrupted.keys()
    for name, bits in uninterrupted.items():  # every parameter, moment, count, scale and key
        np.testing.assert_array_equal(resumed[name], bits, err_msg=name)
    names = " ".join(resumed)
    for mode in worker.MODES:
        assert f"{mode}|['scaler'].scaler" in names and f"{mode}|['key']" in names and f"{mode}|['step']" in names
    assert "sr|['opt_state'].inner[0].nu" in names and "f32|['opt_state'][0].nu" in names
    assert "sr|['model'].layers[0].weight|bfloat16" in names and "f32|['model'].layers[0].weight|float32" in names
    scale = next(v for k, v in resumed.items() if k.startswith("sr|['scaler'].scaler")).view(np.float32)[0]
    assert scale > 2.0**12  # the dynamic scale moved
    for mode in worker.MODES:
        step = next(v for k, v in resumed.items() if k.startswith(f"{mode}|['step']")).view(np.int32)[0]
        assert step == STEPS


def _state():
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
        "fn": jax.nn.gelu,
    }


def _bits(tree):
    out = []
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(
            (type(x).__name__, str(getattr(x, "dtype", "")), np.asarray(x).tobytes() if hasattr(x, "dtype") else x)
        )
    return out


def test_round_trip_is_exact_for_scalers_keys_and_python_numbers(tmp_path):
    state = _state()
    autocast.save_train_state(tmp_path / "c", state)
    restored = autocast.restore_train_state(tmp_path / "c", like=_state())
    assert _bits(restored) == _bits(state)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert restored["dynamic"].patience == 7 and int(restored["dynamic"].total_resets) == 2
    assert restored["step"] == 41 and isinstance(restored["step"], int) and restored["lr"] == 0.5
    assert jax.random.key_impl(restored["key"]) == jax.random.key_impl(state["key"])
    with pytest.raises(FileExistsError, match="overwrite=True"):
        autocast.save_train_state(tmp_path / "c", state)
    autocast.save_train_state(tmp_path / "c", {**state, "step": 42}, overwrite=True)
    assert autocast.restore_train_state(tmp_path / "c", like=_state())["step"] == 42


def test_sharded_state_restores_onto_like_sharding(tmp_path):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    sharding = NamedSharding(mesh, P("d", None))
    w = jax.device_put(jnp.arange(32.0, dtype=jnp.float32).reshape(8, 4).astype(jnp.bfloat16), sharding)
    autocast.save_train_state(tmp_path / "s", {"w": w})
    like = {"w": jax.device_put(jnp.zeros((8, 4), jnp.bfloat16), sharding)}
    restored = autocast.restore_train_state(tmp_path / "s", like=like)["w"]
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


def _data_files(root):
    return sorted(p for p in Path(root, "arrays").rglob("*") if p.is_file() and p.parent.name == "d")


def test_damaged_checkpoints_raise_clear_errors(tmp_path):
    state = {"w": jax.random.normal(jax.random.key(0), (64, 64)), "step": 3}
    for name in ("truncated", "flipped", "record"):
        autocast.save_train_state(tmp_path / name, state)
    # a data file cut short
    for f in _data_files(tmp_path / "truncated"):
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    with pytest.raises(ValueError, match=r"cannot read the arrays of the checkpoint .*truncated or corrupted|checksum"):
        autocast.restore_train_state(tmp_path / "truncated", state)
    # bytes changed in place
    for f in _data_files(tmp_path / "flipped"):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"truncated or corrupted|checksum"):
        autocast.restore_train_state(tmp_path / "flipped", state)
    # the JSON record damaged
    (record,) = [p for p in (tmp_path / "record" / "meta").iterdir() if p.name == "metadata"]
    record.write_text(record.read_text()[:-20])
    with pytest.raises(ValueError, match=r"cannot read the checkpoint record"):
        autocast.restore_train_state(tmp_path / "record", state)
