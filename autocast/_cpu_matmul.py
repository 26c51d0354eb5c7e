"""Half x half -> float32 matmuls on XLA:CPU: a process-wide override of two CPU lowerings.

**What it changes.** At import, `autocast` wraps JAX's CPU lowering rules of
`dot_general` and `conv_general_dilated` (`mlir.register_lowering(..., platform="cpu")`
around the rule JAX registered). The wrapper changes only matmuls whose two operands share
one half dtype (`bfloat16` or `float16`) and whose result is `float32`, and only for a
dtype whose XLA:CPU probe failed (`_cpu_has_float32_result`): it converts their operands
to float32 in the lowered program. Every other lowering, every other platform, and programs
that hold no such matmul are untouched. It is process-wide because JAX's lowering tables are;
it affects code outside `autocast.amp` only if that code writes such a matmul itself,
and then it turns a runtime failure into the same products computed in float32.

**Why.** XLA:CPU (jaxlib 0.9.2 through 0.12.0.1 at least) rewrites most bfloat16 matmuls to
float32 ones, but not one whose transpose is folded into it after that rewrite: its runtime
then fails with `Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32`. GPUs
run these matmuls natively (cuBLASLt, Triton), and amp writes them on purpose (a matmul read
only in float32 stores a float32 result, `autocast._wide`; the weight gradient of a
parameter, `autocast._tangent_product`). So the jaxpr always holds the plain half x half
-> float32 matmul, and only its *lowering for CPU* widens the operands first: the same
products (exact in float32) and the same float32 accumulation as XLA:CPU's own rewrite. The
decision is the lowering platform's, never the host's: a program compiled for a GPU from a
CPU process (AOT, `jit(backend=)`, a mesh of GPU devices) keeps its half-precision GEMMs.

**How.** Lowering never compiles, so the answer is probed before: `prepare` (called by
amp wherever it binds a matmul) runs the failing pattern once per dtype on the CPU backend
and records the answer, which the lowering rule reads. Where JAX lacks the internals the
override needs, `WIDEN_AT_LOWERING` is False and `prepare` widens at trace time
instead, for a CPU default backend. `docs/internals.md` describes it too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _compat

_MATMULS = frozenset({"dot_general", "conv_general_dilated"})
_CPU_PROBES: dict[str, bool] = {}
_PROBING: list[bool] = []


def _half_f32_dtype(invals: Sequence[Any], preferred: Any) -> str | None:
    """The half dtype of a two-operand matmul of one half dtype with a float32 result."""
    if preferred is None or str(np.dtype(preferred)) != "float32" or len(invals) != 2:
        return None
    names = {str(getattr(x, "dtype", "")) for x in invals}
    if len(names) != 1 or names.isdisjoint({"bfloat16", "float16"}):
        return None
    return names.pop()


def prepare(prim: Any, invals: Sequence[Any], preferred: Any) -> Sequence[Any]:
    """The operands with which to bind `prim`: unchanged, after probing XLA:CPU once per
    dtype for a half x half -> float32 `prim` (its CPU lowering reads the answer); widened
    to float32 here only where the lowering rule could not be registered and the default
    backend is CPU."""
    name = _half_f32_dtype(invals, preferred) if getattr(prim, "name", prim) in _MATMULS else None
    if name is None:
        return invals
    if name not in _CPU_PROBES:
        _CPU_PROBES[name] = _cpu_has_float32_result(name)
    if WIDEN_AT_LOWERING or _CPU_PROBES[name] or jax.default_backend() != "cpu":
        return invals
    return [jax.lax.convert_element_type(x, "float32") for x in invals]


def _cpu_has_float32_result(dtype_name: str) -> bool:
    """Whether XLA:CPU runs a `dtype` x `dtype` -> float32 matmul in every layout:
    probed with exactly the failing pattern (a matmul read through a transpose), never by
    version. False (widen: always correct) where there is no CPU backend to ask."""

    def probe(a, b):
        h = jax.numpy.maximum(a, 0).astype(dtype_name)
        out = jax.lax.dot_general(b.astype(dtype_name), h, (((1,), (0,)), ((), ())), preferred_element_type="float32")
        return out.T

    _PROBING.append(True)  # the lowering rule leaves the probe's matmul alone
    try:
        device = jax.devices("cpu")[0]
        with jax.ensure_compile_time_eval():
            a = jax.device_put(np.ones((8, 4), np.float32), device)
            b = jax.device_put(np.ones((2, 8), np.float32), device)
            out = np.asarray(jax.jit(probe)(a, b))
        return bool(np.all(out == 8.0))
    except Exception:  # XlaRuntimeError (UNIMPLEMENTED), or no CPU backend
        return False
    finally:
        _PROBING.pop()


def _widening_cpu_lowering(previous: Callable) -> Callable:
    def rule(ctx: Any, *args: Any, **params: Any) -> Any:
        out = ctx.avals_out[0].dtype if len(ctx.avals_out) == 1 else None
        name = _half_f32_dtype(ctx.avals_in, out)
        if name is not None and _CPU_PROBES.get(name) is False and not _PROBING:
            wide = [_compat.aval_with_dtype(a, np.dtype("float32")) for a in ctx.avals_in]
            args = tuple(_compat.convert_hlo(ctx, x, a, w) for x, a, w in zip(args, ctx.avals_in, wide))
            ctx = ctx.replace(avals_in=wide)
        return previous(ctx, *args, **params)

    return rule


def _register() -> bool:
    rules = {p: _compat.lowering_rule(p, "cpu") for p in (jax.lax.dot_general_p, jax.lax.conv_general_dilated_p)}
    if any(r is None for r in rules.values()):
        return False  # a JAX without these internals
    for prim, (rule, inline) in rules.items():  # type: ignore[misc]
        _compat.register_lowering(prim, _widening_cpu_lowering(rule), platform="cpu", inline=inline)
    return True


WIDEN_AT_LOWERING = _register()
"""Whether half x half -> float32 matmuls are widened by their CPU lowering (see above)."""


def bind(prim: Any, invals: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    """`autocast._compat.bind`, with the operands of a half x half -> float32 matmul
    prepared for its CPU lowering (`prepare`). The interpreter binds every equation a
    rule ruled on through this (any of them may be such a matmul)."""
    return _compat.bind(prim, prepare(prim, invals, params.get("preferred_element_type")), params)
