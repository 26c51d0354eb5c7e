"""Every JAX-internals touch point of autocast, in one place.

The interpreter reads jaxprs, binds primitives and re-traces sub-jaxprs; those steps use
a handful of names that JAX does not promise to keep stable. They all live here, feature
detected (never by comparing version strings), each branch commented with the release it
serves, so that a JAX upgrade is one file's work. The suite runs on the oldest supported
JAX (0.9.2, Python 3.11) and the newest (0.12, Python 3.13) via ``tests/run_tests.sh``.

What changed across the supported range, and where it is handled:

- JAX 0.9.2: ``Primitive.get_bind_params`` returns a dict (a pair before): :func:`bind`.
- JAX 0.10: ``DropVar`` in ``jax.extend.core``.
- JAX 0.11: ``ClosedJaxpr`` merged into ``Jaxpr``: :func:`is_closed`, :func:`close_jaxpr`.
- JAX 0.12: the constants of a traced jaxpr are its leading invars (``constvars`` are only
  those with values attached): :func:`bind_inputs` (also for the jaxprs that
  custom-derivative thunks return), :func:`close_jaxpr`; ``scan`` describes its operand
  groups with a ``FlatTree`` ``ft_in`` instead of ``num_consts``/``num_carry``:
  :func:`scan_counts`; a ``custom_vjp`` ``bwd`` also returns logs: :func:`call_custom_bwd`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex_core
import jax.extend.linear_util as jex_lu
import jax.extend.source_info_util as jex_siu
import numpy as np
from jax._src.interpreters import partial_eval as _pe  # trace_to_jaxpr_dynamic

Primitive = jex_core.Primitive
Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr
Literal = jex_core.Literal
# JAX >= 0.10 exports DropVar from jax.extend.core; 0.9.x only from jax._src.core.
DropVar = getattr(jex_core, "DropVar", None) or importlib.import_module("jax._src.core").DropVar

user_context = jex_siu.user_context
current_name_stack = jex_siu.current_name_stack

# JAX >= 0.11: ClosedJaxpr is an alias of Jaxpr (consts live on the Jaxpr).
_CLOSED_IS_JAXPR = ClosedJaxpr is Jaxpr


def is_jaxpr_like(x: Any) -> bool:
    """A ``Jaxpr`` or ``ClosedJaxpr`` (both are the same class from JAX 0.11 on)."""
    return isinstance(x, (Jaxpr, ClosedJaxpr))


def is_closed(x: Any) -> bool:
    """Whether ``x`` carries its own constants (a ``ClosedJaxpr`` before JAX 0.11)."""
    return (not _CLOSED_IS_JAXPR) and isinstance(x, ClosedJaxpr)


def open_and_consts(x: Any) -> tuple[Any, list[Any]]:
    """The open ``Jaxpr`` and its constant values, for an open or closed jaxpr."""
    if is_closed(x):
        return x.jaxpr, list(x.consts)
    return x, list(getattr(x, "consts", ()) or ())


def bind(prim: Primitive, invals: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    """Bind ``prim`` with equation ``params``; always returns a list of outputs."""
    invals = half_matmul_operands(prim, invals, params.get("preferred_element_type"))
    bind_params = prim.get_bind_params(params)
    if isinstance(bind_params, tuple):
        # JAX < 0.9.2: get_bind_params returned (subfuns, params); subfuns lead the operands.
        subfuns, bind_params = bind_params
        out = prim.bind(*subfuns, *invals, **bind_params)
    else:
        # JAX >= 0.9.2: a dict; call-like primitives keep their subfuns inside it.
        out = prim.bind(*invals, **bind_params)
    return list(out) if prim.multiple_results else [out]


# --- half x half -> float32 matmuls, decided by the platform the program is lowered for -----
#
# XLA:CPU (jaxlib 0.9.2 through 0.12.0.1 at least) rewrites most bfloat16 matmuls to float32
# ones, but not one whose transpose is folded into it after that rewrite: its runtime then
# fails with ``Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32``. GPUs run
# these matmuls natively (cuBLASLt, Triton). So the jaxpr always holds the plain half x half
# -> float32 ``dot_general`` / ``conv_general_dilated``, and only its *lowering for CPU*
# widens the operands to float32 first, for a dtype whose XLA:CPU probe failed: the same
# products (exact in float32) and the same float32 accumulation as XLA:CPU's own rewrite.
# The decision is the lowering platform's, never the host's: a program compiled for a GPU
# from a CPU process (AOT, ``jit(backend=)``, a mesh of GPU devices) keeps its
# half-precision GEMMs. The rule is registered for CPU only and changes nothing until autocast
# binds such a matmul (which probes the dtype first: lowering never compiles). JAX 0.9.2 ..
# 0.12: ``mlir.register_lowering(..., platform="cpu")`` wrapping the rule JAX registered
# (``mlir._platform_specific_lowerings`` / ``mlir._lowerings``); ``LoweringRuleContext``
# with ``avals_in`` / ``avals_out`` and ``replace``; ``mlir.convert_hlo``. Where that is
# missing, :data:`WIDEN_AT_LOWERING` is False and :func:`half_matmul_operands` widens at
# trace time for a CPU default backend (the behaviour before this rule).

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


def half_matmul_operands(prim: Any, invals: Sequence[Any], preferred: Any) -> Sequence[Any]:
    """The operands with which to bind ``prim``: unchanged, after probing XLA:CPU once per
    dtype for a half x half -> float32 ``prim`` (its CPU lowering reads the answer); widened
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
    """Whether XLA:CPU runs a ``dtype`` x ``dtype`` -> float32 matmul in every layout:
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
            wide = [aval_with_dtype(a, np.dtype("float32")) for a in ctx.avals_in]
            args = tuple(_mlir.convert_hlo(ctx, x, a, w) for x, a, w in zip(args, ctx.avals_in, wide))
            ctx = ctx.replace(avals_in=wide)
        return previous(ctx, *args, **params)

    return rule


def _register_widening_cpu_lowerings() -> bool:
    try:
        table = _mlir._platform_specific_lowerings["cpu"]
        entries = {
            p: table.get(p) or _mlir._lowerings[p] for p in (jax.lax.dot_general_p, jax.lax.conv_general_dilated_p)
        }
        for prim, entry in entries.items():
            _mlir.register_lowering(prim, _widening_cpu_lowering(entry.rule), platform="cpu", inline=entry.inline)
    except (AttributeError, KeyError, TypeError):  # a JAX without these internals
        return False
    return True


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's operands (consts, carry, xs)."""
    if "num_consts" in params:  # JAX <= 0.11: explicit counts
        return params["num_consts"], params["num_carry"]
    # JAX >= 0.12: a FlatTree ``ft_in`` groups the operands as (consts, carry, xs).
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def eqn_context(eqn: Any) -> contextlib.AbstractContextManager:
    """The context an equation was traced in (abstract mesh, compute type, ...)."""
    ctx = getattr(eqn, "ctx", None)
    manager = getattr(ctx, "manager", None)
    return manager if manager is not None else contextlib.nullcontext()


