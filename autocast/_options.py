"""The options `amp`, `explain` and `find_overflow` share: one typed, validated object.

An option is added here, once: a field of `AmpOptions` (its default and type), its
check in `__post_init__`, its effect in `AmpOptions.context`, and its entry in
`AmpKwargs` (for type checkers). `amp`, `explain` and `find_overflow` take
`**options` and list these fields as their keyword arguments (`takes_amp_options`),
so the three accept the same options, with the same defaults and the same errors.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypedDict, TypeVar

import jax.numpy as jnp
import numpy as np

from . import _dtypes
from ._interpreter import Context
from ._policy import default_amp_policy, validate_policy

_WEIGHT_GRAD_DTYPES = ("float32", "compute")
_CUSTOM_VJP_BWD = ("amp", "original")
_ATTENTION = ("auto", "xla")
_REMAT = ("auto", "matmuls")


class AmpKwargs(TypedDict, total=False):
    """The keyword options of `amp`/`explain`/`find_overflow`, for type checkers
    (`**options: Unpack[AmpKwargs]`); the fields of `AmpOptions`."""

    compute_dtype: Any
    amp_policy: Mapping | None
    remat_float32: bool | Literal["auto", "matmuls"]
    weight_grad_dtype: Literal["float32", "compute"]
    custom_vjp_bwd: Literal["amp", "original"]
    attention: Literal["auto", "xla"]
    loss_head: Literal["auto", "xla"] | int


@dataclasses.dataclass(frozen=True)
class AmpOptions:
    """`amp`'s options, checked and in canonical form: `compute_dtype` a NumPy dtype,
    `amp_policy` a validated mapping (the default policy for `None`). See
    `autocast.amp` for what each does.

    Raises:
        ValueError: An option's value is not allowed (the message names the option, the
            value and what is allowed).
        TypeError: `amp_policy` is not a policy mapping (`validate_policy`).
    """

    compute_dtype: Any = jnp.float16
    amp_policy: Mapping | None = None
    remat_float32: bool | Literal["auto", "matmuls"] = "auto"
    weight_grad_dtype: Literal["float32", "compute"] = "float32"
    custom_vjp_bwd: Literal["amp", "original"] = "amp"
    attention: Literal["auto", "xla"] = "auto"
    loss_head: Literal["auto", "xla"] | int = "auto"

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: canonical values are written once, here
        set_(self, "compute_dtype", _dtypes.canonical_compute_dtype(self.compute_dtype))
        policy = default_amp_policy if self.amp_policy is None else self.amp_policy
        validate_policy(policy)
        set_(self, "amp_policy", policy)
        remat = self.remat_float32
        if not (remat is True or remat is False or (isinstance(remat, str) and remat in _REMAT)):
            raise ValueError(
                f"remat_float32={self.remat_float32!r} is not allowed; use True, False, 'auto' or 'matmuls'."
            )
        _check_choice("weight_grad_dtype", self.weight_grad_dtype, _WEIGHT_GRAD_DTYPES)
        _check_choice("custom_vjp_bwd", self.custom_vjp_bwd, _CUSTOM_VJP_BWD)
        _check_choice("attention", self.attention, _ATTENTION)
        head = self.loss_head
        if not (isinstance(head, str) and head in _ATTENTION) and not (
            isinstance(head, (int, np.integer)) and not isinstance(head, bool) and head >= 1
        ):
            raise ValueError(
                f"loss_head={head!r} is not allowed; use 'auto', 'xla' or a number of chunks (an int >= 1)."
            )
        if isinstance(head, np.integer):
            set_(self, "loss_head", int(head))

    @classmethod
    def from_kwargs(cls, caller: str, options: Mapping[str, Any]) -> AmpOptions:
        """The options `caller` (`"amp"`, `"explain"`, ...) was given.

        Raises:
            TypeError: A keyword is not an option (the message names it and `caller`).
            ValueError: An option's value is not allowed.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in names:
                raise TypeError(
                    f"{caller}() got an unexpected keyword argument {key!r}; the amp options are {', '.join(names)}."
                )
        return cls(**options)

    @property
    def dtype(self) -> np.dtype:
        """The compute dtype (`float16`, `bfloat16` or `float32`)."""
        return self.compute_dtype

    @property
    def policy(self) -> Mapping:
        """The policy (the default one if none was given)."""
        assert self.amp_policy is not None  # set in __post_init__
        return self.amp_policy

    def context(self, cls: type[Context] = Context) -> Context:
        """A new interpreter context (of type `cls`) with these options in effect."""
        ctx = cls(self.dtype, self.policy, self.remat_float32)
        ctx.float32_cotangents = self.weight_grad_dtype == "float32"
        ctx.custom_vjp_bwd = self.custom_vjp_bwd
        off = {"attention"} if self.attention == "xla" else set()
        if self.loss_head == "xla":
            off.add("loss_head")
        ctx.rewrites_off = frozenset(off)
        ctx.rewrite_settings = {"loss_head": self.loss_head}
        return ctx

    def as_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments (`amp(fn, **options.as_kwargs())`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _check_choice(argument: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not (isinstance(value, str) and value in allowed):
        choices = " or ".join(repr(a) for a in allowed)
        raise ValueError(f"{argument}={value!r} is not allowed; use {choices}.")


_F = TypeVar("_F", bound=Callable[..., Any])


def takes_amp_options(func: _F) -> _F:
    """Give `func`, declared with `**options`, a signature (`inspect.signature`, the
    API reference) that lists the fields of `AmpOptions` as keyword-only arguments
    with their defaults in place of `**options`."""
    sig = inspect.signature(func)
    own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(own) == len(sig.parameters) - 1, f"{func.__name__} must take **options"
    amp_options = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(AmpOptions)
    ]
    positional = [p for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    keyword = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]
    func.__signature__ = sig.replace(parameters=[*positional, *amp_options, *keyword])  # type: ignore[attr-defined]
    return func
