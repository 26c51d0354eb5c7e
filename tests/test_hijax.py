"""The hijax encodings (JAX's ``jax_remat3``, ``jax_custom_jvp3``, ``jax_custom_vjp3`` upgrade
flags: checkpoint, custom_jvp and custom_vjp become one ``call_hi_primitive`` equation each)
behave under amp as their non-hijax twins (defect class: the generic fallback ran every such
body in float32 and wrapped custom rules in constructions JAX cannot differentiate).

Each test turns the flags on with JAX's own config context managers, only those this JAX
has (JAX 0.9.2: ``custom_vjp3``; 0.12: all), and compares with float32 and with the same
function under amp without the flags. Bodies are read through ``_compat.hi_bodies``.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree_max_rel_err
from jax.ad_checkpoint import checkpoint_name

import autocast
from autocast import _compat, _constructs

FLAGS = _compat.hijax_flags()
_CONSTRUCTS = [n for n in ("remat3", "custom_jvp3", "custom_vjp3") if n in FLAGS]
SETTINGS = [(n,) for n in _CONSTRUCTS] + ([tuple(_CONSTRUCTS)] if len(_CONSTRUCTS) > 1 else [])
IDS = [s[0] if len(s) == 1 else "all" for s in SETTINGS]
TOL = 1e-2  # float16 vs float32, operands of size ~1 (measured <= 3e-3 on these functions)


@contextlib.contextmanager
def flags_set(names, value=True):
    with contextlib.ExitStack() as stack:
        for n in names:
            stack.enter_context(FLAGS[n](value))
        yield


@pytest.fixture(params=SETTINGS, ids=IDS)
def flags(request):
    with flags_set(request.param):
        yield request.param


def _wx(seed=0, n=16, m=8, k=8):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((m, k), dtype=np.float32) / np.float32(np.sqrt(m))
    return jnp.asarray(w), jnp.asarray(rng.standard_normal((n, m), dtype=np.float32))


# --- reading bodies, hijax ones included --------------------------------------------------


def _sub_jaxprs(eqn):
    for val in eqn.params.values():
        for item in val if isinstance(val, tuple) else (val,):
            if _compat.is_jaxpr_like(item):
                yield _compat.open_and_consts(item)[0]
    for body in _compat.hi_bodies(eqn):
        yield _compat.open_and_consts(body)[0]


def _eqns(jaxpr):
    jaxpr = _compat.open_and_consts(jaxpr)[0]
    for eqn in jaxpr.eqns:
        yield eqn, jaxpr
        for sub in _sub_jaxprs(eqn):
            yield from _eqns(sub)


def matmul_operand_dtypes(fn, *args):
    """The operand dtype of every matmul of ``fn``'s jaxpr, in every body."""
    out = []
    for eqn, _ in _eqns(jax.make_jaxpr(fn)(*args)):
        if eqn.primitive.name == "dot_general":
            dts = {str(v.aval.dtype) for v in eqn.invars}
            out.append("/".join(sorted(dts)))
    return out


def hi_names(fn, *args):
    return {_compat.hi_name(e) for e, _ in _eqns(jax.make_jaxpr(fn)(*args))} - {None}


# --- the constructs --------------------------------------------------------------------------


def make_model():
    """A model with a checkpoint, a custom_jvp, a custom_vjp and a scan around matmuls; made
    where it is used, as JAX 0.9.2 reads ``jax_custom_vjp3`` when ``jax.custom_vjp``
    decorates a function."""

    @jax.custom_jvp
    def scaled_tanh(x, w):
        return jnp.tanh(x @ w)

    @scaled_tanh.defjvp
    def _scaled_tanh_jvp(primals, tangents):
        (x, w), (tx, tw) = primals, tangents
        y = scaled_tanh(x, w)
        return y, (1 - y**2) * (tx @ w + x @ tw) * 0.5  # half the true derivative: the rule is used

    @jax.custom_vjp
    def clipped(x, w):
        return jnp.sin(x @ w)

    def _clipped_fwd(x, w):
        return clipped(x, w), (x, w)

    def _clipped_bwd(res, g):
        x, w = res
        g = jnp.clip(g * jnp.cos(x @ w), -0.05, 0.05)  # a clipped gradient: the rule is used
        return g @ w.T, x.T @ g

    clipped.defvjp(_clipped_fwd, _clipped_bwd)

    def model(w, x):
        h = jax.checkpoint(lambda h: jax.nn.relu(h @ w))(x)
        h = scaled_tanh(h, w)
        h = clipped(h, w)
        h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), h, None, length=2)
        return jnp.sum(jax.nn.softplus(h @ w))

    return model, scaled_tanh, clipped


