"""float8 matmuls: a policy rule that runs eligible `dot_general`s as scaled float8 products.

The rule (categories `fp8` and `fp8_any` of a policy table; `policies/fp8.toml`) plans
like `autocast.use_compute_precision` (an `autocast.Rule` of role `"compute"`)
and binds an eligible `dot_general` itself (`Rule.bind`) as `fp8_dot_general`:

- forward: each operand quantized to `float8_e4m3fn` with its own per-tensor *current*
  scale (`amax / fp8 max`, amax in float32; q 0 where amax is 0; values clipped before the
  cast); a parameter or input as it arrives, a computed operand from the compute-dtype
  value the matmul it replaces would read (so a float32 producer writes half precision
  for the amax and quantizing kernels); viewed as `[batch, rows, contracted]`
  (contracted dimension minor, the layout cuBLASLt's float8 GEMMs read), the fp8 operands
  passed to `lax.dot_general` with the compute dtype as `preferred_element_type` (float32
  accumulation) and the product multiplied by `c * amax_x * amax_w` (the form XLA-GPU
  rewrites into one cuBLASLt fp8 GEMM, the amaxes its scale operands);
- backward (`custom_vjp`): the cotangent quantized to `float8_e5m2` with its own
  scale (padded with zeros to a multiple of 16 first where it is not: both of its float8
  layouts then come from one kernel); both transposed products in fp8 (e5m2 x e4m3) with
  float32 accumulation; each operand's gradient in the dtype the operand arrived in (a
  float32 parameter gets a float32 gradient, no half-precision rounding; the rule rounds a
  computed activation's gradient to the compute dtype first, as the compute-dtype matmul
  it replaces does). The residuals are the amaxes and, per operand, the operand itself
  where it costs nothing to keep (a parameter or input, or a value an enclosing autocast
  checkpoint recomputes), quantized again in the backward pass with the forward's amax;
  else its float8 value in the layout the backward product reads.

A non-finite operand or cotangent makes its scale non-finite, and the product (then the
gradient) non-finite: overflow is never hidden from a loss scaler or `find_overflow`.

Eligible: a `dot_general` of two float operands whose GEMM dimensions (M, N and K:
the rows, the columns and the contracted size, batch dimensions aside) are all at least
`min_dim` (small ones, e.g. a 10-class head or a 4-pixel patch embedding, stay in the
compute dtype). With `activations=False` (category `fp8`) at least one operand must be
a free value (a parameter, an input or a constant, as the interpreter tracks them): a
product of two computed activations (attention's scores and values) stays in the compute
dtype unless a named scope maps it to `fp8_any`. And with a `target` (default `"h100"`)
only where float8 pays: its train-step GEMMs and quantisation modeled faster than the
compute dtype's GEMMs on that GPU (`autocast._fp8_cost`); small and memory-bound GEMMs
stay in the compute dtype. `autocast.explain` says, per matmul, which way it went and why.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from . import _compat, _dtypes, _fp8_cost, _rules

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
FP8_DTYPES = frozenset({E4M3, E5M2})

MIN_DIM = 16
"""Default: a `dot_general` runs in float8 only if its M, N and K are all at least this."""


def _recomputed(ctx: _rules.RuleContext, var: Any) -> bool:
    """Whether the backward pass has operand `var` at no cost: recomputed by the enclosing
    autocast checkpoint (`ctx.checkpoint_saved`: the values it saves; None outside one)."""
    saved = ctx.checkpoint_saved
    return saved is not None and (isinstance(var, _compat.Literal) or var not in saved)


def quantize(x: Any, dtype: Any = E4M3) -> tuple[jax.Array, jax.Array]:
    """Per-tensor current scaling: `(q, scale)` with `q = clip(x / scale)` in `dtype`.

    `scale = amax(|x|) / max(dtype)` computed in float32 (0, and q 0, where amax is 0). An inf or
    NaN in `x` gives a non-finite scale (inf or NaN), so whatever is computed from `q`
    and `scale` is non-finite too.
    """
    q, amax = _quantize(x, dtype)
    return q, amax / float(jnp.finfo(np.dtype(dtype)).max)


def _quantize(x: Any, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """`(q, amax)`: the scale's scalar arithmetic is left to the consumers (XLA fuses it
    into the quantising and the GEMM-epilogue kernels instead of launching one per scalar)."""
    amax = jnp.max(jnp.abs(_widen(x)))
    return _quantize_with(x, amax, dtype), amax


def _quantize_with(x: Any, amax: Any, dtype: Any) -> jax.Array:
    """`x` in float8 `dtype` scaled by a known `amax` (the backward pass quantises an
    operand again with the amax its forward pass found: the same float8 values)."""
    dtype = np.dtype(dtype)
    fmax = float(jnp.finfo(dtype).max)
    inv = jnp.where(amax > 0, fmax / amax, 0.0)
    return jnp.clip(_widen(x) * inv, -fmax, fmax).astype(dtype)


def _widen(x: Any) -> jax.Array:
    """`x` in float32. A bfloat16 `x` is widened through its bits (exact: bfloat16 is
    float32's upper half), which XLA cannot fold with the conversion that rounded it to
    bfloat16 (`xla_allow_excess_precision`): the producer then writes bfloat16, and the
    amax and the float8 values are those of the bfloat16 operand the matmul stands for."""
    if _dtypes.dtype_of(x) != np.dtype(jnp.bfloat16):
        return lax.convert_element_type(x, np.float32)
    bits = lax.convert_element_type(lax.bitcast_convert_type(x, np.uint16), np.uint32)
    return lax.bitcast_convert_type(lax.shift_left(bits, np.uint32(16)), np.float32)


def _remaining(n: int, *removed: Sequence[int]) -> list[int]:
    drop = set(itertools.chain(*removed))
    return [i for i in range(n) if i not in drop]


class _Canon:
    """An operand's view as `[B, R, C]` (batch, kept, contracted; `[R, C]` without batch
    dimensions): the layout cuBLASLt's float8 GEMMs read without a transpose (contracted
    dimension minor), and the way back to the operand's own dimensions."""

    def __init__(self, shape: Sequence[int], contract: Sequence[int], batch: Sequence[int]):
        kept = _remaining(len(shape), contract, batch)
        self.perm = (*batch, *kept, *contract)
        self.inverse = tuple(int(i) for i in np.argsort(self.perm))
        self.permuted = tuple(shape[i] for i in self.perm)
        sizes = [int(np.prod([shape[i] for i in dims], dtype=np.int64)) for dims in (batch, kept, contract)]
        self.kept_shape = tuple(shape[i] for i in kept)
        self.batch_shape = tuple(shape[i] for i in batch)
        self.shape = tuple(sizes) if batch else tuple(sizes[1:])

    def to(self, x):
        if self.perm != tuple(range(len(self.perm))):
            x = lax.transpose(x, self.perm)
        return x.reshape(self.shape)

    def back(self, x):
        """`[B, R, C]` -> the operand's dimensions."""
        x = x.reshape(self.permuted)
        return lax.transpose(x, self.inverse) if self.inverse != tuple(range(len(self.inverse))) else x


