"""Jraph (DeepMind's graph networks library) under ``amp``, with Haiku update functions.

A batch of four random graphs (``jraph.batch``), node, edge and global features, and:

- ``jraph.GraphNetwork`` (the full GN block of Battaglia et al.: edge, node and global
  updates by ``hk.nets.MLP``, ``segment_sum`` aggregations), two rounds of message
  passing, a graph-level regression of the globals;
- ``jraph.GAT`` (graph attention: ``segment_softmax`` over each node's incoming edges,
  as jraph's ``zacharys_karate_club`` example), with self edges, node classification.

The padded batch is ``jraph.pad_with_graphs`` to fixed node/edge/graph counts, as jraph
recommends under ``jit``: a padding graph whose nodes and edges the loss masks out with
``jraph.get_node_padding_mask`` / ``get_graph_padding_mask``. Its padding nodes receive no
edges, so their attention ``segment_softmax`` is over an empty segment.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import jraph
import numpy as np
import optax
import pytest
from harness import CHECKS, HALF, Model, Tol, build, run_all_checks

F, CLASSES = 16, 4


def _graphs(self_edges: bool):
    rng = np.random.default_rng(0)
    graphs = []
    for n, e in ((5, 8), (7, 12), (3, 4), (6, 10)):
        senders, receivers = rng.integers(0, n, e), rng.integers(0, n, e)
        if self_edges:
            senders, receivers = np.concatenate([senders, np.arange(n)]), np.concatenate([receivers, np.arange(n)])
        graphs.append(
            jraph.GraphsTuple(
                nodes=rng.normal(size=(n, F)).astype(np.float32),
                edges=rng.normal(size=(len(senders), F)).astype(np.float32),
                senders=senders.astype(np.int32),
                receivers=receivers.astype(np.int32),
                globals=rng.normal(size=(1, F)).astype(np.float32),
                n_node=np.array([n], np.int32),
                n_edge=np.array([len(senders)], np.int32),
            )
        )
    graph = jraph.batch(graphs)
    padded = jraph.pad_with_graphs(graph, n_node=32, n_edge=64, n_graph=6)
    # the unpadded batch has the same shapes: the real graphs stretched over the padding
    # budget would change the model; instead it is the padded batch with the padding
    # graph's nodes and edges made real (a fifth graph, all of it in the loss)
    return jax.tree.map(jnp.asarray, padded)


def _labels(graph, key):
    return dict(
        node=jax.random.randint(key, (graph.nodes.shape[0],), 0, CLASSES),
        graph=jax.random.normal(key, (graph.globals.shape[0], 1)),
    )


def _batches(self_edges):
    graph = _graphs(self_edges)
    labels = _labels(graph, jax.random.key(3))
    node_mask = jraph.get_node_padding_mask(graph)
    graph_mask = jraph.get_graph_padding_mask(graph)
    return {
        "padded": dict(graph=graph, labels=labels, node_mask=node_mask, graph_mask=graph_mask),
        "unpadded": dict(graph=graph, labels=labels, node_mask=jnp.ones_like(node_mask), graph_mask=graph_mask),
    }


def _mlp(sizes):
    return lambda *xs: hk.nets.MLP(sizes, activation=jax.nn.relu)(jnp.concatenate(xs, axis=-1))


def _graph_network(graph):
    gn = jraph.GraphNetwork(
        update_edge_fn=_mlp([32, F]),
        update_node_fn=_mlp([32, F]),
        update_global_fn=_mlp([32, F]),
    )
    for _ in range(2):
        graph = gn(graph)
    return hk.Linear(1)(graph.globals)


def graph_network() -> Model:
    net = hk.without_apply_rng(hk.transform(_graph_network))
    batches = _batches(self_edges=False)
    params = net.init(jax.random.key(0), batches["padded"]["graph"])

    def loss(params, batch):
        pred = net.apply(params, batch["graph"])
        w = batch["graph_mask"][:, None].astype(jnp.float32)
        return jnp.sum(w * (pred - batch["labels"]["graph"]) ** 2) / jnp.sum(w)

    # From measurement (benchmarks/results/corpus/real-models.md, CPU, JAX 0.12) with 3-5x margin.
    tol = {"float16": Tol(loss=4e-3, grad=1e-2), "bfloat16": Tol(loss=6e-3, grad=4e-2)}
    return Model("jraph.GraphNetwork", "jraph", params, batches, loss, tol)


def _gat(graph):
    heads, width = 4, 8

    def query(nodes):
        return hk.Linear(heads * width)(nodes).reshape(-1, heads, width)

    def logit(sent, received, edges):
        return hk.Linear(1)(jnp.concatenate([sent, received], axis=-1))[..., 0]  # (E, heads)

    gat = jraph.GAT(attention_query_fn=query, attention_logit_fn=lambda s, r, e: logit(s, r, e)[..., None])
    graph = gat(graph)
    return hk.Linear(CLASSES)(graph.nodes)


def gat() -> Model:
    net = hk.without_apply_rng(hk.transform(_gat))
    batches = _batches(self_edges=True)
    params = net.init(jax.random.key(0), batches["padded"]["graph"])

    def loss(params, batch):
        logits = net.apply(params, batch["graph"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]["node"])
        w = batch["node_mask"].astype(jnp.float32)
        return jnp.sum(w * ce) / jnp.sum(w)

    tol = {"float16": Tol(loss=1e-4, grad=4e-3), "bfloat16": Tol(loss=1e-3, grad=2e-2)}
    return Model("jraph.GAT", "jraph", params, batches, loss, tol)


MODELS = {"graph_network": graph_network, "gat": gat}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(MODELS))
def test_jraph(name, dtype, check):
    run_all_checks(build(MODELS[name]), dtype, check)
