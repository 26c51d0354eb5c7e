"""The documentation: every public name has an API entry, skips are few and explained.

The code blocks themselves run through Sybil (the repository's root conftest.py collects
README.md, docs/*.md and the docstrings in autocast/); these tests check what Sybil cannot.
"""

import importlib
import inspect
import pathlib
import re

import pytest

import autocast

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "results" not in p.relative_to(DOCS).parts) + [ROOT / "README.md"]

# Blocks that cannot run in the docs tests (CPU, the test dependencies). Raise only with a reason.
MAX_SKIPS = 1

COMPAT = ["jmp", "mpx", "jaxamp"]
# Module constants documented in a table on their API page, not by a docstring.
CONSTANTS = {
    "__version__",
    "default_amp_policy",
    "FLOAT16_MAX",
    "BFLOAT16_MAX",
    "HALF_PRECISION_DATATYPE",
    "LossScale",
    "dtype_to_names",
    "name_to_dtype",
}


def _api_page(module):
    return (DOCS / "api" / ("autocast.md" if module == "autocast" else f"compat-{module}.md")).read_text()


def _public(module):
    mod = autocast if module == "autocast" else importlib.import_module(f"autocast.compat.{module}")
    return mod, list(mod.__all__)


def test_skips_are_counted_and_explained():
    skips = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"<!-- skip: next -->\s*```(\w*)\n(.*)\n", text):
            skips.append(page.name)
            language, first = match.groups()
            assert language == "python", f"{page}: a skip marker before a {language!r} block"
            assert first.startswith("# Not run in the docs tests:"), (
                f"{page}: a skipped block must begin with '# Not run in the docs tests: <why>'; got {first!r}"
            )
        markers = len(re.findall(r"^[ \t]*<!--\s*skip", text, re.M))  # what Sybil's skip parser reads
        assert markers == len([s for s in skips if s == page.name]), f"{page}: a skip marker of another form"
    assert len(skips) <= MAX_SKIPS, f"{len(skips)} skipped blocks ({skips}); at most {MAX_SKIPS}"


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(DOCS)) for p in PAGES if p.parent != ROOT}
    for page in pages:
        assert re.search(rf":\s+{re.escape(page)}\s*$", nav, re.M), f"{page} is not in mkdocs.yml's nav"


@pytest.mark.parametrize("module", ["autocast", *COMPAT])
def test_every_public_name_has_an_api_entry(module):
    page = _api_page(module)
    mod, names = _public(module)
    prefix = "autocast" if module == "autocast" else f"autocast.compat.{module}"
    for name in names:
        if name in CONSTANTS:
            assert f"`{name}`" in page or f"::: {prefix}.{name}\n" in page, (
                f"{prefix}.{name} is missing from its API page"
            )
        else:
            assert f"::: {prefix}.{name}\n" in page, f"{prefix}.{name} is missing from its API page"


@pytest.mark.parametrize("module", ["autocast", *COMPAT])
def test_every_public_name_has_a_summary_and_an_example(module):
    mod, names = _public(module)
    missing = []
    for name in names:
        if name in CONSTANTS:
            continue
        doc = inspect.getdoc(getattr(mod, name)) or ""
        summary = doc.strip().splitlines()[0] if doc.strip() else ""
        if not summary or "Example" not in doc:
            missing.append(name)
    assert not missing, f"{module}: public names without a summary line or an example: {missing}"
