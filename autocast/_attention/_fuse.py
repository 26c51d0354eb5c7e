"""The rewrite in amp: each attention span `find` proves becomes one `fused_attention`
equation, which its rule binds as a platform choice.

The rewrite is registered at import (`REWRITE`, through `autocast._rewrites`, the door of
whole-program rewrites), with its policy categories (`attention`, `xla_attention`:
`autocast._rules.register_category`); neither the interpreter nor the policy imports this
module. Before a jaxpr is planned, for each `Match` whose span the policy lets fuse (the
rule of `fused_attention` under the span's named scopes is `ATTENTION`, not
`XLA_ATTENTION`; never inside `amp_stop`), the span's equations become one equation of
`fused_attention_p` that holds the match and the span as a closed jaxpr (its `body`).
The planner sees one opaque equation; its rule, `_Fused`, binds it:

- a span is fused where a platform has a kernel for it (`Emit`: cuDNN on CUDA where the
  cuDNN call traces, `cudnn_plan`: a machine with a CUDA jaxlib and cuDNN, a deviceless
  compile for a GPU included; Pallas's splash attention on TPU where `_splash.tpu_plan`
  takes it, on a machine that can compile for a TPU: `_splash.tpu_refusal`); where none has (no cuDNN and a match splash refuses) its
  equations stay as they are, and the program is exactly what it was;
- the rule binds it as `lax.platform_dependent`: one branch per such platform, the fused
  kernel (on CUDA `jax.nn.dot_product_attention(..., implementation="cudnn")`, on TPU splash
  attention, both on q, k and v in the compute dtype, whose residuals are q, k, v, the output
  and a float32 row statistic: no softmax island to recompute), elsewhere the span's own
  equations under amp's rules. Lowering keeps only the branch of the platform compiled for:
  the CPU program is the one the span as written gives.

`explain` lists each attention: the kernel chosen on each platform, and why a platform has
none, or why it was left alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import _dtypes, _rewrites, _rules
from . import _derivatives, _splash
from ._call import call, cudnn_plan, pad_sequences
from ._find import find
from ._match import LeftAlone, Match

fused_attention_p = _rewrites.span_primitive("fused_attention")
"""One attention span of a jaxpr amp evaluates (params: `match`; `emit`, a `_Fusion`: per
platform with a kernel for it, the kernel and the match as it takes it (its `plan`, the
sequences maybe padded), and the platforms without one, with the reason; `body`, the span's
equations; `scopes`)."""


@dataclasses.dataclass(frozen=True)
class Emit:
    """Where the platform choice runs a fused call, and which kernel: `branches`, pairs of a
    `lax.platform_dependent` branch name and a kernel: `"cudnn"` or `"xla"`
    (`jax.nn.dot_product_attention`'s implementation), `"splash"` (Pallas's TPU splash attention,
    `_splash`; in interpret mode on a platform other than `tpu`), or a function with
    `jax.nn.dot_product_attention`'s arguments but `implementation` (a test's stand-in: see
    `emitting`). The default: cuDNN on CUDA, splash on TPU."""

    branches: tuple[tuple[str, str | Callable[..., Any]], ...] = (("cuda", "cudnn"), ("tpu", "splash"))


@dataclasses.dataclass(frozen=True, eq=False)
class _Branch:
    """One platform's fused call for one span: `plan` is the match as `kernel` takes it."""

    platform: str
    kernel: str | Callable[..., Any]
    plan: Match

    def describe(self) -> str:
        if self.kernel == "splash":
            return f"{_splash.describe(self.plan)} on {self.platform}"
        kernel = self.kernel if isinstance(self.kernel, str) else "custom"
        pad = f" (sequences padded to a multiple of {self.plan.seq_multiple})" if self.plan.seq_multiple > 1 else ""
        return f"{kernel}{pad} on {self.platform}"

    def run(self, inputs: Sequence[Any]) -> list[Any]:
        """The span's outputs by the kernel, differentiable in every mode (`_derivatives`)."""
        kernel = self.kernel
        if kernel == "splash":
            kernel = _splash.kernel(self.plan, interpret=self.platform != "tpu")
        elif isinstance(kernel, str):
            kernel = functools.partial(jax.nn.dot_product_attention, implementation=kernel)
        return call(self.plan, inputs, attend=_derivatives.differentiable(kernel, _float32_xla))


