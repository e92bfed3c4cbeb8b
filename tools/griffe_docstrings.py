"""Griffe extension for the API reference: read this project's docstrings as written.

The docstrings are Google style with two habits that the Google parser does not know:

- an ``Example:`` section (singular) holding doctests: read as ``Examples:``, so the
  doctests render as code (instead of text whose ``[...]`` looks like a link);
- Sphinx roles (``:func:`custom_root```, ``:class:`Info```): read as code spans;
- one ``Args:`` entry for two parameters (``rtol, atol: tolerances ...``): read as one
  entry per parameter with the same text, so that every entry still has to name a real
  parameter (griffe warns otherwise, and ``mkdocs build --strict`` fails).

And one habit of the code: a default given by a module constant (``max_steps=
DEFAULT_MAX_STEPS``) is shown as the constant's value (``max_steps=10000``), which is
what a reader of the signature wants to know.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:func|meth|class|mod|data|attr|exc|obj):`~?([^`]+)`")
_PAIR = re.compile(r"^(?P<indent>\s+)(?P<a>\*{0,2}\w+), (?P<b>\*{0,2}\w+): (?P<text>.*)$")


def rewrite(docstring: str) -> str:
    lines = _ROLE.sub(r"`\1`", docstring).splitlines()
    out = []
    i = 0
    section = None
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped == "Example:":
            line = line.replace("Example:", "Examples:")
        if re.fullmatch(r"\w[\w ]*:", stripped):
            section = stripped[:-1]
        match = _PAIR.match(line) if section in ("Args", "Arguments", "Parameters") else None
        if match is None:
            out.append(line)
            i += 1
            continue
        # The entry's continuation lines: indented deeper than the entry.
        indent = len(match["indent"])
        body = [match["text"]]
        i += 1
        while i < len(lines) and (
            not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent
        ):
            if not lines[i].strip():
                break
            body.append(lines[i])
            i += 1
        for name in (match["a"], match["b"]):
            out.append(f"{match['indent']}{name}: {body[0]}")
            out.extend(body[1:])
    return "\n".join(out)


def constant_value(function, default):
    """The literal value of the module constant ``default`` names, else None."""
    if not isinstance(default, griffe.ExprName):
        return None
    member = function.parent.members.get(default.name) if function.parent else None
    if member is None or member.is_alias or not member.is_attribute:
        return None
    value = member.value
    if not isinstance(value, str):
        return None
    if re.fullmatch(r"[-+]?[\d_.eE]+", value):
        return value.replace("_", "")
    return value if re.fullmatch(r"'[^']*'|\"[^\"]*\"", value) else None


class ProjectDocstrings(griffe.Extension):
    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)

    def on_function_instance(self, *, func, **kwargs) -> None:
        for parameter in func.parameters:
            value = constant_value(func, parameter.default)
            if value is not None:
                parameter.default = value
