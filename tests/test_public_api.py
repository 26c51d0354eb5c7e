"""The public surface: one import path per name, documented."""

from __future__ import annotations

import pathlib
import re
import warnings

import pytest

import autocast
import autocast.optim

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
