"""The GPU program of an ``amp`` train step, checked on a machine without a GPU.

XLA compiles for an NVIDIA H100 described by ``benchmarks/gpu_modeled/targets/h100_sxm.txtpb`` through
the jax-cuda12 plugin's topology API ("deviceless" compilation): the optimised HLO below is
what XLA:GPU would run, in both GEMM modes (``triton``: XLA's default; ``cublas``: every
GEMM a cuBLASLt call). No autotuning and no timings: compile-time facts only.

For an Equinox MLP, a ViT (patch-embedding convolution, a cls token and one encoder block:
ViT-Base's 197 tokens) and a transformer block (``eqx.nn.MultiheadAttention``, LayerNorm, GELU
MLP), each train step (``value_and_grad`` of the ``amp`` loss + an SGD update, parameters
donated) in bfloat16, float16 and float8 (``load_policy("fp8")`` without its cost check,
``use_float8(target=None)``: these models' matmuls are too small for float8 to pay) must have:

- no float32 x float32 GEMM outside ``amp_stop`` (recognised by the op_name metadata XLA
  keeps; a control puts the MLP's last layer in ``amp_stop`` and finds its float32 GEMMs);
- no convolution with float32 operands;
- every float8 matmul JAX hands to XLA as a float8 GEMM (none upcast; XLA may merge
  GEMMs that share an operand, attention's q/k/v projections);
- no transpose kernel in front of or after a GEMM beyond the float32 step's (folded into
  the GEMM); float8 in cuBLAS mode is an expected failure (XLA transposes cuBLASLt's TN
  float8 operands in kernels of their own);
- less temp memory than the float32 step (bf16, f16); XLA's own peak at most arguments +
  outputs + temp - aliased;
- at most the committed kernel count (``gpu_program_kernels.json``, a regression guard;
  ``AUTOCAST_UPDATE_KERNELS=1`` rewrites it);
- at most 2 % more HBM bytes, modeled time (the roofline model of
  ``benchmarks/gpu_modeled/hlo_model.py``, H100 SXM rates) and peak memory than committed in
  ``gpu_program_roofline.json`` (float32 steps included; the compile is deterministic, so any
  rise is a change in the program; ``AUTOCAST_UPDATE_ROOFLINE=1`` rewrites it).

Fused attention (issue 41, docs/attention.md): with cuDNN installed, the cuDNN attention call
traces and compiles for the H100 (``__cudnn$fmhaSoftmax`` and ``...Backward`` custom calls), and
in the bfloat16 steps of the ViT, the block and a two-layer GPT-2-style causal transformer
(``benchmarks/models/gpt2.py``, 512 tokens) every attention is one fused forward and one fused
backward call, and no kernel writes a ``[B, N, T, S]`` scores-sized buffer (the unfused
program, ``attention="xla"``, guarded too, writes bfloat16 ones); the GPT's peak memory is
below the unfused program's, the ViT's and the block's at most the kernels' saved outputs and
float32 row statistics above it.

Runs in ``bash tests/run_gpu_program.sh`` (installs the plugin, about 200 MB, and cuDNN, 1.2 GB;
cached); elsewhere it skips, saying so.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path

import pytest

pytest.importorskip(
    "jax_plugins.xla_cuda12", reason="jax-cuda12 plugin not installed (bash tests/run_gpu_program.sh installs it)"
)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from helpers import fp8_every_matmul  # noqa: E402

import autocast  # noqa: E402
from autocast import _compat  # noqa: E402
from benchmarks.gpu_modeled import deviceless as D  # noqa: E402
from benchmarks.gpu_modeled import hlo_model as H  # noqa: E402
from benchmarks.models import train_steps as S  # noqa: E402
from benchmarks.models.gpt2 import GPT, GPTConfig  # noqa: E402
from benchmarks.models.vit import ViT, ViTConfig, _Block  # noqa: E402

KERNELS_FILE = Path(__file__).with_name("gpu_program_kernels.json")
SLACK = 0.05  # a kernel count may grow by 5 % (at least 2) before the guard fails
ROOFLINE_FILE = Path(__file__).with_name("gpu_program_roofline.json")
ROOFLINE_SLACK = 0.02  # HBM bytes, modeled time and peak memory may grow by 2 % before the guard fails
# the ViT: ViT-Base's sequence (224x224 images in 16x16 patches and a cls token: 197 tokens, a
# length cuDNN takes padded), one narrow block with heads of 64; batch 8
VIT = ViTConfig(image_size=224, channels=3, patch=16, width=128, mlp_hidden=512, depth=1, heads=2, classes=16)
# the GPT: GPT-2's architecture (causal, heads of 64), two layers of 512 tokens; batch 4
GPT_CFG = GPTConfig(vocab=256, seq=512, width=128, depth=2, heads=2)


@functools.cache
def _sharding():
    return D.target_sharding("h100")


def _block(width, heads, key):
    """The benchmark ViT's encoder block (MultiheadAttention, LayerNorm, GELU MLP 4x wide)."""
    return _Block(width, 4 * width, heads, key=key)


