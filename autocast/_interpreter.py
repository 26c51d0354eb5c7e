"""The interpreter: re-evaluate a jaxpr, equation by equation, under a casting policy.

For each equation the interpreter reads its operands (as they arrive: some already in
half precision), finds the rule (``amp_stop`` first, then named scopes outermost first,
then the primitive, then registered rules, then ``"amp_default"``), lets the rule cast the
operands, checks what the rule returned, and binds the primitive in the equation's own
context (source location, name stack, abstract mesh). Primitives that hold jaxprs (``jit``,
``scan``, ``while``, ``cond``, ``checkpoint``, ``custom_jvp_call``, ``custom_vjp_call``,
``shard_map``, ...) are not ruled on: the planner finds their handler in the table of
:mod:`autocast._registry` (filled by :mod:`autocast._higher_order`), and the handler
transforms their bodies with the same policy.

Values are cast where a consumer needs it, never after a producer: a matmul result stays
in half precision until an operation whose rule wants float32. A matmul whose result only
float32 operations read (and no recomputed island) stores a float32 result instead, with a
half-precision derivative (:mod:`autocast._wide`; the planner's ``wide`` set). The
gradient of a free operand narrowed from float32 (a parameter) leaves its matmul in float32
(:mod:`autocast._wide` again; ``Context.float32_cotangents``), so data-parallel and FSDP
gradient reductions run in float32.

Sharp edges:

- A value is *free* if it is a function input, a constant or a literal, or was only
  reshaped, broadcast, sliced, converted, added or subtracted from free values. Free operands adapt to
  computed ones when an operation harmonises dtypes (``use_input_precision``): this keeps a
  float32 bias from dragging a half-precision activation to float32.
- Custom derivatives (``custom_jvp`` / ``custom_vjp``): the body and the rules run in the
  dtypes their operands arrive in, under the same policy; the user's ``bwd`` is called
  with the residuals and cotangents as they arrive (adapted at its boundary if it cannot
  take them). See :mod:`autocast._higher_order`.
- Loop carries keep the dtype the initial value arrives in (a float32 one made from
  parameters or inputs that the body turns half starts half, as unrolled); branch outputs that differ
  between ``cond`` branches are cast back to their traced dtype.
- An elementwise operation whose results are only consumed in float32 runs in float32
  (``_plan.py``), so ``x - max(x)`` before an ``exp`` is not rounded to half first. This
  sees through nested bodies: outputs of ``jit``/``checkpoint``/``scan``/custom-derivative
  bodies consumed only in float32 are computed in float32, and operands that ``jit``,
  ``checkpoint`` and ``scan`` bodies read only in float32 are cast once, outside (see
  :func:`autocast._plan.input_pulls`).
- With ``remat_float32`` each contiguous run of float32 equations is evaluated inside its
  own ``jax.checkpoint`` (an island), so their float32 results are recomputed in the
  backward pass rather than saved; with ``"auto"`` only where that cuts what the island
  keeps by a large factor (``_worth_recomputing``). A recomputed island's checkpoint also
  holds the matmuls that read it and saves only their outputs (``_absorbed_end``), so their
  half-precision operand is recomputed, not kept; and a product of two activations that
  only the island reads (attention's scores before the softmax, ``_lead_ins``), so the
  product is recomputed from its operands, which its own derivative keeps anyway.
- A float32 result that only half-precision consumers read, through operations that
  commute with rounding (``relu``, data movement), is rounded where it is made
  (``_narrow``; the planner's ``narrow`` set).
- An operand narrowed from float32 that an elementwise operation broadcasts (a bias) is
  broadcast in float32 first, so its gradient (the transpose of the broadcast) is summed in
  float32 (``_bind_broadcast_in_float32``). Islands are local: an enclosing user checkpoint keeps
  its policy (an outer checkpoint policy would override nested ones).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from . import _compat, _cpu_matmul, _dtypes, _fp8, _plan, _rules, _wide
from ._policy import Lookup

# Primitives whose output is only a rearrangement (or a conversion) of their float
# operands: a value made by them from free values is free too.
_STRUCTURAL = _plan.LAYOUT | {
    "broadcast_to",
    "convert_element_type",
    "device_put",
    "gather",
    "iota",
    "reshard",
    "select_n",
    "sharding_constraint",
    "stop_gradient",
    "tile",
}
# ... and sums of free values: ``embedding + position`` is still made from parameters only,
# so a half-precision activation added to it keeps it half (as a bias add would).
_SUMS = frozenset({"add", "sub", "neg", "add_any"})
_SCATTERS = frozenset({"scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"})
#: The free flag of a value made only from literals (``jnp.zeros``, ``jnp.full``): free,
#: and known to be a constant (truthy wherever a free flag is tested).
LITERAL = "literal"

# Elementwise primitives that broadcast size-1 (and rank-0) operands implicitly. Autodiff
# transposes that broadcast into a ``reduce_sum`` in the dtype of the operand as bound.
_IMPLICIT_BROADCAST = frozenset(
    {"add", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "nextafter", "clamp", "select_n", "add_any"}
)
# ... of which these are linear in every float operand: autodiff saves none of them.
_LINEAR_BROADCAST = frozenset({"add", "sub", "select_n", "add_any"})


# The sums of a matmul result and a bias that feed an expensive elementwise function in the
# jaxpr being evaluated (``_plan.Plan.bias_sums``).
_BIAS_SUMS: contextvars.ContextVar[frozenset] = contextvars.ContextVar("bias_sums", default=frozenset())


# The small sums (norm statistics) a recomputed island saves in the jaxpr being evaluated
# (``_plan.Plan.statistics``).
_STATISTICS: contextvars.ContextVar[frozenset] = contextvars.ContextVar("statistics", default=frozenset())


@contextlib.contextmanager
def _planned(bias_sums: frozenset, statistics: frozenset):
    tokens = _BIAS_SUMS.set(bias_sums), _STATISTICS.set(statistics)
    try:
        yield
    finally:
        _BIAS_SUMS.reset(tokens[0])
        _STATISTICS.reset(tokens[1])


class Context:
    """What stays fixed while one function is transformed: dtype, policy, caches."""

    def __init__(self, compute_dtype: np.dtype, policy: Any, remat: bool | str = "auto"):
        self.compute_dtype = compute_dtype
        # ``remat``: find float32 islands at all; ``remat_auto``: recompute only those
        # that the cost model says pay off (see ``_worth_recomputing``).
        self.remat = remat is not False and compute_dtype != _dtypes.FLOAT32
        self.remat_auto = remat == "auto"
        # whether matmuls read only in float32 may store float32 results (``_wide``): not
        # inside a user checkpoint whose policy may save matmul results
        self.widen = True
        # whether the cotangent of a matmul operand narrowed from float32 (a parameter) is
        # accumulated in float32 (``_wide``); off: in the compute dtype (less bandwidth)
        self.float32_cotangents = True
        # whether evaluation is inside a recomputed island's checkpoint or a user checkpoint
        # that saves nothing (a custom JVP call that computes in float32, or an island, then
        # needs no checkpoint of its own: it would be recomputed twice)
        self.recomputed = False
        self.lookup = Lookup(policy)
        self._jaxpr_cache: dict[Any, Any] = {}
        self._keep_alive: list[Any] = []
        # Observation hook for ``autocast.explain`` (None otherwise): an object with
        # ``enter(eqn)`` (before an equation is evaluated: nested bodies are evaluated until the
        # matching call below) and ``exit(eqn, kind, rule, scopes, arrived, bound, outs, island)``
        # (after it; ``arrived``/``bound``: operands before/after the rule; ``island``: None, or
        # ``(marker, recomputed)`` shared by the equations of one float32 island).
        self.observer: Any = None
        # How a custom VJP's ``bwd`` runs: "amp" (traced in the traced dtypes, re-evaluated
        # under this policy, as the forward) or "original" (called as written on the values as
        # they arrive); see ``autocast._higher_order.custom_vjp``.
        self.custom_vjp_bwd = "amp"
        # For the handler of a call (``jit``, ``checkpoint``) only: which of its outputs every
        # consumer reads in the compute dtype (see ``_plan.plan``); its body narrows them.
        self.out_narrow: Sequence[bool] | None = None

    def narrowing(self, out_narrow: Sequence[bool] | None) -> Context:
        """This context (same caches), telling a call's handler which outputs to narrow."""
        other = copy.copy(self)
        other.out_narrow = out_narrow
        return other

    def without_widening(self) -> Context:
        """This context (same caches), with ``widen`` off."""
        other = copy.copy(self)
        other.widen = False
        return other

    def without_islands(self) -> Context:
        """This context (same caches), finding no float32 islands: for a custom JVP rule,
        whose call is recomputed as a whole instead (JAX cannot linearize a checkpoint
        inside a custom JVP rule under ``jax_remat3``)."""
        other = copy.copy(self)
        other.remat = False
        return other

    def inside_recomputed_island(self) -> Context:
        """This context (same caches), for evaluation inside a recomputed island (or a
        checkpoint that saves nothing)."""
        other = copy.copy(self)
        other.recomputed = True
        return other

    def cached(self, key: tuple, jaxpr_like: Any, build):
        """Memoise a sub-jaxpr rewrite on (jaxpr object, dtypes, scopes, ...)."""
        full_key = (id(jaxpr_like), self.widen, self.remat, self.recomputed, *key)
        if full_key not in self._jaxpr_cache:
            self._keep_alive.append(jaxpr_like)  # keeps id() unique while cached
            self._jaxpr_cache[full_key] = build()
        return self._jaxpr_cache[full_key]


