"""The loss head on a batch sharded across devices (the 8 simulated CPU devices of
tests/conftest.py): the chunks interleave the rows, so each chunk holds rows of every device
and the chunked step needs no collective the step as written does not have."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_max_rel_err
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from loss_head_cases import strict

import autocast
from autocast._loss_head import _chunk

B, T, D, V = 16, 4, 8, 128
"""16 sequences over 8 devices (2 each) of 4 tokens, width 8, vocabulary 128."""


def _loss(w, x, y):
    logits = x @ w.T
    return optax.softmax_cross_entropy_with_integer_labels(logits.reshape(-1, V), y.reshape(-1)).mean()


def _data():
    k = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(k[1], (V, D)) * 0.3,
        jax.random.normal(k[0], (B, T, D)),
        jax.random.randint(k[2], (B, T), 0, V),
    )


@pytest.fixture(scope="module")
def sharded():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    w, x, y = _data()
    batch = NamedSharding(mesh, P("data"))
    return jax.device_put(w, NamedSharding(mesh, P())), jax.device_put(x, batch), jax.device_put(y, batch)


def _collectives(fn, args):
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return {op: hlo.count(f" {op}(") for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce")}


def _step(loss_head):
    return jax.value_and_grad(autocast.amp(_loss, compute_dtype=jnp.bfloat16, loss_head=loss_head), argnums=(0, 1))


def test_auto_counts_the_devices_and_keeps_the_rows_where_they_lie(sharded, monkeypatch):
    """Under "auto" with 8 devices, only counts whose chunks hold rows of every device are
    taken (16 sequences: 2), the largest of them where the budget asks for more (here 4):
    the step has the collectives of the step as written and no other."""
    assert jax.device_count() == 8
    monkeypatch.setattr(_chunk, "BUDGET", B * T * V * 4 // 4)  # 4 chunks wanted
    (how,) = [h["how"] for h in autocast.explain(_loss, compute_dtype=jnp.bfloat16)(*sharded).totals["loss_head"]]
    assert how.startswith("chunked: 2 token chunks"), how
    assert _collectives(_step("auto"), sharded) == _collectives(_step("xla"), sharded)


_OLD_JAX = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 10)


@pytest.mark.parametrize(
    "k",
    [
        2,
        pytest.param(
            4,
            marks=pytest.mark.skipif(
                _OLD_JAX,
                reason="JAX 0.9 cannot name the output sharding GSPMD picks for 4 chunks of 16 rows on 8 "
                "devices (IndivisibleError in pxla.maybe_recover_user_shardings); 'auto' takes 2 there",
            ),
        ),
    ],
)
def test_interleaved_chunks_equal_the_head_as_written(sharded, k):
    """Chunk j holds every k-th sequence: values and gradients as the head as written
    (sharded or not), within two bfloat16 roundings of the gradients made with the loop; 4
    chunks of 16 rows on 8 devices (a count that leaves some chunks without rows of some
    device, asked as an int) are exact too, XLA moving the rows; and the sharded step as on one
    device. The chunked and the written step compiled without excess precision
    (`loss_head_cases.strict`): on JAX 0.9.2 XLA otherwise keeps one program's bfloat16 logits
    in float32 into the softmax and not the other's (6e-5 of the loss)."""
    chunked = strict(_step(k), *sharded)
    written = strict(_step("xla"), *sharded)
    assert tree_max_rel_err(chunked[0], written[0]) <= 1e-6
    assert tree_max_rel_err(chunked[1], written[1]) <= 2**-7
    assert tree_max_rel_err(jax.jit(_step(k))(*sharded), _step(k)(*_data())) <= 1e-5


@pytest.mark.parametrize("inner", [1, 2, 4])
def test_split_and_merge_are_inverse_and_interleave(inner):
    """`_split` puts the rows r with (r // inner) % k == j in chunk j, in order; `_merge`
    puts them back."""
    k, x = 4, np.arange(2 * 32 * 3).reshape(2, 32, 3)
    chunks = np.asarray(_chunk._split(jnp.asarray(x), 1, k, inner))
    rows = np.arange(32)
    for j in range(k):
        np.testing.assert_array_equal(chunks[j], x[:, rows[(rows // inner) % k == j]])
    np.testing.assert_array_equal(np.asarray(_chunk._merge(jnp.asarray(chunks), 1, inner)), x)


def test_explicit_sharding_mode_leaves_the_head_as_written():
    """A batch sharded in JAX's explicit sharding mode (`AxisType.Explicit`, where each value's
    sharding is part of its type): the head stays as written, saying why, and the step runs,
    equal to the step with `loss_head="xla"` (before, tracing the chunks failed on a `select_n`
    whose cases had different shardings)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    w, x, y = _data()
    with jax.set_mesh(mesh):
        args = (jax.device_put(w, P()), jax.device_put(x, P("data")), jax.device_put(y, P("data")))
        (how,) = [
            h["how"]
            for h in autocast.explain(_loss, compute_dtype=jnp.bfloat16, loss_head=2)(*args).totals["loss_head"]
        ]
        assert how == "as written: an input is sharded in JAX's explicit sharding mode", how
        got = jax.jit(_step(2))(*args)
        written = jax.jit(_step("xla"))(*args)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(written)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert tree_max_rel_err(got, jax.value_and_grad(_loss, argnums=(0, 1))(w, x, y)) < 3e-2
