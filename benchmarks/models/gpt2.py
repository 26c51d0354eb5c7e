"""The GPU benchmark's GPT: a GPT-2-style causal transformer (pre-LN, GELU MLP, tied
input/output embedding), at GPT-2 small's size and at 1B parameters (:mod:`benchmarks.models.train_steps`
builds its training steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-2-style causal transformer (pre-LN, GELU MLP, tied input/output embedding)."""

    vocab: int
    seq: int
    width: int
    depth: int
    heads: int


GPT2_SMALL = GPTConfig(vocab=50257, seq=1024, width=768, depth=12, heads=12)
# 1B parameters: 16 x 12 x 2048^2 in the blocks (805 M), 103 M in the tied embedding, 4 M positions
GPT_1B = GPTConfig(vocab=50257, seq=2048, width=2048, depth=16, heads=16)


class _GPTBlock(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, width: int, heads: int, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(width)
        self.attn = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.ln2 = eqx.nn.LayerNorm(width)
        self.fc1 = eqx.nn.Linear(width, 4 * width, key=k2)
        self.fc2 = eqx.nn.Linear(4 * width, width, key=k3)

    def __call__(self, x, mask):
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=mask)
        return x + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(jax.vmap(self.ln2)(x))))


class GPT(eqx.Module):
    """Causal language model for one sequence of token ids ``(T,)`` -> logits ``(T, vocab)``."""

    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: tuple[_GPTBlock, ...]
    ln: eqx.nn.LayerNorm

    def __init__(self, cfg: GPTConfig, *, key):
        keys = jax.random.split(key, cfg.depth + 2)
        self.embed = eqx.nn.Embedding(cfg.vocab, cfg.width, key=keys[0])
        self.pos = 0.01 * jax.random.normal(keys[1], (cfg.seq, cfg.width))
        self.blocks = tuple(_GPTBlock(cfg.width, cfg.heads, key=k) for k in keys[2:])
        self.ln = eqx.nn.LayerNorm(cfg.width)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens) + self.pos[: tokens.shape[0]]
        mask = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0]), bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.ln)(x) @ self.embed.weight.T
