"""The character-level GPT of ``benchmarks/accuracy/char_gpt.py`` (and of the optimizer-memory
benchmark): pre-LN, token and position embeddings, causal ``eqx.nn.MultiheadAttention``, GELU
MLP, a final LayerNorm and an untied head, written for float32 with no dtype anywhere.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import autocast

VOCAB = 128


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of :class:`GPT`."""

    d_model: int = 64
    layers: int = 2
    heads: int = 4
    seq: int = 64
    mlp_ratio: int = 4
    vocab: int = VOCAB


class _Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, cfg: GPTConfig, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(cfg.d_model)
        self.attn = eqx.nn.MultiheadAttention(cfg.heads, cfg.d_model, key=k1)
        self.ln2 = eqx.nn.LayerNorm(cfg.d_model)
        self.fc1 = eqx.nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, key=k2)
        self.fc2 = eqx.nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, key=k3)

    def __call__(self, x, mask):
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=mask)
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(h)))


class GPT(eqx.Module):
    """Decoder-only transformer: tokens ``(seq,)`` -> logits ``(seq, vocab)``."""

    tok: jax.Array
    pos: jax.Array
    blocks: tuple[_Block, ...]
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, cfg: GPTConfig, *, key):
        keys = jax.random.split(key, cfg.layers + 3)
        self.tok = 0.02 * jax.random.normal(keys[0], (cfg.vocab, cfg.d_model))
        self.pos = 0.02 * jax.random.normal(keys[1], (cfg.seq, cfg.d_model))
        self.blocks = tuple(_Block(cfg, key=k) for k in keys[3:])
        self.ln = eqx.nn.LayerNorm(cfg.d_model)
        self.head = eqx.nn.Linear(cfg.d_model, cfg.vocab, key=keys[2])

    def __call__(self, tokens):
        n = tokens.shape[0]
        x = self.tok[tokens] + self.pos[:n]
        mask = jnp.tril(jnp.ones((n, n), bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.head)(jax.vmap(self.ln)(x))


def loss_fn(model: GPT, batch: jax.Array) -> jax.Array:
    """Mean next-character cross-entropy (nats) of a batch ``(B, seq + 1)`` of byte ids."""
    model = autocast.optim.to_float32_params(model)  # written for float32: amp decides the dtypes
    logits = jax.vmap(model)(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
