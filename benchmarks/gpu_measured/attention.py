"""Causal attention, forward + backward, six ways: what amp's fused attention gives (issue 41).

At GPT-2 small's shapes (batch 8, 1,024 tokens, 12 heads of 64; ``--smoke``: 2 x 64 tokens x
2 heads of 16, any backend), each variant's ``value_and_grad`` of ``sum(attention(q, k, v) *
g)`` with respect to q, k and v (``g`` a fixed random cotangent):

- ``fp32``: attention written out in float32 (``einsum``, ``where(causal, s, finfo.min)``,
  ``jax.nn.softmax``, ``einsum``), JAX's default matmul precision;
- ``mpx-bf16``: the MPX recipe, the same code on bfloat16 inputs;
- ``amp-bf16-xla``: ``amp(fp32's code, compute_dtype=bfloat16, attention="xla")``: as written;
- ``amp-bf16-fused``: ``amp(fp32's code, compute_dtype=bfloat16)``: the fused kernel where
  cuDNN takes it (docs/attention.md), as written elsewhere;
- ``cudnn``: ``jax.nn.dot_product_attention(..., is_causal=True, implementation="cudnn")`` on
  bfloat16 inputs;
- ``cudnn-from-f32``: the same call on the float32 inputs cast to bfloat16, its output cast back:
  amp's fused program written by hand (on an H100 target the two compile to the same program:
  the same :func:`~benchmarks.gpu_measured.rounds.program_hash`).

Every variant is compiled (and checked) first; then the variants take turns in ``--rounds``
rotated rounds (:mod:`benchmarks.gpu_measured.rounds`), each turn ``--steps`` calls dispatched
back to back (only the last waited for). Per variant: the median time per call over rounds
and its min-max, its ratio to fp32 and to MPX taken within each round, XLA's temp memory of
the compiled program (``memory_analysis()``), the cuDNN attention custom calls in it
(``__cudnn$fmha*``: forward, backward), and the relative L2 error of the output and of the
gradient (q, k and v together) against float32 at ``Precision.HIGHEST``, and the program's
hash (:func:`benchmarks.gpu_measured.rounds.program_hash`: equal programs, equal hashes). A variant that
fails (the cuDNN call off a CUDA GPU) is a result: its error is recorded. The report is
rewritten after each variant's compile and after the rounds (a run cut short keeps what it measured):
``<out-dir>/attention-<device>-<date>[-smoke].{md,json}``::

    python -m benchmarks.gpu_measured.attention                 # on the GPU
    python -m benchmarks.gpu_measured.attention --smoke --out-dir /tmp/attn
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import autocast
from benchmarks import _common as C
from benchmarks.gpu_measured import rounds as R

SHAPES = {
    "gpt2-small": {"batch": 8, "seq": 1024, "heads": 12, "head_dim": 64},
    "smoke": {"batch": 2, "seq": 64, "heads": 2, "head_dim": 16},
}
VARIANTS = ("fp32", "mpx-bf16", "amp-bf16-xla", "amp-bf16-fused", "cudnn", "cudnn-from-f32")
_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha(\w*)"')


def written(q: Any, k: Any, v: Any, precision: Any = None) -> Any:
    """Causal attention as users write it: ``[B, T, N, H]`` in, ``[B, T, N, H]`` out."""
    # a Python float scale: weakly typed, so bfloat16 scores stay bfloat16 (MPX's recipe)
    s = jnp.einsum("btnh,bsnh->bnts", q, k, precision=precision) * q.shape[-1] ** -0.5
    causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    s = jnp.where(causal, s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v, precision=precision)


def _cudnn(q: Any, k: Any, v: Any) -> Any:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5, implementation="cudnn")


def _cudnn_from_f32(q: Any, k: Any, v: Any) -> Any:
    bf16 = jnp.bfloat16
    return _cudnn(q.astype(bf16), k.astype(bf16), v.astype(bf16)).astype(q.dtype)


def variant(name: str) -> tuple[Any, Any]:
    """``(attention function, the dtype its q, k, v come in)`` of variant ``name``."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    table = {
        "fp32": (written, f32),
        "mpx-bf16": (written, bf16),
        "amp-bf16-xla": (autocast.amp(written, compute_dtype=bf16, attention="xla"), f32),
        "amp-bf16-fused": (autocast.amp(written, compute_dtype=bf16), f32),
        "cudnn": (_cudnn, bf16),
        "cudnn-from-f32": (_cudnn_from_f32, f32),
    }
    if name not in table:
        raise ValueError(f"variant {name!r} unknown; allowed: {list(VARIANTS)}")
    return table[name]


