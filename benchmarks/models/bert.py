"""The GPU benchmark's BERT: a BERT-base-style encoder (Devlin et al. 2019) with padded
sequences, trained with a masked-language-model loss (:mod:`benchmarks.models.train_steps`
builds its training steps).

Post-LN blocks (``LayerNorm(x + attention(x))``, ``LayerNorm(x + MLP(x))``, exact GELU),
learned token, position and segment embeddings summed and layer-normed, Equinox's
``MultiheadAttention`` with a key-padding mask built from each sequence's length
(``arange(S) < length``: the padded keys are masked for every query), and the MLM head of
BERT (dense + GELU + LayerNorm, then the tied word embedding and an output bias) read at
the masked positions only. No dropout (the benchmark compares kernels, and attention
dropout keeps ``amp`` from fusing the attention). No dtype is hard-coded: the
mixed-precision systems decide every dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp

MASK_TOKEN = 3
"""The id the masked positions are replaced with in the input (BERT's ``[MASK]``; any
fixed id of the vocabulary: the synthetic tokens carry no meaning)."""


@dataclass(frozen=True)
class BERTConfig:
    """A post-LN BERT encoder and its masked-language-model batch."""

    vocab: int
    seq: int
    width: int
    depth: int
    heads: int
    mlp_hidden: int
    predictions: int  # masked positions per sequence (BERT: max_predictions_per_seq)
    min_length: int  # the synthetic batch's lengths are uniform in [min_length, seq]


# BERT-base (110 M parameters) at 512 tokens, as in BERT's second pre-training phase (20 of
# the 512 positions predicted: 15 % of the shortest sequence, 128 tokens)
BERT_BASE = BERTConfig(
    vocab=30522, seq=512, width=768, depth=12, heads=12, mlp_hidden=3072, predictions=20, min_length=128
)


class _BERTBlock(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    ln1: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    ln2: eqx.nn.LayerNorm

    def __init__(self, width: int, hidden: int, heads: int, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.ln1 = eqx.nn.LayerNorm(width)
        self.fc1 = eqx.nn.Linear(width, hidden, key=k2)
        self.fc2 = eqx.nn.Linear(hidden, width, key=k3)
        self.ln2 = eqx.nn.LayerNorm(width)

    def __call__(self, x, mask):
        x = jax.vmap(self.ln1)(x + self.attn(x, x, x, mask=mask))
        h = jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(x), approximate=False))
        return jax.vmap(self.ln2)(x + h)


class BERT(eqx.Module):
    """Masked-language model for one padded sequence: ``(tokens (S,), length, positions
    (P,))`` -> the logits ``(P, vocab)`` of the masked positions."""

    embed: eqx.nn.Embedding
    pos: jax.Array
    segment: jax.Array
    ln: eqx.nn.LayerNorm
    blocks: tuple[_BERTBlock, ...]
    head: eqx.nn.Linear
    head_ln: eqx.nn.LayerNorm
    out_bias: jax.Array

    def __init__(self, cfg: BERTConfig, *, key):
        keys = jax.random.split(key, cfg.depth + 4)
        self.embed = eqx.nn.Embedding(cfg.vocab, cfg.width, key=keys[0])
        self.pos = 0.02 * jax.random.normal(keys[1], (cfg.seq, cfg.width))
        self.segment = 0.02 * jax.random.normal(keys[2], (2, cfg.width))
        self.ln = eqx.nn.LayerNorm(cfg.width)
        self.blocks = tuple(_BERTBlock(cfg.width, cfg.mlp_hidden, cfg.heads, key=k) for k in keys[4:])
        self.head = eqx.nn.Linear(cfg.width, cfg.width, key=keys[3])
        self.head_ln = eqx.nn.LayerNorm(cfg.width)
        self.out_bias = jnp.zeros(cfg.vocab)

    def __call__(self, tokens, length, positions):
        s = tokens.shape[0]
        x = jax.vmap(self.embed)(tokens) + self.pos[:s] + self.segment[0]
        x = jax.vmap(self.ln)(x)
        # key padding: every query sees the keys before the sequence's length only
        mask = jnp.broadcast_to(jnp.arange(s)[None, :] < length, (s, s))
        for block in self.blocks:
            x = block(x, mask)
        h = x[positions]  # (P, width): the masked positions only
        h = jax.vmap(self.head_ln)(jax.nn.gelu(jax.vmap(self.head)(h), approximate=False))
        return h @ self.embed.weight.T + self.out_bias


def synthetic_batch(cfg: BERTConfig, batch: int, *, key) -> tuple[jax.Array, ...]:
    """A random MLM batch: ``(tokens (B, S), lengths (B,), positions (B, P), labels (B, P))``,
    int32. Lengths uniform in ``[min_length, seq]``; tokens past a length are padding (id 0);
    ``predictions`` distinct positions below each length are masked (their input token
    replaced by :data:`MASK_TOKEN`) and their original tokens are the labels."""
    k1, k2, k3 = jax.random.split(key, 3)
    lengths = jax.random.randint(k1, (batch,), cfg.min_length, cfg.seq + 1)
    tokens = jax.random.randint(k2, (batch, cfg.seq), 4, cfg.vocab)
    tokens = jnp.where(jnp.arange(cfg.seq)[None, :] < lengths[:, None], tokens, 0)

    def pick(k, n):  # distinct positions below n: the first P of a random order of [0, n)
        order = jnp.argsort(jnp.where(jnp.arange(cfg.seq) < n, jax.random.uniform(k, (cfg.seq,)), 2.0))
        return order[: cfg.predictions]

    positions = jax.vmap(pick)(jax.random.split(k3, batch), lengths).astype(jnp.int32)
    labels = jnp.take_along_axis(tokens, positions, axis=1)
    tokens = jax.vmap(lambda t, p: t.at[p].set(MASK_TOKEN))(tokens, positions)
    return tokens.astype(jnp.int32), lengths.astype(jnp.int32), positions, labels.astype(jnp.int32)
