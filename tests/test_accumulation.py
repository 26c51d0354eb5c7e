"""Every accumulation in float32 (issue 42): sums that amp's casts would otherwise make in half
precision, in the forward pass and in the backward pass JAX derives from it.

- A ``scatter-add`` (``jax.ops.segment_sum``, ``x.at[i].add``) whose operand also feeds a matmul
  summed thousands of terms per element in bfloat16: a graph potential's energy was 57 % off.
- The derivative of a gather with repeated indices is a ``scatter-add``, and of a broadcast a
  ``reduce_sum``, in the dtype the gather or broadcast ran in: a node's features gathered by
  2,000 edges got a gradient 80 % off in bfloat16.

Each case compares the whole training step (value and gradients) with float32, and with the
same model written with ``jnp.sum`` (which amp always ran in float32): the reference for
"bfloat16's usual error".
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import walk

import autocast
from autocast import _compat, _policy

HALVES = [jnp.float16, jnp.bfloat16]
N, E, D = 4, 8000, 32  # 2,000 edges per node


def _rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _graph():
    k = jax.random.split(jax.random.key(0), 6)
    x = jax.random.uniform(k[0], (N, D))
    params = {
        "w": jax.random.uniform(k[1], (D, D)) / np.sqrt(D),
        "wm": jax.random.normal(k[2], (D, D)) / np.sqrt(D),
        "w2": jax.random.normal(k[3], (D, 1)) / np.sqrt(D),
    }
    src = jax.random.randint(k[4], (E,), 0, N)
    dst = jax.random.randint(k[5], (E,), 0, N)
    return params, x, src, dst


def _segment_model(params, x, src, dst):
    """The issue's minimal form: node features from a matmul, summed over edges."""
    h = x @ params["w"]
    agg = jax.ops.segment_sum(h[src], dst, N)
    return jnp.sum(agg @ params["w2"])


def _onehot_model(params, x, src, dst):
    """The same sum written with jnp.sum over a one-hot (a reduce_sum: float32 under amp)."""
    h = x @ params["w"]
    onehot = jax.nn.one_hot(dst, N, dtype=h.dtype).T
    agg = jnp.sum(onehot[:, :, None] * h[src][None], axis=1)
    return jnp.sum(agg @ params["w2"])


def _message_model(params, x, src, dst):
    """Messages from gathered node features through a matmul: the gather's output is read in
    half precision, and its derivative (a scatter-add over 2,000 edges per node) must not be."""
    h = jnp.tanh(x @ params["w"])
    m = jnp.tanh(h[src] @ params["wm"])
    agg = jax.ops.segment_sum(m, dst, N)
    return jnp.sum(agg @ params["w2"])


def _step_errors(fn, dtype, *args):
    ref, gref = jax.value_and_grad(fn, argnums=(0, 1))(*args)
    val, g = jax.jit(jax.value_and_grad(autocast.amp(fn, compute_dtype=dtype), argnums=(0, 1)))(*args)
    return _rel(val, ref), max(_rel(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gref)))


@pytest.mark.parametrize("dtype", HALVES)
def test_segment_sum_is_as_accurate_as_the_same_sum_written_with_jnp_sum(dtype):
    args = _graph()
    seg = _step_errors(_segment_model, dtype, *args)
    onehot = _step_errors(_onehot_model, dtype, *args)
    # before: bfloat16 energy 648 for float32's 4425 (85 % off), gradients 81 % off
    assert seg[0] <= 2 * onehot[0] + 1e-3 and seg[1] <= 2 * onehot[1] + 1e-3, (seg, onehot)
    tol = 1e-2 if dtype == jnp.bfloat16 else 2e-3
    assert max(seg) < tol, seg


@pytest.mark.parametrize("dtype", HALVES)
def test_gradient_through_a_gather_with_repeated_indices_accumulates_in_float32(dtype):
    args = _graph()
    val_err, grad_err = _step_errors(_message_model, dtype, *args)
    # before: gradients of w and x 82 % (bfloat16) / 10 % (float16) off: a half-precision scatter-add
    tol = 2e-2 if dtype == jnp.bfloat16 else 5e-3
    assert val_err < tol and grad_err < tol, (val_err, grad_err)
    closed = jax.make_jaxpr(jax.grad(autocast.amp(_message_model, compute_dtype=dtype), argnums=(0, 1)))(*args)
    scatters = [e for e, _ in walk(closed) if e.primitive.name == "scatter-add"]
    assert scatters and all(e.invars[0].aval.dtype == jnp.float32 for e in scatters), [
        str(e.invars[0].aval) for e in scatters
    ]


@pytest.mark.parametrize("dtype", HALVES)
def test_gradient_of_a_broadcast_half_value_is_summed_in_float32(dtype):
    """A computed conditioning vector (a diffusion model's time embedding) added at 4,096
    positions: its gradient sums 4,096 cotangents."""
    k = jax.random.split(jax.random.key(1), 5)
    x, c = jax.random.normal(k[0], (2, 4096, 16)), jax.random.normal(k[1], (2, 16))
    params = {
        "wc": jax.random.normal(k[2], (16, 16)) / 4,
        "w": jax.random.normal(k[3], (16, 16)) / 4,
        "w3": jax.random.uniform(k[4], (16, 1)),
    }

    def loss(params, x, c):
        temb = jnp.tanh(c @ params["wc"])
        h = jnp.tanh(x @ params["w"]) + temb[:, None, :]
        return jnp.sum(h @ params["w3"])  # every position's cotangent the same positive row

    _, grad_err = _step_errors(loss, dtype, params, x, c)
    # before: 3.1e-2 in bfloat16 (a bfloat16 reduce_sum over the positions)
    assert grad_err < (1e-2 if dtype == jnp.bfloat16 else 2e-3), grad_err
    closed = jax.make_jaxpr(jax.grad(autocast.amp(loss, compute_dtype=dtype)))(params, x, c)
    big = [e for e, _ in walk(closed) if e.primitive.name == "reduce_sum" and e.invars[0].aval.size >= 4096 * 16]
    assert big and all(e.invars[0].aval.dtype == jnp.float32 for e in big), [str(e.invars[0].aval) for e in big]