def _grad_fn(fn: Any, g: Any) -> Any:
    def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * g)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _rel(a: list[Any], b: list[Any]) -> float:
    a64 = [np.asarray(x, np.float64) for x in a]
    b64 = [np.asarray(x, np.float64) for x in b]
    num = np.sqrt(sum(np.sum((x - y) ** 2) for x, y in zip(a64, b64)))
    return float(num / np.sqrt(sum(np.sum(y**2) for y in b64)))


def inputs(shape: dict[str, int], seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """Float32 q, k, v (unit normal) and the cotangent ``g``, all ``[B, T, N, H]``."""
    dims = (shape["batch"], shape["seq"], shape["heads"], shape["head_dim"])
    keys = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(k, dims, jnp.float32) for k in keys)  # type: ignore[return-value]


def reference(q: Any, k: Any, v: Any, g: Any) -> tuple[Any, list[Any]]:
    """Float32 attention at ``Precision.HIGHEST``: the output and the gradient (q, k, v)."""
    fn = lambda q, k, v: written(q, k, v, precision=jax.lax.Precision.HIGHEST)  # noqa: E731
    out = jax.jit(fn)(q, k, v)
    _, grads = _grad_fn(fn, g)(q, k, v)
    return jax.device_get(out), [jax.device_get(x) for x in grads]


def prepare(name: str, q: Any, k: Any, v: Any, g: Any, ref: tuple[Any, list[Any]]) -> tuple[Any, dict[str, Any]]:
    """One variant compiled and checked, not yet timed: a runner (one call) and its figures:
    XLA temp memory, fmha calls, errors, compile time and program hash."""
    fn, dtype = variant(name)
    args = [x.astype(dtype) for x in (q, k, v)]
    t0 = time.perf_counter()
    compiled = _grad_fn(fn, g).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    calls = _FMHA.findall(hlo)
    out = jax.device_get(jax.jit(fn)(*args))
    _, grads = C.block(compiled(*args))
    mem = C.compiled_memory(compiled) or {}
    info = {
        "temp_bytes": mem.get("temp"),
        "fmha_forward": sum(1 for c in calls if "Backward" not in c),
        "fmha_backward": sum(1 for c in calls if "Backward" in c),
        "out_err": _rel([out], [ref[0]]),
        "grad_err": _rel([jax.device_get(x) for x in grads], ref[1]),
        "grad_finite": bool(all(np.isfinite(np.asarray(x, np.float32)).all() for x in grads)),
        "compile_s": compile_s,
        "program_hash": R.program_hash(hlo),
    }
    return (lambda: compiled(*args)), info


WHAT = {
    "fp32": "float32 written out (einsum, where(causal, s, finfo.min), jax.nn.softmax, einsum)",
    "mpx-bf16": "the MPX recipe: the same code on bfloat16 inputs",
    "amp-bf16-xla": 'amp bf16, attention="xla" (as written)',
    "amp-bf16-fused": "amp bf16 (fused where cuDNN takes it)",
    "cudnn": 'jax.nn.dot_product_attention(..., is_causal=True, implementation="cudnn"), bfloat16',
    "cudnn-from-f32": "the same call on float32 inputs cast to bfloat16, its output cast back (amp's fused by hand)",
}


def _ratio(r: dict[str, Any], base: str) -> str:
    v = r.get("vs", {}).get(base)
    return "-" if not v else f"{v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})"


