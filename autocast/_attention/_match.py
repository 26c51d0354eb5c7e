"""What the recogniser reports: `Match` (a span it can replace) and `LeftAlone`
(an attention it recognised and leaves as it is, with the reason)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _graph


class MaskKind(enum.Flag):
    """How a match's mask reaches `jax.nn.dot_product_attention` (flags combine:
    `CAUSAL | KV_LENGTHS`). `NONE`: no mask, or a constant mask that keeps everything."""

    NONE = 0
    CAUSAL = enum.auto()  # is_causal=True (a constant lower-triangular mask, T == S)
    WINDOW = enum.auto()  # local_window_size=(window, 0) with is_causal (a constant band)
    KV_LENGTHS = enum.auto()  # key_value_seq_lengths (key positions < a traced length)
    Q_LENGTHS = enum.auto()  # query_seq_lengths (the original also zeroes those rows)
    MASK = enum.auto()  # mask= (any other boolean mask, constant or traced, full T x S)
    BIAS = enum.auto()  # bias= (an additive bias, full T x S)


@dataclass(frozen=True)
class Operand:
    """One of q, k, v as the rewrite reads it: the input it comes from (an index into
    `Match.inputs`), that input's shape and dtype, and the role of each of its axes:
    `"B"` (a batch axis, flattened into the kernel's batch), `"N"` (the heads axis),
    `"G"` (a query-only axis: grouped-query heads), `"T"` (queries), `"S"` (keys),
    `"H"` (the head dimension)."""

    input: int
    shape: tuple[int, ...]
    dtype: np.dtype
    roles: tuple[str, ...]

    def describe(self) -> str:
        return f"{np.dtype(self.dtype).name}{list(self.shape)} ({' '.join(self.roles)})"


@dataclass(frozen=True)
class Mask:
    """The mask class of a match and its data.

    Attributes:
        kind: How the mask reaches the kernel (`MaskKind` flags).
        window: The left window (keys `t - window .. t`) with `MaskKind.WINDOW`.
        may_empty: Some query row may have every key masked (the original then averages
            all values uniformly; the call reproduces that explicitly).
        empty_nan: Such a row is NaN in the original (every masked value is `-inf`); the
            call gives NaN there.
        folded: The masks are folded into the bias (a learned bias beside them could mask
            a row on its own): the kernel reads the bias and no mask.
    """

    kind: MaskKind
    window: int | None = None
    may_empty: bool = False
    empty_nan: bool = False
    folded: bool = False

    def describe(self) -> str:
        if not self.kind:
            return "no mask"
        names = [k.name.lower() for k in MaskKind if k and k in self.kind and k.name]
        text = " + ".join(n.replace("_", " ") for n in names)
        if self.window is not None:
            text += f" (window {self.window})"
        if self.folded:
            text += " (the masks folded into it)"
        return text


@dataclass(frozen=True)
class Side:
    """A traced side value of the scores (a mask leaf, a bias, a length): its value id in
    the match's program, its axes as axes of the scores (`-1`: a size-1 axis they lack),
    and a coefficient (biases) or polarity (masks: 1.0 keeps where true, -1.0 where false)."""

    id: int
    amap: tuple[int, ...]
    coef: float = 1.0


@dataclass(frozen=True, eq=False)
class Layout:
    """The axes of the scores (the `q . k` product's output) by role, and how the
    kernel's layout maps back to the span's output."""

    lout_shape: tuple[int, ...]
    batch: tuple[int, ...]  # score axes flattened into the kernel's batch
    heads: int | None  # the score axis that is the kernel's kv heads (None: 1 head)
    groups: tuple[int, ...]  # query-only score axes (grouped-query heads)
    t: int
    s: int
    q_axes: tuple[int, ...]  # per kernel q axis [batch..., T, heads?, groups..., H]: q's axis
    k_axes: tuple[int, ...]  # [batch..., S, heads?, H]: k's axis
    v_axes: tuple[int, ...]  # [batch..., S, heads?, Hv]: v's axis
    kv_repeat: int  # the heads axis of k and v is repeated this many times in the original
    out_amap: tuple[int, ...]  # per output axis: a score axis, -2 (Hv) or -1 (size 1)


@dataclass(frozen=True, eq=False)
class Program:
    """How the call computes its operands from the match's inputs: `nodes` (equations of
    the span that compute side values, in order) evaluated on the inputs (`input_ids`)
    and constants (`consts`)."""

    input_ids: tuple[int, ...]
    nodes: tuple[_graph.Node, ...]
    consts: dict[int, Any]
    q: int
    k: int
    v: int
    masks: tuple[Side, ...] = ()
    biases: tuple[Side, ...] = ()
    kv_lengths: Side | None = None
    q_lengths: Side | None = None
    const_mask: np.ndarray | None = None  # broadcastable to the scores; True keeps
    const_bias: np.ndarray | None = None  # broadcastable to the scores, already scaled
    fold_fill: Any = None  # not None: the masks are folded into the bias, this where masked
    bias_recipe: tuple[tuple[Any, ...], ...] = ()  # how `biases` sum as the chain sums them (`_mask.bias_recipe`)
    factors: tuple[Side, ...] = ()  # traced factors on the probabilities (on the output, per head)
    const_factor: np.ndarray | None = None  # broadcastable to the scores, size 1 along the keys


@dataclass(frozen=True, eq=False)
class Match:
    """An attention span the recogniser proved equal to one
    `jax.nn.dot_product_attention` call.

    The emitted computation goes where the last equation of `eqns` was: every input is
    defined before it, every reader of `outputs` after it.

    Attributes:
        eqns: Indices of the top-level equations the rewrite replaces (sorted). Every
            value they compute is read only among them, except `outputs`.
        inputs: The top-level variables whose values `call` takes, in order (q, k and v
            first). Constants the span reads are folded into the match.
        outputs: The variables the call's results stand for (one).
        q: Where the queries come from and the role of each of their axes.
        k: The same for the keys.
        v: The same for the values.
        scale: The concrete scale on the scores (folded from every constant factor on
            the scores, q or k).
        mask: The mask class.
        kv_heads: The kernel's kv heads.
        groups: The kernel's query heads per kv head (grouped-query attention when
            `groups > 1`).
        idiom: What the span looks like (for `explain`).
        compute_dtype: The half dtype q, k and v are cast to for the kernel.
        out_shape: The shape of the span's output.
        out_dtype: The dtype of the span's output.
        layout: The axes of the scores by role (`Layout`).
        program: How the call computes its side values from `inputs` (`Program`).
        seq_multiple: Sequences are padded to a multiple of this (see `pad_sequences`).
    """

    eqns: tuple[int, ...]
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    q: Operand
    k: Operand
    v: Operand
    scale: float
    mask: Mask
    kv_heads: int
    groups: int
    idiom: str
    compute_dtype: np.dtype
    out_shape: tuple[int, ...]
    out_dtype: np.dtype
    layout: Layout = field(repr=False)
    program: Program = field(repr=False)
    seq_multiple: int = 1

    def describe(self) -> str:
        """One line for `explain`."""
        heads = f"{self.kv_heads * self.groups} heads"
        if self.groups > 1:
            heads += f" on {self.kv_heads} kv heads"
        pad = f", sequences padded to a multiple of {self.seq_multiple}" if self.seq_multiple > 1 else ""
        return (
            f"attention ({self.idiom}) -> jax.nn.dot_product_attention in {np.dtype(self.compute_dtype).name}: "
            f"q {self.q.describe()}, k {self.k.describe()}, v {self.v.describe()}; {heads}, "
            f"scale {self.scale:.6g}, {self.mask.describe()}{pad}"
        )


@dataclass(frozen=True)
class LeftAlone:
    """An attention the recogniser leaves as it is: the top-level equation of its softmax
    (`anchor`), what it looks like (`idiom`) and why (`reason`)."""

    anchor: int
    idiom: str
    reason: str

    def describe(self) -> str:
        """One line for `explain`."""
        return f"attention ({self.idiom}) left alone: {self.reason}"
