"""`RuleContext`: what a rule's `bind` may use of the transformation it runs in.

The interpreter's own `Context` (`autocast._interpreter`) is private and mutable: caches,
planner switches, the observer. A rule gets this small, frozen view of it instead, made for
the one equation it binds (`Context.for_rule`): what the built-in rules, the float8 rule
and the fused attention's rule read, and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np


@dataclasses.dataclass(frozen=True)
class RuleContext:
    """What `autocast.Rule.bind` may use of the transformation it runs in (read-only).

    amp makes one for each equation a rule binds itself (a rule that does not override
    `bind` costs nothing).

    Attributes:
        compute_dtype: The compute dtype given to `autocast.amp` (`float16`, `bfloat16` or
            `float32`).
        scopes: The named scopes around the equation, outermost first (`amp_stop` among
            them inside `autocast.amp_stop`).
        remat: Whether float32 work may be recomputed in the backward pass here: amp's
            `remat_float32` (`True`, also for `"matmuls"`, or `"auto"`: where its cost
            model says it pays), or
            `False` where amp finds no float32 islands (`remat_float32=False`, a float32
            compute dtype, inside a custom JVP rule).
        recomputed: Whether the equation is inside a checkpoint that recomputes it in the
            backward pass anyway (a recomputed float32 island, a user checkpoint that saves
            nothing): a checkpoint of the rule's own would recompute it twice.
        checkpoint_saved: Inside an autocast checkpoint (a recomputed island), the jaxpr
            variables it saves rather than recomputes (matmul results); None elsewhere. An
            operand `eqn.invars[i]` not in it is recomputed in the backward pass, so a rule
            need not keep a copy of it.
        observer: Where amp's own rules tell `autocast.explain` what they decided
            (`rewrite(name, what, how)`, `float8(eqn, why, requantize)`); every method is a
            no-op outside `explain`. A user rule may ignore it.

    Example:
        ```python
        class Logged(autocast.Rule):
            role = "compute"
            casts_only = True
            seen = []

            def cast(self, compute_dtype, original_dtypes, invars, params, free):
                return autocast.use_compute_precision.cast(compute_dtype, original_dtypes, invars, params, free)

            def bind(self, ctx, eqn, arrived, cast, params, free):
                type(self).seen.append((ctx.compute_dtype, ctx.scopes))
                return None  # bound as usual


        policy = autocast.extend_policy({jax.lax.dot_general_p: Logged()})
        autocast.amp(loss_fn, compute_dtype=jnp.bfloat16, amp_policy=policy)(params, batch)
        assert Logged.seen and all(dtype == jnp.bfloat16 for dtype, _ in Logged.seen)
        ```
    """

    compute_dtype: np.dtype
    scopes: tuple[str, ...]
    remat: bool | Literal["auto"]
    recomputed: bool
    checkpoint_saved: frozenset[Any] | None
    observer: Any
    _evaluate: Callable[..., list[Any]] = dataclasses.field(repr=False, compare=False)

    def eval_closed(
        self,
        closed: Any,
        args: Sequence[Any],
        free: Sequence[bool] | None = None,
        *,
        scopes: tuple[str, ...] | None = None,
        rewrites: bool = True,
        observed: bool = True,
        recomputed: bool = False,
    ) -> list[Any]:
        """Evaluate a closed jaxpr's equations as amp would, in the trace that is running:
        how a rule that holds equations binds them (the fused attention's span, as written).

        Args:
            closed: A closed jaxpr.
            args: The values of its inputs, as they arrive (some in half precision).
            free: Per input, whether it is a free value (a function input, a constant or
                only moved from them; see `autocast.Rule.cast`); None: none is.
            scopes: The named scopes around its equations (None: the equation's `scopes`).
            rewrites: Whether whole-program rewrites (the fused attention) apply to its
                equations; False: as written (the equations a rewrite replaced).
            observed: Whether `autocast.explain` records its equations; False for a trace
                that is not part of the program (the shapes of the outputs).
            recomputed: Whether the rule evaluates them inside a checkpoint of its own that
                recomputes them in the backward pass (the loss head's chunks): amp then adds
                no recomputed float32 island of its own there, and stores matmul results
                in the compute dtype (as inside a user checkpoint).

        Returns:
            Its outputs.

        Example:
            ```python
            class TanhAsRatio(autocast.Rule):  # tanh bound as sinh / cosh, each by its own rule
                def cast(self, compute_dtype, original_dtypes, invars, params, free):
                    return list(invars), params

                def bind(self, ctx, eqn, arrived, cast, params, free):
                    closed = jax.make_jaxpr(lambda v: jnp.sinh(v) / jnp.cosh(v))(*arrived)
                    return ctx.eval_closed(closed, arrived, free)


            policy = autocast.extend_policy({jax.lax.tanh_p: TanhAsRatio()})
            out = autocast.amp(lambda v: jnp.tanh(v), amp_policy=policy)(x)
            assert jnp.allclose(out, jnp.tanh(x), atol=1e-3)
            ```
        """
        free = [False] * len(args) if free is None else list(free)
        scopes = self.scopes if scopes is None else scopes
        return self._evaluate(closed, args, free, scopes, rewrites, observed, recomputed or self.recomputed)
