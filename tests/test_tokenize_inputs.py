"""tokenize_batch and pad_collate never give a wrong token without an error: texts that
are not strings or UTF-8 bytes, padded tokenizer output, ids a padded dtype cannot hold."""

from __future__ import annotations

import numpy as np
import pytest

from torchgrain.tokens.tokenize import tokenize_batch


def _codepoints(texts):
    return [[ord(c) for c in t] for t in texts]


@pytest.mark.parametrize(
    "text",
    [
        "hi",
        b"hi",
        bytearray(b"hi"),
        memoryview(b"hi"),
        np.array("hi"),
        np.str_("hi"),
        np.frombuffer(b"hi", np.uint8),
        np.frombuffer(b"hi", np.int8),
    ],
    ids=["str", "bytes", "bytearray", "memoryview", "0d-str", "np-str", "uint8", "int8"],
)
def test_texts_the_docstring_promises_are_read_as_text(text):
    assert [a.tolist() for a in tokenize_batch(_codepoints, ["yo", text])] == [
        [121, 111],
        [104, 105],
    ]


@pytest.mark.parametrize(
    "text",
    [
        np.array([104, 105]),
        np.array(["hi", "yo"]),
        np.zeros((2, 2), np.uint8),
        np.array([1.0, 2.0]),
        memoryview(np.array([104, 105], np.int64)),
        7,
        None,
    ],
    ids=["int64", "1d-str", "2d-uint8", "float", "memoryview-int64", "int", "none"],
)
def test_other_values_are_refused_naming_their_position_and_type(text):
    with pytest.raises(TypeError, match=r"text 1 of the batch is a .*not a string"):
        tokenize_batch(_codepoints, ["yo", text])
