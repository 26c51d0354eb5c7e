"""Rooms that do one job: no module of the package passes ``LIMIT`` lines unless its docstring
says why (a line starting ``Size:``), so a file that grows a second job is split, not stretched.

600 lines is about what one reader holds in mind at once; the largest modules when the limit
was set (2026-11-27, after splitting ``_compat.py`` and ``_interpreter.py``) were ~600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import autocast

PACKAGE = Path(autocast.__file__).parent
LIMIT = 600


def test_no_module_passes_the_size_limit_without_a_stated_reason():
    too_big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n <= LIMIT:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if not any(line.strip().startswith("Size:") for line in doc.splitlines()):
            too_big.append(f"{path.relative_to(PACKAGE)}: {n} lines")
    assert not too_big, f"modules over {LIMIT} lines without a 'Size:' reason in their docstring: {too_big}"
