"""A small Vision Transformer built from Equinox layers, shared by the demo and benchmarks.

Patch embedding (a strided ``eqx.nn.Conv2d``), learned position embeddings, pre-LN
blocks (``eqx.nn.LayerNorm`` -> ``eqx.nn.MultiheadAttention`` -> residual,
``eqx.nn.LayerNorm`` -> MLP with GELU -> residual), a final LayerNorm and a linear
head on the cls token or on the mean of the tokens. The model is written for one image
``(C, H, W)``; batch it with ``jax.vmap``. No dtype is hard-coded anywhere, so the
mixed-precision systems decide every dtype.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Hyper-parameters of :class:`ViT`."""

    image_size: int
    channels: int
    patch: int
    width: int
    mlp_hidden: int
    depth: int
    heads: int
    classes: int
    pool: str = "cls"  # "cls" or "mean"


#: The ViT shapes of the MPX paper (arXiv 2507.03312, section 5). The paper gives no
#: head count for "desktop"; 8 heads (head dim 32) is our choice.
SHAPES: dict[str, ViTConfig] = {
    "desktop": ViTConfig(image_size=32, channels=3, patch=4, width=256, mlp_hidden=800, depth=6, heads=8, classes=100),
    "base": ViTConfig(
        image_size=224, channels=3, patch=16, width=768, mlp_hidden=3072, depth=12, heads=12, classes=1000
    ),
}


class _Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, width: int, hidden: int, heads: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(width)
        self.attn = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.ln2 = eqx.nn.LayerNorm(width)
        self.fc1 = eqx.nn.Linear(width, hidden, key=k2)
        self.fc2 = eqx.nn.Linear(hidden, width, key=k3)

    def __call__(self, x: Float[Array, "tokens width"]) -> Float[Array, "tokens width"]:
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.ln2)(x)
        h = jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(h)))
        return x + h


class ViT(eqx.Module):
    """Vision Transformer for one image ``(C, H, W)`` -> logits ``(classes,)``."""

    patch_embed: eqx.nn.Conv2d
    cls_token: Float[Array, "1 width"] | None
    pos_embed: Float[Array, "tokens width"]
    blocks: tuple[_Block, ...]
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    pool: str = eqx.field(static=True)

    def __init__(self, cfg: ViTConfig, *, key: PRNGKeyArray):
        keys = jax.random.split(key, cfg.depth + 4)
        n_patches = (cfg.image_size // cfg.patch) ** 2
        n_tokens = n_patches + (cfg.pool == "cls")
        self.patch_embed = eqx.nn.Conv2d(cfg.channels, cfg.width, cfg.patch, stride=cfg.patch, key=keys[0])
        self.cls_token = 0.02 * jax.random.normal(keys[1], (1, cfg.width)) if cfg.pool == "cls" else None
        self.pos_embed = 0.02 * jax.random.normal(keys[2], (n_tokens, cfg.width))
        self.blocks = tuple(_Block(cfg.width, cfg.mlp_hidden, cfg.heads, key=k) for k in keys[4:])
        self.ln = eqx.nn.LayerNorm(cfg.width)
        self.head = eqx.nn.Linear(cfg.width, cfg.classes, key=keys[3])
        self.pool = cfg.pool

    def __call__(self, image: Float[Array, "channels height width"]) -> Float[Array, " classes"]:
        x = self.patch_embed(image)  # (width, H/p, W/p)
        x = x.reshape(x.shape[0], -1).T  # (patches, width)
        if self.cls_token is not None:
            x = jnp.concatenate([self.cls_token, x], axis=0)
        x = x + self.pos_embed
        for block in self.blocks:
            x = block(x)
        x = jax.vmap(self.ln)(x)
        x = x[0] if self.pool == "cls" else jnp.mean(x, axis=0)
        return self.head(x)


def cross_entropy(logits: Float[Array, "batch classes"], labels: Int[Array, " batch"]) -> Array:
    """Mean softmax cross-entropy (no casts: the mixed-precision system decides dtypes)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def loss_fn(model: ViT, images: Array, labels: Array) -> tuple[Array, Array]:
    """``(mean cross-entropy, accuracy)`` of a batch ``(B, C, H, W)``, ``(B,)``."""
    logits = jax.vmap(model)(images)
    acc = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
    return cross_entropy(logits, labels), acc


def synthetic_batch(cfg: ViTConfig, batch: int, *, key: PRNGKeyArray) -> tuple[Array, Array]:
    """A random float32 image batch ``(B, C, H, W)`` and int32 labels ``(B,)``."""
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (batch, cfg.channels, cfg.image_size, cfg.image_size))
    y = jax.random.randint(ky, (batch,), 0, cfg.classes)
    return x, y