def scope_names(name_stack: Any) -> tuple[str, ...]:
    """The ``jax.named_scope`` names of a name stack, outermost first.

    Transformation markers (``jvp(...)``, ``transpose(...)``) are not scopes and are
    skipped.
    """
    stack = getattr(name_stack, "stack", ())
    names = []
    for entry in stack:
        # jax._src.source_info_util.Scope has .name; Transform entries have .name too,
        # but are a different class: only scopes count.
        if type(entry).__name__ == "Scope":
            names.append(entry.name)
    return tuple(names)


def trace_to_jaxpr(fun: Callable[..., Sequence[Any]], in_avals: Sequence[Any]) -> tuple[Any, list[Any]]:
    """Trace ``fun`` (flat lists in, flat list out) at ``in_avals``.

    Returns ``(open_jaxpr, consts)``. Avals keep their sharding and varying-manual-axes
    annotations, which ``jax.make_jaxpr`` on ``ShapeDtypeStruct`` would not.
    """

    def flat(*args):
        return list(fun(*args))

    dbg = _debug_info(flat, in_avals)
    wrapped = jex_lu.wrap_init(flat, debug_info=dbg)
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return jaxpr, list(consts)


def _debug_info(fun: Callable, in_avals: Sequence[Any]) -> Any:
    from jax._src import api_util  # JAX >= 0.5: wrap_init requires debug_info

    return api_util.debug_info("autocast", fun, tuple(in_avals), {})


def close_jaxpr(jaxpr: Any, consts: Sequence[Any]) -> Any:
    """A closed jaxpr from an open one (as :func:`trace_to_jaxpr` returns it) and its
    constants."""
    if hasattr(jaxpr, "with_consts"):
        # JAX >= 0.12: constants are the values attached to the leading invars.
        return jaxpr.with_consts(list(consts)) if consts else jaxpr
    if _CLOSED_IS_JAXPR:  # JAX 0.11: one class, constvars kept apart from invars
        return jaxpr.replace(consts=list(consts)) if consts else jaxpr
    return ClosedJaxpr(jaxpr, list(consts))  # JAX <= 0.10


def bind_inputs(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[tuple[Any, Any, bool]]:
    """Pair an open jaxpr's variables with ``consts`` and ``args``: ``(var, value, is_const)``.

    JAX <= 0.11 keeps ``constvars`` apart from ``invars``; from JAX 0.12 the constants of
    a traced (open) jaxpr are its leading ``invars`` (``constvars`` are only those with
    values attached). Concatenating both lists pairs correctly on either side.
    """
    all_vars = [*jaxpr.constvars, *jaxpr.invars]
    vals = [*consts, *args]
    if len(all_vars) != len(vals):
        raise ValueError(
            f"jaxpr takes {len(all_vars)} inputs (constants included); got {len(consts)} constants and {len(args)} arguments"
        )
    return [(v, x, i < len(consts)) for i, (v, x) in enumerate(zip(all_vars, vals))]


def constvars_to_invars(jaxpr: Any) -> Any:
    """Turn the constvars of an open jaxpr into leading invars."""
    return _pe.convert_constvars_jaxpr(jaxpr)


SAVED_NAME = "autocast_saved"
"""``jax.ad_checkpoint.checkpoint_name`` of values every autocast checkpoint saves (the
float8 operands and scales of an fp8 matmul: recomputing them costs more than keeping them)."""


def checkpoint(fun: Callable, save: frozenset[str] = frozenset()) -> Callable:
    """``jax.checkpoint`` saving only the outputs of the primitives named in ``save`` and
    the values named :data:`SAVED_NAME`: everything else inside is recomputed in the
    backward pass."""

    def policy(prim: Any, *_: Any, **params: Any) -> bool:
        return prim.name in save or (prim.name == "name" and params.get("name") == SAVED_NAME)

    return jax.checkpoint(fun, prevent_cse=True, policy=policy)


def jaxpr_as_fun(closed: Any) -> Callable[..., list[Any]]:
    return jex_core.jaxpr_as_fun(closed)


def aval_with_dtype(aval: Any, dtype: Any) -> Any:
    """``aval`` with another dtype (sharding and manual axes kept); weak type dropped."""
    if aval.dtype == dtype:
        return aval
    return aval.update(dtype=dtype, weak_type=False)


def typeof(x: Any) -> Any:
    """The abstract value of a concrete or traced value."""
    return jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)  # type: ignore[attr-defined]  # JAX < 0.6


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


