"""Training that is checkpointed, killed and resumed (``tests/test_checkpoint.py``).

    python tests/checkpoint_worker.py crash  CKPT_DIR SAVE_AT STEPS REF.npz  # uninterrupted run, then one that dies
    python tests/checkpoint_worker.py resume CKPT_DIR STEPS OUT.npz          # restore, continue to STEPS

Each command does both modes: ``f32`` (float32 master parameters and AdamW state) and
``sr`` (bfloat16 parameters, ``half_state(adamw)``, stochastic rounding). Training: a small
Equinox MLP under ``amp`` (float16) with a dynamic loss scaler (patience 3, so the scale
moves), a batch drawn with the state's PRNG key every step. ``crash`` first trains STEPS
steps without interruption and writes every array leaf of the final states to REF.npz,
then trains again from step 0, saves the train state after step SAVE_AT, trains two more
steps and exits with ``os._exit(17)`` (no clean-up, as a killed job). ``resume`` restores
into a fresh train state in a new process and writes its final states to OUT.npz.
"""

from __future__ import annotations

import functools
import os
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import autocast

MODES = ("f32", "sr")
_X = jax.random.normal(jax.random.key(100), (256, 4))
_Y = jnp.stack([jnp.sin(_X[:, 0]), _X[:, 1] * _X[:, 2]], axis=1)


def _optim(mode):
    adamw = optax.adamw(1e-2, weight_decay=1e-2)
    return autocast.half_state(adamw) if mode == "sr" else adamw


@functools.cache
def initial_state_fn(mode):
    return eqx.filter_jit(lambda: _initial_state(mode))


def initial_state(mode):
    """The train state at step 0 (built under one jit: faster than op by op)."""
    return initial_state_fn(mode)()


def _initial_state(mode):
    model = eqx.nn.MLP(4, 2, 32, 2, key=jax.random.key(0))
    if mode == "sr":
        model = autocast.to_half_params(model)
    return {
        "model": model,
        "opt_state": _optim(mode).init(eqx.filter(model, eqx.is_inexact_array)),
        "scaler": autocast.DynamicScalerState(patience=3, scaler=2.0**12),
        "key": jax.random.key(1),
        "step": jnp.int32(0),
    }


def _loss(model, x, y):
    model = autocast.to_float32_params(model)
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


_GRAD = autocast.dynamic_scale_value_and_grad(autocast.amp(_loss, compute_dtype=jnp.float16))


@functools.cache
def _make_step(mode):
    optim = _optim(mode)

    @eqx.filter_jit
    def step(state):
        key, batch_key, round_key = jax.random.split(state["key"], 3)
        idx = jax.random.choice(batch_key, _X.shape[0], (32,), replace=False)
        scaler, (_, grads) = _GRAD(state["model"], _X[idx], _Y[idx], dynamic_scaler_state=state["scaler"])
        model, opt_state = autocast.optimizer_update(
            state["model"],
            optim,
            state["opt_state"],
            grads,
            scaler.grads_finite,
            key=round_key if mode == "sr" else None,
        )
        return {"model": model, "opt_state": opt_state, "scaler": scaler, "key": key, "step": state["step"] + 1}

    return step


def train(mode, state, until):
    step = _make_step(mode)
    while int(state["step"]) < until:
        state = step(state)
    return state


def leaves_as_arrays(state):
    """Every array leaf's raw bytes (PRNG keys: their data), keyed by its path and dtype."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if eqx.is_array(x):
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)
            x = np.ascontiguousarray(np.asarray(x))
            out[f"{jax.tree_util.keystr(path)}|{x.dtype.name}|{x.shape}"] = x.reshape(-1).view(np.uint8)
    return out


def _save_npz(path, states):
    np.savez(
        path, **{f"{mode}|{name}": x for mode, state in states.items() for name, x in leaves_as_arrays(state).items()}
    )


def main(argv):
    command, ckpt = argv[0], argv[1]
    if command == "crash":
        save_at, steps, ref = int(argv[2]), int(argv[3]), argv[4]
        _save_npz(ref, {mode: train(mode, initial_state(mode), steps) for mode in MODES})
        for mode in MODES:
            state = train(mode, initial_state(mode), save_at)
            autocast.save_train_state(os.path.join(ckpt, mode), state)
            train(mode, state, min(save_at + 2, steps))  # progress after the checkpoint, lost in the crash
        sys.stdout.flush()
        os._exit(17)
    if command == "resume":
        steps, out = int(argv[2]), argv[3]
        restored = {
            mode: autocast.restore_train_state(os.path.join(ckpt, mode), like=initial_state(mode)) for mode in MODES
        }
        _save_npz(out, {mode: train(mode, state, steps) for mode, state in restored.items()})
        return
    raise SystemExit(f"unknown command {command!r}; use crash or resume")


if __name__ == "__main__":
    main(sys.argv[1:])
