"""Policies: which rule applies to which primitive or named scope.

A policy is a mapping from a `jax.extend.core.Primitive` or a `jax.named_scope`
name to a rule (see `autocast._rules`); the key `"amp_default"` names the rule for
primitives the policy does not mention. The shipped tables are TOML files in the
`autocast.policies` package (`policies/` in the repository), resolved to primitives here
and nowhere else. A table may extend another (`extends`: a shipped name or a path relative
to its file; `_resolved_table` applies the chain, `_merge` one step of it) and list only
its differences. Its optional `[accumulation]` section (`selects`, `exceptions`) says why
a primitive that combines elements is not in the `float32` category; it changes no rule
(`accumulation` reads it for `tests/test_accumulation.py`).
"""

from __future__ import annotations

import collections
import fnmatch
import functools
import importlib.resources
import os
import pathlib
import tomllib
import types
from collections.abc import Iterator, Mapping
from typing import Any

from . import _compat, _rewrites, _rules

PolicyKey = _compat.Primitive | str
AMP_DEFAULT = "amp_default"
AMP_STOP = "amp_stop"

CATEGORIES: dict[str, _rules.Rule] = _rules.CATEGORIES
"""The rule each category name of a policy file stands for (`policies/README.md`): the
table of `autocast._rules`, which feature modules (`autocast._fp8`, `autocast._attention`)
fill at their import (`register_category`); this module imports none of them."""

# Rules registered with `register_rule`: part of the default policy, and the fallback of
# any user policy for a primitive it does not name.
_REGISTRY: dict[_compat.Primitive, _rules.Rule] = {}


class AmpPolicy(Mapping):
    """A read-only policy: primitive or scope name -> rule.

    Build one with `load_policy` or `extend_policy`; a plain `dict` works
    wherever a policy is taken, too. Lookups are live: `extend_policy` layers sit on top of
    their base, so rules registered later with `register_rule` are seen.

    Example:
        ```python
        policy = autocast.extend_policy({jax.lax.tanh_p: autocast.use_float32_precision})
        assert isinstance(policy, autocast.AmpPolicy)
        assert policy[jax.lax.tanh_p] is autocast.use_float32_precision
        ```
    """

    def __init__(self, layers: tuple[Mapping, ...], name: str, unresolved: tuple[str, ...] = ()):
        self._chain: collections.ChainMap[Any, Any] = collections.ChainMap(*layers)  # type: ignore[arg-type]
        self._layers = layers
        self.name = name
        self.unresolved = unresolved
        """Names in the policy file that this JAX version does not define."""

    def __getitem__(self, key: PolicyKey) -> _rules.Rule:
        return self._chain[key]

    def __iter__(self) -> Iterator[PolicyKey]:
        return iter(self._chain)

    def __len__(self) -> int:
        return len(self._chain)

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __repr__(self) -> str:
        return f"AmpPolicy({self.name!r}, {len(self)} entries)"


def validate_policy(policy: Mapping, *, argument: str = "amp_policy") -> None:
    """Raise a TypeError naming the first bad key or rule of `policy`."""
    if isinstance(policy, (str, os.PathLike)):
        raise TypeError(
            f"{argument}={policy!r}: a policy table's name or path is loaded with "
            f"autocast.load_policy({str(policy)!r}); {argument} takes the loaded mapping."
        )
    if not isinstance(policy, Mapping):
        raise TypeError(
            f"{argument} must be a mapping from primitives or scope names to rules, got {type(policy).__name__}."
        )
    for key, rule in policy.items():
        if not isinstance(key, (_compat.Primitive, str)):
            raise TypeError(
                f"{argument} key {key!r} (a {type(key).__name__}) is neither a jax Primitive nor a "
                f"named-scope string; use e.g. jax.lax.exp_p, 'amp_default' or 'my_scope'."
            )
        if not callable(rule):
            raise TypeError(
                f"{argument}[{_key_name(key)!r}] = {rule!r} is not callable; a rule is a function "
                f"rule(compute_dtype, original_dtypes, *invars, **params) -> (invars, params)."
            )


def _key_name(key: PolicyKey) -> str:
    return key if isinstance(key, str) else key.name


