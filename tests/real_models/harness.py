"""The harness of the real-model corpus (tests/real_models/, benchmarks/corpus/real_models.py).

A ``Model`` is a third-party model as its package's documentation builds it: parameters
from the library's own init, a padded and an unpadded random batch, and a scalar
``loss(params, batch)``. ``measure(model, dtype, batch)`` runs
``jax.jit(jax.value_and_grad(autocast.amp(loss, compute_dtype=dtype)))`` (float32: the
plain function) and records what the tests assert and the results table shows:

- the loss and the gradient, and where they are finite;
- their error against float32 (loss: relative error; gradient: relative L2 error of all
  leaves together, and the largest per-leaf one);
- the matmuls and convolutions (``dot_general``, ``conv_general_dilated``) of the forward
  and backward jaxpr, searched recursively through every body, by operand dtype and
  whether they sit inside ``amp_stop``;
- the bytes of the residuals ``jax.vjp`` saves for the backward pass;
- the rendered ``autocast.explain`` table.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import autocast
from autocast import _compat

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers import COMPUTE_PRIMS, operand_dtypes, walk  # noqa: E402

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
HALF = ("float16", "bfloat16")
BATCHES = ("padded", "unpadded")


@dataclasses.dataclass(frozen=True)
class Tol:
    """Tolerances against float32 (the same parameters and batch), set from measurement
    with margin: ``loss`` the loss's relative error, ``grad`` the relative L2 error of the
    whole gradient (all leaves together)."""

    loss: float
    grad: float


@dataclasses.dataclass(eq=False)
class Model:
    """One corpus model. ``batches`` maps "padded" / "unpadded" to a batch (a model
    without padding has the same batch under both names); ``tol`` is by half dtype name.

    ``min_half_fraction``: the fraction of the matmuls and convolutions of the forward and
    backward jaxpr that must have half-precision operands (1.0: all outside ``amp_stop``).
    A model below 1.0 is a finding, documented in docs/real-models.md.
    """

    name: str
    package: str  # the distribution that ships it ("gemma"), for the table
    params: Any
    batches: dict[str, Any]
    loss: Callable[[Any, Any], jax.Array]
    tol: dict[str, Tol]
    min_half_fraction: float = 1.0
    # why amp's residuals may equal float32's (then only amp <= float32 is checked)
    residuals_not_smaller: str = ""


@functools.cache
def build(factory: Callable[[], Model]) -> Model:
    """``factory()``, once per process (its tests and the table share the measurements)."""
    return factory()


def amp_loss(model: Model, dtype: str) -> Callable:
    if dtype == "float32":
        return model.loss
    return autocast.amp(model.loss, compute_dtype=DTYPES[dtype])


def census(fn: Callable, *args: Any) -> dict[str, int]:
    """Matmuls/convolutions of ``make_jaxpr(fn)(*args)`` at any depth: how many have
    half-precision operands, how many a float32 one (outside / inside ``amp_stop``)."""
    counts = {"half": 0, "float32": 0, "float32_in_stop": 0, "total": 0}
    for eqn, scopes in walk(jax.make_jaxpr(fn)(*args)):
        if eqn.primitive.name not in COMPUTE_PRIMS:
            continue
        counts["total"] += 1
        dts = operand_dtypes(eqn)
        if "float32" in dts:
            counts["float32_in_stop" if "amp_stop" in scopes else "float32"] += 1
        elif set(dts) & {"float16", "bfloat16"}:
            counts["half"] += 1
    return counts


def residual_bytes(fn: Callable, *args: Any) -> int:
    """Bytes of the residuals ``jax.vjp(fn, *args)`` saves for the backward pass."""
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, _ in _compat.saved_residuals(fn, *args))


def _leaves(tree: Any) -> list[np.ndarray]:
    return [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(tree)]


@functools.cache
def train_step(model: Model, dtype: str) -> Callable:
    """``jit(value_and_grad(amp(loss)))``, one per model and dtype: the padded and the
    unpadded batch have the same shapes, so they share one compilation."""
    return jax.jit(jax.value_and_grad(amp_loss(model, dtype)))  # XLA_FLAGS: tests/real_models/conftest.py


@functools.cache
def run(model: Model, dtype: str, batch: str) -> dict[str, Any]:
    """Loss and gradient of one model, dtype and batch, under jit."""
    start = time.perf_counter()
    loss, grads = train_step(model, dtype)(model.params, model.batches[batch])
    loss = float(loss)
    grads = _leaves(grads)
    return dict(loss=loss, grads=grads, seconds=time.perf_counter() - start)


def finite_where_float32_is(model: Model, dtype: str, batch: str) -> tuple[bool, list[str]]:
    """Whether the loss and every gradient element are finite wherever float32's are;
    the offending leaves' paths otherwise."""
    m, ref = run(model, dtype, batch), run(model, "float32", batch)
    bad = []
    if np.isfinite(ref["loss"]) and not np.isfinite(m["loss"]):
        bad.append(f"loss = {m['loss']}")
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(model.params)]
    for path, g, r in zip(paths, m["grads"], ref["grads"]):
        n = int(np.sum(np.isfinite(r) & ~np.isfinite(g)))
        if n:
            bad.append(f"{path}: {n} of {g.size} non-finite")
    return not bad, bad


