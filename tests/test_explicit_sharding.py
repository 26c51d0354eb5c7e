"""``amp`` on ``jax.make_mesh`` meshes with explicit axis types (sharding in types): data
parallel, FSDP and tensor parallel with ``out_sharding=`` on ``jnp.einsum``/``jnp.dot``,
``jax.sharding.reshard`` inside the function, under ``jax.set_mesh``.

Checked against the same function in float32: values, the sharding of every output and
gradient, and the dtypes on the wire (weight gradients reduced in float32, parameters
gathered in half precision, matmuls on half-precision operands).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compute_op_dtypes, tree_max_rel_err
from hlo_collectives import collectives, kinds_with
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import autocast

D, H = 64, 128


@pytest.fixture(scope="module")
def mesh2d():
    assert len(jax.devices()) == 8, "tests/conftest.py should give 8 CPU devices"
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit))


@pytest.fixture(scope="module")
def mesh1d():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def _init():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(k[0], (D, H)) / 8, "w2": jax.random.normal(k[1], (H, D)) / 11}
    return params, jax.random.normal(k[2], (32, D))


def mlp(params, x):
    return jnp.mean(jax.nn.gelu(jax.nn.gelu(x @ params["w1"]) @ params["w2"]).astype(jnp.float32) ** 2)


def tensor_parallel(params, x):
    """Megatron MLP: column-parallel then row-parallel, out_sharding given explicitly."""
    h = jnp.einsum("bd,dh->bh", x, params["w1"], out_sharding=P("data", "model"))
    h = jax.nn.gelu(h)
    y = jnp.dot(h, params["w2"], out_sharding=P("data", None))
    y = jax.sharding.reshard(y, P("data", None))
    return jnp.mean(jax.nn.gelu(y).astype(jnp.float32) ** 2)


def _put(mesh, tree, spec):
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh, spec))


def _check_against_float32(fn, params, x, dtype=jnp.float16, tol=2e-2):
    f = jax.jit(jax.value_and_grad(autocast.amp(fn, compute_dtype=dtype)))
    v, g = f(params, x)
    v32, g32 = jax.jit(jax.value_and_grad(fn))(params, x)
    np.testing.assert_allclose(v, v32, rtol=tol)
    assert tree_max_rel_err(g, g32) < tol
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g32)):
        assert a.dtype == b.dtype and jax.typeof(a).sharding.spec == jax.typeof(b).sharding.spec, (a, b)
    return f.lower(params, x).compile().as_text()


@pytest.mark.parametrize("layout", ["data_parallel", "fsdp"])
def test_data_parallel_and_fsdp_on_an_explicit_mesh(mesh1d, layout):
    params, x = _init()
    with jax.set_mesh(mesh1d):
        params = _put(mesh1d, params, P() if layout == "data_parallel" else P("data", None))
        x = _put(mesh1d, x, P("data", None))
        hlo = _check_against_float32(mlp, params, x)
        grads = jax.grad(autocast.amp(mlp))(params, x)
        for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)):
            assert jax.typeof(g).sharding.spec == jax.typeof(p).sharding.spec  # gradients sharded like params
    weight_collectives = kinds_with(hlo, (D, H)) | kinds_with(hlo, (H, D))
    reduced = {d for k, d in weight_collectives if k in ("all-reduce", "reduce-scatter")}
    assert reduced == {"f32"}, collectives(hlo)
    if layout == "fsdp":
        assert {d for k, d in weight_collectives if k == "all-gather"} == {"f16"}, collectives(hlo)


def _tensor_parallel_inputs(mesh2d):
    """The MLP's weights sharded over "model" (columns, then rows), the batch over "data"."""
    params, x = _init()
    with jax.set_mesh(mesh2d):
        params = {
            "w1": _put(mesh2d, params["w1"], P(None, "model")),
            "w2": _put(mesh2d, params["w2"], P("model", None)),
        }
        return params, _put(mesh2d, x, P("data", None))


def test_tensor_parallel_with_out_sharding_and_reshard(mesh2d):
    params, x = _tensor_parallel_inputs(mesh2d)
    with jax.set_mesh(mesh2d):
        hlo = _check_against_float32(tensor_parallel, params, x)
        f = autocast.amp(tensor_parallel)
        counts = compute_op_dtypes(f, params, x)
        assert counts and all(dtype == "float16" for (_, dtype, _) in counts), counts
        counts_bwd = compute_op_dtypes(jax.grad(f), params, x)
        assert all(dtype == "float16" for (_, dtype, _) in counts_bwd), counts_bwd
    # the weights stay sharded over "model": their gradients are reduced over "data" only, in float32
    for shape in [(D, H // 2), (H // 2, D)]:
        reduced = {d for k, d in kinds_with(hlo, shape) if k in ("all-reduce", "reduce-scatter")}
        assert reduced == {"f32"}, collectives(hlo)


def test_amp_output_shardings_follow_the_function(mesh2d):
    params, x = _tensor_parallel_inputs(mesh2d)
    with jax.set_mesh(mesh2d):

        def hidden(params, x):
            return jnp.einsum("bd,dh->bh", x, params["w1"], out_sharding=P("data", "model"))

        out = jax.jit(autocast.amp(hidden))(params, x)
        ref = jax.jit(hidden)(params, x)
    assert out.dtype == jnp.float32 and jax.typeof(out).sharding.spec == jax.typeof(ref).sharding.spec == P(
        "data", "model"
    )
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)
