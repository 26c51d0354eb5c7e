"""The GPU program of an ``amp`` train step, checked on a machine without a GPU.

XLA compiles for an NVIDIA H100 described by ``benchmarks/targets/h100_sxm.txtpb`` through
the jax-cuda12 plugin's topology API ("deviceless" compilation): the optimised HLO below is
what XLA:GPU would run, in both GEMM modes (``triton``: XLA's default; ``cublas``: every
GEMM a cuBLASLt call). No autotuning and no timings: compile-time facts only.

For an Equinox MLP, a ViT (patch-embedding convolution + one encoder block) and a
transformer block (``eqx.nn.MultiheadAttention``, LayerNorm, GELU MLP), each train step
(``value_and_grad`` of the ``amp`` loss + an SGD update, parameters donated) in bfloat16,
float16 and float8 (``load_policy("fp8")``) must have:

- no float32 x float32 GEMM (nothing is in ``amp_stop`` here; a control shows the census
  does see one that is);
- no convolution with float32 operands;
- every float8 matmul JAX hands to XLA as a float8 GEMM (none upcast; XLA may merge
  GEMMs that share an operand, attention's q/k/v projections);
- no transpose left in front of a GEMM beyond the float32 step's (folded into the GEMM);
- at most the committed kernel count (``gpu_program_kernels.json``, a regression guard;
  ``AUTOCAST_UPDATE_KERNELS=1`` rewrites it).

Runs in ``bash tests/run_gpu_program.sh`` (installs the plugin, about 200 MB, cached);
elsewhere it skips, saying so.
"""

from __future__ import annotations

import functools
import json
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

import autocast  # noqa: E402
from benchmarks import _gpu_target as T  # noqa: E402

KERNELS_FILE = Path(__file__).with_name("gpu_program_kernels.json")
SLACK = 0.05  # a kernel count may grow by 5 % (at least 2) before the guard fails


@functools.cache
def _sharding():
    return T.target_sharding("h100")


class _Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, width, heads, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width)
        self.attn = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.fc1 = eqx.nn.Linear(width, 4 * width, key=k2)
        self.fc2 = eqx.nn.Linear(4 * width, width, key=k3)

    def __call__(self, x):
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(jax.vmap(self.ln2)(x))))


class _ViT(eqx.Module):
    patch: eqx.nn.Conv2d
    block: _Block
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.patch = eqx.nn.Conv2d(3, 128, 8, stride=8, key=k1)
        self.block = _Block(128, 4, k2)
        self.head = eqx.nn.Linear(128, 16, key=k3)

    def __call__(self, img):
        x = self.patch(img).reshape(128, -1).T  # (16 patches, 128)
        return self.head(self.block(x).mean(0))


def _models():
    key = jax.random.key(0)
    return {
        "mlp": (
            eqx.nn.MLP(256, 256, 512, depth=2, activation=jax.nn.gelu, key=key),
            lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2),
            jnp.ones((256, 256)),
        ),
        "vit": (_ViT(key), lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), jnp.ones((32, 3, 32, 32))),
        "block": (_Block(128, 4, key), lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), jnp.ones((8, 64, 128))),
    }


SYSTEMS = {
    "fp32": None,
    "bf16": dict(compute_dtype=jnp.bfloat16),
    "f16": dict(compute_dtype=jnp.float16),
    "fp8": dict(compute_dtype=jnp.bfloat16, amp_policy="fp8"),
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
            kw["amp_policy"] = autocast.load_policy("fp8")
        f = autocast.amp(f, **kw)

    def step(p, x):
        loss_value, g = jax.value_and_grad(f)(p, x)
        return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g), loss_value

    return step, (params, x)


@functools.cache
def _compiled(model_name: str, system: str, mode: str, stop_head: bool = False):
    step, args = _step(model_name, system, stop_head)
    jitted = jax.jit(step, donate_argnums=0, compiler_options=T.MODES[mode])
    _, info = T.compile_for_target(jitted, T.abstract(args, _sharding()))
    # float8 matmuls JAX hands to XLA (after JAX's dead-code elimination)
    lowered = jax.jit(step).lower(*args).as_text()
    dots = re.findall(r"stablehlo\.dot_general[^\n]*: \(tensor<(?:[0-9]+x)*(\w+)>", lowered)
    info["jaxpr_fp8_dots"] = sum(1 for d in dots if d.startswith("f8"))
    info["jaxpr_other_dots"] = len(dots) - info["jaxpr_fp8_dots"]
    return info


CASES = [(m, s, mode) for m in ("mlp", "vit", "block") for s in ("bf16", "f16", "fp8") for mode in T.MODES]


@pytest.mark.parametrize("model,system,mode", CASES)
def test_amp_step_on_the_gpu_target(model, system, mode):
    info = _compiled(model, system, mode)
    f32_gemms = info["gemms"].get("f32 x f32", 0)
    assert f32_gemms == 0, f"{f32_gemms} f32 x f32 GEMMs: {info['gemms']}"
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
    assert info["transposes_into_gemms"] <= baseline["transposes_into_gemms"], (
        info["transposes_into_gemms"],
        baseline["transposes_into_gemms"],
    )
    _check_kernels(f"{model}/{system}/{mode}", info["kernels"])


def test_census_sees_float32_gemms_in_amp_stop():
    """The control: the MLP's last layer under ``amp_stop`` keeps its float32 GEMMs."""
    info = _compiled("mlp", "bf16", "cublas", stop_head=True)
    assert info["gemms"].get("f32 x f32", 0) >= 2, info["gemms"]  # forward and its weight gradient at least
    assert info["gemms"].get("bf16 x bf16", 0) >= 3, info["gemms"]


def test_float32_step_has_float32_gemms():
    info = _compiled("block", "fp32", "triton")
    assert set(info["gemms"]) == {"f32 x f32"}, info["gemms"]


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
