"""The corpus's jraph.GraphNetwork over many parameter draws: is a change in its gradient
error (the results table measures one draw) the rule's doing or the draw's?

The model and batch of ``tests/real_models/test_jraph.py`` (two rounds of message passing,
``segment_sum`` aggregations, a graph-level regression), its parameters initialised with
keys ``0 .. --seeds - 1``; for each draw the whole gradient's relative L2 error against
float32 under ``amp`` with the shipped policy (``scatter-add`` in float32, issue 42) and with
``scatter-add`` in the precision its operands arrive in (the policy before it). Runs in the
corpus virtualenv::

    bash tests/run_corpus.sh --co -q   # makes .venv-corpus once
    .venv-corpus/bin/python -m benchmarks.corpus.graph_network_seeds

Writes ``benchmarks/results/corpus/graph-network-seeds.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "real_models"))
import conftest  # isort: skip  # noqa: E402, F401  (XLA_FLAGS before JAX starts)
import haiku as hk  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import test_jraph  # noqa: E402

import autocast  # noqa: E402
from benchmarks._common import metadata, metadata_markdown, results_dir, write_json  # noqa: E402

POLICIES = {
    "shipped": None,
    "scatter-add as it arrives": autocast.extend_policy({jax.lax.scatter_add_p: autocast.use_input_precision}),
}


def _error(grads, ref) -> float:
    a, b = jax.tree.leaves(grads), jax.tree.leaves(ref)
    diff = sum(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2) for x, y in zip(a, b))
    return float(np.sqrt(diff / sum(np.sum(np.asarray(y, np.float64) ** 2) for y in b)))


def measure(seeds: int) -> dict:
    model = test_jraph.graph_network()  # the corpus model: its loss and padded batch
    loss, batch = model.loss, model.batches["padded"]
    init = hk.transform(test_jraph._graph_network).init  # the same parameters' structure, any key
    reference = jax.jit(jax.grad(loss))
    runs = {
        (dtype, name): jax.jit(jax.grad(autocast.amp(loss, compute_dtype=dtype, amp_policy=policy)))
        for dtype in ("float16", "bfloat16")
        for name, policy in POLICIES.items()
    }
    errors: dict[str, dict[str, list[float]]] = {d: {n: [] for n in POLICIES} for d in ("float16", "bfloat16")}
    for seed in range(seeds):
        params = init(jax.random.key(seed), batch["graph"])
        ref = reference(params, batch)
        for (dtype, name), grad in runs.items():
            errors[dtype][name].append(_error(grad(params, batch), ref))
    return errors


def render(errors: dict, meta: dict, command: str, seconds: float) -> str:
    lines = [
        "## jraph.GraphNetwork: gradient error over parameter draws\n",
        f"Command: `{command}`\n",
        metadata_markdown(meta),
        f"- wall time: {seconds:.0f} s\n",
        "The corpus model `jraph.GraphNetwork` (tests/real_models/test_jraph.py, padded batch), its "
        "parameters drawn with keys 0..N-1; each cell the whole gradient's relative L2 error against "
        "float32. *shipped*: `amp` as released (`scatter-add` in float32); *scatter-add as it "
        "arrives*: the policy before issue 42. The results table (corpus/real-models.md) measures "
        "draw 0 only.\n",
        "| dtype | policy | median | mean | max | per draw |",
        "|---|---|---|---|---|---|",
    ]
    for dtype, by_policy in errors.items():
        for name, errs in by_policy.items():
            per = " ".join(f"{e:.4f}" for e in errs)
            lines.append(
                f"| {dtype} | {name} | {np.median(errs):.4f} | {np.mean(errs):.4f} | {np.max(errs):.4f} | {per} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=12, help="parameter draws (keys 0..N-1)")
    ap.add_argument("--out", default="graph-network-seeds", help="file stem in results/corpus/")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    errors = measure(args.seeds)
    seconds = time.perf_counter() - start
    meta = metadata()
    command = "python -m benchmarks.corpus.graph_network_seeds" + (f" --seeds {args.seeds}" if args.seeds != 12 else "")
    out = results_dir("corpus") / args.out
    write_json(out.with_suffix(".json"), {"command": command, "meta": meta, "seconds": seconds, "errors": errors})
    text = render(errors, meta, command, seconds)
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
