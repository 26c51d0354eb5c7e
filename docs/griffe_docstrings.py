"""Griffe extension for the API reference: renders the package's docstring conventions.

* an ``Example::`` literal block (reStructuredText) becomes a bold "Example:" and a fenced,
  highlighted Python block;
* Sphinx roles (``:func:`x```, ``:class:`x```, ``:data:`x```, ...) become code spans.

Loaded by mkdocs.yml (``extensions``); the docstrings themselves stay as they are.
"""

import re
import textwrap

import griffe

_ROLE = re.compile(r":(?:func|class|data|meth|attr|mod|obj|exc):`~?([^`]+)`")


def _render(text: str) -> str:
    text = _ROLE.sub(r"`\1`", text)
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        match = re.match(r"^(\s*)(.*?)\s*Example::\s*$", line)
        if not match:
            out.append(line)
            i += 1
            continue
        indent = len(match.group(1))
        prefix = match.group(2)
        j = i + 1
        block = []
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
            block.append(lines[j])
            j += 1
        while block and not block[-1].strip():
            block.pop()
        code = textwrap.dedent("\n".join(block)).strip("\n")
        head = (prefix + " " if prefix else "") + "**Example:**"
        out += [" " * indent + head, "", " " * indent + "```python"]
        out += [(" " * indent + c) if c else "" for c in code.splitlines()]
        out += [" " * indent + "```", ""]
        i = j
    return "\n".join(out)


class DocstringConventions(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _render(obj.docstring.value)
