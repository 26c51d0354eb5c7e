"""Fused attention (issue 41): find attention in a jaxpr and build the equivalent
`jax.nn.dot_product_attention` call.

**What is matched.** The anchor is a softmax over one axis, in either of JAX's forms:
the inline `reduce_max -> max(-inf) -> sub -> exp -> reduce_sum -> div` chain or the
`custom_jvp_call[_softmax]` / `CustomJVPTraced` of `jax_softmax_custom_jvp`, also
inside a `jit`. The recogniser reads one jaxpr's top-level equations (amp calls it once
per jaxpr it evaluates: top level, `jit`/`checkpoint`/`scan`/custom-derivative
bodies), seeing through the small calls a span crosses: every `jit` whose body has no
matmul (`jit[_where]`, `jit[tril]`, `jit[softmax]`, `jit[_bernoulli]`) and the softmax
`custom_jvp` are inlined (`_graph`). From the softmax's input it walks back to a
`dot_general` through layout equations, float converts, multiplications and divisions by
a constant scalar (the scale), additive biases (either operand order) and `select_n`
against a constant fill (`jnp.where`, masks); from its output, through layout
equations and factors that do not vary along the keys (a head mask: the call multiplies its
output by them), to the `dot_general` with the values; after that, through transposes, and a
`mul` zeroing the rows past the query lengths where the original has one (`jax.nn`'s
XLA path). q, k and v are traced back through single-reader transposes, converts,
constant scalar factors (folded into the scale: Flax linen and Equinox scale the query)
and a `jnp.repeat` of the kv heads.

**How roles are proved** (`_roles`). The scores' axes are the `q . k` product's
output axes: its batch axes (shared by q and k), q's free axes, k's free axis. k's one free
axis must be the softmax axis (the keys `S`); the contracted axis is the head dimension
`H`; q's largest free axis is the queries `T`, its other free axes are grouped-query heads
`G` (`jax.nn`'s own `[B, T, K, G, H]` form). The `p . v` product must contract exactly
the keys, pair exactly the scores' batch axes with v's, keep q's free axes and leave one
axis of v (`Hv`). Every value on the way carries an *axis map* to the scores' axes
(`_layout`), so masks, biases, lengths and the output are moved by the transposes
actually present. A reshape may merge axes of the scores (Gemma's and Flax NNX's grouped
query heads, `[B, T, K, G, S] -> [B, T, K * G, S]`) if the probabilities are split back
the same way before the value product: a relabelling; constant side values on the merged
scores are split into the merged axes, traced ones must not vary along them. Which
batch axis is the kernel's heads axis is a layout choice (q's last batch axis, or the
repeated one); nothing is identified by position or size, so a key
transposed "wrongly" (pytorch#195320) is rewritten as what it computes.

**Mask classes** (`_mask`, `MaskKind`). The masks (each `select_n`, each constant
additive bias of zeros and numbers <= -1e4 or -inf, and each traced bias that provably
takes the two values 0 and one number that absorbs the scores, `_scores.ABSORBED`: Flax's
and Hugging Face's `select(m > 0, 0, finfo.min)`, also as a term of a sum) are split into
conjuncts through `and`/`not`/`or`, layout equations and boolean converts (`ne(convert(b),
0)`: Flax's `combine_masks`). A constant conjunct (it depends on no
input: `iota`, comparisons, `jnp.tril`, captured arrays) is evaluated at trace time
and becomes `is_causal` (exactly `tril` with T == S; cuDNN and XLA agree on it only
there), `is_causal` + `local_window_size=(w, 0)` (a causal band), nothing (all true), or
a constant `mask=`. `iota_S < n` with `n` traced and integer is
`key_value_seq_lengths`; `iota_T < n` is `query_seq_lengths` only where the original
also zeroes those output rows, else a mask. Any other boolean goes to `mask=`; traced
additive biases (and constant ones that are not masks) to `bias=`, summed and scaled in the
chain's order; both broadcast to the full `T x S` (cuDNN rejects a broadcast T or S). A
learned bias beside masks may mask a row on its own: the masks are then folded into it
(their one absorbing fill), and every bias term stays a bias.

**What is left alone, and why** (`LeftAlone` with the reason): dropout on the
probabilities (the kernel cannot reproduce its random mask); softcapping (`tanh`); a
traced scale; a second reader of the scores or the probabilities (a returned or sown
attention map); a bias added after a mask; a fill that is not a large negative number;
where a query row may be fully masked: masked values that differ (the original averages
the keys of the largest) or depend on the scores (an additive `-1e9`); masks that depend on the scores; a softmax over a query or batch
axis, or over merged axes; a value product that does not contract the softmax axis; a
factor on the probabilities that varies along the keys; merged scores the probabilities
do not split back the same way, or a traced side value varying along merged axes; head
dimensions cuDNN rejects (not a multiple of 8, above `max_head_dim`, q/k and v different). A fully masked
row of one masked value averages the values uniformly in the original (NaN for `-inf`); the
call sets that explicitly. Odd sequence lengths are padded by `pad_sequences` /
`cudnn_plan` (padded keys masked, padded queries sliced off).

**Use.** amp's rewrite is `_fuse.REWRITE`, registered at this package's import through
`autocast._rewrites` (the door of whole-program rewrites; the interpreter and the policy
import nothing of this package), which applies it to each jaxpr amp evaluates before it is
planned: for each `Match` that `find` returns and the policy lets fuse, `cudnn_plan`
(cuDNN, on CUDA) and `tpu_plan` (Pallas's splash attention, on TPU: `_splash`) give the match
to emit (its sequences maybe padded) or why there is none, and the span's equations become
one `fused_attention` equation whose rule binds `call` with each platform's kernel and the
span's own equations elsewhere (`lax.platform_dependent`). The kernel in `call` is
differentiable in every mode (`_derivatives`: its own backward pass for a first-order
gradient, XLA's attention in float32 for forward mode and higher orders). `explain` lists
each attention and what became of it: fused (on which platform, by which kernel), or kept
as written and why (a `LeftAlone`'s reason, the policy, or no cuDNN or TPU kernel).

The extracted call itself is `call` (`implementation="xla"` runs anywhere: the
tests compare it with the replaced equations, values and gradients). Tests emit the
fused branch on CPU with `_fuse.emitting("cpu", "xla")` (or a stand-in kernel), and the
TPU branch with `_fuse.emitting("cpu", "splash")` (Pallas's interpret mode).
"""

from . import _fuse  # noqa: F401  (registers the rewrite and its policy categories)
from ._call import call, cudnn_error, cudnn_plan, pad_sequences
from ._find import find
from ._match import LeftAlone, Mask, MaskKind, Match, Operand
from ._splash import tpu_plan

__all__ = [
    "LeftAlone",
    "Mask",
    "MaskKind",
    "Match",
    "Operand",
    "call",
    "cudnn_error",
    "cudnn_plan",
    "find",
    "pad_sequences",
    "tpu_plan",
]
