"""Processes that save, die and resume, for ``tests/test_checkpoint_kills.py``.

    python tests/checkpoint_worker.py PLAN.json RESULTS.json

The worker imports JAX, Orbax and autocast once, without starting JAX's runtime, and runs
each job of PLAN.json (a list) in a forked child: a new process that starts its own JAX
runtime, so a job costs no import. RESULTS.json lists how each child ended: ``"exit N"``
or ``"signal N"`` (9: SIGKILL). Jobs:

- ``{"job": "crash", "dir", "save_at", "steps", "ref"}``: train both modes STEPS steps
  without interruption and write every array leaf of the final states to REF (.npz), then
  train again from step 0, save the train state after step SAVE_AT to DIR/<mode>, train two
  more steps and exit with ``os._exit(17)`` (no clean-up, as a killed job).
- ``{"job": "resume", "dir", "steps", "out"}``: restore each mode from DIR/<mode> into a
  fresh train state, continue to STEPS, write the final states to OUT.
- ``{"job": "kill_at", "dir", "step", "first"}``: save ``kill_state(0)`` to DIR (unless
  FIRST), then save ``kill_state(1)`` over it and SIGKILL itself when the save reaches STEP
  (``autocast._checkpoint_store.reached``); it exits 3 if the save never reaches STEP.
- ``{"job": "two_processes", "processes": 2, "port", "dir", "out"}``: two JAX processes
  (``jax.distributed`` on CPU, gloo) save a state with an array split across them, overwrite
  it, restore it into a shape-only template with the same shardings and write their local
  shards to OUT.<rank>.npz.
- ``{"job": "kill_after", "dir", "delay"}``: save ``kill_state(0)``, then overwrite DIR with
  ``kill_state(1)``, ``kill_state(0)``, ... until the worker SIGKILLs it DELAY seconds after
  the first overwrite began.

Training (both modes: ``f32``, float32 master parameters and AdamW state; ``sr``, bfloat16
parameters, ``half_state(adamw)``, stochastic rounding): a small Equinox MLP under ``amp``
(float16) with a dynamic loss scaler (patience 3, so the scale moves), a batch drawn with
the state's PRNG key every step. Compiling dominates these two jobs, so XLA's optimizations
are off in them (``jax_disable_most_optimizations``) and the resume job reuses the crash
job's compiles (``CHECKPOINT_WORKER_JAX_CACHE``, a compilation cache directory): what they
check, that the restored state continues bit for bit, does not depend on either.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint  # noqa: F401  (imported once here, not in every child)

import autocast
import autocast._checkpoint_store
import autocast.optim

MODES = ("f32", "sr")


@functools.cache
def _data():
    x = jax.random.normal(jax.random.key(100), (256, 4))
    return x, jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1)


def _optim(mode):
    adamw = optax.adamw(1e-2, weight_decay=1e-2)
    return autocast.optim.half_state(adamw) if mode == "sr" else adamw


@functools.cache
def initial_state_fn(mode):
    return eqx.filter_jit(lambda: _initial_state(mode))


def initial_state(mode):
    """The train state at step 0 (built under one jit: faster than op by op)."""
    return initial_state_fn(mode)()


def _initial_state(mode):
    model = eqx.nn.MLP(4, 2, 32, 2, key=jax.random.key(0))
    if mode == "sr":
        model = autocast.optim.to_half_params(model)
    return {
        "model": model,
        "opt_state": _optim(mode).init(eqx.filter(model, eqx.is_inexact_array)),
        "scaler": autocast.DynamicScalerState(patience=3, scaler=2.0**12),
        "key": jax.random.key(1),
        "step": jnp.int32(0),
    }


def _loss(model, x, y):
    model = autocast.optim.to_float32_params(model)
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


_GRAD = autocast.dynamic_scale_value_and_grad(autocast.amp(_loss, compute_dtype=jnp.float16))


@functools.cache
def _make_step(mode):
    optim = _optim(mode)
    x, y = _data()

    @eqx.filter_jit
    def step(state):
        key, batch_key, round_key = jax.random.split(state["key"], 3)
        idx = jax.random.choice(batch_key, x.shape[0], (32,), replace=False)
        scaler, (_, grads) = _GRAD(state["model"], x[idx], y[idx], dynamic_scaler_state=state["scaler"])
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


def state_bits(tree):
    """Every leaf as (path, type, dtype, bytes or Python value): equal iff bit for bit equal."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        kind = type(x).__name__
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            kind = f"key {jax.random.key_impl(x)}"
            x = jax.random.key_data(x)
        if eqx.is_array(x):
            x = np.ascontiguousarray(np.asarray(x))
            out.append((jax.tree_util.keystr(path), kind, x.dtype.name, x.shape, x.tobytes()))
        else:
            out.append((jax.tree_util.keystr(path), kind, "", (), x))
    return out


def kill_state(version):
    """A small train state with every kind of leaf, built without compiling anything;
    versions 0 and 1 differ in every saved leaf."""
    v = int(version)
    f32 = np.arange(12, dtype=np.float32).reshape(3, 4) / 7 + v
    params = {
        "w": jnp.asarray(f32),
        "b": jnp.asarray(f32[0].astype(jnp.bfloat16)),
        "h": jnp.asarray(f32[1].astype(jnp.float16)),
    }
    moments = {k: jnp.asarray(np.asarray(p) * (1 + v)) for k, p in params.items()}
    opt_state = (optax.ScaleByAdamState(count=jnp.asarray(np.int32(5 + v)), mu=moments, nu=moments), optax.EmptyState())
    return {
        "params": params,
        "opt_state": autocast.optim.HalfOptState(inner=opt_state, key=jax.random.wrap_key_data(np.uint32([3, 9 + v]))),
        "scaler": autocast.DynamicScalerState(
            patience=3,
            scaler=jnp.asarray(np.float32(2.0 ** (10 + v))),
            count=jnp.asarray(np.int32(v)),
            total_resets=jnp.asarray(np.int32(2 * v)),
            grads_finite=jnp.asarray(np.bool_(v)),
        ),
        "key": jax.random.wrap_key_data(np.uint32([v, 11])),
        "legacy_key": jnp.asarray(np.uint32([12, v])),
        "step": 100 + v,
        "lr": 0.25 + v,
        "warmup": not v,
        "name": f"run-{v}",
        "activation": jax.nn.gelu,
    }


