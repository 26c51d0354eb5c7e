"""The roofline model (``benchmarks/gpu_modeled/hlo_model.py``) on small programs compiled for the H100
target without a GPU, whose HBM bytes and GEMM FLOPs are known by hand.

Runs in the GPU-program lane (``bash tests/run_gpu_program.sh``, which installs the jax-cuda12
plugin); elsewhere it skips, saying so. ``tests/test_hlo_model.py`` checks the same reader on
HLO text, in every lane.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

pytest.importorskip(
    "jax_plugins.xla_cuda12", reason="jax-cuda12 plugin not installed (bash tests/run_gpu_program.sh installs it)"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.gpu_modeled import deviceless as D  # noqa: E402
from benchmarks.gpu_modeled import hlo_model as H  # noqa: E402

M, K, N = 512, 1024, 256
BW, LAUNCH = H.H100_SXM.hbm_bytes_per_s, H.H100_SXM.launch_s


@functools.cache
def _sharding():
    return D.target_sharding("h100")


def _hlo(f, *shapes, mode="triton") -> str:
    args = [jax.ShapeDtypeStruct(s, dt, sharding=_sharding()) for s, dt in shapes]
    return jax.jit(f, compiler_options=D.MODES[mode]).lower(*args).compile().as_text()


@pytest.mark.parametrize("dtype,peak", [(jnp.bfloat16, 989e12), (jnp.float32, 495e12)])
def test_cublas_matmul(dtype, peak):
    """[M, K] x [K, N] as one cuBLASLt call: bytes = the operands + the result (its
    workspace left out), FLOPs = 2 M N K, time = max(bytes / 3.35 TB/s, FLOPs / peak) + 2 us."""
    hlo = _hlo(jnp.matmul, ((M, K), dtype), ((K, N), dtype), mode="cublas")
    (k,) = H.kernel_costs(hlo)
    size = jnp.dtype(dtype).itemsize
    assert (k.op, k.bytes, k.flops) == ("custom-call", (M * K + K * N + M * N) * size, 2 * M * N * K)
    assert k.gemm_s == pytest.approx(2 * M * N * K / peak, rel=1e-12)
    assert k.time_s == pytest.approx(max(k.bytes / BW, k.gemm_s) + LAUNCH, rel=1e-12)
    r = H.roofline(hlo)
    assert (r["kernels"], r["gemm_kernels"], r["gemm_flops"], r["hbm_bytes"]) == (1, 1, 2 * M * N * K, k.bytes)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_triton_matmul(dtype):
    """Triton mode: the GEMM fusion has the same FLOPs; without autotuning XLA may split K
    (float32 partial sums, then a reduction kernel): more bytes, never fewer."""
    hlo = _hlo(jnp.matmul, ((M, K), dtype), ((K, N), dtype))
    r = H.roofline(hlo)
    size = jnp.dtype(dtype).itemsize
    assert r["gemm_kernels"] == 1 and r["gemm_flops"] == 2 * M * N * K
    assert r["gemm_bytes"] >= (M * K + K * N + M * N) * size
    split = r["kernels"] == 2  # the reduction of the split-K partial sums
    assert r["kernels"] == (2 if split else 1)
    if split:
        partial = r["gemm_bytes"] - (M * K + K * N) * size
        assert partial % (M * N * 4) == 0, partial  # float32 partial sums, one [M, N] per split
        assert r["other_bytes"] == partial + M * N * size


def test_elementwise_fusion():
    """exp(x) * 2 + y: one loop fusion reading x and y and writing the result."""
    hlo = _hlo(lambda x, y: jnp.exp(x) * 2 + y, ((1024, 1024), jnp.float32), ((1024, 1024), jnp.float32))
    (k,) = H.kernel_costs(hlo)
    assert (k.op, k.bytes, k.flops) == ("fusion", 3 * 1024 * 1024 * 4, 0)
    assert k.time_s == pytest.approx(k.bytes / BW + LAUNCH, rel=1e-12)
    r = H.roofline(hlo)
    assert r["gemm_time_s"] == 0 and r["other_time_s"] == r["time_s"] == k.time_s


def test_reduction():
    """A row sum of bf16 [4096, 1024]: reads the input once, writes 4096 values."""
    hlo = _hlo(lambda x: jnp.sum(x, axis=-1), ((4096, 1024), jnp.bfloat16))
    (k,) = H.kernel_costs(hlo)
    assert k.bytes == 4096 * 1024 * 2 + 4096 * 2 and k.flops == 0


def test_target_report_of_a_shapes_only_model(tmp_path):
    """``--target h100 --smoke`` on the shapes-only GPT (its parameters never made): the
    report has the roofline of the step and its tables (one system, one mode: the lane's time)."""
    from benchmarks.gpu_measured import gpu

    report = gpu.main(
        ["--target", "h100", "--smoke", "--models", "gpt-1b", "--systems", "autocast-bf16", "--modes", "triton"]
        + ["--batch-mults", "1", "4", "--out-dir", str(tmp_path)]
    )
    runs = report["models"]["gpt-1b"]["runs"]
    assert list(runs) == ["x1-triton"]  # the 1B GPT: batch x1 only; one mode asked for
    for run in runs.values():
        res = run["results"]["autocast-bf16"]
        r = res["roofline"]
        assert r["time_s"] == pytest.approx(r["gemm_time_s"] + r["other_time_s"])
        assert r["hbm_bytes"] > 0 and r["gemm_flops"] > 0 and r["kernels"] == res["kernels"]
        assert set(res["gemms"]) == {"bf16 x bf16"}, res["gemms"]
    md = (tmp_path / Path(report["paths"][0]).name).read_text()
    assert "Modeled step time on an H100 SXM" in md and "| gpt-1b | x1 | triton |" in md
    assert "shapes only" in report["models"]["gpt-1b"]["description"]


def test_cudnn_attention_flops():
    """cuDNN's fused attention (issue 41; causal, bfloat16, GPT-2 small's shapes: B 8, T = S
    1,024, N 12, H 64), counted by hand over the scores the causal mask keeps (T (T + 1) / 2
    a head): the forward call's ``Q K^T`` and ``P V``, 2 B N T(T+1)/2 (H + H); the backward
    call's scores again, ``dV``, ``dP``, ``dQ`` and ``dK``, 2 B N T(T+1)/2 (3 H + 2 H); each at
    the bfloat16 peak, its bytes its operands and results (scratch left out)."""
    b, t, n, h = 8, 1024, 12, 64

    def loss(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").astype(jnp.float32).sum()

    try:
        hlo = _hlo(jax.grad(loss, argnums=(0, 1, 2)), *[((b, t, n, h), jnp.bfloat16)] * 3)
    except RuntimeError as e:
        if "cuDNN" not in str(e):
            raise
        pytest.fail(f"{e}: cuDNN is not installed here (bash tests/run_gpu_program.sh installs nvidia-cudnn-cu12)")
    costs = {k.name: k for k in H.kernel_costs(hlo)}
    fwd = [k for name, k in costs.items() if name.startswith("dot_product_attention_fwd")]
    bwd = [k for name, k in costs.items() if name.startswith("dot_product_attention_bwd")]
    assert len(fwd) == len(bwd) == 1, list(costs)
    kept = b * n * t * (t + 1) // 2
    assert fwd[0].flops == 2 * kept * (h + h) and bwd[0].flops == 2 * kept * (3 * h + 2 * h)
    qkv = b * t * n * h * 2
    assert fwd[0].bytes == 3 * qkv + qkv + b * n * t * 4  # q, k, v in; the output and float32 row statistics out
    assert fwd[0].gemm_s == pytest.approx(fwd[0].flops / 989e12, rel=1e-12)
    assert H.roofline(hlo)["gemm_flops"] >= fwd[0].flops + bwd[0].flops