@functools.cache
def _discovered() -> dict[str, list[_compat.Primitive]]:
    return _compat.discover_primitives()


def _primitives_by_name() -> dict[str, list[_compat.Primitive]]:
    """The primitives a policy file may name: JAX's, and the registered rewrites' own
    (`autocast._rewrites`: `fused_attention`)."""
    return {**_discovered(), **_rewrites.primitives_by_name()}


_SHIPPED = "autocast.policies"
_TOP_LEVEL = ("schema", "extends", "name", "description", "fallback", "primitives", "scopes", "accumulation")


def _shipped_names() -> list[str]:
    return sorted(p.name[:-5] for p in importlib.resources.files(_SHIPPED).iterdir() if p.name.endswith(".toml"))


def _is_name(source: str | os.PathLike) -> bool:
    """Whether `source` names a shipped table (`"default"`) rather than a file."""
    return isinstance(source, str) and "/" not in source and os.sep not in source and not source.endswith(".toml")


def _read_table(source: str | os.PathLike, folder: Any = None) -> tuple[dict[str, Any], str, Any, str]:
    """(table, origin, folder, key) of a shipped table's name or a file's path (relative to
    `folder` when given): `folder` is where its own `extends` paths start from, `key`
    identifies the file (to find cycles)."""
    if _is_name(source):
        resource = importlib.resources.files(_SHIPPED) / f"{source}.toml"
        if not resource.is_file():
            raise ValueError(
                f"policy {source!r} is not a shipped policy; shipped: {_shipped_names()}, or pass a path to a .toml file."
            )
        return tomllib.loads(resource.read_text()), str(source), importlib.resources.files(_SHIPPED), str(source)
    path = pathlib.Path(source) if folder is None else folder / os.fspath(source)
    with path.open("rb") as f:
        table = tomllib.load(f)
    origin = os.fspath(source) if folder is None else str(path)
    return table, origin, getattr(path, "parent", folder), os.path.realpath(str(path))


def _resolved_table(
    source: str | os.PathLike, folder: Any = None, chain: tuple[str, ...] = ()
) -> tuple[dict[str, Any], str]:
    """The table of `source` with its `extends` chain applied (see `_merge`), and
    its origin."""
    table, origin, here, key = _read_table(source, folder)
    if key in chain:
        cycle = " -> ".join([*chain[chain.index(key) :], key])
        raise ValueError(f"policy {origin}: 'extends' makes a cycle: {cycle}.")
    unknown = sorted(set(table) - set(_TOP_LEVEL))
    if unknown:
        raise ValueError(f"policy {origin}: unknown key(s) {unknown}; allowed: {list(_TOP_LEVEL)}.")
    table_categories(table, origin)
    base_ref = table.get("extends")
    if base_ref is None:
        return table, origin
    allowed = f"use a shipped policy's name ({_shipped_names()}) or a .toml path relative to this file"
    if not isinstance(base_ref, str) or not base_ref:
        raise ValueError(f"policy {origin}: extends = {base_ref!r} is not a name or a path; {allowed}.")
    if _is_name(base_ref) and base_ref not in _shipped_names():
        raise ValueError(f"policy {origin}: extends = {base_ref!r} is not a shipped policy; {allowed}.")
    if not _is_name(base_ref) and not (here / base_ref).is_file():
        raise ValueError(f"policy {origin}: extends = {base_ref!r}: no such file {str(here / base_ref)!r}; {allowed}.")
    base, _ = _resolved_table(base_ref, None if _is_name(base_ref) else here, (*chain, key))
    return _merge(base, table), origin


