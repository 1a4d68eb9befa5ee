"""A griffe extension for the API reference: show Sphinx roles in docstrings as code.

The docstrings cross-reference with Sphinx roles (``:class:`~zero_core.plugin.Chunk```), which
mkdocstrings would print as they are. This turns each role into a code span holding the
name (the last component when the target starts with ``~``, as Sphinx shows it) and an
RST literal-block marker (``text::``) into a plain colon. A pointer to a note in the sources
(``[Note: meshes]``, the sources' convention for long explanations) becomes a code span, so
it reads as a name to search for rather than as a broken link. The sources are not changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|meth|func|attr|mod|exc|data|obj|doc):`(~?)([^`]+)`")
_LITERAL_BLOCK = re.compile(r"(?<=\S)::$", re.MULTILINE)
_NOTE = re.compile(r"(?<!`)\[Note: [^\]]+\](?!`)")


def _role(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrite each docstring once the whole package is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is not None:
            text = _LITERAL_BLOCK.sub(":", _ROLE.sub(_role, docstring.value))
            docstring.value = _NOTE.sub(lambda m: f"`{m.group(0)}`", text)
