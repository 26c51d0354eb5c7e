"""Every JAX-internals touch point of autocast, in one place: the shims.

The interpreter reads jaxprs, binds primitives and re-traces sub-jaxprs; those steps use
a handful of names that JAX does not promise to keep stable. They are all read here (this is
the only module that imports `jax._src`; `tests/test_compat_surface.py` checks that every
name it reads exists in the installed JAX, and that no other module imports `jax._src`),
feature detected (never by comparing version strings), each branch commented with the release
it serves, so that a JAX upgrade starts and mostly ends here. The suite runs on the oldest
supported JAX (0.9.2, Python 3.11) and the newest (0.12, Python 3.13) via `tests/run_tests.sh`.

Three modules build on these names and are the rest of the JAX-facing surface:
`autocast._constructs` (one shape per custom-derivative / checkpoint / scan construct,
for the classic and the hijax encodings), `autocast._tangent_product` (a primitive autocast
defines) and `autocast._cpu_matmul` (an override of two XLA:CPU lowerings).

What changed across the supported range, and where it is handled:

- JAX 0.10: `DropVar` in `jax.extend.core`.
- JAX 0.11: `ClosedJaxpr` merged into `Jaxpr`: `is_closed`, `close_jaxpr`.
- JAX 0.12: the constants of a traced jaxpr are its leading invars (`constvars` are only
  those with values attached): `bind_inputs` (also for the jaxprs that
  custom-derivative thunks return), `close_jaxpr`; `scan` describes its operand
  groups with a `FlatTree` `ft_in` instead of `num_consts`/`num_carry`:
  `scan_counts`; a `custom_vjp` `bwd` also returns logs
  (`autocast._constructs.call_custom_bwd`); `batching.not_mapped` removed
  (`NOT_MAPPED`); hijax encodings behind upgrade flags (`hijax_flags`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.extend.linear_util as jex_lu
import jax.extend.source_info_util as jex_siu
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
    """A `Jaxpr` or `ClosedJaxpr` (both are the same class from JAX 0.11 on)."""
    return isinstance(x, (Jaxpr, ClosedJaxpr))


def is_closed(x: Any) -> bool:
    """Whether `x` carries its own constants (a `ClosedJaxpr` before JAX 0.11)."""
    return (not _CLOSED_IS_JAXPR) and isinstance(x, ClosedJaxpr)


def open_and_consts(x: Any) -> tuple[Any, list[Any]]:
    """The open `Jaxpr` and its constant values, for an open or closed jaxpr."""
    if is_closed(x):
        return x.jaxpr, list(x.consts)
    return x, list(getattr(x, "consts", ()) or ())


def bind(prim: Primitive, invals: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    """Bind `prim` with equation `params`; always returns a list of outputs. (JAX >=
    0.9.2: `get_bind_params` returns a dict; call-like primitives keep their subfuns in it.)"""
    out = prim.bind(*invals, **prim.get_bind_params(params))
    return list(out) if prim.multiple_results else [out]


_core = importlib.import_module("jax._src.core")
_siu = importlib.import_module("jax._src.source_info_util")


def new_eqn(
    invars: Sequence[Any], outvars: Sequence[Any], prim: Primitive, params: dict[str, Any], source_info: Any
) -> Any:
    """A jaxpr equation without effects (JAX 0.9.2 .. 0.12: `core.new_jaxpr_eqn`; 0.12 also
    exports it from `jax.extend.core`), its source info without a name stack (a call's
    equations extend the name stack they are bound in)."""
    return _core.new_jaxpr_eqn(
        list(invars), list(outvars), prim, params, frozenset(), source_info.replace(name_stack=_siu.new_name_stack())
    )


def jaxpr_of(invars: Sequence[Any], outvars: Sequence[Any], eqns: Sequence[Any]) -> Any:
    """A closed jaxpr without constants over existing variables and equations (`core.Jaxpr`:
    constvars, invars, outvars, eqns, effects in JAX 0.9.2 .. 0.12)."""
    info = _debug_info(lambda *args: args, [v.aval for v in invars])
    info = info._replace(result_paths=tuple(f"result[{i}]" for i in range(len(outvars))))  # (a NamedTuple)
    return close_jaxpr(_core.Jaxpr([], list(invars), list(outvars), list(eqns), frozenset(), info), [])


def with_eqns(jaxpr: Any, eqns: Sequence[Any]) -> Any:
    """An open jaxpr with other equations (`Jaxpr.replace`, JAX 0.9.2 .. 0.12)."""
    return jaxpr.replace(eqns=list(eqns))


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """`(num_consts, num_carry)` of a `scan` equation's operands (consts, carry, xs)."""
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
    """The `jax.named_scope` names of a name stack, outermost first.

    Transformation markers (`jvp(...)`, `transpose(...)`) are not scopes and are
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
    """Trace `fun` (flat lists in, flat list out) at `in_avals`.

    Returns `(open_jaxpr, consts)`. Avals keep their sharding and varying-manual-axes
    annotations, which `jax.make_jaxpr` on `ShapeDtypeStruct` would not.
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
    """A closed jaxpr from an open one (as `trace_to_jaxpr` returns it) and its
    constants."""
    if hasattr(jaxpr, "with_consts"):
        # JAX >= 0.12: constants are the values attached to the leading invars.
        return jaxpr.with_consts(list(consts)) if consts else jaxpr
    if _CLOSED_IS_JAXPR:  # JAX 0.11: one class, constvars kept apart from invars
        return jaxpr.replace(consts=list(consts)) if consts else jaxpr
    return ClosedJaxpr(jaxpr, list(consts))  # JAX <= 0.10


