"""The `autocast.Rule` protocol (issue 49): a subclass that defines neither `cast` nor
`__call__` is refused when the class is defined (it used to recurse until Python's limit
when amp first cast with it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autocast


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
