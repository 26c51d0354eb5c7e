"""What runs in which dtype: read the transformed jaxpr and check each equation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compute_op_dtypes, operand_dtypes, walk

import autocast
from autocast import amp, amp_stop

HALF = [jnp.float16, jnp.bfloat16]


def _eqns(fn, *args):
    return list(walk(jax.make_jaxpr(fn)(*args)))


def _mlp(params, x):
    for w, b in params[:-1]:
        x = jax.nn.gelu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def _params(key, sizes=(8, 16, 16, 4)):
    keys = jax.random.split(key, len(sizes))
    return [(jax.random.normal(k, (m, n)) / np.sqrt(m), jnp.zeros(n)) for k, m, n in zip(keys, sizes[:-1], sizes[1:])]


@pytest.mark.parametrize("dtype", HALF)
def test_matmuls_and_convs_run_in_compute_dtype(dtype):
    def f(w, k, x, img):
        y = x @ w
        z = jax.lax.conv_general_dilated(img, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        # results returned (or read by matmuls) stay half; a result that only float32
        # operations read is stored in float32 instead (tests/test_wide_matmuls.py)
        return jnp.einsum("bi,ij->bj", y, w), z, jnp.dot(y, w.T)

    args = (jnp.ones((4, 4)), jnp.ones((3, 3, 2, 2)), jnp.ones((2, 4)), jnp.ones((1, 5, 5, 2)))
    counts = compute_op_dtypes(amp(f, compute_dtype=dtype), *args)
    assert counts == {
        ("dot_general", np.dtype(dtype).name, False): 3,
        ("conv_general_dilated", np.dtype(dtype).name, False): 1,
    }
    for eqn, _ in _eqns(amp(f, compute_dtype=dtype), *args):
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            assert set(operand_dtypes(eqn)) == {np.dtype(dtype).name}
            assert eqn.params["preferred_element_type"] in (None, np.dtype(dtype))
            assert str(eqn.outvars[0].aval.dtype) == np.dtype(dtype).name


def test_float32_list_runs_in_float32():
    def f(x, w):
        h = x @ w  # float16
        return (
            jnp.exp(h).sum()
            + jnp.log1p(jnp.abs(h)).sum()
            + jax.lax.rsqrt(h * h + 1).sum()
            + (h**3).sum()
            + jax.scipy.special.erf(h).sum()
            + jnp.cumsum(h, axis=0).sum()
            + jnp.prod(h[:1], axis=1).sum()
            + jax.nn.logsumexp(h)
        )

    checked = set()
    for eqn, _ in _eqns(amp(f), jnp.ones((4, 4)), jnp.ones((4, 4))):
        name = eqn.primitive.name
        if name in ("exp", "log1p", "rsqrt", "integer_pow", "erf", "cumsum", "reduce_prod", "reduce_sum", "log"):
            assert set(operand_dtypes(eqn)) == {"float32"}, (name, operand_dtypes(eqn))
            assert all(str(v.aval.dtype) == "float32" for v in eqn.outvars)
            checked.add(name)
    assert {"exp", "log1p", "rsqrt", "integer_pow", "erf", "cumsum", "reduce_prod", "reduce_sum", "log"} <= checked


def test_activations_stay_half_between_matmuls():
    """x@w1 + b1 -> relu -> @w2: the bias add and the relu run in half precision and the
    second matmul's input is not converted (no bounce through float32)."""

    def f(w1, b1, w2, x):
        h = jnp.maximum(x @ w1 + b1, 0.0) * 0.5
        return h @ w2

    eqns = [e for e, _ in _eqns(amp(f), jnp.ones((4, 8)), jnp.zeros(8), jnp.ones((8, 2)), jnp.ones((3, 4)))]
    by_name = {}
    for e in eqns:
        by_name.setdefault(e.primitive.name, []).append(e)
    assert all(operand_dtypes(e) == ("float16", "float16") for e in by_name["add"])
    assert all(operand_dtypes(e) == ("float16", "float16") for e in by_name["max"])
    assert all(operand_dtypes(e) == ("float16", "float16") for e in by_name["mul"])
    # converts: x, w1, b1 (param, to half), w2 (to half), output back to float32: nothing else
    converts = [e for e in eqns if e.primitive.name == "convert_element_type"]
    assert len(converts) == 5, [(operand_dtypes(e), e.params["new_dtype"]) for e in converts]


def test_scalar_constants_do_not_upcast_half_tensors():
    def f(x, w):
        h = x @ w
        return (h / np.sqrt(8.0) + 0.5 * h - 1.0) @ w  # feeds a matmul: stays half

    for eqn, _ in _eqns(amp(f), jnp.ones((2, 8)), jnp.ones((8, 8))):
        if eqn.primitive.name in ("div", "mul", "sub", "add"):
            assert operand_dtypes(eqn) in (("float16", "float16"),), (eqn.primitive.name, operand_dtypes(eqn))