@functools.cache
def _models():
    key = jax.random.key(0)
    return {
        "mlp": (
            eqx.nn.MLP(256, 256, 512, depth=2, activation=jax.nn.gelu, key=key),
            lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2),
            jnp.ones((256, 256)),
        ),
        "vit": (ViT(VIT, key=key), lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), jnp.ones((8, 3, 224, 224))),
        "block": (_block(128, 4, key), lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), jnp.ones((8, 64, 128))),
        "gpt": (GPT(GPT_CFG, key=key), lambda m, t: S._gpt_loss(m, (t,)), jnp.zeros((4, GPT_CFG.seq + 1), jnp.int32)),
    }


# each model's attention: (layers, batch, heads, queries = keys)
ATTENTION = {"vit": (1, 8, 2, 197), "block": (1, 8, 4, 64), "gpt": (GPT_CFG.depth, 4, GPT_CFG.heads, GPT_CFG.seq)}


SYSTEMS = {
    "fp32": None,
    "bf16": dict(compute_dtype=jnp.bfloat16),
    "f16": dict(compute_dtype=jnp.float16),
    "fp8": dict(compute_dtype=jnp.bfloat16, amp_policy="fp8"),
    "bf16-xla": dict(compute_dtype=jnp.bfloat16, attention="xla"),  # every attention as written
}


def _step(model_name: str, system: str, stop_head: bool = False):
    model, loss, x = _models()[model_name]
    params, static = eqx.partition(model, eqx.is_array)

    def f(p, x):
        m = eqx.combine(p, static)
        if stop_head:  # the MLP's last layer in float32, by amp_stop
            m = eqx.tree_at(lambda m: m.layers[-1], m, autocast.amp_stop(m.layers[-1]))
        return loss(m, x)

    if SYSTEMS[system] is not None:
        kw = dict(SYSTEMS[system])
        if kw.get("amp_policy") == "fp8":
            kw["amp_policy"] = fp8_every_matmul()
        f = autocast.amp(f, **kw)

    def step(p, x):
        loss_value, g = jax.value_and_grad(f)(p, x)
        return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g), loss_value

    return step, (params, x)


@functools.cache
def _compiled(model_name: str, system: str, mode: str, stop_head: bool = False):
    step, args = _step(model_name, system, stop_head)
    jitted = jax.jit(step, donate_argnums=0, compiler_options=D.MODES[mode])
    lowered = jitted.lower(*D.abstract(args, _sharding()))
    compiled = lowered.compile()
    info = D.analyse(compiled)
    entry, comps = H.parse(compiled.as_text())
    # every kernel's results (dtype, dimensions), and what the fused attention kernels save for
    # the backward pass: the forward calls' results (output and float32 row statistics)
    info["results"] = [(dt, dims) for ins, _ in H.kernels(entry, comps) for dt, dims in H.arrays(ins.shape)]
    info["fmha_saved_bytes"] = sum(
        H.nbytes(H.scratch_free(ins)) for ins, _ in H.kernels(entry, comps) if H.fmha_call(ins) == "forward"
    )
    # float8 matmuls JAX hands to XLA (after JAX's dead-code elimination)
    dots = re.findall(r"stablehlo\.dot_general[^\n]*: \(tensor<(?:[0-9]+x)*(\w+)>", lowered.as_text())
    info["jaxpr_fp8_dots"] = sum(1 for d in dots if d.startswith("f8"))
    info["jaxpr_other_dots"] = len(dots) - info["jaxpr_fp8_dots"]
    return info


def _group(model: str, mode: str):
    """The xdist group of the tests that read one (model, mode)'s compiles: the lane runs on
    two workers (``--dist loadgroup``) and each compile, float32 baseline included, happens
    on one of them only (``_compiled`` caches per process)."""
    return pytest.mark.xdist_group(f"{model}-{mode}")


