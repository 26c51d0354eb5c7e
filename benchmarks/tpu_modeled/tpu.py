"""Train steps compiled for a TPU this machine does not have: the ``--target v5e|v6e`` report.

``python -m benchmarks.tpu_modeled.tpu --target v5e`` (in ``.venv-tpu``, which
``bash tests/run_tpu_program.sh`` makes: ``jax[tpu]``, libtpu; with ``JAX_PLATFORMS=cpu`` and
``ALLOW_MULTIPLE_LIBTPU_LOAD=1``). libtpu's topology API describes a one-chip TPU
(``jax.experimental.topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu")``) and
XLA:TPU compiles each step for it with its arguments as ``ShapeDtypeStruct`` s on that chip: what
comes back is the optimised TPU program, its buffer assignment and XLA's cost analysis. Nothing
runs: **compiled for the TPU, not measured**.

The models and systems are the GPU benchmark's (:mod:`benchmarks.models.train_steps`: the same
tasks, :func:`~benchmarks.models.train_steps.build_system`, the step with parameters,
optimizer state and scaler donated), plus ``gpt2-2blocks``: GPT-2 small with 2 blocks instead of
12 (the same 50,257-token vocabulary; issue 48's model whose amp temp was above MPX's). Reported
per step: XLA:TPU's memory analysis (arguments, outputs, aliased, temp, peak = arguments +
outputs + temp - aliased), XLA's cost analysis (FLOPs, bytes accessed) and the census of
:func:`benchmarks.tpu_modeled.census.census` (matmuls and convolutions by operand dtypes, float32
x float32 matmuls outside ``amp_stop``, Pallas/Mosaic kernels).

``--batch N`` compiles every model at batch N instead of its own (the CI guard's reduced size);
``--dump DIR`` keeps XLA's dumps (the optimised HLO, buffer assignment, live ranges at the peak:
:mod:`benchmarks.tpu_modeled.buffers` reads them).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import optax

from benchmarks import _common as C
from benchmarks.gpu_modeled.deviceless import abstract, memory
from benchmarks.models import train_steps as S
from benchmarks.models.gpt2 import GPT, GPT2_SMALL
from benchmarks.tpu_modeled.census import cell, census

TARGETS = {"v5e": "v5e:1x1", "v6e": "v6e:1x1"}
"""``--target`` -> libtpu topology name (one chip)."""
SYSTEMS = ("fp32", "mpx-bf16", "autocast-bf16", "autocast-bf16-xla-loss-head")
"""What the report compiles by default; any :data:`train_steps.SYSTEMS` or ``EXTRA_SYSTEMS`` name is accepted."""
DEFAULT_MODELS = ("gpt2-small", "vit-base", "bert-base", "gpt2-2blocks")
# issue 48's targets on v5e: amp bf16's temp at most this many times MPX's (and never above it)
TEMP_TARGET = {"gpt2-small": 0.5, "vit-base": 0.5, "bert-base": 0.5}
BYTES_TARGET = {"gpt2-small": 0.8}  # bytes accessed against MPX's (with the TPU attention kernel)


def _gpt2_blocks(depth: int) -> Callable[..., S.Task]:
    """GPT-2 small (its vocabulary, sequence and width) with ``depth`` blocks, shapes only."""

    def make(shapes_only: bool = True) -> S.Task:
        cfg = dataclasses.replace(GPT2_SMALL, depth=depth)
        task = S.make_task("gpt2-small", shapes_only=True)
        model = eqx.filter_eval_shape(GPT, cfg, key=jax.random.key(0))
        desc = task.description.replace(f"{GPT2_SMALL.depth} blocks", f"{depth} blocks").split("; ")
        return dataclasses.replace(task, name=f"gpt2-{depth}blocks", description="; ".join(desc[:2]), model=model)

    return make


MODELS: dict[str, Callable[..., S.Task]] = {
    **{m: (lambda m=m: S.make_task(m, shapes_only=True)) for m in ("gpt2-small", "vit-base", "bert-base", "gpt-1b")},
    "gpt2-2blocks": _gpt2_blocks(2),
}
"""The models ``--models`` takes, each a factory of its task (shapes only: nothing is made)."""


def make_task(model: str, batch: int | None = None) -> S.Task:
    """``model`` 's task (:data:`MODELS`), its batch's leading axis set to ``batch`` (None: its own).

    Example::

        task = make_task("gpt2-2blocks", batch=2)  # 2 sequences of 1,024 tokens
    """
    if model not in MODELS:
        raise ValueError(f"model {model!r} unknown; allowed: {sorted(MODELS)}")
    task = MODELS[model]()
    if batch is None:
        return task
    resized = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((batch, *x.shape[1:]), x.dtype), task.batch)
    head, sep, _ = task.description.rpartition("; batch ")
    desc = f"{head}; batch {batch}" if sep else task.description
    return dataclasses.replace(task, batch=resized, description=desc)


def target_sharding(target: str) -> Any:
    """A one-chip ``NamedSharding`` on the deviceless TPU ``target`` (:data:`TARGETS`).

    Raises:
        ValueError: an unknown target.
        RuntimeError: libtpu is missing (``bash tests/run_tpu_program.sh`` makes ``.venv-tpu``).
    """
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    if target not in TARGETS:
        raise ValueError(f"--target {target!r} unknown; allowed: {sorted(TARGETS)}")
    try:
        topo = topologies.get_topology_desc(topology_name=TARGETS[target], platform="tpu")
    except Exception as e:  # noqa: BLE001 - libtpu's absence shows as several exception types
        raise RuntimeError(
            f"--target {target}: cannot compile for a TPU here ({type(e).__name__}: {e}); run in .venv-tpu "
            "(bash tests/run_tpu_program.sh makes it: jax[tpu]) with JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1"
        ) from e
    return NamedSharding(topologies.make_mesh(topo, (1,), ("x",)), PartitionSpec())


def compile_step(task: S.Task, name: str, sharding: Any, dump: Path | None = None) -> Any:
    """System ``name`` 's train step for ``task`` compiled for ``sharding`` 's TPU.

    Parameters, optimizer state and scaler are donated; the step returns them and the loss (as
    :func:`benchmarks.gpu_modeled.deviceless.compile_step`). ``dump``: XLA's dump folder
    (``xla_dump_to``) for this compile.
    """
    params, static = eqx.partition(task.model, S.is_leaf_array)
    opt = optax.adamw(1e-4, weight_decay=1e-4)
    system = S.build_system(name, task, static, opt)
    state = (*system.init(params, opt), system.scaler)
    args = (*abstract(state, sharding), abstract(task.batch, sharding))

    def train_step(*a):  # the module's name in XLA's dumps: jit_train_step
        return system.step(*a)[:4]

    options = {"xla_dump_to": str(dump)} if dump is not None else None
    with system.context():
        return jax.jit(train_step, donate_argnums=(0, 1, 2)).lower(*args).compile(compiler_options=options)


def cost(compiled: Any) -> dict[str, float]:
    """XLA:TPU's cost analysis: ``flops`` and ``bytes_accessed`` of one step."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list | tuple) else ca  # a list of one dict on older JAX
    return {"flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0))}


def analyse(compiled: Any) -> dict[str, Any]:
    """``{"memory": ..., "cost": ..., "census": ...}`` of a compiled step."""
    return {"memory": memory(compiled), "cost": cost(compiled), "census": census(compiled.as_text())}


def compile_system(task: S.Task, name: str, sharding: Any, dump: Path | None = None) -> dict[str, Any]:
    """:func:`analyse` of :func:`compile_step`, with ``compile_s`` (tracing included)."""
    t0 = time.perf_counter()
    info = analyse(compile_step(task, name, sharding, dump))
    info["compile_s"] = round(time.perf_counter() - t0, 1)
    return info


# ----------------------------------------------------------------------------- the report


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def _ratio(r: dict[str, Any], base: dict[str, Any] | None, *keys: str) -> str:
    if base is None or "error" in base:
        return "n/a"
    a, b = r, base
    for k in keys:
        a, b = a[k], b[k]
    return f"{a / b:.2f}"


def _kernels(k: dict[str, Any]) -> str:
    """The Mosaic kernels cell: their count, and by name where there are any."""
    named = k.get("kernels") or {}
    return f"{k['mosaic_kernels']}: {cell(named)}" if named else str(k["mosaic_kernels"])


def table(model: str, results: dict[str, dict[str, Any]]) -> str:
    """One model's systems: memory, cost, census, ratios against fp32 and MPX."""
    rows = [
        f"#### {model}\n",
        "| system | arguments MiB | outputs MiB | aliased MiB | temp MiB | peak MiB | temp vs fp32 | temp vs MPX "
        "| GFLOP | GB accessed | bytes vs fp32 | bytes vs MPX | matmuls by operand dtypes | f32 x f32 matmuls "
        "| convolutions | Mosaic kernels | JAX loops | compile s |",
        "|---|" + "---|" * 17,
    ]
    fp32, mpx = results.get("fp32"), results.get("mpx-bf16")
    for s, r in results.items():
        if "error" in r:
            rows.append(f"| {s} | failed: {r['error']} |" + " |" * 16)
            continue
        m, c, k = r["memory"], r["cost"], r["census"]
        rows.append(
            f"| {s} | {_mib(m['argument'])} | {_mib(m['output'])} | {_mib(m['alias'])} | {_mib(m['temp'])} | "
            f"{_mib(m['peak'])} | {_ratio(r, fp32, 'memory', 'temp')} | {_ratio(r, mpx, 'memory', 'temp')} | "
            f"{c['flops'] / 1e9:,.0f} | {c['bytes_accessed'] / 1e9:,.1f} | "
            f"{_ratio(r, fp32, 'cost', 'bytes_accessed')} | {_ratio(r, mpx, 'cost', 'bytes_accessed')} | "
            f"{cell(k['matmuls'])} | {k['f32_matmuls']} | {cell(k['convolutions'])} | {_kernels(k)} | "
            f"{k['jax_loops']} | {r['compile_s']:.0f} |"
        )
    return "\n".join(rows)


def targets(model: str, results: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """Issue 48's targets for one model (None: a system missing or failed)."""
    amp, mpx = results.get("autocast-bf16"), results.get("mpx-bf16")
    if not amp or not mpx or "error" in amp or "error" in mpx:
        return {}
    t = amp["memory"]["temp"] / mpx["memory"]["temp"]
    b = amp["cost"]["bytes_accessed"] / mpx["cost"]["bytes_accessed"]
    out: dict[str, bool | None] = {"amp temp <= MPX temp": t <= 1.0}
    out["amp temp <= 0.5x MPX"] = t <= TEMP_TARGET[model] if model in TEMP_TARGET else None
    out["amp bytes <= 0.8x MPX"] = b <= BYTES_TARGET[model] if model in BYTES_TARGET else None
    amps = [r for s, r in results.items() if s.startswith("autocast") and "error" not in r]
    out["no f32 x f32 matmul in amp"] = all(r["census"]["f32_matmuls"] == 0 for r in amps)
    return out


NOTE = (
    "**Compiled for the TPU, not measured.** Nothing ran: libtpu compiled each step for a one-chip "
    "topology with no TPU present (deviceless XLA:TPU). Memory: XLA:TPU's buffer assignment with parameters, "
    "optimizer state and scaler donated (aliased to the outputs); peak = arguments + outputs + temp - aliased. "
    "FLOPs and bytes accessed: XLA's cost analysis of the optimised program (a model of HBM traffic, not a "
    "measurement) that counts a loop body once, whatever its trip count: a step with a JAX loop (JAX loops > 0: "
    "amp's loss-head rewrite scans the vocabulary head over token chunks) has its FLOPs and bytes under-counted, "
    "by the loop body times (trips - 1); compare such a step's memory, not its bytes. Matmuls: JAX `dot_general`s, which XLA:TPU writes as convolutions, by the dtypes the MXU "
    "reads; convolutions: JAX `conv_general_dilated`s; Mosaic kernels: Pallas `tpu_custom_call`s, by their "
    "`pallas_call`'s name (splash attention: `splash_mha_fwd*` forward, `splash_mha_dq*`/`splash_mha_dkv*` backward)."
)


def render(report: dict[str, Any]) -> str:
    """The markdown report of a run's JSON report."""
    sections, verdicts = [], []
    for model, entry in report["models"].items():
        sections.append(f"{table(model, entry['results'])}\n\n{entry['description']}")
        if entry.get("targets"):
            verdicts.append((model, entry["targets"]))
    keys = list(dict.fromkeys(k for _, v in verdicts for k in v))
    mark = {True: "met", False: "**not met**", None: "n/a"}
    vtable = "\n".join(
        ["| model | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        + [f"| {m} | " + " | ".join(mark[v.get(k)] for k in keys) + " |" for m, v in verdicts]
    )
    return (
        f"## Train steps compiled for a TPU {report['target']} ({report['topology']}), not measured\n\n"
        f"Command: `{report['command']}`\n\n{C.metadata_markdown(report['meta'])}"
        f"- libtpu {report.get('libtpu')}; wall time: {report['wall_time_s'] / 60:.1f} min\n\n{NOTE}\n\n"
        + (f"Note: {report['notes']}.\n\n" if report.get("notes") else "")
        + (f"### Targets (issue 48)\n\n{vtable}\n\n" if keys else "")
        + "### Per model\n\n"
        + "\n\n".join(sections)
        + "\n"
    )


def _libtpu_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def run(args: argparse.Namespace, cmd: str) -> dict[str, Any]:
    """The report; writes ``tpu-target-<target>[-batch<N>]-<date>.{json,md}`` after each step."""
    t0 = time.perf_counter()
    sharding = target_sharding(args.target)
    report: dict[str, Any] = {
        "command": cmd,
        "meta": C.metadata(),
        "libtpu": _libtpu_version(),
        "target": args.target,
        "topology": TARGETS[args.target],
        "batch": args.batch,
        "models": {},
    }
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    out_dir = Path(args.out_dir) if args.out_dir else C.results_dir("tpu_modeled")
    tag = f"-batch{args.batch}" if args.batch else ""
    if args.unroll_loss_head:
        from autocast._loss_head import _forward

        _forward.UNROLL = True
        report["loss_head_unrolled"] = True
        tag += "-unrolled"
    stem = out_dir / f"tpu-target-{args.target}{tag}-{date}"
    for model in args.models:
        task = make_task(model, args.batch)
        entry = report["models"][model] = {"description": task.description, "results": {}, "targets": {}}
        for name in args.systems:
            dump = Path(args.dump) / f"{model}{tag}-{name}" if args.dump else None
            try:
                res = compile_system(task, name, sharding, dump)
            except Exception as e:  # noqa: BLE001 - a failing system is a result
                res = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            entry["results"][name] = res
            entry["targets"] = targets(model, entry["results"])
            msg = res.get("error") or (
                f"temp {_mib(res['memory']['temp'])} MiB, {res['cost']['bytes_accessed'] / 1e9:.1f} GB accessed, "
                f"matmuls {cell(res['census']['matmuls'])} ({res['compile_s']:.0f} s)"
            )
            print(f"{model} {name}: {msg}", flush=True)
            report["wall_time_s"] = time.perf_counter() - t0
            C.write_json(stem.with_suffix(".json"), report)
            stem.with_suffix(".md").write_text(render(report))
    print(f"wrote {stem}.md and .json ({report['wall_time_s']:.0f} s)")
    return report


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", choices=sorted(TARGETS), default="v5e", help="the TPU (one chip)")
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(DEFAULT_MODELS))
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), help=f"default: {' '.join(SYSTEMS)}")
    ap.add_argument("--batch", type=int, help="every model at this batch size (default: each model's own)")
    ap.add_argument("--out-dir", help="where the report goes (default: benchmarks/results/tpu_modeled)")
    ap.add_argument("--dump", help="keep XLA's dumps of each step under DIR/<model>-<system>/")
    ap.add_argument(
        "--unroll-loss-head",
        action="store_true",
        help="amp's loss-head chunk loops unrolled, so XLA's cost analysis (which counts a loop body once) "
        "counts every chunk; the report's name ends in -unrolled",
    )
    args = ap.parse_args(argv)
    unknown = sorted(set(args.systems) - set(S.SYSTEMS + S.EXTRA_SYSTEMS))
    if unknown:
        ap.error(f"--systems: unknown {unknown}; allowed: {list(S.SYSTEMS + S.EXTRA_SYSTEMS)}")
    if args.batch is not None and args.batch < 1:
        ap.error("--batch must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the report from the command line's arguments (``argv``: ``sys.argv[1:]`` if None)."""
    argv = sys.argv[1:] if argv is None else argv
    return run(_parse(argv), "python -m benchmarks.tpu_modeled.tpu " + shlex.join(argv))


if __name__ == "__main__":
    main()