def errors(model: Model, dtype: str, batch: str) -> dict[str, float]:
    """Loss relative error and the gradient's global relative L2 error against float32,
    and the largest relative L2 error of a leaf holding at least 1e-3 of the norm."""
    m, ref = run(model, dtype, batch), run(model, "float32", batch)
    a, b = m["grads"], ref["grads"]
    total = float(np.sqrt(sum(np.sum(y.astype(np.float64) ** 2) for y in b)))
    diff = float(np.sqrt(sum(np.sum((x.astype(np.float64) - y) ** 2) for x, y in zip(a, b))))
    leaf = [float(np.linalg.norm(x - y) / np.linalg.norm(y)) for x, y in zip(a, b) if np.linalg.norm(y) >= 1e-3 * total]
    return dict(
        loss=abs(m["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30),
        grad=diff / max(total, 1e-30),
        leaf=max(leaf, default=0.0),
    )


@functools.cache
def matmuls(model: Model, dtype: str) -> dict[str, int]:
    """The matmul census of the forward and backward pass (the padded batch)."""
    return census(jax.value_and_grad(amp_loss(model, dtype)), model.params, model.batches["padded"])


@functools.cache
def residuals(model: Model, dtype: str) -> int:
    batch = model.batches["padded"]
    return residual_bytes(lambda p: amp_loss(model, dtype)(p, batch), model.params)


@functools.cache
def explanation(model: Model, dtype: str) -> str:
    return str(autocast.explain(model.loss, compute_dtype=DTYPES[dtype])(model.params, model.batches["padded"]))


# --- the checks, shared by every test file ---------------------------------------------


def check_finite(model: Model, dtype: str, batch: str) -> None:
    ok, bad = finite_where_float32_is(model, dtype, batch)
    assert ok, f"{model.name}/{dtype}/{batch}: not finite where float32 is: {bad[:8]}"


def check_close(model: Model, dtype: str, batch: str) -> None:
    tol = model.tol[dtype]
    err = errors(model, dtype, batch)
    name = f"{model.name}/{dtype}/{batch}"
    assert err["loss"] < tol.loss, f"{name}: loss rel. error {err['loss']:.2e} >= {tol.loss}"
    assert err["grad"] < tol.grad, f"{name}: gradient rel. L2 error {err['grad']:.2e} >= {tol.grad}"


def check_matmuls_half(model: Model, dtype: str) -> None:
    ref = matmuls(model, "float32")
    c = matmuls(model, dtype)
    assert ref["total"] > 0 and ref["half"] == 0, ref
    assert c["half"] >= model.min_half_fraction * c["total"], f"{model.name}/{dtype}: {c}"
    if model.min_half_fraction == 1.0:
        assert c["float32"] == 0, f"{model.name}/{dtype}: float32 matmuls outside amp_stop: {c}"


def check_residuals_smaller(model: Model, dtype: str) -> None:
    amp, f32 = residuals(model, dtype), residuals(model, "float32")
    if model.residuals_not_smaller:
        assert amp <= f32, f"{model.name}/{dtype}: residuals {amp} bytes under amp, {f32} in float32"
    else:
        assert amp < f32, f"{model.name}/{dtype}: residuals {amp} bytes under amp, {f32} in float32"


def check_explain(model: Model, dtype: str) -> None:
    text = explanation(model, dtype)
    assert "dot_general" in text or "conv_general_dilated" in text, text[:2000]


def run_all_checks(model: Model, dtype: str, check: str) -> None:
    """One named check (the tests parametrise over these)."""
    if check.startswith("finite-"):
        check_finite(model, dtype, check.removeprefix("finite-"))
    elif check.startswith("close-"):
        check_close(model, dtype, check.removeprefix("close-"))
    elif check == "matmuls-half":
        check_matmuls_half(model, dtype)
    elif check == "residuals":
        check_residuals_smaller(model, dtype)
    elif check == "explain":
        check_explain(model, dtype)
    else:
        raise ValueError(check)


CHECKS = ("finite-padded", "finite-unpadded", "close-padded", "close-unpadded", "matmuls-half", "residuals", "explain")


def summary(model: Model, dtype: str) -> dict[str, Any]:
    """One row of the results table (benchmarks/corpus/real_models.py)."""
    row: dict[str, Any] = dict(model=model.name, package=model.package, dtype=dtype)
    try:
        fin = {b: finite_where_float32_is(model, dtype, b)[0] for b in BATCHES}
        err = {b: errors(model, dtype, b) for b in BATCHES}
        c = matmuls(model, dtype)
        row.update(
            runs=True,
            loss=run(model, dtype, "padded")["loss"],
            loss_err=max(e["loss"] for e in err.values()),
            grad_err=max(e["grad"] for e in err.values()),
            half_matmuls=c["half"],
            matmuls=c["total"],
            float32_matmuls_outside_stop=c["float32"],
            residual_bytes=residuals(model, dtype),
            residual_bytes_float32=residuals(model, "float32"),
            finite_padded=fin["padded"],
            finite_unpadded=fin["unpadded"],
            explain_ok=bool(explanation(model, dtype)),
        )
    except Exception as e:  # a row that does not run is a result too
        row.update(runs=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    return row
