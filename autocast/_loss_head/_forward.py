"""The loss head's first-order derivative made with its forward pass: no chunk is computed
twice.

A chunked loss `L(x, W) = sum_c L_c(x_c, W)` with one float scalar output is linear in its
cotangent: its derivative in the direction `(tx, tW)` is `<dL/dx, tx> + <dL/dW, tW>`. So
the loop that computes the loss also takes JAX's own `jax.vjp` of each chunk's equations (the
user's equations under amp's rules, as in the loop) at cotangent 1 and keeps the gradients:
each chunk's `dL/dx_c` (the size of the hidden states) and `dL/dW` summed across chunks in
float32. The loss is a `jax.custom_jvp` whose tangent is that inner product: JAX transposes it
into `cotangent * gradient`, so the loss scale and any outer factor reach every gradient by
construction, and differentiating the rule again (a Hessian) differentiates `jax.vjp`. Where
nothing differentiates the loss, only the loop runs.

Against `lax.scan` + `jax.checkpoint` (the fallback, `_chunk`): the logits are computed once
per step, not twice (GPT-2 small, deviceless H100: the recomputed `[tokens, vocab]` product is
4 % of the step). It applies where the loss is one float scalar and the compute dtype is
bfloat16: a gradient at cotangent 1 must not underflow where the loss scale would have kept it
(float16's range is what the dynamic loss scaler exists for), and a per-token or maximised
output has no such inner product.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat, _dtypes
from . import _axes

_F32 = np.dtype(np.float32)

UNROLL: bool = False
"""Unroll the chunk loops (`_forward`'s and `_chunk`'s `lax.scan`): the same computation in
straight-line code, for measurement only. XLA's cost analysis counts a loop's body once, so
`benchmarks/tpu_modeled` sets it to count every chunk's bytes and FLOPs (`--unroll-loss-head`)."""


def applies(compute_dtype: Any, shapes: Sequence[Any], kinds: Sequence[Any]) -> bool:
    """Whether the span's outputs are summed scalars, exactly one of them float, and the
    compute dtype bfloat16."""
    if np.dtype(compute_dtype) != np.dtype(jnp.bfloat16):
        return False
    if not all(k == _axes.SUM and tuple(s.shape) == () for s, k in zip(shapes, kinds)):
        return False
    return sum(_dtypes.is_floating(s.dtype) for s in shapes) == 1


def with_gradients(
    run: Callable[[Sequence[Any], Sequence[Any], Any], list[Any]],
    xs: Sequence[Any],
    whole: Sequence[Any],
    cast_w: Any,
    shapes: Sequence[Any],
) -> list[Any]:
    """The span's outputs, summed over the chunks (stacked on the leading axis of `xs`), as a
    `jax.custom_jvp` whose derivative is the inner product with the gradients the loop keeps.

    Args:
        run: `run(chunk_inputs, whole_inputs, cast_w)`: one chunk's outputs.
        xs: The chunked inputs, each stacked on a leading chunk axis.
        whole: The inputs every chunk reads whole.
        cast_w: The weight cast to the compute dtype once (None: each chunk casts it); an
            input of the `custom_jvp` whose tangent is not used (the weight's counts).
        shapes: The outputs' shapes and dtypes (scalars).

    Returns:
        The outputs, in their dtypes.
    """
    acc = [_F32 if _dtypes.is_floating(s.dtype) else np.dtype(s.dtype) for s in shapes]
    loss = next(j for j, s in enumerate(shapes) if _dtypes.is_floating(s.dtype))

    def total(xs: list[Any], whole: list[Any], cast_w: Any) -> list[Any]:
        def step(carry, xs_t):
            outs = run(xs_t, whole, cast_w)
            return [c + o.astype(c.dtype) for c, o in zip(carry, outs)], None

        carry, _ = jax.lax.scan(step, [jnp.zeros((), a) for a in acc], xs, unroll=UNROLL)
        return carry

    head = jax.custom_jvp(total)

    def jvp(primals, tangents):
        xs, whole, cast_w = primals
        txs, twhole, _ = tangents
        dx = [i for i, (x, t) in enumerate(zip(xs, txs)) if _varies(x, t)]
        dw = [i for i, (w, t) in enumerate(zip(whole, twhole)) if _varies(w, t)]

        def step(carry, xs_t):
            sums, gw = carry

            def chunk(x_vals, w_vals):
                xs_l, whole_l = list(xs_t), list(whole)
                for i, v in zip(dx, x_vals):
                    xs_l[i] = v
                for i, v in zip(dw, w_vals):
                    whole_l[i] = v
                outs = run(xs_l, whole_l, cast_w)
                return outs[loss].astype(_F32), outs

            _, pullback, outs = jax.vjp(chunk, [xs_t[i] for i in dx], [whole[i] for i in dw], has_aux=True)
            gx, gws = pullback(jnp.ones((), _F32))
            sums = [c + o.astype(c.dtype) for c, o in zip(sums, outs)]
            gw = [a + g.astype(a.dtype) for a, g in zip(gw, gws)]
            return (sums, gw), gx

        init = ([jnp.zeros((), a) for a in acc], [jnp.zeros(whole[i].shape, _F32) for i in dw])
        (sums, gw), gx = jax.lax.scan(step, init, xs, unroll=UNROLL)
        tangent = jnp.zeros((), _F32)
        for g, i in zip(gx, dx):
            tangent = tangent + jnp.sum(g.astype(_F32) * txs[i].astype(_F32))
        for g, i in zip(gw, dw):
            tangent = tangent + jnp.sum(g * twhole[i].astype(_F32))
        tangents_out = [tangent.astype(a) if j == loss else _zero_tangent(a) for j, a in enumerate(acc)]
        return sums, tangents_out

    head.defjvp(jvp, symbolic_zeros=True)
    carry = head(list(xs), list(whole), cast_w)
    return [c.astype(s.dtype) for c, s in zip(carry, shapes)]


def _varies(x: Any, t: Any) -> bool:
    return not _compat.is_zero(t) and _dtypes.is_floating(_dtypes.dtype_of(x))


def _zero_tangent(dtype: np.dtype) -> Any:
    if _dtypes.is_floating(dtype):
        return jnp.zeros((), dtype)
    return np.zeros((), dtype=jax.dtypes.float0)
