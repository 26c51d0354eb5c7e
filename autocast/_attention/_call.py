"""The extracted call: a `Match`'s span as one `jax.nn.dot_product_attention`, the
trace-time cuDNN support query (`autocast._attention._fuse` emits the platform choice)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from . import _graph, _layout
from ._match import Layout, MaskKind, Match

_IMPLEMENTATIONS = ("xla", "cudnn")


def call(
    match: Match,
    inputs: Sequence[Any],
    *,
    implementation: Literal["xla", "cudnn"] = "xla",
    out_dtype: Any = None,
    attend: Callable[..., Any] | None = None,
) -> list[Any]:
    """The span's outputs, computed by one `jax.nn.dot_product_attention` call.

    Args:
        match: The span.
        inputs: The values of `match.inputs`, in order.
        implementation: The kernel, `"xla"` (runs anywhere) or `"cudnn"`; q, k and v are
            cast to `match.compute_dtype` and laid out as `[B, T, N, H]` for it.
        out_dtype: The dtype of the result (None: the original's).
        attend: The kernel, called in place of `jax.nn.dot_product_attention` with its
            arguments but `implementation` (None: that function; `_attention._fuse` passes
            the fused call made differentiable in every mode, `_derivatives.differentiable`).

    Returns:
        The span's outputs (one), in the original's layout.

    Raises:
        ValueError: `implementation` is neither `"xla"` nor `"cudnn"`, or `inputs` does
            not hold one value per `match.inputs`.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"call(implementation={implementation!r}): one of {_IMPLEMENTATIONS} is allowed")
    if len(inputs) != len(match.inputs):
        raise ValueError(f"call(inputs=...): {len(match.inputs)} values expected (match.inputs), got {len(inputs)}")
    prog, lay = match.program, match.layout
    env: dict[int, Any] = dict(zip(prog.input_ids, inputs))
    env.update(prog.consts)
    _graph.evaluate(prog.nodes, env)
    half = match.compute_dtype
    nb = len(lay.batch)
    q = _operand(env[prog.q], lay.q_axes, nb, half)
    k = _operand(env[prog.k], lay.k_axes, nb, half)
    v = _operand(env[prog.v], lay.v_axes, nb, half)
    rank = len(lay.lout_shape)
    mask = _mask(match, env, rank)
    bias = _bias(match, env, rank)
    kv_len = _length(prog.kv_lengths, env, lay)
    q_len = _length(prog.q_lengths, env, lay)
    causal = MaskKind.CAUSAL in match.mask.kind
    window = (match.mask.window, 0) if match.mask.window is not None else None
    t, s = q.shape[1], k.shape[1]
    if prog.fold_fill is not None:
        bias = _folded_bias(mask, kv_len, bias, prog.fold_fill, s)
        mask = kv_len = None
    qp, kp, vp, maskp, biasp, kvp = _pad(match.seq_multiple, q, k, v, mask, bias, kv_len)
    if attend is None:
        attend = functools.partial(jax.nn.dot_product_attention, implementation=implementation)
    out = attend(
        qp,
        kp,
        vp,
        bias=biasp,
        mask=maskp,
        scale=float(match.scale),
        is_causal=causal,
        query_seq_lengths=q_len,
        key_value_seq_lengths=kvp,
        local_window_size=window,
    )[:, :t]
    if match.mask.may_empty:
        out = _fill_empty_rows(match, out, v, mask, kv_len, q_len, t, s)
    out = _layout.kernel_out_to_output(out, lay)
    factor = _factor(match, env, rank)
    if factor is not None:  # it commutes with the value product, which contracts only the keys
        out = out.astype(jnp.float32) * _layout.scores_to_output(factor, lay.out_amap)
    return [out.astype(match.out_dtype if out_dtype is None else out_dtype)]


def _operand(x: Any, axes: tuple[int, ...], n_batch: int, dtype: np.dtype) -> Any:
    """`x` transposed to `[batch..., seq, heads..., H]` and flattened to the kernel's
    `[B, seq, N, H]` (for q, its group axes follow the heads axis)."""
    x = jnp.transpose(jnp.asarray(x), axes)
    shape = x.shape
    x = jnp.reshape(x, (math.prod(shape[:n_batch]), shape[n_batch], math.prod(shape[n_batch + 1 : -1]), shape[-1]))
    return x.astype(dtype)


