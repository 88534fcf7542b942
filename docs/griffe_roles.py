"""A griffe extension for the API pages: the docstrings name other objects with Sphinx roles
(``:class:`~torchgrain.Source```, ``:meth:`state_dict```), which Markdown shows as they are
written. Each becomes a cross-reference to the object's section when the site documents it,
else the name as inline code.

A role's target is looked up as Sphinx looks it up: from the object whose docstring names it
outwards (its class, its module, the packages above), then as a full path. A target found
becomes an mkdocs-autorefs reference marked ``optional`` (the form mkdocstrings gives to
signature annotations): a link where some page renders the object, inline code without a
warning where none does. A target not found is inline code. The text shown is Sphinx's: the
title given (``:func:`tg.stats <torchgrain.stats>```), the last part of a ``~`` name, else the
name as written, with ``()`` after a function or method.
"""

from __future__ import annotations

import contextlib
import html
import re
from typing import Any

import griffe

ROLES = ("attr", "class", "data", "exc", "func", "meth", "mod", "obj")
# ``:role:`target``` or ``:role:`title <target>```; a target may run over a line break.
_ROLE = re.compile(r":(?:py:)?(" + "|".join(ROLES) + r"):`([^`]+)`")
_TITLED = re.compile(r"(.*?)\s*<([^<>]+)>\s*", re.DOTALL)


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = _ROLE.sub(
                lambda m: _reference(m, obj, loader.modules_collection), obj.docstring.value
            )


def _reference(m: re.Match[str], obj: griffe.Object, collection: Any) -> str:
    role, text = m.group(1), " ".join(m.group(2).split())
    titled = _TITLED.fullmatch(text)
    title, target = (titled.group(1), titled.group(2)) if titled else (None, text)
    target = target.lstrip("!")  # (Sphinx: "no link")
    short = target.startswith("~")
    target = target.lstrip("~.").removesuffix("()")
    if title is None:
        title = target.rsplit(".", 1)[-1] if short else target
        if role in ("func", "meth"):
            title += "()"
    code = f"`{title}`"
    path = _resolve(target, obj, collection)
    if path is None:
        return code
    return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'


def _resolve(target: str, obj: griffe.Object, collection: Any) -> str | None:
    """The canonical path of what ``target`` names, seen from ``obj``, or None."""
    scopes = []
    scope: griffe.Object | None = obj if obj.is_class or obj.is_module else obj.parent
    while scope is not None:
        scopes.append(scope.path + ".")
        scope = scope.parent
    for prefix in [*scopes, ""]:
        found = _lookup(prefix + target, collection)
        if found is not None:
            return found
    return None


def _lookup(path: str, collection: Any) -> str | None:
    """``path``'s object in the collection, through aliases (a few at most), or None."""
    for _ in range(8):
        parts = path.split(".")
        node: Any = collection
        for k, name in enumerate(parts):
            if node is not collection and node.is_alias:
                # A name a module imports: go on from the object it names.
                path = ".".join([node.target_path, *parts[k:]])
                break
            members = node.members
            if node is not collection and node.is_class:
                # (a method a class inherits is named from the class too)
                with contextlib.suppress(griffe.AliasResolutionError):
                    members = node.all_members
            if name not in members:
                return None
            node = members[name]
        else:
            if not node.is_alias:
                return node.path
            path = node.target_path
    return None
