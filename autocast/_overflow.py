"""`autocast.find_overflow`: where half precision breaks, equation by equation.

The amp-transformed program is evaluated eagerly, one equation at a time, with the bodies
of higher-order primitives inlined (`jit`/`checkpoint` bodies in place, `scan` and
`while` as Python loops, `cond` as the branch taken, `custom_jvp`/`custom_vjp` as
their primal body). Each equation whose result is half precision is bound a second time
with its operands cast to float32: an *equation-local* float32 reference. A finding is an
equation whose half-precision result is inf/NaN where the reference is finite, or is zero
where the reference is a significant value (at least 1/1000 of the reference's largest
magnitude), so an overflow is reported where it happens and not again downstream.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _cpu_matmul, _dtypes, _walk
from ._amp import amp
from ._explain import BACKWARD, _check_fn, _flat, gradients
from ._options import AmpKwargs, AmpOptions, takes_amp_options
from ._plan import COMMUTES_WITH_ROUNDING

_UNDERFLOW_SIGNIFICANCE = 1e-3
# Primitives that only move, select or reshape their operands: their half-precision result
# holds values that were already half precision, so they cannot overflow or underflow.
_REARRANGING = COMMUTES_WITH_ROUNDING | {"argmax", "argmin", "device_put", "dynamic_update_slice", "reshard", "sign"}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One equation where half precision breaks (see `autocast.find_overflow`).

    `str(finding)` prints all of it.

    Attributes:
        primitive: The name of the equation's primitive.
        kind: `"overflow"` (inf), `"nan"` or `"underflow"` (flushed to zero).
        source: `"path/to/file.py:LINE"`: the user line that traced the equation.
        scopes: The named scopes around it, outermost first.
        path: The higher-order primitives it is nested in, outermost first
            (`("jit(f)", "scan(4)")`).
        half_range: (min, max) of the half-precision result.
        float32_range: (min, max) of the equation-local float32 reference.
        dtype: The half-precision dtype of the result.
        count: How many elements broke.
        backward: Whether the equation is in the backward pass (`grad=True`).
        suggestion: What to do about it, in one line.

    Example:
        ```python
        big = {"w1": params["w1"], "w2": params["w2"] * 1e5}  # float16 tops out at 65504
        findings = autocast.find_overflow(loss_fn)(big, batch)
        assert findings and isinstance(findings[0], autocast.Finding)
        assert findings[0].kind == "overflow" and findings[0].dtype == "float16"
        print(findings[0])
        ```
    """

    primitive: str
    kind: str
    source: str
    scopes: tuple[str, ...]
    path: tuple[str, ...]
    half_range: tuple[float, float]
    float32_range: tuple[float, float]
    dtype: str
    count: int
    backward: bool
    suggestion: str

    def __str__(self) -> str:
        where = "/".join(self.scopes)
        nest = " > ".join(self.path)
        ctx = ", ".join(
            x
            for x in (
                f"scope {where}" if where else "",
                f"in {nest}" if nest else "",
                "backward pass" if self.backward else "",
            )
            if x
        )
        return (
            f"{self.kind} in {self.primitive} at {self.source}{f' ({ctx})' if ctx else ''}: "
            f"{self.count} element(s); {self.dtype} range [{self.half_range[0]:.4g}, {self.half_range[1]:.4g}], "
            f"float32 [{self.float32_range[0]:.4g}, {self.float32_range[1]:.4g}]\n    -> {self.suggestion}"
        )


class Findings(list):
    """A list of `Finding` in program order; prints one per line."""

    checked: int = 0

    def __str__(self) -> str:
        if not self:
            return f"no overflow, NaN or underflow in half precision ({self.checked} equations checked)"
        lines = [f"{len(self)} finding(s) in half precision ({self.checked} equations checked), earliest first:"]
        lines += [f"{i}. {f}" for i, f in enumerate(self, 1)]
        return "\n".join(lines)

    __repr__ = __str__


