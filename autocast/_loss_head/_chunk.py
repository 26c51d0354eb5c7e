"""The loss head in amp: each head `_find` proves becomes one `loss_head` equation, whose rule
replays the user's own equations on token chunks.

Registered at import through `autocast._rewrites` (`REWRITE`), with its policy categories
(`loss_head`; `xla_loss_head` keeps the heads in a named scope as written). For a head the
policy lets chunk, `_prepare` chooses the chunk count `k` and traces the span's equations at
chunk shapes (`_axes.at_chunk`: the shapes in their parameters divided along the token
axis) into one jaxpr; the rule, `_Chunked`, binds

    carry, per_token = lax.scan(checkpoint(step), zeros, chunks of the token inputs)

where `step` evaluates that jaxpr under amp's rules on one chunk (the head's matmul in the
compute dtype, the softmax in float32, as unchunked) and adds what it reduces over the tokens
to a float32 carry. JAX derives the backward pass: the checkpoint recomputes each chunk's
logits, and the weight enters the loop as it arrived (float32; its cast to the compute dtype
made once before the loop stands in for each chunk's), so its gradient is accumulated across
chunks in float32, the loss scale included (it is the cotangent of the carry). Where the
loss is one float scalar and the compute dtype bfloat16, `_forward` makes the gradients with
the loop instead (no chunk computed twice). No gradient is written by hand.

**Chunk count.** With `loss_head="auto"` the smallest count that divides the token axis and
brings the head's float32 logits per chunk to `BUDGET` bytes or less (GPT-2 small at 8 x 1024
tokens: 1.53 GiB -> 4 chunks; Llama 3's vocabulary: 8); a head whose float32 logits fit
in `BUDGET` is left as written (it does not pay). `loss_head=k` asks for `k` chunks (the
smallest count >= k the token axis allows), whatever the size. See docs/loss_head.md for
the measurements.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat, _dtypes, _registry, _rewrites, _rules
from .._attention._graph import Node
from . import _axes, _find, _forward, _pad, _regroup

BUDGET = 512 << 20
"""The float32 logits one chunk may hold under `loss_head="auto"` (bytes). Measured on the
deviceless H100 target, GPT-2 small's body at 8 x 1024 tokens, amp bf16, gradients with the
forward pass, the vocabulary padded (benchmarks/results/gpu_modeled/loss-head-padded-2026-11-28/):
at the vocabulary 50,257 this gives 4 chunks, 0.70x the step's XLA temp for 1.03x its modeled
time; at 128,256 and 256,000, 8 chunks, 0.47x and 0.38x for 1.04x. More chunks cost time (the weight
gradient's float32 accumulator is read and written once a chunk); fewer keep more."""

loss_head_p = _rewrites.span_primitive("loss_head")
"""One loss head of a jaxpr amp evaluates (params: `plan`, `chunks`, `chunk`: the span's
equations at chunk shapes, a closed jaxpr; `body`: the span as written; `scopes`)."""
# the planner looks through the span as written: the hidden states, read by the head's
# matmul in the compute dtype, are rounded where they are made, as without the rewrite
_registry.NARROW_BODIES[loss_head_p] = "body"


class _Chunked(_rules.Rule):
    """The rule of `loss_head`: the span's equations on token chunks, in a `lax.scan` whose
    step is checkpointed, what they reduce over the tokens accumulated in float32."""

    role: _rules.Role = "opaque"
    name = "loss_head"
    primitives = frozenset({"loss_head"})

    def cast(self, compute_dtype, original_dtypes, invars, params, free):
        return list(invars), params  # each equation is cast by its own rule, per chunk

    def bind(self, ctx, eqn, arrived, cast, params, free):
        plan, k, chunk = params["plan"], params["chunks"], params["chunk"]
        n = len(plan.inputs)
        vals, flags = list(arrived[:n]), list(free or [False] * len(arrived))[:n]
        if plan.pad is not None:  # the chunks' matmuls read the weight padded once (`_pad`)
            vals[plan.pad.input] = _pad.weight(vals[plan.pad.input], plan.pad)
        in_axes = [plan.axes.get(i) for i in plan.inputs]
        kinds = [plan.axes[o] for o in plan.outputs]
        whole = [v for v, a in zip(vals, in_axes) if a is None]
        xs = [_split(v, a, k, plan.inner[i]) for v, a, i in zip(vals, in_axes, plan.inputs) if a is not None]

        precast = _precast(ctx, plan, vals)
        weight = None if plan.weight is None else sum(1 for a in in_axes[: plan.weight] if a is None)

        def run(xs_t: Sequence[Any], whole_t: Sequence[Any], cast_w: Any, observed: bool = True) -> list[Any]:
            """The chunk's outputs under amp's rules (`whole_t`: the whole inputs, maybe
            tracers of a derivative; `cast_w`, the weight's precast, stands in for its cast;
            `observed`: False for a trace that is not the program, the outputs' shapes)."""
            it, wit = iter(xs_t), iter(whole_t)
            args = [next(it) if a is not None else next(wit) for a in in_axes]
            with contextlib.ExitStack() as stack:
                stack.enter_context(_dtypes.memoised_casts())
                if cast_w is not None and weight is not None:
                    stack.enter_context(_dtypes.cast_override(whole_t[weight], cast_w.dtype, lambda: cast_w))
                return ctx.eval_closed(
                    chunk, args, flags, scopes=params["scopes"], rewrites=False, observed=observed, recomputed=True
                )

        first = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in xs]
        shapes = jax.eval_shape(lambda *a: run(a, whole, precast, observed=False), *first)
        forward = _forward.applies(ctx.compute_dtype, shapes, kinds)
        ctx.observer.rewrite("loss_head", plan.what, describe(k, forward, plan.pad, params.get("flat", False)))
        if forward:
            return _forward.with_gradients(run, xs, whole, precast, shapes)

        def step(carry: Sequence[Any], xs_t: Sequence[Any]) -> tuple[list[Any], list[Any]]:
            outs = run(xs_t, whole, precast)
            it = iter(carry)
            new, ys = [], []
            for o, kind in zip(outs, kinds):
                if kind == _axes.SUM:
                    new.append(next(it) + o.astype(_accumulator(o.dtype)))
                elif kind == _axes.MAX:
                    c = next(it)
                    new.append(_combine_max(c, o.astype(c.dtype)))
                else:
                    ys.append(o)
            return new, ys

        init = [_init(s, kind) for s, kind in zip(shapes, kinds) if isinstance(kind, str)]
        step = jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable)
        carry, ys = jax.lax.scan(step, init, xs, unroll=_forward.UNROLL)
        results, cit, yit = [], iter(carry), iter(ys)
        for s, kind, o in zip(shapes, kinds, plan.outputs):
            if isinstance(kind, str):
                results.append(next(cit).astype(s.dtype))
            else:
                results.append(_merge(next(yit), kind, plan.inner[o]))
        return results


