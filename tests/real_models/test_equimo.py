"""Equimo (Equinox vision models) under ``amp``: two of its published image models, built by
their constructors and called as its documentation does (``model(x, key=..., inference=True)``
per image, ``jax.vmap`` over the batch).

- ``VisionTransformer`` with the options of its recent recipes: RoPE positions applied
  inside each attention block (``use_local_pos_embed``), four register tokens, query/key
  normalisation (``qk_norm``) and layer scale (``init_values``); average pooling, linear
  head.
- ``ConvNeXt`` (two stages) with Global Response Normalisation (``use_grn``), its
  ``LayerNorm2d`` blocks and downsamplers.

Images have no padding: the padded and unpadded batches are the same.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from equimo.vision.models.convnext import ConvNeXt
from equimo.vision.models.vit import VisionTransformer
from harness import CHECKS, HALF, Model, Tol, build, run_all_checks

B = 4


def _image_model(name: str, module: eqx.Module, size: int, tol: dict[str, Tol]) -> Model:
    params, static = eqx.partition(module, eqx.is_inexact_array)
    x = jax.random.normal(jax.random.key(1), (B, 3, size, size))
    y = jax.random.randint(jax.random.key(2), (B,), 0, 10)
    batch = dict(x=x, y=y)

    def loss(params, batch):
        model = eqx.combine(params, static)
        logits = jax.vmap(lambda img: model(img, inference=True))(batch["x"])
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))

    return Model(name, "equimo", params, {"padded": batch, "unpadded": batch}, loss, tol)


def vit() -> Model:
    module = VisionTransformer(
        img_size=32,
        in_channels=3,
        dim=64,
        patch_size=8,
        num_heads=4,
        depths=[2],
        num_classes=10,
        use_local_pos_embed=True,
        qk_norm=True,
        init_values=1e-5,
        reg_tokens=4,
        key=jax.random.key(0),
    )
    # From measurement (benchmarks/results/corpus/real-models.md, CPU, JAX 0.12) with 3-5x margin.
    tol = {"float16": Tol(loss=3e-4, grad=2e-3), "bfloat16": Tol(loss=1e-4, grad=1.5e-2)}
    return _image_model("VisionTransformer (RoPE, registers, qk-norm)", module, 32, tol)


def convnext() -> Model:
    module = ConvNeXt(3, depths=[1, 1], dims=[16, 32], use_grn=True, num_classes=10, key=jax.random.key(0))
    tol = {"float16": Tol(loss=3e-4, grad=3e-3), "bfloat16": Tol(loss=2e-3, grad=1.5e-2)}
    return _image_model("ConvNeXt (GRN)", module, 32, tol)


MODELS = {"vit": vit, "convnext": convnext}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(MODELS))
def test_equimo(name, dtype, check):
    run_all_checks(build(MODELS[name]), dtype, check)
