"""The loss head (issue 49): the projection to the vocabulary and the loss that reads it,
computed on token chunks so that the `[tokens, vocabulary]` logits are never held whole.

`_find` proves the head (a matmul whose result is much larger than its token operand) and
the row-local equations that read it down to reductions over the tokens (`_axes`: per
primitive, which axis is the token axis and the parameters at chunk size); `_chunk` registers
the rewrite through `autocast._rewrites` and its rule replays the user's own equations on
chunks under `lax.scan` + `jax.checkpoint`, accumulating in float32. The interpreter and the
policy import nothing of this package. docs/loss_head.md has what is rewritten, when, how
to turn it off and the numerics.
"""

from . import _chunk  # noqa: F401  (registers the rewrite and its policy categories)
from ._chunk import BUDGET, chunk_count
from ._find import AMPLIFY, Plan, Refused, find

__all__ = ["AMPLIFY", "BUDGET", "Plan", "Refused", "chunk_count", "find"]