def _merge(base: Mapping[str, Any], table: Mapping[str, Any]) -> dict[str, Any]:
    """`base` (a resolved table) extended by `table`: each primitive `table` lists
    moves into its category (out of the base's), its scopes are set over the base's, its
    `fallback` and `description` replace the base's, its `[accumulation]` `selects` join
    the base's and its `exceptions` are set over the base's; `name` is not inherited."""
    moved = {n for names in table.get("primitives", {}).values() for n in names}
    prims = {cat: [n for n in names if n not in moved] for cat, names in base.get("primitives", {}).items()}
    for cat, names in table.get("primitives", {}).items():
        prims[cat] = [*prims.get(cat, []), *names]
    acc, base_acc = table.get("accumulation", {}), base.get("accumulation", {})
    out = {
        "schema": 1,
        "fallback": table.get("fallback", base.get("fallback", "original")),
        "primitives": {cat: names for cat, names in prims.items() if names},
        "scopes": {**base.get("scopes", {}), **table.get("scopes", {})},
        "accumulation": {
            "selects": sorted({*base_acc.get("selects", ()), *acc.get("selects", ())}),
            "exceptions": {**base_acc.get("exceptions", {}), **acc.get("exceptions", {})},
        },
    }
    for key in ("name", "description"):
        value = table.get(key, base.get(key) if key == "description" else None)
        if value is not None:
            out[key] = value
    return out


def table_categories(table: Mapping[str, Any], origin: str) -> tuple[dict[str, list[str]], dict[str, str], str]:
    """Check a policy table's schema; return (category -> names, scope -> category, fallback)."""
    if table.get("schema") != 1:
        raise ValueError(f"policy {origin}: 'schema = 1' is required, got {table.get('schema')!r}.")
    known = set(CATEGORIES) | {"recurse"}
    prims = table.get("primitives", {})
    seen: dict[str, str] = {}
    for category, names in prims.items():
        if category not in known:
            raise ValueError(
                f"policy {origin}: unknown category {category!r} in [primitives]; allowed: {sorted(known)}."
            )
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"policy {origin}: [primitives].{category} must be a list of primitive names.")
        for n in names:
            if n in seen:
                raise ValueError(
                    f"policy {origin}: {n!r} is listed in both [primitives].{seen[n]} and .{category}; "
                    "a primitive has one category."
                )
            seen[n] = category
    scopes = table.get("scopes", {})
    for scope, category in scopes.items():
        if category not in CATEGORIES:
            raise ValueError(
                f"policy {origin}: scope {scope!r} has unknown category {category!r}; allowed: {sorted(CATEGORIES)}."
            )
    acc = table.get("accumulation", {})
    if not isinstance(acc, Mapping) or set(acc) - {"selects", "exceptions"}:
        raise ValueError(f"policy {origin}: [accumulation] takes 'selects' (a list) and 'exceptions' (a table).")
    if not all(isinstance(n, str) for n in acc.get("selects", [])) or not all(
        isinstance(r, str) and r for r in acc.get("exceptions", {}).values()
    ):
        raise ValueError(
            f"policy {origin}: [accumulation].selects must list primitive names and .exceptions map each "
            "name to the reason it does not accumulate in float32."
        )
    fallback = table.get("fallback", "original")
    if fallback not in CATEGORIES:
        raise ValueError(f"policy {origin}: fallback {fallback!r} is not a category; allowed: {sorted(CATEGORIES)}.")
    return prims, scopes, fallback


def accumulation(source: str | os.PathLike = "default") -> tuple[frozenset[str], dict[str, str]]:
    """The `[accumulation]` section of a policy file, its `extends` chain applied (each
    table's `selects` joined, its `exceptions` set over the base's); it changes no rule
    (`tests/test_accumulation.py` reads it).

    Args:
        source: A shipped policy's name or the path of a TOML file.

    Returns:
        `(selects, exceptions)`: the primitives that combine elements only by selecting
            one (exact in any precision), and those that accumulate outside float32 under
            the table, each mapped to the reason.
    """
    table, origin = _resolved_table(source)
    table_categories(table, origin)
    acc = table.get("accumulation", {})
    return frozenset(acc.get("selects", ())), dict(acc.get("exceptions", {}))


