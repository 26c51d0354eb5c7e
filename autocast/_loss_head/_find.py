"""Find the loss head in a jaxpr: a projection to the vocabulary and the row-local equations
that read its result, down to reductions over the tokens.

**The anchor.** A `dot_general` one of whose operands is *whole* (the weight: read the same
by every chunk) and whose result is at least `AMPLIFY` times the other operand (the hidden
states): tokens x vocabulary from tokens x width and width x vocabulary. The token axis is
one of the hidden states' free axes (tried in order); roles come from the dimension numbers,
never from positions or sizes, so `x @ W.T`, `einsum("btd,vd->btv")`, a tied embedding and
a head `vmap`ped per example (the batch folds into the free axes) are all the same head.

**Row-locality, proved.** Every equation that reads a chunked value must be row-local along
the token axis (`_axes.relate`, per primitive: elementwise operations, layout equations
whose token axis survives, reductions over other axes, per-row gathers: `take_along_axis`,
optax's integer labels, one-hot products), through the small `jit`s a loss is made of
(`log_softmax`, `take_along_axis`, `_one_hot`: inlined, `autocast._attention._graph`). A
reduction over the token axis (`sum`, `mean`'s sum, a masked sum; `max`) ends the chain: its
result is what the span returns, accumulated across chunks. Per-token values read after the
span (a per-token loss returned unreduced) come back whole, concatenated.

Side values with a token axis (labels, masks, weights) are sliced per chunk; those computed
only from labels and constants (a one-hot, label smoothing, `iota`) and read only by the
loss are computed per chunk instead (never a `[tokens, vocab]` one-hot in full).

**Left alone, with the reason** (`Kept`): the logits, or any value as large, read after the
loss (returned, an accuracy `argmax` kept per token and vocab entry, sown); a reduction that
mixes rows and is read again by the chain (a softmax over the batch axis, a loss normalised
across rows before the sum); an operation along the tokens (a cumulative sum, a shift of the
logits along the token axis chosen); a call amp cannot look into or a second matmul reading
the logits; a call that mixes the loss with other work; no token axis the chunk count can
divide.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import _compat, _dtypes
from .._attention._graph import Graph, Lit, Node
from . import _axes, _pad, _vocab

AMPLIFY = 8
"""How many times the hidden states' elements the head's result must have: the vocabulary at
least eight times the width, as PyTorch Inductor's auto_chunker asks (GPT-2 small: 50,257 / 768 = 65; an MLP's 4x up-projection or a classifier over 10 classes is
not a head worth chunking)."""


PREFERRED = 8
"""Of the token axes a head is row-local along, the finder takes the first that allows this
many chunks (or the one allowing most): the batch axis of 8 x 1024 tokens, not the sequence."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """A loss head the finder proved row-local along one token axis.

    Attributes:
        what: What it is, for `explain`.
        nodes: The span's first-order equations (the inlined view), in program order.
        axes: Value id -> its token axis (`int`) or how it ends (`SUM`, `MAX`); absent: whole.
        inputs: The ids the span reads from outside (top-level variables), in order.
        outputs: The ids it returns (top-level variables), in order.
        consts: Ids of constants inside inlined calls -> their values.
        sizes: The sizes of the token axis along the chain: a chunk count must divide each.
        logits_bytes: The head's result in float32, in bytes (what chunking divides).
        relations: Each node's token axes (`_axes.relate`'s), in `nodes` order.
        in_vars: The top-level variables of `inputs`.
        out_vars: The top-level variables of `outputs`.
        weight: The index in `inputs` of the head's whole operand (the weight), or None where
            the span makes it.
        inner: For each chunked input and output, its rows per group: chunk `j` of `k` holds
            the rows `r` of its token axis with `(r // inner) % k == j` (the head's token axis:
            `inner` 1, every `k`-th row; merged with the axes after it, their size). Chunks so
            interleaved hold rows of every shard of a batch sharded across devices.
        sizes: (as above) The number of row groups of each chunked value.
        head: The index in `nodes` of the head's matmul.
        pad: How its vocabulary is padded for the chunks' matmuls (`_pad`), or None.
    """

    what: str
    nodes: tuple[Node, ...]
    axes: Mapping[int, _axes.Axis]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    consts: Mapping[int, Any]
    sizes: tuple[int, ...]
    logits_bytes: int
    relations: tuple[Mapping[_axes.Slot, _axes.Axis], ...]
    in_vars: tuple[Any, ...]
    out_vars: tuple[Any, ...]
    weight: int | None = None
    inner: Mapping[int, int] = dataclasses.field(default_factory=dict)
    head: int = -1
    pad: _pad.Pad | None = None

    def chunk_counts(self) -> list[int]:
        """The chunk counts this plan allows (those that divide every size), ascending."""
        g = 0
        for n in self.sizes:
            g = math.gcd(g, n)
        return [k for k in range(2, g + 1) if g % k == 0]


@dataclasses.dataclass(frozen=True)
class Refused:
    """A head the finder saw and leaves as written: `what`, and why."""

    what: str
    why: str
    eqns: tuple[int, ...] = ()


def find(jaxpr: Any, consts: Sequence[Any] = ()) -> list[tuple[tuple[int, ...], Plan] | Refused]:
    """The loss heads of an open jaxpr's top-level equations.

    Args:
        jaxpr: The open jaxpr.
        consts: The values of its constants, paired with `(*constvars, *invars)` as
            `autocast._compat.bind_inputs` pairs them.

    Returns:
        For each head, `(top-level equation indices, Plan)` or `Refused`; spans never overlap.
    """
    open_, own = _compat.open_and_consts(jaxpr)
    if not any(e.primitive.name == _vocab.HEAD for e in open_.eqns):
        return []
    known = dict(zip(open_.constvars, own)) if own else dict(zip([*open_.constvars, *open_.invars], consts))
    g = Graph(open_, known)
    found: list[tuple[tuple[int, ...], Plan] | Refused] = []
    taken: set[int] = set()
    for n, node in enumerate(g.nodes):
        if node.name != _vocab.HEAD or node.opaque or node.top in taken:
            continue
        candidate = _anchor(g, node)
        if candidate is None:
            continue
        what, choices = candidate
        result: tuple[tuple[int, ...], Plan] | Refused | None = None
        best = 0
        for operand, axis in choices:
            try:
                attempt = _span(g, n, operand, axis, what)
            except _axes.NotLocal as e:
                result = result if result is not None else Refused(what, str(e), (node.top,))
                continue
            except Exception as e:  # a jaxpr the finder does not know: never fail amp's trace
                result = result if result is not None else Refused(what, f"not recognised ({type(e).__name__}: {e})")
                continue
            counts = attempt[1].chunk_counts()
            if not counts:
                result = result if result is not None else Refused(what, "no chunk count divides its token axis")
            elif min(counts[-1], PREFERRED) > best:  # the token axis that allows the most chunks (up to 8)
                result, best = attempt, min(counts[-1], PREFERRED)
        if result is None:
            continue
        if isinstance(result, tuple):
            if taken & set(result[0]):
                continue
            taken.update(result[0])
        found.append(result)
    return found


def _anchor(g: Graph, node: Node) -> tuple[str, list[tuple[int, int]]] | None:
    """(what it is, [(token operand 0 or 1, token axis of the result)]) if `node` projects
    to something `AMPLIFY` times larger than one operand; None otherwise."""
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lhs, rhs = (g.shape(a) for a in node.ins)
    out = g.shape(node.outs[0])
    size = int(np.prod(out, dtype=np.int64))
    lfree = [i for i in range(len(lhs)) if i not in lc and i not in lb]
    rfree = [i for i in range(len(rhs)) if i not in rc and i not in rb]
    choices = []
    # the result's axes: batch, then lhs free, then rhs free
    for operand, free, first in ((0, lfree, len(lb)), (1, rfree, len(lb) + len(lfree))):
        other = rhs if operand == 0 else lhs
        mine = lhs if operand == 0 else rhs
        if size >= AMPLIFY * int(np.prod(mine, dtype=np.int64)) and size > int(np.prod(other, dtype=np.int64)):
            choices += [(operand, first + j) for j in range(len(free))]
    if not choices or lb:
        return None
    what = f"loss head {_dims(lhs)} x {_dims(rhs)} -> {_dims(out)}"
    frame = _compat.user_frame(node.source) if node.source is not None else None
    if frame is not None:
        what += f" at {Path(frame[0]).name}:{frame[1]}"
    return what, choices


def _dims(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(n) for n in shape) + "]"


class _Build:
    """The state of one attempt: the span's nodes and every value's token axis."""

    def __init__(self, g: Graph, no_pull: set[int]):
        self.g = g
        self.members: set[int] = set()
        self.axes: dict[int, _axes.Axis] = {}  # the span's values (the head's result and what it feeds)
        self.sliced: dict[int, int] = {}  # values made outside, sliced per chunk (not the span's)
        self.after: set[int] = set()  # values made from reductions over the tokens
        self.relations: dict[int, dict[_axes.Slot, _axes.Axis]] = {}
        # each chunked value's rows per group (`Plan.inner`): chunk j holds its rows r with
        # (r // inner) % k == j, so that every chunk has rows of every shard of a sharded batch
        self.inner: dict[int, int] = {}
        self.no_pull = no_pull
        self.pulled: set[int] = set()
        self._labels: dict[int, bool] = {}

    def add(self, n: int, known: Mapping[_axes.Slot, int], inner: int | None = None) -> None:
        node = self.g.nodes[n]
        if node.opaque:
            raise _axes.NotLocal(f"`{node.name}` (a call amp does not look into) reads the logits")
        if node.name in _vocab.MATMULS:
            raise _axes.NotLocal(f"a second `{node.name}` reads the logits")
        ins = [self.g.aval(a) for a in node.ins]
        live = [j for j, o in enumerate(node.outs) if o >= 0]
        outs = [self.g.avals[node.outs[j]] for j in live]
        to_live = {j: i for i, j in enumerate(live)}
        known = {(("out", to_live[s[1]]) if s[0] == "out" else s): v for s, v in known.items()}
        rel = _axes.relate(node.name, node.params, ins, outs, known)
        rel = {(("out", live[s[1]]) if s[0] == "out" else s): v for s, v in rel.items()}
        inners = self._inners(node, rel, inner)
        self.relations[n] = rel
        self.members.add(n)
        for j, o in enumerate(node.outs):
            v = rel.get(("out", j))
            if o >= 0 and v is not None:
                self.axes[o] = v
                if isinstance(v, int):
                    self.inner[o] = inners[("out", j)]
        for i, a in enumerate(node.ins):
            need = rel.get(("in", i))
            if isinstance(need, int) and isinstance(a, int):
                self.demand(a, need, inners[("in", i)])

    def _inners(self, node: Node, rel: Mapping[_axes.Slot, _axes.Axis], inner: int | None) -> dict[_axes.Slot, int]:
        """Each chunked operand's and result's rows per group: the same for all, but across a
        reshape, where the flat stride `inner * (elements after the axis)` is what stays."""
        known = {("in", i): self.inner[a] for i, a in enumerate(node.ins) if isinstance(a, int) and a in self.inner}
        chunked = [s for s, v in rel.items() if isinstance(v, int)]
        if node.name != "reshape":
            values = {known[s] for s in chunked if s in known} | ({inner} if inner is not None else set())
            if len(values) > 1:
                raise _axes.NotLocal("its operands are chunked in different row groups")
            one = values.pop() if values else 1
            return {s: one for s in chunked}
        src, dst = self.g.shape(node.ins[0]), self.g.avals[node.outs[0]].shape
        a, b = rel.get(("in", 0)), rel.get(("out", 0))
        if not isinstance(a, int) or not isinstance(b, int):
            return {s: (inner or 1) for s in chunked}
        after_src, after_dst = int(np.prod(src[a + 1 :], dtype=np.int64)), int(np.prod(dst[b + 1 :], dtype=np.int64))
        if ("in", 0) in known:
            stride = known[("in", 0)] * after_src
        else:
            stride = (inner or 1) * after_dst
        if stride % after_src or stride % after_dst or src[a] % (stride // after_src) or dst[b] % (stride // after_dst):
            raise _axes.NotLocal("a reshape splits the chunks' row groups")
        return {("in", 0): stride // after_src, ("out", 0): stride // after_dst}

    def demand(self, a: int, axis: int, inner: int) -> None:
        """`a` must be chunked along `axis` in groups of `inner` rows: computed per chunk where
        it is made from labels and constants only and read by the loss only, else sliced."""
        have = self.axes.get(a, self.sliced.get(a))
        if have is not None:
            if have != axis or self.inner.get(a, inner) != inner:
                raise _axes.NotLocal("a value is read chunked along two different axes")
            return
        p = self.g.producer.get(a)
        if p is not None and p not in self.members and p not in self.no_pull and self._broadcast(p, a, axis):
            self.add(p, {("out", j): axis for j, o in enumerate(self.g.nodes[p].outs) if o == a}, inner)
            self.pulled.add(p)
            return
        if p is not None and p not in self.members and p not in self.no_pull and self._pullable(p):
            outs = self.g.nodes[p].outs
            try:
                self.add(p, {("out", j): axis for j, o in enumerate(outs) if o == a}, inner)
            except _axes.NotLocal:
                self.members.discard(p)
                self.no_pull.add(p)
            else:
                self.pulled.add(p)
                return
        self.sliced[a] = axis
        self.inner[a] = inner

    def _broadcast(self, n: int, a: int, axis: int) -> bool:
        """Whether node `n` makes the token axis of `a` from whole operands (a bias broadcast
        to `[tokens, vocab]`, an `iota`): made per chunk at chunk size, never sliced whole."""
        node = self.g.nodes[n]
        if node.opaque or node.name in _vocab.MATMULS or len(node.outs) != 1:
            return False
        try:
            rel = _axes.relate(
                node.name, node.params, [self.g.aval(b) for b in node.ins], [self.g.avals[a]], {("out", 0): axis}
            )
        except _axes.NotLocal:
            return False
        return all(not isinstance(rel.get(("in", i)), int) for i in range(len(node.ins)))

    def _pullable(self, n: int) -> bool:
        node = self.g.nodes[n]
        if node.opaque or node.name in _vocab.MATMULS:
            return False
        return all(self._from_labels(a) for a in node.ins)

    def _from_labels(self, a: Any) -> bool:
        """Whether `a` is computed from integers, booleans and constants only."""
        if isinstance(a, Lit) or self.g.is_const(a) or not _dtypes.is_castable(self.g.aval(a).dtype):
            return True
        if a not in self._labels:
            self._labels[a] = False  # (no cycles in a jaxpr; guards the recursion)
            node = self.g.node_of(a)
            self._labels[a] = node is not None and not node.opaque and all(self._from_labels(b) for b in node.ins)
        return self._labels[a]


def _span(g: Graph, head: int, operand: int, axis: int, what: str) -> tuple[tuple[int, ...], Plan]:
    no_pull: set[int] = set()
    while True:
        b = _attempt(g, head, operand, axis, no_pull)
        leaking = {p for p in b.pulled if any(_read_outside(g, b.members, o) for o in g.nodes[p].outs if o >= 0)}
        if not leaking:
            return _plan(g, b, head, what)
        no_pull |= leaking


def _attempt(g: Graph, head: int, operand: int, axis: int, no_pull: set[int]) -> _Build:
    b = _Build(g, set(no_pull))
    node = g.nodes[head]
    (lc, rc), _ = node.params["dimension_numbers"]
    shape = g.shape(node.ins[operand])
    free = [i for i in range(len(shape)) if i not in (lc if operand == 0 else rc)]
    lfree = len([i for i in range(len(g.shape(node.ins[0]))) if i not in lc])
    position = axis - (0 if operand == 0 else lfree)
    b.members.add(head)
    b.relations[head] = {("in", operand): free[position], ("in", 1 - operand): None, ("out", 0): axis}
    hidden = node.ins[operand]
    if not isinstance(hidden, int):
        raise _axes.NotLocal("the hidden states are a literal")
    b.axes[node.outs[0]] = axis
    b.sliced[hidden] = free[position]  # the hidden states: sliced, never recomputed
    b.inner[node.outs[0]] = b.inner[hidden] = 1
    w = node.ins[1 - operand]
    p = g.producer.get(w) if isinstance(w, int) else None
    if (
        p is not None
        and isinstance(w, int)
        and g.nodes[p].name == "transpose"
        and not g.nodes[p].opaque
        and g.n_readers(w) == 1
    ):
        # `x @ W.T`: the weight enters the loop as stored (the loop's own layout of a
        # transposed copy costs XLA a padded copy of it and of the logits' cotangent per chunk)
        b.members.add(p)
        b.relations[p] = {}
    for n in range(head + 1, len(g.nodes)):
        nd = g.nodes[n]
        ids = [a for a in nd.ins if isinstance(a, int)]
        chunked: dict[int, int] = {}
        for i, a in enumerate(nd.ins):
            v = b.axes.get(a) if isinstance(a, int) else None
            if isinstance(v, int):
                chunked[i] = v
        if any(isinstance(b.axes.get(a), str) or a in b.after for a in ids):
            if chunked:
                raise _axes.NotLocal(f"a reduction over the tokens is read again by `{nd.name}` (it mixes rows)")
            b.after.update(o for o in nd.outs if o >= 0)
            continue
        if chunked and n not in b.members:
            known: dict[_axes.Slot, int] = {
                ("in", i): b.sliced[a] for i, a in enumerate(nd.ins) if isinstance(a, int) and a in b.sliced
            }
            known.update({("in", i): v for i, v in chunked.items()})
            b.add(n, known)
    return b


def _read_outside(g: Graph, members: set[int], o: int) -> bool:
    return o in g.outside or any(r not in members for r in g.readers.get(o, ()))


def _plan(g: Graph, b: _Build, head: int, what: str) -> tuple[tuple[int, ...], Plan]:
    members = set(b.members)
    tops = sorted({g.nodes[n].top for n in members})
    for t in tops:  # a call the span enters is taken whole: its other equations compute whole values
        for n in g.top_nodes[t]:
            if n not in members:
                touched = [*g.nodes[n].ins, *g.nodes[n].outs]
                if any(isinstance(a, int) and (a in b.axes or a in b.sliced) for a in touched):
                    raise _axes.NotLocal("a call mixes the loss with other work")
                members.add(n)
                b.relations[n] = {}
    order = sorted(members)
    made = {o for n in order for o in g.nodes[n].outs if o >= 0}
    inputs: list[int] = []
    consts: dict[int, Any] = {}
    for n in order:
        for a in g.nodes[n].ins:
            if isinstance(a, int) and a not in made and a not in inputs and a not in consts:
                if a in g.var_of_id:
                    inputs.append(a)
                else:
                    consts[a] = g.value(a)
    tainted = set(made)  # what depends on the span: no input of it may
    for n in range(min(order), len(g.nodes)):
        if n not in members and any(isinstance(a, int) and a in tainted for a in g.nodes[n].ins):
            tainted.update(o for o in g.nodes[n].outs if o >= 0)
    if any(a in tainted for a in inputs):
        raise _axes.NotLocal("a reduction over the tokens is read again by the loss (it mixes rows)")
    outputs = [o for o in made if _read_outside(g, members, o)]
    outputs.sort()
    head_node = g.nodes[head]
    big = int(np.prod(g.shape(head_node.ins[0 if head_node.ins[0] in b.sliced else 1]), dtype=np.int64))
    for o in outputs:
        ax = b.axes.get(o)
        if o not in g.var_of_id:
            raise _axes.NotLocal("a call returns a value of the loss with other work")
        if ax is None:
            raise _axes.NotLocal("a value computed beside the loss is read after it")
        if isinstance(ax, int) and int(np.prod(g.shape(o), dtype=np.int64)) > big:
            raise _axes.NotLocal("the logits (or a value as large) are read after the loss")
    if not any(isinstance(b.axes.get(o), str) for o in outputs) and not outputs:
        raise _axes.NotLocal("nothing of the loss is read")
    dt = np.dtype(np.float32).itemsize
    logits_bytes = int(np.prod(g.shape(head_node.outs[0]), dtype=np.int64)) * dt
    nodes = tuple(g.nodes[n] for n in order)
    axes = {**b.sliced, **b.axes}
    sizes = tuple(sorted({g.shape(i)[v] // b.inner[i] for i, v in axes.items() if isinstance(v, int)}))
    inner = {i: b.inner[i] for i in (*inputs, *outputs) if isinstance(axes.get(i), int)}
    relations = tuple(b.relations[n] for n in order)
    whole = head_node.ins[1] if head_node.ins[0] in b.sliced else head_node.ins[0]
    weight = inputs.index(whole) if whole in inputs else None
    in_vars = tuple(g.var_of_id[i] for i in inputs)
    out_vars = tuple(g.var_of_id[o] for o in outputs)
    plan = Plan(
        what,
        nodes,
        axes,
        tuple(inputs),
        tuple(outputs),
        consts,
        sizes,
        logits_bytes,
        relations,
        in_vars,
        out_vars,
        weight,
        inner,
        order.index(head),
        _pad.find(nodes, order.index(head), axes, inputs, g.shape),
    )
    return tuple(tops), plan