def eval_jaxpr(
    ctx: Context,
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    free: Sequence[bool],
    scopes: tuple[str, ...],
    out_float32: Sequence[bool] | None = None,
    out_narrow: Sequence[bool] | None = None,
) -> tuple[list[Any], list[bool]]:
    """Evaluate an open jaxpr under ``ctx``; returns the outputs and their free flags.

    ``out_float32[i]`` says that output ``i`` will be cast to float32 by the caller (so
    computing it in float32 costs nothing extra).
    """
    env: dict[Any, tuple[Any, bool]] = {}

    def read(v):
        if isinstance(v, _compat.Literal):
            return v.val, LITERAL
        return env[v]

    free_it = iter(free)
    for var, val, is_const in _compat.bind_inputs(jaxpr, consts, args):
        env[var] = (val, True if is_const else next(free_it))

    if ctx.out_narrow is not None:  # meant for the handler that called us, not nested calls
        ctx = ctx.narrowing(None)
    plan, island, narrow, wide, bias_sums, statistics = _plan.plan(
        ctx, jaxpr, scopes, out_float32 or [False] * len(jaxpr.outvars), out_narrow
    )
    with _dtypes.memoised_casts(), _planned(bias_sums, statistics):
        _eval_eqns(ctx, jaxpr, plan, island, narrow, wide if ctx.widen else {}, env, read, scopes)
    results = [read(v) for v in jaxpr.outvars]
    return [x for x, _ in results], [f for _, f in results]


