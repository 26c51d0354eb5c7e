"""The public surface: one import path per name, documented; amp's options taken alike by
``amp``, ``explain`` and ``find_overflow``, and documented in each of their docstrings."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re
import typing
import warnings

import jax.numpy as jnp
import pytest

import autocast
import autocast.optim
from autocast import _options

ROOT = pathlib.Path(__file__).resolve().parents[1]
MOVED = [
    "HalfOptState",
    "half_state",
    "stochastic_round",
    "to_float32_opt_state",
    "to_float32_params",
    "to_half_opt_state",
    "to_half_params",
]


def test_one_import_path_per_public_name():
    top, optim = set(autocast.__all__), set(autocast.optim.__all__)
    assert not top & optim, sorted(top & optim)
    assert optim == set(MOVED)
    for name in top:
        assert hasattr(autocast, name), name
    for name in optim:
        assert getattr(autocast.optim, name).__module__.startswith("autocast."), name


def test_every_exported_name_is_documented_in_the_api_reference():
    page = (ROOT / "docs" / "api" / "autocast.md").read_text()
    documented = set(re.findall(r"^::: (autocast(?:\.optim)?\.\w+)$", page, re.M))
    exported = {f"autocast.{n}" for n in autocast.__all__ if n != "__version__"}
    exported |= {f"autocast.optim.{n}" for n in autocast.optim.__all__}
    assert exported <= documented, sorted(exported - documented)
    assert "`__version__`" in page
    # the old top-level paths are not documented
    assert not {f"autocast.{n}" for n in MOVED} & documented


@pytest.mark.parametrize("name", MOVED)
def test_old_top_level_path_warns_and_returns_the_same_object(name):
    with pytest.warns(DeprecationWarning, match=rf"autocast\.{name} is deprecated.*use autocast\.optim\.{name}"):
        obj = getattr(autocast, name)
    assert obj is getattr(autocast.optim, name)
    assert name not in autocast.__all__
    with pytest.warns(DeprecationWarning, match=rf"autocast\.optim\.{name}"):
        exec(f"from autocast import {name} as imported", namespace := {})
    assert namespace["imported"] is obj


def test_new_paths_and_unknown_names_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in MOVED:
            getattr(autocast.optim, name)
        for name in autocast.__all__:
            getattr(autocast, name)
    with pytest.raises(AttributeError, match="no attribute 'half_stat'"):
        autocast.half_stat  # noqa: B018


_OLD_PATH = re.compile(rf"\bautocast\.({'|'.join(MOVED)})\b|from autocast import [^\n]*\b({'|'.join(MOVED)})\b")


def test_docs_and_readme_use_the_new_paths():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    old = [
        f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for page in pages
        if "results" not in page.relative_to(ROOT).parts
        for text in [page.read_text()]
        for m in _OLD_PATH.finditer(text)
    ]
    assert not old, old


# --- amp's options ------------------------------------------------------------------------


def _keyword_options(fn, own=()):
    """The keyword-only parameters of ``fn`` other than ``own``: (name, default, annotation)."""
    return [
        (p.name, p.default, p.annotation)
        for p in inspect.signature(fn).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in own
    ]


def test_explain_and_find_overflow_take_exactly_amps_options():
    amp_options = _keyword_options(autocast.amp)
    assert [n for n, _, _ in amp_options] == [f.name for f in dataclasses.fields(_options.AmpOptions)]
    assert {"compute_dtype", "amp_policy", "remat_float32", "weight_grad_dtype", "custom_vjp_bwd"} <= {
        n for n, _, _ in amp_options
    }
    assert _keyword_options(autocast.explain) == amp_options
    assert _keyword_options(autocast.find_overflow, own=("grad", "scale")) == amp_options
    own = inspect.signature(autocast.find_overflow).parameters
    assert own["grad"].default is False and own["scale"].default == 2.0**15
    # the TypedDict type checkers read lists the same options
    assert list(typing.get_type_hints(_options.AmpKwargs)) == [n for n, _, _ in amp_options]


def test_amp_defaults_are_the_documented_ones():
    defaults = {n: d for n, d, _ in _keyword_options(autocast.amp)}
    assert defaults["compute_dtype"] is jnp.float16 and defaults["amp_policy"] is None
    assert defaults["remat_float32"] == "auto" and defaults["weight_grad_dtype"] == "float32"
    opts = _options.AmpOptions()
    assert opts.dtype == jnp.float16 and opts.policy is autocast.default_amp_policy


@pytest.mark.parametrize(
    ("option", "value", "error", "message"),
    [
        ("compute_dtype", "float64", ValueError, r"compute_dtype='float64'.*allowed: float16, bfloat16 or float32"),
        ("amp_policy", [1, 2], TypeError, r"amp_policy must be a mapping.*got list"),
        (
            "remat_float32",
            "yes",
            ValueError,
            r"remat_float32='yes' is not allowed; use True, False, 'auto' or 'matmuls'",
        ),
        ("remat_float32", 1, ValueError, r"remat_float32=1 is not allowed; use True, False, 'auto' or 'matmuls'"),
        (
            "weight_grad_dtype",
            "half",
            ValueError,
            r"weight_grad_dtype='half' is not allowed; use 'float32' or 'compute'",
        ),
        ("custom_vjp_bwd", None, ValueError, r"custom_vjp_bwd=None is not allowed; use 'amp' or 'original'"),
    ],
)
def test_a_bad_option_gets_one_error_from_all_three(option, value, error, message):
    for fn in (autocast.amp, autocast.explain, autocast.find_overflow):
        with pytest.raises(error, match=message):
            fn(lambda x: x, **{option: value})


def test_an_unknown_keyword_is_named_with_the_options():
    for fn in (autocast.amp, autocast.explain, autocast.find_overflow):
        with pytest.raises(TypeError, match=rf"{fn.__name__}\(\) got an unexpected keyword argument 'remat'.*"):
            fn(lambda x: x, remat=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'grad'"):
        autocast.explain(lambda x: x, grad=True)  # find_overflow's own option only


# --- docstrings -------------------------------------------------------------------------
# That every docstring of autocast/ names only parameters its object takes (public and
# private, both docstring styles, load_policy's old inline `**Arguments:** `source`: ...`
# form included) is checked by tests/test_docstrings.py. What it cannot see is an argument
# left undocumented: amp's options are listed once, in autocast/_options.py, and an option
# added there is taken by amp, explain and find_overflow, so each docstring must gain its
# entry.


@pytest.mark.parametrize("fn", [autocast.amp, autocast.explain, autocast.find_overflow], ids=lambda f: f.__name__)
def test_each_amp_option_has_an_args_entry(fn):
    from test_docstrings import google_names

    documented = google_names(inspect.getdoc(fn) or "")
    taken = list(inspect.signature(fn).parameters)
    assert documented == taken, (
        f"{fn.__name__}'s docstring documents {documented}; its signature (autocast/_options.py) is {taken}: "
        "one Args: entry per parameter, in order"
    )


# The pages whose API tables quote full signatures (docs/loss-scaling.md's
# `optimizer_update(...)` lacks its `key=None` and is not checked yet).
SIGNATURE_PAGES = ["docs/policies.md", "docs/debugging.md"]


def _quoted_signatures():
    """``(page, name, parameter list)`` of each ``name(...)`` that opens the first cell of a
    table row of :data:`SIGNATURE_PAGES` (the pages' API tables), ``...`` elisions aside."""
    for page in SIGNATURE_PAGES:
        for m in re.finditer(r"^\| `(\w+)\(([^`]*)\)`", (ROOT / page).read_text(), re.M):
            if "..." not in m.group(2) and callable(getattr(autocast, m.group(1), None)):
                yield page, m.group(1), m.group(2)


def test_signatures_quoted_in_the_docs_are_the_codes():
    import ast

    checked = []
    for page, name, quoted in _quoted_signatures():
        fn = getattr(autocast, name)
        real = inspect.signature(fn).parameters
        args = ast.parse(f"def f({quoted}): pass").body[0].args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        assert [a.arg for a in params] == list(real), f"{page}: {name}({quoted}) vs {name}{inspect.signature(fn)}"
        defaults = dict(zip([a.arg for a in [*args.posonlyargs, *args.args]][::-1], args.defaults[::-1]))
        defaults |= {a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}
        for arg, node in defaults.items():
            assert eval(ast.unparse(node), {"jnp": jnp}) == real[arg].default, f"{page}: {name}: {arg}"
        checked.append(name)
    assert {"amp", "explain", "find_overflow", "load_policy"} <= set(checked), checked