def load_policy(source: str | os.PathLike = "default") -> AmpPolicy:
    """Load a policy table: a shipped one by name (`"default"`, `"matmul_only"`,
    `"fp8"`) or a TOML file by path. See `policies/README.md` for the format; a table
    may extend another (`extends = "default"`: a shipped name, or a path relative to its
    file) and list only its differences.

    Rules registered with `register_rule` take precedence over the table.

    Args:
        source: `"default"`, `"matmul_only"`, `"fp8"`, or the path of a TOML file.

    Returns:
        An `AmpPolicy`; the primitive names this JAX version does not define are in its
            `unresolved`.

    Raises:
        ValueError: `source` is a name (no `/`, no `.toml`) that is not a shipped
            policy, or a table of its `extends` chain is not a valid policy: no
            `schema = 1`, an unknown top-level key, category or fallback, a primitive in
            two categories, a malformed `[accumulation]` section, or an `extends` that is
            not a shipped name or an existing file, or makes a cycle (the message names
            the file). A file that is not TOML raises `tomllib.TOMLDecodeError`, a
            `ValueError` too.
        FileNotFoundError: The file at `source` does not exist.

    Example:
        ```python
        policy = autocast.load_policy("matmul_only")
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
        ```
    """
    table, origin = _resolved_table(source)
    prims, scopes, fallback = table_categories(table, origin)
    by_name = _primitives_by_name()
    rules: dict[PolicyKey, _rules.Rule] = {}
    unresolved = []
    for category, names in prims.items():
        if category == "recurse":
            continue
        for name in names:
            found = by_name.get(name)
            if not found:
                unresolved.append(name)
            for prim in found or ():
                rules[prim] = CATEGORIES[category]
    for scope, category in scopes.items():
        rules[scope] = CATEGORIES[category]
    rules[AMP_DEFAULT] = CATEGORIES[fallback]
    name = table.get("name", origin)
    return AmpPolicy((_REGISTRY, types.MappingProxyType(rules)), name=name, unresolved=tuple(unresolved))


def extend_policy(rules: Mapping[PolicyKey, _rules.Rule], base: Mapping | None = None) -> AmpPolicy:
    """A policy that is `base` (the default policy if omitted) with `rules` on top.

    Nothing is copied: the result looks `rules` up first, then `base`'s layers.

    Args:
        rules: Primitive or named-scope name -> rule (an `autocast.Rule` or a function
            `rule(compute_dtype, original_dtypes, *invars, **params)`).
        base: The policy underneath (None: `default_amp_policy`).

    Returns:
        An `AmpPolicy` named after `base` (`"default+extended"`).

    Raises:
        TypeError: A key of `rules` or `base` is neither a primitive nor a string, or a
            rule is not callable (the message names it).

    Example:
        ```python
        policy = autocast.extend_policy({"attention": autocast.use_float32_precision,
                                         jax.lax.tanh_p: autocast.use_float32_precision})
        loss = autocast.amp(loss_fn, amp_policy=policy)(params, batch)
        ```
    """
    validate_policy(rules, argument="rules")
    base = default_amp_policy if base is None else base
    validate_policy(base, argument="base")
    layers = base._layers if isinstance(base, AmpPolicy) else (base,)
    return AmpPolicy((types.MappingProxyType(dict(rules)), *layers), name=f"{getattr(base, 'name', 'custom')}+extended")


def register_rule(primitive: _compat.Primitive, rule: _rules.Rule | None = None) -> Any:
    """Register `rule` for `primitive` globally, once (usable as a decorator).

    The rule becomes part of `default_amp_policy` (overriding the shipped table) and
    applies under any policy that does not name `primitive` itself. Use it for
    third-party primitives, e.g. one made with `jax.extend.core.Primitive`.

    Args:
        primitive: The primitive.
        rule: An `autocast.Rule` or a function
            `rule(compute_dtype, original_dtypes, *invars, **params) -> (invars, params)`;
            omitted, `register_rule(primitive)` is a decorator that registers the
            function it decorates.

    Returns:
        `rule` (or, without it, the decorator).

    Raises:
        TypeError: `primitive` is not a jax Primitive, or `rule` is not callable.

    Example:
        ```python
        from jax.extend.core import Primitive

        my_kernel_p = Primitive("my_kernel")  # a third-party primitive
        autocast.register_rule(my_kernel_p, autocast.use_compute_precision)
        assert autocast.default_amp_policy[my_kernel_p] is autocast.use_compute_precision

        @autocast.register_rule(my_kernel_p)  # as a decorator, with a rule of your own
        def my_kernel_rule(compute_dtype, original_dtypes, *invars, **params):
            return autocast.use_float32_precision(compute_dtype, original_dtypes, *invars, **params)

        assert autocast.default_amp_policy[my_kernel_p] is my_kernel_rule
        autocast.unregister_rule(my_kernel_p)
        ```
    """
    if not isinstance(primitive, _compat.Primitive):
        raise TypeError(f"register_rule: primitive={primitive!r} is not a jax Primitive (e.g. jax.lax.exp_p).")
    if rule is None:
        return functools.partial(register_rule, primitive)
    if not callable(rule):
        raise TypeError(f"register_rule({primitive.name}): rule={rule!r} is not callable.")
    _REGISTRY[primitive] = rule
    return rule


