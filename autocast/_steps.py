"""The vocabulary of plans: a `Plan` of a jaxpr, each equation's `Step`, and the families of
primitives the planner, the binding and the islands reason about (data movement, linear
operations, operations that commute with rounding)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

from . import _compat

LAYOUT = frozenset(
    {
        "broadcast_in_dim",
        "concatenate",
        "copy",
        "dynamic_slice",
        "pad",
        "reshape",
        "rev",
        "slice",
        "split",
        "squeeze",
        "transpose",
    }
)
"""Data movement: primitives that only move or reshape their operands' values."""

# Primitives whose JVP needs none of their operands (linear in every float operand):
# an island made only of these (and of products with literals) would save nothing, so it
# is evaluated without a checkpoint.
LINEAR = LAYOUT | {
    "add",
    "add_any",
    "conj",
    "convert_element_type",
    "cumsum",
    "imag",
    "neg",
    "psum",
    "real",
    "reduce_sum",
    "reduce_window_sum",
    "select_n",
    "stop_gradient",
    "sub",
}
STOP, HIGHER, RULE = "stop", "higher", "rule"

SELECTED = "selected"
"""A pull flag (see `input_pulls`): the operand is consumed only in float32, but
only through slices or gathers that convert it themselves (`_rules.select_in_float32`):
it is handed over in the dtype it arrives in, not cast outside."""

# Operations that commute with rounding to a narrower float dtype: `op(round(x)) ==
# round(op(x))` for any operand values (rounding is monotone and symmetric; these only
# move, select or compare values). A float32 value that reaches a half-precision consumer
# only through them can be rounded first: they then run in half precision, same values.
COMMUTES_WITH_ROUNDING = LAYOUT | {
    "abs",
    "gather",
    "max",
    "min",
    "neg",
    "reduce_max",
    "reduce_min",
    "select_n",
    "sharding_constraint",
    "stop_gradient",
}


class Step(NamedTuple):
    """How the interpreter evaluates one equation.

    Attributes:
        kind: `STOP` (inside `amp_stop`: bound exactly as traced), `RULE` (`rule` casts
            its operands) or `HIGHER` (a primitive that holds jaxprs, has a handler in
            `autocast._registry` and is not named by the policy: `handler` transforms its
            bodies).
        rule: `RULE`: the `autocast.Rule`.
        handler: `HIGHER`: the handler (`autocast._registry`).
        out_float32: `HIGHER`: per output, whether every consumer reads it in float32
            (its bodies compute it so; a dropped output counts as read so).
        pulls: `HIGHER`: per operand, whether its bodies consume it only in float32: True
            (cast it once, outside), False, or `SELECTED` (see `input_pulls`).
        out_narrow: `HIGHER`: per output, whether every consumer reads it in the compute
            dtype (its body narrows it).
    """

    kind: str
    rule: Any = None
    handler: Any = None
    out_float32: Sequence[bool] = ()
    pulls: Sequence[bool | str] = ()
    out_narrow: Sequence[bool] = ()

    @property
    def computes(self) -> bool:
        """A rule of role `"compute"` (a matmul in the compute dtype)."""
        return self.kind == RULE and self.rule.role == "compute"

    def role(self) -> str | None:
        return self.rule.role if self.kind == RULE else None


@dataclasses.dataclass(frozen=True)
class Plan:
    """The plan of one jaxpr's evaluation (`plan`).

    Attributes:
        steps: How each equation is evaluated, one `Step` per equation.
        island: Per equation, whether it belongs to a float32 island (evaluated inside a
            `jax.checkpoint` and recomputed in the backward pass); all False without
            `ctx.remat`.
        narrow: The float vars that every consumer reads in the compute dtype: a float32
            value such a var holds (a norm's result) is rounded where it is made.
        wide: The index of each matmul whose float results only rule equations of this
            jaxpr read, all in float32 (not an output of the jaxpr) -> the indices of
            those readers: it may store a float32 result (`autocast._wide`).
        bias_sums: The `add` outputs summing a matmul result and a bias before an
            expensive function (`_bias_sums`).
        statistics: The `reduce_sum` outputs a recomputed island's checkpoint saves
            (`_statistics`).
    """

    steps: list[Step]
    island: list[bool]
    narrow: set
    wide: dict[int, set[int]]
    bias_sums: frozenset
    statistics: frozenset


def is_linear(eqn: Any) -> bool:
    name = eqn.primitive.name
    if name in LINEAR:
        return True
    if name in ("mul", "div"):  # by a literal constant
        return any(isinstance(v, _compat.Literal) for v in eqn.invars[1 if name == "div" else 0 :])
    return False