_FLOAT16_RANGE = (
    "; float16's range is the limit here (its largest value is 65,504, where float32 holds this "
    "value): compute_dtype=jnp.bfloat16 has float32's range"
)


def _suggest(prim: str, kind: str, source: str, backward: bool, dtype: str = "") -> str:
    """The one-line suggestion of a finding; an overflow in float16 of a value float32 holds
    also says that float16's range is the limit and points to bfloat16."""
    text = _suggestion(prim, kind, source, backward)
    if kind == "overflow" and dtype == "float16":
        text += _FLOAT16_RANGE
    return text


def _suggestion(prim: str, kind: str, source: str, backward: bool) -> str:
    if kind == "underflow":
        if backward:
            return "gradients flush to zero: use loss scaling (autocast.DynamicScalerState) or a larger scale"
        return f"values flush to zero in half precision: wrap {source} in `with autocast.amp_stop():`, use bfloat16, or rescale"
    if backward:
        return f"the scaled gradient overflows in {prim}: lower the loss scale, or wrap {source} in `with autocast.amp_stop():`"
    if prim == "convert_element_type":
        return (
            f"a float32 value does not fit in half precision where amp casts it for its consumer: wrap {source} in "
            "`with autocast.amp_stop():`, or give the consumer a float32 rule"
        )
    return (
        f"wrap {source} in `with autocast.amp_stop():`, or run it in float32 with "
        f"autocast.extend_policy({{jax.lax.{prim}_p: autocast.use_float32_precision}})"
    )