def _eval_eqns(
    ctx: Context,
    jaxpr: Any,
    plan: list,
    island: list[bool],
    narrow: set,
    wide: dict,
    env: dict,
    read,
    scopes: tuple[str, ...],
) -> None:
    eqns = jaxpr.eqns
    last_use: dict[Any, int] = {}
    feeds_recomputed = _recomputed_consumers(ctx, eqns, plan, island, wide, env) if wide else None
    if any(island):
        for i, eqn in enumerate(eqns):
            for v in eqn.invars:
                if not isinstance(v, _compat.Literal):
                    last_use[v] = i
        for v in jaxpr.outvars:
            if not isinstance(v, _compat.Literal):
                last_use[v] = len(eqns)
    lead = _lead_ins(eqns, plan, island, jaxpr.outvars) if any(island) and not ctx.recomputed else {}
    i = 0
    while i < len(eqns):
        j = _island_end(eqns, plan, island, lead[i]) if i in lead else i
        if j > i and _recomputes(ctx, eqns[i:j], read):
            # an activation product that only the island reads: recomputed with it
            k = _absorbed_end(eqns, plan, island, j, lead)
            _eval_island(ctx, eqns[i:k], plan[i:k], env, read, scopes, last_use, k, j - i)
            j = k
        elif not island[i]:
            widen = feeds_recomputed is not None and i in wide and not feeds_recomputed(i)
            _eval_eqn(ctx, eqns[i], plan[i], env, read, scopes, widen=widen)
            j = i + 1
        else:
            j = _island_end(eqns, plan, island, i)
            if not _recomputes(ctx, eqns[i:j], read):
                marker = (object(), False)
                for k in range(i, j):
                    _eval_eqn(ctx, eqns[k], plan[k], env, read, scopes, marker)
            else:
                k = _absorbed_end(eqns, plan, island, j, lead)
                _eval_island(ctx, eqns[i:k], plan[i:k], env, read, scopes, last_use, k, j - i)
                j = k
        if narrow:
            _narrow(ctx, eqns[i:j], narrow, env)
        i = j


def _narrow(ctx: Context, eqns: Sequence[Any], narrow: set, env: dict) -> None:
    """Round the float32 results that only half-precision consumers read (see
    :func:`autocast._plan.plan`) to the compute dtype where they are made."""
    for eqn in eqns:
        for v in eqn.outvars:
            if v in narrow and v in env:
                x, free = env[v]
                if _dtypes.dtype_of(x) == _dtypes.FLOAT32 and not free:
                    with _compat.user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack):
                        env[v] = (_dtypes.cast(x, ctx.compute_dtype), free)


def _recomputed_consumers(ctx: Context, eqns: Sequence[Any], plan: list, island: list[bool], wide: dict, env: dict):
    """For the matmuls in ``wide`` (index -> indices of their readers): a test of whether one
    of them feeds an island that will be recomputed. Such a matmul keeps its half-precision result: the island's checkpoint
    saves its inputs, and a float32 one would double them. The decision the island takes
    when it is reached is estimated here with the values at hand, counting the results of
    matmuls not evaluated yet in the compute dtype."""
    if not ctx.remat:
        return lambda i: False
    segment: dict[int, tuple[int, int]] = {}  # island equation -> its island's (start, end)
    i = 0
    while i < len(eqns):
        if island[i]:
            j = _island_end(eqns, plan, island, i)
            segment.update((k, (i, j)) for k in range(i, j))
            i = j
        else:
            i += 1
    made_by_matmul = {
        v
        for eqn, step in zip(eqns, plan)
        if step[0] == _plan.RULE and _rules.is_compute_rule(step[1])
        for v in eqn.outvars
    }

    def nbytes(v):
        if v in env:
            return _nbytes(env[v][0])
        dtype = ctx.compute_dtype if v in made_by_matmul else v.aval.dtype
        return v.aval.size * np.dtype(dtype).itemsize

    def recomputed(start: int, end: int) -> bool:
        if all(_plan.is_linear(e) for e in eqns[start:end]):
            return False
        return not ctx.remat_auto or _worth_recomputing(eqns[start:end], nbytes)

    def feeds(i: int) -> bool:
        return any(recomputed(*se) for se in {segment[k] for k in wide[i] if k in segment})

    return feeds


def _recomputes(ctx: Context, eqns: Sequence[Any], read) -> bool:
    """Whether an island (with its lead-in) is evaluated in its own checkpoint."""
    if ctx.recomputed:  # inside a recomputed island or checkpoint: recomputed already
        return False
    if all(_plan.is_linear(e) for e in eqns):
        return False
    return not ctx.remat_auto or _worth_recomputing(eqns, lambda v: _nbytes(read(v)[0]))


def _lead_ins(eqns: Sequence[Any], plan: list, island: list[bool], outvars: Sequence[Any]) -> dict[int, int]:
    """Islands' lead-ins: ``{start: island start}``.

    A lead-in is a compute-rule ``dot_general`` of two computed values (attention's
    ``q @ k.T``) whose result, larger than either operand, only the island reads, possibly
    through single-use equations with one array operand (a scale, a mask's ``where``).
    Evaluated in the island's checkpoint, the product is recomputed in the backward pass
    instead of saved as the island's input: the backward pass keeps its operands anyway
    (its own derivative reads them), so this saves the product's bytes for one matmul's
    FLOPs (attention's scores: the largest activation of a transformer).
    """
    readers = _readers(eqns, outvars)
    producer = {v: eqn for eqn in eqns for v in eqn.outvars}

    def computed(v: Any) -> bool:
        while not isinstance(v, _compat.Literal) and v in producer:
            eqn = producer[v]
            if not _plan.is_linear(eqn):
                return True
            arrays = [u for u in eqn.invars if not isinstance(u, _compat.Literal) and u.aval.size > 1]
            if len(arrays) != 1:
                return False
            v = arrays[0]
        return False

    found: dict[int, int] = {}
    for j in range(1, len(eqns)):
        if not island[j] or island[j - 1]:
            continue
        end = _island_end(eqns, plan, island, j)
        k, wanted = j - 1, {v for e in eqns[j:end] for v in e.invars if not isinstance(v, _compat.Literal)}
        while k >= 0 and not eqns[k].effects:
            eqn = eqns[k]
            out = eqn.outvars[0] if len(eqn.outvars) == 1 else None
            # read by the island (and the lead-in after it) only
            if out is None or out not in wanted or not readers.get(out, set()) <= set(range(k + 1, end)):
                break
            if plan[k][0] == _plan.RULE and _rules.is_compute_rule(plan[k][1]) and eqn.primitive.name == "dot_general":
                ops = [v for v in eqn.invars if not isinstance(v, _compat.Literal)]
                if len(ops) == 2 and all(computed(v) for v in ops) and out.aval.size >= max(v.aval.size for v in ops):
                    found[k] = j
                break
            arrays = [
                u
                for u in eqn.invars
                if not isinstance(u, _compat.Literal) and _dtypes.is_castable(u.aval.dtype) and u.aval.size > 1
            ]
            if len(arrays) != 1:
                break
            wanted = {arrays[0]}
            k -= 1
    return found


