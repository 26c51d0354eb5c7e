"""One process of the multi-process test (``tests/test_multiprocess.py``), or its
one-process reference.

    python tests/multiprocess_worker.py OUT.json                        # one process, all local devices
    python tests/multiprocess_worker.py OUT.json PORT PROCESS_ID NUM_PROCESSES

With a port, the process joins ``jax.distributed`` on ``127.0.0.1:PORT`` (CPU collectives
through gloo). It trains a small MLP under ``amp`` (float16) with the dynamic loss scaler
for a few Adam steps, data parallel over every device of every process, twice: under
``jax.jit`` with ``NamedSharding`` and with ``jax.shard_map`` (``axis_name``). One step's
batch holds an infinity in a row that the last process's devices hold. Writes the losses,
finite flags, scales and final parameters of both runs to ``OUT.json``.
"""

from __future__ import annotations

import json
import sys

import jax

if len(sys.argv) > 2:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{sys.argv[2]}",
        num_processes=int(sys.argv[4]),
        process_id=int(sys.argv[3]),
        initialization_timeout=60,
    )

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import autocast  # noqa: E402

STEPS, BAD_STEP, BATCH, D_IN, HIDDEN, CLASSES = 6, 2, 32, 16, 64, 4
OPT = optax.adam(1e-2)


def loss_fn(params, x, y):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def init():
    rng = np.random.default_rng(0)
    return {
        "w1": rng.standard_normal((D_IN, HIDDEN), np.float32) / np.float32(4.0),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.standard_normal((HIDDEN, CLASSES), np.float32) / np.float32(8.0),
        "b2": np.zeros(CLASSES, np.float32),
    }


def batch(step):
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((BATCH, D_IN), np.float32)
    if step == BAD_STEP:
        x[BATCH - 3, 1] = np.inf  # held by the last device, i.e. by the last process
    return x, rng.integers(0, CLASSES, BATCH).astype(np.int32)


def global_array(mesh, value, spec):
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda idx: value[idx])


def jit_step():
    grad_fn = autocast.dynamic_scale_grad(autocast.amp(loss_fn))

    @jax.jit
    def step(params, opt_state, state, x, y):
        state, grads = grad_fn(params, x, y, dynamic_scaler_state=state)
        params, opt_state = autocast.optimizer_update(params, OPT, opt_state, grads, state.grads_finite)
        return params, opt_state, state, loss_fn(params, x, y)

    return step


def shard_map_step(mesh):
    grad_fn = autocast.dynamic_scale_grad(autocast.amp(loss_fn), axis_name="data")

    def local(params, x, y, state):
        params = jax.lax.pcast(params, "data", to="varying")  # per-device gradients, as with pmap
        state, grads = grad_fn(params, x, y, dynamic_scaler_state=state)
        stacked = jax.tree.map(lambda v: v[None], (state.scaler, state.count, state.grads_finite))
        return stacked, jax.lax.pmean(grads, "data")

    sharded = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()), out_specs=(P("data"), P()), check_vma=True
    )

    @jax.jit
    def step(params, opt_state, state, x, y):
        (scaler, count, finite), grads = sharded(params, x, y, state)
        # every device must have taken the same decision; its copy 0 becomes the state
        agree = jnp.all(scaler == scaler[0]) & jnp.all(finite == finite[0])
        state = autocast.DynamicScalerState(scaler=scaler[0], count=count[0], grads_finite=finite[0] & agree)
        params, opt_state = autocast.optimizer_update(params, OPT, opt_state, grads, state.grads_finite)
        return params, opt_state, state, loss_fn(params, x, y)

    return step


def local_value(x):
    return np.asarray(x.addressable_data(0)).tolist()


def train(mesh, step):
    params = jax.tree.map(lambda v: global_array(mesh, v, P()), init())
    opt_state = jax.jit(OPT.init)(params)
    state = jax.tree.map(lambda v: global_array(mesh, v, P()), autocast.DynamicScalerState(scaler=2.0**10))
    record = {"loss": [], "finite": [], "scale": []}
    for i in range(STEPS):
        x, y = batch(i)
        x, y = global_array(mesh, x, P("data")), global_array(mesh, y, P("data"))
        params, opt_state, state, loss = step(params, opt_state, state, x, y)
        record["loss"].append(local_value(loss))
        record["finite"].append(bool(local_value(state.grads_finite)))
        record["scale"].append(local_value(state.scaler))
    record["params"] = {k: local_value(v) for k, v in params.items()}
    return record


def main():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    out = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
        "jax": jax.__version__,
        "jit": train(mesh, jit_step()),
        "shard_map": train(mesh, shard_map_step(mesh)),
    }
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
    if jax.process_count() > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
