"""Higher-order semantics under ``amp``: custom derivatives, checkpoint policies, effects,
random keys, ``amp_stop`` / named scopes in nested bodies, loop carries.

Custom derivative rules are chosen so that their output is *distinguishable from the true
derivative* (a straight-through estimator, a gradient scaler, a gradient clipper): if
``amp`` dropped the rule and differentiated the primal body, the gradient would be the true
one and the comparison with ``jax.grad`` of the original function (same rules) would fail.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import activation_jvps, bodies, compute_op_dtypes, dots_in, of_kind, param, tree_max_rel_err, walk
from jax.ad_checkpoint import print_saved_residuals
from jax.experimental import io_callback

import autocast
from autocast import _compat

F16 = jnp.float16
# amp vs float32 for these small functions (operands of size ~1, float16 matmuls, sums
# of <= 64 terms): measured <= 2e-3, allowed 1e-2.
GRAD_TOL = 1e-2


def _wx(seed=0, n=8, m=16, k=8):
    rng = np.random.default_rng(seed)  # NumPy data: no per-shape jax.random compilations
    w = rng.standard_normal((m, k), dtype=np.float32) / np.float32(np.sqrt(m))
    return jnp.asarray(w), jnp.asarray(rng.standard_normal((n, m), dtype=np.float32))


def _prims(fn, *args):
    return collections.Counter(e.primitive.name for e, _ in walk(jax.make_jaxpr(fn)(*args)))


# --- custom_jvp ---------------------------------------------------------------------------


@jax.custom_jvp
def ste_round(x):
    """Rounding with a straight-through gradient (the true derivative is zero)."""
    return jnp.round(x)


@ste_round.defjvp
def _ste_round_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return ste_round(x), t


@jax.custom_jvp
def triple_grad(x):
    """The identity whose JVP rule is three times the true one."""
    return x


@triple_grad.defjvp
def _triple_grad_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return x, 3.0 * t


def test_custom_jvp_straight_through_estimator_is_used():
    w, x = _wx()

    def f(w, x):
        h = ste_round(4.0 * (x @ w))
        return jnp.sum(jnp.tanh(h / 4.0) @ w.T)

    ref = jax.grad(f)(w, x)
    true = jax.grad(lambda w, x: jnp.sum(jnp.tanh(jnp.round(4.0 * (x @ w)) / 4.0) @ w.T))(w, x)
    got = jax.grad(autocast.amp(f))(w, x)
    assert got.dtype == jnp.float32
    # the STE rule matters: the true gradient differs from it by a lot
    assert tree_max_rel_err(true, ref) > 0.3
    assert tree_max_rel_err(got, ref) < GRAD_TOL, "amp(f) does not use the custom_jvp rule"
    # the custom_jvp stays one (classic or call_hi_primitive encoding), around half values
    (ste,) = activation_jvps(jax.make_jaxpr(autocast.amp(f))(w, x))
    assert [str(v.aval.dtype) for v in ste.invars] == ["float16"], ste


def test_custom_jvp_rule_output_is_used_not_the_body_derivative():
    w, x = _wx(1)

    def f(w, x):
        return jnp.sum(jnp.sin(triple_grad(x @ w)))

    ref = jax.grad(f)(w, x)
    true = jax.grad(lambda w, x: jnp.sum(jnp.sin(x @ w)))(w, x)
    np.testing.assert_allclose(ref, 3.0 * true, rtol=1e-4)
    got = jax.grad(autocast.amp(f))(w, x)
    assert tree_max_rel_err(got, ref) < GRAD_TOL, f"got/true ratio {float(jnp.sum(got) / jnp.sum(true)):.3f}, want 3"
    # the jvp (not just vjp) path too
    _, t_got = jax.jvp(autocast.amp(f), (w, x), (jnp.ones_like(w), jnp.zeros_like(x)))
    _, t_ref = jax.jvp(f, (w, x), (jnp.ones_like(w), jnp.zeros_like(x)))
    assert abs(float(t_got) - float(t_ref)) < GRAD_TOL * abs(float(t_ref))


# --- custom_vjp ---------------------------------------------------------------------------

CLIP = 0.05
_seen_bwd_dtypes: list = []


@jax.custom_vjp
def clip_gradient(x):
    """The identity whose backward pass clips the cotangent to [-CLIP, CLIP]."""
    return x


def _clip_fwd(x):
    return x, x


def _clip_bwd(res, g):
    _seen_bwd_dtypes.append((res.dtype.name, g.dtype.name))
    return (jnp.clip(g, -CLIP, CLIP),)


clip_gradient.defvjp(_clip_fwd, _clip_bwd)


def test_custom_vjp_gradient_clipper_backward_is_used():
    w, x = _wx(2)

    def f(w, x):
        h = clip_gradient(x @ w)
        return jnp.sum(jnp.tanh(h) @ (3.0 * w.T))

    ref = jax.grad(f)(w, x)
    true = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) @ (3.0 * w.T)))(w, x)
    assert tree_max_rel_err(true, ref) > 0.3, "the clip must be active for this test to mean anything"
    _seen_bwd_dtypes.clear()
    got = jax.grad(autocast.amp(f))(w, x)
    assert tree_max_rel_err(got, ref) < GRAD_TOL, "amp(f) does not use the custom_vjp backward function"
    # documented: bwd is traced as JAX would (float32 values) and evaluated under the policy
    # on the float16 residuals and cotangents; its clip still applies exactly (checked above)
    assert _seen_bwd_dtypes and all(d == ("float32", "float32") for d in _seen_bwd_dtypes), _seen_bwd_dtypes
    _seen_bwd_dtypes.clear()
    got = jax.grad(autocast.amp(f, custom_vjp_bwd="original"))(w, x)
    assert tree_max_rel_err(got, ref) < GRAD_TOL
    # as written: bwd runs in the dtypes its residuals and cotangents arrive in (the float16 matmul result)
    assert _seen_bwd_dtypes and all(d == ("float16", "float16") for d in _seen_bwd_dtypes), _seen_bwd_dtypes
    (clip,) = activation_jvps(jax.make_jaxpr(autocast.amp(f))(w, x), "custom_vjp")
    assert [str(v.aval.dtype) for v in clip.invars] == ["float16"], clip


def test_custom_vjp_inside_jit_and_scan_under_amp():
    w, x = _wx(3, k=16)  # square w: the scan carry keeps its shape

    def f(w, x):
        def body(h, _):
            return jnp.tanh(clip_gradient(h @ (3.0 * w))), None

        h, _ = jax.lax.scan(body, x, None, length=2)
        return jnp.sum(jax.jit(lambda h: h @ w.T)(h))

    ref = jax.grad(f)(w, x)
    true = jax.grad(
        lambda w, x: jnp.sum(jax.lax.scan(lambda h, _: (jnp.tanh(h @ (3.0 * w)), None), x, None, length=2)[0] @ w.T)
    )(w, x)
    assert tree_max_rel_err(true, ref) > 0.1, "the clip must be active for this test to mean anything"
    got = jax.grad(autocast.amp(f))(w, x)
    assert tree_max_rel_err(got, ref) < GRAD_TOL
    census = compute_op_dtypes(jax.grad(autocast.amp(f)), w, x)
    assert {dt for (_, dt, _) in census} == {"float16"}, census


# --- checkpoint -----------------------------------------------------------------------------


def test_checkpoint_policy_param_is_kept():
    w, x = _wx(4)
    policy = jax.checkpoint_policies.dots_saveable

    def f(w, x):
        block = jax.checkpoint(lambda w, x: jnp.sin(x @ w) @ w.T, policy=policy)
        return jnp.sum(block(w, x) ** 2)

    closed = jax.make_jaxpr(autocast.amp(f))(w, x)
    remats = of_kind(closed, "checkpoint")
    assert any(param(e, "policy") is policy for e in remats), [param(e, "policy") for e in remats]
    # and its body's two matmuls are half precision
    inner = [d for r in remats if param(r, "policy") is policy for b in bodies(r) for d in dots_in(b)]
    assert inner == [("float16", "float16")] * 2, inner
    assert tree_max_rel_err(jax.grad(autocast.amp(f))(w, x), jax.grad(f)(w, x)) < GRAD_TOL


@pytest.mark.parametrize("remat_float32", [True, False])
def test_user_checkpoint_policy_decides_the_saved_activations(remat_float32, capsys):
    """With ``policy=dots_saveable`` the block's matmul output is saved for the backward
    pass and its elementwise intermediates are recomputed. Under amp the block must not
    save more of its (64, 8) activations than float32 does (amp's half copies are smaller,
    so the count is what matters)."""
    w, x = _wx(16, n=64, m=16, k=8)
    policy = jax.checkpoint_policies.dots_saveable

    def f(w, x):
        block = jax.checkpoint(lambda w, x: jnp.tanh(jnp.tanh(x @ w) * 2.0) @ w.T, policy=policy)
        return jnp.sum(block(w, x) ** 2)

    def n_activations(fn):
        print_saved_residuals(fn, w, x)
        return sum("[64,8]" in line for line in capsys.readouterr().out.splitlines())

    want = n_activations(f)
    got = n_activations(autocast.amp(f, remat_float32=remat_float32))
    assert want == 1
    assert got <= want, (
        f"amp(remat_float32={remat_float32}) saves {got} (64, 8) activations of the dots_saveable "
        f"block for the backward pass; float32 saves {want} (the matmul output)"
    )


@pytest.mark.parametrize("remat_float32", [True, False])
def test_user_checkpoint_still_recomputes_its_matmuls(remat_float32):
    """A user's ``jax.checkpoint`` (save nothing) must keep recomputing its block in the
    backward pass under amp: amp's own ``remat_float32`` policy must not turn the block's
    intermediates into saved residuals (that would undo ``nn.remat`` / ``eqx`` checkpointed
    scans and raise activation memory). Counted: matmuls in ``jax.grad``'s jaxpr."""
    w, x = _wx(5, k=16)

    @jax.checkpoint
    def block(w, x):
        return jnp.tanh(x @ w) @ w

    def f(w, x):
        return jnp.sum(block(w, x) ** 2)

    def n_dots(fn):
        return sum(n for (prim, _, _), n in compute_op_dtypes(jax.grad(fn), w, x).items() if prim == "dot_general")

    want = n_dots(f)
    got = n_dots(autocast.amp(f, remat_float32=remat_float32))
    assert got == want, (
        f"amp(remat_float32={remat_float32}): jax.grad has {got} matmuls, float32 has {want}: "
        f"the user's jax.checkpoint block is no longer recomputed (its residuals are saved instead)"
    )