def test_every_matmul_in_every_body_is_half(flags):
    model, _, _ = make_model()
    w, x = _wx()
    names = hi_names(model, w, x)
    expect = {"remat3": "RematTraced", "custom_jvp3": "CustomJVPTraced", "custom_vjp3": "CustomVJPTraced"}
    assert {expect[f] for f in flags} <= names, names  # the flags are in effect
    f = autocast.amp(model, compute_dtype=jnp.float16)
    dts = matmul_operand_dtypes(f, w, x)
    assert len(dts) >= 5 and set(dts) == {"float16"}, dts
    assert {expect[n] for n in flags} <= hi_names(f, w, x)  # each construct is rebuilt as such
    v, g = jax.value_and_grad(f)(w, x)
    v32, g32 = jax.value_and_grad(model)(w, x)
    assert abs(float(v) - float(v32)) < TOL * abs(float(v32))
    assert g.dtype == jnp.float32 and tree_max_rel_err(g, g32) < TOL


def test_values_and_gradients_match_the_run_without_flags(flags):
    w, x = _wx(1)
    model, _, _ = make_model()
    v, g = jax.value_and_grad(autocast.amp(model, compute_dtype=jnp.float16))(w, x)
    with flags_set(flags, False):
        model, _, _ = make_model()
        v0, g0 = jax.value_and_grad(autocast.amp(model, compute_dtype=jnp.float16))(w, x)
    np.testing.assert_allclose(float(v), float(v0), rtol=2e-3)
    assert tree_max_rel_err(g, g0) < 5e-3


def test_custom_rules_receive_values_as_they_arrive(flags):
    """The rebuilt custom_jvp / custom_vjp take half operands (their body and rules run on
    them, as traced jaxprs); the user's ``bwd`` is called on half residuals and cotangents
    with ``custom_vjp_bwd="original"``, and traced in float32 then evaluated on them under
    the policy by default (its ``g * 3.0`` then runs in half precision)."""
    seen: list[str] = []

    @jax.custom_jvp
    def act(x):
        return jnp.maximum(x, 0.0)

    @act.defjvp
    def _act_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return act(x), jnp.where(x > 0, t, 0.1 * t)  # leaky derivative: the rule is used

    @jax.custom_vjp
    def scale_grad(x):
        return x

    def _bwd(res, g):
        seen.extend([str(res.dtype), str(g.dtype)])
        return (g * 3.0,)

    scale_grad.defvjp(lambda x: (x, x), _bwd)

    def f(w, x):
        return jnp.sum(act(scale_grad(x @ w)) @ w)

    w, x = _wx(2)
    amp_f = autocast.amp(f, compute_dtype=jnp.float16)
    custom = [
        str(e.invars[0].aval.dtype)
        for e, _ in _eqns(jax.make_jaxpr(amp_f)(w, x))
        if e.primitive.name in ("custom_jvp_call", "custom_vjp_call")
        or _compat.hi_name(e) in ("CustomJVPTraced", "CustomVJPTraced")
    ]
    assert len(custom) >= 4 and set(custom) == {"float16"}, custom  # two matmuls' own, act, scale_grad
    g = jax.grad(amp_f)(w, x)
    assert seen and set(seen) == {"float32"}, seen  # traced as JAX would
    muls = [e for e, _ in _eqns(jax.make_jaxpr(jax.grad(amp_f))(w, x)) if e.primitive.name == "mul"]
    assert any(str(e.outvars[0].aval.dtype) == "float16" for e in muls), muls  # ... evaluated in half
    g32 = jax.grad(f)(w, x)
    assert tree_max_rel_err(g, g32) < TOL
    seen.clear()
    g = jax.grad(autocast.amp(f, compute_dtype=jnp.float16, custom_vjp_bwd="original"))(w, x)
    assert seen and set(seen) == {"float16"}, seen
    assert tree_max_rel_err(g, g32) < TOL
    ref = jax.grad(lambda w, x: jnp.sum(jax.nn.relu(x @ w) @ w))(w, x)
    assert tree_max_rel_err(g32, ref) > 0.1  # the rules change the gradient