def _gemm(a, b, sa, sb, c, dtype):
    """`a [B, R, K] x b [B, S, K] -> [B, R, S]` times `c * sa * sb` in `dtype` (float32
    accumulation; contracted dimensions minor). The GEMM writes `dtype` itself. The scales
    are the operands' amaxes as the reductions wrote them and a constant: in cuBLAS mode
    XLA passes them to cuBLASLt as they are, with no kernel to multiply two scalars first."""
    batch = ((0,), (0,)) if a.ndim == 3 else ((), ())
    y = lax.dot_general(a, b, ((((a.ndim - 1),), ((b.ndim - 1),)), batch), preferred_element_type=dtype)
    return (y.astype(np.float32) * c * sa * sb).astype(dtype)


ALIGN = 16
"""The multiple cuBLASLt's float8 GEMMs need their sizes in; the backward products pad the
cotangent to it (XLA:GPU pads a float8 operand that is not, in a copy of its own)."""


def _pad(x, rows: int, cols: int):
    """`x` with `rows` and `cols` zeros after its last two dimensions (none: `x`)."""
    if not rows and not cols:
        return x
    return lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] * (x.ndim - 2) + [(0, rows, 0), (0, cols, 0)])


def _swap(q):
    """The last two dimensions swapped (XLA writes it in the quantising kernel)."""
    return jnp.swapaxes(q, -1, -2)