def test_elementwise_ops_consumed_only_in_float32_run_in_float32():
    """softmax(x @ w): the shift x - max(x) feeds only exp (float32), so it is computed from
    the half-precision logits in float32 rather than rounded to half first."""

    def f(x, w):
        return jax.nn.softmax((x @ w) @ w, axis=-1) @ w

    subs = [e for e, _ in _eqns(amp(f), jnp.ones((2, 8)), jnp.ones((8, 8))) if e.primitive.name == "sub"]
    assert [operand_dtypes(e) for e in subs] == [("float32", "float32")]
    dots = [e for e, _ in _eqns(amp(f), jnp.ones((2, 8)), jnp.ones((8, 8))) if e.primitive.name == "dot_general"]
    assert all(operand_dtypes(e) == ("float16", "float16") for e in dots)


def test_computed_float32_statistic_is_not_rounded_to_half():
    """layer norm: x - mean(x) mixes a half activation with a float32 statistic: float32."""

    def f(x, w):
        h = x @ w
        mu = jnp.mean(h, axis=-1, keepdims=True)
        return (h - mu) * jax.lax.rsqrt(jnp.var(h, axis=-1, keepdims=True) + 1e-5)

    subs = [e for e, _ in _eqns(amp(f), jnp.ones((2, 8)), jnp.ones((8, 8))) if e.primitive.name == "sub"]
    assert subs and all(operand_dtypes(e) == ("float32", "float32") for e in subs)


def test_amp_stop_keeps_traced_precision_everywhere_inside():
    def f(w, x):
        y = x @ w
        with amp_stop():
            z = jax.jit(lambda a: a @ w)(y)
            z = jax.lax.scan(lambda c, _: (c @ w, None), z, None, length=2)[0]
            z = jnp.exp(z) @ w
        return (z @ w).sum()

    n_half = n_stop = 0
    for eqn, scopes in _eqns(amp(f), jnp.ones((4, 4)), jnp.ones((2, 4))):
        if "amp_stop" in scopes and eqn.primitive.name not in ("convert_element_type",):
            assert all(d in ("float32", "int32", "bool") for d in operand_dtypes(eqn)), (
                eqn.primitive,
                operand_dtypes(eqn),
            )
            n_stop += eqn.primitive.name == "dot_general"
        elif eqn.primitive.name == "dot_general":
            assert operand_dtypes(eqn) == ("float16", "float16")
            n_half += 1
    assert n_half == 2 and n_stop == 3