def _residuals(fn, *args):
    return sorted((a.shape, str(a.dtype)) for a, _ in _compat.saved_residuals(fn, *args))


@pytest.mark.parametrize(
    "name", ["relu", "softplus", "mish", "gelu", "softmax", "logsumexp", "checkpoint", "custom_vjp", "custom_jvp"]
)
def test_residuals_are_those_saved_without_flags(flags, name):
    w, x = _wx(3, n=64)
    _, scaled_tanh, clipped = make_model()
    body = {
        "relu": lambda w, x: jax.nn.relu(x @ w) @ w,
        "softplus": lambda w, x: jax.nn.softplus(x @ w) @ w,
        "mish": lambda w, x: jax.nn.mish(x @ w) @ w,
        "gelu": lambda w, x: jax.nn.gelu(x @ w, approximate=False) @ w,
        # islands whose max enters through stop_gradient (jax_remat3 would keep its mask)
        "softmax": lambda w, x: jax.nn.softmax(x @ w) @ w,
        "logsumexp": lambda w, x: jax.nn.logsumexp(x @ w, axis=-1, keepdims=True) - x @ w,
        "checkpoint": lambda w, x: jax.checkpoint(lambda h: jnp.sin(h @ w) @ w)(x),
        "custom_vjp": lambda w, x: clipped(x, w) @ w,
        "custom_jvp": lambda w, x: scaled_tanh(x, w) @ w,
    }[name]

    def f(w, x):
        return jnp.sum(body(w, x) ** 2)

    amp_f = autocast.amp(f, compute_dtype=jnp.float16)
    got = _residuals(amp_f, w, x)
    with flags_set(flags, False):
        _, scaled_tanh, clipped = make_model()
        want = _residuals(autocast.amp(f, compute_dtype=jnp.float16), w, x)
    assert got == want