def _dn(dimension_numbers) -> tuple:
    (lc, rc), (lb, rb) = dimension_numbers
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


_INV_E4M3 = 1.0 / float(jnp.finfo(E4M3).max)
_INV_E5M2 = 1.0 / float(jnp.finfo(E5M2).max)


def _saved(v):
    # named: an autocast checkpoint (an island of remat_float32) saves it
    return checkpoint_name(v, _compat.SAVED_NAME)


def _residual(v, q, amax, requantize: bool):
    """What the backward pass keeps of one operand: the operand itself where it costs no
    memory (`requantize`: a parameter, or a value an enclosing checkpoint recomputes), to
    be quantized again with the forward's amax; else its float8 value in the layout the
    backward product reads (written by the forward's quantising kernel), half the bytes."""
    if requantize:
        return v, _saved(amax)
    q = _swap(q)
    # saved as its bits where a checkpoint would not give float8 residuals back exactly
    return _saved(q if _compat.float8_residuals_exact() else lax.bitcast_convert_type(q, np.uint8)), _saved(amax)


def _backward_operand(r, amax, canon: _Canon, requantize: bool, recomputed: bool):
    """The `[B, K, rows]` float8 operand of the backward products from a residual. A
    recomputed activation is quantized in its own layout and the float8 copy transposed:
    XLA:GPU's transposing kernel (cuBLASLt reads `[B, K, rows]`) does not take in an
    expensive recomputation that another kernel also reads (GELU's `tanh`, read by its
    derivative too), which would then be written out in float32 and read back."""
    if recomputed:
        return _swap(lax.optimization_barrier(_quantize_with(canon.to(r), amax, E4M3)))
    if requantize:
        return _quantize_with(_swap(canon.to(r)), amax, E4M3)
    return lax.bitcast_convert_type(r, E4M3) if r.dtype == np.uint8 else r


def _forward(x, w, cx: _Canon, cw: _Canon, out_dtype, requantize: tuple[bool, bool]):
    qx, ax = _quantize(cx.to(x), E4M3)  # [B, M, K]
    qw, aw = _quantize(cw.to(w), E4M3)  # [B, N, K]
    # [B, M, N]: dot_general's own output order (batch, lhs kept, rhs kept)
    y = _gemm(qx, qw, ax, aw, _INV_E4M3 * _INV_E4M3, out_dtype)
    res = (*_residual(x, qx, ax, requantize[0]), *_residual(w, qw, aw, requantize[1]))
    return y.reshape((*cx.batch_shape, *cx.kept_shape, *cw.kept_shape)), res


def _make(dimension_numbers, x_shape, w_shape, out_dtype, x_dtype, w_dtype, requantize, grad_dtypes, recomputed):
    (xc, wc), (xb, wb) = dimension_numbers
    gx_dtype, gw_dtype = (d if d is not None else o for d, o in zip(grad_dtypes, (x_dtype, w_dtype)))
    cx, cw = _Canon(x_shape, xc, xb), _Canon(w_shape, wc, wb)

    @jax.custom_vjp
    def fp8_dot(x, w):
        return _forward(x, w, cx, cw, out_dtype, requantize)[0]

    def fwd(x, w):
        return _forward(x, w, cx, cw, out_dtype, requantize)

    def bwd(res, g):
        rx, ax, rw, aw = res
        qx_t = _backward_operand(rx, ax, cx, requantize[0], recomputed[0])  # [B, K, M]
        qw_t = _backward_operand(rw, aw, cw, requantize[1], recomputed[1])  # [B, K, N]
        m, n = cx.shape[-2], cw.shape[-2]
        # M and N padded to cuBLASLt's float8 multiple with zeros: one kernel then writes
        # both layouts of the quantized cotangent (XLA would pad one of them in a copy)
        pm, pn = (-m) % ALIGN, (-n) % ALIGN
        g3, qw_t, qx_t = _pad(g.reshape((*cx.shape[:-2], m, n)), pm, pn), _pad(qw_t, 0, pn), _pad(qx_t, 0, pm)
        qg, ag = _quantize(g3, E5M2)  # [B, M, N]
        dx = _gemm(qg, qw_t, ag, aw, _INV_E5M2 * _INV_E4M3, gx_dtype)[..., :m, :]  # [B, M, K]
        dw = _gemm(_swap(qg), qx_t, ag, ax, _INV_E5M2 * _INV_E4M3, gw_dtype)[..., :n, :]  # [B, N, K]
        return cx.back(dx).astype(x_dtype), cw.back(dw).astype(w_dtype)

    fp8_dot.defvjp(fwd, bwd)
    return fp8_dot


