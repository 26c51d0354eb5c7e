"""The real-model corpus's results table: every model of tests/real_models/ in float32,
float16 and bfloat16, measured with the tests' own harness (tests/real_models/harness.py).

Run it with ``bash benchmarks/corpus/run_real_models.sh``: the corpus needs two virtualenvs
(tests/run_corpus.sh explains why), so each writes its part
(``python -m benchmarks.corpus.real_models --files ... --part NAME``) and the last call
(``--render``) joins the parts into benchmarks/results/corpus/real-models.md and .json.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "real_models"
sys.path.insert(0, str(CORPUS))
import conftest  # noqa: E402, F401  (XLA_FLAGS and KERAS_BACKEND before JAX starts)
from benchmarks._common import metadata, results_dir  # noqa: E402

COLUMNS = (
    "model",
    "package",
    "dtype",
    "runs",
    "loss err",
    "grad err",
    "half matmuls / total",
    "residuals amp / f32",
    "padded finite",
    "unpadded finite",
)


def measure_file(name: str) -> list[dict[str, Any]]:
    import harness

    module = importlib.import_module(name)
    rows = []
    for key, factory in module.MODELS.items():
        start = time.perf_counter()
        try:
            model = harness.build(factory)
        except Exception as e:  # a model that cannot be built is a row too
            rows.append(dict(model=f"{name}:{key}", package="?", dtype="-", runs=False, error=repr(e)[:300]))
            continue
        version = importlib.metadata.version(model.package)
        for dtype in ("float32", "float16", "bfloat16"):
            row = harness.summary(model, dtype)
            row["package"] = f"{model.package} {version}"
            rows.append(row)
        print(f"{model.name}: {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def _fmt(row: dict[str, Any]) -> list[str]:
    if not row.get("runs"):
        return [row["model"], row["package"], row["dtype"], f"no: {row.get('error', '')}"] + [""] * 6
    f32 = row["dtype"] == "float32"
    res = "1 (reference)" if f32 else f"{row['residual_bytes'] / row['residual_bytes_float32']:.2f}"
    return [
        row["model"],
        row["package"],
        row["dtype"],
        "yes",
        "-" if f32 else f"{row['loss_err']:.1e}",
        "-" if f32 else f"{row['grad_err']:.1e}",
        f"{row['half_matmuls']} / {row['matmuls']}",
        res + f" ({row['residual_bytes'] / 2**10:.0f} KiB)",
        "yes" if row["finite_padded"] else "**no**",
        "yes" if row["finite_unpadded"] else "**no**",
    ]


def render(parts: list[Path], command: str) -> None:
    data = [json.loads(p.read_text()) for p in parts]
    rows = [r for d in data for r in d["rows"]]
    lines = [
        "# Real-model corpus under amp",
        "",
        f"Command: `{command}`. Each row: `jax.jit(jax.value_and_grad(amp(loss, compute_dtype)))` of a",
        "third-party model (tests/real_models/, docs/real-models.md), float32 parameters from the",
        "library's init, random data. Errors against float32 on the same parameters and batch, the",
        "larger of the padded and the unpadded batch: `loss err` relative, `grad err` the relative L2",
        "error of the whole gradient. `half matmuls`: the forward and backward jaxpr's `dot_general`",
        "and `conv_general_dilated` (all bodies) with half-precision operands. `residuals`: bytes",
        "`jax.vjp` saves, padded batch. `finite`: loss and every gradient element finite wherever",
        "float32's are.",
        "",
    ]
    for d in data:
        m = d["meta"]
        vers = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
        lines += [
            f"- part `{d['part']}` ({', '.join(d['files'])}): {m['date']}; {m['machine']} ({m['os']}); "
            f"backend {m['backend']}; python {m['python']}; {vers}; repo commit {m.get('git_commit')}; "
            f"{d['seconds']:.0f} s",
        ]
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r)) + " |" for r in rows]
    out = results_dir("corpus")
    (out / "real-models.md").write_text("\n".join(lines) + "\n")
    (out / "real-models.json").write_text(json.dumps(dict(command=command, parts=data), indent=1) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--files", nargs="*", default=[], help="test modules of tests/real_models (test_gemma ...)")
    ap.add_argument("--part", help="name of this part's JSON (written to --out-dir)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / ".cache" / "real-models")
    ap.add_argument("--render", nargs="*", type=Path, help="join these part JSONs into the table")
    ap.add_argument("--command", default="bash benchmarks/corpus/run_real_models.sh")
    args = ap.parse_args()
    if args.render is not None:
        render(args.render, args.command)
        return
    start = time.perf_counter()
    rows = [r for f in args.files for r in measure_file(f)]
    meta = metadata()
    meta["versions"].update({p: _version(p) for p in ("flax", "keras", "keras-hub", "gemma", "diffrax", "dm-haiku")})
    meta["versions"].update({p: _version(p) for p in ("jraph", "recurrentgemma", "equimo", "numpyro")})
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = dict(part=args.part, files=args.files, meta=meta, rows=rows, seconds=time.perf_counter() - start)
    (args.out_dir / f"{args.part}.json").write_text(json.dumps(out, indent=1, default=str) + "\n")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
