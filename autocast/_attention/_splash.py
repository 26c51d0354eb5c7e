"""The TPU branch of a fused span: Pallas's splash attention
(`jax.experimental.pallas.ops.tpu.splash_attention`) where it is the same computation.

`tpu_plan(match)` decides, as `cudnn_plan` does for cuDNN: the match to emit (its sequences
padded to a multiple of 128, splash's block) or why there is none. `kernel(plan, interpret)`
is the kernel, a function with `jax.nn.dot_product_attention`'s arguments but
`implementation` (`call` computes its q, k, v, mask and lengths as for cuDNN; `_fuse` makes it
differentiable in every mode with `_derivatives.differentiable`, XLA's attention in float32
taking every derivative but the first-order reverse one).

How the match's mask reaches splash, which has no bias and no traced mask of its own:

- `is_causal` (T == S), a causal band (`local_window_size=(w, 0)`) and a constant mask equal
  across the batch: one static mask per query head (`CausalMask`, `LocalMask`, `NumpyMask`
  in a `MultiHeadMask`), `and`-ed; splash skips the blocks it masks;
- key lengths, a traced mask over the keys only (a padding mask, `[B, 1, 1, S]`), and the
  padded keys: the keys' segment ids (0 kept, 1 masked), the queries' 0;
- a fully masked row: `call` sets it (the mean of the values, or NaN) as for cuDNN; the kernel
  must not see one (its output and its backward pass there are 0 / 0), so such a row's query
  gets segment id 1 (it attends to the keys its static mask keeps, all masked: a finite row
  that `call` overwrites and whose cotangent it zeroes), and a static mask's empty row keeps
  every key;
- query lengths: the rows past them zeroed after the kernel (as `jax.nn`'s XLA path does).

Refused, with the reason (`tpu_plan`): a bias (traced, constant, or masks folded into one), a
traced mask that varies along the queries or heads, a constant mask that differs across the
batch, or across the kv-head groups of grouped-query attention, a per-head constant mask beside
a traced key mask where a row may be fully masked, float16 operands (a TPU computes in
bfloat16), head dimensions splash does not take.

Numerics. splash takes no scale: the kernel multiplies q by it in float32 and rounds the
product to bfloat16, one rounding (at most 2**-8 relative per element of q) that the original
(the scale on the float32 scores) does not have; none where the scale is a power of two
(`1 / sqrt(d)` for d = 16, 64, 256). The scores are accumulated in float32, the softmax's
statistics are float32, the probabilities are rounded to bfloat16 for the value product, as in
cuDNN's kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from . import _layout
from ._call import pad_sequences, trace_error
from ._match import Match

BLOCK = 128
"""splash's default block (queries and keys): sequences are padded to a multiple of it."""


def tpu_plan(match: Match) -> Match | str:
    """The match to emit for splash attention (its sequences padded to a multiple of `BLOCK`
    where they are not one), or the reason there is none.

    Args:
        match: A span `find` proved.

    Returns:
        The padded match, or a reason such as `"splash: a traced bias"`.
    """
    reason = _refusal(match)
    if reason is not None:
        return f"splash: {reason}"
    lay = match.layout
    t, s = lay.lout_shape[lay.t], lay.lout_shape[lay.s]
    plan = pad_sequences(match, 1 if t % BLOCK == 0 and s % BLOCK == 0 else BLOCK)
    err = _trace_error(plan)
    return plan if err is None else f"splash: {err}"


def tpu_refusal() -> str | None:
    """Why a program traced here gets no splash branch for a TPU, or None: no TPU compiler
    here (neither a TPU backend nor libtpu: the branch would only cost its trace, about 30 ms
    an attention layer, on every CPU and GPU machine), or several TPUs XLA would have to
    partition the kernel over (`partition_refusal`). Not part of `tpu_plan`: it depends on
    where amp traces, not on the match."""
    if not _compat.tpu_compiler():
        return "splash: no TPU compiler here (no TPU backend, libtpu not installed)"
    return partition_refusal()