def fp8_dot_general(
    x: Any,
    w: Any,
    dimension_numbers: Any,
    out_dtype: Any = jnp.bfloat16,
    requantize: Sequence[bool] = (False, False),
    grad_dtypes: Sequence[Any] = (None, None),
    recomputed: Sequence[bool] = (False, False),
) -> jax.Array:
    """`lax.dot_general(x, w, dimension_numbers)` as a scaled float8 product.

    Forward in `float8_e4m3fn` x `float8_e4m3fn` with float32 accumulation, the result
    in `out_dtype`; backward with the cotangent in `float8_e5m2`; gradients in the
    dtypes of `x` and `w`. Reverse mode only (`jax.jvp` raises: a `custom_vjp`).

    Args:
        x: The left operand, a float array (float16, bfloat16 or float32).
        w: The right operand, a float array (float16, bfloat16 or float32).
        dimension_numbers: As for `lax.dot_general`.
        out_dtype: The dtype the result is stored in.
        requantize: Per operand (`x`, `w`), whether the backward pass keeps the operand
            itself and quantizes it again with the forward pass's amax (the same float8
            values; right where the operand is kept anyway: a parameter, or a value an
            enclosing checkpoint recomputes) instead of keeping its float8 copy (half the
            bytes of bfloat16).
        grad_dtypes: Per operand, the dtype its gradient product writes (then cast to the
            operand's dtype); None: the operand's dtype. The compute dtype for an
            activation rounds its gradient as a half-precision matmul would (and halves
            the buffer).
        recomputed: Per operand, whether the backward pass recomputes it (an activation
            inside an enclosing checkpoint; implies `requantize`): quantized in its own
            layout, its float8 copy transposed, so the recomputation fuses with its other
            readers.

    Returns:
        The product, in `out_dtype`.

    Raises:
        TypeError: `x`, `w` or an entry of `grad_dtypes` is not float16, bfloat16 or
            float32.
        ValueError: `requantize`, `grad_dtypes` or `recomputed` is not a pair.

    Example:
        ```python
        from autocast._fp8 import fp8_dot_general

        x, w = jnp.ones((32, 64)), jnp.ones((64, 16))
        y = fp8_dot_general(x, w, (((1,), (0,)), ((), ())), jnp.bfloat16)
        assert y.shape == (32, 16) and y.dtype == jnp.bfloat16
        assert (y == 64).all()  # ones are exact in float8
        ```
    """
    for name, v in (("x", x), ("w", w)):
        d = _dtypes.dtype_of(v)
        if d not in _dtypes.CASTABLE:
            raise TypeError(f"fp8_dot_general: {name} has dtype {d}; allowed: float16, bfloat16, float32.")
    dn = _dn(dimension_numbers)
    if not isinstance(requantize, Sequence) or len(requantize) != 2:
        raise ValueError(f"fp8_dot_general: requantize={requantize!r}; must be two booleans (x, w).")
    if not isinstance(recomputed, Sequence) or len(recomputed) != 2:
        raise ValueError(f"fp8_dot_general: recomputed={recomputed!r}; must be two booleans (x, w).")
    rc = (bool(recomputed[0]), bool(recomputed[1]))
    rq = (bool(requantize[0]) or rc[0], bool(requantize[1]) or rc[1])  # a recomputed operand is kept
    if not isinstance(grad_dtypes, Sequence) or len(grad_dtypes) != 2:
        raise ValueError(f"fp8_dot_general: grad_dtypes={grad_dtypes!r}; must be two dtypes or None (x, w).")
    gd = tuple(None if g is None else np.dtype(g) for g in grad_dtypes)
    for g in gd:
        if g is not None and g not in _dtypes.CASTABLE:
            raise TypeError(f"fp8_dot_general: grad_dtypes has {g}; allowed: float16, bfloat16, float32 or None.")
    dtypes = (_dtypes.dtype_of(x), _dtypes.dtype_of(w))
    make = _make(dn, np.shape(x), np.shape(w), np.dtype(out_dtype), *dtypes, rq, gd, rc)
    return make(x, w)


