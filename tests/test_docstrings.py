"""Docstrings (issue 43): one style, and only real parameters.

The style is Google's (`Args:`, `Returns:`, `Raises:`, `Example:` sections; examples as
fenced ```python blocks inside the section), which mkdocstrings renders without a
converter (docs/contributing.md, "Docstrings"). The old markup (`**Arguments:**` bullets,
`Example::` blocks, Sphinx roles, ``double`` backticks) is gone from every module; nothing
converts or runs it any more, so it must not come back.

Checked for every function, method and class of `autocast/` (private ones too), read
with `ast` (nothing is executed but the imports that give a class its constructor):

- each parameter a docstring names, in either style, is in the signature (a class: its
  constructor's or its dataclass fields; a class's `Attributes:` are its attributes,
  those its `__init__` sets on `self` included);
- a Google section header is one griffe parses (a blank line above, none below), an
  `Args:` entry is `name: text`, and continuation lines are indented as griffe reads them;
- no module uses the old markup.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autocast"
MODULES = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py"))

# --- reading docstrings ----------------------------------------------------------------


@dataclasses.dataclass
class Doc:
    qualname: str  # "" for the module
    line: int
    text: str  # cleaned (inspect.cleandoc)
    node: ast.AST | None  # the function or class; None for a module or attribute docstring


def _is_string(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def docstrings(tree: ast.Module) -> list[Doc]:
    """Every docstring of a module: the module's, its classes' and functions' at any depth
    (methods, nested functions), and attribute docstrings (a string after an assignment at
    module or class level, which griffe renders too)."""
    out: list[Doc] = []

    def visit(node: ast.AST, prefix: str) -> None:
        body = getattr(node, "body", [])
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if body and _is_string(body[0]):
                out.append(Doc(prefix, body[0].lineno, inspect.cleandoc(body[0].value.value), node))
        if isinstance(node, ast.Module | ast.ClassDef):
            for prev, stmt in zip(body, body[1:]):
                if isinstance(prev, ast.Assign | ast.AnnAssign) and _is_string(stmt):
                    target = prev.targets[0] if isinstance(prev, ast.Assign) else prev.target
                    name = ast.unparse(target)
                    out.append(
                        Doc(f"{prefix}.{name}".lstrip("."), stmt.lineno, inspect.cleandoc(stmt.value.value), None)
                    )
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                local = "<locals>." if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else ""
                visit(child, f"{prefix}.{local}{child.name}".lstrip("."))
            elif not isinstance(child, ast.expr):
                visit_nested(child, prefix)

    def visit_nested(node: ast.AST, prefix: str) -> None:  # definitions under if/try/with blocks
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, f"{prefix}.{child.name}".lstrip("."))
            elif isinstance(child, ast.stmt):
                visit_nested(child, prefix)

    visit(tree, "")
    return out


# --- the parameters a docstring names ----------------------------------------------------

_PARAM_SECTIONS = ("args", "arguments", "params", "parameters")
_KEYWORD_SECTIONS = ("keyword args", "keyword arguments", "other args", "other arguments", "other parameters")
_SECTIONS = (
    *_PARAM_SECTIONS,
    *_KEYWORD_SECTIONS,
    "attributes",
    "returns",
    "yields",
    "raises",
    "examples",
    "example",
    "warns",
)
_HEADER = re.compile(r"^(?P<indent>[ ]*)(?P<title>[A-Z][A-Za-z ]*):[ ]*$")
_ENTRY = re.compile(r"^(?P<name>\*{0,2}\w+)(?:[ ]*\((?P<type>[^)]*)\))?:(?:[ ]|$)")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def google_sections(text: str) -> list[tuple[str, int, list[tuple[int, str]]]]:
    """`(title, header line index, [(line index, entry line)])` of each Google section, read
    as griffe reads it: a known title alone on its line with a blank line above (or at the
    top) and its first entry on the next line, indented; entries are the lines at that
    indentation. Lines inside fenced code blocks are not headers."""
    lines = text.splitlines()
    sections = []
    fence = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fence = not fence
        m = None if fence else _HEADER.match(line)
        if m and m.group("title").lower() in _SECTIONS and (i == 0 or not lines[i - 1].strip()):
            base = len(m.group("indent"))
            if i + 1 < len(lines) and lines[i + 1].strip() and _indent(lines[i + 1]) > base:
                item = _indent(lines[i + 1])
                entries = []
                j = i + 1
                while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) >= item):
                    if lines[j].strip() and _indent(lines[j]) == item:
                        entries.append((j, lines[j][item:]))
                    j += 1
                sections.append((m.group("title").lower(), i, entries))
                i = j
                continue
        i += 1
    return sections


def google_names(text: str, kinds: tuple[str, ...] = _PARAM_SECTIONS) -> list[str]:
    """The names the `Args:`-like sections (`kinds`) of a Google docstring document."""
    names = []
    for title, _, entries in google_sections(text):
        if title in kinds:
            for _, entry in entries:
                m = _ENTRY.match(entry)
                if m:
                    names.append(m.group("name"))
    return names


_OLD_ARGS = re.compile(r"\*\*(?:Arguments|Args|Parameters):\*\*(?P<rest>.*)$")
_OLD_HEADING = re.compile(r"^\s*\*\*[A-Z][\w ]*:\*\*|^\s*Example::?\s*$")
_CODE = re.compile(r"`{1,2}(\*{0,2}\w+)`{1,2}")


def _leading_names(text: str) -> list[str]:
    """The code-span names before an item's first colon: `` `a`, `b` (optional): ... ``
    gives `["a", "b"]`; text that is not only names, commas and parentheses gives []."""
    head, sep, _ = text.partition(":")
    while head.count("`") % 2:  # a colon inside a code span: read on
        more, sep, _ = _.partition(":")
        head += ":" + more
    if not sep:
        return []
    rest = _CODE.sub("", head)
    rest = re.sub(r"\([^)]*\)", "", rest)
    if rest.replace(",", " ").replace(" and ", " ").replace(" or ", " ").strip():
        return []
    return _CODE.findall(head)


def old_names(text: str) -> list[str]:
    """The names an old-style `**Arguments:**` section documents: its `- `name`: ...`
    bullets (several names each: `` `a`, `b`: ``), or `` **Arguments:** `name`: ... `` written
    on the heading line."""
    names = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _OLD_ARGS.search(line)
        if not m:
            continue
        rest = re.split(r"\*\*[A-Z][\w ]*:\*\*", m.group("rest"))[0]
        names += _leading_names(rest.strip())
        for follow in lines[i + 1 :]:
            if _OLD_HEADING.match(follow):
                break
            bullet = re.match(r"^\s*[-*]\s+(.*)$", follow)
            if bullet:
                names += _leading_names(bullet.group(1))
    return names


# --- what a function or class takes ------------------------------------------------------


def _function_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    names = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
    if a.vararg:  # documented as `*args`, as griffe expects
        names.add("*" + a.vararg.arg)
    if a.kwarg:
        names.add("**" + a.kwarg.arg)
    return names


def _runtime(module: str, qualname: str) -> object | None:
    """The object itself, or None (nested in a function, defined under `if TYPE_CHECKING:`,
    or in the sources of the tests below)."""
    if "<locals>" in qualname:
        return None
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj


def _signature_names(obj: object) -> set[str]:
    """The parameter names of a callable's signature (`*args`/`**kwargs` starred), as a
    decorator that sets `__signature__` (`amp`'s options) presents them; set() without one."""
    try:
        params = inspect.signature(obj).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return set()
    star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return {star.get(p.kind, "") + p.name for p in params}


def _init_attributes(init: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The attributes `__init__` sets on its instance: `self.x = ...`, `self.x: T = ...`,
    `self.x += ...`, `self.a, self.b = ...` anywhere in its body (nested functions and
    classes excepted: their `self` is another object)."""
    args = [*init.args.posonlyargs, *init.args.args]
    if not args:
        return set()
    me = args[0].arg
    names: set[str] = set()

    def targets(t: ast.expr) -> None:
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me:
            names.add(t.attr)
        elif isinstance(t, ast.Tuple | ast.List):
            for elt in t.elts:
                targets(elt)
        elif isinstance(t, ast.Starred):
            targets(t.value)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
                continue
            if isinstance(child, ast.Assign):
                for t in child.targets:
                    targets(t)
            elif isinstance(child, ast.AnnAssign | ast.AugAssign):
                targets(child.target)
            visit(child)

    visit(init)
    return names


def _class_params(module: str, qualname: str, node: ast.ClassDef) -> tuple[set[str], set[str]]:
    """(constructor parameters and dataclass fields, attribute names) of a class. Its
    attributes: class-level annotations and assignments, methods and properties, what its
    `__init__` sets on `self`, and at run time what `dir` lists."""
    params: set[str] = set()
    attrs: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            params |= _function_params(stmt) - {"self"}
            attrs |= _init_attributes(stmt)
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            attrs.add(stmt.target.id)
        if isinstance(stmt, ast.Assign):
            attrs |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            attrs.add(stmt.name)  # properties
    cls = _runtime(module, qualname)
    if inspect.isclass(cls):
        params |= _signature_names(cls)
        if dataclasses.is_dataclass(cls):
            params |= {f.name for f in dataclasses.fields(cls)}
        attrs |= {name for name in dir(cls)}
    elif not any(isinstance(s, ast.FunctionDef) and s.name == "__init__" for s in node.body):
        params |= attrs
    return params, attrs | params


# --- the checks --------------------------------------------------------------------------


def _module_name(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def parameter_problems(path: str, source: str) -> list[str]:
    """`"file:line: object: ..."` for each parameter a docstring names that the object
    does not take, and each malformed Google section."""
    problems = []
    module = _module_name(path)
    for doc in docstrings(ast.parse(source)):
        where = f"{path}:{doc.line}: {doc.qualname or '(module)'}"
        problems += [f"{where}: {p}" for p in section_problems(doc.text)]
        named = google_names(doc.text) + old_names(doc.text)
        attributes = google_names(doc.text, ("attributes",))
        if isinstance(doc.node, ast.FunctionDef | ast.AsyncFunctionDef):
            takes, attrs = _function_params(doc.node), set()
            fn = _runtime(module, doc.qualname)
            if callable(fn):
                takes |= _signature_names(fn)
            if not doc.node.args.kwarg:  # `Keyword Args:` document options a `**kwargs` takes
                named += google_names(doc.text, _KEYWORD_SECTIONS)
        elif isinstance(doc.node, ast.ClassDef):
            takes, attrs = _class_params(module, doc.qualname, doc.node)
        else:
            takes, attrs = set(), set()
            if named:
                problems.append(f"{where}: documents parameters {named}, but is not a function or class")
            continue
        for name in named:
            if name not in takes:
                shown = sorted(n for n in takes if not n.startswith("*"))
                problems.append(f"{where}: documents parameter `{name}`, which it does not take (it takes {shown})")
        for name in attributes:
            if name not in attrs:
                problems.append(f"{where}: documents attribute `{name}`, which it does not have")
    return problems


def section_problems(text: str) -> list[str]:
    """Google sections griffe would misread: a header with a blank line below it (griffe
    then renders it as text), an `Args:` entry that is not `name: text`, a continuation
    line indented neither as an entry nor twice as deep."""
    problems = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _HEADER.match(line)
        if m and m.group("title").lower() in _SECTIONS and i + 2 < len(lines):
            if not lines[i + 1].strip() and _indent(lines[i + 2]) > len(m.group("indent")) and lines[i + 2].strip():
                if i == 0 or not lines[i - 1].strip():
                    problems.append(f"`{m.group('title')}:` has a blank line below it (griffe reads it as text)")
    for title, _, entries in google_sections(text):
        if title in (*_PARAM_SECTIONS, *_KEYWORD_SECTIONS, "attributes"):
            for _, entry in entries:
                if not _ENTRY.match(entry):
                    problems.append(f"`{title.capitalize()}:` entry {entry[:50]!r} is not `name: description`")
        if title in ("example", "examples"):
            continue
        if entries:
            first, _ = entries[0]
            item = _indent(lines[first])
            header_indent = _indent(lines[first - 1])
            last = entries[-1][0]
            j = last + 1
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > header_indent):
                j += 1
            fence = False
            for k in range(first, j):
                body = lines[k]
                if body.lstrip().startswith("```"):
                    fence = not fence
                if fence or not body.strip():
                    continue
                depth = _indent(body) - header_indent
                step = item - header_indent
                if step < depth < 2 * step:
                    problems.append(
                        f"`{title.capitalize()}:` line {body.strip()[:40]!r} is indented {depth} spaces "
                        f"(griffe reads {step} for an entry, {2 * step} for its continuation)"
                    )
    return problems


_OLD_MARKUP = [
    (re.compile(r"\*\*(?:Arguments|Args|Parameters|Returns|Raises|Fields|Examples?):\*\*"), "a **Heading:**"),
    (re.compile(r"^\s*(?:.*\S\s)?\S*::\s*$", re.M), "a reStructuredText `::` literal block"),
    (re.compile(r":(?:func|class|mod|data|meth|attr|obj|exc):`"), "a Sphinx role"),
    (re.compile(r"(?<!`)``(?!`)[^`\n]+(?<!`)``(?!`)"), "a ``double-backtick`` literal"),
]


def old_markup(source: str) -> list[str]:
    """`"line: what"` for each docstring of a module that uses the old markup."""
    found = []
    for doc in docstrings(ast.parse(source)):
        for pattern, what in _OLD_MARKUP:
            text = re.sub(r"^[ ]*```.*?^[ ]*```", "", doc.text, flags=re.M | re.S)  # code is not markup
            m = pattern.search(text)
            if m:
                found.append(f"{doc.line}: {doc.qualname or '(module)'}: {what} ({m.group(0).strip()[:40]!r})")
    return found


@pytest.mark.parametrize("path", MODULES)
def test_docstrings_name_only_real_parameters(path):
    problems = parameter_problems(path, (ROOT / path).read_text())
    assert not problems, "\n".join(problems)


def test_no_module_uses_the_old_markup():
    found = {p: old_markup((ROOT / p).read_text()) for p in MODULES}
    found = {p: lines for p, lines in found.items() if lines}
    assert not found, "old docstring markup (write it in Google style, docs/contributing.md):\n" + "\n".join(
        f"{p}:{line}" for p, lines in found.items() for line in lines
    )


# --- the checker finds what it should ----------------------------------------------------


def _problems(source: str) -> list[str]:
    return parameter_problems("autocast/example.py", inspect.cleandoc(source))


def test_the_checker_finds_the_old_inline_form():
    # load_policy's docstring before 18dc030: the heading and the item on one line
    source = '''
    def load_policy(source="default"):
        """Load a policy.

        **Arguments:** `name_or_path`: `"default"`, `"matmul_only"`, or the path of a TOML file.

        **Returns:** an `AmpPolicy`.
        """
    '''
    problems = _problems(source)
    assert len(problems) == 1, problems
    assert "autocast/example.py:2: load_policy: documents parameter `name_or_path`" in problems[0]
    assert "it takes ['source']" in problems[0]
    assert _problems(source.replace("name_or_path", "source")) == []
    inline_with_returns = '''
    def cast_to_full(tree):
        """x.

        **Arguments:** `leaves`: any pytree. **Returns:** the same tree.
        """
    '''
    assert "`leaves`" in "".join(_problems(inline_with_returns))


def test_the_checker_finds_old_bullets_and_google_entries():
    old = '''
    def select_tree(pred, on_true, on_false):
        """x.

        **Arguments:**

        - `pred`: a flag.
        - ``on_true``, `on_fals`: pytrees, continued
          on a second line: with a colon.

        **Returns:** a pytree.

        Example::

            select_tree(p, a, b)
        """
    '''
    assert [p.split(": ", 2)[2] for p in _problems(old)] == [
        "documents parameter `on_fals`, which it does not take (it takes ['on_false', 'on_true', 'pred'])"
    ]
    google = '''
    class Scaler:
        """x.

        Args:
            patience: Steps.
            factor (float): Growth,
                continued.
            **kwargs: Options.

        Attributes:
            scale: The scale.
            counter: No such attribute.
        """

        scale: float

        def __init__(self, patience, growth, **kwargs):
            self.scale = 1.0

        def method(self, x, *args):
            """y.

            Args:
                x: A value.
                *args: More.
                y: Not a parameter.
            """
    '''
    found = [p.split(": ", 2)[1:] for p in _problems(google)]
    assert found == [
        ["Scaler", "documents parameter `factor`, which it does not take (it takes ['growth', 'patience'])"],
        ["Scaler", "documents attribute `counter`, which it does not have"],
        ["Scaler.method", "documents parameter `y`, which it does not take (it takes ['self', 'x'])"],
    ]


def test_the_checker_counts_what_init_sets_as_attributes():
    source = '''
    class Report:
        """x.

        Args:
            records: The records.

        Attributes:
            rows: Set in `__init__`.
            totals: Annotated there.
            first: Unpacked there.
            second: Unpacked there.
            count: Incremented there.
            limit: A class attribute.
            helper_value: Set by a nested function, on another object.
        """

        limit = 3

        def __init__(me, records):
            me.rows = [r for r in records]
            me.totals: dict = {}
            (me.first, me.second), other = (1, 2), 3
            me.count = 0
            me.count += 1

            def helper(self):
                self.helper_value = 1
    '''
    found = [p.split(": ", 2)[1:] for p in _problems(source)]
    assert found == [["Report", "documents attribute `helper_value`, which it does not have"]]
    without_rows = source.replace("me.rows = [r for r in records]", "pass")
    assert [p.split(": ", 2)[2] for p in _problems(without_rows)] == [
        "documents attribute `rows`, which it does not have",
        "documents attribute `helper_value`, which it does not have",
    ]


def test_the_checker_finds_sections_griffe_misreads():
    source = '''
    def f(a, b):
        """x.

        Args:

            a: A blank line above me.

        Returns:
            Fine,
              but this continuation is indented 6 spaces.
        """

    def g(a, b):
        """x.

        Args:
            `a`, `b`: Two names in one entry.
        """
    '''
    problems = [p.split(": ", 2)[2] for p in _problems(source)]
    assert problems == [
        "`Args:` has a blank line below it (griffe reads it as text)",
        "`Returns:` line 'but this continuation is indented 6 spac' is indented 6 spaces "
        "(griffe reads 4 for an entry, 8 for its continuation)",
        "`Args:` entry '`a`, `b`: Two names in one entry.' is not `name: description`",
    ]


def test_old_markup_is_recognised():
    source = '''
    """Module. See :func:`amp`."""

    def f(x):
        """Uses ``x``.

        Example::

            f(1)
        """

    def g(x):
        """Google style: `x`, and a fenced block.

        Args:
            x: A value.

        Example:
            ```python
            g(1)
            ```
        """
    '''
    found = old_markup(inspect.cleandoc(source))
    assert [f.split(": ")[1:3] for f in found] == [
        ["(module)", "a Sphinx role (':func:`')"],
        ["f", "a reStructuredText `::` literal block ('Example::')"],
        ["f", "a ``double-backtick`` literal ('``x``')"],
    ]
