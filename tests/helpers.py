"""Helpers shared by the tests: walking jaxprs recursively and reading operand dtypes."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import pytest

import autocast
from autocast import _compat, _walk

COMPUTE_PRIMS = ("dot_general", "conv_general_dilated")


def _scopes(eqn: Any) -> tuple[str, ...]:
    return tuple(e.name for e in eqn.source_info.name_stack.stack if type(e).__name__ == "Scope")


def walk(jaxpr: Any, scopes: tuple[str, ...] = ()) -> Iterator[tuple[Any, tuple[str, ...]]]:
    """Every equation of ``jaxpr`` and of all its bodies (``autocast._walk.bodies``: jit,
    scan, cond, while, checkpoint, custom_jvp/vjp, shard_map, in either encoding: the
    classic primitives or JAX's ``call_hi_primitive``), with the accumulated scopes."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        here = scopes + _scopes(eqn)
        yield eqn, here
        for sub in _walk.bodies(eqn):
            yield from walk(sub, here)


def kind(eqn: Any) -> str:
    """What ``eqn`` is in either encoding: ``checkpoint``, ``custom_jvp``, ``custom_vjp``,
    ``scan``, ``jit``, ... (``autocast._walk.kind``); else the primitive's name."""
    return _walk.kind(eqn)


def label(eqn: Any) -> str:
    """How ``eqn`` shows in explain's nesting paths, in either encoding: ``checkpoint``,
    ``custom_jvp(relu)``, ``scan(8)``, ``jit(f)`` (``autocast._walk.label``)."""
    return _walk.label(eqn)


def of_kind(jaxpr: Any, *kinds: str) -> list[Any]:
    """The equations of ``jaxpr`` (any depth) that are one of ``kinds``."""
    return [e for e, _ in walk(jaxpr) if _walk.kind(e) in kinds]


def param(eqn: Any, key: str, default: Any = None) -> Any:
    """A parameter of ``eqn`` in either encoding (``autocast._walk.param``)."""
    return _walk.param(eqn, key, default)


def bodies(eqn: Any) -> list[Any]:
    """The jaxprs ``eqn`` holds (its body, its branches, ...), in either encoding."""
    return _walk.bodies(eqn)


def dots_in(jaxpr: Any) -> list[tuple[str, ...]]:
    """The operand dtypes of every matmul/convolution in ``jaxpr`` at any depth."""
    return [operand_dtypes(e) for e, _ in walk(jaxpr) if e.primitive.name in COMPUTE_PRIMS]


def activation_jvps(jaxpr: Any, kind: str = "custom_jvp") -> list[Any]:
    """The ``custom_jvp`` (or ``kind``) equations, either encoding, any depth, whose body
    computes no matmul: an activation's (``relu``, ...), not the ``custom_jvp`` around a
    matmul that gives it a float32 weight cotangent, nor amp's saturating conversion of a
    fill (``autocast._dtypes.saturating_cast``)."""
    return [
        e
        for e in of_kind(jaxpr, kind)
        if not any(i.primitive.name in COMPUTE_PRIMS for b in _walk.bodies(e) for i, _ in walk(b))
        and {i.primitive.name for b in _walk.bodies(e) for i, _ in walk(b)} != _SATURATION
    ]


_SATURATION = {"clamp", "is_finite", "select_n", "convert_element_type"}


def flag_on(*names: str) -> bool:
    """Whether all of JAX's upgrade flags ``jax_<name>`` are on (``remat3``, ``custom_jvp3``,
    ``custom_vjp3``, ``scan3``, ``softmax_custom_jvp``; False where JAX lacks one)."""
    return all(_compat.flag_on(n) for n in names)


def xfail_if_flag(*names: str, reason: str) -> Any:
    """A strict xfail that applies only while the upgrade flags ``names`` are on (the CI
    lane ``nextjax``); ``reason`` names the upstream behaviour."""
    return pytest.mark.xfail(flag_on(*names), strict=True, reason=reason)


def operand_dtypes(eqn: Any) -> tuple[str, ...]:
    """The dtypes of ``eqn``'s operands."""
    return tuple(str(v.aval.dtype) for v in eqn.invars)


def compute_op_dtypes(fn, *args, **kwargs) -> collections.Counter:
    """Count matmuls/convolutions in ``make_jaxpr(fn)`` by (primitive, lhs dtype, in amp_stop)."""
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    counts: collections.Counter = collections.Counter()
    for eqn, scopes in walk(closed):
        if eqn.primitive.name in COMPUTE_PRIMS:
            counts[(eqn.primitive.name, operand_dtypes(eqn)[0], "amp_stop" in scopes)] += 1
    return counts


def float32_compute_ops_outside_stop(fn, *args, **kwargs) -> int:
    """How many matmuls/convolutions outside ``amp_stop`` have a float32 operand."""
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    n = 0
    for eqn, scopes in walk(closed):
        if eqn.primitive.name in COMPUTE_PRIMS and "amp_stop" not in scopes:
            if any(d == "float32" for d in operand_dtypes(eqn)):
                n += 1
    return n


def tree_max_rel_err(a: Any, b: Any) -> float:
    """max over leaves of ||a - b|| / (||b|| + tiny), in float32."""
    errs = []
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x = np.asarray(x, np.float32)
        y = np.asarray(y, np.float32)
        errs.append(float(np.linalg.norm(x - y) / (np.linalg.norm(y) + 1e-12)))
    return max(errs) if errs else 0.0


def fp8_every_matmul() -> Any:
    """The shipped float8 policy without its cost check (``use_float8(target=None)``): every
    weight matmul of at least 16 in float8. The tests' matmuls are far too small for float8
    to pay on a GPU; they test float8's numerics and program (the check: test_fp8_filter.py)."""
    return autocast.extend_policy(
        {jax.lax.dot_general_p: autocast.use_float8(target=None)}, base=autocast.load_policy("fp8")
    )


def require_libtpu() -> None:
    """Skip (outside the TPU lane) or fail (inside it, ``AUTOCAST_TPU_LANE=1``) where libtpu
    is not installed: the deviceless TPU compiles of tests/run_tpu_program.sh."""
    import importlib.util
    import os

    if importlib.util.find_spec("libtpu") is not None:
        return
    if os.environ.get("AUTOCAST_TPU_LANE") == "1":
        pytest.fail("libtpu is not installed in the TPU lane's virtualenv (tests/run_tpu_program.sh installs it)")
    pytest.skip("libtpu not installed: bash tests/run_tpu_program.sh runs the TPU compiles")
