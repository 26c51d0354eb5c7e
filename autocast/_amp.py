"""`amp`: the automatic-mixed-precision transform."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _dtypes, _nnx
from ._interpreter import Context, eval_jaxpr
from ._options import AmpKwargs, AmpOptions, takes_amp_options

_CACHE_SIZE = 32


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or _compat.is_tracer(x)


def _partition(
    tree: Any, is_array: Callable[[Any], bool] = _is_array
) -> tuple[Any, tuple[bool, ...], list[Any], tuple[Any, ...]]:
    """`tree`'s treedef, which leaves are arrays (traced), the array leaves and the other
    leaves (static, as in `equinox.filter_jit`)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    mask = tuple(is_array(x) for x in leaves)
    return treedef, mask, [x for x, m in zip(leaves, mask) if m], tuple(x for x, m in zip(leaves, mask) if not m)


def _combine(treedef: Any, mask: Sequence[bool], dynamic: Sequence[Any], static: Sequence[Any]) -> Any:
    """The inverse of `_partition`."""
    it_dyn, it_static = iter(dynamic), iter(static)
    return jax.tree_util.tree_unflatten(treedef, [next(it_dyn) if m else next(it_static) for m in mask])


class _Traced:
    """A traced-and-transformed function for one input signature."""

    __slots__ = ("transformed", "out_tree", "out_static", "out_dynamic_mask", "jitted")

    def __init__(self, transformed, out_tree, out_static, out_dynamic_mask):
        self.transformed = transformed
        self.out_tree = out_tree
        self.out_static = out_static
        self.out_dynamic_mask = out_dynamic_mask
        self.jitted = None


class _AmpFunction:
    """The callable `amp` returns; see `amp`."""

    def __init__(self, fn: Callable, options: AmpOptions):
        self.fn = fn
        self.options = options
        self._cache: collections.OrderedDict = collections.OrderedDict()
        # amp of fn over NNX's (graphdef, state), made on the first call with NNX objects; that
        # function's own arguments are the split state, never split again (_split_nnx False)
        self._nnx_core: _AmpFunction | None = None
        self._split_nnx = True
        self.trace_count = 0
        """How many times ``fn`` has been traced (re-calls with one signature reuse it)."""
        functools.update_wrapper(self, fn)

    def __get__(self, instance, owner=None):  # methods: amp-decorated in a class body
        if instance is None:
            return self
        return functools.partial(self, instance)

    def __call__(self, *args, **kwargs):
        if self._split_nnx and _nnx.holds_graph_nodes(self.fn, args, kwargs):
            # Flax NNX objects: their state updates are written back (autocast/_nnx.py)
            if self._nnx_core is None:
                self._nnx_core = _AmpFunction(_nnx.pure(self.fn), self.options)
                self._nnx_core._split_nnx = False
            return _nnx.call(self.fn, self._nnx_core, args, kwargs)
        treedef, dynamic_mask, dynamic, static = _partition((args, kwargs))
        scopes = _compat.scope_names(_compat.current_name_stack())
        avals = tuple(_compat.typeof(x) for x in dynamic)
        key = (treedef, dynamic_mask, avals, static, scopes)
        try:
            hash(key)
        except TypeError:
            key = None
        traced = self._cache.get(key) if key is not None else None
        if traced is None:
            traced = self._trace(treedef, dynamic_mask, static, dynamic, scopes)
            # A function closing over an outer trace's values is only valid in that trace.
            if key is not None and not any(_compat.is_tracer(c) for c in traced.transformed.consts):
                self._cache[key] = traced
                if len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if any(_compat.is_tracer(x) for x in dynamic):
            out_dynamic = _as_arrays(_compat.jaxpr_as_fun(traced.transformed)(*dynamic), traced.transformed)
        else:
            if traced.jitted is None:
                traced.jitted = jax.jit(_compat.jaxpr_as_fun(traced.transformed))
            out_dynamic = traced.jitted(*dynamic)
        return _combine(traced.out_tree, traced.out_dynamic_mask, out_dynamic, traced.out_static)

    def _trace(self, treedef, dynamic_mask, static, dynamic, scopes) -> _Traced:
        self.trace_count += 1
        out_info: dict[Any, Any] = {}

        def flat_fn(*dyn):
            args, kwargs = _combine(treedef, dynamic_mask, dyn, static)
            out = self.fn(*args, **kwargs)
            out_leaves, out_tree = jax.tree_util.tree_flatten(out)
            mask = tuple(_is_array(x) for x in out_leaves)
            out_info.update(tree=out_tree, mask=mask, static=tuple(x for x, m in zip(out_leaves, mask) if not m))
            return [x for x, m in zip(out_leaves, mask) if m]

        closed = jax.make_jaxpr(flat_fn)(*dynamic)
        transformed = _transform(closed, scopes, self.options.context())
        return _Traced(transformed, out_info["tree"], out_info["static"], out_info["mask"])

    def __repr__(self) -> str:
        return f"amp({getattr(self.fn, '__name__', self.fn)!r}, compute_dtype={self.options.dtype.name})"