def _pair_potential(params, pos, src, dst, n):
    """A small message-passing interatomic potential: radial features of edge lengths, a
    message MLP, segment sums onto atoms, an atom-energy head."""
    vec = pos[dst] - pos[src]
    r = jnp.sqrt(jnp.sum(vec**2, axis=-1) + 1e-6)
    centers = jnp.linspace(0.5, 3.0, 16)
    rbf = jnp.exp(-4.0 * (r[:, None] - centers) ** 2)
    m = jax.nn.silu(rbf @ params["w_rbf"])
    h = jax.ops.segment_sum(m, dst, n)
    h = jax.nn.silu(h @ params["w_h"])
    m2 = jax.nn.silu(h[src] @ params["w_m"]) * rbf[:, :1]
    h = h + jax.ops.segment_sum(m2, dst, n)
    return jnp.sum(h @ params["w_out"])


@pytest.mark.parametrize("dtype", HALVES)
def test_a_potential_trained_on_forces_matches_float32(dtype):
    """Second-order autodiff through segment sums: the loss on energy and forces
    (forces = -grad(energy, positions)) and its gradient, against float32."""
    n, per = 16, 60  # a dense neighbourhood: 60 neighbours per atom
    k = jax.random.split(jax.random.key(2), 7)
    pos = jax.random.uniform(k[0], (n, 3)) * 3.0
    src = jnp.repeat(jnp.arange(n), per) % n
    dst = jax.random.randint(k[1], (n * per,), 0, n)
    dst = jnp.where(dst == src, (dst + 1) % n, dst)
    params = {
        "w_rbf": jax.random.normal(k[2], (16, 32)) / 4,
        "w_h": jax.random.normal(k[3], (32, 32)) / 6,
        "w_m": jax.random.normal(k[4], (32, 32)) / 6,
        "w_out": jax.random.normal(k[5], (32, 1)) / 6,
    }
    f_target = jax.random.normal(k[6], (n, 3))

    def loss(params, pos, energy_fn):
        e, g = jax.value_and_grad(energy_fn, argnums=1)(params, pos, src, dst, n)
        return 1e-3 * e**2 + jnp.mean((-g - f_target) ** 2)

    ref, gref = jax.value_and_grad(loss)(params, pos, _pair_potential)
    amp_energy = autocast.amp(_pair_potential, compute_dtype=dtype)
    val, g = jax.jit(jax.value_and_grad(loss), static_argnums=2)(params, pos, amp_energy)
    assert np.isfinite(float(val)) and all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(g))
    tol = 3e-2 if dtype == jnp.bfloat16 else 5e-3
    assert _rel(val, ref) < tol, (float(val), float(ref))
    assert max(_rel(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gref))) < tol


# A primitive whose name says it may combine several elements into one.
_COMBINES = re.compile(
    r"sum|prod|cum|accum|scatter|reduce(?!d)|dot|conv(?!ert)|logsumexp|window|segment|matmul|einsum|pmax|pmin"
)


@pytest.mark.parametrize("table", ["default", "fp8"])
def test_every_accumulating_primitive_runs_in_float32_or_the_table_says_why(table):
    """Walk every primitive this JAX defines: each one that combines elements runs in float32
    under the shipped table, or its ``[accumulation]`` section lists it (``selects``: exact in
    any precision; ``exceptions``: with the reason). A new JAX primitive whose name says it
    combines elements fails here until it is placed."""
    policy = autocast.load_policy(table)
    selects, exceptions = _policy.accumulation(table)
    unplaced = []
    for name, prims in sorted(_compat.discover_primitives().items()):
        if not _COMBINES.search(name) or name in selects or name in exceptions:
            continue
        roles = {getattr(policy.get(p), "role", None) for p in prims}
        if roles != {"float32"}:
            unplaced.append(f"{name} (rule role {sorted(map(str, roles))})")
    assert not unplaced, (
        "primitives that may accumulate, neither float32 nor listed in [accumulation] of "
        f"policies/{table}.toml: {unplaced}"
    )
    assert all(len(reason) > 20 for reason in exceptions.values()), exceptions
    # the float32 ones really are: a scatter-add of half-precision updates accumulates in float32
    assert {getattr(policy.get(p), "role", None) for p in _compat.discover_primitives()["scatter-add"]} == {"float32"}


def test_the_accumulation_table_names_only_primitives_it_may_list():
    """A name the table lists as selecting or excepted is not also in the float32 category
    (one answer per primitive), and the selecting ones really only select (reductions of max,
    min, and/or/xor, arg-reductions, the scatters that overwrite or take extremes)."""
    policy = autocast.load_policy("default")
    selects, exceptions = _policy.accumulation("default")
    assert not selects & set(exceptions)
    by_name = _compat.discover_primitives()
    for name in selects | set(exceptions):
        for p in by_name.get(name, ()):
            assert getattr(policy.get(p), "role", None) != "float32", name
    assert all(re.search(r"max|min|arg|and|or|xor|^scatter$|select_and_gather", n) for n in selects), selects
