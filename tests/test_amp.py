"""The amp() wrapper: call forms, pytrees, composability, caching and errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compute_op_dtypes

import autocast
from autocast import amp


def _f(w, x):
    return jnp.tanh(x @ w).sum()


W = jax.random.normal(jax.random.key(0), (4, 4)) / 2
X = jax.random.normal(jax.random.key(1), (3, 4))


def test_call_forms():
    ref = amp(_f)(W, X)

    @amp
    def g(w, x):
        return _f(w, x)

    @amp(compute_dtype="bf16")
    def h(w, x):
        return _f(w, x)

    assert g(W, X) == ref
    assert g.__name__ == "g" and g.__wrapped__ is not None
    assert compute_op_dtypes(h, W, X) == {("dot_general", "bfloat16", False): 1}
    assert compute_op_dtypes(amp(compute_dtype=jnp.float16)(_f), W, X) == {("dot_general", "float16", False): 1}


@pytest.mark.parametrize("spelling", [jnp.float16, np.float16, "float16", "f16", "half", np.dtype("float16")])
def test_compute_dtype_spellings(spelling):
    assert compute_op_dtypes(amp(_f, compute_dtype=spelling), W, X) == {("dot_general", "float16", False): 1}


@pytest.mark.parametrize("bad", [jnp.int8, "float8", "float64", jnp.float64, 3, "int32", object()])
def test_bad_compute_dtype_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"compute_dtype=.*allowed: float16, bfloat16 or float32"):
        amp(_f, compute_dtype=bad)


@pytest.mark.parametrize("bad", [3, "f", None.__class__, [1]])
def test_non_callable_fn_is_a_clear_error(bad):
    if callable(bad):
        bad = 3
    with pytest.raises(TypeError, match="fn must be callable"):
        amp(bad)


def test_kwargs_and_pytrees_and_static_leaves():
    def f(params, x, *, scale, act=jax.nn.relu, name="n"):
        assert isinstance(name, str)
        return {"y": act(x @ params["w"]) * scale, "n": name, "none": None}

    params = {"w": W}
    out = amp(f)(params, X, scale=jnp.float32(2.0), act=jnp.tanh, name="hello")
    ref = f(params, X, scale=jnp.float32(2.0), act=jnp.tanh, name="hello")
    assert out["n"] == "hello" and out["none"] is None
    assert out["y"].dtype == jnp.float32
    np.testing.assert_allclose(out["y"], ref["y"], rtol=1e-2, atol=1e-2)


def test_equinox_module_argument_and_module_as_fn():
    model = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
    out = amp(lambda m, x: jax.vmap(m)(x))(model, X)
    ref = jax.vmap(model)(X)
    assert out.dtype == ref.dtype
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)
    out2 = jax.vmap(amp(model))(X)
    np.testing.assert_allclose(out2, ref, rtol=2e-2, atol=2e-2)


def test_jit_grad_vmap_compose():
    ref_g = jax.grad(_f)(W, X)
    g = jax.jit(jax.grad(amp(_f)))(W, X)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, ref_g, rtol=2e-2, atol=2e-2)
    v = jax.vmap(amp(_f), in_axes=(None, 0))(W, jnp.stack([X, 2 * X]))
    np.testing.assert_allclose(v, jnp.stack([_f(W, X), _f(W, 2 * X)]), rtol=1e-2, atol=3e-3)
    v2 = jax.jit(jax.vmap(jax.grad(amp(_f)), in_axes=(None, 0)))(W, jnp.stack([X, X]))
    np.testing.assert_allclose(v2[0], ref_g, rtol=2e-2, atol=2e-2)


def _conv(k, x):  # an NHWC image batch: the weight gradient is a convolution
    y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(jnp.tanh(y) ** 2)


def _batched_matmul(w, x):  # dot_general with batch dimensions on both operands
    return jnp.sum(jnp.tanh(jnp.einsum("bij,bjk->bik", x, w)) ** 2)


_DERIVATIVE_CASES = {
    "matmul": (_f, W, X),
    "conv": (
        _conv,
        jax.random.normal(jax.random.key(2), (3, 3, 2, 4)) / 4,
        jax.random.normal(jax.random.key(3), (2, 5, 5, 2)),
    ),
    "batched_matmul": (_batched_matmul, jnp.stack([W, W.T]), jnp.stack([X, -X])),
}


@pytest.mark.parametrize("case", list(_DERIVATIVE_CASES))
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_batching_a_derivative_of_amp(dtype, case):
    """Forward-mode Jacobians (``vmap`` of ``jvp``), ``grad`` of ``vmap(amp(f))`` and Hessians
    batch the weight-gradient product amp's derivative makes, in each layout its batching rule
    handles (a matmul, a matmul with batch dimensions, a convolution: the inner primitive's
    own rule). JAX 0.12 removed ``batching.not_mapped``, which that rule read: an
    AttributeError there until 2026-11-27."""
    fn, w, x = _DERIVATIVE_CASES[case]
    f = amp(fn, compute_dtype=dtype)

    def close(a, b):  # relative L2 error: single elements of a convolution's Jacobian cancel
        assert a.dtype == b.dtype == jnp.float32 and a.shape == b.shape
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b), (case, np.linalg.norm(a - b) / np.linalg.norm(b))

    close(jax.jacfwd(f)(w, x), jax.jacfwd(fn)(w, x))
    xs = jnp.stack([x, 2 * x, -x])

    def batched(f):
        return lambda w: jnp.sum(jax.vmap(f, in_axes=(None, 0))(w, xs))

    close(jax.grad(batched(f))(w), jax.grad(batched(fn))(w))
    close(jax.vmap(jax.grad(f), in_axes=(None, 0))(w, xs), jax.vmap(jax.grad(fn), in_axes=(None, 0))(w, xs))
    if case == "matmul":  # second order: forward over reverse
        close(jax.jit(jax.hessian(batched(f)))(w), jax.hessian(batched(fn))(w))


def test_constant_outputs_come_back_as_arrays_of_their_dtype():
    """A constant ``fn`` returns (a literal of its jaxpr: Equinox BatchNorm's ``first_time``
    flag, ``False`` after the first call) comes back as the array ``fn`` returned, also under
    ``grad`` (the jaxpr is evaluated, not compiled, there): not as a Python bool."""
    model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", mode="batch")

    def loss(model, state, x):
        y, state = jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(x, state)
        return jnp.sum(y**2), (state, jnp.int32(3), jnp.float32(0.5))

    (_, ref), _ = eqx.filter_value_and_grad(loss, has_aux=True)(model, state, X)
    for call in (eqx.filter_value_and_grad(amp(loss), has_aux=True), eqx.filter_jit(amp(loss))):
        out = call(model, state, X)
        aux = out[0][1] if isinstance(out[0], tuple) else out[1]
        leaves, ref_leaves = jax.tree.leaves(aux), jax.tree.leaves(ref)
        assert all(isinstance(x, jax.Array) for x in leaves), [type(x) for x in leaves]
        assert [x.dtype for x in leaves] == [x.dtype for x in ref_leaves]
        for x, r in zip(leaves, ref_leaves):  # the statistics: float32 in both (no matmul), fused otherwise
            np.testing.assert_allclose(x, r, rtol=1e-6)


def test_grads_come_back_in_parameter_dtype():
    w16 = W.astype(jnp.bfloat16)
    g = jax.grad(amp(_f))(w16, X)
    assert g.dtype == jnp.bfloat16


def test_amp_of_function_calling_grad():
    def step(w, x):
        g = jax.grad(_f)(w, x)
        return w - 0.1 * g

    out = jax.jit(amp(step))(W, X)
    np.testing.assert_allclose(out, step(W, X), rtol=1e-2, atol=1e-2)
    counts = compute_op_dtypes(amp(step), W, X)
    assert counts[("dot_general", "float32", False)] == 0 and counts[("dot_general", "float16", False)] >= 2


def test_amp_inside_scan_body_and_nested_amp():
    def body(c, x):
        return c + amp(_f)(W, x), None

    out = jax.lax.scan(body, 0.0, jnp.stack([X, X]))[0]
    np.testing.assert_allclose(out, 2 * _f(W, X), rtol=1e-2, atol=3e-3)
    counts = compute_op_dtypes(lambda xs: jax.lax.scan(body, 0.0, xs)[0], jnp.stack([X, X]))
    assert counts == {("dot_general", "float16", False): 1}
    nested = amp(amp(_f))
    assert nested(W, X) == amp(_f)(W, X)
    assert compute_op_dtypes(nested, W, X) == {("dot_general", "float16", False): 1}


def test_same_signature_reuses_trace():
    calls = []

    def f(w, x):
        calls.append(1)
        return _f(w, x)

    g = amp(f)
    g(W, X)
    g(W + 1, X * 2)  # same shapes and dtypes: no retrace
    jax.jit(g)(W, X)  # under jit: abstract values have the same types
    assert len(calls) == 1 and g.trace_count == 1
    g(W, X[:2])  # new shape: traced again
    assert len(calls) == 2


def test_closure_over_outer_tracer_is_not_cached_across_traces():
    def outer(s):
        return amp(lambda w: (w * s).sum())(W)

    g = jax.jit(outer)
    np.testing.assert_allclose(g(2.0), (W * 2).sum(), rtol=1e-3)
    np.testing.assert_allclose(g(3.0), (W * 3).sum(), rtol=1e-3)

    scaled = amp(lambda w, s: (w * s).sum())
    np.testing.assert_allclose(jax.jit(lambda s: scaled(W, s))(2.0), (W * 2).sum(), rtol=1e-3)
    np.testing.assert_allclose(jax.jit(lambda s: scaled(W, s))(5.0), (W * 5).sum(), rtol=1e-3)


def test_rule_returning_wrong_count_is_a_clear_error():
    def bad(compute_dtype, original_dtypes, *invars, **params):
        return invars[:1], params

    with pytest.raises(ValueError, match=r"rule .*bad.* for primitive 'dot_general' returned 1 operands; expected 2"):
        amp(_f, amp_policy=autocast.extend_policy({jax.lax.dot_general_p: bad}))(W, X)


def test_rule_returning_int_for_float_operand_is_a_clear_error():
    def to_int(compute_dtype, original_dtypes, *invars, **params):
        return [x.astype(jnp.int32) for x in invars], params

    with pytest.raises(
        TypeError, match=r"rule .*to_int.* for primitive 'tanh' returned dtype int32 for operand 0, a floating operand"
    ):
        amp(_f, amp_policy=autocast.extend_policy({jax.lax.tanh_p: to_int}))(W, X)


def test_rule_changing_an_integer_operand_is_a_clear_error():
    def cast_all(compute_dtype, original_dtypes, *invars, **params):
        return [x.astype(jnp.float32) for x in invars], params

    def f(n):
        return n + 1

    with pytest.raises(TypeError, match=r"changed operand 0 from int32 to float32"):
        amp(f, amp_policy=autocast.extend_policy({jax.lax.add_p: cast_all}))(jnp.arange(3))


def test_rule_returning_non_pair_is_a_clear_error():
    with pytest.raises(TypeError, match=r"returned NoneType; expected the pair \(operands, params\)"):
        amp(_f, amp_policy={jax.lax.tanh_p: lambda *a, **k: None})(W, X)


@pytest.mark.parametrize("prim", [jax.lax.tanh_p, jax.lax.dot_general_p], ids=["one_operand", "two_operands"])
def test_rule_returning_operands_alone_says_what_was_expected(prim):
    """A rule that returns its operands without the params (one operand or two: a pair of
    arrays looks like ``(operands, params)`` at first sight) names what it returned."""

    def operands_only(compute_dtype, original_dtypes, *invars, **params):
        return tuple(x.astype(compute_dtype) for x in invars)

    with pytest.raises(TypeError, match=r"it looks like the operands alone\); expected the pair \(operands, params\)"):
        amp(_f, amp_policy={prim: operands_only})(W, X)


@pytest.mark.parametrize("bad_key", [3, jnp.tanh, ("dot_general",)])
def test_bad_policy_key_is_a_clear_error(bad_key):
    with pytest.raises(TypeError, match="neither a jax Primitive nor a named-scope string"):
        amp(_f, amp_policy={bad_key: autocast.use_float32_precision})


def test_bad_policy_value_is_a_clear_error():
    with pytest.raises(TypeError, match=r"amp_policy\['exp'\] = 'float32' is not callable"):
        amp(_f, amp_policy={jax.lax.exp_p: "float32"})
    with pytest.raises(TypeError, match="must be a mapping"):
        amp(_f, amp_policy=[autocast.use_float32_precision])
    # a table's name: the error says how to load it
    with pytest.raises(TypeError, match=r"amp_policy='fp8': .* autocast.load_policy\('fp8'\)"):
        amp(_f, amp_policy="fp8")
    assert compute_op_dtypes(amp(_f, compute_dtype="bf16", amp_policy=autocast.load_policy("fp8")), W, X)
