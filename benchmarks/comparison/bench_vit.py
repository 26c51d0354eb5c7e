"""ViT training-step benchmark: autocast against fp32, the MPX approach, jmp and jaxamp.

Builds the MPX paper's ViT shapes ("desktop": CIFAR-100 32x32, patch 4, width 256,
MLP 800, 6 blocks; "base": ViT-Base 224x224, patch 16, 768/3072, 12 blocks) on
synthetic batches and measures one training step (forward, backward, optax AdamW
update, loss scaling where the system uses it) for every system in one process:

- median step time after warm-up (all systems called round-robin),
- trace / lower / compile time,
- activation memory: bytes of the residuals that ``jax.vjp`` saves for the backward pass,
- XLA's compiled memory analysis, and peak device memory where the backend reports it,
- convert ops in the StableHLO and in the optimized HLO.

Run from the repo root::

    python -m benchmarks.comparison.bench_vit --quick
    python -m benchmarks.comparison.bench_vit --shape desktop --sizes 8 16 32 64
    python -m benchmarks.comparison.bench_vit --shape base --sizes 1 2

Results go to ``benchmarks/results/comparison/vit_<shape>[_quick].{json,md,png}``. The figure is
redrawn from the committed JSON, without running anything, by::

    python -m benchmarks.comparison.bench_vit --plot-only vit_desktop vit_base vit_desktop_headtohead vit_desktop_quick
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

if __package__ in (None, ""):  # allow `python benchmarks/comparison/bench_vit.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    __package__ = "benchmarks.comparison"

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from benchmarks import _common as C
from benchmarks.models.vit import SHAPES, ViT, ViTConfig, cross_entropy, synthetic_batch

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
INIT_SCALE = 2.0**15
PERIOD = 2000

ALL_SYSTEMS = (
    "fp32",
    "autocast-f16",
    "autocast-bf16",
    "autocast-f16-noremat",
    "mpx-f16",
    "mpx-bf16",
    "jmp-f16",
    "jaxamp-f16",
)
#: ``--quick`` leaves out the ablation ``autocast-f16-noremat`` (amp's ``remat_float32=False``).
QUICK_SYSTEMS = tuple(s for s in ALL_SYSTEMS if s != "autocast-f16-noremat")
#: Opt-in control: fp32 under ``jax.checkpoint(policy=dots_saveable)``, i.e. fp32 with a
#: recompute policy, to separate the effect of recomputation from that of half precision.
EXTRA_SYSTEMS = ("fp32-remat",)


# ----------------------------------------------------------------------------- loss


def _loss(model: ViT, x: jax.Array, y: jax.Array, ce: Callable = cross_entropy):
    logits = jax.vmap(model)(x)
    return ce(logits, y), jnp.mean(jnp.argmax(logits, axis=-1) == y)


# ----------------------------------------------------------------------------- systems


@dataclass
class System:
    """One mixed-precision system: a jittable train step and the loss it differentiates.

    ``step(params, opt_state, scaler, x, y) -> (params, opt_state, scaler, loss, finite)``;
    ``loss(params, x, y) -> scalar`` is the (transformed) loss whose vjp residuals are
    the activation memory; ``scaler`` is a pytree of arrays (or ``None``).
    """

    name: str
    label: str
    step: Callable[..., Any]
    loss: Callable[..., Any]
    scaler: Any = None
    context: Callable[[], Any] = field(default=contextlib.nullcontext)


def _adamw() -> optax.GradientTransformation:
    return optax.adamw(1e-3, weight_decay=1e-4)


def _apply(opt, params, opt_state, grads):
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _select(pred, new, old):
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), new, old)


def _cast_floats(tree: Any, dtype: Any, kinds=(F16, BF16, F32)) -> Any:
    """Cast every array leaf whose dtype is one of ``kinds`` to ``dtype``."""
    kinds = tuple(jnp.dtype(k) for k in kinds)
    return jax.tree_util.tree_map(lambda a: a.astype(dtype) if eqx.is_array(a) and a.dtype in kinds else a, tree)


class _Scale(NamedTuple):
    """Dynamic loss scale used by the re-implementations (the jmp adjustment rule)."""

    scale: jax.Array
    counter: jax.Array

    @classmethod
    def create(cls) -> _Scale:
        return cls(jnp.asarray(INIT_SCALE, F32), jnp.zeros((), jnp.int32))

    def adjust(self, finite: jax.Array) -> _Scale:
        grown = jnp.where(self.counter == PERIOD - 1, self.scale * 2, self.scale)
        grown = jnp.where(jnp.isfinite(grown), grown, self.scale)
        scale = jnp.where(finite, grown, jnp.maximum(1.0, self.scale / 2))
        counter = jnp.where(finite, (self.counter + 1) % PERIOD, 0)
        return _Scale(scale, counter)


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.isfinite(a).all() for a in jax.tree_util.tree_leaves(tree)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def _fp32(static, opt) -> System:
    def loss(p, x, y):
        return _loss(eqx.combine(p, static), x, y)[0]

    def step(p, opt_state, scaler, x, y):
        (l, _), g = jax.value_and_grad(lambda q: _loss(eqx.combine(q, static), x, y), has_aux=True)(p)
        p, opt_state = _apply(opt, p, opt_state, g)
        return p, opt_state, scaler, l, jnp.asarray(True)

    return System("fp32", "fp32 (no mixed precision)", step, loss)


def _fp32_remat(static, opt) -> System:
    policy = jax.checkpoint_policies.dots_saveable
    ck_loss = jax.checkpoint(lambda p, x, y: _loss(eqx.combine(p, static), x, y), policy=policy)

    def loss(p, x, y):
        return ck_loss(p, x, y)[0]

    def step(p, opt_state, scaler, x, y):
        (l, _), g = jax.value_and_grad(ck_loss, has_aux=True)(p, x, y)
        p, opt_state = _apply(opt, p, opt_state, g)
        return p, opt_state, scaler, l, jnp.asarray(True)

    return System(
        "fp32-remat",
        "fp32 under jax.checkpoint(policy=dots_saveable) (control: recompute without mixed precision)",
        step,
        loss,
    )


def _autocast(static, opt, dtype, remat: bool = True) -> System:
    import autocast

    name = ("autocast-f16" if dtype == F16 else "autocast-bf16") + ("" if remat else "-noremat")
    amp_loss = autocast.amp(_loss, compute_dtype=dtype, remat_float32=remat)

    def loss(p, x, y):
        return amp_loss(eqx.combine(p, static), x, y)[0]

    gfn = autocast.dynamic_scale_value_and_grad(amp_loss, has_aux=True)

    def step(p, opt_state, scaler, x, y):
        model = eqx.combine(p, static)
        scaler, ((l, _), grads) = gfn(model, x, y, dynamic_scaler_state=scaler)
        model, opt_state = autocast.optimizer_update(model, opt, opt_state, grads, scaler.grads_finite)
        return eqx.filter(model, eqx.is_array), opt_state, scaler, l, scaler.grads_finite

    scaler = autocast.DynamicScalerState() if dtype == F16 else autocast.NoOpScalerState()
    scaler_kind = "dynamic scaler" if dtype == F16 else "no-op scaler"
    label = f"autocast {jnp.dtype(dtype).name} ({scaler_kind}" + (
        ")" if remat else "; ablation: amp(..., remat_float32=False))"
    )
    return System(name, label, step, loss, scaler)


def _mpx_package(static, opt, dtype) -> System:
    import mpx

    ce = mpx.force_full_precision(cross_entropy, F32)  # MPX's recipe for the loss head

    def f(model, x, y):
        return _loss(model, x, y, ce)

    def loss(p, x, y):
        m, x = mpx.cast_to_half_precision((eqx.combine(p, static), x))
        return f(m, x, y)[0]

    def step(p, opt_state, scaler, x, y):
        model = eqx.combine(p, static)
        (l, _), scaler, finite, grads = mpx.filter_value_and_grad(f, scaler, has_aux=True)(model, x, y)
        model, opt_state = mpx.optimizer_update(model, opt, opt_state, grads, finite)
        return eqx.filter(model, eqx.is_array), opt_state, scaler, l, finite

    scaler = mpx.DynamicLossScaling(
        loss_scaling=jnp.asarray(INIT_SCALE, F32), min_loss_scaling=jnp.asarray(1.0, F32), period=PERIOD
    )
    name = "mpx-f16" if dtype == F16 else "mpx-bf16"
    version = C._version("mixed-precision-for-jax")
    return System(
        name,
        f"MPX {version} package, {jnp.dtype(dtype).name}",
        step,
        loss,
        scaler,
        functools.partial(C.mpx_half_dtype, dtype),
    )


def _mpx_reimpl(static, opt, dtype) -> System:
    """The MPX approach re-implemented here: cast every float input of the step to half,
    run the unchanged model (JAX type promotion keeps it in half), loss head in f32."""

    def ce(logits, y):
        return cross_entropy(logits.astype(F32), y)

    def loss(p, x, y):
        p, x = _cast_floats((p, x), dtype)
        return _loss(eqx.combine(p, static), x, y, ce)[0]

    def step(p, opt_state, scaler, x, y):
        ph, xh = _cast_floats((p, x), dtype)

        def scaled(q):
            l, acc = _loss(eqx.combine(q, static), xh, y, ce)
            return l * scaler.scale, (l, acc)

        (_, (l, _)), g = jax.value_and_grad(scaled, has_aux=True)(ph)
        g = jax.tree_util.tree_map(lambda a: a.astype(F32) / scaler.scale, g)
        finite = _all_finite(g)
        new_p, new_s = _apply(opt, p, opt_state, g)
        return (_select(finite, new_p, p), _select(finite, new_s, opt_state), scaler.adjust(finite), l, finite)

    name = "mpx-f16" if dtype == F16 else "mpx-bf16"
    return System(
        name, f"MPX approach, {jnp.dtype(dtype).name} (re-implementation in this script)", step, loss, _Scale.create()
    )


def _jmp_package(static, opt, dtype) -> System:
    import jmp

    policy = jmp.Policy(param_dtype=F32, compute_dtype=dtype, output_dtype=F32)

    def f(p, x, y):
        p, x = policy.cast_to_compute((p, x))
        logits = policy.cast_to_output(jax.vmap(eqx.combine(p, static))(x))
        return cross_entropy(logits, y), jnp.mean(jnp.argmax(logits, -1) == y)

    def loss(p, x, y):
        return f(p, x, y)[0]

    def step(p, opt_state, scaler_leaves, x, y):
        # jmp's DynamicLossScale validates its leaves in __post_init__, which breaks
        # jax.jit(...).trace()/.lower() (AOT), so the step takes its two leaves.
        scaler = jmp.DynamicLossScale(*scaler_leaves, period=PERIOD)

        def scaled(q):
            l, acc = f(q, x, y)
            return scaler.scale(l), (l, acc)

        (_, (l, _)), g = jax.value_and_grad(scaled, has_aux=True)(p)
        g = scaler.unscale(g)
        finite = jmp.all_finite(g)
        new_p, new_s = _apply(opt, p, opt_state, g)
        p = jmp.select_tree(finite, new_p, p)
        opt_state = jmp.select_tree(finite, new_s, opt_state)
        new = scaler.adjust(finite)
        return p, opt_state, (new.loss_scale, new.counter), l, finite

    # A float32 scale: jmp's README recipe (a float16 scale) crashes in adjust (jmp#47).
    scaler = (jnp.asarray(INIT_SCALE, F32), jnp.zeros((), jnp.int32))
    return System(
        "jmp-f16", f"jmp {C._version('jmp')} package, policy params=f32,compute=f16,output=f32", step, loss, scaler
    )


def _jmp_reimpl(static, opt, dtype) -> System:
    """The jmp approach re-implemented here: a (param=f32, compute=half, output=f32)
    policy cast inside the differentiated function."""

    def f(p, x, y):
        p, x = _cast_floats((p, x), dtype, kinds=(F32,))
        logits = jax.vmap(eqx.combine(p, static))(x).astype(F32)
        return cross_entropy(logits, y), jnp.mean(jnp.argmax(logits, -1) == y)

    def loss(p, x, y):
        return f(p, x, y)[0]

    def step(p, opt_state, scaler, x, y):
        def scaled(q):
            l, acc = f(q, x, y)
            return l * scaler.scale, (l, acc)

        (_, (l, _)), g = jax.value_and_grad(scaled, has_aux=True)(p)
        g = jax.tree_util.tree_map(lambda a: a / scaler.scale, g)
        finite = _all_finite(g)
        new_p, new_s = _apply(opt, p, opt_state, g)
        return (_select(finite, new_p, p), _select(finite, new_s, opt_state), scaler.adjust(finite), l, finite)

    return System(
        "jmp-f16",
        "jmp approach, policy params=f32,compute=f16,output=f32 (re-implementation in this script)",
        step,
        loss,
        _Scale.create(),
    )


def _jaxamp(static, opt, dtype) -> System:
    import jaxamp

    amp_loss = jaxamp.amp(_loss, compute_dtype=dtype)
    gfn = jaxamp.dynamic_scale_value_and_grad(amp_loss, has_aux=True)

    def loss(p, x, y):
        return amp_loss(eqx.combine(p, static), x, y)[0]

    def step(p, opt_state, scaler, x, y):
        scaler, ((l, _), g) = gfn(eqx.combine(p, static), x, y, dynamic_scaler_state=scaler)
        g = eqx.filter(g, eqx.is_array)
        p, opt_state = _apply(opt, p, opt_state, g)
        return p, opt_state, scaler, l, jnp.asarray(True)

    return System(
        "jaxamp-f16", f"jaxamp {C._version('jaxamp')} package, float16", step, loss, jaxamp.DynamicScalerState()
    )


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def build_system(name: str, static: Any, opt: Any, *, reimpl: bool = False) -> System:
    """Build system ``name`` (see ``ALL_SYSTEMS``); raises if it cannot be built."""
    dtype = BF16 if name.endswith("bf16") else F16
    if name == "fp32":
        return _fp32(static, opt)
    if name == "fp32-remat":
        return _fp32_remat(static, opt)
    if name.startswith("autocast"):
        return _autocast(static, opt, dtype, remat=not name.endswith("noremat"))
    if name.startswith("mpx"):
        use_pkg = _installed("mpx") and not reimpl
        return (_mpx_package if use_pkg else _mpx_reimpl)(static, opt, dtype)
    if name.startswith("jmp"):
        use_pkg = _installed("jmp") and not reimpl
        return (_jmp_package if use_pkg else _jmp_reimpl)(static, opt, dtype)
    if name.startswith("jaxamp"):
        return _jaxamp(static, opt, dtype)
    raise ValueError(f"unknown system {name!r}")


# ----------------------------------------------------------------------------- measuring


def _error(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return msg[:300]


def _measure_one(system: System, params, opt_state, x, y, ref_loss) -> dict[str, Any]:
    """Compile ``system``'s step and measure everything except step time."""
    out: dict[str, Any] = {"label": system.label}
    with system.context():
        jitted = jax.jit(system.step)
        (lowered, compiled), times = C.trace_lower_compile(jitted, params, opt_state, system.scaler, x, y)
        out["compile_s"] = times
        out["converts"] = C.count_converts(lowered, compiled)
        out["xla_memory"] = C.compiled_memory(compiled)
        out["residuals"] = C.residual_bytes(system.loss, params, x, y)
        l0 = jax.jit(system.loss)(params, x, y)
    out["loss0"] = float(l0)
    out["loss0_dtype"] = str(l0.dtype)
    out["loss0_rel_err_vs_fp32"] = abs(float(l0) - ref_loss) / abs(ref_loss)
    out["_compiled"] = compiled
    return out