def _precast(ctx: Any, plan: _find.Plan, vals: Sequence[Any]) -> Any:
    """The weight in the compute dtype, cast once before the loop (float32 weight, half
    compute dtype): the chunks' matmuls read it instead of casting it again in every chunk,
    forward and recomputed, while its gradient still flows to the float32 weight (`_wide`'s
    float32 cotangent ignores the tangent of the cast)."""
    if plan.weight is None:
        return None
    w = vals[plan.weight]
    if _dtypes.dtype_of(w) != _dtypes.FLOAT32 or ctx.compute_dtype not in _dtypes.HALF:
        return None
    return _dtypes.cast(w, ctx.compute_dtype)


def _accumulator(dtype: Any) -> Any:
    """Float sums accumulate in float32 (or wider); integer and boolean counts as they are."""
    dtype = np.dtype(dtype)
    if _dtypes.is_castable(dtype) and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype


def _init(shape: Any, kind: str) -> Any:
    dtype = _accumulator(shape.dtype)
    if kind == _axes.SUM:
        return jnp.zeros(shape.shape, dtype)
    return jnp.full(shape.shape, _lowest(dtype), dtype)


def _lowest(dtype: np.dtype) -> Any:
    if np.issubdtype(dtype, np.floating):
        return -np.inf
    if np.issubdtype(dtype, np.integer):
        return np.iinfo(dtype).min
    return False


def _combine_max(c: Any, o: Any) -> Any:
    return jnp.maximum(c, o)


