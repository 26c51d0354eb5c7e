"""The GPU benchmark's models and systems: one training step of each, as a function.

Shared by the measured benchmark (:mod:`benchmarks.gpu_measured.gpu`) and the deviceless compiles for a
GPU target (:mod:`benchmarks.gpu_modeled.deviceless`); nothing here measures or compiles.

- models (:data:`MODELS`): ViT-Base (224x224, patch 16, 768/3072, 12 blocks) and the MPX
  paper's "desktop" ViT (``benchmarks/models/vit.py``), a GPT-2-small-sized causal transformer
  (12 blocks, width 768, 12 heads, 1024 tokens, vocabulary 50257, tied embeddings;
  ``benchmarks/models/gpt2.py``), and a
  1B-parameter GPT (16 blocks, width 2048, 16 heads, 2048 tokens) whose parameters and batch
  are shapes only (:attr:`Task.shapes_only`, never materialised unless a measured run asks);
  on request (``--models bert-base``), BERT-base with padded sequences and a masked-language-model
  loss (``benchmarks/models/bert.py``: 512 tokens, lengths 128-512, a key-padding mask);
- systems (:data:`SYSTEMS`): ``fp32``; ``autocast-bf16`` (attention fused where cuDNN takes
  it: docs/attention.md) and ``autocast-bf16-xla-attention`` (the same with
  ``attention="xla"``: every attention as written), ``autocast-f16``
  (dynamic loss scaler) and ``autocast-fp8`` (``policies/fp8.toml``: float8 where the H100 roofline
  says it pays; the smoke models, all too small for that, every matmul); ``autocast-bf16-sr``: amp bf16 with
  the parameters and AdamW's moments stored in bfloat16, updated with stochastic rounding
  (``autocast.optim.to_half_params``, ``autocast.optim.half_state``; docs/memory.md); ``mpx-bf16``, the
  MPX recipe; on request (:data:`EXTRA_SYSTEMS`), ``autocast-bf16-noremat`` and
  ``autocast-bf16-xla-loss-head`` (``loss_head="xla"``: the language-model head and its loss as
  written, where ``autocast-bf16`` chunks them over tokens: issue 49);
- the GPT models' vocabulary (:data:`GPT_MODELS`, :func:`make_task`'s ``vocab``): their own 50,257
  by default, another on request (``--vocab``: Llama 3's 128,256, Gemma's 256,000), the tied
  embedding and the logits sized by it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import autocast
from benchmarks import _common as C
from benchmarks.models import bert
from benchmarks.models.bert import BERT, BERT_BASE, BERTConfig
from benchmarks.models.gpt2 import GPT, GPT2_SMALL, GPT_1B, GPTConfig
from benchmarks.models.vit import SHAPES, ViT, ViTConfig, cross_entropy, synthetic_batch

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
SYSTEMS = (
    "fp32",
    "autocast-bf16",
    "autocast-bf16-xla-attention",
    "autocast-f16",
    "autocast-fp8",
    "autocast-bf16-sr",
    "mpx-bf16",
)
EXTRA_SYSTEMS = (
    "autocast-bf16-noremat",
    "autocast-bf16-remat-matmuls",
    "autocast-bf16-xla-loss-head",
    "autocast-bf16-loss-head-8",
)
"""Built on request only (``--systems``): amp bf16 with ``remat_float32=False`` (no float32
island recomputed in the backward pass: what the recomputation costs in time and saves in
memory), amp bf16 with ``remat_float32="matmuls"`` (every island recomputed, with the matmuls
between two recomputed islands or an island and the fused attention: what recomputing q, k, v
and the MLP's up-projection saves and costs), amp bf16 with ``loss_head="xla"`` (the tokens x vocabulary matmul and its loss
as written: the "before" of the loss-head rewrite, ``autocast-bf16`` its "after"), and amp bf16
with ``loss_head=8`` (eight token chunks: what more chunks than ``"auto"`` takes save and cost)."""

# ----------------------------------------------------------------------------- tasks


@dataclass
class Task:
    """A model, a batch and its loss ``loss(model, batch, ce) -> scalar`` (``ce``: the
    cross-entropy to use, so the MPX recipe can force its loss head to float32).

    ``shapes_only``: the model's arrays and the batch are ``jax.ShapeDtypeStruct`` s (enough
    to compile the step; :meth:`materialise` makes the arrays, for a measured run)."""

    name: str
    description: str
    model: Any
    batch: tuple[Any, ...]
    loss: Callable[..., Any]
    shapes_only: bool = False
    make: Callable[[], Task] | None = None
    # the ``autocast-fp8`` system's ``use_float8(target=...)``: the GPU whose roofline decides
    # per matmul whether float8 pays; None (the smoke sizes, far too small to pay): every matmul
    fp8_target: str | None = "h100"

    def materialise(self) -> Task:
        """This task with real arrays (itself if it has them)."""
        if self.shapes_only and self.make is not None:
            return dataclasses.replace(self.make(), fp8_target=self.fp8_target)
        return self


def is_leaf_array(x: Any) -> bool:
    """An array of a model, materialised or not (``eqx.partition`` 's filter for a task's
    parameters, shapes-only tasks included)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _vit_loss(model, batch, ce=cross_entropy):
    x, y = batch
    return ce(jax.vmap(model)(x), y)


