"""Half x half -> float32 matmuls are decided by the platform the program is lowered for.

XLA:CPU lacks a bfloat16 x bfloat16 -> float32 matmul in one layout (a matmul read through a
transpose), so autocast's CPU lowering widens those operands to float32 exactly; a GPU
runs them natively. The jaxpr is the same whatever the host, and a program exported (or
compiled) for CUDA from this CPU-only process keeps its half-precision GEMMs."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autocast
from autocast import _cpu_matmul


def _loss(w, x):
    h = jnp.maximum(x @ w, 0)
    return (h.T @ h).sum()  # the XLA:CPU failing pattern: a float32-result matmul read transposed


def _args():
    kw, kx = jax.random.split(jax.random.key(0))
    return jax.random.normal(kw, (16, 8)) / 4, jax.random.normal(kx, (4, 16))


def _dots(module_text: str) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) element types of every ``stablehlo.dot_general``."""
    t = r"tensor<(?:[0-9]+x)*(\w+)>"
    pat = re.compile(rf"stablehlo\.dot_general .*: \({t}, {t}\) -> {t}")
    return [m.groups() for m in map(pat.search, module_text.splitlines()) if m]


def _export(fn, platform, *args):
    return jax.export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cuda_lowering_keeps_half_operands(dtype):
    """Exported for CUDA from a CPU process: every matmul of the step reads half-precision
    operands (the float32 weight gradient comes straight from them), none float32."""
    grad = jax.grad(autocast.amp(_loss, compute_dtype=dtype))
    dots = _dots(_export(grad, "cuda", *_args()))
    half = {"bfloat16": "bf16", "float16": "f16"}[np.dtype(dtype).name]
    assert dots and all(lhs == rhs == half for lhs, rhs, _ in dots), dots
    assert "f32" in {out for *_, out in dots}, "the weight gradient should leave its matmul in float32"


def test_cpu_lowering_widens_exactly_where_xla_cpu_lacks_the_kernel():
    """The same jaxpr lowered for CPU: a bfloat16 x bfloat16 -> float32 matmul gets float32
    operands if (and only if) the probe of XLA:CPU found the kernel missing, and the step
    runs and matches the float32 reference."""
    w, x = _args()
    grad = jax.grad(autocast.amp(_loss, compute_dtype=jnp.bfloat16))
    dots = _dots(_export(grad, "cpu", w, x))
    f32_result = [(lhs, rhs) for lhs, rhs, out in dots if out == "f32"]
    assert f32_result
    expected = ("bf16", "bf16") if _cpu_matmul._CPU_PROBES["bfloat16"] else ("f32", "f32")
    assert all(ops == expected for ops in f32_result), dots
    got = jax.jit(grad)(w, x)
    ref = jax.grad(_loss)(w, x)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, rtol=0.05, atol=0.05 * float(jnp.abs(ref).max()))


def test_jaxpr_is_the_same_for_every_platform():
    """No trace-time decision by the host: the jaxpr holds half x half -> float32 matmuls."""
    closed = jax.make_jaxpr(jax.grad(autocast.amp(_loss, compute_dtype=jnp.bfloat16)))(*_args())
    dots = [e for e in closed.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert all(str(v.aval.dtype) == "bfloat16" for e in dots for v in e.invars)
    assert any(str(e.outvars[0].aval.dtype) == "float32" for e in dots)


def test_multi_platform_export_runs_on_cpu():
    """One export for CPU and CUDA: the CPU branch widens, the program runs here."""
    w, x = _args()
    grad = jax.grad(autocast.amp(_loss, compute_dtype=jnp.bfloat16))
    exp = jax.export.export(jax.jit(grad), platforms=["cpu", "cuda"])(w, x)
    np.testing.assert_allclose(exp.call(w, x), jax.jit(grad)(w, x), rtol=0, atol=0)


def test_plain_jax_matmuls_are_untouched():
    """The CPU lowering rule changes nothing but half x half -> float32 matmuls: a float32
    and a bfloat16-result matmul lower exactly as without autocast's rule."""
    a = jnp.ones((4, 8), jnp.bfloat16)
    b = jnp.ones((8, 2), jnp.bfloat16)
    for fn in (lambda a, b: a @ b, lambda a, b: a.astype(jnp.float32) @ b.astype(jnp.float32)):
        assert _dots(_export(fn, "cpu", a, b)) == _dots(_export(fn, "cuda", a, b))


def test_convolutions_stay_half_for_the_gpu():
    """A convolution's forward and weight-gradient products read and write half precision
    (XLA:GPU would run a half x half -> float32 convolution on float32 operands); the weight
    gradient is float32 after it."""

    def loss(w, x):
        y = jax.lax.conv_general_dilated(x, w, (4, 4), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(jax.nn.gelu(y).astype(jnp.float32) ** 2)

    w = jax.random.normal(jax.random.key(0), (4, 4, 3, 8)) / 7
    x = jax.random.normal(jax.random.key(1), (2, 16, 16, 3))
    grad = jax.grad(autocast.amp(loss, compute_dtype=jnp.bfloat16))
    t = r"tensor<(?:[0-9]+x)*(\w+)>"
    pat = re.compile(rf"stablehlo\.convolution.*: \({t}, {t}\) -> {t}")
    convs = [m.groups() for m in map(pat.search, _export(grad, "cuda", w, x).splitlines()) if m]
    assert len(convs) >= 2 and all(c == ("bf16", "bf16", "bf16") for c in convs), convs
    assert grad(w, x).dtype == jnp.float32