ACTIVATIONS = {
    name: getattr(jax.nn, name)
    for name in (
        "relu",
        "relu6",
        "sigmoid",
        "softplus",
        "sparse_plus",
        "soft_sign",
        "silu",
        "log_sigmoid",
        "leaky_relu",
        "hard_sigmoid",
        "hard_silu",
        "hard_tanh",
        "elu",
        "celu",
        "selu",
        "gelu",
        "glu",
        "mish",
        "squareplus",
        "log_softmax",
        "softmax",
        "logsumexp",
    )
    if hasattr(jax.nn, name)
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_every_activation_differentiates_under_amp(flags, name):
    act = ACTIVATIONS[name]
    w, x = _wx(4)

    def f(w, x):
        return jnp.sum(jnp.atleast_2d(act(x @ w)) @ w[: jnp.atleast_2d(act(x @ w)).shape[-1]])

    g = jax.grad(autocast.amp(f, compute_dtype=jnp.float16))(w, x)
    assert g.dtype == jnp.float32
    assert tree_max_rel_err(g, jax.grad(f)(w, x)) < 2e-2


def make_sin_remat():
    @jax.custom_vjp
    def sin_remat(a):
        return jnp.sin(a)

    sin_remat.defvjp(lambda a: (jnp.sin(a), jnp.cos(a)), lambda c, g: (2.0 * g * c,), optimize_remat=True)
    return sin_remat


@pytest.mark.skipif("custom_vjp3" not in FLAGS, reason="this JAX has no jax_custom_vjp3")
@pytest.mark.parametrize("remat", [True, "auto", False])
def test_vmap_of_grad_with_an_optimize_remat_custom_vjp(remat):
    """The call sits between float32 operations (an island); vmap of grad works, as without
    amp (not inside a checkpoint: see the next test)."""

    w, x = _wx(5)
    with FLAGS["custom_vjp3"](True):
        sin_remat = make_sin_remat()

        def f(w, x):
            return jnp.sum(jnp.tanh(sin_remat(jnp.sin(x @ w))) @ w.T)

        assert "CustomVJPTraced" in hi_names(f, w, x)
        assert "CustomVJPTraced" in hi_names(autocast.amp(f, compute_dtype=jnp.float16, remat_float32=remat), w, x)
        got = jax.vmap(jax.grad(autocast.amp(f, compute_dtype=jnp.float16, remat_float32=remat)), (None, 0))(
            w, x[:, None]
        )
        ref = jax.vmap(jax.grad(f), in_axes=(None, 0))(w, x[:, None])
    assert got.dtype == jnp.float32 and tree_max_rel_err(got, ref) < TOL


@pytest.mark.skipif("custom_vjp3" not in FLAGS, reason="this JAX has no jax_custom_vjp3")
@pytest.mark.xfail(
    strict=True,
    raises=NotImplementedError,
    reason="JAX: vmap of grad of an optimize_remat custom_vjp inside jax.checkpoint, with jax_custom_vjp3, "
    "raises 'OptRemat must implement batch'",
)
def test_jax_vmap_of_grad_of_a_checkpointed_optimize_remat_custom_vjp():
    w, x = _wx(5)
    with FLAGS["custom_vjp3"](True):
        sin_remat = make_sin_remat()
        f = jax.checkpoint(lambda w, x: jnp.sum(jnp.tanh(sin_remat(x @ w)) @ w.T))
        jax.vmap(jax.grad(f), in_axes=(None, 0))(w, x[:, None])


def test_mutable_refs_keep_their_dtype():
    def f(w, x):
        r = jax.new_ref(jnp.zeros((x.shape[0], w.shape[1])))
        r[...] += x @ w
        r[...] += jnp.sin(x @ w)
        return jnp.sum(r[...])

    w, x = _wx(6)
    amp_f = autocast.amp(f, compute_dtype=jnp.float16)
    refs = [
        str(v.aval)
        for e, _ in _eqns(jax.make_jaxpr(amp_f)(w, x))
        for v in [*e.invars, *e.outvars]
        if _compat.is_ref_aval(getattr(v, "aval", None))
    ]
    assert refs and all("float32" in r for r in refs), refs
    assert set(matmul_operand_dtypes(amp_f, w, x)) == {"float16"}
    v, g = jax.value_and_grad(amp_f)(w, x)
    v32, g32 = jax.value_and_grad(f)(w, x)
    assert abs(float(v) - float(v32)) < TOL * abs(float(v32)) and tree_max_rel_err(g, g32) < TOL


# --- models that checkpoint --------------------------------------------------------------------


def _train(loss, params, batch, steps=5, lr=0.1):
    grad = jax.jit(jax.value_and_grad(loss))
    losses = []
    for _ in range(steps):
        v, g = grad(params, *batch)
        losses.append(float(v))
        params = jax.tree_util.tree_map(lambda p, d: p - lr * d, params, g)
    return losses, g


@pytest.mark.skipif("remat3" not in FLAGS, reason="this JAX has no jax_remat3")
@pytest.mark.parametrize("scanned", [False, True], ids=["remat", "scan_remat"])
def test_flax_remat_model_trains_under_remat3(scanned):
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _=None):
            h = h + nn.Dense(16)(nn.gelu(nn.Dense(16)(h)))
            return (h, None) if scanned else h

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            if scanned:
                h, _ = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=2)()(
                    x, None
                )
            else:
                h = nn.remat(Block)()(nn.remat(Block)()(x))
            return nn.Dense(1)(h)

    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((32, 16), dtype=np.float32))
    y = jnp.asarray(rng.standard_normal((32, 1), dtype=np.float32))
    with FLAGS["remat3"](True):
        net = Net()
        params = net.init(jax.random.key(0), x)

        def loss(p, x, y):
            return jnp.mean((net.apply(p, x) - y) ** 2)

        amp_loss = autocast.amp(loss, compute_dtype=jnp.float16)
        assert "RematTraced" in hi_names(loss, params, x, y)
        dts = matmul_operand_dtypes(jax.grad(amp_loss), params, x, y)
        assert dts and set(dts) == {"float16"}, dts
        losses, g = _train(amp_loss, params, (x, y))
        losses32, g32 = _train(loss, params, (x, y))
    assert losses[-1] < 0.8 * losses[0], losses
    assert tree_max_rel_err(g, g32) < 5e-2
    np.testing.assert_allclose(losses, losses32, rtol=2e-2)