def _mask(match: Match, env: dict[int, Any], rank: int) -> Any:
    prog = match.program
    m = None if prog.const_mask is None else jnp.asarray(prog.const_mask)
    for side in prog.masks:
        val = jnp.asarray(env[side.id]).astype(bool)
        val = _layout.to_scores(val if side.coef > 0 else ~val, side.amap, rank, jnp)
        m = val if m is None else m & val
    return None if m is None else _layout.side_to_kernel(m, match.layout)


def _bias(match: Match, env: dict[int, Any], rank: int) -> Any:
    """The biases summed and scaled in the chain's order (so that a sum that overflows to
    `-inf` in the original does here), plus the constant bias."""
    prog = match.program
    b = None
    for op in prog.bias_recipe:
        if op[0] == "add":
            total = None
            for pos, sign in op[1]:
                side = prog.biases[pos]
                val = _layout.to_scores(jnp.asarray(env[side.id]), side.amap, rank, jnp)
                total = sign * val if total is None else total + sign * val
            b = op[2] * total if b is None else b + op[2] * total
        elif op[0] == "convert":
            assert b is not None  # (the recipe starts with a sum)
            b = b.astype(op[1])
        else:
            b = b * op[1] if op[0] == "mul" else b / op[1]
    if prog.const_bias is not None:
        b = jnp.asarray(prog.const_bias) if b is None else b + prog.const_bias
    return None if b is None else _layout.side_to_kernel(b, match.layout)


def _folded_bias(mask: Any, kv_len: Any, bias: Any, fill: Any, s: int) -> Any:
    """The bias with the masks folded into it: `fill` where they mask (the same scores
    at the softmax: `fill` absorbs the scores, `_scores.ABSORBED`)."""
    keep = True if mask is None else mask
    if kv_len is not None:
        keep = keep & (jnp.arange(s)[None, None, None, :] < kv_len[:, None, None, None])
    bias = jnp.zeros((), jnp.float32) if bias is None else bias
    return jnp.where(keep, bias, jnp.asarray(fill, bias.dtype))


def _factor(match: Match, env: dict[int, Any], rank: int) -> Any:
    """The factors on the probabilities, multiplied, broadcastable to the scores (float32)."""
    prog = match.program
    f = None if prog.const_factor is None else jnp.asarray(prog.const_factor, jnp.float32)
    for side in prog.factors:
        val = _layout.to_scores(jnp.asarray(env[side.id], jnp.float32), side.amap, rank, jnp)
        f = val if f is None else f * val
    return f


def _length(side: Any, env: dict[int, Any], lay: Layout) -> Any:
    if side is None:
        return None
    val = _layout.to_scores(jnp.asarray(env[side.id]), side.amap, len(lay.lout_shape), jnp)
    return _layout.lengths_to_kernel(val, lay)


