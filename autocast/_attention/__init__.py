"""Fused attention: find attention in a jaxpr and build the equivalent
``jax.nn.dot_product_attention`` call (issue 41).

Design note (placeholder, rewritten below once the API settles).
"""

from ._call import call, cudnn_error, cudnn_plan, pad_sequences, platform_dependent
from ._find import find
from ._match import LeftAlone, Mask, MaskKind, Match, Operand

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
    "platform_dependent",
]
