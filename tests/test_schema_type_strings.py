"""Schema type strings: a list's element types stay inside its ``list[...]``."""

from __future__ import annotations

import pytest

from torchgrain.compose.view import join_types
from torchgrain.formats.codecs import merge_schema, split_type, union_type


def test_split_type_splits_only_outside_brackets():
    assert split_type("int") == ["int"]
    assert split_type("list[int|null]|null") == ["list[int|null]", "null"]
    assert split_type("list[list[bool|int]|str]|uint8[2,3]") == [
        "list[list[bool|int]|str]",
        "uint8[2,3]",
    ]


def test_union_type_keeps_each_lists_element_types():
    assert union_type("list[bool|float]", "list[int]") == "list[bool|float]|list[int]"
    s = merge_schema(merge_schema({}, {"l": [1, None]}), {"l": [2]})
    assert s == {"l": "list[int]|list[int|null]"}


@pytest.mark.parametrize(
    ("a", "b", "joined"),
    [
        ("list[int|null|str]", "list[int|str]|null", "list[int|null|str]|null"),
        ("list[int|null|str]", "list[int|null|str]|null", "list[int|null|str]|null"),
        ("list[int]", "list[str]", None),
        ("list[int]|null", "list[int]", "list[int]|null"),
        ("list[int]|list[int|null]", "list[int]", "list[int|null]"),
        ("float32[2]", "float32[3]|null", "float32[?]|null"),
    ],
)
def test_join_types_reads_a_lists_element_types_as_its_own(a, b, joined):
    assert join_types(a, b) == joined
    assert join_types(b, a) == joined