def render(report: dict[str, Any]) -> str:
    """The markdown report of :func:`main`'s JSON report."""
    s = report["shape"]
    rows = [
        "| variant | what | ms per call, median of rounds (back to back) | spread over rounds: min-max | vs fp32, same "
        "round: median (min-max) | vs MPX bf16, same round | XLA temp | cuDNN fmha calls (fwd / bwd) "
        "| output error vs float32 | gradient error vs float32 | program |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        if "error" in r:
            rows.append(f"| {name} | {WHAT[name]} | failed: {r['error']} | | | | | | | | |")
            continue
        finite = "" if r["grad_finite"] else " (non-finite)"
        t = r.get("step_s")
        timed = f"{r['ms_per_call']:.3f} ms | {t['min'] * 1e3:.3f}-{t['max'] * 1e3:.3f} ms" if t else "not timed | "
        rows.append(
            f"| {name} | {WHAT[name]} | {timed} | {_ratio(r, 'fp32')} | {_ratio(r, 'mpx-bf16')} | "
            f"{C.fmt_bytes(r['temp_bytes'])} | {r['fmha_forward']} / {r['fmha_backward']} | {r['out_err']:.2e} | "
            f"{r['grad_err']:.2e}{finite} | `{r['program_hash'][:12]}` |"
        )
    orders = "; ".join(f"{i + 1}: {', '.join(o)}" for i, o in enumerate(report.get("orders", [])))
    same = R.identical_programs(report["results"])
    return (
        f"## Causal attention, forward + backward ({report['meta']['backend']}: {report['meta']['device']})\n\n"
        f"Command: `{report['command']}`\n\n{C.metadata_markdown(report['meta'])}"
        f"- shape: batch {s['batch']}, {s['seq']} tokens, {s['heads']} heads of {s['head_dim']} "
        f"(q, k, v `[B, T, N, H]`); every variant compiled first, then {report['rounds']} rotated rounds of "
        f"{report['steps']} calls back to back per variant\n"
        f"- wall time: {report['wall_time_s']:.0f} s\n\n"
        "Each variant: `value_and_grad` of `sum(attention(q, k, v) * g)` with respect to q, k and v. "
        "Errors: relative L2 error against float32 at `Precision.HIGHEST` (the gradient: q, k and v "
        "together). "
        + R.METHOD.replace("system", "variant").replace("step", "call")
        + "\n\n"
        + "\n".join(rows)
        + "\n\n"
        f"Round orders: {orders or 'none (not timed)'}.\n"
        f"Identical programs: {'; '.join(' = '.join(g) for g in same) if same else 'none'}.\n"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the micro-benchmark; returns what it writes to the ``.json`` file."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (any backend)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--steps", type=int, default=None, help="calls back to back per turn (default 50; smoke 3)")
    ap.add_argument("--rounds", type=int, default=None, help="rotated rounds (default 5; smoke 3)")
    ap.add_argument("--out-dir", default=None, help="default: benchmarks/results/gpu_measured")
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else (3 if args.smoke else 50)
    rounds = args.rounds if args.rounds is not None else (3 if args.smoke else 5)
    for flag, value in (("--steps", steps), ("--rounds", rounds)):
        if value < 1:
            ap.error(f"{flag}: got {value}; must be an integer >= 1")
    t0 = time.perf_counter()
    shape = SHAPES["smoke" if args.smoke else "gpt2-small"]
    meta = C.metadata()
    out_dir = Path(args.out_dir) if args.out_dir else C.results_dir("gpu_measured")
    out_dir.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0].device_kind
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower() or jax.default_backend()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    stem = out_dir / f"attention-{slug}-{date}{'-smoke' if args.smoke else ''}"
    cmd = " ".join(["python -m benchmarks.gpu_measured.attention", *(argv if argv is not None else sys.argv[1:])])
    report: dict[str, Any] = {"command": cmd, "meta": meta, "shape": shape, "steps": steps, "rounds": rounds}
    report["results"] = {}

    def write() -> None:  # after each step: a run cut short keeps what it measured
        report["wall_time_s"] = time.perf_counter() - t0
        C.write_json(stem.with_suffix(".json"), report)
        stem.with_suffix(".md").write_text(render(report))

    q, k, v, g = inputs(shape)
    ref = reference(q, k, v, g)
    runners = {}
    for name in args.variants:  # every variant compiled (and checked) before any is timed
        try:
            runners[name], report["results"][name] = prepare(name, q, k, v, g, ref)
        except Exception as e:  # noqa: BLE001 - a failing variant is a result
            report["results"][name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        write()
    timing = R.rotated_rounds(runners, rounds=rounds, steps=steps, warmup=2)
    report["orders"] = timing["orders"]
    for name, t in R.summarise(timing).items():
        report["results"][name] |= t | {"ms_per_call": t["step_s"]["median"] * 1e3}
        report["results"][name]["ms_rounds"] = [x * 1e3 for x in t["rounds_s"]]
    write()
    for name, r in report["results"].items():
        print(f"{name}: " + (r.get("error") or f"{r['ms_per_call']:.3f} ms, grad err {r['grad_err']:.2e}"), flush=True)
    print(f"wrote {stem}.md and .json ({report['wall_time_s']:.0f} s)")
    report["paths"] = [str(stem.with_suffix(".md")), str(stem.with_suffix(".json"))]
    return report


if __name__ == "__main__":
    main()