@pytest.mark.skipif("remat3" not in FLAGS, reason="this JAX has no jax_remat3")
def test_equinox_checkpointed_scan_trains_under_remat3():
    import equinox as eqx

    keys = jax.random.split(jax.random.key(1), 3)
    layers = [eqx.nn.Linear(16, 16, key=k) for k in keys]
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((32, 16), dtype=np.float32))
    y = jnp.asarray(rng.standard_normal((32, 16), dtype=np.float32))

    def loss(params, x, y):
        @jax.checkpoint
        def step(h, layer):
            return h + jnp.tanh(jax.vmap(layer)(h)), None

        h, _ = jax.lax.scan(step, x, params)
        return jnp.mean((h - y) ** 2)

    with FLAGS["remat3"](True):
        amp_loss = autocast.amp(loss, compute_dtype=jnp.float16)
        assert "RematTraced" in hi_names(loss, stacked, x, y)
        dts = matmul_operand_dtypes(jax.grad(amp_loss), stacked, x, y)
        assert dts and set(dts) == {"float16"}, dts
        losses, g = _train(amp_loss, stacked, (x, y), lr=0.05)
        losses32, g32 = _train(loss, stacked, (x, y), lr=0.05)
    assert losses[-1] < losses[0], losses
    assert tree_max_rel_err(g, g32) < 5e-2
    np.testing.assert_allclose(losses, losses32, rtol=2e-2)


def test_checkpoint_policy_and_names_are_kept(flags):
    policy = jax.checkpoint_policies.save_only_these_names("pre")

    def f(w, x):
        def block(x):
            h = checkpoint_name(x @ w, "pre")
            return jnp.sin(h) @ w

        return jnp.sum(jax.checkpoint(block, policy=policy)(x) ** 2)

    w, x = _wx(9, n=64)
    amp_f = autocast.amp(f, compute_dtype=jnp.float16)
    jaxpr = jax.make_jaxpr(amp_f)(w, x)
    policies = [
        e.params.get("policy", getattr(_compat.hi_prim(e), "params", {}).get("policy"))
        for e, _ in _eqns(jaxpr)
        if _constructs.remat_parts(e) is not None
    ]
    assert policy in policies, policies
    got = _residuals(amp_f, w, x)
    # the named matmul output is saved, in half precision (what is saved without the flags)
    assert ((64, 8), "float16") in got, got
    with flags_set(flags, False):
        assert _residuals(autocast.amp(f, compute_dtype=jnp.float16), w, x) == got
    g = jax.grad(amp_f)(w, x)
    assert tree_max_rel_err(g, jax.grad(f)(w, x)) < TOL


@pytest.mark.parametrize("extra", [(), tuple(_CONSTRUCTS)], ids=["softmax_custom_jvp", "with_all"])
def test_softmax_custom_jvp_saves_what_the_plain_softmax_saves(extra):
    """``jax_softmax_custom_jvp``: the softmax is a custom JVP whose rule computes in float32;
    it joins the float32 island, so the matmul reading it is recomputed with it and its
    half-precision operand is not kept (as for the plain softmax)."""
    rng = np.random.default_rng(10)
    w = jnp.asarray(rng.standard_normal((32, 64), dtype=np.float32)) / 6
    w2 = jnp.asarray(rng.standard_normal((64, 64), dtype=np.float32)) / 8
    x = jnp.asarray(rng.standard_normal((256, 32), dtype=np.float32))

    def f(w, w2, x):
        return jnp.sum(jnp.tanh(jax.nn.softmax(x @ w, axis=-1) @ w2))

    with FLAGS["softmax_custom_jvp"](False):
        want = _residuals(autocast.amp(f, compute_dtype=jnp.float16), w, w2, x)
    with FLAGS["softmax_custom_jvp"](True), flags_set(extra):
        names = {e.primitive.name for e, _ in _eqns(jax.make_jaxpr(f)(w, w2, x))} | hi_names(f, w, w2, x)
        assert {"custom_jvp_call", "CustomJVPTraced"} & names, names  # the flag is in effect
        amp_f = autocast.amp(f, compute_dtype=jnp.float16)
        got = _residuals(amp_f, w, w2, x)
        g = jax.grad(amp_f, argnums=(0, 1))(w, w2, x)
    assert got == want
    assert tree_max_rel_err(g, jax.grad(f, argnums=(0, 1))(w, w2, x)) < 2e-2


