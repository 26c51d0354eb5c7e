"""``jax_scan3`` (JAX 0.12): ``lax.scan`` is one ``Scan3`` equation whose loop carries are
mutable refs. amp transforms its body in the forward pass: matmuls half, carries (refs) keep
the dtype they were made with. JAX cannot yet differentiate or batch ``Scan3``, ignores
``reverse`` and drops a scan with only carries under ``jit``: those limits are recorded as
strict xfails (each fails the day JAX lifts it), and amp does no worse than JAX there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_hijax import FLAGS, _eqns, hi_names, matmul_operand_dtypes

import autocast
from autocast import _compat

pytestmark = pytest.mark.skipif("scan3" not in FLAGS, reason="this JAX has no jax_scan3")
F16 = jnp.float16
TOL = 1e-2


def _wxs(seed=0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((8, 8), dtype=np.float32)) / 3
    return w, jnp.asarray(rng.standard_normal((5, 4, 8), dtype=np.float32))


def rnn(w, xs, reverse=False):
    def body(c, x):
        h = jnp.tanh(x @ w + c)
        return h, jnp.sum(jnp.sin(h @ w))

    c, ys = jax.lax.scan(body, jnp.zeros((4, 8)), xs, reverse=reverse)
    return jnp.sum(c) + jnp.sum(ys)


def carry_only(w, xs):
    c, _ = jax.lax.scan(lambda c, x: (jnp.tanh(x @ w + c), None), jnp.zeros((4, 8)), xs)
    return jnp.sum(c)


def _scan3(fn, *args):
    with FLAGS["scan3"](True):
        return fn(*args)


def _classic(fn, *args):
    """``fn(*args)`` with ``lax.scan`` in its classic encoding (the reference), whatever
    the environment sets (the nextjax lane runs this file with ``JAX_SCAN3=1``)."""
    with FLAGS["scan3"](False):
        return fn(*args)


def test_scan3_body_matmuls_are_half_and_values_match():
    w, xs = _wxs()
    ref = _classic(rnn, w, xs)
    with FLAGS["scan3"](True):
        assert "Scan3" in hi_names(rnn, w, xs)
        f = autocast.amp(rnn, compute_dtype=F16)
        jaxpr = jax.make_jaxpr(f)(w, xs)
        dts = matmul_operand_dtypes(f, w, xs)
        got, got_jit = f(w, xs), jax.jit(f)(w, xs)
        plain = rnn(w, xs)
    assert "Scan3" in {_compat.hi_name(e) for e, _ in _eqns(jaxpr)}
    assert len(dts) == 2 and set(dts) == {"float16"}, dts
    refs = [str(v.aval) for e, _ in _eqns(jaxpr) for v in e.outvars if _compat.is_ref_aval(v.aval)]
    assert refs and all("float32" in r for r in refs), refs  # the carry keeps its dtype
    np.testing.assert_allclose(float(plain), float(ref), rtol=1e-6)
    np.testing.assert_allclose(float(got), float(ref), rtol=TOL)
    np.testing.assert_allclose(float(got_jit), float(got), rtol=1e-6)


def test_scan3_over_a_pytree_with_a_half_input():
    w, xs = _wxs(1)

    def f(w, xs):
        def body(c, x):
            a, b = x
            h = jnp.tanh(a @ w + b.astype(jnp.float32) + c["h"])
            return {"h": h, "n": c["n"] + 1}, h @ w

        c, ys = jax.lax.scan(body, {"h": jnp.zeros((4, 8)), "n": jnp.int32(0)}, (xs, xs.astype(F16)))
        return jnp.sum(c["h"]) + jnp.sum(ys) + c["n"]

    ref = _classic(f, w, xs)
    got = _scan3(autocast.amp(f, compute_dtype=F16), w, xs)
    np.testing.assert_allclose(float(got), float(ref), rtol=TOL)


# --- JAX's limits: amp is no worse, and works the day JAX lifts them -----------------------


@pytest.mark.xfail(strict=True, raises=NotImplementedError, reason="JAX: Scan3 has no vjp_fwd (no reverse mode)")
def test_grad_through_scan3():
    w, xs = _wxs(2)
    ref = _classic(jax.grad(rnn), w, xs)
    got = _scan3(jax.grad(autocast.amp(rnn, compute_dtype=F16)), w, xs)
    assert float(jnp.max(jnp.abs(got - ref))) < TOL * float(jnp.max(jnp.abs(ref)))


@pytest.mark.xfail(strict=True, raises=NotImplementedError, reason="JAX: Scan3 has no batch rule (no vmap)")
def test_vmap_of_scan3():
    w, xs = _wxs(3)
    ref = _classic(jax.vmap(rnn, in_axes=(None, 0)), w, xs[None])
    got = _scan3(jax.vmap(autocast.amp(rnn, compute_dtype=F16), in_axes=(None, 0)), w, xs[None])
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=TOL)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="JAX: Scan3 ignores reverse=True")
def test_reverse_scan3():
    w, xs = _wxs(4)
    ref = _classic(rnn, w, xs, True)
    np.testing.assert_allclose(float(_scan3(rnn, w, xs, True)), float(ref), rtol=TOL)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="JAX: a Scan3 with only carries is dropped under jit")
def test_carry_only_scan3_under_jit():
    w, xs = _wxs(5)
    ref = _classic(carry_only, w, xs)
    np.testing.assert_allclose(float(_scan3(jax.jit(carry_only), w, xs)), float(ref), rtol=TOL)


def test_amp_does_what_jax_does_at_its_limits():
    """Where ``Scan3`` computes something other than ``lax.scan`` (``reverse``, a carry-only
    scan under ``jit``, which an amp function always is), amp computes what JAX computes;
    where it raises, amp raises the same error."""
    w, xs = _wxs(6)
    with FLAGS["scan3"](True):
        amp_rnn = autocast.amp(lambda w, xs: rnn(w, xs, True), compute_dtype=F16)
        np.testing.assert_allclose(float(amp_rnn(w, xs)), float(rnn(w, xs, True)), rtol=TOL)
        np.testing.assert_allclose(
            float(autocast.amp(carry_only, compute_dtype=F16)(w, xs)), float(jax.jit(carry_only)(w, xs)), atol=1e-6
        )
        for transform in (jax.grad, lambda f: jax.vmap(f, in_axes=(None, 0))):
            args = (w, xs) if transform is jax.grad else (w, xs[None])
            with pytest.raises(NotImplementedError) as plain:
                transform(rnn)(*args)
            with pytest.raises(NotImplementedError) as amped:
                transform(autocast.amp(rnn, compute_dtype=F16))(*args)
            assert str(amped.value).split(",")[0] == str(plain.value).split(",")[0]
