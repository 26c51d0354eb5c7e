"""autocast.explain: what runs in which dtype and why, float32 matmuls with their source
lines, and totals checked against independent accounting (jaxpr walks, JAX's residuals)."""

from __future__ import annotations

import inspect
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autocast

HERE = os.path.abspath(__file__)


def line_of(marker: str) -> int:
    lines, start = inspect.getsourcelines(inspect.getmodule(line_of))
    hits = [(start or 1) + i for i, text in enumerate(lines) if text.rstrip().endswith(f"# LINE:{marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def at(source: str) -> tuple[str, int]:
    file, line = source.rsplit(":", 1)
    return os.path.abspath(file), int(line)


def stop_model(params, x):
    w1, w2, w3, w4 = params
    h = jnp.tanh(x @ w1)
    with autocast.amp_stop():
        h = jnp.tanh(h @ w2)  # LINE:stop_a
        h = h @ w3  # LINE:stop_b
    return jnp.mean(jax.nn.softmax(h @ w4))


PARAMS = [jnp.ones((8, 16)) * 0.1, jnp.ones((16, 16)) * 0.1, jnp.ones((16, 16)) * 0.1, jnp.ones((16, 4)) * 0.1]
X = jnp.ones((4, 8))


def test_amp_stop_region_lists_exactly_its_matmuls():
    report = autocast.explain(stop_model)(PARAMS, X)
    got = [(m.primitive, at(m.source), m.reason, m.dtype) for m in report.float32_matmuls]
    assert got == [
        ("dot_general", (HERE, line_of("stop_a")), "amp_stop", "f32×2"),
        ("dot_general", (HERE, line_of("stop_b")), "amp_stop", "f32×2"),
    ]
    assert all("amp_stop" in m.scopes for m in report.float32_matmuls)
    assert report.float32_matmuls[0].shape == ((4, 16), (16, 16))
    # FLOPs: the two stopped matmuls in float32, the others in float16; the float32
    # original has all of them in float32 (2*M*N*K each).
    flops = report.totals["matmul_flops"]
    assert flops["amp"] == {"float16": 2 * 4 * 8 * 16 + 2 * 4 * 16 * 4, "float32": 2 * (2 * 4 * 16 * 16)}
    assert flops["float32"] == {"float32": sum(flops["amp"].values())}


def _matmul_operand_dtypes(fn, *args):
    """(lhs dtype) of every dot_general at any depth of make_jaxpr(fn), independent of explain."""
    from tests.helpers import walk

    return [
        str(e.invars[0].aval.dtype) for e, _ in walk(jax.make_jaxpr(fn)(*args)) if e.primitive.name == "dot_general"
    ]


def test_nested_bodies_show_their_path_and_count():
    def step(w, x):
        return jnp.tanh(x @ w)

    @jax.jit
    def block(w, xs):
        def body(c, x):
            return c, step(w, x)

        return jax.lax.scan(body, 0.0, xs)[1]

    def model(w, xs):
        with autocast.amp_stop():
            y = block(w, xs)  # LINE:nested
        return jnp.sum(y)

    w, xs = jnp.ones((8, 8)) * 0.1, jnp.ones((5, 4, 8))
    report = autocast.explain(model)(w, xs)
    (m,) = report.float32_matmuls
    assert m.path == ("jit(block)", "scan(5)")
    src_file, src_line = at(m.source)
    assert src_file == HERE and src_line == inspect.getsourcelines(step)[1] + 1
    rows = [r for r in report.rows if r["primitive"] == "dot_general"]
    assert len(rows) == 1 and rows[0]["count"] == 5 and rows[0]["nesting"] == "jit(block) > scan(5)"
    assert report.totals["matmul_flops"]["amp"] == {"float32": 5 * 2 * 4 * 8 * 8}
    # Without amp_stop the matmul runs in float16, and the transformed jaxpr agrees.
    report16 = autocast.explain(lambda w, xs: jnp.sum(block(w, xs)))(w, xs)
    assert report16.float32_matmuls == []
    assert _matmul_operand_dtypes(autocast.amp(lambda w, xs: jnp.sum(block(w, xs))), w, xs) == ["float16"]


def test_reasons():
    def model(w, x):
        with jax.named_scope("head"):
            h = x @ w
        return jnp.sum(jax.nn.log_softmax(h))

    w, x = jnp.ones((8, 4)), jnp.ones((2, 8))
    policy = autocast.extend_policy({"head": autocast.use_float32_precision})
    report = autocast.explain(model, amp_policy=policy)(w, x)
    (m,) = report.float32_matmuls
    assert m.reason.split(";")[0] == "scope 'head'" and m.scopes == ("head",)
    whys = {(r["primitive"], r["why"].split(";")[0]) for r in autocast.explain(model)(w, x).rows}
    assert ("dot_general", "primitive table") in whys
    assert ("exp", "primitive table") in whys
    assert ("sub", "pulled to float32 by its consumers") in whys  # x - max(x) feeds exp
    # A registered rule for a primitive the table names.
    autocast.register_rule(jax.lax.tanh_p, autocast.use_float32_precision)
    try:
        rows = autocast.explain(lambda x: jnp.tanh(x @ x))(jnp.ones((4, 4))).rows
        assert [r["why"].split(";")[0] for r in rows if r["primitive"] == "tanh"] == ["registered rule"]
    finally:
        autocast.unregister_rule(jax.lax.tanh_p)
    # A plain-dict policy without a default: the fallback.
    rows = autocast.explain(
        lambda x: jnp.sin(x @ x), amp_policy={jax.lax.dot_general_p: autocast.use_compute_precision}
    )(jnp.ones((4, 4))).rows
    assert [(r["why"].split(";")[0], r["rule"]) for r in rows if r["primitive"] == "sin"] == [("fallback", "original")]


def _residual_bytes(fn, *args) -> dict[str, int]:
    """Bytes saved for the backward pass, by dtype, read independently from the jaxpr of
    ``jax.vjp`` (residuals that are neither the function's inputs nor constants)."""

    def residuals(*a):
        return jax.tree_util.tree_leaves(jax.vjp(fn, *a)[1])

    closed = jax.make_jaxpr(residuals)(*args)
    invars, constvars = set(closed.jaxpr.invars), set(closed.jaxpr.constvars)
    out: dict[str, int] = {}
    for v in closed.jaxpr.outvars:
        if isinstance(v, jax.extend.core.Literal) or v in invars or v in constvars:
            continue
        out[str(v.aval.dtype)] = out.get(str(v.aval.dtype), 0) + int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
    return out


def _print_saved_residual_bytes(fn, *args) -> dict[str, int]:
    """The same from jax.ad_checkpoint.print_saved_residuals' printed report."""
    import contextlib
    import io
    import re

    from jax.ad_checkpoint import print_saved_residuals

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(fn, *args)
    out: dict[str, int] = {}
    for line in buf.getvalue().splitlines():
        m = re.match(r"(\w+)\[([\d,]*)\]\s+(.*)", line.strip())
        if not m or m.group(3).startswith("from "):  # arguments, constants, literals
            continue
        dtype = {"f16": "float16", "f32": "float32", "bf16": "bfloat16", "i32": "int32", "bool": "bool"}[m.group(1)]
        size = int(np.prod([int(d) for d in m.group(2).split(",") if d] or [1]))
        out[dtype] = out.get(dtype, 0) + size * np.dtype(dtype).itemsize
    return out


def _small_vit():
    from benchmarks.models.vit import ViT, ViTConfig, loss_fn, synthetic_batch

    cfg = ViTConfig(image_size=8, channels=3, patch=4, width=32, mlp_hidden=64, depth=2, heads=4, classes=10)
    model = ViT(cfg, key=jax.random.PRNGKey(0))
    x, y = synthetic_batch(cfg, 2, key=jax.random.PRNGKey(1))
    return (lambda m, x: loss_fn(m, x, y)[0]), model, x


def test_saved_bytes_agree_with_jax_residual_accounting():
    import equinox as eqx

    loss, model, x = _small_vit()
    params, static = eqx.partition(model, eqx.is_array)

    def fn(params, x):
        return loss(eqx.combine(params, static), x)

    report = autocast.explain(fn)(params, x)
    saved = report.totals["saved_bytes"]
    assert saved["amp"] == _print_saved_residual_bytes(autocast.amp(fn), params, x)
    assert saved["float32"] == _print_saved_residual_bytes(fn, params, x)
    assert saved["amp"].get("float16", 0) > 0
    assert saved["amp"].get("float32", 0) < saved["float32"]["float32"] / 10
    # Intermediate bytes: every float result of every first-order equation of the
    # transformed (and of the original) jaxpr, counted here independently.
    from tests.helpers import bodies, walk

    def float_results(closed):
        out: dict[str, int] = {}
        for eqn, _ in walk(closed):
            if bodies(eqn):  # a higher-order equation (either encoding): its body's equations count
                continue
            for v in eqn.outvars:
                if v.aval.dtype in (jnp.float16, jnp.float32, jnp.bfloat16):
                    out[str(v.aval.dtype)] = (
                        out.get(str(v.aval.dtype), 0) + int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
                    )
        return out

    inter = report.totals["intermediate_bytes"]
    assert inter["amp"] == float_results(jax.make_jaxpr(autocast.amp(fn))(params, x))
    assert inter["float32"] == float_results(jax.make_jaxpr(fn)(params, x))


def test_residual_bytes_of_an_mlp_match_the_vjp_jaxpr():
    def mlp(w1, w2, x):
        return jnp.sum(jax.nn.log_softmax(jax.nn.gelu(x @ w1) @ w2))

    w1, w2, x = jnp.ones((16, 32)) * 0.1, jnp.ones((32, 8)) * 0.1, jnp.ones((4, 16))
    for remat in (True, False):
        report = autocast.explain(mlp, remat_float32=remat)(w1, w2, x)
        assert report.totals["saved_bytes"]["amp"] == _residual_bytes(autocast.amp(mlp, remat_float32=remat), w1, w2, x)
        assert report.totals["saved_bytes"]["float32"] == _residual_bytes(mlp, w1, w2, x)
    islands = autocast.explain(mlp)(w1, w2, x).totals
    assert islands["float32_islands"] >= 2 and 1 <= islands["islands_recomputed"] <= islands["float32_islands"]
    assert autocast.explain(mlp, remat_float32=False)(w1, w2, x).totals["islands_recomputed"] == 0


def test_desktop_vit_has_no_float32_matmuls():
    from benchmarks.models.vit import SHAPES, ViT, loss_fn, synthetic_batch

    cfg = SHAPES["desktop"]
    model = ViT(cfg, key=jax.random.PRNGKey(0))
    x, y = synthetic_batch(cfg, 1, key=jax.random.PRNGKey(1))
    report = autocast.explain(lambda m, x, y: loss_fn(m, x, y)[0])(model, x, y)
    assert report.float32_matmuls == []
    flops = report.totals["matmul_flops"]
    assert set(flops["amp"]) == {"float16"} and flops["amp"]["float16"] == flops["float32"]["float32"]
    n_matmuls = sum(r["count"] for r in report.rows if r["primitive"] in ("dot_general", "conv_general_dilated"))
    assert n_matmuls == 1 + cfg.depth * (4 + 2 + 2) + 1  # patch conv; q,k,v,o + 2 attention + 2 MLP per block; head
    assert report.totals["casts_inserted"] > 0
    # Module paths show up as scopes.
    assert any("eqx.nn.MultiheadAttention" in r["scope"] for r in report.rows)


def test_float32_compute_dtype_is_the_identity():
    report = autocast.explain(stop_model, compute_dtype=jnp.float32)(PARAMS, X)
    assert report.float32_matmuls == []
    t = report.totals
    assert t["matmul_flops"]["amp"] == t["matmul_flops"]["float32"]
    assert t["intermediate_bytes"]["amp"] == t["intermediate_bytes"]["float32"]
    assert t["casts_inserted"] == 0 and t["float32_islands"] == 0


def test_outputs_text_markdown_dict(monkeypatch):
    report = autocast.explain(stop_model)(PARAMS, X)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["compute_dtype"] == "float16" and len(data["float32_matmuls"]) == 2
    assert data["totals"]["matmul_flops"]["float32"]["float32"] > 0
    md = report.to_markdown()
    assert md.startswith("| scope | nesting | primitive | count |") and "amp_stop" in md
    text = str(report)
    assert "dot_general" in text and "saved for backward" in text and "matmuls not in float16: 2" in text
    for name in [n for n in sys.modules if n == "rich" or n.startswith("rich.")] or ["rich"]:
        monkeypatch.setitem(sys.modules, name, None)  # rich not installed: plain text
    plain = str(report)
    assert "dot_general" in plain and "┃" not in plain and "matmuls not in float16: 2" in plain


def test_bad_input():
    with pytest.raises(TypeError, match="fn must be callable"):
        autocast.explain("f")
    with pytest.raises(ValueError, match="compute_dtype"):
        autocast.explain(stop_model, compute_dtype="float64")
    with pytest.raises(TypeError, match="amp_policy"):
        autocast.explain(stop_model, amp_policy=[1, 2])


def test_cond_branches_are_counted_once_each():
    # The branches' outputs disagree in dtype (float16 / float32), so the interpreter traces
    # branch ``a`` a second time; explain keeps one record per equation.
    def f(w, x, p):
        def a(x):
            return x @ w

        def b(x):
            return jnp.exp(x) @ w + jnp.sum(x)

        return jnp.sum(jax.lax.cond(p > 0, a, b, x))

    report = autocast.explain(f)(jnp.ones((4, 4)), jnp.ones((2, 4)), 1.0)
    rows = [r for r in report.rows if r["primitive"] == "dot_general"]
    assert sum(r["count"] for r in rows) == 2 and all(r["nesting"] == "cond" for r in rows)
    assert _matmul_operand_dtypes(autocast.amp(f), jnp.ones((4, 4)), jnp.ones((2, 4)), 1.0) == ["float16", "float16"]


# --- every option of amp takes effect ---------------------------------------------------


def _mlp(w1, w2, x):
    return jnp.sum(jax.nn.log_softmax(jax.nn.gelu(x @ w1) @ w2))


MLP_ARGS = (jnp.ones((16, 32)) * 0.1, jnp.ones((32, 8)) * 0.1, jnp.ones((4, 16)))


def test_weight_grad_dtype_sets_the_dtype_of_the_weight_gradients_explain_reports():
    """The backward pass of ``gelu(x @ w1) @ w2`` runs four matmuls: dW2 [32, 8], dh [4, 32],
    dW1 [16, 32] and dx [4, 16]. Under ``weight_grad_dtype="float32"`` the gradients of the
    operands narrowed from float32 (w1, w2 and the input x) leave their matmuls in float32
    and dh in float16; under ``"compute"`` all four are float16; the float32 original's are
    float32. (remat_float32=False: no matmul is recomputed in the backward pass.)"""
    n = {"dW2": 32 * 8, "dh": 4 * 32, "dW1": 16 * 32, "dx": 4 * 16}
    want = {
        "float32": {"float32": 4 * (n["dW2"] + n["dW1"] + n["dx"]), "float16": 2 * n["dh"]},
        "compute": {"float16": 2 * sum(n.values())},
    }
    for mode, expected in want.items():
        report = autocast.explain(_mlp, weight_grad_dtype=mode, remat_float32=False)(*MLP_ARGS)
        assert report.totals["backward_matmul_bytes"] == {"amp": expected, "float32": {"float32": 4 * sum(n.values())}}
        assert "backward matmul results" in report.to_markdown()


def _checkpoints(fn, *args):
    """Checkpoints in the gradient program, in either encoding (the classic `checkpoint`
    primitive, or `RematTraced` under JAX's `jax_remat3`)."""
    from tests.helpers import kind, walk

    closed = jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(*args)
    return sum(kind(e) == "checkpoint" for e, _ in walk(closed))


def test_remat_float32_decides_which_islands_explain_reports_recomputed():
    reports = {r: autocast.explain(_mlp, remat_float32=r)(*MLP_ARGS) for r in (True, "auto", False)}
    totals = {r: rep.totals for r, rep in reports.items()}
    assert totals[True]["float32_islands"] >= 2 and totals[True]["islands_recomputed"] >= 1
    assert 1 <= totals["auto"]["islands_recomputed"] <= totals[True]["islands_recomputed"]
    assert totals[False]["islands_recomputed"] == 0
    assert not any("recomputed" in row["why"] for row in reports[False].rows)
    assert any("island, recomputed" in row["why"] for row in reports[True].rows)
    # what explain reports is what amp does: checkpoints in the gradient program exactly
    # where islands are recomputed
    for r, t in totals.items():
        assert (_checkpoints(autocast.amp(_mlp, remat_float32=r), *MLP_ARGS) > 0) == (t["islands_recomputed"] > 0), r


@jax.custom_vjp
def _product(x, w):
    return x @ w


def _product_fwd(x, w):
    return x @ w, (x, w)


def _product_bwd(res, g):
    x, w = res
    return g @ w.T, x.T @ g


_product.defvjp(_product_fwd, _product_bwd)


def test_custom_vjp_bwd_decides_how_explain_counts_a_backward_rule():
    """Under ``"amp"`` the rule's two matmuls run in float16 (g @ w.T [8, 4], x.T @ g
    [4, 4]); as written (``"original"``) they run on the residuals as they arrive, a float32
    one among them."""
    w, x = jnp.full((4, 4), 0.01), jnp.ones((8, 4))

    def loss(w, x):
        return jnp.sum(_product(x, w))

    under_amp = autocast.explain(loss)(w, x).totals
    assert under_amp["custom_vjp_bwd"] == {"count": 1, "mode": "amp"}
    assert under_amp["backward_matmul_bytes"]["amp"] == {"float16": 2 * (8 * 4 + 4 * 4)}
    as_written = autocast.explain(loss, custom_vjp_bwd="original")(w, x).totals
    assert as_written["custom_vjp_bwd"] == {"count": 1, "mode": "original"}
    assert as_written["backward_matmul_bytes"]["amp"].get("float32", 0) > 0


def test_a_while_loop_has_no_backward_matmuls_to_count():
    """JAX cannot transpose a while loop: the backward accounting is n/a, the rest is there."""

    def f(w, x):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1].sum()

    report = autocast.explain(f)(jnp.full((4, 4), 0.1), jnp.ones((2, 4)))
    assert report.totals["backward_matmul_bytes"] == {"amp": None, "float32": None}
    assert report.totals["matmul_flops"]["amp"] == {"float16": 2 * 2 * 4 * 4}
    assert "backward matmul results | n/a | n/a" in report.to_markdown()