def _peak_in_child(shape: str, system: str, batch: int, reimpl: bool) -> int | None:
    """Peak device memory of one step of ``system``, in a fresh process (GPU/TPU only)."""
    cmd = [sys.executable, "-m", "benchmarks.comparison.bench_vit", "--_peak-child", shape, system, str(batch)] + (
        ["--reimpl"] if reimpl else []
    )
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])["peak"]
    except (IndexError, ValueError, KeyError):
        return None


def _peak_child(shape: str, name: str, batch: int, reimpl: bool) -> None:
    cfg = SHAPES[shape]
    params, static, opt, opt_state, x, y = _setup(cfg, batch)
    system = build_system(name, static, opt, reimpl=reimpl)
    with system.context():
        step = jax.jit(system.step)
        C.block(step(params, opt_state, system.scaler, x, y))
    print(json.dumps({"peak": C.device_peak_bytes()}))


def _setup(cfg: ViTConfig, batch: int):
    model = ViT(cfg, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    opt = _adamw()
    opt_state = opt.init(params)
    x, y = synthetic_batch(cfg, batch, key=jax.random.key(1))
    return params, static, opt, opt_state, x, y


def run_size(
    shape: str, batch: int, names: list[str], *, repeats: int, warmup: int, reimpl: bool, peak: bool
) -> dict[str, Any]:
    """Measure every system at one batch size; step times are interleaved."""
    cfg = SHAPES[shape]
    params, static, opt, opt_state, x, y = _setup(cfg, batch)
    ref_loss = float(jax.jit(lambda p: _loss(eqx.combine(p, static), x, y)[0])(params))
    results: dict[str, Any] = {}
    runners: dict[str, Callable[[], Any]] = {}
    for name in names:
        try:
            system = build_system(name, static, opt, reimpl=reimpl)
            res = _measure_one(system, params, opt_state, x, y, ref_loss)
        except Exception as e:  # noqa: BLE001 - a failing system is a result
            results[name] = {"error": _error(e)}
            print(f"  [{shape} bs={batch}] {name}: FAILED {_error(e)}", flush=True)
            if os.environ.get("BENCH_DEBUG"):
                traceback.print_exc()
            continue
        compiled = res.pop("_compiled")
        state = {"s": (params, opt_state, system.scaler), "skipped": 0}

        def runner(compiled=compiled, state=state):
            p, o, s = state["s"]
            p, o, s, l, finite = compiled(p, o, s, x, y)
            state["s"] = (p, o, s)
            return l, finite

        runners[name] = runner
        results[name] = res
        print(
            f"  [{shape} bs={batch}] {name}: compiled in {res['compile_s']['total']:.1f}s, "
            f"activations {C.fmt_bytes(res['residuals']['activation'])}",
            flush=True,
        )
    if runners:
        timing = C.interleaved_medians(runners, warmup=warmup, repeats=repeats)
        for name, t in timing.items():
            results[name]["step_s"] = t
    for name in runners:
        results[name]["peak_device_bytes"] = _peak_in_child(shape, name, batch, reimpl) if peak else None
    return results


# ----------------------------------------------------------------------------- reporting


def _ratio(a, b):
    return a / b if a and b else None


def _fmt(v, spec=".2f", suffix=""):
    return "n/a" if v is None else f"{v:{spec}}{suffix}"


def summarise(shape: str, sizes: dict[int, dict[str, Any]]) -> list[str]:
    """Markdown tables: absolute numbers per batch size, then ratios."""
    lines = []
    for bs, res in sizes.items():
        lines += [
            f"\n### {shape}, batch {bs}\n",
            "| system | step time (median) | vs fp32 | trace+lower+compile | "
            "activation memory | fp32 / this | XLA temp | converts StableHLO / "
            "optimized | loss rel. err. vs fp32 |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        f32 = res.get("fp32", {})
        f32_t = f32.get("step_s", {}).get("median")
        f32_a = f32.get("residuals", {}).get("activation")
        for name, r in res.items():
            if "error" in r:
                lines.append(f"| {name} | failed: `{r['error']}` | | | | | | | |")
                continue
            t = r.get("step_s", {}).get("median")
            act = r["residuals"]["activation"]
            temp = (r["xla_memory"] or {}).get("temp")
            cv = r["converts"]
            lines.append(
                f"| {name} | {_fmt(t and t * 1e3, '.1f', ' ms')} | "
                f"{_fmt(_ratio(t, f32_t), '.2f', 'x')} | "
                f"{_fmt(r['compile_s']['total'], '.2f', ' s')} | {C.fmt_bytes(act)} | "
                f"{_fmt(_ratio(f32_a, act), '.2f', 'x')} | {C.fmt_bytes(temp)} | "
                f"{cv['stablehlo']} / {cv['optimized']} | {r['loss0_rel_err_vs_fp32']:.1e} |"
            )
    lines += [
        "\n### Ratios (same run)\n",
        "| batch | act. fp32/autocast-f16 | act. fp32/autocast-f16-noremat | "
        "act. fp32/fp32-remat | "
        "act. fp32/mpx-f16 | act. fp32/jmp-f16 | act. fp32/autocast-bf16 "
        "| step autocast-f16/mpx-f16 | step autocast-bf16/mpx-bf16 | "
        "step autocast-f16/fp32 | compile autocast-f16/fp32 (wall; CPU) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def g(res, name, *path):
        v = res.get(name, {})
        for p in path:
            v = v.get(p, {}) if isinstance(v, dict) else {}
        return v if isinstance(v, (int, float)) else None

    for bs, res in sizes.items():
        act = lambda n: g(res, n, "residuals", "activation")  # noqa: B023
        st = lambda n: g(res, n, "step_s", "median")  # noqa: B023
        ct = lambda n: g(res, n, "compile_s", "total")  # noqa: B023
        cc = lambda n: g(res, n, "compile_s", "total_cpu")  # noqa: B023
        lines.append(
            f"| {bs} | {_fmt(_ratio(act('fp32'), act('autocast-f16')), '.2f', 'x')} | "
            f"{_fmt(_ratio(act('fp32'), act('autocast-f16-noremat')), '.2f', 'x')} | "
            f"{_fmt(_ratio(act('fp32'), act('fp32-remat')), '.2f', 'x')} | "
            f"{_fmt(_ratio(act('fp32'), act('mpx-f16')), '.2f', 'x')} | "
            f"{_fmt(_ratio(act('fp32'), act('jmp-f16')), '.2f', 'x')} | "
            f"{_fmt(_ratio(act('fp32'), act('autocast-bf16')), '.2f', 'x')} | "
            f"{_fmt(_ratio(st('autocast-f16'), st('mpx-f16')), '.3f')} | "
            f"{_fmt(_ratio(st('autocast-bf16'), st('mpx-bf16')), '.3f')} | "
            f"{_fmt(_ratio(st('autocast-f16'), st('fp32')), '.3f')} | "
            f"{_fmt(_ratio(ct('autocast-f16'), ct('fp32')), '.2f')}; "
            f"{_fmt(_ratio(cc('autocast-f16'), cc('fp32')), '.2f')} |"
        )
    return lines


def plot(shape: str, sizes: dict[int, dict[str, Any]], path, backend: str | None = None) -> None:
    """Activation memory and step time per system: against batch size when several were run
    (cf. MPX paper Figs. 1-2), as bar charts when there is one batch size (a head-to-head)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backend = backend or jax.default_backend()
    names = sorted(
        {n for res in sizes.values() for n, r in res.items() if "error" not in r},
        key=(ALL_SYSTEMS + EXTRA_SYSTEMS).index,
    )
    if len(sizes) == 1:
        ((bs, res),) = sizes.items()
        names = [n for n in names if "step_s" in res.get(n, {})]
        memory = [res[n]["residuals"]["activation"] / 2**20 for n in names]
        step = [res[n]["step_s"]["median"] * 1e3 for n in names]
        colors = [
            "#888888" if n.startswith("fp32") else "#3b5bdb" if n.startswith("autocast") else "#e8590c" for n in names
        ]
        fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(names) + 1.6), sharey=True)
        for ax, values, label in (
            (axes[0], memory, "activation memory (MiB, vjp residuals)"),
            (axes[1], step, f"step time (ms, median, {backend})"),
        ):
            ypos = range(len(names))
            ax.barh(ypos, values, color=colors)
            for y, v in zip(ypos, values):
                ax.text(v, y, f" {v:.1f}", va="center", fontsize=8)
            ax.set_xlabel(label)
            ax.set_xlim(0, max(values) * 1.18)
            ax.grid(axis="x", alpha=0.3)
        axes[0].set_yticks(range(len(names)), names)
        axes[0].invert_yaxis()
        axes[0].set_title(f"ViT-{shape}, batch {bs}: activation memory")
        axes[1].set_title(f"ViT-{shape}, batch {bs}: training step time")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in names:
        bss = [bs for bs, res in sizes.items() if "step_s" in res.get(name, {})]
        if not bss:
            continue
        axes[0].plot(bss, [sizes[b][name]["residuals"]["activation"] / 2**20 for b in bss], "o-", label=name)
        axes[1].plot(bss, [sizes[b][name]["step_s"]["median"] * 1e3 for b in bss], "o-", label=name)
    axes[0].set(
        xlabel="batch size", ylabel="activation memory (MiB, vjp residuals)", title=f"ViT-{shape}: activation memory"
    )
    axes[1].set(xlabel="batch size", ylabel=f"step time (ms, {backend})", title=f"ViT-{shape}: training step time")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_xticks(sorted(sizes))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replot(stem: str) -> None:
    """Redraw ``results/comparison/<stem>.png`` from the committed ``results/comparison/<stem>.json`` (no benchmark run)."""
    out = C.results_dir("comparison")
    data = json.loads((out / f"{stem}.json").read_text())
    sizes = {int(k): v for k, v in data["results"].items()}
    plot(data["shape"], sizes, out / f"{stem}.png", backend=data["meta"].get("backend"))
    print(f"wrote {out / stem}.png from {stem}.json")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="desktop")
    ap.add_argument("--sizes", type=int, nargs="+", help="batch sizes to sweep")
    ap.add_argument(
        "--quick", action="store_true", help="desktop shape, batch 8, 1 warm-up + 3 rounds (< 2 min on CPU)"
    )
    ap.add_argument(
        "--systems",
        nargs="+",
        choices=ALL_SYSTEMS + EXTRA_SYSTEMS,
        help="default: all (--quick: all but autocast-f16-noremat)",
    )
    ap.add_argument("--repeats", type=int, help="timed rounds per batch size")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--reimpl",
        action="store_true",
        help="use this script's re-implementations of MPX and jmp even if the packages are installed",
    )
    ap.add_argument(
        "--no-peak", action="store_true", help="skip the per-system subprocess that reads peak device memory"
    )
    ap.add_argument("--out", help="output file stem (default vit_<shape>[_quick])")
    ap.add_argument(
        "--plot-only",
        nargs="+",
        metavar="STEM",
        help="redraw results/comparison/STEM.png from the committed results/comparison/STEM.json and exit (e.g. vit_desktop_headtohead)",
    )
    ap.add_argument("--_peak-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.plot_only:
        for stem in args.plot_only:
            replot(stem)
        return

    if args._peak_child:
        shape, name, bs = args._peak_child
        _peak_child(shape, name, int(bs), args.reimpl)
        return
    if args.quick:
        args.shape = "desktop"
        sizes = args.sizes or [8]
        repeats = args.repeats or 3
        args.warmup = 1
    else:
        sizes = args.sizes or ([8, 16, 32, 64] if args.shape == "desktop" else [1, 2])
        repeats = args.repeats or (10 if args.shape == "desktop" else 3)
    if args.systems is None:
        args.systems = list(QUICK_SYSTEMS if args.quick else ALL_SYSTEMS)
    peak = (not args.no_peak) and C.device_peak_bytes() is not None
    stem = args.out or f"vit_{args.shape}" + ("_quick" if args.quick else "")
    meta = C.metadata()
    cmd = "python -m benchmarks.comparison.bench_vit " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"bench_vit: shape={args.shape} sizes={sizes} backend={meta['backend']} ({meta['device']})", flush=True)
    t0, c0 = time.perf_counter(), time.process_time()
    results: dict[int, dict[str, Any]] = {}
    for bs in sizes:
        results[bs] = run_size(
            args.shape, bs, args.systems, repeats=repeats, warmup=args.warmup, reimpl=args.reimpl, peak=peak
        )
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    cfg = SHAPES[args.shape]
    data = {
        "command": cmd,
        "meta": meta,
        "shape": args.shape,
        "config": cfg.__dict__,
        "repeats": repeats,
        "warmup": args.warmup,
        "wall_s": wall,
        "cpu_s": cpu,
        "results": {str(k): v for k, v in results.items()},
    }
    out = C.results_dir("comparison")
    C.write_json(out / f"{stem}.json", data)
    md = [
        f"## ViT-{args.shape} training step ({cfg.image_size}x{cfg.image_size}, patch "
        f"{cfg.patch}, width {cfg.width}, MLP {cfg.mlp_hidden}, {cfg.depth} blocks, "
        f"{cfg.heads} heads, {cfg.classes} classes)\n",
        f"Command: `{cmd}` ({wall:.0f} s wall, {cpu:.0f} s CPU)\n",
        C.metadata_markdown(meta),
        f"Step time: median of {repeats} interleaved rounds after {args.warmup} warm-up "
        "calls. Activation memory: bytes of vjp residuals computed from the batch. "
        "Peak device memory: " + ("in the JSON." if peak else "not reported by this backend."),
    ]
    labels = {n: r["label"] for res in results.values() for n, r in res.items() if "label" in r}
    md += ["\nSystems:\n"] + [f"- `{n}`: {lbl}" for n, lbl in labels.items()]
    md += summarise(args.shape, results)
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    plot(args.shape, results, out / f"{stem}.png")
    print("\n".join(md))
    print(f"\nwrote {out / stem}.{{json,md,png}} in {wall:.0f} s")


if __name__ == "__main__":
    main()
