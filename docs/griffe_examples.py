"""A griffe extension for the API pages: docstrings say ``Example:`` (singular) before their
doctests, which the Google-style parser takes for an admonition and renders as Markdown (so
``ds[0]["x"]`` reads as a link). Rename it ``Examples:`` before parsing, so the doctests
render as code, as they run under ``pytest --doctest-modules``."""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
