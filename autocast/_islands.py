"""Float32 islands: which runs of float32 equations are recomputed, and how they are evaluated.

The planner marks the equations that compute in float32 (`autocast._plan.Plan.island`).
With `remat_float32` each contiguous run of them (an island, `island_end`) is
evaluated inside its own `jax.checkpoint` (`eval_island`), so its float32 results
are recomputed in the backward pass rather than saved; with `"auto"` only where that cuts
what the island keeps by a large factor (`worth_recomputing`); with `"matmuls"` an island's
checkpoint also runs on over the matmuls its matmuls feed to the next recomputed island or
fused attention (`chain_end`). A recomputed island's
checkpoint also holds the matmuls that read it and saves only their outputs
(`absorbed_end`), so their half-precision operand is recomputed, not kept; and a
product of two activations that only the island reads (attention's scores before the
softmax, `lead_ins`), so the product is recomputed from its operands, which its own
derivative keeps anyway. Islands are local: an enclosing user checkpoint keeps its policy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from . import _compat, _dtypes, _plan
from ._binding import LITERAL


def recomputed_consumers(ctx: Any, eqns: Sequence[Any], plan: list, island: list[bool], wide: dict, env: dict):
    """For the matmuls in `wide` (index -> indices of their readers): a test of whether one
    of them feeds an island that will be recomputed. Such a matmul keeps its half-precision
    result: the island's checkpoint saves its inputs, and a float32 one would double them.
    The decision the island takes when it is reached is estimated here with the values at
    hand, counting the results of matmuls not evaluated yet in the compute dtype."""
    if not ctx.remat:
        return lambda i: False
    segment: dict[int, tuple[int, int]] = {}  # island equation -> its island's (start, end)
    i = 0
    while i < len(eqns):
        if island[i]:
            j = island_end(eqns, plan, island, i)
            segment.update((k, (i, j)) for k in range(i, j))
            i = j
        else:
            i += 1
    made_by_matmul = {v for eqn, step in zip(eqns, plan) if step.computes for v in eqn.outvars}

    def nbytes(v):
        if v in env:
            return _nbytes(env[v][0])
        dtype = ctx.compute_dtype if v in made_by_matmul else v.aval.dtype
        return v.aval.size * np.dtype(dtype).itemsize

    def recomputed(start: int, end: int) -> bool:
        if all(_plan.is_linear(e) for e in eqns[start:end]):
            return False
        return not ctx.remat_auto or worth_recomputing(eqns[start:end], nbytes)

    def feeds(i: int) -> bool:
        return any(recomputed(*se) for se in {segment[k] for k in wide[i] if k in segment})

    return feeds


def recomputes(ctx: Any, eqns: Sequence[Any], read) -> bool:
    """Whether an island (with its lead-in) is evaluated in its own checkpoint."""
    if ctx.recomputed:  # inside a recomputed island or checkpoint: recomputed already
        return False
    if all(_plan.is_linear(e) for e in eqns):
        return False
    return not ctx.remat_auto or worth_recomputing(eqns, lambda v: _nbytes(read(v)[0]))


def lead_ins(
    eqns: Sequence[Any], plan: list, island: list[bool], read_by: Mapping[Any, set[int]], matmuls: bool = False
) -> dict[int, int]:
    """Islands' lead-ins: `{start: island start}` (`read_by`: `readers(eqns, outvars)`).

    A lead-in is a compute-rule `dot_general` of two computed values (attention's
    `q @ k.T`) whose result, larger than either operand, only the island reads, possibly
    through single-use equations with one array operand (a scale, a mask's `where`).
    Evaluated in the island's checkpoint, the product is recomputed in the backward pass
    instead of saved as the island's input: the backward pass keeps its operands anyway
    (its own derivative reads them), so this saves the product's bytes for one matmul's
    FLOPs (attention's scores: the largest activation of a transformer). With `matmuls`
    (`remat_float32="matmuls"`) one operand may be a parameter (an MLP's up-projection
    before GELU: the activation it reads is kept for its weight gradient anyway), and the
    way to the island may add a parameter (the projection's bias).
    """
    producer = {v: eqn for eqn in eqns for v in eqn.outvars}
    memo: dict[Any, bool] = {}

    def computed(v: Any) -> bool:
        while not isinstance(v, _compat.Literal) and v in producer:
            eqn = producer[v]
            if not _plan.is_linear(eqn):
                return True
            arrays = [u for u in eqn.invars if not isinstance(u, _compat.Literal) and u.aval.size > 1]
            if matmuls and len(arrays) > 1:  # a bias add: computed if an operand is
                if v not in memo:
                    memo[v] = any(computed(u) for u in arrays)
                return memo[v]
            if len(arrays) != 1:
                return False
            v = arrays[0]
        return False

    found: dict[int, int] = {}
    for j in range(1, len(eqns)):
        if not island[j] or island[j - 1]:
            continue
        end = island_end(eqns, plan, island, j)
        k, wanted = j - 1, {v for e in eqns[j:end] for v in e.invars if not isinstance(v, _compat.Literal)}
        while k >= 0 and not eqns[k].effects:
            eqn = eqns[k]
            out = eqn.outvars[0] if len(eqn.outvars) == 1 else None
            # read by the island (and the lead-in after it) only
            if out is None or out not in wanted or not read_by.get(out, set()) <= set(range(k + 1, end)):
                break
            if plan[k].computes and eqn.primitive.name == "dot_general":
                ops = [v for v in eqn.invars if not isinstance(v, _compat.Literal)]
                made = [computed(v) for v in ops]
                if (
                    len(ops) == 2
                    and (all(made) or (matmuls and any(made)))
                    and out.aval.size >= max(v.aval.size for v in ops)
                ):
                    found[k] = j
                break
            arrays = [
                u
                for u in eqn.invars
                if not isinstance(u, _compat.Literal) and _dtypes.is_castable(u.aval.dtype) and u.aval.size > 1
            ]
            if matmuls and len(arrays) > 1:  # a bias add: the parameter's side is not recomputed
                arrays = [u for u in arrays if computed(u)]
            if len(arrays) != 1:
                break
            wanted = {arrays[0]}
            k -= 1
    return found


def readers(eqns: Sequence[Any], outvars: Sequence[Any] = ()) -> dict[Any, set[int]]:
    """Variable -> the indices of the equations that read it (`len(eqns)` for `outvars`:
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


def island_end(eqns: Sequence[Any], plan: list, island: list[bool], i: int) -> int:
    """End of the island starting at `i`: the run of float32 equations, continued over
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


def _bridges(eqn: Any, step: _plan.Step) -> bool:
    return (
        step.kind == _plan.RULE and not eqn.effects and not any(_dtypes.is_castable(v.aval.dtype) for v in eqn.outvars)
    )


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


# Derived from the two cases it separates: an island fed by half-precision activations keeps
# at least twice their bytes in float32 (ratio 2: a softmax's exp of half scores); an LSTM
# cell updating a float32 carry keeps about 1.6 times its inputs (benchmarks/memory/
# bench_lstm_scan.py: recomputing it cost a second evaluation for a small saving). 1.75 lies
# between them.
RECOMPUTE_RATIO = 1.75


def worth_recomputing(eqns: Sequence[Any], nbytes) -> bool:
    """The island cost model of `remat_float32="auto"`: recompute an island only if that
    cuts the memory it keeps for the backward pass by a large factor (`RECOMPUTE_RATIO`).

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
    return kept_if_saved >= RECOMPUTE_RATIO * kept_if_recomputed


def absorbed_end(eqns: Sequence[Any], plan: list, island: list[bool], j: int, lead: Mapping[int, int]) -> int:
    """End of a recomputed island extended over the matmuls that read it.

    The matmul (convolution) after a layer norm, a softmax or GELU needs its half-precision
    operand for the backward pass (the weight gradient): saved, it is an activation the size
    of the island's output. Evaluated in the island's `jax.checkpoint`, with a policy that
    saves only the matmul outputs, that operand is recomputed with the island, which the
    backward pass recomputes anyway. The island extends over the compute-rule equations
    that follow it and the linear ones between them (reshapes, bias adds, weight casts),
    up to the last compute-rule one and not over the next island's lead-in (`lead`);
    nothing non-linear is recomputed twice.
    """
    k, last = j, j
    while k < len(eqns) and not island[k] and k not in lead and not eqns[k].effects and plan[k].kind == _plan.RULE:
        if plan[k].computes:
            last = k + 1
        elif not _plan.is_linear(eqns[k]):
            break
        k += 1
    return last


# How many steps a chain may take past a point where a value it made is still read further on,
# to close where that value's reader joins it: in a post-LN block the first norm's output is
# read by the residual add before the second norm, one step after the MLP. One step; more
# would let a chain run across blocks and keep no block's recomputation local.
_LOOKAHEAD = 1


class Chain(NamedTuple):
    """What each equation of an autocast checkpoint is (`eval_island`), by position:
    `marked`, in an island (or a recomputable equation chained to one: the observer's
    island marker); `saved`, a matmul whose outputs the checkpoint saves; `recomputed`, a
    recomputable equation (the fused attention) bound as inside a checkpoint that
    recomputes it, so it adds no checkpoint of its own."""

    marked: tuple[bool, ...]
    saved: tuple[bool, ...]
    recomputed: tuple[bool, ...]


def chain_end(
    eqns: Sequence[Any],
    plan: list,
    island: list[bool],
    start: int,
    island_stop: int,
    end: int,
    lead: Mapping[int, int],
    read_by: Mapping[Any, set[int]],
    units: frozenset[str],
) -> tuple[int, Chain] | None:
    """`remat_float32="matmuls"`: the recomputed island `[start, island_stop)`, with its
    absorbed matmuls up to `end`, extended over what its matmuls feed, when that is
    recomputed too: through linear equations (bias adds, reshapes) to the next recomputed
    island or recomputable equation (`units`: the fused attention) and the matmuls that
    read it, and so on. A matmul between two recomputed steps (an MLP's up-projection
    between its layer norm and GELU; q, k and v between a layer norm and the attention)
    is then recomputed with them instead of saved as the next one's input: one more
    matmul in the backward pass for an activation the size of its result. The chain
    ends where a value it made is read outside it (the residual stream), or one step
    (`_LOOKAHEAD`) further where that step takes the value's reader in and nothing else
    escapes (a post-LN block: its first norm's output, read by the second residual add),
    so each block's chain is recomputed alone, just before its own backward pass.

    Returns:
        The chain's end and what each of its equations is, or None where the island
        chains to nothing.
    """
    marked = set(range(start, island_stop))
    recomputed = {start} if eqns[start].primitive.name in units else set()
    group, cur = island_stop, end  # the matmuls whose outputs the checkpoint saves: [group, cur)
    done = None  # (cur, group, marked, recomputed) where the chain last closed
    open_steps = 0
    while True:
        m = cur
        while (
            m < len(eqns)
            and not island[m]
            and m not in lead
            and eqns[m].primitive.name not in units
            and plan[m].kind == _plan.RULE
            and not plan[m].computes
            and not eqns[m].effects
            and _plan.is_linear(eqns[m])
        ):
            m += 1
        if m >= len(eqns) or eqns[m].effects:
            break
        unit = False
        if m in lead or island[m]:
            stop = island_end(eqns, plan, island, lead.get(m, m))
            if all(_plan.is_linear(e) for e in eqns[m:stop]):
                break
        elif eqns[m].primitive.name in units:
            stop, unit = m + 1, True
        else:
            break
        marked.update(range(m, stop))
        if unit:
            recomputed.add(m)
        group, cur = stop, absorbed_end(eqns, plan, island, stop, lead)
        inside = set(range(start, cur))
        if all(read_by.get(v, set()) <= inside for e in eqns[start:m] for v in e.outvars):
            done = (cur, group, set(marked), set(recomputed))
            if open_steps:
                break  # closed after a step it could not close at (post-LN: at the next norm)
        elif open_steps == _LOOKAHEAD or done is None:
            break  # a value made before it is read further on (the residual stream)
        else:
            open_steps += 1
    if done is None:
        return None
    cur, group, marked, recomputed = done
    n = range(start, cur)
    return cur, Chain(
        tuple(k in marked for k in n),
        tuple(group <= k and plan[k].computes for k in n),
        tuple(k in recomputed for k in n),
    )


def eval_island(
    ctx: Any,
    eqns: Sequence[Any],
    steps: Sequence,
    env: dict,
    read,
    scopes,
    last_use: dict,
    end: int,
    n_island: int | None,
    eval_eqn: Callable[..., None],
    chain: Chain | None = None,
) -> None:
    """Evaluate a run of float32 equations inside `jax.checkpoint`: the backward pass
    recomputes them from the island's inputs (half-precision activations, parameters)
    instead of keeping their float32 results. Equations after the first `n_island` are
    the matmuls that read the island (see `absorbed_end`): only their outputs are
    saved. `eval_eqn(ctx, eqn, step, env, read, scopes, island)` evaluates one equation
    (the interpreter's), `island` being a marker shared by the island's equations.
    `chain` (`chain_end`, in place of `n_island`): the islands and recomputable equations
    chained after the first, and the matmuls whose outputs are saved (the last group)."""
    n_island = len(eqns) if n_island is None else n_island
    if chain is None:
        chain = Chain(
            tuple(n < n_island for n in range(len(eqns))),
            tuple(n >= n_island and s.computes for n, s in enumerate(steps)),
            (False,) * len(eqns),
        )
    inputs = _island_inputs(eqns)
    outputs = [
        v for eqn in eqns for v in eqn.outvars if not isinstance(v, _compat.DropVar) and last_use.get(v, -1) >= end
    ]
    if not outputs:
        return
    in_vals = [read(v) for v in inputs]
    out_free: list[bool] = []
    marker = (object(), True)  # for Context.observer: one recomputed island
    kept_for_matmul = _kept_for_matmul(eqns, chain.saved, outputs)

    def island(*args):
        local = {v: (x, f) for v, x, (_, f) in zip(inputs, args, in_vals)}

        def local_read(v):
            return (v.val, LITERAL) if isinstance(v, _compat.Literal) else local[v]

        inner = ctx.in_checkpoint(kept_for_matmul)
        whole = inner.inside_recomputed_island() if any(chain.recomputed) else inner
        with _dtypes.memoised_casts():
            for n, (eqn, step) in enumerate(zip(eqns, steps)):
                c = whole if chain.recomputed[n] else inner
                eval_eqn(c, eqn, step, local, local_read, scopes, marker if chain.marked[n] else None)
                if chain.saved[n]:
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


def _kept_for_matmul(eqns: Sequence[Any], saved: Sequence[bool], outputs: Sequence[Any]):
    """The values an island's checkpoint saves only for one matmul: the result of a saved
    matmul (attention's `probs @ values`) carried through linear equations (reshapes,
    transposes), each read once and never outside the island. A float8 matmul reading one
    keeps its float8 copy instead of having the half-precision value saved (half the bytes);
    not where the checkpoint would keep the value anyway (`jax_remat3`)."""
    if _compat.checkpoint_keeps_custom_vjp_operands():
        return frozenset()
    read_by = readers(eqns, outputs)  # an output: read outside the island too
    found: set = set()
    for n, eqn in enumerate(eqns):
        if saved[n]:
            root = True
        else:
            floats = [v for v in eqn.invars if not isinstance(v, _compat.Literal) and _dtypes.is_floating(v.aval.dtype)]
            root = _plan.is_linear(eqn) and len(floats) == 1 and floats[0] in found
        if root:
            found.update(v for v in eqn.outvars if len(read_by.get(v, ())) == 1 and len(eqns) not in read_by[v])
    return frozenset(found)


def _tangent_free(eqns: Sequence[Any], inputs: Sequence[Any], outputs: Sequence[Any]) -> set:
    """The float inputs of an island whose tangent it never uses: read only through
    `stop_gradient` or into non-float results (a softmax's `max`). They enter its
    checkpoint through `stop_gradient`: JAX's `jax_remat3` checkpoint keeps the tangent of
    every input alive, and with it the residuals of the JVP that made it (the `max`'s mask,
    the size of the logits)."""
    needs = set(outputs)
    for eqn in reversed(eqns):
        if eqn.primitive.name == "stop_gradient":
            continue
        if any(v in needs and _dtypes.is_floating(v.aval.dtype) for v in eqn.outvars):
            needs.update(v for v in eqn.invars if not isinstance(v, _compat.Literal))
    return {v for v in inputs if v not in needs and _dtypes.is_floating(v.aval.dtype)}
