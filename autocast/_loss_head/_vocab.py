"""The primitive names the loss-head finder reads, by family: the one place they are spelt
(tests/test_loss_head_find.py checks each is a primitive of the installed JAX, or a name
an older or newer JAX uses)."""

from __future__ import annotations

from .. import _walk

ELEMENTWISE = frozenset(
    {
        "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh",
        "cbrt", "ceil", "clamp", "conj", "convert_element_type", "copy", "cos", "cosh",
        "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt",
        "imag", "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max",
        "min", "mul", "ne", "neg", "nextafter", "not", "or", "pow", "real", "reduce_precision", "rem",
        "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub",
        "tan", "tanh", "xor",
    }
)  # fmt: skip
"""Primitives that act on each element alone (operands of one shape, or scalars)."""

MATMULS = frozenset(_walk.MATMULS)
"""The products: the head is one; a second one reading the logits is not row-local here."""

HEAD = "dot_general"
"""The primitive of the head's projection."""

REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
"""The reductions over the tokens a chunked loss ends in (summed or maximised across chunks)."""