@dataclasses.dataclass(frozen=True, eq=False)
class _Fusion:
    """A span's fused calls (`branches`, one per platform with a kernel for it) and the
    platforms that have none, with the reason (`refused`)."""

    branches: tuple[_Branch, ...]
    refused: tuple[str, ...] = ()

    def describe(self) -> str:
        text = "fused: " + ", ".join(b.describe() for b in self.branches) + ", else as written"
        return text + "".join(f"; {r}" for r in self.refused)


def _float32_xla(q: Any, k: Any, v: Any, *, bias: Any = None, **kwargs: Any) -> Any:
    """XLA's attention in float32, the result in q's dtype: the derivatives of the fused call
    other than its first-order reverse mode (in half precision, a tangent through the softmax
    loses several percent to cancellation)."""
    f32 = jnp.float32
    bias = None if bias is None else bias.astype(f32)
    out = jax.nn.dot_product_attention(q.astype(f32), k.astype(f32), v.astype(f32), bias=bias, **kwargs)
    return out.astype(q.dtype)


_CUDNN_AND_SPLASH = Emit()
_EMIT: contextvars.ContextVar[Emit] = contextvars.ContextVar("autocast_attention_emit", default=_CUDNN_AND_SPLASH)


@contextlib.contextmanager
def emitting(platform: str, kernel: str | Callable[..., Any]) -> Iterator[Emit]:
    """Within the block, amp emits the fused call on `platform` with `kernel` only (see
    `Emit`; the default is cuDNN on CUDA and splash on TPU). For tests: `emitting("cpu", "xla")`
    runs the rewrite on a machine without cuDNN (no cuDNN support query), the fused branch
    being the one that runs; `emitting("cpu", "splash")` runs splash attention there, in
    Pallas's interpret mode. Read when amp traces: a function jitted before the block keeps
    its program."""
    emit = Emit(((platform, kernel),))
    token = _EMIT.set(emit)
    try:
        yield emit
    finally:
        _EMIT.reset(token)


class _Fused(_rules.Rule):
    """The rule of `fused_attention`: the span as one fused kernel where it traces (on
    CUDA, by `lax.platform_dependent`), its own equations under amp's rules elsewhere. The
    kernel is differentiable in every mode (`_derivatives.differentiable`: its own backward
    pass for a first-order reverse-mode derivative, XLA's attention for every other)."""

    role: _rules.Role = "opaque"
    name = "fused_attention"
    primitives = frozenset({"fused_attention"})

    def cast(self, compute_dtype, original_dtypes, invars, params, free):
        return list(invars), params  # the kernel casts q, k, v itself; the equations by their rules

    def bind(self, ctx, eqn, arrived, cast, params, free):
        match, fusion, body, scopes = (params[k] for k in ("match", "emit", "body", "scopes"))
        n = len(match.inputs)
        flags = list(free or [False] * len(arrived))
        ctx.observer.rewrite("attention", match.describe(), fusion.describe())

        def original(*ops: Any) -> list[Any]:  # the span's equations, as written
            return ctx.eval_closed(body, ops, flags, scopes=scopes, rewrites=False)

        # the shapes' trace is not the program: explain sees the branch's
        shapes = jax.eval_shape(
            lambda *a: ctx.eval_closed(body, a, flags, scopes=scopes, rewrites=False, observed=False), *arrived
        )

        def fused(branch: _Branch) -> Callable[..., list[Any]]:
            def run(*ops: Any) -> list[Any]:
                return [o.astype(s.dtype) for o, s in zip(branch.run(ops[:n]), shapes)]

            if _recompute(ctx, branch.plan):
                return jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)
            return run

        branches = {b.platform: fused(b) for b in fusion.branches}
        return list(jax.lax.platform_dependent(*arrived, **branches, default=original))


def _recompute(ctx: _rules.RuleContext, plan: Match) -> bool:
    """Whether the fused call is recomputed in the backward pass (one more forward kernel)
    instead of keeping its residuals (its output and a float32 row statistic), by
    `remat_float32` as for a float32 island: `True` always; `"auto"` where that cuts what it
    keeps by much: padded sequences, whose padded output would be kept beside the sliced copy
    its reader keeps (ViT-Base's 197 tokens: +7 % peak on the H100 target; recomputed +0.4 %);
    `False` never."""
    if not ctx.remat or ctx.recomputed:  # (inside a checkpoint that recomputes it anyway)
        return False
    return ctx.remat is True or plan.seq_multiple > 1