# --- effects: debug print, callbacks ---------------------------------------------------------


def _exact_wx():
    # small integers: the float16 matmul is exact, so printed values match float32's
    w = jnp.arange(12.0).reshape(4, 3) - 5.0
    x = jnp.arange(8.0).reshape(2, 4) / 2.0
    return w, x


def test_debug_print_runs_inside_jit_scan_and_cond(capfd):
    w, x = _exact_wx()

    def f(w, x):
        h = x @ w
        jax.debug.print("top h={h}", h=h)

        def body(c, _):
            jax.debug.print("scan c={c}", c=c @ jnp.ones((3, 3)))
            return c, None

        jax.lax.scan(body, h, None, length=1)
        jax.lax.cond(h.sum() > 0, lambda: jax.debug.print("cond {s}", s=h.sum()), lambda: None)
        return jax.jit(lambda h: jnp.sum(h))(h)

    jax.block_until_ready(f(w, x))
    want = capfd.readouterr().out
    jax.block_until_ready(autocast.amp(f)(w, x))
    got = capfd.readouterr().out
    assert "top h=" in want and "scan c=" in want and "cond " in want, want
    assert got == want


def test_debug_callback_receives_the_traced_dtypes():
    w, x = _wx(6)
    seen = []

    def f(w, x):
        h = x @ w
        jax.debug.callback(lambda h: seen.append(np.asarray(h).dtype), h)
        return jnp.sum(h)

    jax.block_until_ready(autocast.amp(f)(w, x))
    assert seen == [np.dtype("float32")]
    # ... while the matmul feeding it ran in float16
    assert compute_op_dtypes(autocast.amp(f), w, x) == collections.Counter({("dot_general", "float16", False): 1})


