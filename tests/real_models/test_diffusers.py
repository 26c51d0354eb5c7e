"""A diffusion model: Hugging Face diffusers' Flax UNet with its DDPM training loss, under ``amp``.

``diffusers.FlaxUNet2DConditionModel`` (the Stable Diffusion UNet; diffusers 0.39, the last
release that ships the Flax models) from a tiny config with random weights
(``init_weights``, nothing downloaded), one resolution and no mid block to keep the lane
fast: a cross-attention down block and up block (spatial transformers: GroupNorm,
self-attention, cross-attention to the text states, GEGLU feed-forward), ResNet blocks
with the sinusoidal timestep embedding, skip connections. The loss is diffusers'
``train_text_to_image_flax.py`` step: ``FlaxDDPMScheduler.add_noise`` (scaled-linear betas,
1000 steps) at random timesteps, the UNet predicts the noise from the noisy latents and
the text states, mean squared error against the noise.

The UNet takes no mask: the padded and unpadded batches are the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from diffusers import FlaxDDPMScheduler, FlaxUNet2DConditionModel
from harness import CHECKS, HALF, Model, Tol, build, run_all_checks

B, C, SIZE, TEXT, WIDTH = 2, 4, 16, 8, 32


def unet() -> Model:
    unet = FlaxUNet2DConditionModel(
        sample_size=SIZE,
        in_channels=C,
        out_channels=C,
        down_block_types=("CrossAttnDownBlock2D",),
        up_block_types=("CrossAttnUpBlock2D",),
        block_out_channels=(32,),  # GroupNorm's 32 groups
        mid_block_type=None,
        layers_per_block=1,
        attention_head_dim=8,
        cross_attention_dim=WIDTH,
        dtype=jnp.float32,
    )
    params = jax.jit(unet.init_weights)(jax.random.key(0))  # one compilation, not op by op
    scheduler = FlaxDDPMScheduler(
        num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012
    )
    state = scheduler.create_state()
    keys = jax.random.split(jax.random.key(1), 4)
    batch = dict(
        latents=jax.random.normal(keys[0], (B, C, SIZE, SIZE)),
        noise=jax.random.normal(keys[1], (B, C, SIZE, SIZE)),
        timesteps=jax.random.randint(keys[2], (B,), 0, 1000),
        text=jax.random.normal(keys[3], (B, TEXT, WIDTH)),
    )

    def loss(params, batch):
        noisy = scheduler.add_noise(state, batch["latents"], batch["noise"], batch["timesteps"])
        pred = unet.apply({"params": params}, noisy, batch["timesteps"], batch["text"], train=False).sample
        return jnp.mean((pred - batch["noise"]) ** 2)

    # Measured (CPU, JAX 0.12, 2026-11-27, `tests/real_models/measure.py diffusers`): float16
    # loss 2.5e-5, gradient 1.8e-3; bfloat16 loss 4.8e-5, gradient 1.0e-2. Tolerances 3-5x,
    # but bfloat16's loss 1e-3: on 2026-11-28's machine (AMD EPYC with AVX-512) the code of
    # 1f99ca6, which gave 4.8e-5 the day before, gives 2.3e-4 (float32's own loss moved by 3e-7
    # between the two machines, and by 5e-7 with XLA's --xla_cpu_max_isa=AVX2: which rounding
    # a bfloat16 activation falls on follows), 3 % of bfloat16's epsilon in either case.
    tol = {"float16": Tol(loss=1e-4, grad=8e-3), "bfloat16": Tol(loss=1e-3, grad=4e-2)}
    return Model(
        "FlaxUNet2DConditionModel + DDPM loss (tiny)",
        "diffusers",
        params,
        {"padded": batch, "unpadded": batch},
        loss,
        tol,
    )


MODELS = {"unet": unet}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(MODELS))
def test_diffusers(name, dtype, check):
    run_all_checks(build(MODELS[name]), dtype, check)