ATTENTION = _Fused()
XLA_ATTENTION = _rewrites.AsWritten("xla_attention", fused_attention_p)
CATEGORIES = {"attention": ATTENTION, "xla_attention": XLA_ATTENTION}
"""The policy categories this module adds (`autocast._rules.register_category`)."""
for _name, _rule in CATEGORIES.items():
    _rules.register_category(_name, _rule)

# (what the match is, its inputs' shapes and dtypes) -> the sequence multiple the cuDNN call
# traces with: one trace per kind of span, not per trace of it. Only successes are kept: a
# failure may be the machine's state at that moment (cuDNN not loaded yet), and on a machine
# without cuDNN the query fails at once.
_PLANS: dict[tuple, int | str] = {}


def _key(match: Match) -> tuple:
    return (match.describe(), tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in match.inputs))


def _plan_for(match: Match) -> Match | str:
    """`cudnn_plan` of `match` (the match to emit, or why there is none), its successes
    memoised on what the match is and its operands' shapes and dtypes."""
    key = _key(match)
    got = _PLANS.get(key)
    if isinstance(got, int):
        return pad_sequences(match, got)
    plan = cudnn_plan(match)
    if not isinstance(plan, str):
        _PLANS[key] = plan.seq_multiple
    return plan


def _spans(jaxpr: Any, consts: Sequence[Any], compute_dtype: Any) -> list[_rewrites.Span | _rewrites.Kept]:
    """The rewrite's finder: each attention of `jaxpr`'s top-level equations, a span to fuse
    or what was left alone and why (`consts`: the values of its constants, from which
    constant masks are evaluated). None unless the compute dtype is a half one."""
    if compute_dtype not in _dtypes.HALF:
        return []
    return [
        _rewrites.Kept(m.describe(), "left alone")
        if isinstance(m, LeftAlone)
        else _rewrites.Span(tuple(m.eqns), tuple(m.inputs), tuple(m.outputs), m.describe(), m)
        for m in find(jaxpr, compute_dtype=compute_dtype, consts=consts)
    ]


def _splash_plan_for(match: Match) -> Match | str:
    """`tpu_plan` of `match`, its answers memoised as `_plan_for`'s (it depends on the match
    and its operands only: no machine state)."""
    key = ("splash", *_key(match))
    if key not in _PLANS:
        plan = _splash.tpu_plan(match)
        _PLANS[key] = plan if isinstance(plan, str) else plan.seq_multiple
    got = _PLANS[key]
    return got if isinstance(got, str) else pad_sequences(match, got)


def _prepare(span: _rewrites.Span, setting: Any = None) -> dict[str, Any] | str:
    """The `fused_attention` equation's parameters for a span the policy lets fuse: its
    `match` and the fused call per platform (`emit`, a `_Fusion`: the `plan` each kernel takes,
    `cudnn_plan` and `tpu_plan` where they trace, the platforms `emitting` names); or why there
    is no fused kernel here."""
    match = span.found
    branches, refused = [], []
    for platform, kernel in _EMIT.get().branches:
        if kernel == "cudnn":
            plan: Match | str = _plan_for(match)
            plan = plan if not isinstance(plan, str) else f"cuDNN: {plan}"
        elif kernel == "splash":
            # (interpreted elsewhere: plain XLA, which partitions)
            plan = (_splash.tpu_refusal() if platform == "tpu" else None) or _splash_plan_for(match)
        else:
            plan = match
        if isinstance(plan, str):
            refused.append((platform, plan))
        else:
            branches.append(_Branch(platform, kernel, plan))
    if not branches:
        return "no fused kernel here (" + "; ".join(why for _, why in refused) + ")"
    return {"match": match, "emit": _Fusion(tuple(branches), tuple(f"{p}: as written ({why})" for p, why in refused))}


REWRITE = _rewrites.register_rewrite("attention", fused_attention_p, _spans, ATTENTION, _prepare, recomputable=True)
"""The attention rewrite, registered: `autocast._rewrites.rewrite` applies it to each jaxpr
amp evaluates, before it is planned (never inside `amp_stop`, nor where the policy maps the
span's scopes to `xla_attention`, nor with `amp(attention="xla")`)."""
