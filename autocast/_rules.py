"""Casting rules: what an equation's operands are cast to before it is bound, and how.

A rule is a `Rule`. Called, it has the protocol of jaxamp (which autocast keeps, so
jaxamp rules and plain functions work unchanged):

```text
rule(compute_dtype, original_dtypes, *invars, **bind_params) -> (invars, bind_params)
```

`compute_dtype` is the half-precision dtype given to `autocast.amp`;
`original_dtypes` are the dtypes the operands had when the function was traced (all
float32 for a float32 model); `invars` are the operands as they arrive now (some may
already be in half precision); `bind_params` are the primitive's parameters. A rule
returns the operands to bind with and the parameters; it must return as many operands as
it got, may change only float16/bfloat16/float32 operands, and only to a floating dtype
(`autocast._binding` checks). A plain function with that protocol is a rule too: a policy
may hold one, and the interpreter wraps it (`as_rule`) as an opaque rule.

Beyond the call, a `Rule` has (attributes set on its class, or per instance for a wrapped
function):

- `role`: what the planner (`autocast._plan`) may assume about its equation (a `Role`:
  it runs in the compute dtype, in float32, follows its operands' dtypes, ...;
  `"opaque"`, the default: nothing);
- `casts_only`: whether it changes its operands only by casting them; the binder
  (`autocast._binding`) then lets a narrowed parameter's gradient leave its matmul in
  float32 (`autocast._wide`);
- `primitives`: the names of the primitives it is for when a named scope maps to it
  (None, the default: every primitive in the scope); the policy lookup
  (`autocast._policy.Lookup.scope_rule`) leaves the scope's other equations to their own
  rules;
- `name`: shown by `autocast.explain`, in errors and as its repr;
- `cast(compute_dtype, original_dtypes, invars, params, free)`: what the interpreter calls
  to cast an equation's operands, with their free flags (by default the call protocol
  above; the call calls `cast` in turn, so a subclass overrides one of the two);
- `bind(ctx, eqn, arrived, cast, params, free)`: binds the equation itself and returns
  its outputs (a float8 matmul, a fused attention kernel), or None, the default, to have
  the interpreter bind it on the cast operands. `ctx` is a `RuleContext`
  (`autocast._rule_context`): a small, frozen, public view of the transformation, not the
  interpreter's private `Context`.

The built-in rules below (functions made `Rule` objects with their role),
`select_in_float32`, `autocast._fp8`'s float8 rules and the attention rewrite's rules
(`autocast._attention._fuse`) are all `Rule` objects. `CATEGORIES` names the rules a policy
file may use; a feature adds its own with `register_category`.

Rules never change integers, booleans, PRNG keys, float64 or complex values: the helpers
here skip them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import jax
import numpy as np

from . import _compat, _dtypes, _pick
from ._rule_context import RuleContext

Role = Literal["compute", "float32", "input", "widest", "original", "as_is", "convert", "select_float32", "opaque"]
"""What the planner may assume about a rule's equation (`Rule.role`)."""

Cast = tuple[list[Any], dict[str, Any]]