def _gpt_loss(model, batch, ce=cross_entropy):
    (tokens,) = batch
    logits = jax.vmap(model)(tokens[:, :-1])
    return ce(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _bert_loss(model, batch, ce=cross_entropy):
    tokens, lengths, positions, labels = batch
    logits = jax.vmap(model)(tokens, lengths, positions)  # (B, P, vocab): the masked positions
    return ce(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _vit_task(name: str, cfg: ViTConfig, batch: int, *, shapes_only: bool = False) -> Task:
    desc = f"ViT {cfg.image_size}x{cfg.image_size}/{cfg.patch}, width {cfg.width}, MLP {cfg.mlp_hidden}, "
    desc += f"{cfg.depth} blocks, {cfg.heads} heads, {cfg.classes} classes; batch {batch}"
    if shapes_only:
        model = eqx.filter_eval_shape(ViT, cfg, key=jax.random.key(0))
        data = jax.eval_shape(lambda k: synthetic_batch(cfg, batch, key=k), jax.random.key(1))
        return Task(name, desc, model, data, _vit_loss, True, lambda: _vit_task(name, cfg, batch))
    model = eqx.filter_jit(lambda k: ViT(cfg, key=k))(jax.random.key(0))
    return Task(name, desc, model, synthetic_batch(cfg, batch, key=jax.random.key(1)), _vit_loss)


def _gpt_task(name: str, cfg: GPTConfig, batch: int, *, shapes_only: bool = False) -> Task:
    desc = f"GPT: vocabulary {cfg.vocab}, {cfg.seq} tokens, width {cfg.width}, {cfg.depth} blocks, "
    desc += f"{cfg.heads} heads; batch {batch}"
    if shapes_only:
        model = eqx.filter_eval_shape(GPT, cfg, key=jax.random.key(0))
        n = sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(model, is_leaf_array)))
        desc += f"; {n / 1e9:.2f} B parameters (shapes only)"
        tokens = jax.ShapeDtypeStruct((batch, cfg.seq + 1), jnp.int32)
        return Task(name, desc, model, (tokens,), _gpt_loss, True, lambda: _gpt_task(name, cfg, batch))
    model = eqx.filter_jit(lambda k: GPT(cfg, key=k))(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (batch, cfg.seq + 1), 0, cfg.vocab)
    return Task(name, desc, model, (tokens,), _gpt_loss)