def _relu_operand_dtypes(fn, *args):
    """Operand dtypes of relu's custom JVP calls (old encoding or hijax), in order."""
    out = []
    for e, _ in _eqns(jax.make_jaxpr(fn)(*args)):
        if e.primitive.name == "custom_jvp_call":
            body = _compat.open_and_consts(e.params["call_jaxpr"])[0]
        elif _compat.hi_name(e) == "CustomJVPTraced":
            body = _compat.open_and_consts(_compat.hi_prim(e).traced.jaxpr)[0]
        else:
            continue
        inner = [b.primitive.name for b, _ in _eqns(body)]
        if "max" in inner and "dot_general" not in inner:  # relu, not a matmul's own custom JVP
            out.append(str(e.invars[0].aval.dtype))
    return out


def test_the_planner_sees_through_hijax_bodies(flags):
    """relu after a norm: its custom JVP body passes its input on to a matmul, so the norm's
    float32 result is rounded before the relu (half operand, half residual); a relu whose
    consumer reads float32 joins the norm's island (float32 operand, recomputed)."""
    rng = np.random.default_rng(11)
    w1 = jnp.asarray(rng.standard_normal((16, 64), dtype=np.float32)) / 4
    w2 = jnp.asarray(rng.standard_normal((64, 64), dtype=np.float32)) / 8
    x = jnp.asarray(rng.standard_normal((256, 16), dtype=np.float32))

    def bn(h):
        mu = h.mean(0, keepdims=True)
        return (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(0, keepdims=True) + 1e-5)

    def f(w1, w2, x):
        h = jax.checkpoint(lambda h: jax.nn.relu(bn(h @ w1)) @ w2)(x)
        h = jax.nn.relu(bn(h))
        return jnp.sum(h.mean(0))

    amp_f = autocast.amp(f, compute_dtype=jnp.float16)
    got = _relu_operand_dtypes(amp_f, w1, w2, x)
    res = _residuals(amp_f, w1, w2, x)
    with flags_set(flags, False):
        want = _relu_operand_dtypes(autocast.amp(f, compute_dtype=jnp.float16), w1, w2, x)
        want_res = _residuals(autocast.amp(f, compute_dtype=jnp.float16), w1, w2, x)
    assert got == want == ["float16", "float32"], (got, want)
    assert res == want_res
    assert not [r for r in res if r[0] == (256, 64) and r[1] == "float32"], res


def test_fp8_residuals_in_a_checkpoint_are_exact(flags):
    """A float8 copy that an fp8 matmul keeps reaches its backward pass unchanged inside a
    user's ``jax.checkpoint`` whatever the encodings (with ``jax_remat3`` and
    ``jax_custom_vjp3`` together JAX changes float8 residuals: they are saved as bits)."""
    from autocast import _fp8

    dn = (((1,), (0,)), ((), ()))
    x = jax.random.normal(jax.random.key(0), (24, 32))
    w = jax.random.normal(jax.random.key(1), (32, 16))
    pol = lambda prim, *_, **p: prim.name == "name" and p.get("name") == _compat.SAVED_NAME

    def inner(x, w):
        return _fp8.fp8_dot_general(jnp.tanh(x).astype(jnp.bfloat16), w, dn, jnp.bfloat16).astype(jnp.float32)

    def loss(x, w, ck):
        f = jax.checkpoint(inner, policy=pol) if ck else inner
        return jnp.sum(f(x, w) ** 2)

    plain, ck = (jax.grad(loss, (0, 1))(x, w, c) for c in (False, True))
    for a, b in zip(plain, ck):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