def partition_refusal() -> str | None:
    """Why splash cannot run in a program traced here, or None: XLA cannot partition a Mosaic
    kernel (a `jit` over several TPU devices fails to lower with one), so it runs only where the
    program runs on one TPU or inside a `shard_map` manual over every mesh axis
    (`_compat.partitioned_tpus`). Not part of `tpu_plan`: it depends on where amp traces, not on
    the match."""
    n = _compat.partitioned_tpus()
    if n > 1:
        return f"splash: {n} TPU devices outside shard_map (XLA cannot partition a Mosaic kernel)"
    return None


def _refusal(match: Match) -> str | None:
    prog, lay = match.program, match.layout
    if _compat.splash_attention() is None:
        return "this JAX has no Pallas TPU splash attention"
    if prog.biases:
        return "a traced bias (the kernel adds none)"
    if prog.fold_fill is not None:
        return "masks folded into a bias (the kernel adds none)"
    if prog.const_bias is not None:
        return "a constant bias (the kernel adds none)"
    if np.dtype(match.compute_dtype) != np.dtype(jnp.bfloat16):
        return f"{np.dtype(match.compute_dtype).name} operands (a TPU computes in bfloat16)"
    lay_t, lay_s = lay.lout_shape[lay.t], lay.lout_shape[lay.s]
    if min(lay_t, lay_s) < BLOCK:
        return f"sequences of {lay_t} x {lay_s}, shorter than the kernel's block of {BLOCK} (it would compute padding mostly)"
    keys = set(lay.batch) | {lay.s}
    if any(not set(a for a in side.amap if a != -1) <= keys for side in prog.masks):
        return "a traced mask that varies along the queries or heads (the kernel takes the keys' segment ids)"
    const = _const_mask(match)
    if isinstance(const, str):
        return const
    if const is not None and const.shape[0] > 1 and (prog.masks or prog.kv_lengths) and match.mask.may_empty:
        return "a per-head constant mask beside key lengths or a traced key mask, where a row may be fully masked"
    return None


def _const_mask(match: Match) -> np.ndarray | str | None:
    """The match's constant mask as the kernel's `[N|1, T, S]` (NumPy; None: there is none), or
    why the kernel cannot take it (it differs across the batch, or across kv-head groups)."""
    prog, lay = match.program, match.layout
    if prog.const_mask is None:
        return None
    m = np.asarray(_layout.side_to_kernel(np.asarray(prog.const_mask, bool), lay, xp=np))
    if m.shape[0] > 1 and not (m == m[:1]).all():
        return "a constant mask that differs across the batch (the kernel's masks are per head)"
    m = m[0]
    if m.shape[0] > 1 and match.groups > 1:
        per_kv = m.reshape(match.kv_heads, match.groups, *m.shape[1:])
        if not (per_kv == per_kv[:1]).all():
            return "a constant mask that differs across kv-head groups (one kernel runs for every group)"
        m = per_kv[0]
    return m


def _trace_error(plan: Match) -> str | None:
    """None if the kernel (forward and backward) traces for `plan`'s inputs, else the error
    (splash's own checks: ValueError, NotImplementedError)."""
    return trace_error(plan, attend=kernel(plan, interpret=False))


