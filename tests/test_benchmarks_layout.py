"""benchmarks/ by question: every file in benchmarks/README.md's table, every quote of it real.

- every file under ``benchmarks/`` (but ``results/``, the packages' ``__init__.py`` and the
  README itself) has a row in the README's table, and every file a row names exists;
- every folder of scripts is a package, so ``python -m benchmarks.<question>.<script>`` runs;
- every command quoted in ``README.md``, ``docs/`` and the READMEs in ``benchmarks/``
  (``bash ....sh``, ``python -m benchmarks...``, ``python benchmarks/....py``) names a
  script or module that exists, every ``benchmarks.<module>.<name>`` they cite is defined
  there, and every ``benchmarks/`` path and results link they give exists.

Text only: nothing is imported or run (the commands' ``--help`` runs are a manual check).
"""

import ast
import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
README = BENCH / "README.md"
PAGES = sorted(
    [ROOT / "README.md", *BENCH.rglob("README.md")]
    + [p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.relative_to(ROOT / "docs").parts]
)
PAGES = [p for p in PAGES if RESULTS not in p.parents]


def _listed_files() -> list[Path]:
    """The files the README's table must name: everything in benchmarks/ but its results,
    caches, the packages' ``__init__.py`` and the README itself."""
    out = []
    for p in sorted(BENCH.rglob("*")):
        rel = p.relative_to(BENCH)
        if p.is_dir() or rel.parts[0] == "results" or "__pycache__" in rel.parts:
            continue
        if p.name == "__init__.py" or p == README:
            continue
        out.append(p)
    return out


def _table_rows(text: str) -> list[list[str]]:
    """The rows of the README's "Every file" table (the one whose header starts with
    ``| question | file |``), as lists of cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| question | file |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _expand(path: str) -> list[str]:
    """``a.{md,json}`` -> ``a.md``, ``a.json`` (one brace group at most in these docs)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [path[: m.start()] + alt + path[m.end() :] for alt in m[1].split(",")]


def _exists(path: Path) -> bool:
    """``path`` exists; a ``*`` in it is a glob that must match."""
    return bool(glob.glob(str(path))) if "*" in str(path) else path.exists()


# ----------------------------------------------------------------------------- the table


def test_every_file_of_benchmarks_has_a_row_in_the_readme_table():
    named = {t for row in _table_rows(README.read_text()) for t in _ticked(row[1])}
    missing = [str(p.relative_to(BENCH)) for p in _listed_files() if str(p.relative_to(BENCH)) not in named]
    assert not missing, f"benchmarks/README.md's table has no row for: {missing}"


def test_every_file_the_table_names_exists():
    rows = _table_rows(README.read_text())
    assert len(rows) >= len(_listed_files())
    missing = []
    for row in rows:
        assert len(row) == 4, row
        for name in _ticked(row[1]):
            if not ((BENCH / name).is_file() or (ROOT / name).is_file()):
                missing.append(name)
        for token in _ticked(row[3]):  # the results column: paths relative to benchmarks/results/
            if "/" in token:
                missing += [p for p in _expand(token) if not _exists(RESULTS / p)]
    assert not missing, f"benchmarks/README.md's table names what does not exist: {missing}"


def test_every_folder_of_scripts_is_a_package():
    folders = {p.parent for p in BENCH.rglob("*.py") if RESULTS not in p.parents}
    missing = [str(d.relative_to(ROOT)) for d in sorted(folders) if not (d / "__init__.py").is_file()]
    assert not missing, f"no __init__.py (python -m cannot reach their scripts): {missing}"


# ----------------------------------------------------------------------------- quotes