class Rule:
    """A casting rule: called as `rule(compute_dtype, original_dtypes, *invars, **params)`,
    it returns `(invars, params)` to bind with (the call protocol, see
    [Policies and rules](../policies.md)).

    Subclass it for a rule the planner should know more about, or that binds its equation
    itself; define `cast` or `__call__` (each calls the other by default): a subclass that
    defines neither is refused when the class is defined (a `TypeError` naming it), as an
    abstract base class would be. A base class meant to be subclassed again declares
    itself `class Base(autocast.Rule, abstract=True)`: it may leave both out, and is not
    instantiated.

    Attributes:
        role: What the planner may assume. `"compute"`: the equation runs in the compute
            dtype, reading and making half-precision values (a matmul: the planner rounds
            float32 values that only such equations read, and may store a float32 result
            where only float32 operations read it). `"float32"`: it computes in float32.
            `"input"`: it follows the dtypes its operands arrive in (the planner may
            switch it to float32 where only float32 operations read its result).
            `"widest"`, `"original"`, `"as_is"`, `"convert"`: as the built-in rules
            of those names. `"select_float32"`: the planner's own rule for a selection
            read in float32 (`select_in_float32`). `"opaque"` (default): nothing is
            assumed.
        casts_only: Whether the rule changes its operands only by casting them (a narrowed
            parameter's gradient may then leave its matmul in float32, `autocast._wide`).
        name: Shown by `autocast.explain` and in errors.
        primitives: The names of the primitives the rule is for when a named scope maps to it
            (None, the default: every primitive in the scope). A rule for one primitive (the
            fused-attention switch) then leaves the scope's other equations to their own rules.

    Example:
        ```python
        class CountedMatmuls(autocast.Rule):
            role = "compute"
            casts_only = True
            name = "counted_matmuls"
            count = 0

            def cast(self, compute_dtype, original_dtypes, invars, params, free):
                return autocast.use_compute_precision.cast(compute_dtype, original_dtypes, invars, params, free)

            def bind(self, ctx, eqn, arrived, cast, params, free):
                type(self).count += 1
                return None  # bound as usual


        policy = autocast.extend_policy({jax.lax.dot_general_p: CountedMatmuls()})
        autocast.amp(loss_fn, amp_policy=policy)(params, batch)
        assert CountedMatmuls.count > 0
        ```
    """

    role: Role = "opaque"
    casts_only: bool = False
    name: str = "rule"
    primitives: frozenset[str] | None = None
    _abstract: bool = True  # Rule itself; each subclass sets its own (`__init_subclass__`)

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        """Refuse a concrete subclass that defines neither `cast` nor `__call__` (each of
        `Rule`'s calls the other: the rule would recurse until Python's limit)."""
        super().__init_subclass__(**kwargs)
        cls._abstract = abstract
        if not abstract and cls.cast is Rule.cast and cls.__call__ is Rule.__call__:
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__} subclasses autocast.Rule but defines neither `cast` nor "
                "`__call__`: define cast(self, compute_dtype, original_dtypes, invars, params, free) -> (invars, "
                "params), or __call__ with the rule protocol (or declare a base class with abstract=True)."
            )

    def __new__(cls, *args: Any, **kwargs: Any) -> Rule:
        if cls._abstract:
            raise TypeError(
                f"{cls.__qualname__} is abstract (it defines no `cast`): subclass it and define `cast` or `__call__`."
            )
        return super().__new__(cls)

    def cast(
        self,
        compute_dtype: np.dtype,
        original_dtypes: Sequence[Any],
        invars: Sequence[Any],
        params: dict[str, Any],
        free: Sequence[Any] | None,
    ) -> Cast:
        """Cast an equation's operands: what the interpreter calls.

        Args:
            compute_dtype: The half-precision dtype given to `autocast.amp`.
            original_dtypes: The dtypes the operands had when the function was traced.
            invars: The operands as they arrive.
            params: The primitive's parameters.
            free: Per operand, whether it is a function input, a constant, a literal or
                only moved from them (None: unknown).

        Returns:
            The operands to bind with and the parameters (by default, what the call
                protocol returns).
        """
        with _free_operands(free):
            return self(compute_dtype, original_dtypes, *invars, **params)

    def bind(
        self,
        ctx: RuleContext,
        eqn: Any,
        arrived: Sequence[Any],
        cast: Sequence[Any],
        params: dict[str, Any],
        free: Sequence[Any] | None,
    ) -> list[Any] | None:
        """Bind the equation itself (a float8 matmul, a fused attention kernel).

        Args:
            ctx: What the rule may use of the transformation (an `autocast.RuleContext`,
                frozen: the compute dtype, the named scopes, the remat settings, evaluating
                a closed jaxpr as amp would, ...).
            eqn: The equation.
            arrived: The operands before `cast`.
            cast: The operands `cast` returned.
            params: The parameters `cast` returned.
            free: Per operand, whether it is a free value (as for `cast`).

        Returns:
            The equation's outputs, or None (the default) to have the interpreter bind
                `eqn.primitive` on the cast operands.
        """
        return None

    def __call__(self, compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **params: Any) -> Cast:
        return self.cast(compute_dtype, original_dtypes, list(invars), params, _FREE.get())

    def __repr__(self) -> str:
        return self.name


