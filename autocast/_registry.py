"""The table of higher-order rules: how the interpreter treats primitives that hold jaxprs.

Like JAX's own rule tables (`ad.primitive_jvps`, `batching.primitive_batchers`), this
module only holds the tables; `autocast._higher_order`, `autocast._custom_derivatives` and
`autocast._hijax` fill them at import with `register_higher_order(prim)(handler)` lines,
and the planner (`autocast._plan`) reads them. So
the interpreter, the planner and the handlers do not import each other in a circle.

A *handler* evaluates one equation:

```
handler(ctx, eqn, invals, in_free, scopes, out_float32) -> (outs, out_free)
```

`invals` are the operands as they arrive (some in half precision), `in_free` their
free flags, `out_float32[i]` says that every consumer of output `i` reads it in float32.

A *pull rule* tells the planner which operands the equation's bodies consume only in
float32 (and can be handed a float32 value without storing more for the backward pass):

```
pulls(ctx, eqn, scopes, out_float32) -> list[bool | str]   # one flag per operand
```

The planner treats passing a value into such an operand as a float32 consumer, and the
interpreter casts that value once, outside, so every float32 consumer reads the same
float32 value; except for the flag `_plan.SELECTED` (the bodies read the operand in
float32 only through slices or gathers that convert it themselves): a float32 consumer
for the planner, handed over as it arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _compat

Handler = Callable[..., tuple[list, list]]
PullRule = Callable[..., list]

HIGHER_ORDER_RULES: dict[Any, Handler] = {}
"""Primitive -> handler."""

PULL_RULES: dict[Any, PullRule] = {}
"""Primitive -> pull rule (primitives without one pull nothing across their boundary)."""

NARROW_BODIES: dict[Any, str | Callable[[Any], Any]] = {}
"""Primitive -> the parameter holding a body whose invars are the operands, one to one,
and whose handler lets half-precision operands in (the planner looks through it to see
whether an operand reaches only half-precision consumers: `relu`'s `custom_jvp`); or a
function of the equation returning that body or None (`call_hi_primitive`: it depends on
the construct the equation holds). See `narrow_body`."""

FLOAT32_CALLS: dict[Any, Callable[..., bool]] = {}
"""Primitive -> `test(ctx, eqn, scopes, out_float32)`: whether the equation computes in
float32 as a whole (a custom JVP whose rule does, softplus's). The planner makes such an
equation part of a float32 island, recomputed in the backward pass like any other."""

_fallback: list[Handler] = []


def register_higher_order(
    prim: Any,
    *,
    pulls: PullRule | None = None,
    body: str | Callable[[Any], Any] | None = None,
    float32_call: Callable[..., bool] | None = None,
) -> Callable[[Handler], Handler]:
    """A decorator registering its `handler` for `prim`.

    Args:
        prim: The primitive; None (this JAX has no such primitive) makes it a no-op.
        pulls: The primitive's pull rule (see the module docstring), if it has one.
        body: See `NARROW_BODIES`.
        float32_call: See `FLOAT32_CALLS`.

    Returns:
        A decorator that registers `handler` and returns it unchanged.
    """

    def register(handler: Handler) -> Handler:
        if prim is not None:
            HIGHER_ORDER_RULES[prim] = handler
            if pulls is not None:
                PULL_RULES[prim] = pulls
            if body is not None:
                NARROW_BODIES[prim] = body
            if float32_call is not None:
                FLOAT32_CALLS[prim] = float32_call
        return handler

    return register


def register_fallback(handler: Handler) -> Handler:
    """The handler for primitives with jaxpr parameters that have no handler of their own."""
    _fallback[:] = [handler]
    return handler


def jaxpr_params(params: dict[str, Any]) -> list[str]:
    """The names of the parameters that hold a jaxpr (or a tuple of jaxprs)."""
    keys = []
    for key, val in params.items():
        if _compat.is_jaxpr_like(val) or (type(val) is tuple and val and all(_compat.is_jaxpr_like(v) for v in val)):
            keys.append(key)
    return keys


def narrow_body(eqn: Any) -> Any | None:
    """The body `NARROW_BODIES` names for `eqn`, or None."""
    body = NARROW_BODIES.get(eqn.primitive)
    if body is None:
        return None
    return eqn.params[body] if isinstance(body, str) else body(eqn)


def computes_in_float32(ctx: Any, eqn: Any, scopes: tuple, out_float32: Any) -> bool:
    """See `FLOAT32_CALLS` (False for a primitive without such a test)."""
    test = FLOAT32_CALLS.get(eqn.primitive)
    return test is not None and bool(test(ctx, eqn, scopes, out_float32))


def handler_for(eqn: Any) -> Handler | None:
    """The handler for a higher-order equation, or None for a first-order one."""
    handler = HIGHER_ORDER_RULES.get(eqn.primitive)
    if handler is not None:
        return handler
    if _fallback and jaxpr_params(eqn.params):
        return _fallback[0]
    return None