def _bert_task(name: str, cfg: BERTConfig, batch: int, *, shapes_only: bool = False) -> Task:
    desc = f"BERT (post-LN): vocabulary {cfg.vocab}, {cfg.seq} tokens (lengths {cfg.min_length}-{cfg.seq}, "
    desc += f"key-padding mask), width {cfg.width}, MLP {cfg.mlp_hidden}, {cfg.depth} blocks, {cfg.heads} heads, "
    desc += f"MLM loss on {cfg.predictions} positions a sequence; batch {batch}"
    if shapes_only:
        model = eqx.filter_eval_shape(BERT, cfg, key=jax.random.key(0))
        data = jax.eval_shape(lambda k: bert.synthetic_batch(cfg, batch, key=k), jax.random.key(1))
        return Task(name, desc, model, data, _bert_loss, True, lambda: _bert_task(name, cfg, batch))
    model = eqx.filter_jit(lambda k: BERT(cfg, key=k))(jax.random.key(0))
    return Task(name, desc, model, bert.synthetic_batch(cfg, batch, key=jax.random.key(1)), _bert_loss)


def _vocab(cfg: GPTConfig, vocab: int | None) -> GPTConfig:
    """``cfg`` with another vocabulary (None: its own)."""
    return cfg if vocab is None else dataclasses.replace(cfg, vocab=vocab)


# model name -> factory(shapes_only=...): the task, its arrays made or shapes only (the 1B GPT:
# always shapes only; Task.materialise makes them); the GPT models' also take vocab=
MODELS: dict[str, Callable[..., Task]] = {
    "vit-base": lambda shapes_only=False: _vit_task("vit-base", SHAPES["base"], 64, shapes_only=shapes_only),
    "vit-desktop": lambda shapes_only=False: _vit_task("vit-desktop", SHAPES["desktop"], 256, shapes_only=shapes_only),
    "gpt2-small": lambda shapes_only=False, vocab=None: _gpt_task(
        "gpt2-small", _vocab(GPT2_SMALL, vocab), 8, shapes_only=shapes_only
    ),
    "gpt-1b": lambda shapes_only=True, vocab=None: _gpt_task("gpt-1b", _vocab(GPT_1B, vocab), 8, shapes_only=True),
    "bert-base": lambda shapes_only=False: _bert_task("bert-base", BERT_BASE, 16, shapes_only=shapes_only),
}
GPT_MODELS = ("gpt2-small", "gpt-1b")
"""The models whose vocabulary :func:`make_task` (``--vocab``) sets."""
# what a run without --models covers: the measured benchmark leaves out the 1B GPT unless asked
# (--models gpt-1b makes its parameters; its float32 step needs 114 GiB before XLA:GPU's
# rematerialisation recomputes it down to 71 GiB); the deviceless --target run compiles it from shapes
DEFAULT_MODELS = ("vit-base", "vit-desktop", "gpt2-small")
TARGET_MODELS = (*DEFAULT_MODELS, "gpt-1b")


def _every_matmul_in_fp8(factory: Callable[..., Task]) -> Callable[..., Task]:
    """A smoke model: tiny, so the fp8 system's cost check would keep every matmul in bf16;
    off, its float8 path runs."""
    return lambda **kw: dataclasses.replace(factory(**kw), fp8_target=None)


SMOKE_MODELS: dict[str, Callable[..., Task]] = {
    "vit-base": lambda shapes_only=False: _vit_task(
        "vit-base",
        ViTConfig(image_size=8, channels=3, patch=4, width=32, mlp_hidden=64, depth=1, heads=2, classes=10),
        4,
        shapes_only=shapes_only,
    ),
    "vit-desktop": lambda shapes_only=False: _vit_task(
        "vit-desktop",
        ViTConfig(image_size=8, channels=3, patch=2, width=16, mlp_hidden=32, depth=1, heads=2, classes=10),
        2,
        shapes_only=shapes_only,
    ),
    "gpt2-small": lambda shapes_only=False, vocab=None: _gpt_task(
        "gpt2-small", GPTConfig(vocab=vocab or 64, seq=16, width=32, depth=1, heads=2), 2, shapes_only=shapes_only
    ),
    "gpt-1b": lambda shapes_only=True, vocab=None: _gpt_task(
        "gpt-1b", GPTConfig(vocab=vocab or 64, seq=16, width=32, depth=2, heads=2), 2, shapes_only=True
    ),
    "bert-base": lambda shapes_only=False: _bert_task(
        "bert-base",
        BERTConfig(vocab=64, seq=16, width=32, depth=1, heads=2, mlp_hidden=64, predictions=3, min_length=4),
        2,
        shapes_only=shapes_only,
    ),
}
SMOKE_MODELS = {name: _every_matmul_in_fp8(factory) for name, factory in SMOKE_MODELS.items()}