@dataclasses.dataclass(frozen=True, eq=False)
class _Splash:
    """The kernel for one plan: `jax.nn.dot_product_attention`'s arguments (q `[B, T, N, H]`,
    k and v `[B, S, K, H]`, `mask` `[B|1, N|1, T, S]`, lengths `[B]`, all as `call` passes them,
    sequences padded), splash attention's result `[B, T, N, Hv]`.

    Attributes:
        t: The queries before padding (rows past them are padding: not read from `mask`).
        const: The constant mask, `[N|1 or G, T, S]` unpadded (None: none).
        key_mask: `mask` holds a traced mask over the keys (the kernel reads it as segment ids).
        may_empty: A row may be fully masked.
        groups: Query heads per kv head (above 1: `make_splash_mqa` per kv head).
        interpret: Pallas's interpret mode (any platform; a TPU runs the compiled kernel).
    """

    t: int
    const: np.ndarray | None
    key_mask: bool
    may_empty: bool
    groups: int
    interpret: bool

    def __call__(
        self,
        q: Any,
        k: Any,
        v: Any,
        bias: Any = None,
        mask: Any = None,
        *,
        scale: float = 1.0,
        is_causal: bool = False,
        query_seq_lengths: Any = None,
        key_value_seq_lengths: Any = None,
        local_window_size: tuple[int, int] | None = None,
    ) -> Any:
        if bias is not None:
            raise ValueError("splash attention adds no bias (tpu_plan refuses a match with one)")
        sa = _compat.splash_attention()
        b, tp, n, _ = q.shape
        sp = k.shape[1]
        if scale != 1.0:  # splash has no scale: one bfloat16 rounding of q * scale (exact for powers of two)
            q = (q.astype(jnp.float32) * scale).astype(q.dtype)
        window = None if local_window_size is None else local_window_size[0]
        static = self._static(tp, sp, is_causal, window)
        segments = self._segments(b, tp, sp, mask, key_value_seq_lengths, is_causal, window)
        masks = self._masks(static, self.groups if self.groups > 1 else n, tp, sp, is_causal, window)
        make = sa.make_splash_mqa if self.groups > 1 else sa.make_splash_mha
        splash = make(
            sa.MultiHeadMask(masks), head_shards=1, q_seq_shards=1, block_sizes=_blocks(), interpret=self.interpret
        )
        qh, kh, vh = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [B, heads, seq, H]
        if self.groups > 1:
            kv = kh.shape[1]
            qg = jnp.reshape(qh, (b, kv, self.groups, tp, qh.shape[-1]))
            per_kv = jax.vmap(splash, in_axes=(0, 0, 0, None))
            out = jax.vmap(per_kv)(qg, kh, vh, segments)
            out = jnp.reshape(out, (b, n, tp, out.shape[-1]))
        else:
            out = jax.vmap(splash)(qh, kh, vh, segments)
        out = jnp.swapaxes(out, 1, 2)  # [B, T, N, Hv]
        if query_seq_lengths is not None:  # as jax.nn's XLA path: rows past the query lengths are 0
            rows = jnp.arange(tp)[None, :] < query_seq_lengths[:, None]
            out = out * rows[:, :, None, None].astype(out.dtype)
        return out

    def _static(self, tp: int, sp: int, causal: bool, window: int | None) -> np.ndarray | None:
        """The constant mask padded to `[heads, tp, sp]` and `and`-ed with the causal band,
        its empty rows keeping every key (None: no constant mask; the band alone)."""
        if self.const is None:
            return None
        m = np.zeros((self.const.shape[0], tp, sp), bool)
        m[:, : self.const.shape[1], : self.const.shape[2]] = self.const
        m[:, self.const.shape[1] :, : self.const.shape[2]] = True  # padded queries: sliced off
        m &= _band(tp, sp, causal, window)[None]
        m[~m.any(axis=-1)] = True  # a row the call fills: any keys but none (0 / 0 in the kernel)
        return m

    def _masks(self, static: np.ndarray | None, heads: int, tp: int, sp: int, causal: bool, window: int | None):
        sa = _compat.splash_attention()
        if static is not None:
            return [sa.NumpyMask(h) for h in static] if static.shape[0] == heads else [sa.NumpyMask(static[0])] * heads
        if window is not None:
            return [sa.LocalMask((tp, sp), (window, 0), 0)] * heads
        if causal:
            return [sa.CausalMask((tp, sp))] * heads
        return [sa.FullMask((tp, sp))] * heads

    def _segments(self, b: int, tp: int, sp: int, mask: Any, kv_len: Any, causal: bool, window: int | None) -> Any:
        """The segment ids of the keys (0: kept; 1: past a length, masked by a traced key
        mask, or padding) and of the queries (0, or 1 for a row with no kept key: it attends
        to its static keys, all masked, and the call overwrites it). None: every key kept."""
        keep = None
        if kv_len is not None:
            keep = jnp.arange(sp)[None, :] < kv_len[:, None]
        if self.key_mask and mask is not None:
            # the traced key mask, from the combined one: any over the real queries and the heads
            # of const & keys is keys & (a column the constant keeps), which and-ed with the
            # constant again is exactly the combined mask
            keys = jnp.any(mask[:, :, : self.t, :], axis=(1, 2))
            keep = keys if keep is None else keep & keys
        if keep is None:
            return None
        keep = jnp.broadcast_to(keep, (b, sp))
        q_ids = jnp.zeros((b, tp), jnp.int32)
        if self.may_empty:
            heads = self._static(tp, sp, causal, window)  # one head (tpu_plan: one static mask for all)
            static = jnp.asarray(_band(tp, sp, causal, window) if heads is None else heads[0])
            empty = ~jnp.any(static[None] & keep[:, None, :], axis=-1)  # [B, tp]
            q_ids = empty.astype(jnp.int32)
        sa = _compat.splash_attention()
        return sa.SegmentIds(q=q_ids, kv=jnp.where(keep, 0, 1).astype(jnp.int32))