def _pad(multiple: int, q: Any, k: Any, v: Any, mask: Any, bias: Any, kv_len: Any) -> tuple[Any, ...]:
    """Queries and keys padded to `multiple` (the padded keys masked by the kv lengths, or
    by a `-inf` bias where there is a bias, the padded queries sliced off by the caller):
    the same computation. With a bias, the kernel's own mask value (`jax.nn`'s XLA path:
    `-0.7 * finfo.max`) would be above a `finfo.min` bias, which a row may hold for every
    real key: a padded key must be below every real one."""
    t, s = q.shape[1], k.shape[1]
    tp, sp = -(-t // multiple) * multiple, -(-s // multiple) * multiple
    if (tp, sp) == (t, s):
        return q, k, v, mask, bias, kv_len
    pad = [(0, 0), (0, 0), (0, 0), (0, 0)]

    def along(x: Any, axis: int, n: int, value: Any = 0) -> Any:
        widths = list(pad)
        widths[axis] = (0, n)
        return jnp.pad(x, widths, constant_values=value)

    q = along(q, 1, tp - t)
    k, v = along(k, 1, sp - s), along(v, 1, sp - s)
    if mask is not None:  # padded queries keep the real keys (no empty row), padded keys drop
        mask = along(along(jnp.broadcast_to(mask, (*mask.shape[:2], t, s)), 2, tp - t, True), 3, sp - s, False)
    if bias is not None:
        bias = along(along(bias, 2, tp - t), 3, sp - s, -jnp.inf)
        return q, k, v, mask, bias, kv_len
    b = q.shape[0]
    kv_len = jnp.full((b,), s, jnp.int32) if kv_len is None else jnp.minimum(kv_len, s)
    return q, k, v, mask, bias, kv_len


def _fill_empty_rows(match: Match, out: Any, v: Any, mask: Any, kv_len: Any, q_len: Any, t: int, s: int) -> Any:
    """Rows whose every key is masked: the original's softmax is uniform there (every
    masked value is the same number, `_mask.finish` proved it), so the output is the mean
    of the values, or NaN where that number is `-inf`; set it explicitly (a fused kernel
    may not average them). A NaN row is the kernel's row times NaN: its cotangent is NaN
    too, so the gradients are NaN where the original's are (its value product's backward pass
    multiplies the NaN probabilities), not finite."""
    rows, cols = np.indices((t, s))
    keep = np.ones((t, s), bool)
    if MaskKind.CAUSAL in match.mask.kind:
        keep &= cols <= rows
    if match.mask.window is not None:
        keep &= rows - cols <= match.mask.window
    full = jnp.asarray(keep)[None, None]
    if mask is not None:
        full = full & mask
    if kv_len is not None:
        full = full & (jnp.arange(s)[None, None, None, :] < kv_len[:, None, None, None])
    empty = ~jnp.any(full, axis=-1)  # [B|1, N|1, T]
    if q_len is not None:  # the original zeroes those rows anyway
        empty = empty & (jnp.arange(t)[None, None, :] < q_len[:, None, None])
    mean = jnp.mean(v.astype(jnp.float32), axis=1)  # [B, K, Hv]
    groups = out.shape[2] // mean.shape[1]
    mean = jnp.repeat(mean, groups, axis=1)[:, None]  # [B, 1, N, Hv]
    empty = jnp.transpose(empty, (0, 2, 1))[..., None]  # [B|1, T, N|1, 1]
    if match.mask.empty_nan:  # a product, so that NaN also reaches the gradients as in the original
        return out * jnp.where(empty, jnp.nan, 1).astype(out.dtype)
    return jnp.where(empty, mean.astype(out.dtype), out)


def pad_sequences(match: Match, multiple: int) -> Match:
    """`match` with its queries and keys padded to a multiple of `multiple` in the
    kernel (masked padded keys, sliced padded queries: the same computation), for a cuDNN
    that rejects the original lengths.

    Raises:
        ValueError: `multiple` is not a positive int.
    """
    if not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"pad_sequences(multiple={multiple!r}): a positive int is allowed")
    return dataclasses.replace(match, seq_multiple=multiple)


def _avals(match: Match) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(tuple(v.aval.shape), v.aval.dtype) for v in match.inputs]


def cudnn_error(match: Match) -> str | None:
    """None if the cuDNN call (forward and backward) traces for `match`'s inputs, else
    the exception's text ("cuDNN is not detected" on a machine without cuDNN; a shape it
    rejects; ...). Tracing reads the installed cuDNN and the default backend only: a
    deviceless or CPU-only trace answers for that machine."""
    return trace_error(match, implementation="cudnn")


def trace_error(match: Match, **kwargs: Any) -> str | None:
    """None if `call(match, ..., **kwargs)` traces, forward and backward (a vjp), for
    `match`'s inputs, else the exception's text: a kernel's own checks of what it takes
    (JAX's and cuDNN's RuntimeError, NotImplementedError, ValueError; splash's)."""

    def fwd_bwd(*args: Any) -> Any:
        floats = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)]

        def f(*xs: Any) -> Any:
            full = list(args)
            for i, x in zip(floats, xs):
                full[i] = x
            return call(match, full, **kwargs)[0]

        out, vjp = jax.vjp(f, *(args[i] for i in floats))
        return out, vjp(jnp.ones_like(out))

    try:
        jax.eval_shape(fwd_bwd, *_avals(match))
    except Exception as e:
        return f"{type(e).__name__}: {e}".strip()
    return None


def cudnn_plan(match: Match, multiples: Sequence[int] = (1, 2, 64, 128)) -> Match | str:
    """The match to emit for cuDNN (padded to the first multiple of `multiples` whose
    call traces, when the original lengths are rejected), or the reason there is none."""
    first = None
    for m in multiples:
        err = cudnn_error(pad_sequences(match, m))
        if err is None:
            return pad_sequences(match, m)
        first = first or err
        if "sequence length" not in err:
            break
    return first or "no padding multiple given"