def gemm_sizes(lhs_shape: Sequence[int], rhs_shape: Sequence[int], dimension_numbers: Any) -> tuple[int, int, int]:
    """`(M, N, K)` of the GEMM a `dot_general` is: the products of the lhs's and the
    rhs's kept (neither contracted nor batch) dimensions, and of the contracted ones."""
    (lc, rc), (lb, rb) = dimension_numbers
    m = int(np.prod([d for i, d in enumerate(lhs_shape) if i not in lc and i not in lb], dtype=np.int64))
    n = int(np.prod([d for i, d in enumerate(rhs_shape) if i not in rc and i not in rb], dtype=np.int64))
    k = int(np.prod([lhs_shape[i] for i in lc], dtype=np.int64))
    return m, n, k


def decide(
    eqn: Any,
    arrived: Sequence[Any],
    free: Sequence[bool] | None,
    min_dim: int,
    activations: bool,
    target: Any,
    half_bytes: int = 2,
) -> tuple[bool, str]:
    """Whether the rule binds the `dot_general` `eqn` in float8, and why (or why not),
    for `explain` (see the module docstring; `target`: a
    `autocast._fp8_cost.Target` or None; `half_bytes`: the compute dtype's size)."""
    if len(arrived) != 2:
        return False, "not a two-operand matmul"
    if any(_dtypes.dtype_of(x) not in _dtypes.CASTABLE for x in arrived):
        return False, "an operand is not a float"
    shapes = np.shape(arrived[0]), np.shape(arrived[1])
    dn = eqn.params["dimension_numbers"]
    m, n, k = gemm_sizes(*shapes, dn)
    if min(m, n, k) < min_dim:
        return False, f"GEMM M={m} N={n} K={k}: a size below min_dim={min_dim}"
    if eqn.params.get("out_sharding") is not None:
        return False, "its result has an explicit sharding"
    if not (activations or free is None or any(bool(f) for f in free)):
        return False, "both operands are computed values (category fp8_any takes them)"
    if target is None:
        return True, f"GEMM M={m} N={n} K={k}, no cost check (target=None)"
    batch = int(np.prod([shapes[0][i] for i in dn[1][0]], dtype=np.int64))
    ok, verdict = _fp8_cost.pays(target, m, n, k, batch, half_bytes)
    return ok, f"GEMM M={m} N={n} K={k}{f' x{batch}' if batch > 1 else ''}, {verdict}"


def _quantized_operands(arrived: Sequence[Any], cast: Sequence[Any], free: Sequence[bool] | None) -> list[Any]:
    """The values a float8 matmul quantizes: a parameter or input as it arrived (a float32
    parameter keeps its float32 gradient), a computed operand as the compute-dtype matmul
    it replaces would read it (its cast): a float32 producer (GELU's island) then writes
    half precision for the amax and quantizing kernels to read, not float32."""
    return [arrived[i] if free is None or free[i] else cast[i] for i in range(len(arrived))]