# While a rule runs: which operands are free (see `Rule.cast`), so that a plain function
# rule that delegates to a built-in one (`use_input_precision`) gets the same answer.
_FREE: contextvars.ContextVar[Sequence[Any] | None] = contextvars.ContextVar("free_operands", default=None)


@contextlib.contextmanager
def _free_operands(free: Sequence[Any] | None) -> Iterator[None]:
    token = _FREE.set(free)
    try:
        yield
    finally:
        _FREE.reset(token)


class _FunctionRule(Rule):
    """A rule from a function with the call protocol (a built-in rule's documented
    function, or a user's), with what the planner may assume about it."""

    def __init__(self, fn: Callable[..., Any], role: Role = "opaque", casts_only: bool = False, cast=None):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._cast = cast
        self.role = role
        self.casts_only = casts_only
        self.name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)

    def __call__(self, compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **params: Any) -> Cast:
        return self._fn(compute_dtype, original_dtypes, *invars, **params)

    def cast(self, compute_dtype, original_dtypes, invars, params, free) -> Cast:
        if self._cast is not None:
            return self._cast(compute_dtype, original_dtypes, list(invars), params, free)
        with _free_operands(free):
            return self._fn(compute_dtype, original_dtypes, *invars, **params)


def _builtin(role: Role, casts_only: bool = False, cast=None) -> Callable[[Callable[..., Any]], Rule]:
    return lambda fn: _FunctionRule(fn, role, casts_only, cast)


_WRAPPED: dict[Any, Rule] = {}


def as_rule(rule: Any) -> Rule:
    """`rule` as a `Rule`: itself, or a callable with the call protocol wrapped
    (once per callable) as an opaque rule."""
    if isinstance(rule, Rule):
        return rule
    try:
        return _WRAPPED[rule]
    except (KeyError, TypeError):
        pass
    wrapped = _FunctionRule(rule)
    try:
        _WRAPPED[rule] = wrapped
    except TypeError:  # an unhashable callable: wrapped anew each time
        pass
    return wrapped


def _castable_pairs(original_dtypes: Sequence[Any], invars: Sequence[Any]) -> list[int]:
    return [
        i
        for i, (orig, x) in enumerate(zip(original_dtypes, invars))
        if _dtypes.is_castable(orig) and _dtypes.is_castable(_dtypes.dtype_of(x))
    ]


def _cast_all(invars: Sequence[Any], indices: Sequence[int], dtype: Any) -> list[Any]:
    out = list(invars)
    for i in indices:
        out[i] = _dtypes.cast(out[i], dtype)
    return out


def _with_preferred(params: dict[str, Any], dtype: Any) -> dict[str, Any]:
    pref = params.get("preferred_element_type")
    if pref is not None and _dtypes.is_castable(pref):
        return dict(params, preferred_element_type=np.dtype(dtype))
    return params


@_builtin("compute", casts_only=True)
def use_compute_precision(compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **params: Any) -> Cast:
    """Float operands in the compute dtype (matmuls, convolutions).

    A `preferred_element_type` becomes the compute dtype too, so the result is stored in
    half precision (XLA still accumulates in float32 on GPUs and TPUs).

    Returns:
        The operands to bind with and the parameters (the rule
            protocol, see [Policies and rules](../policies.md)).

    Example:
        ```python
        policy = autocast.extend_policy({jax.lax.cumsum_p: autocast.use_compute_precision})
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
        ```
    """
    idx = _castable_pairs(original_dtypes, invars)
    return _cast_all(invars, idx, compute_dtype), _with_preferred(params, compute_dtype)


@_builtin("float32")
def use_float32_precision(compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **params: Any) -> Cast:
    """Float operands in float32; the result stays float32 (exp/log, reductions, ...).

    Returns:
        The operands to bind with and the parameters (the rule protocol).

    Example:
        ```python
        policy = autocast.extend_policy({jax.lax.tanh_p: autocast.use_float32_precision})
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
        ```
    """
    idx = _castable_pairs(original_dtypes, invars)
    return _cast_all(invars, idx, _dtypes.FLOAT32), _with_preferred(params, _dtypes.FLOAT32)


