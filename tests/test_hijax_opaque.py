"""Operations JAX encodes as opaque ``call_hi_primitive`` equations without any flag (JAX
0.12: ``jnp.searchsorted``, ``jnp.nonzero``, ``jnp.frexp``, ``jnp.ldexp``,
``lax.custom_root``) run as traced, in float32: ``call_hi_primitive`` is in the policy's
``"recurse"`` category, and its handler binds a construct it does not know (anything but a
checkpoint, custom derivative or ``Scan3``) with its operands back in their traced dtypes:
exact operations (comparisons, exponent arithmetic) and a solver whose tolerance assumes
float32. Their values are the float32 function's on the values they receive; integer
outputs stay integers. On a JAX that traces them as ordinary primitives the same holds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import walk

import autocast
from autocast import _compat

HALF = [jnp.float16, jnp.bfloat16]


def _ops(x, y):
    sorted_x = jnp.sort(x)
    mant, expo = jnp.frexp(x)
    return {
        "searchsorted": jnp.searchsorted(sorted_x, y),
        "nonzero": jnp.nonzero(x > 0, size=x.shape[0])[0],
        "frexp": (mant, expo),
        "ldexp": jnp.ldexp(mant, expo),
        "root": jax.lax.custom_root(
            lambda t: t * t - y[0] ** 2, 1.0, lambda g, t0: t0 - g(t0) / (2 * t0), lambda g, t: t / 2.0
        ),
    }


def _inputs():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(16, dtype=np.float32) * 10)
    y = jnp.asarray([1.5, -3.25, 7.0], jnp.float32)
    return x, y


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_opaque_hijax_operations_run_as_traced_in_float32(dtype):
    x, y = _inputs()
    got = autocast.amp(_ops, compute_dtype=dtype)(x, y)
    want = _ops(x, y)
    for name in want:
        for g, w in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name])):
            assert g.dtype == w.dtype, (name, g.dtype, w.dtype)  # int32 stays int32; float32 stays float32
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_opaque_hijax_operation_fed_a_half_activation_sees_its_float32_value(dtype):
    """``searchsorted`` on a half-precision activation: the equation receives the activation
    converted to float32 (its traced dtype), so it agrees with float32 on the rounded values."""
    x, y = _inputs()
    w = jnp.eye(16, dtype=jnp.float32) * 1.001

    def f(w, x, y):
        h = jnp.sort(x @ w)
        return jnp.searchsorted(h, y), h

    idx, h = autocast.amp(f, compute_dtype=dtype)(w, x, y)
    assert idx.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(idx), np.searchsorted(np.asarray(h, np.float32), np.asarray(y)))
    closed = jax.make_jaxpr(autocast.amp(f, compute_dtype=dtype))(w, x, y)
    his = [e for e, _ in walk(closed) if _compat.hi_name(e) is not None]
    for e in his:  # every opaque hijax equation is bound with its traced (float32 / int) operands
        assert all(str(v.aval.dtype) in ("float32", "int32", "bool") for v in e.invars), e