def _readers(eqns: Sequence[Any], outvars: Sequence[Any] = ()) -> dict[Any, set[int]]:
    """Variable -> the indices of the equations that read it (``len(eqns)`` for ``outvars``:
    read after the equations)."""
    readers: dict[Any, set[int]] = {}
    for n, eqn in enumerate(eqns):
        for v in eqn.invars:
            if not isinstance(v, _compat.Literal):
                readers.setdefault(v, set()).add(n)
    for v in outvars:
        if not isinstance(v, _compat.Literal):
            readers.setdefault(v, set()).add(len(eqns))
    return readers


def _island_end(eqns: Sequence[Any], plan: list, island: list[bool], i: int) -> int:
    """End of the island starting at ``i``: the run of float32 equations, continued over
    equations without float results (integer index arithmetic between a norm's statistics
    and its normalisation) when more float32 equations follow, so that one island does not
    hand a float32 activation to the next."""
    j = i
    while True:
        while j < len(eqns) and island[j]:
            j += 1
        k = j
        while k < len(eqns) and not island[k] and _bridges(eqns[k], plan[k]):
            k += 1
        if k == j or k == len(eqns) or not island[k]:
            return j
        j = k


def _bridges(eqn: Any, step: tuple[str, Any]) -> bool:
    return step[0] == _plan.RULE and not eqn.effects and not any(_dtypes.is_castable(v.aval.dtype) for v in eqn.outvars)


def _eval_eqn(
    ctx: Context,
    eqn: Any,
    step: tuple[str, Any],
    env: dict,
    read,
    scopes: tuple[str, ...],
    island: Any = None,
    widen: bool = False,
) -> None:
    kind, rule = step
    read_in = [read(v) for v in eqn.invars]
    invals = [x for x, _ in read_in]
    in_free = [f for _, f in read_in]
    eqn_scopes = scopes + _compat.scope_names(eqn.source_info.name_stack)
    if ctx.observer is not None:  # autocast.explain (see Context.observer)
        ctx.observer.enter(eqn)
    bound = invals
    with (
        _compat.user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack),
        _compat.eqn_context(eqn),
    ):
        if kind == _plan.STOP:
            outs = _bind_original(eqn, invals)
            out_free = [False] * len(outs)
        elif kind == _plan.HIGHER:
            handler, out32, pulls, outn = rule
            # operands the bodies consume only in float32: cast once, here, so every
            # float32 consumer of the value (inside and outside) reads the same value
            invals = [
                _dtypes.cast(x, _dtypes.FLOAT32) if p is True and _dtypes.is_castable(v.aval.dtype) else x
                for x, p, v in zip(invals, pulls, eqn.invars)
            ]
            hctx = ctx.narrowing(outn) if any(outn) else ctx
            if island is not None and island[1] and not ctx.recomputed:
                hctx = hctx.inside_recomputed_island()
            outs, out_free = handler(hctx, eqn, invals, in_free, eqn_scopes, out32)
        else:
            outs, out_free, bound = _apply_rule(ctx, eqn, rule, invals, in_free, widen)
            if len(outs) == 1 and eqn.outvars[0] in _STATISTICS.get() and (ctx.recomputed or (island and island[1])):
                # a row statistic: saved by the island's checkpoint (``_plan.Plan.statistics``)
                outs = [checkpoint_name(x, _compat.SAVED_NAME) for x in outs]
    if ctx.observer is not None:
        ctx.observer.exit(eqn, kind, rule, eqn_scopes, invals, bound, outs, island)
    for var, val, f in zip(eqn.outvars, outs, out_free):
        if not isinstance(var, _compat.DropVar):
            env[var] = (val, f)


def _island_inputs(eqns: Sequence[Any]) -> list[Any]:
    defined = {v for eqn in eqns for v in eqn.outvars}
    inputs: list[Any] = []
    for eqn in eqns:
        for v in eqn.invars:
            if not isinstance(v, _compat.Literal) and v not in defined and v not in inputs:
                inputs.append(v)
    return inputs


def _nbytes(x: Any) -> int:
    return int(np.size(x)) * _dtypes.dtype_of(x).itemsize


# An island fed by half-precision activations keeps at least twice their bytes in float32
# (ratio 2: a softmax's exp); an LSTM cell updating a float32 carry about 1.6 times.
_RECOMPUTE_RATIO = 1.75


def _worth_recomputing(eqns: Sequence[Any], nbytes) -> bool:
    """The island cost model of ``remat_float32="auto"``: recompute an island only if that
    cuts the memory it keeps for the backward pass by a large factor (``_RECOMPUTE_RATIO``).

    Recomputed, the island keeps its inputs (in the dtypes they arrive in). Not
    recomputed, the backward pass keeps its float32 intermediates, estimated as the float32
    results of its non-linear operations (each is, or is the size of, a value their
    derivative needs). An island fed by half-precision activations always qualifies (each
    float32 value is twice its half-precision source); one whose inputs are float32
    activations of its own size (an LSTM cell updating a float32 carry) does not: there the
    recomputation would cost a second evaluation for a small saving.
    """
    kept_if_recomputed = sum(
        nbytes(v) for v in _island_inputs(eqns) if _dtypes.is_castable(v.aval.dtype)
    )  # integer and boolean inputs (labels, masks) are small or kept by their users anyway
    kept_if_saved = sum(
        v.aval.size * _dtypes.FLOAT32.itemsize
        for eqn in eqns
        if not _plan.is_linear(eqn)
        for v in eqn.outvars
        if _dtypes.is_castable(v.aval.dtype) and not isinstance(v, _compat.DropVar)
    )
    return kept_if_saved >= _RECOMPUTE_RATIO * kept_if_recomputed