def _arm(step):
    def reached(name):
        if name == step:
            os.kill(os.getpid(), signal.SIGKILL)

    autocast._checkpoint_store.reached = reached


def _crash(job):
    _save_npz(job["ref"], {mode: train(mode, initial_state(mode), job["steps"]) for mode in MODES})
    for mode in MODES:
        state = train(mode, initial_state(mode), job["save_at"])
        autocast.save_train_state(os.path.join(job["dir"], mode), state)
        train(mode, state, min(job["save_at"] + 2, job["steps"]))  # progress after the checkpoint, lost in the crash
    sys.stdout.flush()
    os._exit(17)


def _resume(job):
    restored = {
        mode: autocast.restore_train_state(os.path.join(job["dir"], mode), like=initial_state(mode)) for mode in MODES
    }
    _save_npz(job["out"], {mode: train(mode, state, job["steps"]) for mode, state in restored.items()})


def _kill_at(job):
    old, new = kill_state(0), kill_state(1)
    if not job.get("first"):
        autocast.save_train_state(job["dir"], old)
    _arm(job["step"])
    autocast.save_train_state(job["dir"], new, overwrite=True)
    os._exit(3)  # the save never reached the step


def _kill_after(job, ready_fd):
    states = kill_state(0), kill_state(1)
    autocast.save_train_state(job["dir"], states[0])
    os.write(ready_fd, b"r")
    for i in range(1, 2000):
        autocast.save_train_state(job["dir"], states[i % 2], overwrite=True)
    os._exit(4)  # never killed


def _two_processes(job):
    """One of two JAX processes (rank 0 or 1, one CPU device each) saving, overwriting and
    restoring a state with an array split across both and replicated ones."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{job['port']}", num_processes=2, process_id=job["rank"], initialization_timeout=120
    )
    mesh = Mesh(np.array(jax.devices()), ("p",))
    split, copy = NamedSharding(mesh, P("p")), NamedSharding(mesh, P())
    whole = np.arange(8, dtype=np.float32)

    def state(version):
        return {
            "w": jax.make_array_from_callback((8,), split, lambda i: whole[i] * (1 + version)),
            "r": jax.make_array_from_callback((3,), copy, lambda i: np.full(3, 2.5 + version, np.float32)[i]),
            "key": jax.jit(lambda: jax.random.key(3 + version), out_shardings=copy)(),
            "step": 5 + version,
        }

    autocast.save_train_state(job["dir"], state(0))
    autocast.save_train_state(job["dir"], state(1), overwrite=True)
    like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        state(0),
    )
    got = autocast.restore_train_state(job["dir"], like)
    local = {k: np.asarray(got[k].addressable_shards[0].data) for k in ("w", "r")}
    key = np.asarray(jax.random.key_data(got["key"]).addressable_shards[0].data)
    np.savez(f"{job['out']}.{job['rank']}.npz", **local, key=key, step=got["step"])


def _run_child(job, ready_fd):
    if os.environ.get("CHECKPOINT_WORKER_JAX_CACHE"):  # the resume job reuses the crash job's compiles
        jax.config.update("jax_compilation_cache_dir", os.environ["CHECKPOINT_WORKER_JAX_CACHE"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if job["job"] in ("crash", "resume"):  # compiling dominates these jobs: XLA's quick mode
        jax.config.update("jax_disable_most_optimizations", True)
    try:
        if job["job"] == "crash":
            _crash(job)
        elif job["job"] == "resume":
            _resume(job)
        elif job["job"] == "kill_at":
            _kill_at(job)
        elif job["job"] == "kill_after":
            _kill_after(job, ready_fd)
        elif job["job"] == "two_processes":
            _two_processes(job)
        else:
            raise ValueError(f"unknown job {job['job']!r}; use crash, resume, kill_at, kill_after or two_processes")
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def _warm_up():
    """Load the MLIR dialects JAX loads at its first compile: once here, not in every child
    (a private JAX function, without starting JAX's runtime; skipped if it moved)."""
    try:
        from jax._src.interpreters import mlir

        mlir.make_ir_context()
    except (ImportError, AttributeError):
        pass


def main(argv):
    with open(argv[0]) as f:
        jobs = json.load(f)
    _warm_up()
    results = []
    for job in jobs:
        start = time.perf_counter()
        children = []
        for rank in range(job.get("processes", 1)):
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                _run_child({**job, "rank": rank}, write_fd)
            os.close(write_fd)
            children.append((pid, read_fd))
        if job["job"] == "kill_after":
            pid, read_fd = children[0]
            if os.read(read_fd, 1) == b"r":  # the first save is complete
                time.sleep(job["delay"])
                os.kill(pid, signal.SIGKILL)
        ended, cpu = [], 0.0
        for pid, read_fd in children:
            os.close(read_fd)
            _, status, usage = os.wait4(pid, 0)
            ended.append(
                f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
            )
            cpu += usage.ru_utime + usage.ru_stime
        seconds = {"wall": round(time.perf_counter() - start, 2), "cpu": round(cpu, 2)}
        results.append({**job, "ended": ", ".join(ended), "seconds": seconds})
    with open(argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
