"""Custom derivatives run in the dtypes their operands arrive in (defect class: every
``custom_jvp`` / ``custom_vjp`` call was a float32 round trip that saved float32
residuals).

Each test compares with the float32 run of the same function. The semantics checks use
rules whose output differs from the true derivative (a straight-through estimator, a
scaled or clipped gradient, symbolic-zero branches), so dropping a rule would fail them.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import activation_jvps, tree_max_rel_err, walk
from jax.ad_checkpoint import print_saved_residuals
from jax.custom_derivatives import SymbolicZero

import autocast

HALF = [jnp.float16, jnp.bfloat16]
# amp vs float32 gradients of these small functions (float16 operands of size ~1): measured
# <= 2e-3 in float16; bfloat16 has 8 bits of mantissa: measured <= 1.5e-2.
TOL = {jnp.float16: 1e-2, jnp.bfloat16: 5e-2}
# every jax.nn activation of one array (elu, selu, celu: a jit whose expm1 ran in float32 and
# kept float32 residuals until its output was narrowed where made)
_NAMES = "relu relu6 softplus mish elu selu celu gelu silu leaky_relu sigmoid log_sigmoid hard_tanh hard_sigmoid"
_NAMES += " hard_silu soft_sign squareplus sparse_plus tanh"
ACTIVATIONS = {name: getattr(jax.nn, name) for name in _NAMES.split() if hasattr(jax.nn, name)}


def _wx(seed=0, n=64, m=16, k=32):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((m, k), dtype=np.float32) / np.float32(np.sqrt(m))
    return jnp.asarray(w), jnp.asarray(rng.standard_normal((n, m), dtype=np.float32))


def _grad_err(f, w, x, dtype, ref=None):
    ref = jax.grad(f)(w, x) if ref is None else ref
    got = jax.grad(autocast.amp(f, compute_dtype=dtype))(w, x)
    assert got.dtype == ref.dtype
    return tree_max_rel_err(got, ref)


def _saved(fn, capsys, *args):
    print_saved_residuals(fn, *args)
    return [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]


# --- activations: half in, half out, half (or boolean) residuals ----------------------------


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_saves_no_float32_residual_of_activation_size(name, dtype, capsys):
    act = ACTIVATIONS[name]
    w, x = _wx()

    def f(w, x):
        return jnp.sum(act(x @ w) @ w.T)

    saved = _saved(autocast.amp(f, compute_dtype=dtype), capsys, w, x)
    act_shape = f"[{x.shape[0]},{w.shape[1]}]"
    act_residuals = [s for s in saved if s.endswith(act_shape)]
    assert act_residuals, saved
    assert not [s for s in act_residuals if s.startswith("f32")], (name, saved)
    # float32 saves float32 ones (the comparison means something)
    assert any(s.startswith("f32") and s.endswith(act_shape) for s in _saved(f, capsys, w, x))
    assert _grad_err(f, w, x, dtype) < TOL[dtype]


@pytest.mark.parametrize("name", ["relu", "relu6"])
def test_relu_call_stays_half(name):
    """No convert around the activation: its custom_jvp (either encoding) takes and returns float16."""
    act = ACTIVATIONS[name]
    w, x = _wx(1)
    closed = jax.make_jaxpr(autocast.amp(lambda w, x: act(x @ w) @ w.T))(w, x)
    # the activation's, not a matmul's (a float32 weight cotangent is a custom_jvp too)
    calls = activation_jvps(closed)
    assert calls
    for e in calls:
        floats = [str(v.aval.dtype) for v in (*e.invars, *e.outvars) if str(v.aval.dtype).startswith("float")]
        assert "float16" in floats and set(floats) <= {"float16"} | ({"float32"} if name == "relu6" else set()), floats
        assert [str(v.aval.dtype) for v in e.outvars] == ["float16"]
    converts = [
        e
        for e, _ in walk(closed)
        if e.primitive.name == "convert_element_type" and e.params["new_dtype"] == jnp.float32
    ]
    assert len(converts) == 1, converts  # only the output of the function


# --- custom_jvp: rules keep their semantics, in the arriving dtypes --------------------------


@jax.custom_jvp
def ste_round(x):
    return jnp.round(x)


@ste_round.defjvp
def _ste_round_jvp(primals, tangents):
    return ste_round(primals[0]), tangents[0]


@jax.custom_jvp
def triple(x):
    return x


@triple.defjvp
def _triple_jvp(primals, tangents):
    return primals[0], 3.0 * tangents[0]


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_custom_jvp_rule_runs_in_the_arriving_dtype(dtype):
    w, x = _wx(2)

    def f(w, x):
        return jnp.sum(jnp.tanh(triple(ste_round(4.0 * (x @ w)) / 4.0)) @ w.T)

    true = jax.grad(lambda w, x: jnp.sum(jnp.tanh(jnp.round(4.0 * (x @ w)) / 4.0) @ w.T))(w, x)
    assert tree_max_rel_err(true, jax.grad(f)(w, x)) > 0.3  # the rules matter
    assert _grad_err(f, w, x, dtype) < TOL[dtype]
    # JAX traces the rule once, at the traced dtypes; amp evaluates that jaxpr on the
    # arriving values: the rule's ``3.0 * t`` runs in the half dtype
    closed = jax.make_jaxpr(jax.grad(autocast.amp(f, compute_dtype=dtype)))(w, x)
    triples = [
        str(e.outvars[0].aval.dtype)
        for e, _ in walk(closed)
        if e.primitive.name == "mul" and any(getattr(v, "val", None) == 3.0 for v in e.invars)
    ]
    assert triples and set(triples) == {jnp.dtype(dtype).name}, triples


@jax.custom_jvp
def weighted_mul(a, b):
    return a * b


_zero_flags: list = []


@functools.partial(weighted_mul.defjvp, symbolic_zeros=True)
def _weighted_mul_jvp(primals, tangents):
    (a, b), (ta, tb) = primals, tangents
    _zero_flags.append((type(ta) is SymbolicZero, type(tb) is SymbolicZero))
    t = jnp.zeros_like(a * b)
    if type(ta) is not SymbolicZero:
        t = t + 2.0 * ta * b
    if type(tb) is not SymbolicZero:
        t = t + 5.0 * a * tb
    return a * b, t


def test_custom_jvp_symbolic_zeros_reach_the_rule():
    w, x = _wx(3)

    def f(w, x):
        h = x @ w
        return jnp.sum(jnp.tanh(weighted_mul(h, jnp.cos(h)) + weighted_mul(h, jnp.ones_like(h))))

    _zero_flags.clear()
    ref = jax.grad(f)(w, x)
    want = sorted(set(_zero_flags))
    _zero_flags.clear()
    assert _grad_err(f, w, x, jnp.float16) < TOL[jnp.float16]
    assert sorted(set(_zero_flags)) == want == [(False, False), (False, True)]
    assert np.all(np.isfinite(ref))


@jax.custom_jvp
def with_index(a):
    return 2.0 * a, jnp.argmax(a, -1)


@with_index.defjvp
def _with_index_jvp(primals, tangents):
    return with_index(primals[0]), (3.0 * tangents[0], np.zeros(primals[0].shape[:-1], jax.dtypes.float0))


def test_custom_jvp_with_an_integer_output():
    w, x = _wx(4)

    def f(w, x):
        y, i = with_index(x @ w)
        return jnp.sum(jnp.tanh(y)) + jnp.sum(i).astype(jnp.float32)

    assert _grad_err(f, w, x, jnp.float16) < TOL[jnp.float16]
    _, i_got = autocast.amp(with_index)(x @ w)
    _, i_ref = with_index(x @ w)
    assert i_got.dtype == i_ref.dtype


# --- custom_vjp: forward in the arriving dtypes, bwd adapted at its boundary -----------------

_bwd_seen: list = []


@jax.custom_vjp
def clip_gradient(x):
    return x


def _clip_fwd(x):
    return x, jnp.abs(x)


def _clip_bwd(res, g):
    _bwd_seen.append((res.dtype.name, g.dtype.name))
    return (jnp.clip(g, -0.05, 0.05) * (res > 0.1),)


clip_gradient.defvjp(_clip_fwd, _clip_bwd)


@pytest.mark.parametrize("mode", ["amp", "original"])
@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_custom_vjp_residuals_and_bwd_in_the_arriving_dtype(dtype, mode, capsys):
    """The forward rule runs in the arriving dtype (half residuals). The backward rule is
    traced as JAX would trace it (float32 values) and evaluated under the policy on the half
    residuals and cotangents (``custom_vjp_bwd="amp"``), or called on them as they arrive
    (``"original"``); either way the clip applies as written."""
    w, x = _wx(5)

    def f(w, x):
        return jnp.sum(jnp.tanh(clip_gradient(x @ w)) @ (3.0 * w.T))

    true = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) @ (3.0 * w.T)))(w, x)
    ref = jax.grad(f)(w, x)
    assert tree_max_rel_err(true, ref) > 0.3
    _bwd_seen.clear()
    amp_f = autocast.amp(f, compute_dtype=dtype, custom_vjp_bwd=mode)
    assert tree_max_rel_err(jax.grad(amp_f)(w, x), ref) < TOL[dtype]
    name = jnp.dtype(dtype).name if mode == "original" else "float32"
    assert _bwd_seen and set(_bwd_seen) == {(name, name)}, _bwd_seen
    saved = _saved(amp_f, capsys, w, x)
    assert not [s for s in saved if s.startswith("f32") and s.endswith(f"[{x.shape[0]},{w.shape[1]}]")], saved


@jax.custom_vjp
def float32_only(x):
    return x


def _f32_fwd(x):
    return x, x


def _f32_bwd(res, g):
    if res.dtype != jnp.float32 or g.dtype != jnp.float32:
        raise TypeError(f"this rule takes float32 only, got {res.dtype}, {g.dtype}")
    return (g * jnp.float32(0.25) * jnp.sign(res),)


float32_only.defvjp(_f32_fwd, _f32_bwd)


@jax.custom_vjp
def upcasting(x):
    return x


upcasting.defvjp(lambda x: (x, None), lambda _, g: (g.astype(jnp.float32) * jnp.float32(0.5),))


@pytest.mark.parametrize("fn", [float32_only, upcasting], ids=["raises_on_half", "returns_float32"])
def test_custom_vjp_bwd_that_cannot_take_half_is_adapted(fn):
    w, x = _wx(6)

    def f(w, x):
        return jnp.sum(jnp.tanh(fn(x @ w)) @ w.T)

    true = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) @ w.T))(w, x)
    assert tree_max_rel_err(true, jax.grad(f)(w, x)) > 0.3
    assert _grad_err(f, w, x, jnp.float16) < TOL[jnp.float16]


@jax.custom_vjp
def pair(a, b):
    return a * b, a + b


def _pair_fwd(a, b):
    return pair(a.value, b.value), (a.value, b.value, a.perturbed, b.perturbed)


def _pair_bwd(res, cts):
    a, b, pa, pb = res
    g1, g2 = (jnp.zeros_like(a) if type(g) is SymbolicZero else g for g in cts)
    return (3.0 * g1 * b + g2 if pa else None, g1 * a + 7.0 * g2 if pb else None)


pair.defvjp(_pair_fwd, _pair_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def scaled(k, a):
    return a * k


scaled.defvjp(lambda k, a: (a * k, None), lambda k, _, g: (g * k * 10.0,))


@jax.custom_vjp
def sin_remat(a):
    return jnp.sin(a)


sin_remat.defvjp(lambda a: (jnp.sin(a), jnp.cos(a)), lambda c, g: (2.0 * g * c,), optimize_remat=True)


@pytest.mark.parametrize(
    "body",
    [
        lambda h: pair(h, jnp.sin(h))[0],
        lambda h: scaled(0.5, h),
        lambda h: sin_remat(h),
    ],
    ids=["symbolic_zeros", "nondiff_argnums", "optimize_remat"],
)
def test_custom_vjp_options_keep_working(body):
    w, x = _wx(7)

    def f(w, x):
        return jnp.sum(jnp.tanh(body(x @ w)) @ w.T)

    assert _grad_err(f, w, x, jnp.float16) < TOL[jnp.float16]
    # and under vmap of grad
    per_row = jax.vmap(jax.grad(autocast.amp(f)), (None, 0))(w, x[:, None])
    ref = jax.vmap(jax.grad(f), (None, 0))(w, x[:, None])
    assert tree_max_rel_err(per_row, ref) < TOL[jnp.float16]


def test_custom_vjp_closing_over_a_differentiated_value_is_an_error():
    w, x = _wx(8)

    def f(w, x):
        h = x @ w

        @jax.custom_vjp
        def g(a):
            return a * h

        g.defvjp(lambda a: (a * h, None), lambda _, c: (c,))
        return jnp.sum(g(x @ w))

    with pytest.raises(Exception, match=re.compile("closed-over|tracer", re.I)):
        jax.grad(autocast.amp(f))(w, x)