# The ViT in Triton mode and bfloat16/float8 only. Its float16 program is its bfloat16 one in
# another half dtype plus the loss scaler, which the other two models' float16 steps carry
# (the two ViT float16 compiles took 200 s of the lane's workers on CI's 2 cores). What only
# the ViT has is its convolution (patch embedding), whose kernels do not depend on the GEMM
# mode; its GEMMs are the block's, which runs in both modes (the three ViT cuBLAS compiles
# took 53 s of the workers: 2026-11-27, tests/run_gpu_program.sh --durations).
_VIT_MODES = ("triton",)


def _runs(model: str, system: str, mode: str) -> bool:
    return model != "vit" or (system != "f16" and mode in _VIT_MODES)


CASES = [
    pytest.param(m, s, mode, marks=_group(m, mode))
    for m in ("mlp", "vit", "block")
    for s in ("bf16", "f16", "fp8")
    for mode in D.MODES
    if _runs(m, s, mode)
]


@pytest.mark.parametrize("model,system,mode", CASES)
def test_amp_step_on_the_gpu_target(model, system, mode):
    info = _compiled(model, system, mode)
    assert info["f32_gemms"] == 0, f"{info['f32_gemms']} f32 x f32 GEMMs: {info['gemm_types']}"
    assert info["f32_gemms_in_amp_stop"] == 0, info["gemm_types"]  # nothing is in amp_stop here
    assert info["f32_convolutions"] == 0, info["convolutions"]
    if model == "vit":
        assert sum(info["convolutions"].values()) >= 2, info["convolutions"]  # forward + weight gradient
    if system == "fp8":
        assert info["jaxpr_fp8_dots"] >= (8 if model == "mlp" else 6), info["jaxpr_fp8_dots"]
        # every float8 matmul stays a float8 GEMM: XLA may merge GEMMs that share an operand
        # (attention's q/k/v projections), never turn one into a wider GEMM
        other = sum(v for k, v in info["gemms"].items() if "f8" not in k)
        assert 0 < info["fp8_gemms"] <= info["jaxpr_fp8_dots"], (info["jaxpr_fp8_dots"], info["gemms"])
        assert other <= info["jaxpr_other_dots"], (
            f"{info['jaxpr_other_dots']} matmuls JAX hands over outside float8, {other} such GEMMs: {info['gemms']}"
        )
    else:
        assert info["fp8_gemms"] == 0
    baseline = _compiled(model, "fp32", mode)
    for key in ("transposes_into_gemms", "transposes_after_gemms"):
        if (system, mode, key) != ("fp8", "cublas", "transposes_into_gemms"):  # test_fp8_cublas_operand_transposes
            assert info[key] <= baseline[key], (key, info[key], baseline[key])
    mem, base_mem = info["memory"], baseline["memory"]
    assert mem["peak"] == mem["argument"] + mem["output"] + mem["temp"] - mem["alias"] > 0, mem
    assert mem["xla_peak"] <= mem["peak"], mem  # XLA's figure knows live ranges: never above
    if system != "fp8":  # fp8 keeps float32 amax histories and scales; bf16/f16 halve activations
        assert mem["temp"] < base_mem["temp"], (mem, base_mem)
    _check_kernels(f"{model}/{system}/{mode}", info["kernels"])
    _check_roofline(f"{model}/{system}/{mode}", info)


@pytest.mark.parametrize(
    "model,mode",
    [
        pytest.param(m, mode, marks=_group(m, mode))
        for m in ("mlp", "vit", "block")
        for mode in D.MODES
        if _runs(m, "fp32", mode)
    ],
)
def test_float32_step_roofline(model, mode):
    """The float32 steps (compiled anyway as the baselines) under the same roofline guard."""
    _check_roofline(f"{model}/fp32/{mode}", _compiled(model, "fp32", mode))


@pytest.mark.parametrize("mode", [pytest.param(mode, marks=_group("mlp", mode)) for mode in D.MODES])
def test_census_sees_float32_gemms_in_amp_stop(mode):
    """The control: the MLP's last layer under ``amp_stop`` keeps its float32 GEMMs, and the
    census files them under ``amp_stop``, forward and backward."""
    info = _compiled("mlp", "bf16", mode, stop_head=True)
    assert info["gemms"].get("f32 x f32", 0) >= 2, info["gemms"]  # forward and its weight gradient at least
    assert info["f32_gemms_in_amp_stop"] == info["gemms"]["f32 x f32"], info
    assert info["f32_gemms"] == 0, info["gemm_types"]
    assert info["gemms"].get("bf16 x bf16", 0) >= 3, info["gemms"]


