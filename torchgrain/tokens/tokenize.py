"""Tokenizer hooks: text to int32 token ids, in DataLoader workers or once, at conversion.

:func:`tokenize_batch` runs a tokenizer over a batch of strings: a fast Hugging Face
``tokenizers.Tokenizer`` (its ``encode_batch``, in parallel Rust threads), a
``transformers`` tokenizer (called on the list; its ``input_ids``), or any callable that
maps a list of strings to a list of id sequences. :func:`tokenize` wraps it as a
``Dataset.map_batch`` function, so the tokenizer runs where the batch is read (in the
DataLoader's workers), for records and for columns batches alike.
``torchgrain convert --tokenize tokenizer.json`` applies the same function once and
stores the tokens with their counts.

This module needs only numpy (the converter's workers do not import torch).

Example:
    >>> import numpy as np
    >>> from torchgrain.tokens.tokenize import tokenize_batch
    >>> def spaces(texts):  # any callable on a list of strings
    ...     return [[len(w) for w in t.split()] for t in texts]
    >>> [ids.tolist() for ids in tokenize_batch(spaces, ["a bb", "ccc"])]
    [[1, 2], [3]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from torchgrain.columns import ColumnBatch, Ragged

__all__ = ["Tokenize", "tokenize", "tokenize_batch"]

_INT32_MAX = np.iinfo(np.int32).max


def tokenize_batch(tokenizer: Any, texts: Sequence[str | bytes]) -> list[np.ndarray]:
    """The token ids of each of ``texts``, as int32 arrays (one per text, in order).

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (``encode_batch``; special tokens added as
            its post-processor says), a ``transformers`` tokenizer (called with the list;
            ``input_ids`` of the result), or a callable taking the list of strings and
            returning one sequence of ids per string (or a mapping with ``input_ids``):
            a list (or 1-D object array) of unpadded sequences, never one padded 2-D
            array or tensor (``return_tensors``), whose pad ids cannot be told from
            tokens.
        texts: strings (a 0-d numpy str array counts as its str) or UTF-8 bytes
            (``bytes``, ``bytearray``, a memoryview of bytes, a 0-d numpy bytes array, a
            1-D uint8 or int8 array), decoded as UTF-8.

    Raises:
        TypeError: a text that is neither a string nor bytes (naming its position and
            type: a numpy array of another dtype is never read as its raw memory), or a
            tokenizer result of the wrong shape (a padded 2-D array among them).
        ValueError: text that is not UTF-8, a tokenizer that returned another number of
            sequences, or ids outside ``[0, 2**31)``.

    Example:
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, "[UNK]"))
        >>> tok.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> [ids.tolist() for ids in tokenize_batch(tok, ["hello world", "world hi"])]
        [[1, 2], [2, 0]]
    """
    strings = [_text(t, i) for i, t in enumerate(texts)]
    if not strings:
        return []
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets.
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        ids: Any = [e.ids for e in encode(strings)]
    elif callable(tokenizer):
        ids = tokenizer(strings)
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):  # a BatchEncoding
            ids = ids["input_ids"]
    else:
        raise _not_a_tokenizer(tokenizer)
    name = type(tokenizer).__name__
    if not isinstance(ids, (list, tuple)) and len(getattr(ids, "shape", ())) > 1:
        # return_tensors="np"/"pt": one padded array, whose pad ids would be taken as tokens
        raise TypeError(
            f"tokenizer {name} returned one {type(ids).__name__} of shape "
            f"{list(ids.shape)}, padded: return a list of unpadded id sequences, one per "
            "text (no return_tensors, no padding)"
        )
    if isinstance(ids, np.ndarray) and ids.ndim == 1:  # an object array of id arrays
        ids = list(ids)
    if not isinstance(ids, Sequence) or len(ids) != len(strings):
        got = f"{len(ids)} sequences" if isinstance(ids, Sequence) else type(ids).__name__
        raise ValueError(f"tokenizer {name} returned {got} for {len(strings)} texts")
    return [_ids(row, i, name) for i, row in enumerate(ids)]


def _not_a_tokenizer(tokenizer: Any) -> TypeError:
    return TypeError(
        "tokenizer must be a tokenizers.Tokenizer, a transformers tokenizer or a "
        f"callable on a list of strings, got {type(tokenizer).__name__}"
    )


def _text(value: Any, i: int) -> str:
    """Text ``i`` of a batch as a str: a str (a 0-d numpy str array too), or UTF-8 bytes
    (bytes, bytearray, a memoryview of bytes, a 0-d numpy bytes array, a 1-D uint8 or int8
    array); never another value's raw memory."""
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "US":
        value = value.item()  # its str or bytes
    if isinstance(value, str):
        return value
    if isinstance(value, np.ndarray):
        ok = value.ndim == 1 and value.dtype in (np.uint8, np.int8)
        what = f"numpy array of {value.dtype} and shape {list(value.shape)}"
    elif isinstance(value, memoryview):
        ok = value.format in ("B", "b", "c") and value.ndim == 1
        what = f"memoryview of format {value.format!r} and shape {list(value.shape or ())}"
    else:
        ok = isinstance(value, (bytes, bytearray))
        what = type(value).__name__
    if not ok:
        raise TypeError(
            f"text {i} of the batch is a {what}, not a string or UTF-8 bytes (a 1-D uint8 array)"
        )
    try:
        return bytes(value).decode()
    except UnicodeDecodeError as e:
        raise ValueError(f"text {i} of the batch is not UTF-8: {e}") from None