class _SelectInFloat32(Rule):
    """The planner's float32 rule for a slice or a gather that reads each element of its
    operand at most once and whose every reader computes in float32 (the label logit of a
    cross-entropy); not a policy category. Its `bind` takes a half-precision operand
    through a custom JVP: the result is selected from the operand's float32 conversion (the
    very value the other float32 readers of the operand convert to, so XLA's excess precision
    cannot give the two paths different roundings), but the tangent is selected in half
    precision and converted after, so the backward pass scatters a half-precision cotangent,
    of the operand's size, that XLA folds into the operand's other cotangents, instead of a
    float32 one. The cast itself leaves the operand as it arrives (the binding converts it);
    a float32 operand is selected as it is. A gather that picks one element per row
    (`take_along_axis`, `_pick.row_axis`) is bound, for a TPU, as a masked sum over the row
    (`_pick`): no gather and no scatter, and nothing of the operand's size for XLA:TPU to keep."""

    role: Role = "select_float32"
    name = "select_in_float32"

    def cast(self, compute_dtype, original_dtypes, invars, params, free) -> Cast:
        return list(invars), params

    def bind(self, ctx, eqn, arrived, cast, params, free):
        x = arrived[0]
        if not _dtypes.is_castable(_dtypes.dtype_of(x)) or _dtypes.dtype_of(x) == _dtypes.FLOAT32:
            return None  # selected as it is
        axis = _pick.row_axis(params, x.shape, cast[1].shape) if eqn.primitive.name == "gather" else None

        def gather(x, indices):
            return _compat.bind(eqn.primitive, [x, indices], params)[0]

        def bind(vals):
            if axis is not None:  # a pick per row: on a TPU, a masked sum that fuses with the row's reductions
                return [_pick.pick(vals[0], vals[1], params, axis, gather)]
            return _compat.bind(eqn.primitive, vals, params)

        def select(x, *rest):
            return bind([_dtypes.cast(x, _dtypes.FLOAT32), *rest])[0]

        select.__name__ = select.__qualname__ = f"{eqn.primitive.name}_in_float32"  # names the call in jaxprs
        select = jax.custom_jvp(select)

        @select.defjvp
        def _select_jvp(primals, tangents):
            return select(*primals), _dtypes.cast(bind([tangents[0], *primals[1:]])[0], _dtypes.FLOAT32)

        return [select(x, *cast[1:])]


select_in_float32 = _SelectInFloat32()


@_builtin("original")
def use_original_precision(compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **params: Any) -> Cast:
    """Every operand back in the dtype it had when the function was traced.

    Returns:
        The operands to bind with and the parameters (the rule protocol).

    Example:
        ```python
        policy = autocast.extend_policy({"head": autocast.use_original_precision})  # a named scope
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
        ```
    """
    out = list(invars)
    for i in _castable_pairs(original_dtypes, invars):
        out[i] = _dtypes.cast(out[i], original_dtypes[i])
    return out, params


@_builtin("widest")
def use_widest_precision(compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **params: Any) -> Cast:
    """Mixed float operands promoted to the widest of their current dtypes.

    Returns:
        The operands to bind with and the parameters (the rule protocol).

    Example:
        ```python
        policy = autocast.extend_policy({jax.lax.add_p: autocast.use_widest_precision})
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
        ```
    """
    idx = _castable_pairs(original_dtypes, invars)
    if not idx:
        return list(invars), params
    target = _dtypes.widest(_dtypes.dtype_of(invars[i]) for i in idx)
    return _cast_all(invars, idx, target), params