def _absorbed_end(eqns: Sequence[Any], plan: list, island: list[bool], j: int, lead: Mapping[int, int]) -> int:
    """End of a recomputed island extended over the matmuls that read it.

    The matmul (convolution) after a layer norm, a softmax or GELU needs its half-precision
    operand for the backward pass (the weight gradient): saved, it is an activation the size
    of the island's output. Evaluated in the island's ``jax.checkpoint``, with a policy that
    saves only the matmul outputs, that operand is recomputed with the island, which the
    backward pass recomputes anyway. The island extends over the compute-rule equations
    that follow it and the linear ones between them (reshapes, bias adds, weight casts),
    up to the last compute-rule one and not over the next island's lead-in (``lead``);
    nothing non-linear is recomputed twice.
    """
    k, last = j, j
    while k < len(eqns) and not island[k] and k not in lead and not eqns[k].effects and plan[k][0] == _plan.RULE:
        if _rules.is_compute_rule(plan[k][1]):
            last = k + 1
        elif not _plan.is_linear(eqns[k]):
            break
        k += 1
    return last


def _eval_island(
    ctx: Context,
    eqns: Sequence[Any],
    steps: Sequence,
    env: dict,
    read,
    scopes,
    last_use: dict,
    end: int,
    n_island: int | None = None,
) -> None:
    """Evaluate a run of float32 equations inside ``jax.checkpoint``: the backward pass
    recomputes them from the island's inputs (half-precision activations, parameters)
    instead of keeping their float32 results. Equations after the first ``n_island`` are
    the matmuls that read the island (see :func:`_absorbed_end`): only their outputs are
    saved."""
    n_island = len(eqns) if n_island is None else n_island
    inputs = _island_inputs(eqns)
    outputs = [
        v for eqn in eqns for v in eqn.outvars if not isinstance(v, _compat.DropVar) and last_use.get(v, -1) >= end
    ]
    if not outputs:
        return
    in_vals = [read(v) for v in inputs]
    out_free: list[bool] = []
    marker = (object(), True)  # for Context.observer: one recomputed island
    kept_for_matmul = _kept_for_matmul(eqns, steps, n_island, outputs)

    def island(*args):
        local = {v: (x, f) for v, x, (_, f) in zip(inputs, args, in_vals)}

        def local_read(v):
            return (v.val, LITERAL) if isinstance(v, _compat.Literal) else local[v]

        with _dtypes.memoised_casts(), _fp8.in_checkpoint(kept_for_matmul):
            for n, (eqn, step) in enumerate(zip(eqns, steps)):
                _eval_eqn(ctx, eqn, step, local, local_read, scopes, marker if n < n_island else None)
                if n >= n_island and _rules.is_compute_rule(step[1]):
                    for v in eqn.outvars:  # the absorbed matmuls' results: saved
                        if v in local and _dtypes.is_floating(_dtypes.dtype_of(local[v][0])):
                            local[v] = (checkpoint_name(local[v][0], _compat.SAVED_NAME), local[v][1])
        out_free[:] = [local[v][1] for v in outputs]
        return [local[v][0] for v in outputs]

    dead = _tangent_free(eqns, inputs, outputs)
    args = [lax.stop_gradient(x) if v in dead else x for v, (x, _) in zip(inputs, in_vals)]
    outs = _compat.checkpoint(island)(*args)
    for v, x, f in zip(outputs, outs, out_free):
        env[v] = (x, f)


def _kept_for_matmul(eqns: Sequence[Any], steps: Sequence, n_island: int, outputs: Sequence[Any]):
    """The values an island's checkpoint saves only for one matmul: the result of a saved
    matmul (attention's ``probs @ values``) carried through linear equations (reshapes,
    transposes), each read once and never outside the island. A float8 matmul reading one
    keeps its float8 copy instead of having the half-precision value saved (half the bytes);
    not where the checkpoint would keep the value anyway (``jax_remat3``)."""
    if _compat.checkpoint_keeps_custom_vjp_operands():
        return frozenset()
    readers = _readers(eqns, outputs)  # an output: read outside the island too
    found: set = set()
    for n, (eqn, (_, rule)) in enumerate(zip(eqns, steps)):
        if n >= n_island and _rules.is_compute_rule(rule):
            root = True
        else:
            floats = [v for v in eqn.invars if not isinstance(v, _compat.Literal) and _dtypes.is_floating(v.aval.dtype)]
            root = _plan.is_linear(eqn) and len(floats) == 1 and floats[0] in found
        if root:
            found.update(v for v in eqn.outvars if len(readers.get(v, ())) == 1 and len(eqns) not in readers[v])
    return frozenset(found)


def _tangent_free(eqns: Sequence[Any], inputs: Sequence[Any], outputs: Sequence[Any]) -> set:
    """The float inputs of an island whose tangent it never uses: read only through
    ``stop_gradient`` or into non-float results (a softmax's ``max``). They enter its
    checkpoint through ``stop_gradient``: JAX's ``jax_remat3`` checkpoint keeps the tangent of
    every input alive, and with it the residuals of the JVP that made it (the ``max``'s mask,
    the size of the logits)."""
    needs = set(outputs)
    for eqn in reversed(eqns):
        if eqn.primitive.name == "stop_gradient":
            continue
        if any(v in needs and _dtypes.is_floating(v.aval.dtype) for v in eqn.outvars):
            needs.update(v for v in eqn.invars if not isinstance(v, _compat.Literal))
    return {v for v in inputs if v not in needs and _dtypes.is_floating(v.aval.dtype)}


