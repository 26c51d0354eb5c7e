"""Measure corpus models: the numbers their tolerances come from.

    JAX_PLATFORMS=cpu .venv-corpus/bin/python tests/real_models/measure.py jax_md penzai
    ... measure.py jax_md --float32-scatter-add

(``PYTHONPATH=<a checkout>`` measures another ``autocast``, e.g. a commit's, exported with
its ``policies/`` copied to ``autocast/policies/``.)

For each model of each named test module (``test_<name>.py``'s ``MODELS``), dtype and
batch: the loss, whether it and the gradient are finite where float32's are, the loss's
relative error and the gradient's relative L2 error against float32 (the harness's own
functions, the tests' checks), the matmul census and the residual bytes.

``--float32-scatter-add`` runs ``amp`` with ``scatter-add`` (``jax.ops.segment_sum``) in
float32 instead of the default policy: an estimate of a model's errors once segment sums
no longer accumulate in half precision (issue 42's bug (1)), for models hit by it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import jax  # noqa: E402

import autocast  # noqa: E402
import conftest  # noqa: E402,F401  (XLA's codegen-only flags, Keras' JAX backend)


def _float32_scatter_add(model: harness.Model, dtype: str):
    policy = autocast.extend_policy({jax.lax.scatter_add_p: autocast.use_float32_precision})
    return autocast.amp(model.loss, compute_dtype=harness.DTYPES[dtype], amp_policy=policy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="+", help="test module names without test_ (jax_md, penzai, ...)")
    parser.add_argument("--float32-scatter-add", action="store_true")
    parser.add_argument("--skip-census", action="store_true", help="only losses and errors")
    args = parser.parse_args()
    if args.float32_scatter_add:
        harness.amp_loss = lambda model, dtype, _f=harness.amp_loss: (
            _f(model, dtype) if dtype == "float32" else _float32_scatter_add(model, dtype)
        )
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, autocast from {os.path.dirname(autocast.__file__)}, "
        f"float32 scatter-add: {args.float32_scatter_add}"
    )
    for name in args.modules:
        module = importlib.import_module(f"test_{name}")
        for key, factory in module.MODELS.items():
            start = time.perf_counter()
            model = harness.build(factory)
            print(f"== {name}.{key}: {model.name} (built in {time.perf_counter() - start:.1f} s)")
            for dtype in ("float32", *harness.HALF):
                for batch in harness.BATCHES:
                    t = time.perf_counter()
                    r = harness.run(model, dtype, batch)
                    line = f"{dtype:8} {batch:8} loss {r['loss']:.6g}"
                    if dtype != "float32":
                        ok, bad = harness.finite_where_float32_is(model, dtype, batch)
                        e = harness.errors(model, dtype, batch)
                        tol = model.tol[dtype]
                        line += (
                            f"  finite {ok}  loss err {e['loss']:.2e} (tol {tol.loss})"
                            f"  grad err {e['grad']:.2e} (tol {tol.grad})  worst leaf {e['leaf']:.2e}"
                        )
                        if bad:
                            line += f"  non-finite: {bad[:3]}"
                    print(line + f"  [{time.perf_counter() - t:.1f} s]", flush=True)
            if not args.skip_census:
                f32 = harness.residuals(model, "float32")
                for dtype in harness.HALF:
                    print(
                        f"{dtype:8} matmuls {harness.matmuls(model, dtype)}  residuals {harness.residuals(model, dtype)} B (float32 {f32} B)"
                    )
            print(f"   ({time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
