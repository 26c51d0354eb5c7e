"""Turning the loss-head rewrite off and choosing its chunks (autocast/_loss_head, issue 49):
`loss_head="xla"`, a named scope the policy maps to `xla_loss_head`, `amp_stop` and float32
amp each keep the head as written (explain says so, the program has no scan and equals the
unrewritten one); the option's values are checked; the chunked program is one `lax.scan`
of checkpointed chunks in which no value as large as the logits exists, forward or backward;
and the chunk count follows `_chunk.chunk_count`'s documented rule, under `"auto"` from the
byte budget.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autocast
from autocast import _policy
from autocast._loss_head import _chunk, chunk_count, find
from tests.helpers import bodies, of_kind, param, tree_max_rel_err, walk

N, D, V = 32, 4, 64
"""32 tokens, width 4, vocabulary 64: a head (the vocabulary 16 times the width, over
`_find.AMPLIFY`); chunk counts 2, 4, 8, 16, 32."""

CHUNKED_4 = "chunked: 4 token chunks (lax.scan + checkpoint), float32 accumulation"


def _data(n=N, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (n, D))
    w = jax.random.normal(k[1], (V, D)) * 0.3
    y = jax.random.randint(k[2], (n,), 0, V)
    return x, w, y


def _loss(x, w, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ w.T, y).mean()


def _hows(fn, args, **options):
    report = autocast.explain(fn, compute_dtype=options.pop("compute_dtype", jnp.bfloat16), **options)(*args)
    # how the chunks are differentiated (`_forward` or `scan` + `checkpoint`) and whether the
    # vocabulary is padded (tests/test_loss_head_pad.py) are not what these tests check
    return [
        re.sub(r", the matmuls' vocabulary padded .*$", "", h["how"]).replace(
            ", gradients with the forward pass)", " + checkpoint)"
        )
        for h in report.totals["loss_head"]
    ]


def _scans(fn, args, **options):
    closed = jax.make_jaxpr(autocast.amp(fn, compute_dtype=options.pop("compute_dtype", jnp.bfloat16), **options))
    return of_kind(closed(*args), "scan")


def _value_and_grads(fn, args, **options):
    amped = autocast.amp(fn, compute_dtype=options.pop("compute_dtype", jnp.bfloat16), **options)
    return jax.value_and_grad(amped, argnums=(0, 1))(*args)


def _assert_identical(a, b):
    for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(q))


def _assert_close(a, b):
    """Within two bfloat16 roundings (2**-7 in norm): XLA on CPU drops the rounding of the
    bfloat16 matmul's result before the float32 softmax in the unchunked program and keeps it
    in the scan's body (tests/test_loss_head_find.py's `_assert_close`), and a bfloat16 loss
    differentiated with its forward pass rounds its gradient at cotangent 1, then scales it
    (`autocast._loss_head._forward`)."""
    for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert tree_max_rel_err(p, q) <= 2**-7, (p, q)


# --- turning it off -------------------------------------------------------------------------


def test_the_xla_setting_keeps_every_head_as_written():
    args = _data()
    assert _hows(_loss, args, loss_head=4) == [CHUNKED_4]
    assert not any(h.startswith("chunked") for h in _hows(_loss, args, loss_head="xla"))
    assert [param(s, "length") for s in _scans(_loss, args, loss_head=4)] == [4]
    assert _scans(_loss, args, loss_head="xla") == []


def _two_heads(x1, x2, w1, w2, y1, y2):
    with jax.named_scope("my_loss"):
        kept = optax.softmax_cross_entropy_with_integer_labels(x1 @ w1.T, y1).mean()
    chunked = optax.softmax_cross_entropy_with_integer_labels(x2 @ w2.T, y2).mean()
    return kept + chunked


def _two_head_args():
    """Two heads sharing nothing (tests/test_loss_head_find.py has heads that share inputs)."""
    (x1, w1, y1), (x2, w2, y2) = _data(seed=0), _data(seed=1)
    return x1, x2, w1, w2, y1, y2


def _scope_policies(tmp_path):
    table = tmp_path / "no_chunks_in_my_loss.toml"
    table.write_text('schema = 1\nextends = "default"\n\n[scopes]\n"my_loss" = "xla_loss_head"\n')
    return {
        "policy file": autocast.load_policy(table),
        "extend_policy": autocast.extend_policy({"my_loss": _policy.CATEGORIES["xla_loss_head"]}),
    }


@pytest.mark.parametrize("how", ["policy file", "extend_policy"])
def test_a_scope_mapped_to_xla_loss_head_keeps_only_its_head(tmp_path, how):
    """docs/policies.md: a `[scopes]` entry names a category; `xla_loss_head` keeps the heads
    traced in that `jax.named_scope` as written, and the head outside it is still chunked."""
    policy = _scope_policies(tmp_path)[how]
    args = _two_head_args()
    hows = sorted(_hows(_two_heads, args, loss_head=4, amp_policy=policy))
    assert hows == ["as written: the policy (xla_loss_head)", CHUNKED_4], hows
    assert [param(s, "length") for s in _scans(_two_heads, args, loss_head=4, amp_policy=policy)] == [4]
    assert len(_scans(_two_heads, args, loss_head=4)) == 2  # without the policy: both chunked
    amped = autocast.amp(_two_heads, compute_dtype=jnp.bfloat16, loss_head=4, amp_policy=policy)
    reference = autocast.amp(_two_heads, compute_dtype=jnp.bfloat16, loss_head="xla")
    _assert_close(jax.value_and_grad(amped, (0, 1, 2, 3))(*args), jax.value_and_grad(reference, (0, 1, 2, 3))(*args))


def test_inside_amp_stop_the_head_is_as_written_and_float32():
    @autocast.amp_stop
    def stopped(x, w, y):
        return _loss(x, w, y)

    args = _data()
    hows = _hows(stopped, args, loss_head=4)
    assert hows and all(h.startswith("as written: ") for h in hows), hows
    assert _scans(stopped, args, loss_head=4) == []
    _assert_identical(_value_and_grads(stopped, args, loss_head=4), _value_and_grads(stopped, args, loss_head="xla"))
    _assert_identical(_value_and_grads(stopped, args, loss_head=4), jax.value_and_grad(_loss, (0, 1))(*args))


def test_float32_amp_finds_nothing_to_chunk():
    """float32 amp is an identity: no head is chunked, and the program is the original's."""
    args = _data()
    assert not any(h.startswith("chunked") for h in _hows(_loss, args, loss_head=4, compute_dtype=jnp.float32))
    assert _scans(_loss, args, loss_head=4, compute_dtype=jnp.float32) == []
    _assert_identical(
        _value_and_grads(_loss, args, loss_head=4, compute_dtype=jnp.float32), jax.value_and_grad(_loss, (0, 1))(*args)
    )