def test_pure_callback_runs_and_receives_original_dtype():
    w, x = _wx(7)
    seen = []

    def host_fn(h):
        seen.append(np.asarray(h).dtype)
        return np.asarray(np.tanh(h) * 2.0, dtype=np.float32)

    def f(w, x):
        h = x @ w
        y = jax.pure_callback(host_fn, jax.ShapeDtypeStruct(h.shape, jnp.float32), h)
        return y @ w.T

    got = autocast.amp(f)(w, x)
    ref = f(w, x)
    assert seen and set(seen) == {np.dtype("float32")}, seen
    assert got.dtype == jnp.float32
    assert tree_max_rel_err(got, ref) < GRAD_TOL
    assert "pure_callback" in _prims(autocast.amp(f), w, x)


def test_io_callback_runs_in_order_with_original_dtype():
    w, x = _wx(8)
    log = []

    def record(tag):
        def cb(v):
            log.append((tag, np.asarray(v).dtype))
            return np.int32(len(log))

        return cb

    def f(w, x):
        h = x @ w
        a = io_callback(record("first"), jax.ShapeDtypeStruct((), jnp.int32), h, ordered=True)
        b = io_callback(record("second"), jax.ShapeDtypeStruct((), jnp.int32), jnp.sum(h), ordered=True)
        return jnp.sum(h) + a + b

    jax.block_until_ready(jax.jit(autocast.amp(f))(w, x))
    assert log == [("first", np.dtype("float32")), ("second", np.dtype("float32"))]


