"""The fused kernel under every transformation (issue 47).

The cuDNN call (`jax.nn.dot_product_attention(..., implementation="cudnn")`) is a
`custom_vjp`: JAX takes its first-order reverse-mode derivative and nothing else (no `jvp`,
so no `jacfwd`, `linearize` or Hessian-vector product; its backward pass has no derivative,
so no gradient of a gradient). Since `lax.platform_dependent` traces every branch, that
reached every program amp fused, on every platform. `differentiable(kernel, fallback)` binds
the kernel (on q, k, v as it takes them, its bias, mask and lengths) as `attention_p`, a
primitive that keeps the kernel where it is the whole story and takes every other derivative
from `fallback` (XLA's attention in float32, `_fuse._float32_xla`):

- `attention_p` (primals -> outputs): evaluates the kernel. Its JVP is `attention_fwd_p` (the
  outputs and the kernel's residuals: the forward pass `jax.vjp` of the kernel runs) and
  `attention_tangent_p`, linear in the tangents.
- `attention_tangent_p` (residuals, primals, tangents -> output tangents): evaluated (forward
  mode: `jvp`, `jacfwd`, `linearize`'s tangent program), it is the fallback's JVP; its
  transpose (reverse mode) is the kernel's own backward pass on the saved residuals, a
  `custom_jvp` whose derivative is the fallback's (a gradient penalty, an HVP); its own JVP
  (second order in forward mode) is the JVP of the fallback's JVP.
- `attention_fwd_p` (primals -> outputs, residuals): its JVP is the same tangent; the
  residuals' tangents are symbolic zeros, which is exact for what reads them: only the
  tangent's transpose reads them, and its derivative comes from the primals.

So `grad`/`value_and_grad`/`vjp` (under `jit`, `vmap`, `checkpoint`) run one forward and one
backward kernel, as before, on the same residuals: those `jax.vjp` of the kernel keeps (the
residuals that are primals, cuDNN's q, k, v and bias, are not passed twice). Where residuals
are materialised (a `scan` over layers, an eager `jax.vjp`), a traced boolean mask, which the
cuDNN call folds into a bias, is kept as well: the fallback reads it. Batching vmaps the
callables (`_Batched`) and binds the primitive again, so a batched kernel is still
differentiable. `attention_p` and `attention_fwd_p` hold the kernel as a jaxpr (`jaxpr`):
JAX looks there for primitives that need devices to lower (the cuDNN call's
`custom_partitioning`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import _compat

attention_p = _compat.Primitive("fused_attention_call")
"""A fused span: evaluates `spec.value` (params: `spec`; `jaxpr`, the value as a closed
jaxpr, for readers of the program: explain, and JAX's own search for primitives that need
devices to lower, such as the cuDNN call's `custom_partitioning`)."""
attention_p.multiple_results = True
attention_fwd_p = _compat.Primitive("fused_attention_fwd")
"""The kernel's forward pass: the outputs, then the residuals its backward pass reads
(params: `spec`, `jaxpr` as `attention_p`'s)."""
attention_fwd_p.multiple_results = True
attention_tangent_p = _compat.Primitive("fused_attention_tangent")
"""(residuals, primals, tangents of the primals `nz` marks) -> the outputs' tangents."""
attention_tangent_p.multiple_results = True


_ARRAYS = ("bias", "mask", "query_seq_lengths", "key_value_seq_lengths")


def differentiable(kernel: Callable[..., Any], fallback: Callable[..., Any]) -> Callable[..., Any]:
    """`kernel` as a function differentiable in every mode.

    Args:
        kernel: A function with `jax.nn.dot_product_attention`'s arguments but
            `implementation` (the cuDNN call); first-order reverse mode uses its own backward
            pass.
        fallback: The same computation, differentiable to any order
            (`jax.nn.dot_product_attention(..., implementation="xla")`): every other
            derivative is its.

    Returns:
        A function with the same arguments, giving `kernel`'s result.
    """

    def attend(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        names = [n for n in _ARRAYS if kwargs.get(n) is not None]
        static = {n: x for n, x in kwargs.items() if n not in _ARRAYS}
        args = [q, k, v, *(kwargs[n] for n in names)]
        avals = [_compat.typeof(x) for x in args]

        def traced(fn: Callable[..., Any]) -> Any:
            def flat(q: Any, k: Any, v: Any, *rest: Any) -> list[Any]:
                return [fn(q, k, v, **dict(zip(names, rest)), **static)]

            return _compat.close_jaxpr(*_compat.trace_to_jaxpr(flat, avals))

        spec = _Base(traced(kernel), traced(fallback), avals)
        return attention_p.bind(*args, spec=spec, jaxpr=spec.jaxpr)[0]

    return attend


def _floating(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.floating)


def _with(p: Sequence[Any], where: Sequence[int], xs: Sequence[Any]) -> list[Any]:
    """`p` with the entries at `where` replaced by `xs`."""
    out = list(p)
    for i, x in zip(where, xs):
        out[i] = x
    return out


def _is_array(x: Any) -> bool:
    return _compat.is_tracer(x) or isinstance(x, jax.Array)


class _Spec:
    """What the three primitives compute for one span: `value`, `fwd` (outputs and
    residuals), `bwd` (the kernel's backward pass), `tangent` (the fallback's JVP) and
    `fallback_bwd` (the fallback's VJP). `nz`: per primal, whether it has a tangent (a
    floating primal whose tangent is not a symbolic zero); `bwd`, `tangent` and
    `fallback_bwd` take and give one tangent or cotangent per marked primal.

    Compared by identity: a primitive parameter must be hashable."""

    floating: tuple[bool, ...]
    out_avals: list[Any]
    res_avals: list[Any]
    jaxpr: Any  # `value` as a closed jaxpr (None where the primals are not batched)

    def value(self, p: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def fwd(self, p: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        raise NotImplementedError

    def bwd(self, nz: tuple[bool, ...], res: Sequence[Any], p: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def tangent(self, nz: tuple[bool, ...], p: Sequence[Any], t: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def fallback_bwd(self, nz: tuple[bool, ...], p: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
        raise NotImplementedError


class _Base(_Spec):
    """A span as amp binds it: the kernel and the fallback as closed jaxprs.

    The kernel's residuals are the leaves of `jax.vjp`'s backward function, found once at
    the operands' avals (`_probe`): each is a primal itself (not an output of
    `attention_fwd_p`: it is passed as the primal), an array (an output) or a constant kept
    with the tree."""

    def __init__(self, value: Any, fallback: Any, avals: Sequence[Any]):
        self.jaxpr = value
        self._value = _compat.jaxpr_as_fun(value)
        self._fallback = _compat.jaxpr_as_fun(fallback)
        self.floating = tuple(_floating(a) for a in avals)
        self.out_avals = [v.aval for v in _compat.open_and_consts(value)[0].outvars]
        self._float_at = [i for i, f in enumerate(self.floating) if f]
        self._tree: Any = None
        self._kinds: list[tuple[str, Any]] = []
        probe, _ = _compat.trace_to_jaxpr(lambda *p: self._probe(p), avals)
        self.res_avals = [v.aval for v in probe.outvars]

    def _vjp(self, p: Sequence[Any]) -> tuple[list[Any], list[Any], Any]:
        def kernel(*xs: Any) -> list[Any]:
            return self._value(*_with(p, self._float_at, xs))

        out, back = jax.vjp(kernel, *(p[i] for i in self._float_at))
        leaves, tree = jax.tree_util.tree_flatten(back)
        return out, leaves, tree

    def _probe(self, p: Sequence[Any]) -> list[Any]:
        _, leaves, self._tree = self._vjp(p)
        outs: list[Any] = []
        for leaf in leaves:
            at = next((i for i, x in enumerate(p) if x is leaf), None)
            if at is not None:
                self._kinds.append(("primal", at))
            elif _is_array(leaf):
                self._kinds.append(("residual", len(outs)))
                outs.append(leaf)
            else:
                self._kinds.append(("constant", leaf))
        return outs

    def value(self, p):
        return self._value(*p)

    def fwd(self, p):
        out, leaves, _ = self._vjp(p)
        if len(leaves) != len(self._kinds):
            raise RuntimeError(
                f"the fused kernel's residuals changed: {len(leaves)} leaves, {len(self._kinds)} at first"
            )
        return out, [leaf for leaf, (kind, _) in zip(leaves, self._kinds) if kind == "residual"]

    def bwd(self, nz, res, p, cts):
        leaves = []
        for kind, at in self._kinds:
            leaves.append(p[at] if kind == "primal" else res[at] if kind == "residual" else at)
        back = jax.tree_util.tree_unflatten(self._tree, leaves)
        grads = back(list(cts))
        return [g for g, i in zip(grads, self._float_at) if nz[i]]

    def _fallback_of(self, nz: tuple[bool, ...], p: Sequence[Any]) -> tuple[Callable[..., list[Any]], list[Any]]:
        at = [i for i, z in enumerate(nz) if z]
        return (lambda *xs: self._fallback(*_with(p, at, xs))), [p[i] for i in at]

    def tangent(self, nz, p, t):
        f, xs = self._fallback_of(nz, p)
        return list(jax.jvp(f, xs, list(t))[1])

    def fallback_bwd(self, nz, p, cts):
        f, xs = self._fallback_of(nz, p)
        return list(jax.vjp(f, *xs)[1](list(cts)))


def _insert(aval: Any, size: int) -> Any:
    return aval.update(shape=(size, *aval.shape))


class _Batched(_Spec):
    """`base` vmapped: primal `i` batched along axis 0 where `p_dims[i]` is 0, unbatched
    where it is None; residual `j` likewise by `res_dims[j]`; the tangents along axis 0
    (`tangents_batched`) or as their primals; outputs and cotangents along axis 0."""

    def __init__(self, base: _Spec, p_dims, res_dims, size: int, tangents_batched: bool = False, avals=None):
        self.base, self.p_dims, self.res_dims, self.size = base, list(p_dims), list(res_dims), size
        self.tangents_batched = tangents_batched
        self.floating = base.floating
        self.out_avals = [_insert(a, size) for a in base.out_avals]
        self.res_avals = [_insert(a, size) for a in base.res_avals]
        self.jaxpr = None
        if avals is not None:
            self.jaxpr = _compat.close_jaxpr(*_compat.trace_to_jaxpr(lambda *xs: self.value(xs), avals))

    def _t_dims(self, nz: tuple[bool, ...]) -> list[Any]:
        return [0 if self.tangents_batched else self.p_dims[i] for i, z in enumerate(nz) if z]

    def _summed(self, nz: tuple[bool, ...], grads: Sequence[Any]) -> list[Any]:
        """Cotangents of unbatched tangents summed over the batch (their primal is shared)."""
        return [g if d == 0 else jnp.sum(g, axis=0) for g, d in zip(grads, self._t_dims(nz))]

    def value(self, p):
        return jax.vmap(self.base.value, in_axes=(self.p_dims,))(list(p))

    def fwd(self, p):
        return jax.vmap(self.base.fwd, in_axes=(self.p_dims,))(list(p))

    def bwd(self, nz, res, p, cts):
        f = functools.partial(self.base.bwd, nz)
        return self._summed(nz, jax.vmap(f, in_axes=(self.res_dims, self.p_dims, 0))(list(res), list(p), list(cts)))

    def tangent(self, nz, p, t):
        f = functools.partial(self.base.tangent, nz)
        return jax.vmap(f, in_axes=(self.p_dims, self._t_dims(nz)))(list(p), list(t))

    def fallback_bwd(self, nz, p, cts):
        f = functools.partial(self.base.fallback_bwd, nz)
        return self._summed(nz, jax.vmap(f, in_axes=(self.p_dims, 0))(list(p), list(cts)))


# --- the kernel's backward pass, differentiable ---------------------------------------------


def _kernel_bwd(spec: _Spec, nz: tuple[bool, ...]) -> Callable[..., list[Any]]:
    """The kernel's backward pass as a `custom_jvp` whose derivative is the fallback's
    (the residuals' tangents are not read: the residuals are functions of the primals)."""
    at = [i for i, f in enumerate(spec.floating) if f]

    @jax.custom_jvp
    def bwd(res: list[Any], p: list[Any], cts: list[Any]) -> list[Any]:
        return spec.bwd(nz, res, p, cts)

    @bwd.defjvp
    def _bwd_jvp(primals: Any, tangents: Any) -> Any:
        res, p, cts = primals
        _, dp, dcts = tangents

        def fallback(xs: list[Any], cs: list[Any]) -> list[Any]:
            return spec.fallback_bwd(nz, _with(p, at, xs), cs)

        _, out_dot = jax.jvp(fallback, ([p[i] for i in at], list(cts)), ([dp[i] for i in at], list(dcts)))
        return bwd(res, p, cts), out_dot

    return bwd


# --- the rules -------------------------------------------------------------------------------


def _zero(x: Any) -> Any:
    return _compat.Zero(_compat.typeof(x).to_tangent_aval())


def _instantiate(t: Any, x: Any) -> Any:
    return jnp.zeros_like(x) if type(t) is _compat.Zero else t


def _nonzero(spec: _Spec, tangents: Sequence[Any]) -> tuple[bool, ...]:
    return tuple(f and type(t) is not _compat.Zero for f, t in zip(spec.floating, tangents))


def _tangents(spec: _Spec, res: Sequence[Any], p: Sequence[Any], tangents: Sequence[Any]) -> list[Any]:
    nz = _nonzero(spec, tangents)
    if not any(nz):
        return [_compat.Zero(a.to_tangent_aval()) for a in spec.out_avals]
    ts = [t for t, z in zip(tangents, nz) if z]
    return attention_tangent_p.bind(*res, *p, *ts, spec=spec, nz=nz)


def _attention_jvp(primals, tangents, *, spec, jaxpr):
    if not any(_nonzero(spec, tangents)):
        outs = attention_p.bind(*primals, spec=spec, jaxpr=jaxpr)
        return outs, [_zero(o) for o in outs]
    both = attention_fwd_p.bind(*primals, spec=spec, jaxpr=jaxpr)
    n = len(spec.out_avals)
    return both[:n], _tangents(spec, both[n:], primals, tangents)


def _fwd_jvp(primals, tangents, *, spec, jaxpr):
    both = attention_fwd_p.bind(*primals, spec=spec, jaxpr=jaxpr)
    n = len(spec.out_avals)
    return both, _tangents(spec, both[n:], primals, tangents) + [_zero(r) for r in both[n:]]


def _split(spec: _Spec, operands: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    n_res, n_p = len(spec.res_avals), len(spec.floating)
    return list(operands[:n_res]), list(operands[n_res : n_res + n_p]), list(operands[n_res + n_p :])


def _tangent_impl(*operands, spec, nz):
    _, p, t = _split(spec, operands)
    return spec.tangent(nz, p, t)


def _tangent_jvp(primals, tangents, *, spec, nz):
    out = attention_tangent_p.bind(*primals, spec=spec, nz=nz)
    _, p, t = _split(spec, primals)
    _, dp, dt = _split(spec, tangents)
    if all(type(d) is _compat.Zero for d in dp + dt):
        return out, [_zero(o) for o in out]
    at = [i for i, f in enumerate(spec.floating) if f]

    def tangent(xs: list[Any], ts: list[Any]) -> list[Any]:
        return spec.tangent(nz, _with(p, at, xs), ts)

    dxs = [_instantiate(dp[i], p[i]) for i in at]
    dts = [_instantiate(d, x) for d, x in zip(dt, t)]
    return out, list(jax.jvp(tangent, ([p[i] for i in at], t), (dxs, dts))[1])


def _tangent_transpose(cts, *operands, spec, nz):
    res, p, t = _split(spec, operands)
    if all(type(c) is _compat.Zero for c in cts):
        return [None] * (len(res) + len(p)) + [_compat.Zero(x.aval) for x in t]
    cts = [jnp.zeros(a.shape, a.dtype) if type(c) is _compat.Zero else c for c, a in zip(cts, spec.out_avals)]
    grads = _kernel_bwd(spec, nz)(res, p, cts)
    return [None] * (len(res) + len(p)) + list(grads)


def _normalised(args: Sequence[Any], dims: Sequence[Any]) -> tuple[list[Any], list[Any], int]:
    """The operands with each batch axis moved to the front (0) or none (None), and the size."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _compat.NOT_MAPPED)
    out: list[Any] = []
    out_dims: list[int | None] = []
    for a, d in zip(args, dims):
        if d is _compat.NOT_MAPPED:
            out.append(a)
            out_dims.append(None)
        else:
            out.append(_compat.moveaxis(a, d, 0))
            out_dims.append(0)
    return out, out_dims, size


def _batched_spec(spec: _Spec, args: Sequence[Any], dims: Sequence[Any]) -> tuple[_Batched, list[Any]]:
    p, p_dims, size = _normalised(args, dims)
    avals = [_compat.typeof(x) for x in p]
    return _Batched(spec, p_dims, [0] * len(spec.res_avals), size, avals=avals), p


def _attention_batch(args, dims, *, spec, jaxpr):
    batched, p = _batched_spec(spec, args, dims)
    outs = attention_p.bind(*p, spec=batched, jaxpr=batched.jaxpr)
    return outs, [0] * len(outs)


def _fwd_batch(args, dims, *, spec, jaxpr):
    batched, p = _batched_spec(spec, args, dims)
    outs = attention_fwd_p.bind(*p, spec=batched, jaxpr=batched.jaxpr)
    return outs, [0] * len(outs)


def _tangent_batch(args, dims, *, spec, nz):
    operands, op_dims, size = _normalised(args, dims)
    res, p, t = _split(spec, operands)
    res_dims, p_dims, _ = _split(spec, op_dims)
    t = [x if d == 0 else jnp.broadcast_to(x, (size, *x.shape)) for x, d in zip(t, _split(spec, op_dims)[2])]
    batched = _Batched(spec, p_dims, res_dims, size, tangents_batched=True)
    outs = attention_tangent_p.bind(*res, *p, *t, spec=batched, nz=nz)
    return outs, [0] * len(outs)


def _attention_impl(*args, spec, jaxpr):
    return spec.value(list(args))


def _fwd_impl(*args, spec, jaxpr):
    out, res = spec.fwd(list(args))
    return [*out, *res]


attention_p.def_impl(_attention_impl)
attention_p.def_abstract_eval(lambda *avals, spec, jaxpr: spec.out_avals)
attention_fwd_p.def_impl(
    lambda *args, spec, jaxpr: jax.jit(functools.partial(_fwd_impl, spec=spec, jaxpr=jaxpr))(*args)
)
attention_fwd_p.def_abstract_eval(lambda *avals, spec, jaxpr: [*spec.out_avals, *spec.res_avals])
attention_tangent_p.def_impl(_tangent_impl)
attention_tangent_p.def_abstract_eval(lambda *avals, spec, nz: spec.out_avals)
for _prim, _impl in (
    (attention_p, _attention_impl),
    (attention_fwd_p, _fwd_impl),
    (attention_tangent_p, _tangent_impl),
):
    _compat.register_lowering(_prim, _compat.lower_fun(_impl, multiple_results=True))
# JAX 0.12 with `jax_custom_vjp3`: a kernel that is a `call_hi_primitive` makes a primitive
# holding it "high" (`Primitive.is_high` reads the jaxpr params); JAX lowers such an equation
# to plain JAX by `to_lojax`, here its evaluation (0.9.2 .. 0.11 never call it)
attention_p.to_lojax = _attention_impl  # type: ignore[method-assign]
attention_fwd_p.to_lojax = _fwd_impl  # type: ignore[method-assign]
_compat.primitive_jvps[attention_p] = _attention_jvp
_compat.primitive_jvps[attention_fwd_p] = _fwd_jvp
_compat.primitive_jvps[attention_tangent_p] = _tangent_jvp
_compat.primitive_transposes[attention_tangent_p] = _tangent_transpose
_compat.primitive_batchers[attention_p] = _attention_batch
_compat.primitive_batchers[attention_fwd_p] = _fwd_batch
_compat.primitive_batchers[attention_tangent_p] = _tangent_batch