def transform_jaxpr(
    ctx: Context,
    jaxpr_like: Any,
    in_dtypes: Sequence[Any],
    in_free: Sequence[bool],
    scopes: tuple[str, ...],
    out_dtypes: Sequence[Any | None] | None = None,
    out_float32: Sequence[bool] | None = None,
    out_narrow: Sequence[bool] | None = None,
    closed: bool = False,
) -> tuple[Any, list[Any], list[bool]]:
    """Transform a (closed or open) jaxpr for operands of ``in_dtypes``.

    Outputs are cast to ``out_dtypes`` where given (``None`` entries: any dtype);
    ``out_float32[i]`` says output ``i`` is consumed only in float32 (default: the outputs
    cast to float32); ``out_narrow[i]`` that every consumer reads output ``i`` in the compute
    dtype (a float32 result is then rounded where it is made). Returns ``(new, extra_consts, out_free)``: a closed jaxpr comes back
    closed with ``extra_consts == []``; an open one comes back open, with any constants it
    needs turned into leading invars and returned as ``extra_consts`` (to be passed as
    leading operands). ``out_free`` tells which outputs are free values. ``closed``: the
    jaxpr is a closed one by its primitive's contract (``jit``, ``scan``, ``while``,
    ``cond``), so its new constants stay attached to it (JAX >= 0.11 has one class for both,
    and binding such a primitive on extra operands would not match its other parameters).
    """
    if out_float32 is None and out_dtypes is not None:
        out_float32 = [d is not None and d == _dtypes.FLOAT32 for d in out_dtypes]
    key = (
        tuple(map(str, in_dtypes)),
        tuple(in_free),
        scopes,
        None if out_dtypes is None else tuple(map(str, out_dtypes)),
        None if out_float32 is None else tuple(map(bool, out_float32)),
        None if out_narrow is None else tuple(map(bool, out_narrow)),
        closed,
    )

    def build():
        open_, consts = _compat.open_and_consts(jaxpr_like)
        in_avals = [_compat.aval_with_dtype(v.aval, d) for v, d in zip(open_.invars, in_dtypes)]
        out_free: list[bool] = []

        def fun(*args):
            outs, free = eval_jaxpr(ctx, open_, consts, args, in_free, scopes, out_float32, out_narrow)
            if out_dtypes is not None:
                outs = [x if d is None else _dtypes.cast(x, d) for x, d in zip(outs, out_dtypes)]
            out_free[:] = free
            return outs

        new_open, new_consts = _compat.trace_to_jaxpr(fun, in_avals)
        if closed or _compat.is_closed(jaxpr_like):
            return (_compat.close_jaxpr(new_open, new_consts), []), list(out_free)
        if new_consts:
            return (_compat.constvars_to_invars(new_open), list(new_consts)), list(out_free)
        return (new_open, []), list(out_free)

    (new, extra), out_free = ctx.cached(key, jaxpr_like, build)
    return new, extra, list(out_free)


def original_dtypes(eqn: Any) -> list[Any]:
    return [v.aval.dtype for v in eqn.invars]