# --- random keys ----------------------------------------------------------------------------


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed_key", "uint32_key"])
def test_random_key_ops_untouched(make_key):
    w, x = _wx(9)

    def f(w, x, key):
        k1, k2 = jax.random.split(key)
        noise = jax.random.normal(k1, (x.shape[0], w.shape[1]))
        keep = jax.random.bernoulli(k2, 0.7, noise.shape)
        h = jnp.where(keep, (x @ w) / 0.7, 0.0) + 0.1 * noise
        return jnp.sum(h), (noise, keep, jax.random.key_data(k1) if make_key is jax.random.key else k1)

    key = make_key(3)
    (v_ref, aux_ref), (v_got, aux_got) = f(w, x, key), autocast.amp(f)(w, x, key)
    for a, b in zip(jax.tree_util.tree_leaves(aux_ref), jax.tree_util.tree_leaves(aux_got)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert abs(float(v_got) - float(v_ref)) < GRAD_TOL * abs(float(v_ref))

    # the key-typed values in the transformed jaxpr are exactly those of the original
    def key_avals(fn):
        closed = jax.make_jaxpr(fn)(w, x, key)
        return sorted(
            (e.primitive.name, str(v.aval))
            for e, _ in walk(closed)
            for v in e.outvars
            if jnp.issubdtype(v.aval.dtype, jax.dtypes.prng_key) or e.primitive.name.startswith(("random_", "threefry"))
        )

    assert key_avals(autocast.amp(f)) == key_avals(f)
    grads = jax.grad(lambda w: autocast.amp(f)(w, x, key)[0])(w)
    assert grads.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(grads)))


def _key_scan_carry(w, h, key):
    def body(c, _):
        k, h = c
        k, sub = jax.random.split(k)
        return (k, jnp.tanh(h @ w + 0.1 * jax.random.normal(sub, h.shape))), None

    (key, h), _ = jax.lax.scan(body, (key, h), None, length=3)
    return jnp.sum(h), key


def _key_fori_carry(w, h, key):
    def body(i, c):
        k, h = c
        k, sub = jax.random.split(k)
        return k, jnp.tanh(h @ w + 0.1 * jax.random.normal(sub, h.shape))

    key, h = jax.lax.fori_loop(0, 3, body, (key, h))
    return jnp.sum(h), key


def _key_scan_xs(w, h, key):
    h, keys = jax.lax.scan(
        lambda h, k: (jnp.tanh(h @ w + 0.1 * jax.random.normal(k, h.shape)), k), h, jax.random.split(key, 3)
    )
    return jnp.sum(h), keys[-1]


def _key_cond(w, h, key):
    h = h @ w
    key = jax.lax.cond(jnp.sum(h) > 0, lambda k: jax.random.split(k)[0], lambda k: k, key)
    return jnp.sum(jnp.tanh(h)) + jnp.sum(jax.random.normal(key, (2,))), key


def _key_checkpoint(w, h, key):
    body = jax.checkpoint(
        lambda w, k: (jnp.sum(jnp.tanh(h @ w + jax.random.normal(k, h.shape))), jax.random.fold_in(k, 1))
    )
    return body(w, key)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(
    "f", [_key_scan_carry, _key_fori_carry, _key_scan_xs, _key_cond, _key_checkpoint], ids=lambda f: f.__name__[5:]
)
def test_typed_keys_through_loops_and_branches(f, dtype):
    """A typed PRNG key carried by a ``scan`` or ``fori_loop`` (an RL rollout, a sampling
    loop), scanned over, returned by a ``cond`` or a ``checkpoint`` keeps its key dtype and
    value, and the loss's gradient matches float32's. A key carry crashed until 2026-11-27:
    the loop handler's cast of its carries read the key dtype as a NumPy dtype."""
    w, x = _wx(9, k=16)
    h = jnp.tanh(x)
    amped = autocast.amp(f, compute_dtype=dtype)
    (v, key), (v_ref, key_ref) = amped(w, h, jax.random.key(0)), f(w, h, jax.random.key(0))
    assert key.dtype == key_ref.dtype and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(key_ref))
    assert abs(float(v) - float(v_ref)) < GRAD_TOL * abs(float(v_ref))
    grads = jax.grad(lambda w: amped(w, h, jax.random.key(0))[0])(w)
    ref = jax.grad(lambda w: f(w, h, jax.random.key(0))[0])(w)
    assert grads.dtype == jnp.float32
    assert float(jnp.linalg.norm(grads - ref) / jnp.linalg.norm(ref)) < GRAD_TOL


