"""The door of whole-program rewrites (`autocast/_rewrites.py`, issue 49): a rewrite declared
with `register_rewrite` (a finder, the rule that binds what it found, its explain entries) is
applied by amp to every jaxpr it evaluates, gated by the policy, `amp_stop` and the context's
switch, with no code of the interpreter's naming it. A toy rewrite, `log(exp(x)) -> x`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autocast
from autocast import _amp, _compat, _explain_record, _options, _rewrites
from tests.helpers import walk

log_exp_p = _compat.Primitive("log_exp_for_test")
log_exp_p.def_abstract_eval(lambda x, **params: x)


def _find(jaxpr, consts, compute_dtype):
    """Each `log` of an `exp` that nothing else reads: a span; one that something else reads:
    left alone."""
    readers: dict = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if not isinstance(v, _compat.Literal):
                readers[v] = readers.get(v, 0) + 1
    made = {e.outvars[0]: i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "exp"}
    out = []
    for i, e in enumerate(jaxpr.eqns):
        if e.primitive.name == "log" and e.invars[0] in made:
            j = made[e.invars[0]]
            if readers[e.invars[0]] > 1 or e.invars[0] in jaxpr.outvars:
                out.append(_rewrites.Kept("log(exp(x))", "exp(x) read elsewhere"))
            else:
                out.append(_rewrites.Span((j, i), tuple(jaxpr.eqns[j].invars), tuple(e.outvars), "log(exp(x))"))
    return out


class _Identity(autocast.Rule):
    name = "log_exp_identity"
    primitives = frozenset({log_exp_p.name})

    def cast(self, compute_dtype, original_dtypes, invars, params, free):
        return list(invars), params

    def bind(self, ctx, eqn, arrived, cast, params, free):
        ctx.observer.rewrite("log_exp", "log(exp(x))", "x")
        return [arrived[0]]


class _AsWritten(autocast.Rule):
    name = "log_exp_as_written"
    primitives = frozenset({log_exp_p.name})

    def cast(self, compute_dtype, original_dtypes, invars, params, free):
        return list(invars), params


IDENTITY = _Identity()


@pytest.fixture
def registered():
    _rewrites.register_rewrite("log_exp", log_exp_p, _find, IDENTITY)
    try:
        yield autocast.extend_policy({log_exp_p: IDENTITY, "kept": _AsWritten()})
    finally:
        _rewrites.REWRITES.pop("log_exp")


def _fn(x):
    with jax.named_scope("kept"):
        a = jnp.log(jnp.exp(x * 2))
    b = jnp.log(jnp.exp(x))  # rewritten
    e = jnp.exp(x)
    return a + b + jnp.log(e) + e  # the last exp is read twice: left alone


X = jnp.asarray(np.linspace(-3, 3, 8), jnp.float32)


def _prims(closed):
    """Every primitive of `closed`, nested bodies (amp's float32 islands) included."""
    return [e.primitive.name for e, _ in walk(closed.jaxpr)]


def test_a_registered_rewrite_is_applied_gated_and_explained(registered):
    f = autocast.amp(_fn, compute_dtype=jnp.bfloat16, amp_policy=registered)
    prims = _prims(jax.make_jaxpr(f)(X))
    # one log(exp) of three is gone: the scoped one is kept by the policy, the last one by the finder
    assert prims.count("log") == 2 and prims.count("exp") == 2, prims
    np.testing.assert_allclose(f(X), _fn(X), rtol=1e-6)
    # what explain's observer hears from the door (kept, and why) and from the rule (what it bound)
    ctx = _options.AmpOptions(compute_dtype=jnp.bfloat16, amp_policy=registered).context(_explain_record.ExplainContext)
    observer = _explain_record.Observer(ctx)
    ctx.observer = observer
    _amp._transform(jax.make_jaxpr(_fn)(X), (), ctx)
    assert sorted(observer.rewrites["log_exp"]) == [
        ("log(exp(x))", "as written: the policy (log_exp_as_written)"),
        ("log(exp(x))", "exp(x) read elsewhere"),
        ("log(exp(x))", "x"),
    ]


def test_off_by_the_context_the_default_policy_and_amp_stop(registered):
    # the default policy does not map the primitive to the rewrite's rule: kept as written
    default = jax.make_jaxpr(autocast.amp(_fn, compute_dtype=jnp.bfloat16))(X)
    assert _prims(default).count("log") == 3
    stopped = jax.make_jaxpr(autocast.amp(autocast.amp_stop(_fn), compute_dtype=jnp.bfloat16, amp_policy=registered))
    assert [e.primitive.name for e, _ in walk(stopped(X).jaxpr)].count("log") == 3
    ctx = _options.AmpOptions(compute_dtype=jnp.bfloat16, amp_policy=registered).context()
    ctx.rewrites_off = frozenset({"log_exp"})
    off = _amp._transform(jax.make_jaxpr(_fn)(X), (), ctx)
    assert _prims(off).count("log") == 3


def test_a_second_rewrite_of_the_same_name_or_primitive_is_refused(registered):
    with pytest.raises(ValueError, match="'log_exp' is registered for it already"):
        _rewrites.register_rewrite("log_exp", _compat.Primitive("other"), _find, IDENTITY)
    with pytest.raises(ValueError, match="'log_exp' is registered for it already"):
        _rewrites.register_rewrite("other", log_exp_p, _find, IDENTITY)