# --- custom derivatives: the thunks JAX stores in custom_jvp_call / custom_vjp_call -------

# JAX raises this from a custom_vjp forward rule when a closed-over value is differentiated.
CustomVJPException = importlib.import_module("jax._src.interpreters.ad").CustomVJPException

# JAX >= 0.12 (``custom_vjp.defvjp_with_logs``): the flattened ``bwd`` returns
# ``(cotangents, logs)``; before, the cotangents alone.
_BWD_RETURNS_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")


def call_jvp_rule_thunk(thunk: Any, zeros: Sequence[bool]) -> tuple[Any, list[Any], list[bool]]:
    """The JVP rule of a ``custom_jvp_call`` traced for these symbolic-zero tangent flags:
    ``(open_jaxpr, consts, out_zeros)``; the jaxpr takes the primals, then the nonzero
    tangents, and returns the primal outputs, then the nonzero output tangents.

    JAX 0.9.2 .. 0.12: ``jvp_jaxpr_fun`` is an ``lu.WrappedFun`` called with the flags.
    """
    jaxpr, consts, out_zeros = thunk.call_wrapped(*zeros)
    return jaxpr, list(consts), list(out_zeros)


def call_custom_bwd(bwd: Any, res: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
    """Call the flattened ``bwd`` of a ``custom_vjp_call`` equation on flat residuals and
    output cotangents; returns one cotangent per non-constant operand (zeros may be
    symbolic: see :func:`is_zero`)."""
    out = bwd.call_wrapped(*res, *cts)
    if _BWD_RETURNS_LOGS:  # JAX >= 0.12
        out = out[0]
    return list(out)


_ZERO_TYPES = tuple(
    t
    for t in (
        getattr(importlib.import_module("jax._src.ad_util"), "Zero", None),
        getattr(importlib.import_module("jax.custom_derivatives"), "SymbolicZero", None),
    )
    if t is not None
)


def is_zero(x: Any) -> bool:
    """A symbolic zero (``ad_util.Zero`` or the public ``SymbolicZero``)."""
    return isinstance(x, _ZERO_TYPES)


def user_frame(source_info: Any) -> tuple[str, int] | None:
    """``(file, line)`` of the innermost user frame (not JAX's own) of an equation's
    ``source_info``, or None. ``jax._src.source_info_util.user_frame`` (JAX 0.4 to 0.12);
    a JAX without it gives None (explain and find_overflow then show no source)."""
    try:
        from jax._src import source_info_util as _siu
    except ImportError:  # pragma: no cover - a future JAX that moved it
        return None
    fn = getattr(_siu, "user_frame", None)
    frame = fn(getattr(source_info, "traceback", None)) if fn is not None else None
    if frame is None:
        return None
    return frame.file_name, int(frame.start_line)


def saved_residuals(fun: Callable, *args: Any) -> list[tuple[Any, str]]:
    """``(aval, description)`` of each residual ``jax.vjp(fun, *args)`` saves, as
    ``jax.ad_checkpoint.print_saved_residuals`` prints them. JAX 0.4 to 0.12:
    ``jax._src.ad_checkpoint.saved_residuals`` (the public module only prints)."""
    from jax._src import ad_checkpoint as _adc

    return list(_adc.saved_residuals(fun, *args))


# --- primitives the interpreter treats specially ----------------------------------------


def _find(name: str, *modules: str) -> Primitive | None:
    for module in modules:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        prim = getattr(mod, name, None)
        if isinstance(prim, Primitive):
            return prim
    return None


_EXT = "jax.extend.core.primitives"
jit_p = _find("jit_p", _EXT) or _find("pjit_p", "jax._src.pjit")  # JAX < 0.7: pjit_p
closed_call_p = _find("closed_call_p", _EXT)
remat_p = _find("remat_p", _EXT)
scan_p = _find("scan_p", _EXT)
while_p = _find("while_p", _EXT)
cond_p = _find("cond_p", _EXT)
custom_jvp_call_p = _find("custom_jvp_call_p", _EXT)
custom_vjp_call_p = _find("custom_vjp_call_p", _EXT)
convert_element_type_p = _find("convert_element_type_p", _EXT)
# shard_map_p is only in jax._src (JAX 0.10: jax._src.shard_map; older: experimental).
shard_map_p = _find("shard_map_p", "jax._src.shard_map", "jax.experimental.shard_map")

# Modules whose Primitive objects a policy file may name (resolved by ``Primitive.name``).
_PRIMITIVE_MODULES = (
    "jax.extend.core.primitives",
    "jax.lax",
    "jax.lax.linalg",
    "jax._src.lax.lax",
    "jax._src.lax.linalg",
    "jax._src.lax.slicing",
    "jax._src.lax.special",
    "jax._src.lax.fft",
    "jax._src.lax.convolution",
    "jax._src.lax.windowed_reductions",
    "jax._src.lax.parallel",
    "jax._src.lax.ann",
    "jax._src.lax.control_flow.loops",
    "jax._src.lax.control_flow.conditionals",
    "jax._src.lax.control_flow.solves",
    "jax._src.ad_checkpoint",
    "jax._src.ad_util",
    "jax._src.custom_derivatives",
    "jax._src.callback",
    "jax._src.debugging",
    "jax._src.random",
    "jax._src.prng",
    "jax._src.shard_map",
    "jax._src.pjit",
    "jax._src.dispatch",
    "jax._src.ffi",
    "jax._src.core",
)


def discover_primitives() -> dict[str, list[Primitive]]:
    """Every ``Primitive`` object JAX defines in its lax/control-flow/AD modules, by name."""
    found: dict[str, dict[int, Primitive]] = {}
    for module in _PRIMITIVE_MODULES:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        for value in vars(mod).values():
            if isinstance(value, Primitive):
                found.setdefault(value.name, {})[id(value)] = value
    return {name: list(prims.values()) for name, prims in found.items()}


# --- a bilinear product whose transpose yields a float32 cotangent ------------------------
#
# ``tangent_product_p`` binds ``inner`` (``dot_general`` or ``conv_general_dilated``) on
# ``a`` (a half-precision primal) and the tangent ``t`` of an operand that was narrowed from
# float32, rounded to the half dtype: ``inner(a, t.astype(half))``, result in ``out_dtype``.
# It is ``inner`` in every respect (shape, sharding and varying-axes rules, lowering) except
# its transpose with respect to ``t``: JAX's own transpose of ``inner`` called with
# ``preferred_element_type`` set to ``t``'s dtype (float32), so the cotangent is accumulated
# into a float32 result straight from half-precision operands (the dot ``ct16^T . a16`` with a
# float32 output) instead of being rounded to half and converted. Every reduction after it (a
# partitioner's all-reduce, ``psum``, a scan's accumulation) then runs in float32.
# JAX 0.9.2 .. 0.12: ``ad.primitive_jvps`` / ``primitive_transposes`` (0.12 also keeps
# ``fancy_transposes``, consulted first, for primitives that register there; this one
# does not), ``batching.primitive_batchers``, ``mlir.register_lowering`` and ``lower_fun``.

_ad = importlib.import_module("jax._src.interpreters.ad")
_batching = importlib.import_module("jax._src.interpreters.batching")
# the batch dimension of an unbatched operand: ``batching.not_mapped`` up to JAX 0.11, removed
# in 0.12 (where ``NotMapped = type(None)``); None in both
_NOT_MAPPED = getattr(_batching, "not_mapped", None)
_mlir = importlib.import_module("jax._src.interpreters.mlir")


class _Params:
    """The inner primitive's parameters as a hashable value (a primitive parameter must be)."""

    __slots__ = ("items",)

    def __init__(self, params: dict[str, Any]):
        self.items = tuple(sorted(params.items()))

    def as_dict(self) -> dict[str, Any]:
        return dict(self.items)

    def __hash__(self) -> int:
        return hash(self.items)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Params) and self.items == other.items

    def __repr__(self) -> str:
        return "{...}"