# --- amp_stop and named scopes inside nested bodies ------------------------------------------


def _nested(w, x, region):
    """One matmul inside ``region()`` and one outside, in each of jit, scan and cond."""

    @jax.jit
    def in_jit(w, x):
        with region():
            a = x @ w
        return a, x @ w

    def body(c, _):
        with region():
            s = c @ w
        return jnp.tanh(c @ w + s), None

    a, b = in_jit(w, x)
    c, _ = jax.lax.scan(body, x[:, : w.shape[0]], None, length=2)

    def precise(x):
        with region():
            return x @ w

    d = jax.lax.cond(jnp.sum(x) > 0, precise, lambda x: x @ w, x)
    return jnp.sum(a) + jnp.sum(b) + jnp.sum(c) + jnp.sum(d)


def test_amp_stop_inside_jit_scan_cond():
    w, x = _wx(10, m=16, k=16)
    fn = autocast.amp(lambda w, x: _nested(w, x, autocast.amp_stop))
    census = compute_op_dtypes(fn, w, x)
    # in jit, scan and cond: one float32 matmul inside amp_stop, one float16 outside
    assert census == collections.Counter({("dot_general", "float32", True): 3, ("dot_general", "float16", False): 3}), (
        census
    )
    got, ref = fn(w, x), _nested(w, x, autocast.amp_stop)
    assert abs(float(got) - float(ref)) < GRAD_TOL * abs(float(ref))
    # also under grad: the backward matmuls of the amp_stop region stay float32
    gcensus = compute_op_dtypes(jax.grad(fn), w, x)
    assert gcensus[("dot_general", "float32", True)] > 0 and gcensus[("dot_general", "float32", False)] == 0, gcensus


def test_amp_stop_decorator_inside_scan_body():
    w, x = _wx(11, m=16, k=16)

    @autocast.amp_stop
    def precise(c):
        return c @ w

    def f(w, x):
        c, _ = jax.lax.scan(lambda c, _: (jnp.tanh(precise(c) + c @ w), None), x, None, length=3)
        return jnp.sum(c)

    census = compute_op_dtypes(autocast.amp(f), w, x)
    assert census == collections.Counter({("dot_general", "float32", True): 1, ("dot_general", "float16", False): 1}), (
        census
    )


def test_named_scope_rule_inside_jit_scan_cond():
    w, x = _wx(12, m=16, k=16)
    policy = autocast.extend_policy({"precise_*": autocast.use_float32_precision})
    fn = autocast.amp(lambda w, x: _nested(w, x, lambda: jax.named_scope("precise_dot")), amp_policy=policy)
    closed = jax.make_jaxpr(fn)(w, x)
    by_scope = collections.Counter(
        ("precise_dot" in scopes, str(e.invars[0].aval.dtype))
        for e, scopes in walk(closed)
        if e.primitive.name == "dot_general"
    )
    assert by_scope == collections.Counter({(True, "float32"): 3, (False, "float16"): 3}), by_scope
    # without the policy entry the scope means nothing
    plain = autocast.amp(lambda w, x: _nested(w, x, lambda: jax.named_scope("precise_dot")))
    assert compute_op_dtypes(plain, w, x) == collections.Counter({("dot_general", "float16", False): 6})


# --- loop carries ---------------------------------------------------------------------------


def _loop_eqns(fn, *args, names=("scan", "while")):
    return [e for e, _ in walk(jax.make_jaxpr(fn)(*args)) if e.primitive.name in names]


