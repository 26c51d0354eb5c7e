"""Reading jaxprs for `explain` and `find_overflow`: nested bodies, source lines, costs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _compat, _dtypes

MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot_general")

# Parameters that hold the body of a higher-order primitive (reducers, scatter combiners
# and sort comparators are scalar helpers, not bodies).
_BODY_PARAMS = ("jaxpr", "call_jaxpr", "branches", "cond_jaxpr", "body_jaxpr")
_NOT_BODIES = ("reduce", "scatter", "select_and", "sort", "argsort")


# ``call_hi_primitive`` encodings (JAX's upgrade flags) by what they are.
_HI_KINDS = {
    "RematTraced": "checkpoint",
    "CustomJVPTraced": "custom_jvp",
    "CustomVJPTraced": "custom_vjp",
    "Scan3": "scan",
}
_KINDS = {"custom_jvp_call": "custom_jvp", "custom_vjp_call": "custom_vjp", "custom_vjp_call_jaxpr": "custom_vjp"}


def bodies(eqn: Any) -> list[Any]:
    """The jaxprs of a higher-order equation (`jit`, `scan`, `cond`, ..., and the
    `call_hi_primitive` encodings of checkpoint, custom_jvp/vjp and scan), or []."""
    if _compat.hi_prim(eqn) is not None:
        return _compat.hi_bodies(eqn)
    if eqn.primitive.name.startswith(_NOT_BODIES):
        return []
    out = []
    for key in _BODY_PARAMS:
        val = eqn.params.get(key)
        for v in val if type(val) is tuple else (val,):
            if _compat.is_jaxpr_like(v):
                out.append(v)
    return out


def kind(eqn: Any) -> str:
    """What an equation is, the same in both encodings: `checkpoint`, `custom_jvp`,
    `custom_vjp`, `scan`, `jit`, a `HiPrim`'s class name for other
    `call_hi_primitive` equations, else the primitive's name."""
    hi = _compat.hi_name(eqn)
    if hi is not None:
        return _HI_KINDS.get(hi, hi)
    name = eqn.primitive.name
    if name in ("jit", "pjit", "closed_call", "core_call"):
        return "jit"
    if name.startswith("remat") or name == "checkpoint":
        return "checkpoint"
    return _KINDS.get(name, name)


def label(eqn: Any) -> str:
    """How a higher-order equation shows in a nesting path: `jit(gelu)`, `scan(8)`,
    `checkpoint`, `custom_jvp(relu)`, ... (the same in both encodings)."""
    k = kind(eqn)
    if k == "jit":
        return f"jit({eqn.params.get('name', '?')})"
    if k == "scan":
        return f"scan({multiplier(eqn)})"
    if k in ("custom_jvp", "custom_vjp"):
        name = _compat.fun_name(eqn)
        return f"{k}({name})" if name else k
    return k


def multiplier(eqn: Any) -> int:
    """How many times a body runs per evaluation of `eqn` (a scan's length; else 1)."""
    return int(param(eqn, "length", 1)) if kind(eqn) == "scan" else 1


def param(eqn: Any, key: str, default: Any = None) -> Any:
    """A parameter of `eqn` in either encoding (a `call_hi_primitive`'s `HiPrim`
    holds them: a checkpoint's `policy`, a scan's `length`, ...)."""
    if _compat.hi_prim(eqn) is not None:
        return _compat.hi_param(eqn, key, default)
    return eqn.params.get(key, default)


def walk(
    jaxpr: Any, scopes: tuple[str, ...] = (), path: tuple[str, ...] = (), mult: int = 1
) -> Iterator[tuple[Any, tuple[str, ...], tuple[str, ...], int]]:
    """Every first-order equation of `jaxpr` at any depth, with its named scopes, its
    nesting path and how many times it runs (scan bodies: times the length; `while`
    bodies and each `cond` branch: once)."""
    open_, _ = _compat.open_and_consts(jaxpr)
    for eqn in open_.eqns:
        here = scopes + _compat.scope_names(eqn.source_info.name_stack)
        subs = bodies(eqn)
        if subs:
            for sub in subs:
                yield from walk(sub, here, (*path, label(eqn)), mult * multiplier(eqn))
        else:
            yield eqn, here, path, mult


def source(source_info: Any) -> str:
    """`"path/to/file.py:LINE"` of the innermost user frame (relative to the working
    directory when inside it), or `"?"`."""
    frame = _compat.user_frame(source_info)
    if frame is None:
        return "?"
    file, line = frame
    try:
        rel = os.path.relpath(file)
        if not rel.startswith(".."):
            file = rel
    except ValueError:  # another drive (Windows)
        pass
    return f"{file}:{line}"


def nbytes(aval: Any) -> int:
    try:
        return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
        return 0


def flops(eqn: Any) -> int:
    """Multiply-add FLOPs (2 per MAC) of a `dot_general` or `conv_general_dilated`."""
    out = eqn.outvars[0].aval
    n_out = int(np.prod(out.shape, dtype=np.int64))
    if eqn.primitive.name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2 * n_out * int(np.prod([lhs[d] for d in lhs_contract], dtype=np.int64))
    if eqn.primitive.name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        rhs_spec = eqn.params["dimension_numbers"].rhs_spec
        return 2 * n_out * int(np.prod(rhs, dtype=np.int64)) // max(1, int(rhs[rhs_spec[0]]))
    return 0


def dtype_name(dtype: Any) -> str:
    short = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64", "int32": "i32", "bool": "bool"}
    name = str(getattr(dtype, "name", dtype))
    return short.get(name, name)


def is_half(dtype: Any) -> bool:
    return _dtypes.is_castable(dtype) and np.dtype(dtype) != _dtypes.FLOAT32
