"""``explain``, ``find_overflow`` and the jaxpr walker under both encodings of checkpoint,
custom_jvp, custom_vjp and scan: the classic primitives (``remat2``, ``custom_jvp_call``,
``custom_vjp_call``, ``scan``) and JAX's ``call_hi_primitive`` encodings behind the upgrade
flags ``jax_remat3``, ``jax_custom_jvp3``, ``jax_custom_vjp3`` and ``jax_scan3``.

Each test runs once per encoding this JAX has: ``classic`` always, and with a flag turned on
for the test alone (``_compat.with_flag``; the functions are defined inside it, since JAX
0.9 reads ``jax_custom_vjp3`` when ``jax.custom_vjp`` decorates). A flag JAX lacks (JAX 0.9
has only ``custom_vjp3``) gives no test case, rather than a skipped one."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import bodies, dots_in, of_kind

import autocast
from autocast import _compat, _walk

# the construct each flag re-encodes, and the HiPrim class it becomes
CONSTRUCTS = {
    "remat3": ("checkpoint", "RematTraced"),
    "custom_jvp3": ("custom_jvp", "CustomJVPTraced"),
    "custom_vjp3": ("custom_vjp", "CustomVJPTraced"),
    "scan3": ("scan", "Scan3"),
}
ENCODINGS = ["classic", *(f for f in CONSTRUCTS if _compat.has_flag(f))]


@contextlib.contextmanager
def _encoding(flag: str):
    """Only ``flag`` on (none for ``classic``), whatever the environment sets (the lane
    ``nextjax`` turns several on)."""
    with contextlib.ExitStack() as stack:
        for name in CONSTRUCTS:
            if _compat.has_flag(name):
                stack.enter_context(_compat.with_flag(name, name == flag))
        yield


def _wx(seed: int = 0, n: int = 4, d: int = 16):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((d, d), dtype=np.float32) / np.float32(np.sqrt(d))
    return jnp.asarray(w), jnp.asarray(rng.standard_normal((n, d), dtype=np.float32))


def _constructs():
    """One function per construct, each with matmuls only inside the construct's body:
    (construct, function, label in a nesting path, matmuls in the body, times it runs)."""

    @jax.checkpoint
    def block(w, x):
        return jnp.tanh(x @ w) @ w.T

    @jax.custom_jvp
    def proj(w, x):
        return x @ w

    @proj.defjvp
    def _proj_jvp(primals, tangents):
        (w, x), (dw, dx) = primals, tangents
        return proj(w, x), dx @ w + x @ dw

    @jax.custom_vjp
    def clip(w, x):
        return jnp.sin(x @ w)

    def _clip_fwd(w, x):
        return clip(w, x), (w, x)

    def _clip_bwd(res, g):
        w, x = res
        g = jnp.clip(g * jnp.cos(x @ w), -1.0, 1.0)
        return x.T @ g, g @ w.T

    clip.defvjp(_clip_fwd, _clip_bwd)

    def looped(w, x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=6)[0]

    return {
        "checkpoint": (block, "checkpoint", 2, 1),
        "custom_jvp": (proj, "custom_jvp(proj)", 1, 1),
        "custom_vjp": (clip, "custom_vjp(clip)", 1, 1),
        "scan": (looped, "scan(6)", 1, 6),
    }


def _cases():
    for flag in ENCODINGS:
        for construct, _ in CONSTRUCTS.values():
            if flag == "classic" or CONSTRUCTS[flag][0] == construct:
                yield pytest.param(flag, construct, id=f"{construct}-{flag}")


def _check_encoding(closed, flag: str, construct: str) -> None:
    """The construct is there, once, in the encoding the flag asks for (so the test means
    what it says)."""
    (eqn,) = of_kind(closed, construct)
    if flag == "classic":
        assert _compat.hi_prim(eqn) is None, eqn
    else:
        assert _compat.hi_name(eqn) == CONSTRUCTS[flag][1], eqn


@pytest.mark.parametrize("flag,construct", list(_cases()))
def test_walk_finds_the_matmuls_in_the_body(flag, construct):
    w, x = _wx()
    with _encoding(flag):
        fn, label, n_dots, times = _constructs()[construct]
        closed = jax.make_jaxpr(lambda w, x: jnp.sum(fn(w, x)))(w, x)
    _check_encoding(closed, flag, construct)
    dots = [(path, mult) for e, _, path, mult in _walk.walk(closed) if e.primitive.name == "dot_general"]
    assert dots == [((label,), times)] * n_dots, dots
    (eqn,) = of_kind(closed, construct)
    assert _walk.label(eqn) == label and _walk.multiplier(eqn) == times
    assert [d for b in bodies(eqn) for d in dots_in(b)] == [("float32", "float32")] * n_dots


@pytest.mark.parametrize("flag,construct", list(_cases()))
def test_explain_counts_the_flops_inside_the_body(flag, construct):
    """The float32 original's matmul FLOPs count every matmul in the body, times the trip
    count (2 * 4 * 16 * 16 per matmul)."""
    w, x = _wx(1)
    with _encoding(flag):
        fn, _, n_dots, times = _constructs()[construct]
        report = autocast.explain(lambda w, x: jnp.sum(fn(w, x)))(w, x)
    assert report.totals["matmul_flops"]["float32"] == {"float32": n_dots * times * 2 * 4 * 16 * 16}
    saved = report.totals["saved_bytes"]["float32"]
    if flag == "scan3":  # JAX's Scan3 is forward-only (no vjp_fwd): nothing to report
        assert saved is None and "n/a" in str(report)
    else:  # residuals are the arguments here (not counted)
        assert isinstance(saved, dict), saved


@pytest.mark.parametrize("flag,construct", list(_cases()))
def test_explain_lists_the_body_matmuls_inside_amp_stop(flag, construct):
    """Inside ``amp_stop`` the construct runs as traced: explain lists each matmul of its
    body as a float32 matmul, with the construct in its nesting path."""
    w, x = _wx(2)
    with _encoding(flag):
        fn, label, n_dots, times = _constructs()[construct]

        def model(w, x):
            with autocast.amp_stop():
                return jnp.sum(fn(w, x))

        report = autocast.explain(model)(w, x)
    found = [(m.primitive, m.dtype, m.path) for m in report.float32_matmuls]
    assert found == [("dot_general", "f32×2", (label,))] * n_dots, found
    rows = [r for r in report.rows if r["primitive"] == "dot_general"]
    assert sum(r["count"] for r in rows) == n_dots * times and {r["nesting"] for r in rows} == {label}


@pytest.mark.parametrize("flag,construct", list(_cases()))
def test_explain_lists_the_body_matmuls_in_half(flag, construct):
    """Under amp every matmul in the body runs in float16: explain lists none as float32,
    shows each in its construct's nesting path, and the transformed program agrees."""
    w, x = _wx(3)
    with _encoding(flag):
        fn, label, n_dots, times = _constructs()[construct]
        model = lambda w, x: jnp.sum(fn(w, x))  # noqa: E731
        report = autocast.explain(model)(w, x)
        amp_dots = dots_in(jax.make_jaxpr(autocast.amp(model))(w, x))
    assert report.float32_matmuls == []
    rows = [r for r in report.rows if r["primitive"] == "dot_general"]
    assert {(r["nesting"], r["operands"].split(" → ")[1]) for r in rows} == {(label, "f16×2")}, rows
    assert sum(r["count"] for r in rows) == n_dots * times
    assert report.totals["matmul_flops"]["amp"] == {"float16": n_dots * times * 2 * 4 * 16 * 16}
    assert amp_dots and all(d == ("float16", "float16") for d in amp_dots), amp_dots