def make_task(model: str, *, smoke: bool = False, shapes_only: bool | None = None, vocab: int | None = None) -> Task:
    """The task of ``model`` (:data:`MODELS`, or :data:`SMOKE_MODELS` with ``smoke``).

    Args:
        model: a key of :data:`MODELS`.
        smoke: the tiny sizes of the smoke runs.
        shapes_only: the model's arrays and batch as shapes only (None: the factory's default).
        vocab: the vocabulary of a GPT model (:data:`GPT_MODELS`); None: the model's own.

    Returns:
        The task.

    Raises:
        ValueError: ``vocab`` given for a model without a vocabulary, or below 2.

    Example::

        task = make_task("gpt2-small", shapes_only=True, vocab=128_256)  # Llama 3's vocabulary
    """
    kw: dict[str, Any] = {} if shapes_only is None else {"shapes_only": shapes_only}
    if vocab is not None:
        if model not in GPT_MODELS:
            raise ValueError(f"vocab: only the GPT models {list(GPT_MODELS)} have one; got model {model!r}")
        if vocab < 2:
            raise ValueError(f"vocab: got {vocab}; must be an integer >= 2")
        kw["vocab"] = vocab
    return (SMOKE_MODELS if smoke else MODELS)[model](**kw)


def vocab_tag(vocab: int | None) -> str:
    """``-vocab<N>``: what the reports' and saved steps' file names carry of ``--vocab`` ('' without it)."""
    return "" if vocab is None else f"-vocab{vocab}"


# ----------------------------------------------------------------------------- systems


@dataclass
class System:
    """``step(params, opt_state, scaler, batch) -> (params, opt_state, scaler, loss, grads)``:
    one training step that also returns its (unscaled) gradient."""

    name: str
    step: Callable[..., Any]
    scaler: Any = None
    context: Callable[[], Any] = field(default=contextlib.nullcontext)
    # how the system stores the parameters (float32 master: as they are) and the optimizer
    # whose ``init`` makes its state (None: the one ``build_system`` was given)
    store_params: Callable[[Any], Any] = lambda p: p
    optimizer: Any = None

    def init(self, params: Any, opt: Any) -> tuple[Any, Any]:
        """The stored parameters and the optimizer state (arrays or shapes only)."""
        stored = jax.eval_shape(self.store_params, params) if _shapes_only(params) else self.store_params(params)
        init = (self.optimizer or opt).init
        return stored, jax.eval_shape(init, stored) if _shapes_only(params) else init(stored)


def _shapes_only(tree: Any) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(tree))


def mpx_available() -> bool:
    return importlib.util.find_spec("mpx") is not None