tangent_product_p = Primitive("tangent_product")


def tangent_product(inner: Primitive, params: dict[str, Any], a: Any, t: Any, index: int, half: Any, out_dtype: Any):
    """``inner`` on ``a`` and ``t.astype(half)`` (``t`` at operand position ``index``), the
    result in ``out_dtype``; its transpose in ``t`` is a float32 (``t``'s dtype) result."""
    return tangent_product_p.bind(
        a, t, inner=inner, inner_params=_Params(params), index=index, half=np.dtype(half), out_dtype=np.dtype(out_dtype)
    )


def _ordered(a, t, index):
    return [a, t] if index == 1 else [t, a]


def _tp_inner_params(inner_params, half):
    return dict(inner_params.as_dict(), preferred_element_type=half)


def _tp_impl(a, t, *, inner, inner_params, index, half, out_dtype):
    (out,) = bind(inner, _ordered(a, t.astype(half), index), _tp_inner_params(inner_params, half))
    return out.astype(out_dtype) if out.dtype != out_dtype else out


def _tp_abstract_eval(a, t, *, inner, inner_params, index, half, out_dtype):
    out, effects = inner.abstract_eval(
        *_ordered(a, aval_with_dtype(t, half), index), **_tp_inner_params(inner_params, half)
    )
    return aval_with_dtype(out, out_dtype), effects


def _tp_jvp(primals, tangents, **params):
    a, t = primals
    ta, tt = tangents
    out = tangent_product_p.bind(a, t, **params)
    terms = []
    if type(ta) is not _ad.Zero:
        terms.append(tangent_product_p.bind(ta, t, **params))
    if type(tt) is not _ad.Zero:
        terms.append(tangent_product_p.bind(a, tt, **params))
    if not terms:
        return out, _ad.Zero.from_primal_value(out)
    return out, sum(terms[1:], terms[0])