def bind_inputs(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[tuple[Any, Any, bool]]:
    """Pair an open jaxpr's variables with `consts` and `args`: `(var, value, is_const)`.

    JAX <= 0.11 keeps `constvars` apart from `invars`; from JAX 0.12 the constants of
    a traced (open) jaxpr are its leading `invars` (`constvars` are only those with
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
"""`jax.ad_checkpoint.checkpoint_name` of values every autocast checkpoint saves (the
float8 operands and scales of an fp8 matmul: recomputing them costs more than keeping them)."""


def checkpoint(fun: Callable, save: frozenset[str] = frozenset()) -> Callable:
    """`jax.checkpoint` saving only the outputs of the primitives named in `save` and
    the values named `SAVED_NAME`: everything else inside is recomputed in the
    backward pass."""

    def policy(prim: Any, *_: Any, **params: Any) -> bool:
        return prim.name in save or (prim.name == "name" and params.get("name") == SAVED_NAME)

    return jax.checkpoint(fun, prevent_cse=True, policy=policy)


def jaxpr_as_fun(closed: Any) -> Callable[..., list[Any]]:
    return jex_core.jaxpr_as_fun(closed)


def aval_with_dtype(aval: Any, dtype: Any) -> Any:
    """`aval` with another dtype (sharding and manual axes kept); weak type dropped."""
    if aval.dtype == dtype:
        return aval
    return aval.update(dtype=dtype, weak_type=False)


def typeof(x: Any) -> Any:
    """The abstract value of a concrete or traced value."""
    return jax.typeof(x)


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


# --- custom derivatives: the thunks JAX stores in custom_jvp_call / custom_vjp_call -------

# JAX raises this from a custom_vjp forward rule when a closed-over value is differentiated.
CustomVJPException = importlib.import_module("jax._src.interpreters.ad").CustomVJPException

_ZERO_TYPES = tuple(
    t
    for t in (
        getattr(importlib.import_module("jax._src.ad_util"), "Zero", None),
        getattr(importlib.import_module("jax.custom_derivatives"), "SymbolicZero", None),
    )
    if t is not None
)


def is_zero(x: Any) -> bool:
    """A symbolic zero (`ad_util.Zero` or the public `SymbolicZero`)."""
    return isinstance(x, _ZERO_TYPES)


def user_frame(source_info: Any) -> tuple[str, int] | None:
    """`(file, line)` of the innermost user frame (not JAX's own) of an equation's
    `source_info`, or None. `jax._src.source_info_util.user_frame` (JAX 0.4 to 0.12);
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
    """`(aval, description)` of each residual `jax.vjp(fun, *args)` saves, as
    `jax.ad_checkpoint.print_saved_residuals` prints them. JAX 0.4 to 0.12:
    `jax._src.ad_checkpoint.saved_residuals` (the public module only prints)."""
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
jit_p = _find("jit_p", _EXT)
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
    """Every `Primitive` object JAX defines in its lax/control-flow/AD modules, by name."""
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


# --- defining a primitive: the tables JAX's transformations read -------------------------
#
# For the primitive autocast defines (``_tangent_product.tangent_product_p``) and the CPU
# lowering it overrides (``_cpu_matmul``). JAX 0.9.2 .. 0.12: ``ad.primitive_jvps`` /
# ``primitive_transposes`` / ``get_primitive_transpose`` / ``is_undefined_primal`` / ``Zero``,
# ``batching.primitive_batchers`` / ``moveaxis``, ``mlir.register_lowering`` / ``lower_fun`` /
# ``convert_hlo`` and the lowering tables ``mlir._platform_specific_lowerings`` / ``_lowerings``.

_ad = importlib.import_module("jax._src.interpreters.ad")
_batching = importlib.import_module("jax._src.interpreters.batching")
_mlir = importlib.import_module("jax._src.interpreters.mlir")
Zero = _ad.Zero
primitive_jvps = _ad.primitive_jvps
primitive_transposes = _ad.primitive_transposes
get_primitive_transpose = _ad.get_primitive_transpose
is_undefined_primal = _ad.is_undefined_primal
primitive_batchers = _batching.primitive_batchers
moveaxis = _batching.moveaxis
# the batch dimension of an unbatched operand: ``batching.not_mapped`` up to JAX 0.11, removed
# in 0.12 (where ``NotMapped = type(None)``); None in both
NOT_MAPPED = getattr(_batching, "not_mapped", None)
register_lowering = _mlir.register_lowering
lower_fun = _mlir.lower_fun
convert_hlo = _mlir.convert_hlo


def lowering_rule(prim: Primitive, platform: str) -> tuple[Callable, bool] | None:
    """`(rule, inline)` of the lowering JAX registered for `prim` on `platform` (the
    platform's own, else the generic one), or None where this JAX keeps its tables otherwise."""
    try:
        entry = _mlir._platform_specific_lowerings[platform].get(prim) or _mlir._lowerings[prim]
        return entry.rule, entry.inline
    except (AttributeError, KeyError, TypeError):
        return None


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
    """The `HiPrim` object of a `call_hi_primitive` equation, else None."""
    if call_hi_primitive_p is None or eqn.primitive is not call_hi_primitive_p:
        return None
    return eqn.params.get("_prim")


def hi_bodies(eqn: Any) -> list[Any]:
    """The jaxprs a `call_hi_primitive` equation holds (its body; [] for an opaque one such
    as `SearchSorted`, or for any other equation)."""
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
    """`RematTraced`, `CustomJVPTraced`, ... for a `call_hi_primitive` equation."""
    prim = hi_prim(eqn)
    return None if prim is None else type(prim).__name__


def hi_param(eqn: Any, key: str, default: Any = None) -> Any:
    """A parameter of a `call_hi_primitive` equation's `HiPrim` (`Scan3`'s `length`,
    `extensives`, ...), else `default`."""
    prim = hi_prim(eqn)
    params = getattr(prim, "params", None) or {}
    return params.get(key, default)


def fun_name(eqn: Any) -> str | None:
    """The user function a custom-derivative equation wraps (`relu`), in either encoding:
    the `Traced` of `CustomJVPTraced`/`CustomVJPTraced`, or the `call_jaxpr`'s debug
    info of `custom_jvp_call`/`custom_vjp_call`."""
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
    """Whether this JAX has the upgrade flag `jax_<name>` (`remat3`, `scan3`, ...)."""
    return _flag_state(name) is not None


def flag_on(name: str) -> bool:
    """The current value of the upgrade flag `jax_<name>` (False where JAX lacks it)."""
    state = _flag_state(name)
    return bool(state is not None and state.value)


def float8_residuals_exact() -> bool:
    """Whether a float8 value that a `custom_vjp` forward pass names for a `jax.checkpoint`
    to save reaches the backward pass unchanged. Not with `jax_remat3` and
    `jax_custom_vjp3` both on (JAX 0.12.0.1: some values come back changed; either flag
    alone, bfloat16 and integer values are exact): there the float8 residuals of
    `autocast._fp8` are saved as their `uint8` bits."""
    return not (flag_on("remat3") and flag_on("custom_vjp3"))


def checkpoint_keeps_custom_vjp_operands() -> bool:
    """Whether a `jax.checkpoint` whose policy saves a `custom_vjp` 's primal operand
    (a matmul result it names) keeps it even where the backward pass reads only the
    residuals the forward pass named: so under `jax_remat3` (JAX 0.12.0.1). A float8 copy
    kept besides it would then add bytes instead of replacing them."""
    return flag_on("remat3")


def with_flag(name: str, value: bool = True) -> contextlib.AbstractContextManager:
    """A context manager that sets `jax_<name>` for what is traced (on JAX 0.9, for what is
    decorated: define the function inside). Raises `ValueError` where JAX lacks the flag."""
    state = _flag_state(name)
    if state is None:
        raise ValueError(f"with_flag(name={name!r}): this JAX ({jax.__version__}) has no flag jax_{name}")
    return state(value)


_AbstractRef = _class("jax._src.state.types", "AbstractRef")
CheckpointName = _class("jax._src.ad_checkpoint", "CheckpointName")
CheckpointNameFwd = _class("jax._src.ad_checkpoint", "CheckpointNameFwd")


def is_ref(x: Any) -> bool:
    """A mutable array reference (`jax.new_ref`; a scan carry under `jax_scan3`): its
    dtype is fixed when it is made, so it is never cast."""
    aval = getattr(x, "aval", None) if is_tracer(x) else None
    return _AbstractRef is not None and isinstance(aval, _AbstractRef)


def is_ref_aval(aval: Any) -> bool:
    return _AbstractRef is not None and isinstance(aval, _AbstractRef)


def hijax_flags() -> dict[str, Any]:
    """JAX's upgrade flags for the hijax encodings that this JAX has, by name (those of
    `HIJAX_FLAGS`): each value is the config state, usable as a context manager
    (`with flags["remat3"](True): ...`)."""
    return {n: state for n in HIJAX_FLAGS if callable(state := _flag_state(n))}


def splash_attention() -> Any:
    """Pallas's TPU splash attention module (`make_splash_mha`, `make_splash_mqa`, the mask
    classes, `SegmentIds`), or None where this JAX has none. Imported on first use (Pallas's
    import is not free); pure Python, so it traces on any machine (JAX 0.9.2 .. 0.12 ship it at
    `jax.experimental.pallas.ops.tpu.splash_attention` with the same names)."""
    global _SPLASH
    if _SPLASH is None:
        try:
            _SPLASH = importlib.import_module("jax.experimental.pallas.ops.tpu.splash_attention")
        except ImportError:  # a JAX without Pallas's TPU ops
            _SPLASH = False
    return _SPLASH or None


_SPLASH: Any = None


def tpu_compiler() -> bool:
    """Whether a program traced here can be compiled for a TPU: the default backend is one, or
    libtpu is installed (`jax[tpu]`: a deviceless compile on a CPU machine, `get_topology_desc`).
    Elsewhere a TPU branch would only cost its trace."""
    return jax.default_backend() == "tpu" or _libtpu_installed()


@functools.cache
def _libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def explicitly_sharded(aval: Any) -> bool:
    """Whether an abstract value is sharded along an axis of a mesh in JAX's explicit sharding
    mode (`AxisType.Explicit`: its sharding is part of its type, and every operation's result
    sharding must follow from its operands'). `aval.sharding`: JAX 0.9.2 .. 0.12 (a mesh with
    no axes where nothing is sharded)."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    if mesh is None or explicit is None or explicit not in tuple(getattr(mesh, "axis_types", ())):
        return False
    return any(p is not None for p in getattr(sharding, "spec", ()))


def partitioned_tpus() -> int:
    """How many TPU devices XLA may partition a program traced here over (GSPMD / Shardy): 1
    inside a `shard_map` manual over every axis of its mesh (each device runs its own shard's
    program) and where the default backend is not a TPU (a CPU or GPU machine: a deviceless
    compile's target is not visible at trace time), else the TPU backend's device count.
    `jax.sharding.get_abstract_mesh` and `AbstractMesh.manual_axes`: JAX 0.9.2 .. 0.12."""
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()))
    if names and set(getattr(mesh, "manual_axes", ())) == set(names):
        return 1
    return jax.device_count() if jax.default_backend() == "tpu" else 1