def _split(x: Any, axis: int, k: int, inner: int) -> Any:
    """`x` with its axis `axis` cut into `k` chunks of interleaved row groups (chunk `j`: the
    rows `r` with `(r // inner) % k == j`, in order), stacked on a new leading axis."""
    shape = list(x.shape)
    n = shape[axis]
    shape[axis : axis + 1] = [n // (k * inner), k, inner]
    y = jnp.moveaxis(jnp.reshape(x, shape), axis + 1, 0)
    out = list(y.shape)
    out[axis + 1 : axis + 3] = [n // k]
    return jnp.reshape(y, out)


def _merge(y: Any, axis: int, inner: int) -> Any:
    """The chunks of a per-token result (stacked on the leading axis) put back along `axis`
    (the inverse of `_split`)."""
    k = y.shape[0]
    shape = list(y.shape)
    m = shape[axis + 1]
    shape[axis + 1 : axis + 2] = [m // inner, inner]
    y = jnp.moveaxis(jnp.reshape(y, shape), 0, axis + 1)
    out = list(y.shape)
    out[axis : axis + 3] = [m * k]
    return jnp.reshape(y, out)


def describe(k: int, forward: bool = False, pad: _pad.Pad | None = None, flat: bool = False) -> str:
    """What explain says of a chunked head (`forward`: its gradients made with the loop;
    `pad`: how its vocabulary is padded for the matmuls; `flat`: the matmul makes the logits
    in the shape the loss reshapes them to)."""
    how = "lax.scan, gradients with the forward pass" if forward else "lax.scan + checkpoint"
    padded = "" if pad is None else f", the matmuls' vocabulary padded {pad.size:,} -> {pad.padded:,}"
    made = ", the logits made flat by the matmul" if flat else ""
    return f"chunked: {k} token chunks ({how}), float32 accumulation{padded}{made}"


LOSS_HEAD = _Chunked()
XLA_LOSS_HEAD = _rewrites.AsWritten("xla_loss_head", loss_head_p)
CATEGORIES = {"loss_head": LOSS_HEAD, "xla_loss_head": XLA_LOSS_HEAD}
"""The policy categories this module adds (`autocast._rules.register_category`)."""
for _name, _rule in CATEGORIES.items():
    _rules.register_category(_name, _rule)


def _spans(jaxpr: Any, consts: Sequence[Any], compute_dtype: Any) -> list[_rewrites.Span | _rewrites.Kept]:
    """The rewrite's finder: each loss head of `jaxpr`'s top-level equations (none unless the
    compute dtype is a half one: float32 amp is an identity)."""
    if compute_dtype not in _dtypes.HALF:
        return []
    out: list[_rewrites.Span | _rewrites.Kept] = []
    try:
        heads = _find.find(jaxpr, consts)
    except Exception as e:  # a jaxpr the finder does not know: never fail amp's trace
        return [_rewrites.Kept("a jaxpr", f"as written: not recognised ({type(e).__name__}: {e})")]
    for found in heads:
        if isinstance(found, _find.Refused):
            out.append(_rewrites.Kept(found.what, f"as written: {found.why}"))
            continue
        eqns, plan = found
        out.append(_rewrites.Span(eqns, plan.in_vars, plan.out_vars, plan.what, plan))
    return out


MAX_CHUNKS = 64
"""The most chunks `"auto"` takes (a token axis of 1,021 tokens is not cut into 1,021 chunks)."""


def chunk_count(plan: _find.Plan, setting: Any) -> int | str:
    """The number of chunks for `plan` under amp's `loss_head` setting, or why none: the
    smallest count that divides the token axis and is at least what the setting asks (an int;
    `"auto"`: the float32 logits over `BUDGET`), else the largest count that divides it (at
    most `MAX_CHUNKS` under `"auto"`). With several devices `"auto"` takes, where there are
    any, only counts that leave each chunk rows of every device (the chunks interleave the
    rows, so a batch sharded across the devices is chunked where it lies, with no
    collective): a data-parallel step over 8 devices with 64 sequences gets at most 8 chunks,
    each device's share of the logits cut as much."""
    counts = plan.chunk_counts()
    if isinstance(setting, int) and not isinstance(setting, bool):
        if setting < 2:
            return f"loss_head={setting}"
        want = setting
    else:
        want = math.ceil(plan.logits_bytes / BUDGET)
        if want < 2:
            mib = plan.logits_bytes / 2**20
            return f"too small to pay ({mib:.0f} MiB of float32 logits; chunked above {BUDGET >> 20} MiB)"
        counts = [k for k in counts if k <= MAX_CHUNKS]
        # where there is one, a count whose every chunk holds rows of every device (a batch
        # sharded across them is chunked where it lies, with no collective; each device's
        # share of the logits is cut as much), the smallest enough or else the largest
        devices = jax.device_count()
        even = [k for k in counts if all((n // k) % devices == 0 for n in plan.sizes)] if devices > 1 else []
        if even:
            return next((k for k in even if k >= want), even[-1])
    if not counts:
        return "no chunk count divides its token axis"
    return next((k for k in counts if k >= want), counts[-1])


def _prepare(span: _rewrites.Span, setting: Any) -> dict[str, Any] | str:
    """The `loss_head` equation's parameters for a span the policy lets chunk: the plan, the
    chunk count and the span's equations at chunk shapes; or why it stays as written."""
    plan = span.found
    if any(_compat.explicitly_sharded(v.aval) for v in plan.in_vars):
        # (its chunks would need every value's sharding respelled at chunk shape)
        return "an input is sharded in JAX's explicit sharding mode"
    k = chunk_count(plan, setting)
    if isinstance(k, str):
        return k
    chunk, flat = _chunk_jaxpr(plan, k)
    return {"plan": plan, "chunks": k, "chunk": chunk, "flat": flat}


def _chunk_jaxpr(plan: _find.Plan, k: int) -> tuple[Any, bool]:
    """The span's equations at chunk shapes, as a closed jaxpr over the plan's inputs (each
    chunked one `1/k` of its token axis), and whether its matmul makes the logits in the shape
    the loss reshapes them to (`_regroup`)."""
    avals = []
    for j, (i, var) in enumerate(zip(plan.inputs, plan.in_vars)):
        aval = var.aval
        a = plan.axes.get(i)
        if isinstance(a, int):
            aval = aval.update(shape=_axes._divided(aval.shape, a, k))
        if plan.pad is not None and j == plan.pad.input:
            shape = list(aval.shape)
            shape[plan.pad.axis] = plan.pad.padded
            aval = aval.update(shape=tuple(shape))
        avals.append(aval)

    reshape = _regroup.find(plan.nodes, plan.head, plan.axes, plan.outputs)
    if reshape is not None:  # its new sizes at chunk size: the head's result is made in them
        sizes = _axes.at_chunk("reshape", plan.nodes[reshape].params, plan.relations[reshape], k)["new_sizes"]
    merged = False  # (the head's `_regroup.bind` applied: the reshape then passes its input on)

    def replay(*args: Any) -> list[Any]:
        env: dict[int, Any] = dict(zip(plan.inputs, args))
        env.update(plan.consts)
        for index, (node, rel) in enumerate(zip(plan.nodes, plan.relations)):
            ins = [np.asarray(a.val, dtype=a.aval.dtype) if not isinstance(a, int) else env[a] for a in node.ins]
            params = _axes.at_chunk(node.name, node.params, rel, k)
            ctx = (
                _compat.user_context(node.source.traceback, name_stack=node.source.name_stack) if node.source else None
            )
            with ctx if ctx is not None else contextlib.nullcontext():
                outs = _bind(index, node, ins, params)
            for o, val in zip(node.outs, outs):
                if o >= 0:
                    env[o] = val
        return [env[o] for o in plan.outputs]

    def _bind(index: int, node: Node, ins: list[Any], params: dict[str, Any]) -> list[Any]:
        nonlocal merged
        if index == plan.head and reshape is not None:  # made in the loss's shape (`_regroup`)
            out = _regroup.bind(node, ins, params, sizes, plan.pad)
            merged = out is not None
            if merged:
                return [out]
        if index == reshape and merged:
            return [ins[0]]
        outs = _compat.bind(node.prim, ins, params)
        if index == plan.head and plan.pad is not None:
            outs = [_pad.logits(outs[0], plan.pad)]
        return outs

    open_, consts = _compat.trace_to_jaxpr(replay, avals)
    return _compat.close_jaxpr(open_, consts), merged


REWRITE = _rewrites.register_rewrite("loss_head", loss_head_p, _spans, LOSS_HEAD, _prepare)
"""The loss-head rewrite, registered: `autocast._rewrites.rewrite` applies it to each jaxpr
amp evaluates, before it is planned (never inside `amp_stop`, nor where the policy maps the
span's scopes to `xla_loss_head`, nor with `amp(loss_head="xla")`)."""
