"""JAX MD's graph-network interatomic potential, trained on energies and forces, under ``amp``.

``jax_md.energy.graph_network_neighbor_list`` (the ``EnergyGraphNet`` of Bapst et al., a
Flax NNX module) in JAX MD's sparse neighbor-list format: each step builds a jraph
``GraphsTuple`` from the neighbor list and runs ``jraph.GraphNetwork`` (edge, node and
global MLPs, ``jax.ops.segment_sum`` aggregations). Forces are ``-grad(energy)`` with
respect to the positions, and the loss is on energies and forces together (the fitting
target of a machine-learned potential), so its gradient is second-order autodiff through
the segment sums.

A batch is four configurations of a 27-atom cluster (a jittered 3x3x3 cubic lattice, two
species, free space), targets from JAX MD's Lennard-Jones potential. The neighbor list
holds every pair within the cutoff plus a skin (``dr_threshold``), as in a simulation;
pairs in the skin but beyond the cutoff are masked into padding edges that point at the
padding node JAX MD appends (a padding graph, jraph's convention). The padded batch
stretches two clusters along x, so their x-bonds (36 of the 135 listed pairs) fall in the
skin and become padding; the unpadded batch has every listed pair within the cutoff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import CHECKS, HALF, Model, Tol, build, run_all_checks
from jax_md import energy, partition, space

CUTOFF, SKIN = 1.15, 0.15
LATTICE = np.stack(np.meshgrid(*[np.arange(3.0)] * 3, indexing="ij"), -1).reshape(-1, 3)
N = len(LATTICE)


def _cluster(stretch: float, seed: int) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray((LATTICE + rng.normal(0, 0.02, LATTICE.shape)) * np.array([stretch, 1, 1]), jnp.float32)


def _batch(neighbor, displacement, stretches) -> dict:
    positions = jnp.stack([_cluster(s, seed) for seed, s in enumerate(stretches, start=2)])
    nbrs = jax.jit(jax.vmap(lambda r: neighbor.update(r)))(positions)  # one neighbor list each
    assert not bool(jnp.any(nbrs.did_buffer_overflow))
    lj = energy.lennard_jones_pair(displacement, sigma=1.0, epsilon=1.0, r_cutoff=2.5)
    e, de_dr = jax.jit(jax.vmap(jax.value_and_grad(lj)))(positions)
    return dict(R=positions, neighbor=nbrs, energy=e, forces=-de_dr)


def _padding_edges(batch, displacement) -> int:
    """Listed pairs beyond the cutoff: the edges ``to_jraph`` masks into padding."""
    i, j = batch["neighbor"].idx[:, 0], batch["neighbor"].idx[:, 1]
    listed = (i < N) & (j < N)
    r = batch["R"]
    take = jax.vmap(lambda r, k: r[jnp.minimum(k, N - 1)])
    dr = jnp.linalg.norm(jax.vmap(jax.vmap(displacement))(take(r, i), take(r, j)), axis=-1)
    return int(jnp.sum(listed & (dr >= CUTOFF)))


def graph_network_potential() -> Model:
    displacement, _ = space.free()
    species = jnp.asarray(np.eye(2, dtype=np.float32)[np.random.default_rng(0).integers(0, 2, N)])
    neighbor_fn, energy_fn = energy.graph_network_neighbor_list(
        displacement,
        4.0,
        CUTOFF,
        SKIN,
        key=jax.random.key(0),
        nodes=species,
        n_recurrences=2,  # JAX MD's default
        mlp_sizes=(32, 32),
        format=partition.Sparse,
        capacity_multiplier=1.0,
        disable_cell_list=True,
    )
    neighbor = neighbor_fn.allocate(_cluster(1.0, 1))
    batches = {
        "padded": _batch(neighbor, displacement, (1.0, 1.22, 1.0, 1.22)),
        "unpadded": _batch(neighbor, displacement, (1.0, 1.0, 1.0, 1.0)),
    }
    assert _padding_edges(batches["padded"], displacement) > 0 == _padding_edges(batches["unpadded"], displacement)
    graphdef, params, rest = nnx.split(energy_fn.model, nnx.Param, ...)

    def loss(params, batch):
        model = nnx.merge(graphdef, params, rest)
        e, de_dr = jax.vmap(jax.value_and_grad(model))(batch["R"], batch["neighbor"])
        forces = -de_dr
        return jnp.mean((e - batch["energy"]) ** 2) / N + jnp.mean(jnp.sum((forces - batch["forces"]) ** 2, -1))

    # Measured (CPU, JAX 0.12, 2026-11-27, `tests/real_models/measure.py jax_md`; errors:
    # loss relative, gradient relative L2, padded / unpadded). At 7e5ce21, segment sums
    # accumulating in half precision (issue 42's bug (1)): float16 loss 9.5e-3 / 9.6e-3,
    # gradient 2.5e-2 / 2.2e-2; bfloat16 loss 2.1e-3 / 1.7e-2, gradient 0.30 / 0.37. With
    # scatter-add in float32 (`measure.py jax_md --float32-scatter-add` at 7e5ce21: float16
    # loss 6.5e-4 / 1.3e-3, gradient 1.2e-3 / 2.5e-3; bfloat16 loss 3.5e-3 / 1.3e-3,
    # gradient 1.7e-2 / 2.3e-2). The tolerances are 3-5x those: at 7e5ce21 the close checks
    # fail in both dtypes. With 62938a7's fix (every accumulation in float32; measured after
    # 9924aae): the same losses, gradients 9.8e-4 / 2.6e-3 (float16), 8.6e-3 / 8.2e-3 (bfloat16).
    tol = {"float16": Tol(loss=5e-3, grad=1e-2), "bfloat16": Tol(loss=1.5e-2, grad=8e-2)}
    return Model("EnergyGraphNet potential (energy + forces)", "jax-md", params, batches, loss, tol)


MODELS = {"graph_network_potential": graph_network_potential}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(MODELS))
def test_jax_md(name, dtype, check):
    run_all_checks(build(MODELS[name]), dtype, check)