def _planted():
    """A float16 overflow inside each construct's body: (300 * tanh(x @ w))² tops 65504."""

    def square(w, x):
        h = jnp.tanh(x @ w) * 300.0
        return (h * h) @ w  # the matmul reads the square in half precision

    block = jax.checkpoint(square)
    act = jax.custom_jvp(square)
    act.defjvp(lambda primals, tangents: (act(*primals), jnp.zeros_like(act(*primals))))
    act2 = jax.custom_vjp(square)
    act2.defvjp(lambda w, x: (act2(w, x), None), lambda _, g: (jnp.zeros((16, 16)), jnp.zeros((4, 16))))

    def looped(w, x):
        return jax.lax.scan(lambda c, _: (c, square(w, c)), x, None, length=3)[1]

    return {
        "checkpoint": (block, "checkpoint"),
        "custom_jvp": (act, "custom_jvp(square)"),
        "custom_vjp": (act2, "custom_vjp(square)"),
        "scan": (looped, "scan(3)"),
    }


@pytest.mark.parametrize("flag,construct", list(_cases()))
def test_find_overflow_inside_the_body(flag, construct):
    w, x = _wx(4)
    w = w * 8.0  # tanh saturates: 300² = 90000 in many entries
    with _encoding(flag):
        fn, label = _planted()[construct]
        model = lambda w, x: jnp.mean(fn(w, x))  # noqa: E731
        assert np.isfinite(model(w, x))
        findings = autocast.find_overflow(model)(w, x)
    # the path names the construct (amp's custom_jvp/vjp rebinding names its function
    # ``<lambda>``: find_overflow reads the transformed program)
    overflows = [f for f in findings if f.kind == "overflow"]
    assert overflows and all(len(f.path) == 1 and f.path[0].startswith(label.split("(")[0]) for f in overflows)
    assert construct.startswith("custom") or overflows[0].path == (label,), findings
    (square,) = [f for f in overflows if f.primitive == "mul"]
    assert square.dtype == "float16" and square.float32_range[1] > 65504 and square.count > 0, square