def _as_arrays(outs: list[Any], closed: Any) -> list[Any]:
    """Outputs that evaluating the jaxpr gives as Python or NumPy scalars (a constant `fn`
    returns, a literal of the jaxpr: Equinox BatchNorm's `first_time` flag, `False`, in
    the state it returns) as the arrays of their traced dtype that `fn` returned."""
    return [
        x if _compat.is_tracer(x) or isinstance(x, jax.Array) else jnp.asarray(x, dtype=v.aval.dtype)
        for x, v in zip(outs, closed.jaxpr.outvars)
    ]


def _transform(closed: Any, scopes: tuple[str, ...], ctx: Context) -> Any:
    """The closed jaxpr of `closed` re-evaluated in `ctx` (made by
    `AmpOptions.context`; for `autocast.explain`, one with an observer)."""
    jaxpr, consts = closed.jaxpr, closed.consts
    in_avals = [v.aval for v in jaxpr.invars]
    out_dtypes = [v.aval.dtype for v in jaxpr.outvars]

    def run(*args):
        out32 = [d == _dtypes.FLOAT32 for d in out_dtypes]
        outs, _ = eval_jaxpr(ctx, jaxpr, consts, args, [True] * len(args), scopes, out32)
        return [_dtypes.cast(x, d) if _dtypes.is_castable(d) else x for x, d in zip(outs, out_dtypes)]

    new_jaxpr, new_consts = _compat.trace_to_jaxpr(run, in_avals)
    return _compat.close_jaxpr(new_jaxpr, new_consts)