def _bind_original(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Bind the equation exactly as traced (operands cast back to their traced dtypes)."""
    invals = [_dtypes.cast(x, d) if _dtypes.is_castable(d) else x for x, d in zip(invals, original_dtypes(eqn))]
    return _cpu_matmul.bind(eqn.primitive, invals, dict(eqn.params))


def _rule_name(rule: Any) -> str:
    return getattr(rule, "__qualname__", None) or getattr(rule, "__name__", None) or repr(rule)


def _apply_rule(ctx: Context, eqn: Any, rule: Any, invals: list[Any], in_free: list[bool], widen: bool = False):
    prim = eqn.primitive
    orig = original_dtypes(eqn)
    if rule is _rules.use_input_precision and _overflowing_constant(prim, invals, in_free):
        rule = _rules.use_float32_precision
    token = _rules._free_mask.set(in_free)
    try:
        with contextlib.ExitStack() as stack:
            fills = _traced_fills(invals, in_free)
            for i, dtype in _float32_broadcasts_ahead(eqn, prim, invals):
                if i not in fills:
                    make = functools.partial(_broadcast_cast, invals[i], eqn, dtype)
                    stack.enter_context(_dtypes.cast_override(invals[i], dtype, make))
            for i in fills:
                for half in _dtypes.HALF:
                    make = functools.partial(_dtypes.saturating_cast, invals[i], half)
                    stack.enter_context(_dtypes.cast_override(invals[i], half, make))
            result = rule(ctx.compute_dtype, orig, *invals, **dict(eqn.params))
    finally:
        _rules._free_mask.reset(token)
    new_invals, params = _check_rule_result(result, prim, rule, invals, orig)
    if prim.name in _SCATTERS:
        params = _retype_combiner(ctx, params, new_invals[0])
    # A rule may bind the equation itself (``rule.binder``, e.g. a float8 matmul): it gets the
    # operands as they arrived and as the rule cast them, and returns the outputs, or None
    # to have the equation bound as usual.
    binder = getattr(rule, "binder", None)
    outs = binder(ctx, eqn, invals, new_invals, params) if binder is not None else None
    # Matmuls read only in float32 store a float32 result (``widen``); the cotangent of a
    # free operand (a parameter) narrowed from float32 by a casting rule is accumulated in
    # float32 (``_wide``). Also for a matmul that a rule's binder declined (a float8 rule's
    # matmul too small for float8 runs in the compute dtype).
    f32_ct = (
        _wide.narrowed(invals, new_invals, in_free)
        if outs is None and ctx.float32_cotangents and _rules.casts_only(rule)
        else []
    )
    if outs is not None:
        pass
    elif (widen or f32_ct) and _wide.applies(prim, new_invals, params):
        outs = _wide.bind(prim, new_invals, params, wide=widen, arrived=invals, float32_cotangent=f32_ct)
    elif ctx.remat and (summed := _bias_into_float32(eqn, prim, invals, new_invals, in_free, ctx.compute_dtype)):
        outs = _bind_bias_summed_apart(eqn, prim, new_invals, params, summed, ctx.compute_dtype)
    else:
        outs = _bind_broadcast_in_float32(eqn, prim, invals, new_invals, params)
    floats = [f for f, d in zip(in_free, orig) if _dtypes.is_castable(d)]
    out_free: Any = False
    if (prim.name in _STRUCTURAL or prim.name in _SUMS) and all(floats):
        out_free = LITERAL if floats and all(f == LITERAL for f in floats) else True
    return outs, [out_free] * len(outs), new_invals


# Operations that only select, order or move their operands' values: a constant beyond
# the half-precision range saturates to its largest finite value and keeps its meaning (a
# mask's fill stays the most negative value). Others run in float32 with it.
_SELECTING = _plan.COMMUTES_WITH_ROUNDING | {"clamp", "select_n", "max", "min", "pmax", "pmin", "sort"}


def _overflowing_constant(prim: Any, invals: Sequence[Any], in_free: Sequence[Any]) -> bool:
    """Whether a harmonised operation (``x16 * 1e5``) would narrow a concrete constant that
    does not fit the half-precision dtype its computed operands arrive in: it then runs in
    float32, as traced, instead of turning the constant into an infinity."""
    if prim.name in _SELECTING:
        return False
    halves = {
        _dtypes.dtype_of(x)
        for x, f in zip(invals, in_free)
        if not f and _dtypes.is_castable(_dtype_or_none(x)) and _dtypes.dtype_of(x) != _dtypes.FLOAT32
    }
    return any(
        f
        and _dtypes.is_concrete(x)
        and _dtype_or_none(x) == _dtypes.FLOAT32
        and any(not _dtypes.fits(x, h) for h in halves)
        for x, f in zip(invals, in_free)
    )


def _traced_fills(invals: Sequence[Any], in_free: Sequence[Any]) -> list[int]:
    """Float32 operands made only from literals that reach the equation traced (a fill passed
    into a ``jit``, as ``jnp.where`` does): their value is not known here, so a rule's cast of
    one to half precision saturates (:func:`autocast._dtypes.saturating_cast`)."""
    return [
        i
        for i, (x, f) in enumerate(zip(invals, in_free))
        if f == LITERAL and _compat.is_tracer(x) and _dtype_or_none(x) == _dtypes.FLOAT32
    ]


def _broadcast_candidates(eqn: Any, prim: Any, invals: Sequence[Any]) -> list[int]:
    """Float32 operands (traced: they may get a gradient) that ``eqn`` broadcasts."""
    if prim.name not in _IMPLICIT_BROADCAST or len(eqn.outvars) != 1:
        return []
    out_shape = tuple(eqn.outvars[0].aval.shape)
    return [
        i
        for i, x in enumerate(invals)
        if _compat.is_tracer(x)
        and _dtype_or_none(x) == _dtypes.FLOAT32
        and tuple(np.shape(x)) != out_shape
        and len(np.shape(x)) in (0, len(out_shape))
    ]


def _broadcast_cast(x: Any, eqn: Any, dtype: Any) -> Any:
    out_shape = tuple(eqn.outvars[0].aval.shape)
    dims = tuple(range(len(out_shape))) if np.ndim(x) else ()
    return lax.convert_element_type(lax.broadcast_in_dim(x, out_shape, dims), dtype)


def _float32_broadcasts_ahead(eqn: Any, prim: Any, invals: Sequence[Any]) -> list[tuple[int, Any]]:
    """For an operation linear in its operands (``x16 + bias32``): the broadcast operands
    whose narrowing is predictable (the other float operands share one half dtype), with
    that dtype. The rule's cast of them then broadcasts in float32 first (no dead convert
    left behind); see :func:`_bind_broadcast_in_float32` for the rest."""
    if prim.name not in _LINEAR_BROADCAST:
        return []
    cands = _broadcast_candidates(eqn, prim, invals)
    others = {
        _dtype_or_none(x) for i, x in enumerate(invals) if i not in cands and _dtypes.is_castable(_dtype_or_none(x))
    }
    if not cands or len(others) != 1 or _dtypes.FLOAT32 in others:
        return []
    (half,) = others
    return [(i, half) for i in cands]


def _bind_broadcast_in_float32(
    eqn: Any, prim: Any, invals: list[Any], new_invals: list[Any], params: dict[str, Any]
) -> list[Any]:
    """Bind, broadcasting in float32 the operands that the rule narrowed from float32 and
    that the primitive broadcasts (a bias ``(1, C)`` added to ``(N, C)`` activations).

    Casting first and broadcasting in half precision would make the gradient of such an
    operand (JAX's transpose of the broadcast: a sum over the broadcast axes, thousands of
    terms for a bias) a half-precision reduction. Broadcast-then-cast is the same forward
    value, and its transpose is ``convert`` to float32 followed by ``reduce_sum`` in
    float32, which XLA fuses (no float32 activation-sized buffer). For a primitive that is
    not linear in the operand (``x * scale``) the broadcast is recomputed in the backward
    pass (``jax.checkpoint``) rather than saved as an activation-sized residual.
    """
    widen = [
        i
        for i in _broadcast_candidates(eqn, prim, invals)
        if _dtypes.dtype_of(new_invals[i]) in _dtypes.CASTABLE
        and _dtypes.dtype_of(new_invals[i]) != _dtypes.FLOAT32
        and np.shape(new_invals[i]) == np.shape(invals[i])  # not already broadcast ahead
    ]
    if not widen:
        return _cpu_matmul.bind(prim, new_invals, params)

    def bind(*ops):
        ops = list(ops)
        for i in widen:
            ops[i] = _broadcast_cast(ops[i], eqn, _dtypes.dtype_of(new_invals[i]))
        return _cpu_matmul.bind(prim, ops, params)

    ops = [invals[i] if i in widen else x for i, x in enumerate(new_invals)]
    if prim.name in _LINEAR_BROADCAST:
        return bind(*ops)
    return _compat.checkpoint(bind)(*ops)


def _bias_into_float32(
    eqn: Any, prim: Any, invals: Sequence[Any], new_invals: Sequence[Any], in_free: Sequence[Any], half: Any
) -> list[int]:
    """For ``x @ w + bias32`` bound in float32 before an expensive elementwise function
    (GELU's ``tanh``: the planner's ``bias_sums``): the broadcast float32 operands that are
    parameters or inputs (free, traced). See :func:`_bind_bias_summed_apart`."""
    if half not in _dtypes.HALF or not eqn.outvars or eqn.outvars[0] not in _BIAS_SUMS.get():
        return []
    if any(_dtype_or_none(x) != _dtypes.FLOAT32 for x in new_invals):
        return []
    return [i for i in _broadcast_candidates(eqn, prim, invals) if in_free[i] and in_free[i] != LITERAL]


def _bind_bias_summed_apart(
    eqn: Any, prim: Any, new_invals: list[Any], params: dict[str, Any], summed: Sequence[int], half: Any
) -> list[Any]:
    """Bind ``x16 + bias32`` in float32 with the bias broadcast first, its gradient (JAX's
    transpose of the broadcast) summed in float32 from the cotangent rounded to the half
    dtype behind an optimisation barrier (:func:`_rounded_cotangent`).

    The values are those of the float32 sum. The bias gradient is the sum of the cotangent
    that the half operand receives anyway (``x16``'s, rounded once, as the weight gradient
    of the matmul that made ``x16`` reads it), in a kernel of its own. Summed from the
    float32 cotangent instead, the reduction is fused into the kernel that computes the
    island's backward pass, and XLA:GPU does not fuse an expensive float32 producer (GELU's
    recomputed ``tanh``) into a reduction: the float32 ``tanh`` is written to memory and
    read back (issue 28; ``tests/test_islands.py``)."""
    out_shape = tuple(eqn.outvars[0].aval.shape)
    ops = list(new_invals)
    for i in summed:
        full = lax.broadcast_in_dim(ops[i], out_shape, tuple(range(len(out_shape))) if np.ndim(ops[i]) else ())
        ops[i] = _rounded_cotangent(full, np.dtype(half).name)
    return _cpu_matmul.bind(prim, ops, params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _rounded_cotangent(x: Any, half: str) -> Any:
    """The identity, whose cotangent is rounded to ``half`` (and converted back) behind an
    optimisation barrier: XLA cannot fuse what reads it with what made it."""
    return x


def _rounded_cotangent_fwd(x: Any, half: str) -> tuple[Any, None]:
    return x, None


def _rounded_cotangent_bwd(half: str, _: None, ct: Any) -> tuple[Any]:
    rounded = lax.optimization_barrier(lax.convert_element_type(ct, np.dtype(half)))
    return (lax.convert_element_type(rounded, _dtypes.dtype_of(ct)),)


_rounded_cotangent.defvjp(_rounded_cotangent_fwd, _rounded_cotangent_bwd)


def _describe(x: Any) -> str:
    """``a tuple of 2 arrays (float16[3], float16[3])``: what a rule returned, for errors."""
    if isinstance(x, (tuple, list)):
        inner = ", ".join(_describe_leaf(v) for v in x[:4]) + (", ..." if len(x) > 4 else "")
        return f"a {type(x).__name__} of {len(x)} ({inner})"
    return _describe_leaf(x)


def _describe_leaf(v: Any) -> str:
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return f"array {v.dtype}{list(v.shape)}"
    return type(v).__name__


def _all_arrays(x: Sequence[Any]) -> bool:
    return all(hasattr(v, "shape") and hasattr(v, "dtype") for v in x)


def _check_rule_result(result: Any, prim: Any, rule: Any, invals: Sequence[Any], orig: Sequence[Any]):
    where = f"rule {_rule_name(rule)} for primitive '{prim.name}'"
    expected = (
        "expected the pair (operands, params): the operands as a list or tuple, one per operand in order, "
        "and the params as a dict (unchanged: the **params the rule was called with)"
    )
    pair = isinstance(result, (tuple, list)) and len(result) == 2
    if not pair or not isinstance(result[0], (tuple, list)) or not isinstance(result[1], Mapping):
        lone = isinstance(result, (tuple, list)) and bool(result) and _all_arrays(result)
        hint = " (it looks like the operands alone)" if lone else ""
        raise TypeError(f"{where} returned {_describe(result)}{hint}; {expected}.")
    new_invals, params = result
    new_invals = list(new_invals)
    if len(new_invals) != len(invals):
        raise ValueError(
            f"{where} returned {len(new_invals)} operands; expected {len(invals)} (one per operand, in order)."
        )
    params = dict(params)
    for i, (new, old, o) in enumerate(zip(new_invals, invals, orig)):
        new_dt, old_dt = _dtype_or_none(new), _dtype_or_none(old)
        if _dtypes.is_castable(o):
            if new_dt is None or not _dtypes.is_floating(new_dt):
                raise TypeError(
                    f"{where} returned dtype {new_dt} for operand {i}, a floating operand "
                    f"(traced as {np.dtype(o).name}); expected a floating dtype such as float16, bfloat16 or float32."
                )
        elif new_dt != old_dt:
            raise TypeError(
                f"{where} changed operand {i} from {old_dt} to {new_dt}; only float16/bfloat16/float32 "
                f"operands may be cast (integers, booleans, keys, float64 and complex never are)."
            )
    return new_invals, params


def _dtype_or_none(x: Any) -> Any:
    dt = getattr(x, "dtype", None)
    if dt is None:
        try:
            return np.result_type(x)
        except TypeError:
            return None
    return dt


def _retype_combiner(ctx: Context, params: dict[str, Any], operand: Any) -> dict[str, Any]:
    """Scatter's scalar combiner jaxpr must have the operand's dtype."""
    jaxpr = params.get("update_jaxpr")
    dtype = _dtypes.dtype_of(operand)
    if jaxpr is None or not _compat.is_jaxpr_like(jaxpr) or not jaxpr.invars or jaxpr.invars[0].aval.dtype == dtype:
        return params
    open_, _ = _compat.open_and_consts(jaxpr)
    in_dtypes = [dtype if _dtypes.is_castable(v.aval.dtype) else v.aval.dtype for v in open_.invars]
    new, consts, _ = transform_jaxpr(
        ctx, jaxpr, in_dtypes, [False] * len(in_dtypes), (), out_dtypes=[dtype] * len(open_.outvars)
    )
    if consts:
        return params  # a combiner that closes over values: keep the traced one
    return dict(params, update_jaxpr=new)