def _tp_transpose(ct, a, t, *, inner, inner_params, index, half, out_dtype):
    rule = _ad.get_primitive_transpose(inner)
    if _ad.is_undefined_primal(t):
        if type(ct) is _ad.Zero:
            return [None, _ad.Zero(t.aval)]
        ct = ct.astype(half) if ct.dtype != half else ct
        # the cotangent of ``t`` accumulated into ``t``'s own dtype (float32), straight from
        # the half-precision operands (see half_matmul_operands)
        ct, a = half_matmul_operands(inner, [ct, a], t.aval.dtype)
        cts = rule(ct, *_ordered(a, t, index), **dict(inner_params.as_dict(), preferred_element_type=t.aval.dtype))
        return [None, cts[index]]
    # the cotangent of ``a``: the ordinary half-precision transpose
    if type(ct) is _ad.Zero:
        return [_ad.Zero(a.aval), None]
    ct = ct.astype(half) if ct.dtype != half else ct
    cts = rule(ct, *_ordered(a, t.astype(half), index), **_tp_inner_params(inner_params, half))
    return [cts[1 - index], None]


def _tp_batch(args, dims, *, inner, inner_params, index, half, out_dtype):
    """``dot_general``: the batch axes folded into the dimension numbers (as JAX's own rule
    does), so a batched product is still a ``tangent_product``. Other primitives (or a
    ``dot_general`` with an explicit ``out_sharding``): the inner primitive's own batching
    rule on the half-precision tangent (the float32 cotangent is not kept there)."""
    a, t = args
    params = inner_params.as_dict()
    if inner.name == "dot_general" and params.get("out_sharding") is None:
        lhs, rhs = _ordered(a, t, index)
        ld, rd = _ordered(*dims, index)
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        shift = lambda ds: tuple(d + 1 for d in ds)  # noqa: E731
        not_mapped = _NOT_MAPPED
        if ld is not not_mapped:
            lhs = _batching.moveaxis(lhs, ld, 0)
            lc, lb = shift(lc), shift(lb)
        if rd is not not_mapped:
            rhs = _batching.moveaxis(rhs, rd, 0)
            rc, rb = shift(rc), shift(rb)
        if ld is not not_mapped and rd is not not_mapped:
            lb, rb, out_dim = (0, *lb), (0, *rb), 0
        elif ld is not not_mapped:
            out_dim = len(lb)
        else:
            out_dim = len(lb) + (lhs.ndim - len(lc) - len(lb))
        new = dict(params, dimension_numbers=((lc, rc), (lb, rb)))
        a2, t2 = (lhs, rhs) if index == 1 else (rhs, lhs)
        out = tangent_product(inner, new, a2, t2, index, half, out_dtype)
        return out, out_dim
    t16 = t.astype(half)
    out, out_dim = _batching.primitive_batchers[inner](
        _ordered(a, t16, index), _ordered(dims[0], dims[1], index), **_tp_inner_params(inner_params, half)
    )
    return out.astype(out_dtype), out_dim


tangent_product_p.def_impl(_tp_impl)
tangent_product_p.def_effectful_abstract_eval(_tp_abstract_eval)
_ad.primitive_jvps[tangent_product_p] = _tp_jvp
_ad.primitive_transposes[tangent_product_p] = _tp_transpose
_batching.primitive_batchers[tangent_product_p] = _tp_batch
_mlir.register_lowering(tangent_product_p, _mlir.lower_fun(_tp_impl, multiple_results=False))
WIDEN_AT_LOWERING = _register_widening_cpu_lowerings()
"""Whether half x half -> float32 matmuls are widened by their CPU lowering (see above)."""


# --- hijax: higher-order primitives as one ``call_hi_primitive`` equation --------------------
#
# JAX 0.12 moves checkpoint, custom_jvp, custom_vjp and scan to "hijax" encodings behind
# upgrade flags (``jax_remat3``, ``jax_custom_jvp3``, ``jax_custom_vjp3``, ``jax_scan3``;
# ``jnp.searchsorted`` and a few others use one without a flag). Such a construct is a single
# ``call_hi_primitive`` equation whose ``params["_prim"]`` is a ``HiPrim`` object holding the
# body: ``.params["jaxpr"]`` (``RematTraced``, ``Scan3``) or ``.params["traced"].jaxpr``
# (``CustomJVPTraced``, ``CustomVJPTraced``). Detected by the classes' presence, never by
# version; on a JAX without hijax every name below is None and nothing takes this path.


def _class(module: str, name: str) -> type | None:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


call_hi_primitive_p = _find("call_hi_primitive_p", "jax._src.hijax")
# JAX 0.12: ``HiPrim``; JAX 0.9.2 .. 0.11: the same base class named ``VJPHiPrimitive``.
HiPrim = _class("jax._src.hijax", "HiPrim") or _class("jax._src.hijax", "VJPHiPrimitive")
RematTraced = _class("jax._src.ad_checkpoint", "RematTraced")
CustomJVPTraced = _class("jax._src.hijax", "CustomJVPTraced")
CustomVJPTraced = _class("jax._src.hijax", "CustomVJPTraced")
Scan3 = _class("jax._src.lax.control_flow.loops", "Scan3")


def hi_prim(eqn: Any) -> Any | None:
    """The ``HiPrim`` object of a ``call_hi_primitive`` equation, else None."""
    if call_hi_primitive_p is None or eqn.primitive is not call_hi_primitive_p:
        return None
    return eqn.params.get("_prim")