@takes_amp_options
def amp(fn: Callable | None = None, **options: Unpack[AmpKwargs]) -> Any:
    """Run `fn` in mixed precision.

    `amp` traces `fn` to a jaxpr over the array leaves of its arguments (other leaves,
    such as an Equinox module's activation function, are static, as in
    `equinox.filter_jit`) and re-evaluates it equation by equation with the rule
    `amp_policy` gives for each: by default matmuls and convolutions run in
    `compute_dtype`, numerically sensitive operations in float32 and everything else in
    the dtype its inputs arrive in. The bodies of nested `jit`, `scan`, `while`,
    `cond`, `checkpoint`, `custom_jvp`/`custom_vjp` and `shard_map` are
    transformed too. Outputs come back in the dtypes `fn` returns. Integers, booleans,
    PRNG keys, float64 and complex values are never cast. Flax NNX modules among the
    arguments (or `fn` itself) keep the state they update as they run (BatchNorm
    statistics, RNG counters), in its own dtypes.

    Args:
        fn: The function. Omit it to get a decorator: `@amp(compute_dtype="bfloat16")`.
        compute_dtype: `float16` (default), `bfloat16` or `float32` (a dtype or a string
            such as `"bf16"`); `float32` makes `amp` an exact identity, for A/B debugging.
        amp_policy: A mapping from primitives or `jax.named_scope` names to rules; default
            `autocast.default_amp_policy`. See `autocast.extend_policy`.
        remat_float32: Whether each run of float32 operations (an "island": a softmax, a
            layer norm, GELU) is recomputed in the backward pass instead of saving its
            float32 intermediates. `"auto"` (default): only where its float32
            intermediates are at least 1.75 times the bytes of its float inputs (islands
            fed by half-precision activations; not an LSTM cell that updates a float32
            carry). `True`: every island. `False`: none. A recomputed island also
            recomputes the matmuls that read it (their half-precision operand is not kept)
            and a product of two activations only it reads (attention's scores before the
            softmax: recomputed from `q` and `k`, never kept). A fused attention kernel
            (`attention="auto"`) is recomputed the same way: `True` always, `"auto"` for
            padded sequences, `False` never. `"matmuls"`: every island and kernel, and
            the matmuls between two recomputed steps with them (an MLP's up-projection
            between its norm and GELU; q, k, v between a norm and the attention), each
            block's chain recomputed from its inputs: about a fifth more matmul FLOPs for
            the least memory (GPT-2 small's v5e step 0.20x MPX's temp, docs/tpu.md).
        weight_grad_dtype: The dtype in which the gradient of a matmul operand narrowed
            from float32 (a parameter) leaves the matmul, and so the dtype of every
            reduction after it (data-parallel all-reduce, FSDP reduce-scatter, `psum`, a
            scan's accumulation). `"float32"` (default): the half-precision matmul writes
            a float32 result. `"compute"`: the compute dtype, halving the bytes of those
            reductions at the cost of rounding each partial sum (FSDP2's `reduce_dtype`).
        custom_vjp_bwd: How the backward rule of a `jax.custom_vjp` inside `fn` runs.
            `"amp"` (default, as PyTorch's `custom_bwd`): under the forward's policy
            (traced in the dtypes JAX would give it, then re-evaluated with the same rules
            on the residuals and cotangents as they arrive: its matmuls in
            `compute_dtype`, its reductions in float32), so a backward rule that
            recomputes the forward pass (diffrax's checkpointed loops) is as fast as the
            forward. `"original"`: called as written on the residuals and cotangents as
            they arrive.
        attention: Whether attention runs as one fused kernel. `"auto"` (default): each
            attention amp finds and proves to be one `jax.nn.dot_product_attention` call
            (the softmax of `q . k` over the keys, times `v`, with a concrete scale and a
            causal, windowed, length or boolean mask) runs as cuDNN's fused kernel on a
            CUDA GPU, as written elsewhere (docs/attention.md). `"xla"`: never fused.
        loss_head: Whether the loss head is computed on token chunks. `"auto"` (default):
            a projection to a vocabulary whose result only a row-local loss reads (softmax
            cross-entropy, z-loss, label smoothing, soft-capping, masks) down to sums over
            the tokens, with more than 512 MiB of float32 logits, runs as a `lax.scan` over
            token chunks (each chunk's logits recomputed in the backward pass, the loss and
            the weight gradient accumulated in float32), on every platform
            (docs/loss_head.md). `"xla"`: as written. An int: that many chunks (at least;
            the smallest count that divides the token axis), whatever the size.

    Returns:
        A function with `fn`'s signature. Calls with the same argument structure, shapes
            and dtypes reuse the transformed jaxpr.

    Raises:
        TypeError: `fn` is not callable, a keyword is not one of the options above, or
            `amp_policy` is not a mapping from primitives or scope names to rules.
        ValueError: `compute_dtype` is not float16, bfloat16 or float32 (or one of their
            names), or `remat_float32`, `weight_grad_dtype`, `custom_vjp_bwd`,
            `attention` or `loss_head` is not one of the values above.

    Example:
        ```python
        loss = autocast.amp(loss_fn, compute_dtype=jnp.bfloat16)(params, batch)
        assert loss.dtype == jnp.float32  # the dtype loss_fn returns
        assert jnp.allclose(loss, loss_fn(params, batch), rtol=0.02)
        grads = jax.grad(autocast.amp(loss_fn))(params, batch)
        assert grads["w1"].dtype == jnp.float32  # the parameters' dtype
        ```
    """
    opts = AmpOptions.from_kwargs("amp", options)
    if fn is None:
        return functools.partial(amp, **opts.as_kwargs())
    if not callable(fn):
        raise TypeError(
            f"amp(fn={fn!r}): fn must be callable (a function, an Equinox module, ...), got {type(fn).__name__}."
        )
    return _AmpFunction(fn, opts)
