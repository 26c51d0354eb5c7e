"""The interpreter: re-evaluate a jaxpr, equation by equation, under a casting policy.

For each equation the interpreter reads its operands (as they arrive: some already in
half precision), finds the rule (`amp_stop` first, then named scopes outermost first,
then the primitive, then registered rules, then `"amp_default"`), lets the rule cast the
operands, checks what the rule returned, and binds the primitive in the equation's own
context (source location, name stack, abstract mesh). Primitives that hold jaxprs (`jit`,
`scan`, `while`, `cond`, `checkpoint`, `custom_jvp_call`, `custom_vjp_call`,
`shard_map`, ...) are not ruled on (unless the policy names the primitive itself): the
planner finds their handler in the table of `autocast._registry` (filled by
`autocast._higher_order`), and the handler transforms their bodies with the same policy.

Values are cast where a consumer needs it, never after a producer: a matmul result stays
in half precision until an operation whose rule wants float32. A matmul whose result only
float32 operations read (and no recomputed island) stores a float32 result instead, with a
half-precision derivative (`autocast._wide`; the plan's `wide` map). The
gradient of a free operand narrowed from float32 (a parameter) leaves its matmul in float32
(`autocast._wide` again; `Context.float32_cotangents`), so data-parallel and FSDP
gradient reductions run in float32.

Sharp edges:

- A value is *free* if it is a function input, a constant or a literal, or was only
  reshaped, broadcast, sliced, converted, added or subtracted from free values. Free operands adapt to
  computed ones when an operation harmonises dtypes (`use_input_precision`): this keeps a
  float32 bias from dragging a half-precision activation to float32.
- Custom derivatives (`custom_jvp` / `custom_vjp`): the body and the rules run in the
  dtypes their operands arrive in, under the same policy; the user's `bwd` is traced in the
  traced dtypes and re-evaluated under the same policy (`custom_vjp_bwd="amp"`, the
  default), or called as written on the residuals and cotangents as they arrive
  (`"original"`). See `autocast._custom_derivatives`.
- Loop carries keep the dtype the initial value arrives in (a float32 one made from
  parameters or inputs that the body turns half starts half, as unrolled); branch outputs that differ
  between `cond` branches are cast back to their traced dtype.
- An elementwise operation whose results are only consumed in float32 runs in float32
  (`_plan.py`), so `x - max(x)` before an `exp` is not rounded to half first. This
  sees through nested bodies: outputs of `jit`/`checkpoint`/`scan`/custom-derivative
  bodies consumed only in float32 are computed in float32, and operands that `jit`,
  `checkpoint` and `scan` bodies read only in float32 are cast once, outside (see
  `autocast._plan.input_pulls`).
- With `remat_float32` each contiguous run of float32 equations is evaluated inside its
  own `jax.checkpoint` (an island), so their float32 results are recomputed in the
  backward pass rather than saved (`autocast._islands`: which runs, at what cost, and
  what a recomputed island also holds).
- A float32 result that only half-precision consumers read, through operations that
  commute with rounding (`relu`, data movement), is rounded where it is made
  (`_narrow`; the plan's `narrow` set).
- An operand narrowed from float32 that an elementwise operation broadcasts (a bias) is
  broadcast in float32 first, so its gradient (the transpose of the broadcast) is summed in
  float32 (`autocast._binding`). Islands are local: an enclosing user checkpoint keeps
  its policy (an outer checkpoint policy would override nested ones).

The modules: this one holds the evaluation loop (`eval_jaxpr`, `transform_jaxpr`);
`autocast._rewrites` first applies the registered whole-program rewrites (the fused
attention of `autocast._attention`: each span the policy lets fuse becomes one equation); `autocast._plan` decides each equation's step before the loop runs;
`autocast._binding` casts and binds one equation; `autocast._islands` evaluates the
recomputed float32 islands; `autocast._higher_order` the equations that hold jaxprs.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from jax.ad_checkpoint import checkpoint_name

from . import _binding, _compat, _dtypes, _islands, _plan, _rewrites
from ._binding import LITERAL, original_dtypes
from ._policy import Lookup
from ._rule_context import RuleContext

__all__ = ["LITERAL", "NO_OBSERVER", "Context", "Observer", "eval_jaxpr", "original_dtypes", "transform_jaxpr"]


class Observer:
    """What the interpreter and the rules tell `autocast.explain` while amp transforms a
    function: every method is a no-op here (`Context.observer` is `NO_OBSERVER` outside
    `explain`); `autocast._explain_record.Observer` overrides them to keep records."""

    def enter(self, eqn: Any) -> None:
        """Before `eqn` is evaluated (nested bodies are evaluated until the matching `exit`)."""

    def exit(
        self, eqn: Any, kind: Any, rule: Any, scopes: Any, arrived: Any, bound: Any, outs: Any, island: Any
    ) -> None:
        """After `eqn` is evaluated: its step's `kind`, the `rule` that cast it, its named
        `scopes`, its operands before (`arrived`) and after (`bound`) the rule, its outputs,
        and `island` (None, or `(marker, recomputed)` shared by the equations of one float32
        island)."""

    def rewrite(self, name: str, what: str, how: str) -> None:
        """What a whole-program rewrite (`autocast._rewrites`; `name`: `"attention"`) found
        (`what`) and what amp does with it (`how`: the kernel, or kept as written and why)."""

    def float8(self, eqn: Any, why: str, requantize: tuple[bool, ...] | None) -> None:
        """What a float8 rule decided for the matmul `eqn` (`autocast._fp8`), and why:
        `requantize` None where it stays in the compute dtype, else per operand whether the
        backward pass quantizes it again (no float8 copy kept)."""


NO_OBSERVER = Observer()
"""The observer of a transformation `explain` does not watch: every method a no-op."""


class Context:
    """What stays fixed while one function is transformed: dtype, policy, caches."""

    def __init__(self, compute_dtype: np.dtype, policy: Any, remat: bool | str = "auto"):
        self.compute_dtype = compute_dtype
        # `remat`: find float32 islands at all; `remat_auto`: recompute only those
        # that the cost model says pay off (see `_worth_recomputing`).
        self.remat = remat is not False and compute_dtype != _dtypes.FLOAT32
        self.remat_auto = remat == "auto"
        # `remat_float32="matmuls"`: every island, and the matmuls between two recomputed
        # ones in one checkpoint with them (`_islands.chain_end`)
        self.remat_matmuls = self.remat and remat == "matmuls"
        # whether matmuls read only in float32 may store float32 results (`_wide`): not
        # inside a user checkpoint whose policy may save matmul results
        self.widen = True
        # whether the cotangent of a matmul operand narrowed from float32 (a parameter) is
        # accumulated in float32 (`_wide`); off: in the compute dtype (less bandwidth)
        self.float32_cotangents = True
        # whether evaluation is inside a recomputed island's checkpoint or a user checkpoint
        # that saves nothing (a custom JVP call that computes in float32, or an island, then
        # needs no checkpoint of its own: it would be recomputed twice)
        self.recomputed = False
        self.lookup = Lookup(policy)
        self._jaxpr_cache: dict[Any, Any] = {}
        self._keep_alive: list[Any] = []
        # What `autocast.explain` observes (see `Observer`; `NO_OBSERVER` otherwise)
        self.observer: Observer = NO_OBSERVER
        # How a custom VJP's `bwd` runs: "amp" (traced in the traced dtypes, re-evaluated
        # under this policy, as the forward) or "original" (called as written on the values as
        # they arrive); see `autocast._custom_derivatives.custom_vjp`.
        self.custom_vjp_bwd = "amp"
        # For the handler of a call (`jit`, `checkpoint`) only: which of its outputs every
        # consumer reads in the compute dtype (see `_plan.plan`); its body narrows them.
        self.out_narrow: Sequence[bool] | None = None
        # Inside an autocast checkpoint (a recomputed island, `_islands.eval_island`): the
        # variables it saves rather than recomputes (matmul results); None elsewhere. A rule
        # that binds its equation itself reads it (a float8 matmul keeps no copy of an
        # operand the backward pass recomputes anyway).
        self.checkpoint_saved: frozenset | None = None
        # The whole-program rewrites (`autocast._rewrites`) not applied here, by name:
        # {"attention"} for `amp(attention="xla")`, and in the equations of a rewritten span
        # evaluated as written.
        self.rewrites_off: frozenset[str] = frozenset()
        # amp's option of each rewrite by name, for its `prepare` (`{"loss_head": 4}`).
        self.rewrite_settings: dict[str, Any] = {}

    def narrowing(self, out_narrow: Sequence[bool] | None) -> Context:
        """This context (same caches), telling a call's handler which outputs to narrow."""
        other = copy.copy(self)
        other.out_narrow = out_narrow
        return other

    def without_widening(self) -> Context:
        """This context (same caches), with `widen` off."""
        other = copy.copy(self)
        other.widen = False
        return other

    def without_islands(self) -> Context:
        """This context (same caches), finding no float32 islands: for a custom JVP rule,
        whose call is recomputed as a whole instead (JAX cannot linearize a checkpoint
        inside a custom JVP rule under `jax_remat3`)."""
        other = copy.copy(self)
        other.remat = False
        return other

    def inside_recomputed_island(self) -> Context:
        """This context (same caches), for evaluation inside a recomputed island (or a
        checkpoint that saves nothing)."""
        other = copy.copy(self)
        other.recomputed = True
        return other

    def in_checkpoint(self, saved: frozenset) -> Context:
        """This context (same caches), for the equations of an autocast checkpoint that
        saves the variables `saved` (see `checkpoint_saved`)."""
        other = copy.copy(self)
        other.checkpoint_saved = frozenset(saved)
        return other

    def without_observer(self) -> Context:
        """This context (same caches), observed by no one: for a trace that is not part of
        the program `explain` reports on."""
        other = copy.copy(self)
        other.observer = NO_OBSERVER
        return other

    def eval_closed(self, closed: Any, args: Sequence[Any], free: Sequence[Any], scopes: tuple[str, ...]) -> list[Any]:
        """Evaluate a closed jaxpr's equations under this context (in the trace that is
        running): what `RuleContext.eval_closed` runs."""
        open_, consts = _compat.open_and_consts(closed)
        outs, _ = eval_jaxpr(self, open_, consts, args, free, scopes)
        return outs

    def for_rule(self, scopes: tuple[str, ...]) -> RuleContext:
        """The public, frozen view of this context a rule's `bind` gets, for an equation in
        the named `scopes` (`autocast.RuleContext`)."""
        remat: bool | Literal["auto"] = False if not self.remat else "auto" if self.remat_auto else True
        return RuleContext(
            self.compute_dtype, tuple(scopes), remat, self.recomputed, self.checkpoint_saved, self.observer, self._eval
        )

    def _eval(
        self,
        closed: Any,
        args: Sequence[Any],
        free: Sequence[Any],
        scopes: tuple[str, ...],
        rewrites: bool,
        observed: bool,
        recomputed: bool = False,
    ) -> list[Any]:
        """`RuleContext.eval_closed`: `closed` evaluated in this context, with no
        whole-program rewrite (`rewrites` False), observed by no one (`observed` False), as
        inside a checkpoint that recomputes it (`recomputed`)."""
        ctx = self
        if recomputed and not ctx.recomputed:  # (and matmul results in the compute dtype, as in a user checkpoint)
            ctx = ctx.inside_recomputed_island().without_widening()
        if not rewrites:
            ctx = copy.copy(ctx)
            ctx.rewrites_off = frozenset(_rewrites.REWRITES)
        if not observed:
            ctx = ctx.without_observer()
        return ctx.eval_closed(closed, args, free, scopes)

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
    """Evaluate an open jaxpr under `ctx`, in the trace that is running.

    Args:
        ctx: The transformation's context.
        jaxpr: The open jaxpr.
        consts: The values of its constants.
        args: The values of its inputs, as they arrive (some already in half precision).
        free: Per input, whether it is a free value (see the module docstring).
        scopes: The named scopes around the jaxpr, outermost first.
        out_float32: Per output, whether the caller casts it to float32 (so computing it
            in float32 costs nothing extra).
        out_narrow: Per output, whether every consumer reads it in the compute dtype (a
            float32 result is then rounded where it is made).

    Returns:
        The outputs and their free flags.
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
    jaxpr = _rewrites.rewrite(ctx, jaxpr, consts, scopes)  # e.g. attention spans as one equation each
    plan = _plan.plan(ctx, jaxpr, scopes, out_float32 or [False] * len(jaxpr.outvars), out_narrow)
    with _dtypes.memoised_casts():
        _eval_eqns(ctx, jaxpr, plan, env, read, scopes)
    results = [read(v) for v in jaxpr.outvars]
    return [x for x, _ in results], [f for _, f in results]


def _eval_eqns(ctx: Context, jaxpr: Any, plan: _plan.Plan, env: dict, read, scopes: tuple[str, ...]) -> None:
    """The loop: each equation in order, or a float32 island at once (`autocast._islands`)."""
    eqns, steps, island = jaxpr.eqns, plan.steps, plan.island
    wide = plan.wide if ctx.widen else {}
    last_use: dict[Any, int] = {}
    feeds_recomputed = _islands.recomputed_consumers(ctx, eqns, steps, island, wide, env) if wide else None
    if any(island):
        for i, eqn in enumerate(eqns):
            for v in eqn.invars:
                if not isinstance(v, _compat.Literal):
                    last_use[v] = i
        for v in jaxpr.outvars:
            if not isinstance(v, _compat.Literal):
                last_use[v] = len(eqns)
    chains = ctx.remat_matmuls and ctx.remat and not ctx.recomputed and any(island)
    read_by = _islands.readers(eqns, jaxpr.outvars) if any(island) and not ctx.recomputed else {}
    lead = _islands.lead_ins(eqns, steps, island, read_by, chains) if read_by else {}

    def eval_eqn(ctx: Context, eqn: Any, step: _plan.Step, env: dict, read, scopes, marker=None, widen=False):
        _eval_eqn(ctx, eqn, step, env, read, scopes, plan, marker, widen)

    units = _rewrites.recomputable_primitives() if chains else frozenset()

    def chain_from(start: int, stop: int, end: int) -> tuple[int, _islands.Chain] | None:
        """The chain the recomputed step `[start, stop)` starts (`remat_float32="matmuls"`)."""
        return _islands.chain_end(eqns, steps, island, start, stop, end, lead, read_by, units) if chains else None

    def eval_island(start: int, stop: int, end: int, found: tuple[int, _islands.Chain] | None) -> int:
        """The recomputed island `[start, stop)` and the matmuls that read it, up to `end`,
        or the chain `found` it starts; returns where it ends."""
        chain = None
        if found is not None:
            end, chain = found
        _islands.eval_island(
            ctx, eqns[start:end], steps[start:end], env, read, scopes, last_use, end, stop - start, eval_eqn, chain
        )
        return end

    i = 0
    while i < len(eqns):
        j = _islands.island_end(eqns, steps, island, lead[i]) if i in lead else i
        if j > i and _islands.recomputes(ctx, eqns[i:j], read):
            # an activation product that only the island reads: recomputed with it
            k = _islands.absorbed_end(eqns, steps, island, j, lead)
            j = eval_island(i, j, k, chain_from(i, j, k))
        elif (
            chains
            and eqns[i].primitive.name in units
            and (found := chain_from(i, i + 1, _islands.absorbed_end(eqns, steps, island, i + 1, lead)))
        ):
            j = eval_island(i, i + 1, i + 1, found)  # the fused attention chained to the island its matmuls feed
        elif not island[i]:
            widen = feeds_recomputed is not None and i in wide and not feeds_recomputed(i)
            eval_eqn(ctx, eqns[i], steps[i], env, read, scopes, widen=widen)
            j = i + 1
        else:
            j = _islands.island_end(eqns, steps, island, i)
            if not _islands.recomputes(ctx, eqns[i:j], read):
                marker = (object(), False)
                for k in range(i, j):
                    eval_eqn(ctx, eqns[k], steps[k], env, read, scopes, marker)
            else:
                k = _islands.absorbed_end(eqns, steps, island, j, lead)
                j = eval_island(i, j, k, chain_from(i, j, k))
        if plan.narrow:
            _narrow(ctx, eqns[i:j], plan.narrow, env)
        i = j


def _narrow(ctx: Context, eqns: Sequence[Any], narrow: set, env: dict) -> None:
    """Round the float32 results that only half-precision consumers read (see
    `autocast._plan.plan`) to the compute dtype where they are made."""
    for eqn in eqns:
        for v in eqn.outvars:
            if v in narrow and v in env:
                x, free = env[v]
                if _dtypes.dtype_of(x) == _dtypes.FLOAT32 and not free:
                    with _eqn_source(eqn):
                        env[v] = (_dtypes.cast(x, ctx.compute_dtype), free)


def _eqn_source(eqn: Any) -> Any:
    """Bind in the equation's own source location, its name stack extending the current one
    (as `jax.core.eval_jaxpr` does): inside JAX's backward pass (a `custom_vjp` backward
    rule re-evaluated under the policy) the equations keep `transpose(jvp(...))` and the
    scopes around the call."""
    return _compat.user_context(
        eqn.source_info.traceback, name_stack=_compat.current_name_stack() + eqn.source_info.name_stack
    )


def _eval_eqn(
    ctx: Context,
    eqn: Any,
    step: _plan.Step,
    env: dict,
    read,
    scopes: tuple[str, ...],
    plan: _plan.Plan,
    island: Any = None,
    widen: bool = False,
) -> None:
    """Evaluate one equation by its step, in its own context (source location, name stack,
    abstract mesh). `island`: None, or `(marker, recomputed)` shared by the equations of
    one float32 island."""
    read_in = [read(v) for v in eqn.invars]
    invals = [x for x, _ in read_in]
    in_free = [f for _, f in read_in]
    eqn_scopes = scopes + _compat.scope_names(eqn.source_info.name_stack)
    ctx.observer.enter(eqn)
    bound = invals
    rule = step.rule
    with (
        _eqn_source(eqn),
        _compat.eqn_context(eqn),
    ):
        if step.kind == _plan.STOP:
            outs = _binding.bind_original(eqn, invals)
            out_free = [False] * len(outs)
        elif step.kind == _plan.HIGHER:
            rule = (step.handler, step.out_float32, step.pulls, step.out_narrow)  # for the observer
            # operands the bodies consume only in float32: cast once, here, so every
            # float32 consumer of the value (inside and outside) reads the same value
            invals = [
                _dtypes.cast(x, _dtypes.FLOAT32) if p is True and _dtypes.is_castable(v.aval.dtype) else x
                for x, p, v in zip(invals, step.pulls, eqn.invars)
            ]
            hctx = ctx.narrowing(step.out_narrow) if any(step.out_narrow) else ctx
            if island is not None and island[1] and not ctx.recomputed:
                hctx = hctx.inside_recomputed_island()
            outs, out_free = step.handler(hctx, eqn, invals, in_free, eqn_scopes, step.out_float32)
        else:
            outs, out_free, bound = _apply_rule(ctx, eqn, plan, step.rule, invals, in_free, widen, eqn_scopes)
            saved = ctx.recomputed or (island and island[1])
            if len(outs) == 1 and eqn.outvars[0] in plan.statistics and saved:
                # a row statistic: saved by the island's checkpoint (`_plan.Plan.statistics`)
                outs = [checkpoint_name(x, _compat.SAVED_NAME) for x in outs]
    ctx.observer.exit(eqn, step.kind, rule, eqn_scopes, invals, bound, outs, island)
    for var, val, f in zip(eqn.outvars, outs, out_free):
        if not isinstance(var, _compat.DropVar):
            env[var] = (val, f)


def _apply_rule(
    ctx: Context,
    eqn: Any,
    plan: _plan.Plan,
    rule: Any,
    invals: list,
    in_free: list,
    widen: bool,
    scopes: tuple[str, ...],
):
    """Cast by the rule, then bind (`autocast._binding`): `(outs, out_free, cast operands)`."""
    rule, new_invals, params = _binding.cast(ctx, eqn, rule, invals, in_free)
    if eqn.primitive.name in _binding.SCATTERS:
        params = _retype_combiner(ctx, params, new_invals[0])
    bias_sum = bool(eqn.outvars) and eqn.outvars[0] in plan.bias_sums
    outs = _binding.bind(
        ctx, eqn, rule, invals, new_invals, params, in_free, widen=widen, bias_sum=bias_sum, scopes=scopes
    )
    return outs, _binding.out_free(eqn, in_free, len(outs)), new_invals


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
    """Transform a (closed or open) jaxpr for operands of `in_dtypes` (memoised in `ctx`).

    Args:
        ctx: The transformation's context.
        jaxpr_like: The closed or open jaxpr.
        in_dtypes: The dtype each input arrives in.
        in_free: Per input, whether it is a free value.
        scopes: The named scopes around the jaxpr, outermost first.
        out_dtypes: The dtypes the outputs are cast to (`None` entries: any dtype; `None`:
            no cast).
        out_float32: Per output, whether it is consumed only in float32 (default: the
            outputs `out_dtypes` casts to float32).
        out_narrow: Per output, whether every consumer reads it in the compute dtype (a
            float32 result is then rounded where it is made).
        closed: The jaxpr is a closed one by its primitive's contract (`jit`, `scan`,
            `while`, `cond`), so its new constants stay attached to it (JAX >= 0.11 has
            one class for both, and binding such a primitive on extra operands would not
            match its other parameters).

    Returns:
        `(new, extra_consts, out_free)`: a closed jaxpr comes back closed with
            `extra_consts == []`; an open one comes back open, with any constants it
            needs turned into leading invars and returned as `extra_consts` (to be passed
            as leading operands). `out_free` tells which outputs are free values.
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