def hi_bodies(eqn: Any) -> list[Any]:
    """The jaxprs a ``call_hi_primitive`` equation holds (its body; [] for an opaque one such
    as ``SearchSorted``, or for any other equation)."""
    prim = hi_prim(eqn)
    if prim is None:
        return []
    params = getattr(prim, "params", {}) or {}
    out = []
    for val in params.values():
        body = getattr(val, "jaxpr", val)  # a ``stages.Traced`` (custom rules) holds .jaxpr
        if is_jaxpr_like(body):
            out.append(body)
    return out


def hi_name(eqn: Any) -> str | None:
    """``RematTraced``, ``CustomJVPTraced``, ... for a ``call_hi_primitive`` equation."""
    prim = hi_prim(eqn)
    return None if prim is None else type(prim).__name__


def hi_param(eqn: Any, key: str, default: Any = None) -> Any:
    """A parameter of a ``call_hi_primitive`` equation's ``HiPrim`` (``Scan3``'s ``length``,
    ``extensives``, ...), else ``default``."""
    prim = hi_prim(eqn)
    params = getattr(prim, "params", None) or {}
    return params.get(key, default)


def fun_name(eqn: Any) -> str | None:
    """The user function a custom-derivative equation wraps (``relu``), in either encoding:
    the ``Traced`` of ``CustomJVPTraced``/``CustomVJPTraced``, or the ``call_jaxpr``'s debug
    info of ``custom_jvp_call``/``custom_vjp_call``."""
    traced = hi_param(eqn, "traced")
    if traced is not None:
        return getattr(traced, "fun_name", None)
    body = eqn.params.get("call_jaxpr")
    info = getattr(getattr(body, "jaxpr", body), "debug_info", None)
    return getattr(info, "func_name", None)


# --- upgrade flags: the encodings JAX moves to (``jax_remat3``, ...) ----------------------

HIJAX_FLAGS = ("remat3", "custom_jvp3", "custom_vjp3", "scan3", "softmax_custom_jvp")


def _flag_state(name: str) -> Any | None:
    from jax._src import config as _config  # the flags' State objects live only here

    return getattr(_config, name, None)


def has_flag(name: str) -> bool:
    """Whether this JAX has the upgrade flag ``jax_<name>`` (``remat3``, ``scan3``, ...)."""
    return _flag_state(name) is not None


def flag_on(name: str) -> bool:
    """The current value of the upgrade flag ``jax_<name>`` (False where JAX lacks it)."""
    state = _flag_state(name)
    return bool(state is not None and state.value)


def float8_residuals_exact() -> bool:
    """Whether a float8 value that a ``custom_vjp`` forward pass names for a ``jax.checkpoint``
    to save reaches the backward pass unchanged. Not with ``jax_remat3`` and
    ``jax_custom_vjp3`` both on (JAX 0.12.0.1: some values come back changed; either flag
    alone, bfloat16 and integer values are exact): there the float8 residuals of
    :mod:`autocast._fp8` are saved as their ``uint8`` bits."""
    return not (flag_on("remat3") and flag_on("custom_vjp3"))


def checkpoint_keeps_custom_vjp_operands() -> bool:
    """Whether a ``jax.checkpoint`` whose policy saves a ``custom_vjp`` 's primal operand
    (a matmul result it names) keeps it even where the backward pass reads only the
    residuals the forward pass named: so under ``jax_remat3`` (JAX 0.12.0.1). A float8 copy
    kept besides it would then add bytes instead of replacing them."""
    return flag_on("remat3")


def with_flag(name: str, value: bool = True) -> contextlib.AbstractContextManager:
    """A context manager that sets ``jax_<name>`` for what is traced (on JAX 0.9, for what is
    decorated: define the function inside). Raises ``ValueError`` where JAX lacks the flag."""
    state = _flag_state(name)
    if state is None:
        raise ValueError(f"with_flag(name={name!r}): this JAX ({jax.__version__}) has no flag jax_{name}")
    return state(value)


# --- hijax adapters: one shape per construct, for the old encoding and the hijax one --------
#
# The handlers of :mod:`autocast._higher_order` transform a construct's body and call its
# rules in the dtypes values arrive in; these adapters give them the same pieces whichever
# way JAX encoded it: ``custom_jvp_call`` / ``custom_vjp_call`` / ``checkpoint`` equations, or
# one ``call_hi_primitive`` equation holding a ``CustomJVPTraced`` / ``CustomVJPTraced`` /
# ``RematTraced`` / ``Scan3`` (JAX 0.12 with ``jax_custom_jvp3`` / ``jax_custom_vjp3`` /
# ``jax_remat3`` / ``jax_scan3``; JAX 0.9.2 has ``CustomVJPTraced`` with ``jax_custom_vjp3``,
# applied to the arguments only, with its rules taken as the user wrote them).

_AbstractRef = _class("jax._src.state.types", "AbstractRef")
CheckpointName = _class("jax._src.ad_checkpoint", "CheckpointName")
CheckpointNameFwd = _class("jax._src.ad_checkpoint", "CheckpointNameFwd")


def is_ref(x: Any) -> bool:
    """A mutable array reference (``jax.new_ref``; a scan carry under ``jax_scan3``): its
    dtype is fixed when it is made, so it is never cast."""
    aval = getattr(x, "aval", None) if is_tracer(x) else None
    return _AbstractRef is not None and isinstance(aval, _AbstractRef)


def is_ref_aval(aval: Any) -> bool:
    return _AbstractRef is not None and isinstance(aval, _AbstractRef)


def _is_a(prim: Any, cls: type | None) -> bool:
    return cls is not None and isinstance(prim, cls)