# --- the option -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["bad", "AUTO", 0, -1, True, False, 2.5, None, "4"], ids=repr)
@pytest.mark.parametrize("entry", ["amp", "explain", "find_overflow"])
def test_a_bad_loss_head_is_refused_naming_the_option_and_its_values(entry, bad):
    with pytest.raises(ValueError, match=r"loss_head=.*'auto', 'xla' or a number of chunks"):
        getattr(autocast, entry)(_loss, compute_dtype=jnp.bfloat16, loss_head=bad)(*_data())


@pytest.mark.parametrize("k", [np.int32(4), np.int64(4), np.uint8(4)], ids=lambda k: type(k).__name__)
def test_numpy_integers_are_chunk_counts(k):
    args = _data()
    assert _hows(_loss, args, loss_head=k) == [CHUNKED_4]
    _assert_identical(_value_and_grads(_loss, args, loss_head=k), _value_and_grads(_loss, args, loss_head=4))


# --- the chunked program ---------------------------------------------------------------------


def _as_large_as_the_logits(closed):
    """(primitive, shape) of every value, at any depth, with N * V elements or more."""
    out = []
    for e, _ in walk(closed):
        for v in [*e.invars, *e.outvars]:
            shape = getattr(getattr(v, "aval", None), "shape", None)
            if shape is not None and math.prod(shape) >= N * V:
                out.append((e.primitive.name, tuple(shape)))
    return out


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_the_chunked_program_is_one_scan_of_chunks(dtype):
    """float16: a scan of checkpointed chunks (recomputed in the backward pass); bfloat16 with
    one scalar loss: a scan with no checkpoint, its gradient made with it (`_forward`)."""
    (scan,) = _scans(_loss, _data(), loss_head=4, compute_dtype=dtype)
    assert param(scan, "length") == 4
    (body,) = bodies(scan)
    assert len(of_kind(body, "checkpoint")) == (1 if dtype == jnp.float16 else 0)
    dots = [e for e, _ in walk(body) if e.primitive.name == "dot_general"]
    assert [tuple(v.aval.shape for v in e.invars) for e in dots] == [((N // 4, D), (D, V))]
    assert [str(v.aval.dtype) for v in dots[0].invars] == [jnp.dtype(dtype).name] * 2


def test_no_value_as_large_as_the_logits_forward_or_backward():
    """The point of the rewrite: the gradient's program (forward, residuals, backward) never
    holds `[N, V]`; the unchunked program does."""
    args = _data()

    def grad_program(loss_head):
        amped = autocast.amp(_loss, compute_dtype=jnp.bfloat16, loss_head=loss_head)
        return jax.make_jaxpr(jax.grad(amped, argnums=(0, 1)))(*args)

    assert _as_large_as_the_logits(grad_program(4)) == []
    assert ("dot_general", (N, V)) in _as_large_as_the_logits(grad_program("xla"))


def test_the_chunked_loss_and_gradients_equal_the_unchunked():
    args = _data()
    for k in (2, 4, 8):
        _assert_close(_value_and_grads(_loss, args, loss_head=k), _value_and_grads(_loss, args, loss_head="xla"))


# --- the chunk count ------------------------------------------------------------------------


def _plan(n=N):
    closed = jax.make_jaxpr(_loss)(*_data(n))
    ((_, plan),) = find(closed.jaxpr, closed.consts)
    return plan


def test_chunk_counts_are_the_divisors_of_the_token_axis():
    assert _plan().chunk_counts() == [2, 4, 8, 16, 32]
    assert _plan(24).chunk_counts() == [2, 3, 4, 6, 8, 12, 24]
    assert _plan(13).chunk_counts() == [13]
    assert _plan().logits_bytes == N * V * 4


@pytest.mark.parametrize(
    ("setting", "expect"),
    [(2, 2), (3, 4), (4, 4), (5, 8), (16, 16), (17, 32), (32, 32), (64, 32), (1, "loss_head=1")],
)
def test_an_int_setting_gives_the_smallest_divisor_at_least_it(setting, expect):
    """`_chunk`: "`loss_head=k` asks for `k` chunks (the smallest count >= k the token axis
    allows)"; more chunks than the token axis allows: as many as it allows."""
    assert chunk_count(_plan(), setting) == expect


def test_a_prime_token_axis_takes_its_only_divisor():
    """13 tokens: 13 chunks of one token whatever count from 2 to 13 is asked (the smallest
    divisor >= k), and the program still equals the unchunked one."""
    plan = _plan(13)
    assert [chunk_count(plan, k) for k in (2, 4, 13, 14)] == [13, 13, 13, 13]
    args = _data(13)
    assert _hows(_loss, args, loss_head=4) == ["chunked: 13 token chunks (lax.scan + checkpoint), float32 accumulation"]
    _assert_close(_value_and_grads(_loss, args, loss_head=4), _value_and_grads(_loss, args, loss_head="xla"))


@pytest.mark.parametrize(("budget", "expect"), [(N * V * 4, None), (N * V * 4 - 1, 2), (3000, 4), (1000, 16), (1, 32)])
def test_auto_takes_the_smallest_divisor_that_fits_the_budget(monkeypatch, budget, expect):
    """`"auto"`: the smallest count >= ceil(logits_bytes / BUDGET) that divides the tokens;
    logits that fit the budget whole are left as written (too small to pay)."""
    monkeypatch.setattr(_chunk, "BUDGET", budget)
    monkeypatch.setattr(
        jax, "device_count", lambda: 1
    )  # one device's budget (the sharded case: test_loss_head_sharded.py)
    want = math.ceil(N * V * 4 / budget)
    got = chunk_count(_plan(), "auto")
    args = _data()
    (how,) = _hows(_loss, args)
    if expect is None:
        assert want == 1 and isinstance(got, str) and got.startswith("too small to pay"), got
        assert how == f"as written: {got}" and _scans(_loss, args) == []
        return
    assert got == expect == min(k for k in [*_plan().chunk_counts(), N] if k >= min(want, N))
    assert how == f"chunked: {expect} token chunks (lax.scan + checkpoint), float32 accumulation"
    assert [param(s, "length") for s in _scans(_loss, args)] == [expect]