def _blocks() -> Any:
    """splash's default blocks (`BLOCK` everywhere), with q, k and v laid out sequence-minor
    (`[heads, head_dim, seq]` in the kernel: the layout only, not the numerics). What the
    kernel keeps for its backward pass is then not padded to the TPU's 128 lanes along a head
    dimension of 64: GPT-2 small's v5e step, temp 3,374 -> 2,931 MiB, bytes accessed 52.8 ->
    49.2 GB (deviceless, 2026-11-28)."""
    sa = _compat.splash_attention()
    seq = sa.QKVLayout.SEQ_MINOR
    return sa.BlockSizes(
        block_q=BLOCK,
        block_kv=BLOCK,
        block_kv_compute=BLOCK,
        block_q_dkv=BLOCK,
        block_kv_dkv=BLOCK,
        block_kv_dkv_compute=BLOCK,
        block_q_dq=BLOCK,
        block_kv_dq=BLOCK,
        q_layout=seq,
        k_layout=seq,
        v_layout=seq,
    )


def _band(tp: int, sp: int, causal: bool, window: int | None) -> np.ndarray:
    """The causal band as a `[tp, sp]` boolean (all true without `is_causal`)."""
    rows, cols = np.indices((tp, sp))
    keep = np.ones((tp, sp), bool)
    if causal:
        keep &= cols <= rows
    if window is not None:
        keep &= rows - cols <= window
    return keep


def kernel(plan: Match, interpret: bool = False) -> Callable[..., Any]:
    """The splash kernel for a plan `tpu_plan` gave, with `jax.nn.dot_product_attention`'s
    arguments but `implementation` (what `call` passes as `attend`).

    Args:
        plan: The plan.
        interpret: Run Pallas's interpret mode (any platform: the tests on CPU).

    Returns:
        The kernel.
    """
    const = _const_mask(plan)
    lay = plan.layout
    return _Splash(
        t=lay.lout_shape[lay.t],
        const=const if isinstance(const, np.ndarray) else None,
        key_mask=bool(plan.program.masks),
        may_empty=plan.mask.may_empty,
        groups=plan.groups,
        interpret=interpret,
    )


def describe(plan: Match) -> str:
    """What runs on a TPU, for `explain`."""
    pad = f", sequences padded to a multiple of {plan.seq_multiple}" if plan.seq_multiple > 1 else ""
    kind = "make_splash_mqa per kv head" if plan.groups > 1 else "make_splash_mha"
    return f"splash ({kind}{pad})"