def test_amp_stop_decorator_and_around_a_call():
    @amp_stop
    def precise(w, x):
        return x @ w

    def f(w, x):
        return precise(w, x @ w).sum()

    counts = compute_op_dtypes(amp(f), jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert counts == {("dot_general", "float16", False): 1, ("dot_general", "float32", True): 1}
    assert precise.__name__ == "precise"


def test_amp_stop_in_caller_scope_applies_to_whole_call():
    f = amp(lambda w, x: (x @ w).sum())

    def outer(w, x):
        with amp_stop():
            return f(w, x)

    counts = compute_op_dtypes(outer, jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert counts == {("dot_general", "float32", True): 1}


def test_integer_bool_and_key_values_are_bit_identical():
    def f(x, n, mask, key):
        y = x @ x.T
        idx = jnp.argsort(y[0])
        r = jax.random.uniform(key, (3,))
        k2 = jax.random.split(key)[0]
        return y.sum(), n * 3 + idx.sum(), jnp.logical_not(mask), jax.random.key_data(k2), n.astype(jnp.float32) * 2, r

    args = (
        jnp.arange(9.0).reshape(3, 3) / 7,
        jnp.array([1, 2, 3], jnp.int32),
        jnp.array([True, False]),
        jax.random.key(3),
    )
    ref = f(*args)
    out = amp(f)(*args)
    for r, o in zip(ref[1:4], out[1:4]):
        assert r.dtype == o.dtype and np.array_equal(np.asarray(r), np.asarray(o))
    np.testing.assert_array_equal(ref[5], out[5])  # uniform samples: the same bits
    for eqn, _ in _eqns(amp(f), *args):
        if eqn.primitive.name == "convert_element_type":
            src = str(eqn.invars[0].aval.dtype)
            assert src in ("float16", "float32", "int32", "uint32"), src


def test_float64_and_complex_are_never_cast():
    with jax.enable_x64(True):
        x64 = jnp.ones((3, 3), jnp.float64)
        c = jnp.ones((3, 3), jnp.complex64)

        def f(a, c):
            return (a @ a).sum(), (c @ c).sum(), jnp.exp(a).sum()

        out = amp(f)(x64, c)
        assert [o.dtype for o in out] == [jnp.float64, jnp.complex64, jnp.float64]
        for eqn, _ in _eqns(amp(f), x64, c):
            assert "float16" not in operand_dtypes(eqn)


def test_outputs_come_back_in_traced_dtypes():
    def f(x, w):
        return {"h": x @ w, "s": jnp.sum(x), "i": jnp.argmax(x)}, [x.astype(jnp.bfloat16)]

    out = amp(f)(jnp.ones((2, 3)), jnp.ones((3, 3)))
    ref = f(jnp.ones((2, 3)), jnp.ones((3, 3)))
    assert jax.tree_util.tree_map(lambda a: a.dtype, out) == jax.tree_util.tree_map(lambda a: a.dtype, ref)


def test_named_scope_rule_outermost_wins():
    def f(w, x):
        with jax.named_scope("block"):
            y = x @ w
            with jax.named_scope("inner"):
                y = y @ w
        return (y @ w).sum()

    policy = autocast.extend_policy({"block": autocast.use_float32_precision, "inner": autocast.use_compute_precision})
    counts = compute_op_dtypes(amp(f, amp_policy=policy), jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert counts == {("dot_general", "float32", False): 2, ("dot_general", "float16", False): 1}


def test_named_scope_rule_reaches_inside_jit_and_glob_patterns():
    def f(w, x):
        with jax.named_scope("attention_0"):
            y = jax.jit(lambda a: a @ w)(x)
        return (y @ w).sum()

    policy = autocast.extend_policy({"attention_*": autocast.use_precision("bfloat16")})
    counts = compute_op_dtypes(amp(f, amp_policy=policy), jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert counts == {("dot_general", "bfloat16", False): 1, ("dot_general", "float16", False): 1}


def test_custom_derivative_rules_run_their_matmuls_in_half_under_grad():
    """Under jax.grad, JAX runs the custom_vjp forward rule (not the body) and the
    custom_jvp JVP rule: both are transformed, so their matmuls are half precision. The
    custom_vjp backward function runs under the policy too (half matmuls; as written, in
    float32, with ``custom_vjp_bwd="original"``), and the user's rules are used."""

    @jax.custom_vjp
    def layer(w, x):
        return jnp.tanh(x @ w)

    def fwd(w, x):
        y = jnp.tanh(x @ w)
        return y, (w, x, y)

    def bwd(res, g):
        w, x, y = res
        gy = g * (1 - y**2)
        return jnp.clip(x.T @ gy, -0.01, 0.01), gy @ w.T  # clipped: not the true gradient

    layer.defvjp(fwd, bwd)

    @jax.custom_jvp
    def gram(x):
        return x @ x.T

    gram.defjvp(lambda p, t: (p[0] @ p[0].T, 3.0 * (t[0] @ p[0].T)))  # x3: not the true JVP

    def f(w, x):
        return jnp.sum(layer(w, x)) + jnp.sum(gram(x @ w))

    w = jax.random.normal(jax.random.key(0), (4, 4))
    x = jax.random.normal(jax.random.key(1), (3, 4))
    by_scope = compute_op_dtypes(jax.grad(amp(f)), w, x)
    assert by_scope[("dot_general", "float32", False)] == 0  # the user's bwd under the policy too
    assert by_scope[("dot_general", "float16", False)] >= 6  # fwd rule, bwd, gram's JVP rule, its transposes
    as_written = amp(f, custom_vjp_bwd="original")
    by_scope = compute_op_dtypes(jax.grad(as_written), w, x)
    assert by_scope[("dot_general", "float32", False)] == 2  # the two matmuls of the user's bwd
    g_ref = jax.grad(f)(w, x)
    for fn in (amp(f), as_written):
        g = jax.grad(fn)(w, x)
        np.testing.assert_allclose(g, g_ref, rtol=2e-2, atol=5e-2 * float(jnp.abs(g_ref).max()))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mode", ["add", "mul", "min", "max", "set"])
def test_scatter_family_follows_half_operands_and_matches_float32(dtype, mode):
    """The scatters that select (min, max, set) run on half-precision activations (their
    combiner jaxpr retyped to the operand's dtype); those that accumulate (add, mul: many
    updates combined into one element) run in float32 (tests/test_accumulation.py). Every
    variant agrees with float32, forward and backward."""

    def f(w, x, idx):
        h = x @ w  # half under amp
        base = jnp.ones((6, h.shape[1]))
        at = base.at[idx]
        out = at.mul(h, unique_indices=True) if mode == "mul" else getattr(at, mode)(h)
        return jnp.tanh(out @ w.T).sum()  # consumed by a matmul: the scatter stays half

    w = jax.random.normal(jax.random.PRNGKey(0), (4, 3))
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    idx = jnp.array([0, 1, 1, 3, 5]) if mode != "mul" else jnp.array([0, 1, 2, 3, 5])  # mul: grads need unique indices
    scatters = [e for e, _ in _eqns(amp(f, compute_dtype=dtype), w, x, idx) if e.primitive.name.startswith("scatter")]
    runs_in = "float32" if mode in ("add", "mul") else jnp.dtype(dtype).name
    assert scatters and all(operand_dtypes(e)[0] == runs_in for e in scatters), [operand_dtypes(e) for e in scatters]
    assert all(operand_dtypes(e)[1] == "int32" for e in scatters)  # indices untouched
    ref, got = f(w, x, idx), amp(f, compute_dtype=dtype)(w, x, idx)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, rtol=3e-2)
    g_ref = jax.grad(f)(w, x, idx)
    g = jax.grad(amp(f, compute_dtype=dtype))(w, x, idx)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, g_ref, rtol=5e-2, atol=5e-2 * float(jnp.abs(g_ref).max()))
