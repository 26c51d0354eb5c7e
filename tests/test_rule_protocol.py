"""The `autocast.Rule` protocol (issue 49): a subclass that defines neither `cast` nor
`__call__` is refused when the class is defined (it used to recurse until Python's limit
when amp first cast with it); `Rule.bind` receives a public, frozen `autocast.RuleContext`
(it used to get the interpreter's private, mutable `Context`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autocast
from tests.helpers import dots_in, walk


def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ w))


W = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4)), jnp.float32)
X = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8)), jnp.float32)


def test_a_rule_without_cast_or_call_is_refused_at_definition():
    with pytest.raises(TypeError, match=r"Forgot subclasses autocast.Rule but defines neither `cast` nor `__call__`"):

        class Forgot(autocast.Rule):
            role = "compute"
            name = "forgot"

            def bind(self, ctx, eqn, arrived, cast, params, free):
                return None


def test_a_rule_that_defines_either_is_accepted_and_runs():
    class ByCast(autocast.Rule):
        role = "compute"
        casts_only = True

        def cast(self, compute_dtype, original_dtypes, invars, params, free):
            return autocast.use_compute_precision.cast(compute_dtype, original_dtypes, invars, params, free)

    class ByCall(autocast.Rule):
        def __call__(self, compute_dtype, original_dtypes, *invars, **params):
            return autocast.use_compute_precision(compute_dtype, original_dtypes, *invars, **params)

    reference = autocast.amp(_loss, compute_dtype=jnp.bfloat16)(W, X)
    for rule in (ByCast(), ByCall()):
        policy = autocast.extend_policy({jax.lax.dot_general_p: rule})
        out = autocast.amp(_loss, compute_dtype=jnp.bfloat16, amp_policy=policy)(W, X)
        assert out == reference, rule
        # the cast operands: the matmul ran in bfloat16
        report = autocast.explain(_loss, compute_dtype=jnp.bfloat16, amp_policy=policy)(W, X)
        (matmul,) = [row for row in report.rows if row["primitive"] == "dot_general"]
        assert matmul["operands"].endswith("→ bf16×2"), matmul


def test_an_abstract_base_may_leave_both_out_and_is_not_instantiated():
    class Base(autocast.Rule, abstract=True):
        role = "compute"

    class Concrete(Base):
        def cast(self, compute_dtype, original_dtypes, invars, params, free):
            return list(invars), params

    assert Concrete().role == "compute"
    with pytest.raises(TypeError, match="Base is abstract"):
        Base()
    with pytest.raises(TypeError, match="Rule is abstract"):
        autocast.Rule()


class _Seen(autocast.Rule):
    """Matmuls in the compute dtype; keeps the context each `bind` got."""

    role = "compute"
    casts_only = True

    def __init__(self):
        self.contexts = []

    def cast(self, compute_dtype, original_dtypes, invars, params, free):
        return autocast.use_compute_precision.cast(compute_dtype, original_dtypes, invars, params, free)

    def bind(self, ctx, eqn, arrived, cast, params, free):
        self.contexts.append(ctx)
        return None


def _scoped(w, x):
    with jax.named_scope("block"):
        h = jnp.tanh(x @ w)
    return jnp.sum(h @ w.T)


@pytest.mark.parametrize(
    ("dtype", "remat", "seen"),
    [
        (jnp.bfloat16, "auto", "auto"),
        (jnp.float16, True, True),
        (jnp.bfloat16, False, False),
        (jnp.float32, True, False),
    ],
)
def test_bind_gets_a_public_frozen_context(dtype, remat, seen):
    rule = _Seen()
    policy = autocast.extend_policy({jax.lax.dot_general_p: rule})
    out = autocast.amp(_scoped, compute_dtype=dtype, amp_policy=policy, remat_float32=remat)(W, X)
    assert out == autocast.amp(_scoped, compute_dtype=dtype, remat_float32=remat)(W, X)
    assert len(rule.contexts) == 2
    for ctx in rule.contexts:
        assert type(ctx) is autocast.RuleContext
        assert ctx.compute_dtype == np.dtype(dtype) and ctx.remat == seen
        assert ctx.recomputed is False and ctx.checkpoint_saved is None
        with pytest.raises(dataclasses.FrozenInstanceError):
            ctx.compute_dtype = np.dtype(np.float32)
    assert [c.scopes for c in rule.contexts] == [("block",), ()]
    # what a rule may read, and nothing of the interpreter's own state
    fields = {f.name for f in dataclasses.fields(autocast.RuleContext) if not f.name.startswith("_")}
    assert fields == {"compute_dtype", "scopes", "remat", "recomputed", "checkpoint_saved", "observer"}
    assert not hasattr(rule.contexts[0], "lookup") and not hasattr(rule.contexts[0], "_jaxpr_cache")


class _AsSinhOverCosh(autocast.Rule):
    """tanh bound as sinh / cosh, evaluated by amp (each equation by its own rule)."""

    def cast(self, compute_dtype, original_dtypes, invars, params, free):
        return list(invars), params

    def bind(self, ctx, eqn, arrived, cast, params, free):
        closed = jax.make_jaxpr(lambda v: jnp.sinh(v @ jnp.eye(v.shape[-1], dtype=v.dtype)) / jnp.cosh(v))(*arrived)
        return ctx.eval_closed(closed, arrived, free)


def test_eval_closed_runs_a_closed_jaxpr_under_the_policy():
    policy = autocast.extend_policy({jax.lax.tanh_p: _AsSinhOverCosh()})
    out = autocast.amp(_loss, compute_dtype=jnp.bfloat16, amp_policy=policy)(W, X)
    assert jnp.allclose(out, _loss(W, X), rtol=3e-2), (out, _loss(W, X))
    jaxpr = jax.make_jaxpr(autocast.amp(_loss, compute_dtype=jnp.bfloat16, amp_policy=policy))(W, X)
    # the jaxpr's own matmul and the one the rule's equations hold, both by the policy: bfloat16
    assert dots_in(jaxpr) == [("bfloat16", "bfloat16")] * 2, dots_in(jaxpr)
    assert not [e for e, _ in walk(jaxpr) if e.primitive.name == "tanh"]
    report = autocast.explain(_loss, compute_dtype=jnp.bfloat16, amp_policy=policy)(W, X)
    assert {"sinh", "cosh"} <= {row["primitive"] for row in report.rows}  # explain saw them