def test_scan_carry_keeps_float32_dtype():
    w, x = _wx(13, m=16, k=16)

    def f(w, x):
        def body(c, xs):
            c = c + jnp.tanh(c @ w) * xs
            return c, c @ w

        c, ys = jax.lax.scan(body, x, jnp.linspace(0.1, 0.3, 4))
        return c, ys

    (c, ys) = autocast.amp(f)(w, x)
    assert c.dtype == jnp.float32 and ys.dtype == jnp.float32
    (scan,) = _loop_eqns(autocast.amp(f), w, x, names=("scan",))
    n_consts, n_carry = _compat.scan_counts(scan.params)
    carry_in = [str(v.aval.dtype) for v in scan.invars[n_consts : n_consts + n_carry]]
    carry_out = [str(v.aval.dtype) for v in scan.outvars[:n_carry]]
    assert carry_in == carry_out == ["float32"], (carry_in, carry_out)
    # the body's matmuls are half precision; the stacked output may stay half inside amp
    body_dots = [
        str(e.invars[0].aval.dtype) for e, _ in walk(scan.params["jaxpr"]) if e.primitive.name == "dot_general"
    ]
    assert body_dots == ["float16", "float16"], body_dots
    ref_c, _ = f(w, x)
    assert tree_max_rel_err(c, ref_c) < GRAD_TOL


def test_loop_carries_start_as_the_unrolled_loop_would():
    """A float32 carry made from inputs or parameters that the body turns half (it adds a
    half-precision activation to itself) starts half, as after the first step of the
    unrolled loop; a carry initialised from constants (an accumulator) keeps float32; a
    half carry stays half. ``fori_loop`` with static bounds is a ``scan``."""
    w, x = _wx(14, m=16, k=16)

    def step(c):
        return jnp.tanh(c @ w) + c

    def f(w, x, loop):
        c = loop(0, 3, lambda i, c: jnp.tanh(c @ w) + c, x)
        acc = loop(0, 3, lambda i, a: a + jnp.tanh(x @ w), jnp.zeros_like(x))
        c2 = loop(0, 2, lambda i, c: c @ w.astype(jnp.bfloat16), x.astype(jnp.bfloat16))
        return c, acc, c2

    def fori(lo, hi, body, init):
        return jax.lax.fori_loop(lo, hi, body, init)

    def while_(lo, hi, body, init):
        return jax.lax.while_loop(lambda s: s[0] < hi, lambda s: (s[0] + 1, body(s[0], s[1])), (lo, init))[1]

    def unrolled(lo, hi, body, init):
        for i in range(lo, hi):
            init = body(i, init)
        return init

    ref = f(w, x, unrolled)
    amp_unrolled = autocast.amp(functools.partial(f, loop=unrolled))(w, x)
    for loop, name in ((fori, "scan"), (while_, "while")):
        g = autocast.amp(functools.partial(f, loop=loop))
        outs = g(w, x)
        assert [o.dtype for o in outs] == [jnp.float32, jnp.float32, jnp.bfloat16]
        carries = [
            [str(v.aval.dtype) for v in e.outvars if v.aval.dtype != jnp.int32]
            for e in _loop_eqns(g, w, x, names=(name,))
        ]
        assert carries == [["float16"], ["float32"], ["bfloat16"]], carries
        for e in _loop_eqns(g, w, x, names=(name,)):
            body = e.params.get("body_jaxpr") or e.params["jaxpr"]
            dots = [str(v.invars[0].aval.dtype) for v, _ in walk(body) if v.primitive.name == "dot_general"]
            assert not dots or set(dots) <= {"float16", "bfloat16"}, dots
        for o, u, r in zip(outs, amp_unrolled, ref):
            # the loop rounds where the unrolled loop does (XLA may fuse differently: an ulp)
            assert tree_max_rel_err(o, u) < (1e-2 if o.dtype == jnp.bfloat16 else 2e-3)
            assert tree_max_rel_err(o, r) < GRAD_TOL


def test_carry_initialised_from_a_half_value_stays_half_and_output_is_cast_back():
    """Documented: a carry keeps the dtype its initial value *arrives* in; here the initial
    value is a matmul result (float16 under amp), so the loop runs with a float16 carry and
    only the function's output is cast back to the traced float32."""
    w, x = _wx(15, m=16, k=16)

    def f(w, x):
        h0 = x @ w
        h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), h0, None, length=2)
        return h

    (scan,) = _loop_eqns(autocast.amp(f), w, x, names=("scan",))
    assert [str(v.aval.dtype) for v in scan.outvars] == ["float16"]
    out = autocast.amp(f)(w, x)
    assert out.dtype == jnp.float32
    assert tree_max_rel_err(out, f(w, x)) < GRAD_TOL
