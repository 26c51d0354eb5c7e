"""Weight gradients leave the matmul in float32 (issue 16).

A matmul ``dot(x16, w16)`` whose weight was narrowed from a float32 parameter is
transposed by JAX into ``dW = x16^T . dy16`` with a half-precision result, converted to
float32 only afterwards: on a mesh the partitioner's all-reduce (data parallel) or
reduce-scatter (FSDP) runs right after that dot, in half precision. Under ``amp`` the
weight's cotangent is the same half-precision dot with a float32 result, so every
reduction after it runs in float32; the activation gradient stays half. These tests check
the optimised HLO on 8 simulated devices, the backward jaxpr, the numerics against
float32, the transformations (vmap, scan, remat, shard_map, forward mode) and that no
activation-sized float32 residual appears. ``weight_grad_dtype="compute"`` restores the
half-precision reduction (and shows the HLO checks are not vacuous).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree_max_rel_err, walk
from hlo_collectives import collectives, kinds_with
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autocast
from autocast import _compat

N_DEV, WIDTH, LAYERS, BATCH = 8, 128, 3, 64
HALF = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}


def mlp(params, x):
    for w in params:
        x = jax.nn.gelu(x @ w)
    return jnp.mean(x.astype(jnp.float32) ** 2)


def init(width=WIDTH, layers=LAYERS, batch=BATCH, seed=0):
    key = jax.random.PRNGKey(seed)
    params = [jax.random.normal(jax.random.fold_in(key, i), (width, width)) / np.sqrt(width) for i in range(layers)]
    return params, jax.random.normal(jax.random.fold_in(key, 99), (batch, width))


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) == N_DEV, "tests/conftest.py should give 8 CPU devices"
    return Mesh(np.array(jax.devices()), ("data",))


def _hlo(mesh, param_spec, **amp_kwargs):
    params, x = init()
    params = jax.device_put(params, NamedSharding(mesh, param_spec))
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    f = jax.jit(jax.value_and_grad(autocast.amp(mlp, **amp_kwargs)))
    return f.lower(params, x).compile().as_text()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("layout", ["data_parallel", "fsdp"])
def test_weight_gradients_are_reduced_in_float32(mesh, layout, dtype):
    spec = P() if layout == "data_parallel" else P("data", None)
    hlo = _hlo(mesh, spec, compute_dtype=HALF[dtype])
    reductions = {(k, d) for k, d in kinds_with(hlo, (WIDTH, WIDTH)) if k in ("all-reduce", "reduce-scatter")}
    reductions |= {(k, d) for k, d in kinds_with(hlo, (WIDTH // N_DEV, WIDTH)) if k == "reduce-scatter"}
    assert reductions and {d for _, d in reductions} == {"f32"}, collectives(hlo)
    # weight_grad_dtype="compute": the half-precision reduction (FSDP2's reduce_dtype)
    hlo_half = _hlo(mesh, spec, compute_dtype=HALF[dtype], weight_grad_dtype="compute")
    half = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    if dtype == "float16":  # XLA-CPU rewrites bfloat16 dots to float32 before partitioning
        assert ("all-reduce", half) in kinds_with(hlo_half, (WIDTH, WIDTH)), collectives(hlo_half)


def test_fsdp_parameters_are_gathered_in_half_precision(mesh):
    hlo = _hlo(mesh, P("data", None), compute_dtype=jnp.float16)
    gathers = {d for k, d in kinds_with(hlo, (WIDTH, WIDTH)) if k == "all-gather"}
    assert gathers == {"f16"}, collectives(hlo)


def _grad_dots(fn, *args):
    """(operand dtypes, result dtype, result shape) of every dot in the backward jaxpr."""
    closed = jax.make_jaxpr(jax.grad(fn))(*args)
    return [
        (
            tuple(str(v.aval.dtype) for v in e.invars),
            str(e.outvars[0].aval.dtype),
            tuple(e.outvars[0].aval.shape),
        )
        for e, _ in walk(closed)
        if e.primitive.name == "dot_general"
    ]


@pytest.mark.parametrize("dtype", HALF)
def test_backward_dots_run_on_half_operands_and_only_weight_gradients_are_float32(dtype):
    params, x = init()
    dots = _grad_dots(autocast.amp(mlp, compute_dtype=HALF[dtype]), params, x)
    half = np.dtype(HALF[dtype]).name
    assert all(ops == (half, half) for ops, _, _ in dots), dots  # no float32 x half GEMM
    f32 = [shape for _, out, shape in dots if out == "float32"]
    assert sorted(f32) == [(WIDTH, WIDTH)] * LAYERS, dots  # one per weight
    assert any(out == half and shape == (BATCH, WIDTH) for _, out, shape in dots)  # activation grads stay half


def _weight_grad_err(dtype, **amp_kwargs):
    params, x = init(width=256, batch=256)
    loss = lambda p, x: 1024.0 * mlp(p, x)  # noqa: E731  (a loss scale keeps f16 gradients normal)
    g = jax.jit(jax.grad(autocast.amp(loss, compute_dtype=dtype, **amp_kwargs)))(params, x)
    g32 = jax.jit(jax.grad(loss))(params, x)
    return tree_max_rel_err(g, g32)


def test_float32_weight_gradients_are_closer_to_float32():
    """One device: the weight gradient is no longer rounded to float16 after the dot."""
    err = _weight_grad_err(jnp.float16)
    err_half = _weight_grad_err(jnp.float16, weight_grad_dtype="compute")
    assert err < err_half, (err, err_half)
    assert err < 3e-3


def test_bad_weight_grad_dtype_is_rejected():
    with pytest.raises(ValueError, match=r"weight_grad_dtype='half'.*'float32' or 'compute'"):
        autocast.amp(mlp, weight_grad_dtype="half")


# --- transformations ----------------------------------------------------------------------


def _check(grads, ref, tol=3e-2):
    err = tree_max_rel_err(grads, ref)
    assert err < tol, err


def test_vmap_of_grad_and_grad_of_vmap():
    params, x = init(width=32, batch=8)
    xs = x.reshape(4, 2, 32)
    f = autocast.amp(mlp)
    per_example = jax.vmap(jax.grad(f), in_axes=(None, 0))(params, xs)
    per_example32 = jax.vmap(jax.grad(mlp), in_axes=(None, 0))(params, xs)
    _check(per_example, per_example32)
    assert all(g.dtype == jnp.float32 and g.shape == (4, 32, 32) for g in per_example)

    def batched_loss(p, xs):  # the Equinox pattern: vmap the model, grad the mean
        return jnp.mean(jax.vmap(mlp, in_axes=(None, 0))(p, xs))

    g = jax.grad(autocast.amp(batched_loss))(params, xs)
    _check(g, jax.grad(batched_loss)(params, xs))
    dots = _grad_dots(autocast.amp(batched_loss), params, xs)
    assert sorted(s for _, out, s in dots if out == "float32") == [(32, 32)] * LAYERS, dots


def test_scan_accumulates_weight_gradients_in_float32():
    params, x = init(width=32, batch=8)
    w = params[0]

    def rnn(w, xs):
        def step(h, x):
            h = jnp.tanh(h @ w + x)
            return h, None

        h, _ = jax.lax.scan(step, jnp.zeros((8, 32)), xs)
        return jnp.sum(h**2)

    xs = jnp.stack([x] * 6)
    _check(jax.grad(autocast.amp(rnn))(w, xs), jax.grad(rnn)(w, xs))
    dots = _grad_dots(autocast.amp(rnn), w, xs)
    assert ((("float16", "float16"), "float32", (32, 32))) in dots, dots


def test_remat_with_a_dots_policy():
    params, x = init(width=32, batch=8)
    model = jax.checkpoint(mlp, policy=jax.checkpoint_policies.dots_saveable)
    _check(jax.grad(autocast.amp(model))(params, x), jax.grad(mlp)(params, x))
    dots = _grad_dots(autocast.amp(model), params, x)
    assert sorted(s for _, out, s in dots if out == "float32") == [(32, 32)] * LAYERS, dots


def test_forward_mode_jvp_linearize_hessian():
    params, x = init(width=16, batch=4)
    f = autocast.amp(mlp)
    t = [jnp.ones_like(w) / 16 for w in params]
    out, tangent = jax.jvp(f, (params, x), (t, jnp.zeros_like(x)))
    out32, tangent32 = jax.jvp(mlp, (params, x), (t, jnp.zeros_like(x)))
    np.testing.assert_allclose(out, out32, rtol=2e-2)
    np.testing.assert_allclose(tangent, tangent32, rtol=5e-2)
    _, lin = jax.linearize(lambda p: f(p, x), params)
    np.testing.assert_allclose(lin(t), tangent32, rtol=5e-2)
    h = jax.hessian(lambda w: f([w, *params[1:]], x))(params[0])
    h32 = jax.hessian(lambda w: mlp([w, *params[1:]], x))(params[0])
    assert h.shape == h32.shape and tree_max_rel_err(h, h32) < 0.1


def test_shard_map_pmean_runs_in_float32(mesh):
    params, x = init()

    def local(params, x):
        params = jax.lax.pcast(params, "data", to="varying") if hasattr(jax.lax, "pcast") else params
        grads = jax.grad(autocast.amp(mlp))(params, x)
        return jax.lax.pmean(grads, "data")

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    params_r = jax.device_put(params, NamedSharding(mesh, P()))
    x_s = jax.device_put(x, NamedSharding(mesh, P("data")))
    hlo = f.lower(params_r, x_s).compile().as_text()
    assert kinds_with(hlo, (WIDTH, WIDTH)) == {("all-reduce", "f32")}, collectives(hlo)
    g = f(params_r, x_s)
    g1 = jax.grad(autocast.amp(mlp))(params, x)
    _check(g, g1, tol=5e-3)


@pytest.mark.parametrize("dtype", HALF)
def test_no_float32_activation_residuals(dtype):
    params, x = init()
    f = autocast.amp(mlp, compute_dtype=HALF[dtype])
    res = _compat.saved_residuals(f, params, x)
    big32 = [str(a) for a, _ in res if a.dtype == jnp.float32 and a.size > WIDTH * WIDTH]
    assert not big32, big32
    assert not [str(a) for a, _ in res if a.dtype == jnp.float32 and a.shape == (BATCH, WIDTH)]


def test_convolution_weight_gradient_is_float32_from_a_half_convolution():
    """A convolution keeps a half-precision result forward and backward (GPUs have no
    half-operand convolution with a float32 output: XLA:GPU would widen the operands); the
    weight cotangent is converted to float32 right after its convolution, so every
    reduction after it (psum, all-reduce, a scan's accumulation) runs in float32."""

    def f(w, x):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(jax.nn.gelu(y).astype(jnp.float32) ** 2)

    w = jax.random.normal(jax.random.PRNGKey(0), (3, 3, 4, 8)) / 6
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 8, 4))
    _check(jax.grad(autocast.amp(f))(w, x), jax.grad(f)(w, x), tol=3e-3)
    convs = [
        (tuple(str(v.aval.dtype) for v in e.invars), str(e.outvars[0].aval.dtype), tuple(e.outvars[0].aval.shape))
        for e, _ in walk(jax.make_jaxpr(jax.grad(autocast.amp(f)))(w, x))
        if e.primitive.name == "conv_general_dilated"
    ]
    assert (("float16", "float16"), "float16", (3, 3, 4, 8)) in convs, convs
    assert all(ops == ("float16", "float16") and out == "float16" for ops, out, _ in convs), convs
    assert jax.grad(autocast.amp(f))(w, x).dtype == jnp.float32
    # vmap of grad (per-example gradients): a batched convolution, values still right
    per_example = jax.vmap(jax.grad(autocast.amp(f)), in_axes=(None, 0))(w, x[:, None])
    per_example32 = jax.vmap(jax.grad(f), in_axes=(None, 0))(w, x[:, None])
    _check(per_example, per_example32, tol=3e-3)