class _Float8Rule(_rules.Rule):
    """A policy rule: cast like `use_compute_precision`; bind eligible matmuls in float8."""

    role: _rules.Role = "compute"
    casts_only = True  # a matmul it leaves to the interpreter gets a float32 weight gradient too

    def __init__(self, min_dim: int = MIN_DIM, activations: bool = False, target: str | None = "h100"):
        if not isinstance(min_dim, int) or isinstance(min_dim, bool) or min_dim < 1:
            raise ValueError(f"use_float8: min_dim={min_dim!r}; must be a positive integer.")
        if target is not None and (not isinstance(target, str) or target not in _fp8_cost.TARGETS):
            raise ValueError(
                f"use_float8: target={target!r}; allowed: {', '.join(map(repr, _fp8_cost.TARGETS))} or None "
                "(every matmul of at least min_dim in float8)."
            )
        self.min_dim = min_dim
        self.activations = bool(activations)
        self.target = target
        self.name = self.__name__ = self.__qualname__ = (
            f"use_float8(min_dim={min_dim}, activations={self.activations}, target={target!r})"
        )

    def cast(self, compute_dtype, original_dtypes, invars, params, free):
        return _rules.use_compute_precision.cast(compute_dtype, original_dtypes, invars, params, free)

    def bind(self, ctx, eqn, arrived, cast, params, free):
        if eqn.primitive.name != "dot_general":  # a named scope's other equations: as compute
            return None
        target = None if self.target is None else _fp8_cost.TARGETS[self.target]
        half_bytes = _dtypes.dtype_of(cast[0]).itemsize  # the dtype it runs in if not float8
        ok, why = decide(eqn, arrived, free, self.min_dim, self.activations, target, half_bytes)
        pref = params.get("preferred_element_type")
        out_dtype = np.dtype(pref) if pref is not None else _dtypes.dtype_of(cast[0])
        if ok and out_dtype not in _dtypes.CASTABLE:
            ok, why = False, f"its result type {out_dtype} is not a float of the policy"
        if not ok:
            ctx.observer.float8(eqn, why, None)  # autocast.explain
            return None
        # a free operand (parameter, input) is kept anyway, and inside an autocast checkpoint
        # (an island) a computed one is recomputed: there the backward pass quantizes again
        recomputed = tuple(not (free and free[i]) and _recomputed(ctx, eqn.invars[i]) for i in range(2))
        requantize = tuple(bool(free and free[i]) or recomputed[i] for i in range(2))
        # a parameter or input gets a gradient in its own dtype (float32: no rounding); a
        # computed activation's gradient is rounded to the compute dtype, as in a compute-dtype
        # matmul, whose cast to the compute dtype it stands for
        grads = tuple(None if free is None or free[i] else out_dtype for i in range(2))
        ctx.observer.float8(eqn, why, requantize)
        ops = _quantized_operands(arrived, cast, free)
        dn = params["dimension_numbers"]
        return [fp8_dot_general(ops[0], ops[1], dn, out_dtype, requantize, grads, recomputed)]

    def __repr__(self) -> str:
        return self.__name__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Float8Rule) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((_Float8Rule, *self._key()))

    def _key(self) -> tuple:
        return self.min_dim, self.activations, self.target


def use_float8(min_dim: int = MIN_DIM, activations: bool = False, target: str | None = "h100") -> Any:
    """A policy rule that runs eligible `dot_general`s as scaled float8 products.

    Forward in `float8_e4m3fn` with per-tensor current scaling and float32 accumulation,
    backward with the cotangent in `float8_e5m2`; a float32 parameter gets a float32
    gradient. Other equations it is given run as with `use_compute_precision`.

    Args:
        min_dim: A matmul runs in float8 only if its GEMM dimensions M, N, K (rows,
            columns, contracted size; batch dimensions aside) are all at least this.
        activations: Also products of two computed values (attention's scores and values);
            by default one operand must be a parameter, an input or a constant.
        target: The GPU whose roofline decides per matmul whether float8 pays (`"h100"`,
            `"h200"`, `"b200"`; see `autocast._fp8_cost`): a matmul runs in float8 only
            where its three train-step GEMMs plus the quantisation are modeled faster than
            in the compute dtype, from the sizes `amp` traces (apply `amp` outside
            `vmap`). `None`: every matmul of at least `min_dim` (to study float8's
            numerics on small models, or on a CPU).

    Returns:
        The rule (for `extend_policy` or a policy dict).

    Raises:
        ValueError: `min_dim` is not a positive integer, or `target` is not one of the
            GPUs above or None.

    Example:
        ```python
        policy = autocast.extend_policy({"attention": autocast.use_float8(activations=True)},
                                        base=autocast.load_policy("fp8"))
        assert policy["attention"].activations  # in scope "attention": products of activations too
        ```
    """
    return _Float8Rule(min_dim, activations, target)


CATEGORIES = {"fp8": use_float8(), "fp8_any": use_float8(activations=True)}
"""The policy-table categories this module adds (`autocast._rules.register_category`)."""
for _name, _rule in CATEGORIES.items():
    _rules.register_category(_name, _rule)
