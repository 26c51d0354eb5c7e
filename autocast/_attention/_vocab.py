"""The primitive names the attention recogniser reads, by family: the one place they are
spelt (tests/test_attention_vocab.py checks that each is a primitive of the installed JAX,
on both JAX ends CI runs).

A *layout equation* moves or relabels axes without changing a value (`LAYOUT`); whether a
particular one only inserts or removes size-1 axes, or merges and splits axes the rewrite can
follow, is decided where it is read (`autocast._attention._layout`). A *pass-through* leaves
every value as it is for the recogniser's purpose (`PASS_THROUGH`: a copy, a float
conversion, a gradient stop). The random primitives (`RANDOM`) are never constants and mark
dropout. The scores chain's own rule table (`autocast._attention._scores`) names what may
sit between the `q . k` product and the softmax.
"""

from __future__ import annotations

from .. import _walk

LAYOUT = frozenset({"broadcast_in_dim", "reshape", "squeeze", "transpose"})
"""Primitives that move or relabel axes and change no value."""

PASS_THROUGH = frozenset({"convert_element_type", "copy", "stop_gradient"})
"""Primitives the recogniser sees through on an operand (a float `convert_element_type`
only: where it reads one, it checks the dtype)."""

RESTORE = LAYOUT | PASS_THROUGH
"""What may sit between a softmax's row reduction and the value it is subtracted from or
divides: they restore the reduced axis and change nothing."""

FORWARD = LAYOUT | frozenset({"convert_element_type", "copy"})
"""What may sit between the probabilities and the value product (a `broadcast_in_dim`
only where it inserts size-1 axes: checked where read)."""

RANDOM = frozenset(
    {
        "iota_2x32_shape",
        "random_bits",
        "random_fold_in",
        "random_seed",
        "random_split",
        "random_unwrap",
        "random_wrap",
        "rng_bit_generator",
        "rng_uniform",
        "threefry2x32",
    }
)
"""Primitives whose result is not a function of their operands' values: never constant
(`_graph`), and what dropout's keep mask is drawn from (`_roles.dropout_or`)."""

SUMS = frozenset({"add", "add_any", "sub"})
"""The sums a bias is split into its terms through."""

COMPARISONS = frozenset({"eq", "ge", "gt", "le", "lt", "ne"})
"""The comparisons (a mask's leaves: lengths `iota < n`, a converted boolean tested against 0)."""

MATMULS = frozenset(_walk.MATMULS)
"""The products (a `jit` body with one is not inlined: amp evaluates it as its own jaxpr)."""

SOFTMAX_JVP_NAME = "_softmax"
"""The name of `jax.nn.softmax`'s `custom_jvp` function (`jax_softmax_custom_jvp`)."""

ALL = (
    LAYOUT
    | PASS_THROUGH
    | RANDOM
    | SUMS
    | COMPARISONS
    | MATMULS
    | frozenset({"exp", "sub", "div", "max", "reduce_max", "reduce_sum"})
)
"""Every primitive name this module spells (the scores chain's table adds its own)."""
