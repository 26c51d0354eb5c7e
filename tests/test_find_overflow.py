"""autocast.find_overflow: planted overflows/underflows are found at their exact line,
with the right primitive, earliest first; healthy models give no finding."""

from __future__ import annotations

import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autocast


def line_of(marker: str) -> int:
    """The line of this file that carries ``# PLANT:<marker>`` (computed, not hard-coded)."""
    lines, start = inspect.getsourcelines(inspect.getmodule(line_of))
    hits = [(start or 1) + i for i, text in enumerate(lines) if text.rstrip().endswith(f"# PLANT:{marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def at(finding) -> tuple[str, int]:
    file, line = finding.source.rsplit(":", 1)
    return os.path.abspath(file), int(line)


HERE = os.path.abspath(__file__)


# --- planted models ---------------------------------------------------------------------


def square_model(w, x):
    h = jnp.tanh(x @ w) * 300.0
    h = h * h  # PLANT:square
    return jnp.mean(h)


def exp_model(w, x):
    logits = x @ w
    p = jnp.exp(logits)  # PLANT:exp
    return jnp.mean(p)


def exp_matmul_model(w, x, v):
    logits = x @ w
    out = jnp.exp(logits) @ v  # PLANT:exp_matmul
    return jnp.mean(out)


def sum_model(w, x):
    h = x @ w  # PLANT:sum
    return jnp.mean(h)


def scan_model(w, xs):
    def body(carry, x):
        h = x @ w
        y = h * h  # PLANT:scan
        return carry + 1.0, y

    _, ys = jax.lax.scan(body, 0.0, xs)
    return jnp.mean(ys)


@jax.jit
def _inner(h):
    return h * h * h  # PLANT:jit


def jit_model(w, x):
    return jnp.mean(_inner(x @ w))


def tiny_grad_model(w, x):
    h = jnp.tanh(x @ w)
    return 1e-9 * jnp.sum(h)  # PLANT:grad


def two_plants(w, x):
    h = x @ w
    a = (h * h) @ w  # PLANT:first
    c = jnp.tanh(x @ w) * 300.0
    d = (c * c) @ w  # PLANT:second
    return jnp.mean(a) + jnp.mean(d)


W = jnp.full((8, 8), 0.5)
X = jnp.full((4, 8), 2.0)


def check_planted(findings, marker: str, primitive: str, kind: str = "overflow"):
    assert findings, f"nothing found for {marker}"
    first = findings[0]
    assert first.primitive == primitive
    assert first.kind == kind
    assert at(first) == (HERE, line_of(marker)), first.source
    return first


def test_large_square_overflows_at_its_line():
    # The plant is real: float32 is finite, amp gives inf.
    assert np.isfinite(square_model(W, X))
    assert not np.isfinite(autocast.amp(square_model)(W, X))
    findings = autocast.find_overflow(square_model)(W, X)
    f = check_planted(findings, "square", "mul")
    assert f.dtype == "float16" and f.count == X.shape[0] * W.shape[1]
    assert np.isinf(f.half_range[1]) and np.isfinite(f.float32_range[1]) and f.float32_range[1] > 65504
    assert "amp_stop" in f.suggestion and "mul_p" in f.suggestion
    assert len(findings) == 1  # the inf is not reported again downstream
    assert "overflow in mul at" in str(findings)


def test_exp_of_large_logit_in_half():
    # A policy that runs exp in half precision: exp itself overflows.
    policy = autocast.extend_policy({jax.lax.exp_p: autocast.use_input_precision})
    w = jnp.full((8, 8), 1.5)
    assert np.isfinite(exp_model(w, X))
    findings = autocast.find_overflow(exp_model, amp_policy=policy)(w, X)
    check_planted(findings, "exp", "exp")
    # The default policy runs exp in float32: no overflow there.
    assert autocast.find_overflow(exp_model)(w, X) == []


def test_exp_result_cast_to_half_for_a_matmul():
    # Default policy: exp in float32 is finite; amp casts it to float16 for the matmul.
    w = jnp.full((8, 8), 1.5)
    v = jnp.full((8, 2), 1e-3)
    assert np.isfinite(exp_matmul_model(w, X, v))
    findings = autocast.find_overflow(exp_matmul_model)(w, X, v)
    f = check_planted(findings, "exp_matmul", "convert_element_type")
    assert "consumer" in f.suggestion


def test_sum_of_many_large_values_in_a_matmul():
    w = jnp.full((256, 4), 30.0)
    x = jnp.full((2, 256), 10.0)  # 256 * 300 = 76800 > 65504
    assert np.isfinite(sum_model(w, x))
    check_planted(autocast.find_overflow(sum_model)(w, x), "sum", "dot_general")


def test_overflow_inside_a_scan_body():
    xs = jnp.full((3, 4, 8), 2.0).at[2].set(40.0)  # only the last step overflows
    findings = autocast.find_overflow(scan_model)(W * 10, xs)
    f = check_planted(findings, "scan", "mul")
    assert f.path == ("scan(3)",)


def test_overflow_inside_a_nested_jit():
    findings = autocast.find_overflow(jit_model)(W * 6, X)
    f = check_planted(findings, "jit", "mul")
    assert f.path == ("jit(_inner)",)


def test_gradient_underflow_needs_loss_scaling():
    w = jnp.full((8, 8), 0.05)
    g32 = jax.grad(tiny_grad_model)(w, X)
    g16 = jax.grad(autocast.amp(tiny_grad_model))(w, X)
    assert np.all(np.asarray(g32) != 0) and np.all(np.asarray(g16) == 0)  # the plant is real
    assert autocast.find_overflow(tiny_grad_model)(w, X) == []  # the forward pass is fine
    findings = autocast.find_overflow(tiny_grad_model, grad=True, scale=1.0)(w, X)
    f = check_planted(findings, "grad", findings[0].primitive, kind="underflow")
    assert f.backward and "loss scaling" in f.suggestion
    assert f.half_range == (0.0, 0.0) and f.float32_range[1] > 0
    # At the default scale 2**15 the scaled gradient is representable.
    assert autocast.find_overflow(tiny_grad_model, grad=True)(w, X) == []


def test_scaled_gradient_overflow():
    w = jnp.full((8, 8), 0.05)
    findings = autocast.find_overflow(lambda w, x: jnp.mean(x @ w), grad=True, scale=2.0**40)(w, X)
    assert findings and findings[0].kind == "overflow" and findings[0].backward
    assert "lower the loss scale" in findings[0].suggestion


def test_earliest_first():
    findings = autocast.find_overflow(two_plants)(W * 40, X)
    assert [at(f)[1] for f in findings] == [line_of("first"), line_of("second")]
    assert [f.primitive for f in findings] == ["mul", "mul"]


def _mlp(params, x):
    for w, b in params[:-1]:
        x = jax.nn.gelu(x @ w + b)
    w, b = params[-1]
    return jax.nn.log_softmax(x @ w + b)


def test_healthy_mlp_has_no_findings():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    sizes = [16, 32, 32, 10]
    params = [(jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros(b)) for k, a, b in zip(keys, sizes, sizes[1:])]
    x = jax.random.normal(keys[3], (8, 16))
    assert autocast.find_overflow(lambda p, x: _mlp(p, x))(params, x) == []
    loss = lambda p, x: -jnp.mean(_mlp(p, x)[:, 0])
    assert autocast.find_overflow(loss, grad=True)(params, x) == []


def test_healthy_vit_has_no_findings():
    from benchmarks.models.vit import ViT, ViTConfig, loss_fn, synthetic_batch

    cfg = ViTConfig(image_size=8, channels=3, patch=4, width=32, mlp_hidden=64, depth=2, heads=4, classes=10)
    model = ViT(cfg, key=jax.random.PRNGKey(0))
    x, y = synthetic_batch(cfg, 2, key=jax.random.PRNGKey(1))
    loss = lambda m, x, y: loss_fn(m, x, y)[0]
    found = autocast.find_overflow(loss)(model, x, y)
    assert found == [], str(found)
    assert "no overflow" in str(found)


def test_bad_input():
    with pytest.raises(TypeError, match="fn must be callable"):
        autocast.find_overflow(3)
    with pytest.raises(ValueError, match="compute_dtype"):
        autocast.find_overflow(square_model, compute_dtype="int8")
    with pytest.raises(ValueError, match="scalar float loss"):
        autocast.find_overflow(lambda w, x: x @ w, grad=True)(W, X)
    with pytest.raises(ValueError, match="scale"):
        autocast.find_overflow(square_model, grad=True, scale=0.0)
    with pytest.raises(TypeError, match="grad"):
        autocast.find_overflow(square_model, grad="yes")


# --- every option of amp takes effect ---------------------------------------------------


def sum_of_products(w, x):
    return jnp.sum(x @ w)  # PLANT:weight_grad


def test_weight_grad_dtype_compute_checks_the_weight_gradient_in_half():
    """dW = x^T . dy sums 8 rows of 1 x 32768 (the loss scale): 262144, beyond float16.
    Under ``weight_grad_dtype="compute"`` that matmul writes float16 and overflows; under
    ``"float32"`` (the default) it writes float32 and nothing breaks."""
    w, x = jnp.full((4, 4), 0.01), jnp.ones((8, 4))
    assert autocast.find_overflow(sum_of_products, grad=True)(w, x) == []
    findings = autocast.find_overflow(sum_of_products, grad=True, weight_grad_dtype="compute")(w, x)
    first = check_planted(findings, "weight_grad", "dot_general")
    assert first.backward and first.float32_range == (262144.0, 262144.0) and first.path == ()


@jax.custom_vjp
def _product(x, w):
    return x @ w


def _product_fwd(x, w):
    return x @ w, (x, w)


def _product_bwd(res, g):
    x, w = res
    return g @ w.T, x.T @ g


_product.defvjp(_product_fwd, _product_bwd)


def test_custom_vjp_bwd_amp_checks_the_backward_rule_in_half():
    """Under ``custom_vjp_bwd="amp"`` the rule's ``x.T @ g`` runs in float16 and its sum of
    8 x 32768 overflows (found in the backward pass; ``g @ w.T``, 1311, does not); as written
    it reads the float32 residual ``x`` and writes float32."""
    w, x = jnp.full((4, 4), 0.01), jnp.ones((8, 4))

    def loss(w, x):
        return jnp.sum(_product(x, w))

    (found,) = autocast.find_overflow(loss, grad=True)(w, x)
    assert (found.primitive, found.kind, found.backward) == ("dot_general", "overflow", True)
    assert found.float32_range == (262144.0, 262144.0) and found.count == 16
    assert autocast.find_overflow(loss, grad=True, custom_vjp_bwd="original")(w, x) == []


def test_remat_float32_changes_the_program_checked():
    """With every float32 island recomputed the backward pass evaluates the islands again:
    more equations are checked than with none recomputed (and none breaks)."""

    def mlp(w1, w2, x):
        return jnp.sum(jax.nn.log_softmax(jax.nn.gelu(x @ w1) @ w2))

    args = (jnp.ones((16, 32)) * 0.1, jnp.ones((32, 8)) * 0.1, jnp.ones((4, 16)))
    checked = {}
    for remat in (True, False):
        findings = autocast.find_overflow(mlp, grad=True, remat_float32=remat)(*args)
        assert findings == [], remat
        checked[remat] = findings.checked
    assert checked[True] > checked[False] > 0