def _leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(tree)


class CustomJVPParts(NamedTuple):
    """A custom JVP construct: ``body`` (a jaxpr whose invars are the operands, one to one);
    the first ``n_consts`` operands carry no tangent; ``rule(zeros)`` traces the JVP rule for
    these symbolic-zero flags (one per operand after ``n_consts``) and returns ``(open_jaxpr,
    consts, out_zeros)``: the jaxpr takes the operands from ``rule_skip`` on, then the nonzero
    tangents, and returns the primal outputs, then the nonzero output tangents."""

    body: Any
    n_consts: int
    rule: Callable[[Sequence[bool]], tuple[Any, list[Any], list[bool]]]
    rule_skip: int
    symbolic_zeros: bool


class CustomVJPParts(NamedTuple):
    """A custom VJP construct: ``body`` as for :class:`CustomJVPParts`; ``fwd(perturbed)``
    (one flag per operand after ``n_consts``) traces the forward rule: ``(open_jaxpr, consts,
    input_fwds)``; the jaxpr takes the operands from ``fwd_skip`` on and returns the computed
    residuals, then the primal outputs; ``input_fwds[i]`` is None for a computed residual or
    the index of the operand residual ``i`` is. ``bwd(res, cts)`` calls the user's backward
    rule on flat residuals and output cotangents: one cotangent per operand after
    ``n_consts`` (zeros may be symbolic: :func:`is_zero`)."""

    body: Any
    n_consts: int
    fwd: Callable[[Sequence[bool]], tuple[Any, list[Any], list[Any]]]
    fwd_skip: int
    bwd: Callable[[Sequence[Any], Sequence[Any]], list[Any]]
    symbolic_zeros: bool


def custom_jvp_parts(eqn: Any) -> CustomJVPParts | None:
    """The pieces of a ``custom_jvp_call`` or ``CustomJVPTraced`` equation (None if this
    JAX stores them in a form autocast does not know)."""
    prim: Any = hi_prim(eqn)
    if prim is None:
        params = eqn.params
        thunk = params.get("jvp_jaxpr_fun")
        if not hasattr(thunk, "call_wrapped"):
            return None
        n = params["num_consts"]
        old_rule = functools.partial(call_jvp_rule_thunk, thunk)
        return CustomJVPParts(params["call_jaxpr"], n, old_rule, n, bool(params.get("symbolic_zeros", False)))
    if not _is_a(prim, CustomJVPTraced):
        return None
    # JAX 0.12: applications take ``(consts, *args)``; the rule gets the same structure
    # (``Static`` leaves for nondiff arguments) with internal ``Zero`` tangents.
    n = len(_leaves(prim.in_avals[0]))
    avals = list(prim.in_avals_flat)

    def rule(zeros: Sequence[bool]) -> tuple[Any, list[Any], list[bool]]:
        flags = [True] * n + list(zeros)
        out_zeros: list[bool] = []

        def fun(*args):
            primals, rest = args[: len(avals)], iter(args[len(avals) :])
            tangents = [_ad.Zero(a.to_tangent_aval()) if z else next(rest) for a, z in zip(avals, flags)]
            p_out, t_out = prim.jvp_rule(
                jax.tree_util.tree_unflatten(prim.in_tree, primals),
                jax.tree_util.tree_unflatten(prim.in_tree, tangents),
            )
            t_flat = prim.out_tree.flatten_up_to(t_out)
            out_zeros[:] = [is_zero(t) for t in t_flat]
            return [*prim.out_tree.flatten_up_to(p_out), *(t for t in t_flat if not is_zero(t))]

        tangent_avals = [a.to_tangent_aval() for a, z in zip(avals, flags) if not z]
        jaxpr, consts = trace_to_jaxpr(fun, [*avals, *tangent_avals])
        return jaxpr, consts, out_zeros

    return CustomJVPParts(prim.traced.jaxpr, n, rule, 0, bool(prim.symbolic_zeros))