def unregister_rule(primitive: _compat.Primitive) -> None:
    """Remove a rule added with `register_rule` (no error if there is none).

    Args:
        primitive: A `jax.extend.core.Primitive` given to `register_rule`.

    Returns:
        `None`.

    Example:
        ```python
        from jax.extend.core import Primitive

        my_kernel_p = Primitive("my_kernel")
        autocast.register_rule(my_kernel_p, autocast.use_float32_precision)
        autocast.unregister_rule(my_kernel_p)
        assert my_kernel_p not in autocast.default_amp_policy
        ```
    """
    _REGISTRY.pop(primitive, None)


default_amp_policy: AmpPolicy = load_policy("default")
"""The shipped default policy (`policies/default.toml`) plus registered rules."""


class Lookup:
    """Rule lookup for one policy: scopes (outermost first), primitive, registry, default.
    Rules come back as `autocast.Rule` objects (a plain function wrapped once)."""

    def __init__(self, policy: Mapping):
        self.policy = policy
        self.scope_keys = [k for k in policy if isinstance(k, str) and k not in (AMP_DEFAULT,)]
        self.default = _rules.as_rule(policy.get(AMP_DEFAULT, _rules.use_original_precision))

    def scope_rule(
        self, scopes: tuple[str, ...], prim: _compat.Primitive | None = None
    ) -> tuple[_rules.Rule | None, str | None]:
        """The rule of the outermost scope that maps `prim` (a scope's rule for some
        primitives only, `Rule.primitives`, maps no other), and the scope's key."""
        if AMP_STOP in scopes:
            return _rules.use_original_precision, AMP_STOP
        for scope in scopes:
            for key in self.scope_keys:
                if key == scope or (any(c in key for c in "*?[") and fnmatch.fnmatchcase(scope, key)):
                    rule = _rules.as_rule(self.policy[key])
                    if rule.primitives is None or (prim is not None and prim.name in rule.primitives):
                        return rule, key
        return None, None

    def stopped(self, scopes: tuple[str, ...]) -> bool:
        """Whether `scopes` are inside `amp_stop` (every equation keeps its traced precision)."""
        return AMP_STOP in scopes

    def explicit(self, prim: _compat.Primitive) -> bool:
        """Whether the policy (or the registry) names `prim` itself."""
        return prim in self.policy or prim in _REGISTRY

    def rule(self, prim: _compat.Primitive, scopes: tuple[str, ...]) -> _rules.Rule:
        rule, _ = self.scope_rule(scopes, prim)
        if rule is not None:
            return rule
        found = self.policy.get(prim)
        if found is None:
            found = _REGISTRY.get(prim)
        return self.default if found is None else _rules.as_rule(found)

    def rule_and_reason(self, prim: _compat.Primitive, scopes: tuple[str, ...]) -> tuple[_rules.Rule, str]:
        """`rule` and why it applies (for `autocast.explain`): `"amp_stop"`,
        `"scope 'KEY'"`, `"registered rule"`, `"primitive table"` or `"fallback"`."""
        rule, key = self.scope_rule(scopes, prim)
        if rule is not None:
            return rule, AMP_STOP if key == AMP_STOP else f"scope {key!r}"
        found = self.policy.get(prim)
        if found is not None:
            layers = getattr(self.policy, "_layers", (self.policy,))
            first = next((layer for layer in layers if prim in layer), None)
            return _rules.as_rule(found), "registered rule" if first is _REGISTRY else "primitive table"
        if prim in _REGISTRY:
            return _rules.as_rule(_REGISTRY[prim]), "registered rule"
        return self.default, "fallback"