def _apply(opt, params, opt_state, grads):
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def build_system(name: str, task: Task, static: Any, opt: Any) -> System:
    """System ``name`` (one of ``SYSTEMS``) for ``task``."""
    if name == "fp32":

        def step(p, opt_state, scaler, batch):
            loss, g = jax.value_and_grad(lambda q: task.loss(eqx.combine(q, static), batch))(p)
            p, opt_state = _apply(opt, p, opt_state, g)
            return p, opt_state, scaler, loss, g

        return System(name, step)
    if name == "autocast-bf16-sr":
        half_opt = autocast.optim.half_state(opt)
        # the loss widens the stored model first, as docs/memory.md shows (Equinox's
        # convolutions need equal dtypes); amp runs its matmuls in bfloat16 again
        loss_fn = lambda model, batch: task.loss(autocast.optim.to_float32_params(model), batch)  # noqa: E731
        gfn = autocast.dynamic_scale_value_and_grad(autocast.amp(loss_fn, compute_dtype=BF16))

        def step(p, opt_state, scaler, batch):
            model = eqx.combine(p, static)
            scaler, (loss, grads) = gfn(model, batch, dynamic_scaler_state=scaler)
            # the parameters' rounding key: derived from the state's, which is split every step
            key = jax.random.fold_in(opt_state.key, 1)
            model, opt_state = autocast.optimizer_update(
                model, half_opt, opt_state, grads, scaler.grads_finite, key=key
            )
            return eqx.filter(model, eqx.is_array), opt_state, scaler, loss, eqx.filter(grads, eqx.is_array)

        return System(
            name, step, autocast.NoOpScalerState(), store_params=autocast.optim.to_half_params, optimizer=half_opt
        )
    if name.startswith("autocast"):
        dtype = {"autocast-f16": F16}.get(name, BF16)
        if name not in SYSTEMS + EXTRA_SYSTEMS:
            raise ValueError(f"system {name!r} unknown; allowed: {list(SYSTEMS + EXTRA_SYSTEMS)}")
        policy = None
        if name == "autocast-fp8":  # the shipped float8 policy, its cost check for the task's GPU
            rule = autocast.use_float8(target=task.fp8_target)
            policy = autocast.extend_policy({jax.lax.dot_general_p: rule}, base=autocast.load_policy("fp8"))
        remat = {"autocast-bf16-noremat": False, "autocast-bf16-remat-matmuls": "matmuls"}.get(name, "auto")
        attention = "xla" if name == "autocast-bf16-xla-attention" else "auto"
        loss_head = {"autocast-bf16-xla-loss-head": "xla", "autocast-bf16-loss-head-8": 8}.get(name, "auto")
        amp_loss = autocast.amp(
            task.loss,
            compute_dtype=dtype,
            amp_policy=policy,
            remat_float32=remat,
            attention=attention,
            loss_head=loss_head,
        )
        gfn = autocast.dynamic_scale_value_and_grad(amp_loss)

        def step(p, opt_state, scaler, batch):
            model = eqx.combine(p, static)
            scaler, (loss, grads) = gfn(model, batch, dynamic_scaler_state=scaler)
            model, opt_state = autocast.optimizer_update(model, opt, opt_state, grads, scaler.grads_finite)
            return eqx.filter(model, eqx.is_array), opt_state, scaler, loss, eqx.filter(grads, eqx.is_array)

        scaler = autocast.DynamicScalerState() if dtype == F16 else autocast.NoOpScalerState()
        return System(name, step, scaler)
    if name == "mpx-bf16":
        import mpx

        ce = mpx.force_full_precision(cross_entropy, F32)

        def f(model, batch):
            model, batch = mpx.cast_to_half_precision((model, batch))
            return task.loss(model, batch, ce)

        def step(p, opt_state, scaler, batch):
            model = eqx.combine(p, static)
            loss, scaler, finite, grads = mpx.filter_value_and_grad(f, scaler)(model, batch)
            model, opt_state = mpx.optimizer_update(model, opt, opt_state, grads, finite)
            return eqx.filter(model, eqx.is_array), opt_state, scaler, loss, eqx.filter(grads, eqx.is_array)

        scaler = mpx.DynamicLossScaling(
            loss_scaling=jnp.asarray(2.0**15, F32), min_loss_scaling=jnp.asarray(1.0, F32), period=2000
        )
        return System(name, step, scaler, functools.partial(C.mpx_half_dtype, BF16))
    raise ValueError(f"system {name!r} unknown; allowed: {list(SYSTEMS + EXTRA_SYSTEMS)}")