@_builtin("input")
def use_input_precision(compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **params: Any) -> Cast:
    """Run in the dtype the operands arrive in; mixed float operands are harmonised.

    Operands that were computed decide: if they all arrive in one dtype, that dtype is
    used and free operands (parameters, inputs, constants, and values only reshaped or
    broadcast from them) are cast to it, so `x16 + bias32` and `x16 * 0.5` stay in half
    precision. Computed operands of different dtypes are promoted to the widest, so a
    float32 statistic is never rounded to half precision (`x16 - mean32` runs in float32).

    Returns:
        The operands to bind with and the parameters (the rule protocol).

    Example:
        ```python
        policy = autocast.extend_policy({jax.lax.exp_p: autocast.use_input_precision})
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
        ```
    """
    idx = _castable_pairs(original_dtypes, invars)
    if len(idx) < 2:
        return list(invars), params
    free = _FREE.get()
    computed = [i for i in idx if free is None or not free[i]]
    deciders = computed or idx
    target = _dtypes.widest(_dtypes.dtype_of(invars[i]) for i in deciders)
    return _cast_all(invars, idx, target), params


@_builtin("as_is")
def use_as_is(compute_dtype: Any, original_dtypes: Sequence[Any], *invars: Any, **params: Any) -> Cast:
    """No casting at all (operands of independent dtypes: sort keys and values, barriers).

    Returns:
        The operands unchanged and the parameters (the rule protocol).

    Example:
        ```python
        policy = autocast.extend_policy({jax.lax.sort_p: autocast.use_as_is})
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
        ```
    """
    return list(invars), params


def use_precision(dtype: Any) -> Rule:
    """A rule that casts the float operands to `dtype` (float16, bfloat16 or float32).

    Args:
        dtype: `float16`, `bfloat16` or `float32` (a dtype or its name).

    Returns:
        A rule with the rule protocol.

    Example:
        ```python
        policy = autocast.extend_policy({"rms_norm": autocast.use_precision(jnp.float32)})
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
        ```
    """
    target = _dtypes.canonical_compute_dtype(dtype, argument="dtype")

    def rule(compute_dtype, original_dtypes, *invars, **params):
        idx = _castable_pairs(original_dtypes, invars)
        return _cast_all(invars, idx, target), _with_preferred(params, target)

    rule.__name__ = rule.__qualname__ = f"use_precision({target.name})"
    return _FunctionRule(rule, casts_only=True)


@_builtin("convert")
def convert_element_type_rule(compute_dtype, original_dtypes, *invars, **params):
    """`astype`: a float32 -> float32 conversion (weak type to strong type) follows its
    input's current dtype; an explicit cast to another dtype is kept."""
    (x,) = invars
    new = params.get("new_dtype")
    orig = original_dtypes[0]
    cur = _dtypes.dtype_of(x)
    if _dtypes.is_castable(orig) and _dtypes.is_castable(cur) and new is not None and np.dtype(new) == np.dtype(orig):
        params = dict(params, new_dtype=cur)
    return [x], params


CATEGORIES: dict[str, Rule] = {
    "compute": use_compute_precision,
    "float32": use_float32_precision,
    "input": use_input_precision,
    "widest": use_widest_precision,
    "original": use_original_precision,
    "as_is": use_as_is,
    "convert": convert_element_type_rule,
}
"""The rule each category name of a policy file stands for: the built-in ones, and those a
feature module adds at its import with `register_category` (`autocast._fp8`'s `fp8` and
`fp8_any`, the attention rewrite's `attention` and `xla_attention`)."""


def register_category(name: str, rule: Rule) -> Rule:
    """Add a category to the policy files' vocabulary (`CATEGORIES`): how a feature declares
    its rules, at its import, without the policy (`autocast._policy`) importing it.

    Args:
        name: The category's name in a policy file (`[primitives]`, `[scopes]`, `fallback`).
        rule: The rule it stands for.

    Returns:
        `rule`.

    Raises:
        TypeError: `rule` is not a `Rule`.
        ValueError: `name` stands for another rule already.
    """
    if not isinstance(rule, Rule):
        raise TypeError(f"register_category({name!r}): rule={rule!r} is not an autocast.Rule.")
    if CATEGORIES.get(name, rule) is not rule:
        raise ValueError(f"register_category({name!r}): the category stands for {CATEGORIES[name]!r} already.")
    CATEGORIES[name] = rule
    return rule