def _ids(row: Any, i: int, name: str) -> np.ndarray:
    try:
        arr = np.asarray(row)
    except (TypeError, ValueError) as e:
        raise TypeError(f"tokenizer {name} gave text {i} ids that are not numbers: {e}") from e
    if arr.size == 0:
        return np.zeros(0, np.int32)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TypeError(
            f"tokenizer {name} gave text {i} ids of shape {list(arr.shape)} and dtype "
            f"{arr.dtype}; expected one integer sequence"
        )
    if arr.dtype != np.int32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > _INT32_MAX:
            raise ValueError(
                f"tokenizer {name} gave text {i} token id {lo if lo < 0 else hi}, outside "
                f"[0, 2**31)"
            )
        arr = arr.astype(np.int32)
    elif int(arr.min()) < 0:
        raise ValueError(f"tokenizer {name} gave text {i} a negative token id {int(arr.min())}")
    return arr


@dataclasses.dataclass(eq=False)
class Tokenize:
    """A ``Dataset.map_batch`` function that adds the token ids of a text field (made by
    :func:`tokenize`; see there)."""

    tokenizer: Any
    column: str = "text"
    output: str = "tokens"
    lengths: str | None = None

    def __post_init__(self) -> None:
        if not (hasattr(self.tokenizer, "encode_batch") or callable(self.tokenizer)):
            raise _not_a_tokenizer(self.tokenizer)

    def __repr__(self) -> str:
        return (
            f"tokenize(column={self.column!r}, tokenizer={type(self.tokenizer).__name__}, "
            f"output={self.output!r})"
        )

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, ColumnBatch):
            return self._columns(batch)
        records = list(batch)
        texts = []
        for i, rec in enumerate(records):
            if not isinstance(rec, Mapping) or self.column not in rec:
                what = "no field" if isinstance(rec, Mapping) else "not a dict, so no field"
                raise KeyError(f"record {i} of the batch has {what} {self.column!r} to tokenize")
            texts.append(rec[self.column])
        out = []
        for rec, ids in zip(records, tokenize_batch(self.tokenizer, texts)):
            rec = {**rec, self.output: ids}
            if self.lengths is not None:
                rec[self.lengths] = np.int32(len(ids))
            out.append(rec)
        return out

    def _columns(self, batch: ColumnBatch) -> ColumnBatch:
        if self.column not in batch:
            raise KeyError(
                f"the columns batch has no field {self.column!r} to tokenize (its fields: "
                f"{sorted(batch)})"
            )
        texts = batch[self.column]
        ids = tokenize_batch(self.tokenizer, texts.tolist() if isinstance(texts, Ragged) else texts)
        lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))
        offsets = np.zeros(len(ids) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate(ids) if ids else np.zeros(0, np.int32)
        columns = {**batch, self.output: Ragged(values, offsets, "array")}
        if self.lengths is not None:
            columns[self.lengths] = lengths.astype(np.int32)
        return ColumnBatch(columns, num_rows=len(batch))


def tokenize(
    column: str = "text",
    tokenizer: Any = None,
    output: str = "tokens",
    *,
    lengths: str | None = None,
) -> Callable[[Any], Any]:
    """A ``Dataset.map_batch`` function adding the int32 token ids of ``column`` as
    ``output`` to each record: ``ds.map_batch(tokenize("text", tok))``.

    The tokenizer runs once per batch (see :func:`tokenize_batch` for what it may be),
    in the DataLoader's workers; the function pickles with its tokenizer, so it works
    under any start method. With ``batch_format="columns"`` the tokens are a
    :class:`~torchgrain.columns.Ragged` column. ``lengths`` names an extra int32 field
    holding each record's token count. A fast ``tokenizers`` tokenizer used in the main
    process before the workers fork runs single-threaded in them (the library's own
    guard, with a warning; set ``TOKENIZERS_PARALLELISM=false`` to silence it): the
    workers are the parallelism.

    Example:
        >>> import torchgrain as tg
        >>> ds = tg.Dataset([{"text": "a bb"}, {"text": "ccc"}])
        >>> ds = ds.map_batch(tokenize("text", lambda ts: [[len(w) for w in t.split()] for t in ts]))
        >>> ds.__getitems__([0, 1])[0]["tokens"].tolist()
        [1, 2]
    """
    if tokenizer is None:
        raise TypeError("tokenize needs a tokenizer")
    return Tokenize(tokenizer, column, output, lengths)