@_group("block", "triton")
def test_float32_step_has_float32_gemms():
    info = _compiled("block", "fp32", "triton")
    assert set(info["gemms"]) == {"f32 x f32"}, info["gemms"]


_TN_ONLY = pytest.mark.xfail(
    strict=True,
    reason="XLA:GPU (jaxlib): cuBLASLt float8 GEMMs take TN operands only, and XLA's GEMM rewriter "
    "transposes the float8 operands in kernels of their own (wrapped_transpose fusions after the "
    "quantising convert) instead of folding the transpose into the quantising kernel",
)


# (the ViT, compiled in Triton mode only, had the same cuBLASLt TN-operand transposes)
@pytest.mark.parametrize(
    "model",
    [
        pytest.param("mlp", marks=[_TN_ONLY, _group("mlp", "cublas")]),
        pytest.param("block", marks=[_TN_ONLY, _group("block", "cublas")]),
    ],
)
def test_fp8_cublas_operand_transposes(model):
    info, baseline = _compiled(model, "fp8", "cublas"), _compiled(model, "fp32", "cublas")
    assert info["transposes_into_gemms"] <= baseline["transposes_into_gemms"], (info, baseline)


def test_loop_bodies_are_counted():
    """A scanned MLP's GEMMs live in while bodies: the census counts their launches (each
    body once) and their GEMMs, and finds no float32 GEMM there either."""

    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jax.nn.gelu(h @ w), None), x, ws)
        return jnp.mean(h**2)

    step = jax.jit(jax.grad(autocast.amp(loss, compute_dtype=jnp.bfloat16)))
    args = (jnp.ones((4, 128, 128)), jnp.ones((64, 128)))
    hlo = step.lower(*D.abstract(args, _sharding())).compile().as_text()
    info = H.census(hlo)
    entry_only = H.census(hlo.replace(" while(", " not-a-while("))  # the bodies unreached
    assert info["kernel_ops"].get("while", 0) == 0
    assert info["gemm_kernels"] >= 3 > entry_only["gemm_kernels"], (info, entry_only)  # forward, 2 backward
    assert info["kernels"] > entry_only["kernels"]
    assert info["f32_gemms"] == 0 and info["gemms"].get("bf16 x bf16", 0) >= 3, info["gemm_types"]


def test_missing_target_names_the_choices():
    with pytest.raises(ValueError, match="h100"):
        D.target_sharding("a100")


def _attention_grad(implementation: str, b: int = 8, t: int = 1024, n: int = 12, h: int = 64):
    """``jax.grad`` (q, k and v) of a causal ``jax.nn.dot_product_attention`` in bfloat16 at
    GPT-2 small's shapes, compiled for the H100."""

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
        return out.astype(jnp.float32).sum()

    args = [jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16, sharding=_sharding())] * 3
    try:
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    except RuntimeError as e:
        if "cuDNN" in str(e):
            pytest.fail(f"{e}: cuDNN is not installed here (bash tests/run_gpu_program.sh installs nvidia-cudnn-cu12)")
        raise


def test_cudnn_attention_compiles_for_the_target():
    """Issue 41: the cuDNN attention call traces here (JAX reads the installed cuDNN's version)
    and compiles for the H100 without a GPU: one ``__cudnn$fmhaSoftmax`` and one
    ``__cudnn$fmhaSoftmaxBackward`` custom call, and none of the float32 scores XLA's own
    attention keeps (at GPT-2 small's shapes: under 32 MiB of temp memory against more than
    the 384 MiB of one float32 ``[8, 12, 1024, 1024]``)."""
    cudnn, xla = _attention_grad("cudnn"), _attention_grad("xla")
    info, base = H.census(cudnn.as_text()), H.census(xla.as_text())
    assert (info["fmha_forward"], info["fmha_backward"]) == (1, 1), info
    assert (base["fmha_forward"], base["fmha_backward"]) == (0, 0)
    scores = 8 * 12 * 1024 * 1024 * 4
    assert D.memory(cudnn)["temp"] < 32 * 2**20 < scores < D.memory(xla)["temp"], (D.memory(cudnn), D.memory(xla))