def _top_level_names(module: Path) -> set[str]:
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _module_file(dotted: str) -> Path | None:
    """The file of module ``dotted`` (``benchmarks.x.y``): a module or a package."""
    base = ROOT.joinpath(*dotted.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def quote_problems(text: str) -> list[str]:
    """What a page quotes of the repository that does not exist: scripts of ``bash`` and
    ``python`` commands, ``python -m benchmarks...`` modules, ``benchmarks.<module>.<name>``
    references, ``benchmarks/...`` paths and ``results/...`` links (docs/results/ is a copy
    of benchmarks/results/)."""
    problems = []
    for m in re.finditer(r"\bbash\s+([\w./-]+\.sh)\b", text):
        if not (ROOT / m[1]).is_file():
            problems.append(f"bash {m[1]}: no such script")
    for m in re.finditer(r"\bpython3?\s+-m\s+(benchmarks[\w.<>]*)", text):
        module = m[1].rstrip(".")
        if "<" in module:  # a placeholder: python -m benchmarks.<question>.<script>
            continue
        if _module_file(module) is None and not (ROOT.joinpath(*module.split(".")) / "__main__.py").is_file():
            problems.append(f"python -m {module}: no such module")
        elif _module_file(module) is not None and _module_file(module).name == "__init__.py":
            problems.append(f"python -m {module}: a package without __main__.py")
    for m in re.finditer(r"\bpython3?\s+((?:benchmarks|tests)/[\w./-]+\.py)\b", text):
        if not (ROOT / m[1]).is_file():
            problems.append(f"python {m[1]}: no such script")
    for m in re.finditer(r"(?<![\w/.-])(benchmarks(?:\.[A-Za-z_]\w*)+)(?!\.<)", text):
        parts = m[1].split(".")
        if parts[1] == "md":  # the docs page benchmarks.md
            continue
        for k in range(len(parts), 1, -1):  # the longest prefix that is a module
            module = _module_file(".".join(parts[:k]))
            if module is not None:
                break
        else:
            problems.append(f"{m[1]}: no such module")
            continue
        if k < len(parts) and parts[k] not in _top_level_names(module):
            if not _module_file(".".join(parts[: k + 1])):
                problems.append(f"{m[1]}: {'.'.join(parts[:k])} defines no {parts[k]}")
    for m in re.finditer(r"(?<![\w/.-])(benchmarks/[\w./{},*<>\[\]-]*[\w*}/])", text):
        path = re.sub(r":\d+$", "", m[1])
        if re.search(r"[<\[]|\.\.\.", path):  # a placeholder: its folder must exist
            path = re.split(r"[<\[]|\.\.\.", path)[0].rsplit("/", 1)[0]
        problems += [f"{p}: no such file or folder" for p in _expand(path) if not _exists(ROOT / p)]
    for m in re.finditer(r"\]\((results/[^)#\s]+)", text):
        if not (BENCH / m[1]).exists():
            problems.append(f"link ({m[1]}): no benchmarks/{m[1]}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_commands_and_paths_exist(page):
    problems = quote_problems(page.read_text())
    assert not problems, f"{page.relative_to(ROOT)} quotes what does not exist:\n" + "\n".join(problems)


def test_the_quotes_are_found():
    """The parser sees the commands the pages do quote (a regex that matched nothing would
    pass every page)."""
    text = "\n".join(p.read_text() for p in PAGES)
    commands = set(re.findall(r"\bbash\s+(benchmarks/[\w./-]+\.sh)", text))
    commands |= set(re.findall(r"\bpython3?\s+-m\s+(benchmarks(?:\.\w+)+)", text))
    assert {"benchmarks/accuracy/run_demo.sh", "benchmarks/gpu_measured/run_gpu.sh"} <= commands
    assert {"benchmarks.accuracy.demo", "benchmarks.comparison.bench_vit", "benchmarks.gpu_measured.gpu"} <= commands
    # every script with a command line is quoted somewhere
    scripts = {f"benchmarks.{p.parent.name}.{p.stem}" for p in BENCH.glob("*/*.py") if "__main__" in p.read_text()}
    scripts |= {str(p.relative_to(ROOT)) for p in BENCH.rglob("*.sh")}
    assert not scripts - commands, f"never quoted as a command: {sorted(scripts - commands)}"


@pytest.mark.parametrize(
    "quote, problem",
    [
        ("`bash benchmarks/run_demo.sh --seeds 0 1 2`", "bash benchmarks/run_demo.sh: no such script"),
        ("`python -m benchmarks.demo`", "python -m benchmarks.demo: no such module"),
        ("`python -m benchmarks.accuracy`", "a package without __main__.py"),
        ("`python benchmarks/demo.py`", "python benchmarks/demo.py: no such script"),
        ("`benchmarks.gpu_modeled.hlo_model.no_such_function(...)`", "defines no no_such_function"),
        ("`benchmarks/results/demo.{md,json}`", "benchmarks/results/demo.md: no such file or folder"),
        ("[table](results/demo_seeds10.md)", "link (results/demo_seeds10.md)"),
    ],
)
def test_a_stale_quote_is_reported(quote, problem):
    assert any(problem in p for p in quote_problems(quote)), quote_problems(quote)


def test_current_quotes_pass_the_same_checks():
    good = (
        "`bash benchmarks/accuracy/run_demo.sh --seeds 0 1 2`, `python -m benchmarks.accuracy.demo`, "
        "`python benchmarks/accuracy/demo.py`, `benchmarks.gpu_modeled.hlo_model.census(text)`, "
        "`benchmarks/results/accuracy/demo.{md,json,png}`, [x](results/accuracy/demo_seeds10.md), "
        "`benchmarks/results/gpu_measured/gpu-<device>-<date>.md`, see benchmarks.md"
    )
    assert quote_problems(good) == []


def test_results_are_in_question_folders():
    """No result lies loose in results/: each is in its question's folder or in archive/."""
    questions = {p.name for p in BENCH.iterdir() if (p / "__init__.py").is_file()} - {"models"}
    loose = [p.name for p in RESULTS.iterdir() if p.name not in questions | {"archive"}]
    assert not loose, f"benchmarks/results/ holds files outside the question folders: {loose}"
    archived = {p.name for p in (RESULTS / "archive").iterdir()}
    assert archived <= questions, archived - questions


def test_the_path_helpers():
    assert _exists(RESULTS / "accuracy" / "demo_seeds10.*")
    assert not _exists(RESULTS / "accuracy" / "no_such_run.*")
    assert _expand("a.{md,json}") == ["a.md", "a.json"] and _expand("a.md") == ["a.md"]