class _Checker:
    """Evaluates a jaxpr eagerly, equation by equation (JAX compiles each primitive once
    per shape and caches it, so repeated layers cost little), checking every
    half-precision result against its equation-local float32 reference."""

    def __init__(self):
        self.findings = Findings()
        self.seen: set = set()
        self.checked = 0

    def run(
        self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], scopes: tuple, path: tuple, backward: bool
    ) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v):
            return v.val if isinstance(v, _compat.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            here = scopes + _compat.scope_names(eqn.source_info.name_stack)
            outs = self.eqn(eqn, [read(v) for v in eqn.invars], here, path, backward)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, _compat.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def body(self, closed: Any, args: Sequence[Any], scopes, path, bwd) -> list[Any]:
        open_, consts = _compat.open_and_consts(closed)
        return self.run(open_, consts, args, scopes, path, bwd)

    def eqn(self, eqn: Any, invals: list, scopes, path, bwd) -> list[Any]:
        prim, params = eqn.primitive, eqn.params
        here = (*path, _walk.label(eqn))
        if _compat.hi_prim(eqn) is not None:
            return self.hi(eqn, invals, scopes, here, bwd)
        if prim in (_compat.jit_p, _compat.closed_call_p, _compat.remat_p):
            if here[-1] == BACKWARD:  # the backward pass (``_grad_target``): not shown as a call
                here, bwd = path, True
            return self.body(params["jaxpr" if "jaxpr" in params else "call_jaxpr"], invals, scopes, here, bwd)
        if prim in (_compat.custom_jvp_call_p, _compat.custom_vjp_call_p):  # the primal body
            return self.body(params["call_jaxpr"], invals, scopes, here, bwd)
        if prim is _compat.cond_p:
            branch = params["branches"][int(np.asarray(invals[0]))]
            return self.body(branch, invals[1:], scopes, here, bwd)
        if prim is _compat.scan_p:
            return self.scan(eqn, invals, scopes, here, bwd)
        if prim is _compat.while_p:
            nc, nb = params["cond_nconsts"], params["body_nconsts"]
            cconsts, bconsts, carry = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
            while bool(np.asarray(self.body(params["cond_jaxpr"], [*cconsts, *carry], scopes, here, bwd)[0])):
                carry = self.body(params["body_jaxpr"], [*bconsts, *carry], scopes, here, bwd)
            return carry
        outs = _cpu_matmul.bind(prim, invals, dict(params))
        if not _walk.bodies(eqn) and any(
            _walk.is_half(v.aval.dtype) for v in eqn.outvars if _dtypes.is_castable(v.aval.dtype)
        ):
            self.check(eqn, invals, outs, scopes, path, bwd)
        return outs

    def scan(self, eqn: Any, invals: list, scopes, path, bwd) -> list[Any]:
        params = eqn.params
        n_consts, n_carry = _compat.scan_counts(params)
        length = int(params["length"])
        consts, carry, xs = invals[:n_consts], invals[n_consts : n_consts + n_carry], invals[n_consts + n_carry :]
        ys_steps = []
        order = range(length - 1, -1, -1) if params.get("reverse") else range(length)
        for i in order:
            outs = self.body(params["jaxpr"], [*consts, *carry, *(x[i] for x in xs)], scopes, path, bwd)
            carry, ys = outs[:n_carry], outs[n_carry:]
            ys_steps.append(ys)
        if params.get("reverse"):
            ys_steps.reverse()
        open_, _ = _compat.open_and_consts(params["jaxpr"])
        y_avals = [v.aval for v in open_.outvars[n_carry:]]
        stacked = [
            jnp.stack([s[k] for s in ys_steps]) if ys_steps else jnp.zeros((0, *a.shape), a.dtype)
            for k, a in enumerate(y_avals)
        ]
        return [*carry, *stacked]

    def hi(self, eqn: Any, invals: list, scopes, path, bwd) -> list[Any]:
        """A `call_hi_primitive` equation (JAX's upgrade flags): checkpoint and custom
        derivative bodies run in place (the primal body); a `Scan3` runs its body once per
        step, in order, as JAX's own `Scan3.expand` does (carries are `Ref` operands the
        body reads and writes); an opaque one (`searchsorted`, ...) is bound as it is."""
        kind, subs = _walk.kind(eqn), _walk.bodies(eqn)
        if kind in ("checkpoint", "custom_jvp", "custom_vjp") and len(subs) == 1:
            return self.body(subs[0], invals, scopes, path, bwd)
        if kind == "scan" and len(subs) == 1:
            extensive = _compat.hi_param(eqn, "extensives")
            steps = [
                self.body(subs[0], [x[i] if e else x for x, e in zip(invals, extensive)], scopes, path, bwd)
                for i in range(_walk.multiplier(eqn))
            ]
            open_, _ = _compat.open_and_consts(subs[0])
            return [
                jnp.stack([s[k] for s in steps]) if steps else jnp.zeros((0, *v.aval.shape), v.aval.dtype)
                for k, v in enumerate(open_.outvars)
            ]
        return _cpu_matmul.bind(eqn.primitive, invals, dict(eqn.params))

    # --- the equation-local float32 reference ---------------------------------------------

    def check(self, eqn: Any, invals: list, outs: list, scopes, path, bwd) -> None:
        """Bind `eqn` again with its half operands (and half dtype parameters) in float32."""
        name = eqn.primitive.name
        if (
            name in _REARRANGING
            or any(_compat.is_jaxpr_like(v) for v in eqn.params.values())
            or any(_compat.is_ref_aval(v.aval) for v in (*eqn.invars, *eqn.outvars))
        ):
            return  # moves half values without computing new ones / a combiner typed for half / state
        if name == "convert_element_type":  # the reference of a cast is its input
            self._report(
                eqn,
                scopes,
                path,
                bwd,
                str(np.dtype(outs[0].dtype)),
                _stats(np.asarray(outs[0], np.float32), np.asarray(invals[0], np.float32)),
            )
            return
        ref_in = [_dtypes.cast(x, _dtypes.FLOAT32) if _walk.is_half(_dtypes.dtype_of(x)) else x for x in invals]
        params = {k: (_dtypes.FLOAT32 if _is_half_dtype(v) else v) for k, v in eqn.params.items()}
        try:
            refs = _cpu_matmul.bind(eqn.primitive, ref_in, params)
        except Exception:  # noqa: BLE001 - a primitive that only exists in half precision
            return
        for out, ref in zip(outs, refs):
            if _walk.is_half(_dtypes.dtype_of(out)) and np.shape(out) == np.shape(ref):
                self._report(
                    eqn,
                    scopes,
                    path,
                    bwd,
                    str(np.dtype(out.dtype)),
                    _stats(np.asarray(out, np.float32), np.asarray(ref, np.float32)),
                )

    def _report(self, eqn: Any, scopes, path, bwd, dtype: str, st: dict) -> None:
        self.checked += 1
        if st["bad"] > 0:
            kind, count = ("overflow" if st["inf"] > 0 else "nan"), int(st["bad"])
        elif st["flushed"] > 0:
            kind, count = "underflow", int(st["flushed"])
        else:
            return
        key = (id(eqn), kind)
        if key in self.seen:
            return
        self.seen.add(key)
        src = _walk.source(eqn.source_info)
        self.findings.append(
            Finding(
                primitive=eqn.primitive.name,
                kind=kind,
                source=src,
                scopes=tuple(scopes),
                path=tuple(path),
                half_range=(float(st["hmin"]), float(st["hmax"])),
                float32_range=(float(st["rmin"]), float(st["rmax"])),
                dtype=dtype,
                count=count,
                backward=bool(bwd),
                suggestion=_suggest(
                    eqn.primitive.name, kind, src, bwd, dtype if np.isfinite([st["rmin"], st["rmax"]]).all() else ""
                ),
            )
        )


def _stats(h: np.ndarray, r: np.ndarray) -> dict[str, Any]:
    """Counts and ranges comparing a half-precision result with its float32 reference."""
    fin = np.isfinite(r)
    bad = ~np.isfinite(h) & fin
    big = float(np.max(np.abs(r[fin]), initial=0.0))
    flushed = (h == 0) & (r != 0) & fin & (np.abs(r) >= _UNDERFLOW_SIGNIFICANCE * big)
    with np.errstate(invalid="ignore"):
        return {
            "bad": int(bad.sum()),
            "inf": int((bad & np.isinf(h)).sum()),
            "flushed": int(flushed.sum()),
            "hmin": float(np.min(h, initial=np.inf)),
            "hmax": float(np.max(h, initial=-np.inf)),
            "rmin": float(np.min(r, initial=np.inf)),
            "rmax": float(np.max(r, initial=-np.inf)),
        }


def _is_half_dtype(v: Any) -> bool:
    if isinstance(v, (str, bool, int, float)) or v is None:
        return False
    try:
        return _walk.is_half(np.dtype(v))
    except TypeError:
        return False


@takes_amp_options
def find_overflow(
    fn: Callable, *, grad: bool = False, scale: float = 2.0**15, **options: Unpack[AmpKwargs]
) -> Callable[..., Findings]:
    """Find where `fn` breaks in half precision under `autocast.amp`.

    Runs `amp(fn)` eagerly, equation by equation (inside nested `jit`, `scan`,
    `while`, `cond`, `checkpoint` and custom-derivative bodies), and compares each
    half-precision result with the same equation evaluated in float32 on the same inputs.

    `find_overflow` takes `fn` and every option of `autocast.amp`, with the same defaults:
    the program checked is the one `amp(fn, **options)` makes.

    Args:
        fn: The function, as `autocast.amp` takes it.
        compute_dtype: `float16` (default), `bfloat16` or `float32` (a dtype or a string
            such as `"bf16"`): the half-precision dtype checked.
        amp_policy: A mapping from primitives or `jax.named_scope` names to rules;
            default `autocast.default_amp_policy`.
        remat_float32: Which float32 islands are recomputed in the backward pass:
            `"auto"` (default), `True`, `"matmuls"` or `False`, as in `autocast.amp`.
        weight_grad_dtype: The dtype the matmuls computing weight gradients write:
            `"float32"` (default) or `"compute"` (then they write half precision and are
            checked too, with `grad=True`).
        custom_vjp_bwd: How the backward rules of `jax.custom_vjp` functions run (with
            `grad=True`): `"amp"` (default, under the policy: their matmuls in half
            precision) or `"original"` (as written, in the dtypes they are given).
        attention: `"auto"` (default) or `"xla"`, as for `autocast.amp`; the program
            checked is the one amp runs on this machine (a fused attention kernel exists
            only on a CUDA GPU).
        loss_head: `"auto"` (default), `"xla"` or a number of chunks, as for
            `autocast.amp` (a chunked loss head is checked chunk by chunk).
        grad: Also check the backward pass; `fn` must return a scalar float loss, and
            the gradient is taken with respect to every floating array leaf of the
            arguments.
        scale: The loss scale the backward pass is checked at (`grad=True`).

    Returns:
        A function that takes `fn`'s (concrete) arguments and returns a list of `Finding`
            in program order, earliest first: `kind` `"overflow"`/`"nan"` (inf/NaN in half
            precision, finite in float32) or `"underflow"` (zero in half precision, a
            significant value in float32), with the primitive, the source line, the scopes,
            both value ranges and a suggestion. `print` it (its `checked` attribute counts
            the equations checked).

    Raises:
        TypeError: `fn` is not callable, `grad` is not a bool, `scale` is not a number, a
            keyword is not an option of `autocast.amp`, or `amp_policy` is not a mapping
            from primitives or scope names to rules.
        ValueError: `scale` is not positive and finite, an option has a value
            `autocast.amp` does not allow, or (when the returned function is called with
            `grad=True`) `fn` does not return a scalar float loss.

    Example:
        ```python
        findings = autocast.find_overflow(loss_fn, grad=True, scale=1.0)(params, batch)
        print(findings)
        ```
    """
    _check_fn("find_overflow", fn)
    opts = AmpOptions.from_kwargs("find_overflow", options)
    if not isinstance(grad, bool):
        raise TypeError(f"find_overflow(grad={grad!r}): grad must be True or False.")
    try:
        scale_f = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"find_overflow(scale={scale!r}): scale must be a positive finite number.") from None
    if not (np.isfinite(scale_f) and scale_f > 0):
        raise ValueError(f"find_overflow(scale={scale!r}): scale must be a positive finite number.")
    amp_fn = amp(fn, **opts.as_kwargs())

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Findings:
        flat_fn, dynamic = _flat(amp_fn, args, kwargs)
        target = _grad_target(flat_fn, dynamic, scale_f) if grad else flat_fn
        closed = jax.make_jaxpr(target)(*dynamic)
        checker = _Checker()
        jaxpr, consts = _compat.open_and_consts(closed)
        checker.run(jaxpr, consts, dynamic, _compat.scope_names(_compat.current_name_stack()), (), False)
        checker.findings.checked = checker.checked
        return checker.findings

    return run


def _grad_target(flat_fn: Callable, dynamic: list[Any], scale: float) -> Callable:
    """`(loss * scale, *grads)` of `flat_fn` w.r.t. its floating leaves."""
    shapes = jax.eval_shape(flat_fn, *dynamic)
    if len(shapes) != 1 or shapes[0].shape != () or not _dtypes.is_floating(shapes[0].dtype):
        got = ", ".join(f"{s.dtype}{list(s.shape)}" for s in shapes) or "no array"
        raise ValueError(f"find_overflow(grad=True): fn must return a scalar float loss; got {got}.")
    idx = [i for i, x in enumerate(dynamic) if _dtypes.is_floating(_dtypes.dtype_of(x))]

    def target(*dyn):
        def loss(*a):
            return flat_fn(*a)[0].astype(jnp.float32) * scale

        value, grads = gradients(loss, list(dyn), idx, jnp.ones_like)
        return [value, *grads]

    return target