def test_fused_attention_has_every_derivative():
    """Issue 47: an amp'd causal attention, fused with the real cuDNN call, compiles for the H100
    under ``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``, an HVP and a gradient penalty (they raised:
    the cuDNN call is a ``custom_vjp`` whose backward pass has no derivative); its first-order
    gradient is still one cuDNN forward and one backward call."""

    def loss(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / 8.0
        s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, jnp.finfo(s.dtype).min)
        return jnp.sum(jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v).astype(jnp.float32) ** 2)

    f = autocast.amp(loss, compute_dtype=jnp.bfloat16)
    args = [jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.float32, sharding=_sharding())] * 3
    every = (0, 1, 2)
    grad = jax.jit(jax.grad(f, every)).lower(*args).compile()
    assert (H.census(grad.as_text())["fmha_forward"], H.census(grad.as_text())["fmha_backward"]) == (1, 1)
    scaled = lambda s, q, k, v: f(q * s, k, v)  # noqa: E731
    derivatives = {
        "jvp": lambda q, k, v: jax.jvp(f, (q, k, v), (q, k, v)),
        "jacfwd": lambda q, k, v: jax.jacfwd(scaled)(1.0, q, k, v),
        "hessian": lambda q, k, v: jax.hessian(scaled)(1.0, q, k, v),
        "hvp": lambda q, k, v: jax.jvp(jax.grad(f, every), (q, k, v), (q, k, v)),
        "gradient_penalty": jax.grad(lambda *xs: sum(jnp.sum(g**2) for g in jax.grad(f, every)(*xs))),
    }
    for name, fn in derivatives.items():
        compiled = jax.jit(fn).lower(*args).compile()
        assert H.census(compiled.as_text())["fmha_forward"] == 1, name  # the value is the fused kernel's


