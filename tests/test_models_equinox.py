"""Real Equinox models, built from Equinox's own layers, trained under ``amp`` vs float32.

Each model is trained for a few optax steps under ``eqx.filter_jit`` with
``eqx.filter_value_and_grad(amp(loss))`` and compared with the float32 run of the same
model, initialisation and data. For each model and half dtype:

- every matmul/convolution of the forward and backward jaxpr (searched recursively,
  through ``scan``/``checkpoint``/``custom_jvp`` bodies) has half-precision operands;
- the step-0 loss and gradients are within the stated tolerance of float32;
- the loss decreases over the training steps, and the last loss stays near float32's;
- gradients come back in the parameters' dtype and state (BatchNorm) in its own dtypes.

This file also holds the harness (``Case``, ``measure``) shared with
``test_models_flax.py`` and ``model_report.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import compute_op_dtypes, tree_max_rel_err

import autocast

HALF_DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}

# Codegen-only XLA options for the training steps: XLA's HLO passes (fusion, algebraic
# simplification, layout) still run, only LLVM's backend optimisation is lowered. It cuts
# compile time, which dominates for these tiny models, by ~40%.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


# --------------------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tol:
    """Tolerances against the float32 run of the same model, init and data."""

    loss: float  # relative error of the step-0 loss
    grad: float  # relative L2 error of the whole step-0 gradient (all leaves together)
    leaf: float  # max over non-negligible leaves of the relative L2 error of the step-0 gradient
    final: float  # relative error of the last-step loss (trajectories drift apart slowly)


@dataclasses.dataclass
class Case:
    """One model: parameters, non-trained state, a batch and a loss.

    ``loss_fn(params, state, batch) -> (loss, new_state)``; ``state`` is ``None`` for
    stateless models. ``params`` may hold non-array leaves (an Equinox module's
    activation function): they are static for ``amp`` and ``eqx.filter_jit`` alike.
    """

    name: str
    params: Any
    state: Any
    batch: Any
    loss_fn: Callable
    tol: dict[str, Tol]  # by half dtype name
    optimizer: Any = dataclasses.field(default_factory=lambda: optax.adam(1e-2))
    steps: int = 4
    jit: Callable = functools.partial(eqx.filter_jit, compiler_options=FAST_COMPILE)
    value_and_grad: Callable = functools.partial(eqx.filter_value_and_grad, has_aux=True)


def _loss_fn(case: Case, dtype_name: str) -> Callable:
    if dtype_name == "float32":
        return case.loss_fn
    return autocast.amp(case.loss_fn, compute_dtype=HALF_DTYPES[dtype_name])


def _array_dtypes(tree: Any) -> list[str]:
    return [str(x.dtype) for x in jax.tree_util.tree_leaves(tree) if eqx.is_array(x)]


def _run(case: Case, dtype_name: str) -> dict[str, Any]:
    """Step-0 loss/grads, the training trajectory and the matmul census of one run."""
    grad_fn = case.value_and_grad(_loss_fn(case, dtype_name))
    opt = case.optimizer

    @case.jit
    def step(params, state, opt_state, batch):
        (loss, new_state), grads = grad_fn(params, state, batch)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(params, eqx.is_array))
        return eqx.apply_updates(params, updates), new_state, opt_state, loss, grads

    params, state = case.params, case.state
    opt_state = opt.init(eqx.filter(params, eqx.is_array))
    losses, grads0, state1 = [], None, None
    for i in range(case.steps):
        params, state, opt_state, loss, grads = step(params, state, opt_state, case.batch)
        losses.append(float(loss))
        if i == 0:
            grads0, state1 = grads, state

    # Matmul/conv census of the forward pass and of the forward *and* backward pass.
    dynamic, static = eqx.partition(case.params, eqx.is_array)
    loss_fn = _loss_fn(case, dtype_name)
    census_fwd = compute_op_dtypes(
        lambda p, s, b: loss_fn(eqx.combine(p, static), s, b), dynamic, case.state, case.batch
    )
    census = compute_op_dtypes(lambda p, s, b: grad_fn(eqx.combine(p, static), s, b), dynamic, case.state, case.batch)
    return dict(
        loss0=losses[0],
        grads0=grads0,
        state1=state1,
        losses=losses,
        census=census,
        census_fwd=census_fwd,
        final_state=state,
        final_params=params,
    )


@functools.cache
def measure(factory: Callable[[], Case], dtype_name: str) -> dict[str, Any]:
    """``_run`` for ``dtype_name`` plus its errors against the float32 run."""
    case = factory()
    if dtype_name == "float32":
        return dict(_run(case, "float32"), case=case)
    ref = measure(factory, "float32")
    out = _run(case, dtype_name)
    out["case"] = case
    out["loss_err"] = abs(out["loss0"] - ref["loss0"]) / abs(ref["loss0"])
    out["grad_err"], out["grad_err_global"] = grad_errors(out["grads0"], ref["grads0"])
    out["final_err"] = abs(out["losses"][-1] - ref["losses"][-1]) / abs(ref["losses"][-1])
    return out


NEGLIGIBLE = 1e-3  # a leaf whose float32 gradient norm is below this fraction of the total


def grad_errors(grads: Any, ref: Any) -> tuple[float, float]:
    """(max over leaves of the relative L2 error, relative L2 error of the whole gradient).

    The per-leaf maximum skips leaves whose float32 gradient is negligible (below
    ``NEGLIGIBLE`` times the whole gradient's norm): e.g. the bias of a convolution
    followed by BatchNorm has a mathematically zero gradient, so its "relative error" is
    rounding noise divided by rounding noise. Those leaves still count in the global error.
    """
    a = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_array))]
    b = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(eqx.filter(ref, eqx.is_array))]
    assert len(a) == len(b) and a, (len(a), len(b))
    total = float(np.sqrt(sum(np.sum(y**2) for y in b)))
    diff = float(np.sqrt(sum(np.sum((x - y) ** 2) for x, y in zip(a, b))))
    leaf = [tree_max_rel_err(x, y) for x, y in zip(a, b) if np.linalg.norm(y) >= NEGLIGIBLE * total]
    return max(leaf), diff / total


def census_counts(census) -> tuple[int, int, int]:
    """(half matmuls/convs, float32 ones outside amp_stop, float32 ones inside amp_stop)."""
    half = sum(n for (_, dt, _), n in census.items() if dt in ("float16", "bfloat16"))
    f32_out = sum(n for (_, dt, stop), n in census.items() if dt == "float32" and not stop)
    f32_in = sum(n for (_, dt, stop), n in census.items() if dt == "float32" and stop)
    return half, f32_out, f32_in


# Shared assertions, used by the Flax tests too ------------------------------------------


def check_compute_ops_half(factory, dtype_name):
    m, ref = measure(factory, dtype_name), measure(factory, "float32")
    name = f"{m['case'].name}/{dtype_name}"
    half, f32_out, _ = census_counts(m["census"])
    ref_half, ref_f32, _ = census_counts(ref["census"])
    assert ref_f32 > 0 and ref_half == 0, ref["census"]
    assert f32_out == 0, f"{name}: float32 matmuls/convs outside amp_stop (forward+backward): {m['census']}"
    assert half > 0 and {dt for (_, dt, _) in m["census"]} == {dtype_name}, m["census"]
    # forward pass: exactly the float32 run's matmuls and convolutions, all in half precision
    fwd = {(prim, stop): n for (prim, _, stop), n in m["census_fwd"].items()}
    ref_fwd = {(prim, stop): n for (prim, _, stop), n in ref["census_fwd"].items()}
    assert fwd == ref_fwd, (name, m["census_fwd"], ref["census_fwd"])
    assert {dt for (_, dt, _) in m["census_fwd"]} == {dtype_name}, m["census_fwd"]


def check_close_to_float32(factory, dtype_name):
    m = measure(factory, dtype_name)
    tol = m["case"].tol[dtype_name]
    name = f"{m['case'].name}/{dtype_name}"
    assert np.isfinite(m["loss0"]), name
    assert m["loss_err"] < tol.loss, f"{name}: step-0 loss rel. error {m['loss_err']:.2e} >= {tol.loss}"
    assert m["grad_err_global"] < tol.grad, f"{name}: step-0 grad rel. error {m['grad_err_global']:.2e} >= {tol.grad}"
    assert m["grad_err"] < tol.leaf, f"{name}: step-0 grad rel. error of a leaf {m['grad_err']:.2e} >= {tol.leaf}"
    assert m["final_err"] < tol.final, f"{name}: last loss rel. error {m['final_err']:.2e} >= {tol.final}"


def check_loss_decreases(factory, dtype_name):
    losses = measure(factory, dtype_name)["losses"]
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < 0.95 * losses[0], f"{factory.__name__}/{dtype_name}: loss did not decrease: {losses}"


def check_dtypes_preserved(factory, dtype_name):
    m = measure(factory, dtype_name)
    case = m["case"]
    assert _array_dtypes(m["grads0"]) == _array_dtypes(eqx.filter(case.params, eqx.is_inexact_array))
    assert _array_dtypes(m["state1"]) == _array_dtypes(case.state)
    assert _array_dtypes(m["final_state"]) == _array_dtypes(case.state)
    assert _array_dtypes(m["final_params"]) == _array_dtypes(case.params)


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------

B = 8  # batch size
N_CLASSES = 4


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# Data from NumPy, models initialised under one jit: eager jax.random calls compile a
# program per shape, which costs more than everything else in these tests.
def normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def integers(seed, high, shape):
    return jnp.asarray(np.random.default_rng(seed).integers(0, high, shape, dtype=np.int32))


def jit_init(make, *args):
    """``make(*args)`` (a model constructor taking a PRNG key) under ``eqx.filter_jit``."""
    return eqx.filter_jit(make, compiler_options=FAST_COMPILE)(*args)


# Tolerances against float32, chosen from the measured errors (benchmarks/results/accuracy/models.md,
# tests/model_report.py; two data sets) with a 3-10x margin. float16 keeps 11 significand
# bits, bfloat16 8: bfloat16 errors are ~8x larger. Measured maxima over the models using
# TOL: float16: loss 5.2e-5, grad 1.6e-3, leaf 2.5e-3, last loss 6.1e-4; bfloat16: loss
# 5.4e-4, grad 1.2e-2, leaf 2.3e-2, last loss 2.4e-3.
TOL = {
    "float16": Tol(loss=1e-3, grad=5e-3, leaf=1e-2, final=5e-3),
    "bfloat16": Tol(loss=5e-3, grad=5e-2, leaf=1e-1, final=2e-2),
}
# Convolutions followed by BatchNorm. The gradient of a weight feeding a normalisation is
# orthogonal to the weight (scale invariance) and BatchNorm's backward pass subtracts batch
# means: small differences of large terms, so the half-precision rounding of the
# convolutions (forward and transposed) and of the bias add (amp adds a float32 bias in
# the activation's half dtype) shows up amplified in the leaves with small gradients
# (first conv kernel, first BatchNorm's bias). A hand-written float16 version of the
# Equinox model (one cast after each conv) measured 1.3e-2 to 1.9e-2 on those leaves; amp
# measured, over two data sets and three models, leaf 7e-4 to 5.5e-2 (float16) and 5.6e-2
# to 2.0e-1 (bfloat16); whole gradient up to 1.2e-2 (float16) and 5.1e-2 (bfloat16).
# Losses are as accurate as elsewhere (float16 <= 6e-5, bfloat16 <= 5.4e-4).
BN_TOL = {
    "float16": Tol(loss=1e-3, grad=5e-2, leaf=2e-1, final=5e-3),
    "bfloat16": Tol(loss=5e-3, grad=1.5e-1, leaf=5e-1, final=2e-2),
}
MLP_TOL = VIT_TOL = RNN_TOL = TOL
CNN_TOL = BN_TOL


def eqx_mlp() -> Case:
    """``eqx.nn.MLP`` classifier."""
    model = jit_init(
        lambda k: eqx.nn.MLP(16, N_CLASSES, width_size=32, depth=2, activation=jax.nn.gelu, key=k), jax.random.key(0)
    )
    x, y = normal(0, (B, 16)), integers(0, N_CLASSES, (B,))

    def loss_fn(model, state, batch):
        x, y = batch
        return _xent(jax.vmap(model)(x), y), state

    return Case("eqx.nn.MLP", model, None, (x, y), loss_fn, MLP_TOL)


class ConvBN(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn1: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    bn2: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(3, 8, 3, padding=1, key=k1)
        self.bn1 = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.conv2 = eqx.nn.Conv2d(8, 16, 3, stride=2, padding=1, key=k2)
        self.bn2 = eqx.nn.BatchNorm(16, axis_name="batch", mode="batch")
        self.head = eqx.nn.Linear(16, N_CLASSES, key=k3)

    def __call__(self, x, state):
        x, state = self.bn1(self.conv1(x), state)
        x = jax.nn.relu(x)
        x, state = self.bn2(self.conv2(x), state)
        x = jax.nn.relu(x)
        return self.head(jnp.mean(x, axis=(1, 2))), state


def eqx_cnn_batchnorm() -> Case:
    """``eqx.nn.Conv2d`` + ``eqx.nn.BatchNorm`` with ``eqx.nn.State`` (batch statistics)."""
    model, state = jit_init(eqx.nn.make_with_state(ConvBN), jax.random.key(1))
    x, y = normal(1, (B, 3, 8, 8)), integers(1, N_CLASSES, (B,))

    def loss_fn(model, state, batch):
        x, y = batch
        logits, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
        return _xent(logits, y), state

    return Case("eqx.nn.Conv2d+BatchNorm", model, state, (x, y), loss_fn, CNN_TOL)


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim, heads, key):
        k1, k2 = jax.random.split(key)
        self.ln1 = eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, use_query_bias=True, use_output_bias=True, key=k1)
        self.ln2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 2 * dim, depth=1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):  # (seq, dim)
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


class ViT(eqx.Module):
    patch: eqx.nn.Conv2d
    pos: jax.Array
    blocks: list[Block]
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key, dim=16, heads=2, depth=2, patch=4, image=8):
        keys = jax.random.split(key, depth + 3)
        self.patch = eqx.nn.Conv2d(3, dim, patch, stride=patch, key=keys[0])
        self.pos = 0.02 * jax.random.normal(keys[1], ((image // patch) ** 2, dim))
        self.blocks = [Block(dim, heads, k) for k in keys[3:]]
        self.ln = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, N_CLASSES, key=keys[2])

    def __call__(self, image):  # (3, H, W)
        x = self.patch(image)  # (dim, h, w)
        x = x.reshape(x.shape[0], -1).T + self.pos  # (seq, dim)
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(jax.vmap(self.ln)(x), axis=0))


def eqx_vit() -> Case:
    """Small ViT: ``Conv2d`` patches, ``MultiheadAttention`` + ``LayerNorm`` blocks."""
    model = jit_init(ViT, jax.random.key(2))
    x, y = normal(2, (B, 3, 8, 8)), integers(2, N_CLASSES, (B,))

    def loss_fn(model, state, batch):
        x, y = batch
        return _xent(jax.vmap(model)(x), y), state

    return Case("eqx ViT (MultiheadAttention+LayerNorm)", model, None, (x, y), loss_fn, VIT_TOL)


VOCAB, SEQ = 24, 8


class LSTMLM(eqx.Module):
    embed: eqx.nn.Embedding
    cell: eqx.nn.LSTMCell
    out: eqx.nn.Linear

    def __init__(self, key, dim=16, hidden=32):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, dim, key=k1)
        self.cell = eqx.nn.LSTMCell(dim, hidden, key=k2)
        self.out = eqx.nn.Linear(hidden, VOCAB, key=k3)

    def __call__(self, tokens):  # (seq,) int -> (seq, vocab) logits
        xs = jax.vmap(self.embed)(tokens)

        def body(carry, x):
            carry = self.cell(x, carry)
            return carry, carry[0]

        init = (jnp.zeros(self.cell.hidden_size), jnp.zeros(self.cell.hidden_size))
        _, hs = jax.lax.scan(body, init, xs)
        return jax.vmap(self.out)(hs)


def eqx_lstm_embedding() -> Case:
    """``eqx.nn.Embedding`` -> ``eqx.nn.LSTMCell`` under ``lax.scan``: next-token model."""
    model = jit_init(LSTMLM, jax.random.key(3))
    tokens = integers(3, VOCAB, (B, SEQ + 1))

    def loss_fn(model, state, tokens):
        logits = jax.vmap(model)(tokens[:, :-1])
        return _xent(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)), state

    return Case("eqx Embedding+LSTMCell (scan)", model, None, tokens, loss_fn, RNN_TOL, optimizer=optax.adam(3e-2))


class GRURegressor(eqx.Module):
    cell: eqx.nn.GRUCell
    out: eqx.nn.Linear

    def __init__(self, key, features=4, hidden=32):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(features, hidden, key=k1)
        self.out = eqx.nn.Linear(hidden, 1, key=k2)

    def __call__(self, xs):  # (seq, features) -> scalar
        h, _ = jax.lax.scan(lambda h, x: (self.cell(x, h), None), jnp.zeros(self.cell.hidden_size), xs)
        return self.out(h)[0]


def eqx_gru() -> Case:
    """``eqx.nn.GRUCell`` under ``lax.scan``: sequence regression (MSE)."""
    model = jit_init(GRURegressor, jax.random.key(4))
    xs = normal(4, (B, SEQ, 4))
    y = jnp.sum(xs[:, :, 0], axis=1) / SEQ + 0.5

    def loss_fn(model, state, batch):
        xs, y = batch
        return jnp.mean((jax.vmap(model)(xs) - y) ** 2), state

    return Case("eqx GRUCell (scan)", model, None, (xs, y), loss_fn, RNN_TOL)


MODELS = [eqx_mlp, eqx_cnn_batchnorm, eqx_vit, eqx_lstm_embedding, eqx_gru]
PARAMS = [pytest.param(f, d, id=f"{f.__name__}-{d}") for f in MODELS for d in HALF_DTYPES]


# --------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("factory,dtype_name", PARAMS)
def test_every_matmul_and_conv_is_half(factory, dtype_name):
    check_compute_ops_half(factory, dtype_name)


@pytest.mark.parametrize("factory,dtype_name", PARAMS)
def test_loss_and_grads_close_to_float32(factory, dtype_name):
    check_close_to_float32(factory, dtype_name)


@pytest.mark.parametrize("factory,dtype_name", PARAMS)
def test_loss_decreases(factory, dtype_name):
    check_loss_decreases(factory, dtype_name)


@pytest.mark.parametrize("factory,dtype_name", PARAMS)
def test_grads_params_and_state_keep_dtypes(factory, dtype_name):
    check_dtypes_preserved(factory, dtype_name)
