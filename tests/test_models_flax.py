"""Real Flax models (Linen and NNX), built from Flax's own layers, trained under ``amp``.

Same protocol as ``test_models_equinox.py`` (whose harness this reuses): a few optax
steps under ``jax.jit`` with ``jax.value_and_grad(amp(loss))``, compared with the float32
run of the same model, initialisation and data.

- Linen: a CNN with ``nn.Conv`` + ``nn.BatchNorm`` (``batch_stats`` as mutable state), and a
  causal transformer whose blocks are stacked with ``nn.scan`` over ``nn.remat``.
- NNX: a CNN with ``nnx.BatchNorm`` through ``nnx.split`` / ``nnx.merge`` (parameters and
  batch statistics as separate pytrees), and an MLP with ``nnx.LayerNorm`` passed to
  ``amp`` directly (NNX modules are pytrees).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from test_models_equinox import (
    BN_TOL,
    FAST_COMPILE,
    HALF_DTYPES,
    TOL,
    Case,
    check_close_to_float32,
    check_compute_ops_half,
    check_dtypes_preserved,
    check_loss_decreases,
    integers,
    normal,
)

B, N_CLASSES = 8, 4
VOCAB, SEQ, DIM = 24, 8, 16

_jax_vg = functools.partial(jax.value_and_grad, has_aux=True)


def _xent(logits, labels):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _jit_init(init, *args):
    return jax.jit(init, compiler_options=FAST_COMPILE)(*args)


def _nnx_init(make):
    """``make()`` (builds an NNX module) with its initialisers run under one jit."""
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    state = jax.jit(lambda: nnx.split(make())[1], compiler_options=FAST_COMPILE)()
    return nnx.merge(graphdef, state)


def _flax_case(name, params, state, batch, loss_fn, tol, **kw) -> Case:
    return Case(
        name,
        params,
        state,
        batch,
        loss_fn,
        tol,
        jit=functools.partial(jax.jit, compiler_options=FAST_COMPILE),
        value_and_grad=_jax_vg,
        **kw,
    )


# --- Linen CNN with BatchNorm ------------------------------------------------------------


class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        x = nn.Conv(16, (3, 3), strides=2)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        return nn.Dense(N_CLASSES)(jnp.mean(x, axis=(1, 2)))


# Convolutions followed by BatchNorm: see BN_TOL in test_models_equinox.py.
LINEN_CNN_TOL = BN_TOL


def linen_cnn_batchnorm() -> Case:
    model = LinenCNN()
    x, y = normal(10, (B, 8, 8, 3)), integers(10, N_CLASSES, (B,))
    variables = _jit_init(functools.partial(model.init, train=False), jax.random.key(10), x)

    def loss_fn(params, batch_stats, batch):
        x, y = batch
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
        )
        return _xent(logits, y), updates["batch_stats"]

    return _flax_case(
        "linen Conv+BatchNorm", variables["params"], variables["batch_stats"], (x, y), loss_fn, LINEN_CNN_TOL
    )


# --- Linen transformer: nn.scan over nn.remat blocks -------------------------------------


class LinenBlock(nn.Module):
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x, _):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.Dense(self.dim)(nn.gelu(nn.Dense(2 * self.dim)(nn.LayerNorm()(x))))
        return x + h, None


class LinenTransformer(nn.Module):
    depth: int = 2

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, DIM)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (SEQ, DIM))
        Stack = nn.scan(
            nn.remat(LinenBlock),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.depth,
        )
        x, _ = Stack(DIM, 2)(x, None)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


LINEN_TRANSFORMER_TOL = TOL


def linen_transformer() -> Case:
    model = LinenTransformer()
    tokens = integers(11, VOCAB, (B, SEQ + 1))
    params = _jit_init(model.init, jax.random.key(11), tokens[:, :-1])["params"]

    def loss_fn(params, state, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return _xent(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)), state

    return _flax_case("linen Transformer (nn.scan+nn.remat)", params, None, tokens, loss_fn, LINEN_TRANSFORMER_TOL)


# --- NNX CNN with BatchNorm, through nnx.split / nnx.merge ------------------------------


class NNXCNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, (3, 3), strides=2, rngs=rngs)
        self.bn2 = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.head = nnx.Linear(16, N_CLASSES, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.relu(self.bn2(self.conv2(x)))
        return self.head(jnp.mean(x, axis=(1, 2)))


NNX_CNN_TOL = LINEN_CNN_TOL


def nnx_cnn_split_merge() -> Case:
    model = _nnx_init(lambda: NNXCNN(nnx.Rngs(12)))
    model.train()
    graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    x, y = normal(12, (B, 8, 8, 3)), integers(12, N_CLASSES, (B,))

    def loss_fn(params, batch_stats, batch):
        x, y = batch
        model = nnx.merge(graphdef, params, batch_stats, copy=True)
        loss = _xent(model(x), y)
        _, _, new_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
        return loss, new_stats

    return _flax_case("nnx Conv+BatchNorm (split/merge)", params, batch_stats, (x, y), loss_fn, NNX_CNN_TOL)


# --- NNX MLP passed directly (an NNX module is a pytree) ---------------------------------


class NNXMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.ln = nnx.LayerNorm(32, rngs=rngs)
        self.l2 = nnx.Linear(32, 32, rngs=rngs)
        self.l3 = nnx.Linear(32, N_CLASSES, rngs=rngs)

    def __call__(self, x):
        x = nnx.gelu(self.ln(self.l1(x)))
        return self.l3(nnx.gelu(self.l2(x)))


NNX_MLP_TOL = TOL


def nnx_mlp_pytree() -> Case:
    model = _nnx_init(lambda: NNXMLP(nnx.Rngs(13)))
    x, y = normal(13, (B, 16)), integers(13, N_CLASSES, (B,))

    def loss_fn(model, state, batch):
        x, y = batch
        return _xent(model(x), y), state

    return _flax_case("nnx MLP+LayerNorm (module as pytree)", model, None, (x, y), loss_fn, NNX_MLP_TOL)


MODELS = [linen_cnn_batchnorm, linen_transformer, nnx_cnn_split_merge, nnx_mlp_pytree]
PARAMS = [pytest.param(f, d, id=f"{f.__name__}-{d}") for f in MODELS for d in HALF_DTYPES]


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


def test_linen_transformer_keeps_scan_and_remat():
    """The transformed jaxpr still has the layer ``scan`` and the ``nn.remat`` checkpoint
    inside it, with the matmuls of the block in half precision *inside* the scan body."""
    from helpers import bodies, dots_in, of_kind

    import autocast

    case = linen_transformer()
    fn = autocast.amp(lambda p, t: case.loss_fn(p, None, t)[0])
    forward = jax.make_jaxpr(fn)(case.params, case.batch)
    closed = jax.make_jaxpr(jax.grad(fn))(case.params, case.batch)
    scans = of_kind(closed, "scan")
    assert len(scans) >= 2, "the nn.scan over layers (forward and backward) disappeared"
    inner = [d for s in scans for b in bodies(s) for d in dots_in(b)]
    assert inner and all(d[0] == "float16" for d in inner), inner
    remats = [r for s in of_kind(forward, "scan") for b in bodies(s) for r in of_kind(b, "checkpoint")]
    assert remats, "nn.remat's checkpoint inside the scanned block disappeared"


def test_linen_nn_remat_still_recomputes_under_amp():
    """``nn.remat`` means: save only the block's inputs, recompute the rest in the backward
    pass. Under amp the backward pass must still recompute the block's matmuls, as in
    float32 (same number of matmuls in the gradient's jaxpr); see
    test_higher_order.py::test_user_checkpoint_still_recomputes_its_matmuls."""
    from helpers import compute_op_dtypes

    import autocast

    case = linen_transformer()
    loss = lambda p, t: case.loss_fn(p, None, t)[0]

    def n_dots(fn):
        return sum(
            n
            for (prim, _, _), n in compute_op_dtypes(jax.grad(fn), case.params, case.batch).items()
            if prim == "dot_general"
        )

    want, got = n_dots(loss), n_dots(autocast.amp(loss))
    assert got == want, f"amp: {got} matmuls in jax.grad, float32: {want}; nn.remat's block is no longer recomputed"


class _NNXBlock(nnx.Module):
    """Linear, BatchNorm (running statistics), GELU, Dropout (an ``nnx.Rngs`` counter)."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(16, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x):
        return self.dropout(nnx.gelu(self.norm(self.linear(x))))


def _nnx_state_after_two_steps(wrap):
    model = _nnx_init(lambda: _NNXBlock(nnx.Rngs(0, dropout=1)))
    model.train()
    x = normal(5, (B, 16))

    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    @nnx.jit
    def step(model, x):
        return nnx.value_and_grad(wrap(loss))(model, x)

    losses = [float(step(model, x)[0]) for _ in range(2)]
    return losses, nnx.state(model, nnx.BatchStat), nnx.state(model, nnx.RngCount), model


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_nnx_state_updates_reach_the_module(dtype_name):
    """An NNX module updates its own state as it runs: under ``nnx.value_and_grad(amp(loss))``
    the BatchNorm's running statistics move as in float32 and Dropout's RNG counter advances,
    so the second step draws a new dropout mask (until 2026-11-27 amp traced copies of the
    module: the statistics never moved and every step drew the first step's mask)."""
    import autocast

    dtype = HALF_DTYPES[dtype_name]
    (l32, stats32, counts32, _) = _nnx_state_after_two_steps(lambda f: f)
    (l16, stats16, counts16, model) = _nnx_state_after_two_steps(lambda f: autocast.amp(f, compute_dtype=dtype))
    assert l32[0] != l32[1]  # the control: float32's second step differs (a new mask, moved statistics)
    for a, b in zip(l16, l32):
        assert abs(a - b) < 2e-2 * abs(b), (l16, l32)
    assert jax.tree.map(lambda a: a.tolist(), counts16) == jax.tree.map(lambda a: a.tolist(), counts32)
    for a, b in zip(jax.tree.leaves(stats16), jax.tree.leaves(stats32)):
        assert a.dtype == b.dtype == jnp.float32
        assert float(jnp.max(jnp.abs(a - b))) < 2e-2 * float(jnp.max(jnp.abs(b))), (a, b)
        assert float(jnp.max(jnp.abs(b))) > 0  # the statistics moved from their zero start

    # the module itself as the function: amp(model)(x) in training mode updates its statistics
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.BatchStat))
    autocast.amp(model, compute_dtype=dtype)(normal(6, (B, 16)))
    moved = [
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.BatchStat)), jax.tree.leaves(before))
    ]
    assert all(m > 0 for m in moved), moved