def custom_vjp_parts(eqn: Any) -> CustomVJPParts | None:
    """The pieces of a ``custom_vjp_call`` or ``CustomVJPTraced`` equation (None if this
    JAX stores them in a form autocast does not know)."""
    prim: Any = hi_prim(eqn)
    if prim is None:
        params = eqn.params
        fwd_thunk, flat_bwd, out_trees = params.get("fwd_jaxpr_thunk"), params.get("bwd"), params.get("out_trees")
        if not (hasattr(fwd_thunk, "call_wrapped") and hasattr(flat_bwd, "call_wrapped") and callable(out_trees)):
            return None

        def old_fwd(perturbed: Sequence[bool]) -> tuple[Any, list[Any], list[Any]]:
            jaxpr, consts = fwd_thunk.call_wrapped(*perturbed)
            _, _, input_fwds = out_trees()  # filled by the call above
            return jaxpr, list(consts), list(input_fwds)

        n = params["num_consts"]
        return CustomVJPParts(
            params["call_jaxpr"],
            n,
            old_fwd,
            n,
            functools.partial(call_custom_bwd, flat_bwd),
            bool(params.get("symbolic_zeros", False)),
        )
    if not _is_a(prim, CustomVJPTraced):
        return None
    # JAX 0.12: applications take ``(consts, fwd_consts, *args)`` and ``bwd`` returns
    # ``(cotangents of args, logs)``; JAX 0.9.2: ``(*args)`` and ``vjp_bwd_retval``.
    with_slots = hasattr(type(prim), "drop_fwd_consts")
    n = len(_leaves(prim.in_avals[:2])) if with_slots else 0
    avals = list(prim.in_avals_flat)
    res_tree: list[Any] = []

    def fwd(perturbed: Sequence[bool]) -> tuple[Any, list[Any], list[Any]]:
        nzs = jax.tree_util.tree_unflatten(prim.in_tree, [False] * n + list(perturbed))

        def fun(*args):
            out = prim.vjp_fwd(nzs, *jax.tree_util.tree_unflatten(prim.in_tree, args))
            res_flat, tree = jax.tree_util.tree_flatten(out[1])
            res_tree[:] = [tree]
            return [*res_flat, *prim.out_tree.flatten_up_to(out[0])]

        jaxpr, consts = trace_to_jaxpr(fun, avals)
        return jaxpr, consts, [None] * res_tree[0].num_leaves

    def bwd(res: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
        cts = [_ad.Zero(a.to_tangent_aval()) if is_zero(c) else c for c, a in zip(cts, prim.out_avals_flat)]
        res_val = jax.tree_util.tree_unflatten(res_tree[0], list(res))
        out_ct = jax.tree_util.tree_unflatten(prim.out_tree, cts)
        if with_slots:  # JAX 0.12
            in_cts, _ = prim.bwd(res_val, out_ct)
            args_tree: Any = jax.tree_util.tree_structure(prim.in_avals[2:])
            return args_tree.flatten_up_to(in_cts)
        return prim.in_tree.flatten_up_to(prim.vjp_bwd_retval(res_val, out_ct))

    return CustomVJPParts(prim.traced.jaxpr, n, fwd, 0, bwd, bool(prim.symbolic_zeros))


def remat_parts(eqn: Any) -> tuple[Any, Any] | None:
    """``(body, policy)`` of a ``checkpoint`` or ``RematTraced`` equation (the body's invars
    are the operands, one to one), else None."""
    if remat_p is not None and eqn.primitive is remat_p:
        return eqn.params["jaxpr"], eqn.params.get("policy")
    prim: Any = hi_prim(eqn)
    if _is_a(prim, RematTraced) and "jaxpr" in prim.params and "prevent_cse" in prim.params:  # JAX 0.12
        return prim.params["jaxpr"], prim.params["policy"]
    return None


def remat_bind(eqn: Any, body: Any, extra: Sequence[Any], invals: Sequence[Any]) -> list[Any]:
    """The checkpoint of ``eqn`` (same policy and ``prevent_cse``) around a new ``body`` that
    takes ``extra`` constants before the operands."""
    prim: Any = hi_prim(eqn)
    if prim is None:
        return bind(eqn.primitive, [*extra, *invals], dict(eqn.params, jaxpr=body))
    prevent_cse = prim.params["prevent_cse"]
    if not isinstance(prevent_cse, bool):
        prevent_cse = (False,) * len(extra) + tuple(prevent_cse)
    return list(type(prim)(body, prim.params["policy"], prevent_cse)(*extra, *invals))


def scan3_parts(eqn: Any) -> tuple[Any, list[bool]] | None:
    """``(body, extensives)`` of a ``Scan3`` equation: the body's invars are the operands one
    to one (loop carries are refs among them); ``extensives[i]``: operand ``i`` is scanned
    over. None for any other equation."""
    prim: Any = hi_prim(eqn)
    if _is_a(prim, Scan3):
        return prim.params["jaxpr"], list(prim.params["extensives"])
    return None


def scan3_bind(eqn: Any, body: Any, extra: Sequence[Any], invals: Sequence[Any]) -> list[Any]:
    """The ``Scan3`` of ``eqn`` (same length, ``reverse``, ``unroll``) over a new ``body``
    that takes ``extra`` loop-invariant constants first."""
    prim: Any = hi_prim(eqn)
    p = prim.params
    ext = [False] * len(extra) + list(p["extensives"])
    return list(type(prim)(ext, p["length"], body, p["reverse"], p["unroll"])([*extra, *invals]))


def is_checkpoint_name(eqn: Any) -> bool:
    """A ``checkpoint_name`` under ``jax_remat3`` (``CheckpointName`` / ``CheckpointNameFwd``)."""
    prim: Any = hi_prim(eqn)
    return _is_a(prim, CheckpointName) or _is_a(prim, CheckpointNameFwd)


def checkpoint_name_bind(eqn: Any, x: Any) -> list[Any]:
    """The ``checkpoint_name`` of ``eqn`` applied to ``x`` in the dtype ``x`` has."""
    prim: Any = hi_prim(eqn)
    return [type(prim)(prim.params["name"], typeof(x))(x)]


def narrow_body(eqn: Any) -> Any | None:
    """The body of a ``RematTraced`` or ``CustomJVPTraced`` equation (invars: its operands,
    one to one), else None."""
    parts = remat_parts(eqn)
    if parts is not None:
        return parts[0]
    prim: Any = hi_prim(eqn)
    return prim.traced.jaxpr if _is_a(prim, CustomJVPTraced) else None


def hijax_flags() -> dict[str, Any]:
    """JAX's upgrade flags for the hijax encodings that this JAX has, by name (those of
    ``HIJAX_FLAGS``): each value is the config state, usable as a context manager
    (``with flags["remat3"](True): ...``)."""
    return {n: state for n in HIJAX_FLAGS if callable(state := _flag_state(n))}