def _scores_results(model: str, info: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The kernel results of ``model``'s step shaped as one attention's scores: ``[..., T, S]``
    with B N T S elements (``[B, N, T, S]``, ``[B N, T, S]``), its sequences as they are or
    padded (by up to 127) for cuDNN."""
    _, b, n, t = ATTENTION[model]
    return [
        (dt, dims)
        for dt, dims in info["results"]
        if len(dims) >= 2 and t <= dims[-1] == dims[-2] < t + 128 and math.prod(dims) == b * n * dims[-1] ** 2
    ]


@pytest.mark.parametrize("model", [pytest.param(m, marks=_group(m, "triton")) for m in ("gpt", "vit", "block")])
def test_attention_is_fused_in_the_step(model):
    """Issue 41: in the bfloat16 step every attention is one cuDNN forward and one cuDNN
    backward call (the GPT's causal ones, the ViT's 197 tokens padded, and recomputed in the
    backward pass, the block's), and no
    kernel writes a scores-sized ``[B, N, T, S]`` buffer, float32 or other (the control: the
    unfused program, ``attention="xla"``, writes bfloat16 ones, the probabilities amp
    recomputes; its float32 softmax stays inside XLA's kernels). Memory: the GPT's (512 tokens
    for heads of 64) peak and temp are below the unfused program's; the ViT's and the block's
    (197 and 64 tokens: scores no larger than the kernel's saved output) at most what their
    forward kernels save for the backward pass above it (the output and its float32 row
    statistics, which the unfused program does not keep: it recomputes). Both programs under
    the kernel and roofline guards."""
    layers = ATTENTION[model][0]
    fused, unfused = _compiled(model, "bf16", "triton"), _compiled(model, "bf16-xla", "triton")
    # the ViT's padded spans are recomputed in the backward pass (remat_float32="auto": their
    # padded output is not kept beside the sliced copy): one more forward call a layer
    forwards = 2 * layers if model == "vit" else layers
    assert (fused["fmha_forward"], fused["fmha_backward"]) == (forwards, layers), fused["kernel_ops"]
    assert (unfused["fmha_forward"], unfused["fmha_backward"]) == (0, 0)
    assert _scores_results(model, fused) == []
    assert len(_scores_results(model, unfused)) >= layers and all(
        dt == "bf16" for dt, _ in _scores_results(model, unfused)
    ), _scores_results(model, unfused)
    mem, base = fused["memory"], unfused["memory"]
    if model == "gpt":
        assert mem["peak"] < base["peak"] and mem["temp"] < base["temp"], (mem, base)
    else:
        assert 0 < fused["fmha_saved_bytes"] and mem["peak"] <= base["peak"] + fused["fmha_saved_bytes"], (
            mem,
            base,
            fused["fmha_saved_bytes"],
        )
    for system, info in (("bf16-xla", unfused), ("bf16", fused)):
        if model == "gpt" or system == "bf16-xla":  # the ViT's and the block's bf16: in test_amp_step_on_the_gpu_target
            _check_kernels(f"{model}/{system}/triton", info["kernels"])
            _check_roofline(f"{model}/{system}/triton", info)


def _check_kernels(key: str, kernels: int) -> None:
    if os.environ.get("AUTOCAST_UPDATE_KERNELS") == "1":
        table = json.loads(KERNELS_FILE.read_text()) if KERNELS_FILE.exists() else {}
        table[key] = kernels
        KERNELS_FILE.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
        return
    table = json.loads(KERNELS_FILE.read_text())
    assert key in table, f"no committed kernel count for {key}: run with AUTOCAST_UPDATE_KERNELS=1"
    limit = table[key] + max(2, int(SLACK * table[key]))
    assert kernels <= limit, f"{key}: {kernels} kernels, committed {table[key]} (limit {limit})"


def _check_roofline(key: str, info: dict) -> None:
    """HBM bytes, modeled step time and peak memory (arguments + outputs + temp - aliased) at
    most 2 % above the committed figures."""
    roofline = info["roofline"]
    now = {
        "hbm_bytes": roofline["hbm_bytes"],
        "time_us": round(roofline["time_s"] * 1e6, 3),
        "peak_bytes": info["memory"]["peak"],
    }
    if os.environ.get("AUTOCAST_UPDATE_ROOFLINE") == "1":
        table = json.loads(ROOFLINE_FILE.read_text()) if ROOFLINE_FILE.exists() else {}
        table[key] = now
        ROOFLINE_FILE.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
        return
    table = json.loads(ROOFLINE_FILE.read_text())
    assert key in table, f"no committed roofline figures for {key}: run with AUTOCAST_UPDATE_ROOFLINE=1"
    for field, value in now.items():
        assert field in table[key], f"{key}: no committed {field}: run with AUTOCAST_UPDATE_ROOFLINE=1"
        limit = table[key][field] * (1 + ROOFLINE_SLACK)
        assert value <= limit, f"{key}: {field} {value:,} above the committed {table[key][field]:,} by more than 2 %"


def _gelu_mlp_f32_results(amp_policy=None, mode: str = "triton") -> list[str]:
    """The float32 activation-sized results of the kernels of a tanh-GELU MLP's bfloat16
    gradient (384 tokens, 256 -> 512 -> 256, biases)."""
    k = jax.random.split(jax.random.key(0), 3)
    p = {
        "w1": jax.random.normal(k[0], (256, 512)) / 16,
        "b1": jnp.zeros(512),
        "w2": jax.random.normal(k[1], (512, 256)) / 23,
        "b2": jnp.zeros(256),
    }
    x = jax.random.normal(k[2], (384, 256))

    def loss(p, x):
        h = jax.nn.gelu(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"]) ** 2)

    grad = jax.grad(autocast.amp(loss, compute_dtype=jnp.bfloat16, amp_policy=amp_policy))
    step = jax.jit(grad, compiler_options=D.MODES[mode])
    hlo = step.lower(*D.abstract((p, x), _sharding())).compile().as_text()
    entry, comps = H.parse(hlo)
    return [
        ins.shape
        for ins, _ in H.kernels(entry, comps)
        for dt, dims in H.arrays(ins.shape)
        if dt == "f32" and math.prod(dims) == 384 * 512
    ]


def test_gelu_mlp_step_writes_no_float32_activation(monkeypatch):
    """Issue 28: GELU's float32 math stays in registers. The bias gradient is summed apart
    from the island's backward kernel (``autocast._binding._bias_into_float32``), so
    XLA:GPU fuses the recomputed ``tanh`` into that kernel: no kernel writes a float32 value
    of the hidden activation's size. Before, the ``tanh`` was a kernel of its own with a
    float32 result, read back by the next one."""
    assert _gelu_mlp_f32_results() == []
    monkeypatch.setattr(autocast._binding, "_bias_into_float32", lambda *a: [])
    assert _gelu_mlp_f32_results() != []  # the control: the float32 tanh written out


def test_fp8_gelu_mlp_step_quantizes_the_activation_from_bfloat16(monkeypatch):
    """Issue 28: a float8 matmul quantizes a computed operand from the bfloat16 value the
    matmul it replaces would read, widened through its bits (``autocast._fp8._widen``), so
    XLA cannot fold the rounding away: GELU's kernel writes bfloat16 and the amax and
    quantizing kernels read it. The control: widened with a conversion, XLA folds
    bfloat16 -> float32 into the float32 GELU, which is then written out in float32 and
    read back by the quantizing kernel."""
    assert _gelu_mlp_f32_results(fp8_every_matmul()) == []
    monkeypatch.setattr(autocast._fp8, "_widen", lambda x: x.astype(jnp.float32))
    assert _gelu_mlp_f32_results(fp8_every_matmul()) != []


def _gpt_block_float32_hidden_results(mode: str) -> int:
    """Kernels writing a float32 value of the hidden activation's size in the float8 step of
    one block of the 1B GPT (width 2,048, 2,048 tokens, batch 2; shapes only)."""
    from benchmarks.models import train_steps as S

    cfg = S.GPTConfig(vocab=512, seq=2048, width=2048, depth=1, heads=16)
    compiled = D.compile_step(S._gpt_task("gpt-1b-block", cfg, 2, shapes_only=True), "autocast-fp8", mode, _sharding())
    entry, comps = H.parse(compiled.as_text())
    hidden = 2 * 2048 * 4 * 2048
    return sum(
        dt == "f32" and math.prod(dims) == hidden
        for ins, _ in H.kernels(entry, comps)
        for dt, dims in H.arrays(ins.shape)
    )


def test_fp8_recomputed_gelu_is_requantized_in_its_own_layout(monkeypatch):
    """Issue 28: in cuBLAS mode the backward pass requantizes the recomputed GELU output for
    the weight gradient in the layout cuBLASLt reads (transposed). Quantized in its own
    layout and the float8 copy transposed (``autocast._fp8._backward_operand``), the
    recomputed ``tanh`` fuses into the kernels that read it: no kernel writes it in float32.
    The control: quantized straight into the transposed layout, the ``tanh`` is written
    out in float32 (XLA:GPU's transposing kernel does not take it in)."""
    assert _gpt_block_float32_hidden_results("cublas") == 0
    original = autocast._fp8._backward_operand
    monkeypatch.setattr(
        autocast._fp8, "_backward_operand", lambda r, amax, canon, rq, rc: original(r, amax, canon, rq, False)
    )
    assert _gpt_block_float32_hidden_results("cublas") > 0


def _lm_head_hlo(tokens: int, classes: int, amp_policy=None, mode: str = "triton") -> str:
    """The optimised HLO of an LM head's bfloat16 gradient (``tokens`` tokens, 256 ->
    ``classes`` classes, optax's integer-label cross-entropy) compiled for the H100."""
    k = jax.random.split(jax.random.key(0), 2)
    w = jax.random.normal(k[0], (256, classes)) / 16
    x = jax.random.normal(k[1], (tokens, 256))
    y = jnp.zeros((tokens,), jnp.int32)

    def loss(w, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean()

    grad = jax.grad(autocast.amp(loss, compute_dtype=jnp.bfloat16, amp_policy=amp_policy))
    step = jax.jit(grad, compiler_options=D.MODES[mode])
    return step.lower(*D.abstract((w, x, y), _sharding())).compile().as_text()


def _fp8_lm_head_costs() -> tuple[int, int]:
    """Kernels and modeled HBM bytes of an LM head's float8 gradient in cuBLAS mode (2,048
    tokens, 8,191 classes: not a multiple of 16)."""
    costs = H.kernel_costs(_lm_head_hlo(2048, 8191, fp8_every_matmul(), "cublas"))
    return len(costs), sum(c.bytes for c in costs)


def test_fp8_cotangent_padded_to_sixteen_is_quantized_once(monkeypatch):
    """Issue 28: cuBLASLt's float8 GEMMs need sizes in multiples of 16. The backward products
    pad the cotangent with zeros first (``autocast._fp8.ALIGN``), so one kernel reads it and
    writes both float8 layouts. The control (no padding): XLA pads one layout in a copy of
    its own and quantizes the cotangent twice: a kernel more, and more than 5 % more bytes."""
    kernels, nbytes = _fp8_lm_head_costs()
    monkeypatch.setattr(autocast._fp8, "ALIGN", 1)
    kernels_before, nbytes_before = _fp8_lm_head_costs()
    assert kernels < kernels_before and nbytes < 0.95 * nbytes_before, (kernels, kernels_before, nbytes, nbytes_before)


def _lm_head_costs(amp_policy=None) -> tuple[list[str], int]:
    """The float32 logits-sized results of the kernels of an LM head's bfloat16 gradient
    (512 tokens, 8,192 classes), and the step's modeled HBM bytes."""
    hlo = _lm_head_hlo(512, 8192, amp_policy)
    entry, comps = H.parse(hlo)
    f32 = [
        ins.shape
        for ins, _ in H.kernels(entry, comps)
        for dt, dims in H.arrays(ins.shape)
        if dt == "f32" and math.prod(dims) == 512 * 8192
    ]
    return f32, sum(k.bytes for k in H.kernel_costs(hlo))


def test_lm_head_step_scatters_the_label_cotangent_in_half():
    """Issue 28: the label logit's gather selects from a float32 conversion of the
    half-precision logits, but its transpose scatters into a half-precision buffer that XLA
    adds in place into the softmax's cotangent: no kernel writes a float32 value of the
    logits' size. The control: with every gather run in float32 by the policy (JAX's own
    transpose of the float32 gather), the float32 zeros and scatter are back and the step
    moves more bytes."""
    f32, nbytes = _lm_head_costs()
    assert f32 == []
    policy = autocast.extend_policy({jax.lax.gather_p: autocast.use_float32_precision})
    f32_old, nbytes_old = _lm_head_costs(policy)
    assert f32_old != []
    assert nbytes < 0.85 * nbytes_old, (nbytes, nbytes_old)


def _attention_step_costs() -> tuple[int, int]:
    """Kernels and modeled HBM bytes of a causal attention layer's bfloat16 gradient
    (8 sequences of 512 tokens, 4 heads of 64), unfused, compiled for the H100."""
    k = jax.random.split(jax.random.key(0), 4)
    p = {n: jax.random.normal(kk, (256, 256)) / 16 for n, kk in zip(("wq", "wk", "wv"), k)}
    x = jax.random.normal(k[3], (8, 512, 256))

    def loss(p, x):
        heads = lambda w: (x @ w).reshape(8, 512, 4, 64).transpose(0, 2, 1, 3)  # noqa: E731
        q, kk, v = heads(p["wq"]), heads(p["wk"]), heads(p["wv"])
        s = q @ kk.swapaxes(-1, -2) / 8.0
        s = jnp.where(jnp.tril(jnp.ones((512, 512), bool)), s, jnp.finfo(jnp.float32).min)
        return jnp.mean((jax.nn.softmax(s, axis=-1) @ v) ** 2)

    # as written (attention="xla"): the softmax island, not the fused kernel (which has none)
    step = jax.jit(jax.grad(autocast.amp(loss, compute_dtype=jnp.bfloat16, attention="xla")))
    hlo = step.lower(*D.abstract((p, x), _sharding())).compile().as_text()
    costs = H.kernel_costs(hlo)
    return len(costs), sum(c.bytes for c in costs)


def test_attention_backward_with_softmax_custom_jvp_reads_the_scores_once_fewer():
    """JAX's flag ``jax_softmax_custom_jvp`` makes ``jax.nn.softmax`` a custom JVP whose rule
    ``y * (dy - sum(y * dy))`` needs only the probabilities; amp keeps the rule inside the
    recomputed attention island (its operand, the masked scores, is pulled to float32 there:
    ``autocast._higher_order.custom_jvp_pulls``), so on this causal attention the backward
    pass has one kernel over the scores fewer than without the flag (the sum of ``exp`` the
    division's derivative needs). docs/faq.md gives the flag as a tip, with the full-model
    figures: faster on GPT-2, not on every ViT step."""
    flag = _compat.hijax_flags()["softmax_custom_jvp"]
    with flag(True):
        kernels, hbm = _attention_step_costs()
    with flag(False):
        kernels_before, hbm_before = _attention_step_costs()
    assert kernels < kernels_before and hbm < hbm_before, (kernels, kernels_before, hbm, hbm_before)
