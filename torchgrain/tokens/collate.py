"""Collating variable-length records: a padding collate, and a clear error where torch's
default collate meets values of different lengths.

:func:`pad_collate` pads the named fields of a batch (token ids, labels, any 1-D
sequence) to the batch's longest row, optionally rounded up to a multiple of 8, adds an
attention mask and stacks everything else as torch's default collate does. It takes
batches of records (dicts) and columns batches (``batch_format="columns"``, whose
variable-length fields are :class:`~torchgrain.columns.Ragged`).

:func:`collate_records` is registered with torch's default collate for plain dict
records: it collates them as torch does, and when a key's values differ in length
(where torch fails with "stack expects each tensor to be equal size") it raises
:class:`~torchgrain.errors.RaggedBatchError` naming the key, the lengths and the fixes.
The lengths are looked at only after torch has failed: equal-length batches pay nothing.

Example:
    >>> import numpy as np, torchgrain as tg
    >>> batch = [{"input_ids": np.array([5, 6, 7]), "y": 0}, {"input_ids": np.array([8]), "y": 1}]
    >>> out = tg.pad_collate(batch)
    >>> out["input_ids"].tolist(), out["attention_mask"].tolist(), out["y"].tolist()
    ([[5, 6, 7], [8, 0, 0]], [[1, 1, 1], [1, 0, 0]], [0, 1])
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from torchgrain.columns import ColumnBatch, Ragged, as_tensor, dtype_holding, unsigned_past_int64
from torchgrain.errors import RaggedBatchError
from torchgrain.frameworks.dataloader import collate

__all__ = ["PadCollate", "collate_records", "pad_collate"]

_SIDES = ("right", "left")
# Not padded unless named: token windows' document boundaries padded with 0 would step
# back to 0 (tg.tokens.windows.collate_windows joins them instead).
_NOT_PADDED = ("cu_seqlens",)


def pad_collate(
    batch: Any = None,
    *,
    keys: Sequence[str] | None = None,
    pad_id: int | float = 0,
    pad_values: Mapping[str, int | float] | None = None,
    multiple_of: int | None = None,
    max_length: int | None = None,
    side: str = "right",
    attention_mask: str | None = "attention_mask",
    labels_pad: int | float = -100,
) -> Any:
    """A collate that pads variable-length fields: ``DataLoader(ds, batch_size=32,
    collate_fn=tg.pad_collate(keys=["input_ids"], multiple_of=8))``.

    Without ``batch`` it returns the collate (a picklable :class:`PadCollate`, so it
    works with worker processes under any start method); with ``batch`` it collates that
    batch at once.

    Args:
        batch: a list of records (dicts), or a columns batch (``[ColumnBatch]`` as the
            DataLoader passes it, or a :class:`~torchgrain.columns.ColumnBatch`).
        keys: the fields to pad (each a 1-D list, numpy array or tensor per record, or a
            :class:`~torchgrain.columns.Ragged` column). ``None``: every such field but
            ``cu_seqlens`` (token windows: batch them with ``collate_windows``).
            ``labels``, when records have it as a 1-D sequence, is padded too.
        pad_id: the padding value of the padded fields.
        pad_values: a padding value per field, over the defaults (``pad_id``;
            ``labels_pad`` for ``labels``; 0 for the attention mask's field).
        multiple_of: round the padded length up to a multiple of this (8 suits tensor
            cores).
        max_length: the padded length never exceeds this; a longer row is an error
            (truncate it in a ``map``, or cut windows with ``Dataset.windows``).
        side: ``"right"`` (padding after each row) or ``"left"`` (before it, as
            generation wants).
        attention_mask: name of the added int64 mask, 1 on the first padded field's real
            positions (``None``: no mask; records that have the field already get it
            padded with 0 instead).
        labels_pad: the padding value of ``labels`` (-100: ignored by
            ``torch.nn.functional.cross_entropy``).

    Each field is padded to its own longest row in the batch (rows all empty: a
    ``[B, 0]`` tensor), in its rows' dtype (a list's is numpy's: Python floats float64,
    as torch's default collate keeps them) promoted to hold them all and the padding
    value (uint32 with int32 rows, or uint16 ones under -100: int64; float16 ones
    padded with 2049 or -1e9: float32; an empty row's dtype is left out, as
    ``np.array([])`` is float64). Other fields go through torch's default collate.
    Errors name the field and the record's position in the batch.

    Raises:
        ValueError: a padding value that is not an integer over integer ids (floats
            would round them), or uint64 ids above ``2**63 - 1`` where int64 is needed
            (a negative padding value, signed rows beside them): never a wrong id;
            over float rows, a padding value no float dtype holds (2**53 + 1).

    Example:
        >>> import numpy as np, torch
        >>> collate = pad_collate(keys=["input_ids"], multiple_of=4, side="left")
        >>> out = collate([{"input_ids": [1, 2], "labels": [1, 2]},
        ...                {"input_ids": [3, 4, 5], "labels": [3, 4, 5]}])
        >>> out["input_ids"].tolist()
        [[0, 0, 1, 2], [0, 3, 4, 5]]
        >>> out["labels"].tolist(), out["attention_mask"].tolist()
        ([[-100, -100, 1, 2], [-100, 3, 4, 5]], [[0, 0, 1, 1], [0, 1, 1, 1]])
    """
    fn = PadCollate(
        keys=keys,
        pad_id=pad_id,
        pad_values=pad_values,
        multiple_of=multiple_of,
        max_length=max_length,
        side=side,
        attention_mask=attention_mask,
        labels_pad=labels_pad,
    )
    return fn if batch is None else fn(batch)


@dataclasses.dataclass(eq=False, kw_only=True)
class PadCollate:
    """The collate :func:`pad_collate` makes (see there for the arguments)."""

    keys: Sequence[str] | None = None
    pad_id: int | float = 0
    pad_values: Mapping[str, int | float] | None = None
    multiple_of: int | None = None
    max_length: int | None = None
    side: str = "right"
    attention_mask: str | None = "attention_mask"
    labels_pad: int | float = -100

    def __post_init__(self) -> None:
        if isinstance(self.keys, str):
            raise TypeError(f"keys must be a list of field names, got the string {self.keys!r}")
        if self.side not in _SIDES:
            raise ValueError(f"side must be 'right' or 'left', got {self.side!r}")
        for name in ("multiple_of", "max_length"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        self.keys = None if self.keys is None else list(self.keys)
        self.pad_values = dict(self.pad_values or {})

    def __repr__(self) -> str:
        return (
            f"pad_collate(keys={self.keys!r}, multiple_of={self.multiple_of!r}, "
            f"max_length={self.max_length!r}, side={self.side!r})"
        )

    def __call__(self, batch: Any) -> dict[str, Any]:
        if isinstance(batch, ColumnBatch):
            return self._columns(batch)
        if isinstance(batch, Sequence) and len(batch) == 1 and isinstance(batch[0], ColumnBatch):
            return self._columns(batch[0])
        if not isinstance(batch, Sequence) or isinstance(batch, (str, bytes)):
            raise TypeError(
                f"pad_collate takes a list of records (dicts) or a columns batch, got "
                f"{type(batch).__name__}"
            )
        if not batch:
            raise ValueError("pad_collate got an empty batch")
        for i, rec in enumerate(batch):
            if not isinstance(rec, Mapping):
                raise TypeError(
                    f"pad_collate takes records that are dicts; record {i} of the batch is "
                    f"a {type(rec).__name__}"
                )
        keys = self._keys_of(batch)
        out: dict[str, Any] = {}
        padded = {
            key: self._pad_rows(key, [_as_row(rec[key], key, i) for i, rec in enumerate(batch)])
            for key in keys
        }
        rest = [{k: v for k, v in rec.items() if k not in padded} for rec in batch]
        if rest[0]:
            out.update(default_collate(rest))
        return self._finish(batch[0].keys(), out, padded)

    # ------------------------------------------------------------ internals
    def _keys_of(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        for i, rec in enumerate(records):
            for key in self.keys or ():
                if key not in rec:
                    raise KeyError(
                        f"pad_collate: record {i} of the batch has no field {key!r} "
                        f"(its fields: {sorted(rec)})"
                    )
        return self._padded(records[0], lambda k: _all_sequences([r.get(k) for r in records]))

    def _padded(self, fields: Iterable[str], pads: Callable[[str], bool]) -> list[str]:
        """The fields padded: those named, and ``labels`` and the mask's field when
        ``pads`` says they hold sequences; else every such field but ``cu_seqlens``."""
        if self.keys is None:
            return [k for k in fields if k not in _NOT_PADDED and pads(k)]
        extra = [k for k in ("labels", self.attention_mask) if k and k not in self.keys]
        return [*self.keys, *(k for k in extra if k in fields and pads(k))]

    def _pad_value(self, key: str) -> int | float:
        if key in self.pad_values:
            return self.pad_values[key]
        if key == "labels":
            return self.labels_pad
        if key == self.attention_mask:
            return 0
        return self.pad_id

    def _layout(self, key: str, lengths: Any) -> tuple[int, int | float]:
        """The padded width and the padding value of field ``key``, whose rows have
        ``lengths`` (a ValueError past ``max_length``, before any value is converted)."""
        longest, row = (int(lengths.max()), int(lengths.argmax())) if len(lengths) else (0, 0)
        if self.max_length is not None and longest > self.max_length:
            raise ValueError(
                f"pad_collate: field {key!r} of record {row} of the batch holds {longest} "
                f"values, more than max_length={self.max_length}: truncate it in a map, or "
                "cut fixed-length windows with Dataset.windows"
            )
        width = longest
        if self.multiple_of is not None:
            width = -(-width // self.multiple_of) * self.multiple_of
        if self.max_length is not None:
            width = min(width, self.max_length)
        return width, self._pad_value(key)

    def _pad_rows(self, key: str, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        sizes = [len(r) for r in rows]
        lengths = torch.tensor(sizes, dtype=torch.int64)
        # The distinct dtypes; an empty row's says nothing (np.array([]) is float64).
        dtypes = dict.fromkeys(r.dtype for r, n in zip(rows, sizes) if n)
        width, pad = self._layout(key, lengths)
        dtype = _dtype_of(key, list(dtypes or dict.fromkeys(r.dtype for r in rows)), pad)
        if torch.uint64 in dtypes and dtype == torch.int64:
            for i, r in enumerate(rows):
                _check_fits(key, r, dtype, pad, lambda at, i=i: f"record {i}")
        out = torch.full((len(rows), width), pad, dtype=dtype)
        for i, (r, n) in enumerate(zip(rows, sizes)):
            at = 0 if self.side == "right" else width - n
            out[i, at : at + n] = r
        return out, lengths

    def _columns(self, batch: ColumnBatch) -> dict[str, Any]:
        from torchgrain._worker_batches import collate_columns

        n = len(batch)
        for key in self.keys or ():
            if key not in batch:
                raise KeyError(
                    f"pad_collate: the columns batch has no field {key!r} (its fields: "
                    f"{sorted(batch)})"
                )
        keys = self._padded(batch, lambda k: _is_column_sequence(batch[k]))
        padded = {key: self._pad_column(key, batch[key], n) for key in keys}
        rest = ColumnBatch({k: v for k, v in batch.items() if k not in padded}, num_rows=n)
        out = collate_columns([rest]) if dict.__len__(rest) else {}
        return self._finish(batch.keys(), out, padded)

    def _pad_column(self, key: str, col: Any, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(col, np.ndarray) and col.ndim == 2 and col.dtype.kind in "biuf":
            # Equal lengths in this batch: stacked already.
            col = Ragged(col.reshape(-1), np.arange(n + 1, dtype=np.int64) * col.shape[1], "array")
        if isinstance(col, list):  # values a column could not hold as one array
            return self._pad_rows(key, [_as_row(v, key, i) for i, v in enumerate(col)])
        if not isinstance(col, Ragged):
            raise TypeError(
                f"pad_collate: field {key!r} of the columns batch is not variable-length "
                f"values (a Ragged) but {type(col).__name__}"
            )
        width, pad = self._layout(key, col.lengths())
        values = as_tensor(col.values)
        dtype = _dtype_of(key, [values.dtype], pad)
        offsets = np.asarray(col.offsets)
        start, end = (int(offsets[0]), int(offsets[-1])) if n else (0, 0)
        _check_fits(
            key,
            values[start:end],
            dtype,
            pad,
            lambda at: f"row {int(np.searchsorted(offsets, start + at, 'right')) - 1}",
        )
        if dtype != values.dtype:
            col = Ragged(values.to(dtype), col.offsets, col.kind)
        out, lengths = col.to_padded(pad, side=self.side)
        if out.shape[1] < width:  # multiple_of: more padding
            extra = torch.full((n, width - out.shape[1]), pad, dtype=out.dtype)
            out = torch.cat([out, extra] if self.side == "right" else [extra, out], dim=1)
        return out, lengths

    def _finish(
        self,
        order: Any,
        collated: dict[str, Any],
        padded: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> dict[str, Any]:
        out = collated
        out.update({key: tensor for key, (tensor, _) in padded.items()})
        mask_name = self.attention_mask
        if mask_name and mask_name not in padded and mask_name not in out and padded:
            first = next(iter(padded))
            tensor, lengths = padded[first]
            width = tensor.shape[1]
            pos = torch.arange(width)
            if self.side == "right":
                mask = pos[None, :] < lengths[:, None]
            else:
                mask = pos[None, :] >= (width - lengths)[:, None]
            out[mask_name] = mask.to(torch.int64)
        # The records' field order, then what was added.
        ordered = {**{k: out[k] for k in order if k in out}, **out}
        if type(out) is dict:
            return ordered
        out.clear()  # a worker's shared-memory batch: keep its type
        out.update(ordered)
        return out


def _dtype_of(key: str, dtypes: list[torch.dtype], pad: int | float) -> torch.dtype:
    """The dtype a padded field gets: its rows' distinct ``dtypes`` promoted (uint32 with
    int32 is int64), holding ``pad`` too; integer ids are never put in floats."""
    floats = [d for d in dtypes if d.is_floating_point or d.is_complex]
    if floats:  # integer rows among float ones go into floats, as torch promotes them
        dtype = _float_holding(functools.reduce(torch.promote_types, floats), pad)
        if dtype is None:
            raise ValueError(
                f"pad_collate: no float dtype holds the padding value {pad!r} of field "
                f"{key!r} exactly: pad with a value float64 holds"
            )
        return dtype
    if isinstance(pad, float):
        if not pad.is_integer():
            raise ValueError(
                f"pad_collate: the padding value {pad!r} of field {key!r} is not an integer "
                f"and its values are integers ({', '.join(sorted(map(str, set(dtypes))))}): "
                "floats would round ids above 2**24; pad with an integer"
            )
        pad = int(pad)
    try:
        return dtype_holding(_holding(tuple(dtypes)), pad)
    except ValueError as e:
        raise ValueError(f"pad_collate: field {key!r}: {e}") from None


@functools.lru_cache(maxsize=256)
def _float_holding(dtype: torch.dtype, pad: int | float) -> torch.dtype | None:
    """The first of ``dtype``, float32 and float64 (none narrower than ``dtype``) that
    holds ``pad`` (float16 rounds a sentinel 2049 to 2048 and makes -1e9 -inf): exactly,
    or a fraction (0.1, which only float64 holds exactly) rounded as the rows' values
    are, within the dtype's range; None if none does (a complex ``dtype`` as it is)."""
    if dtype.is_complex or pad != pad:  # (NaN: every float dtype holds one)
        return dtype
    wider = [d for d in (torch.float32, torch.float64) if d.itemsize > dtype.itemsize]
    for d in (dtype, *wider):
        try:
            held = torch.tensor(pad, dtype=d).item()
        except OverflowError:  # an int past float64's range
            continue
        fraction = isinstance(pad, float) and not pad.is_integer()
        if held == pad or (fraction and abs(held) != float("inf")):
            return d
    return None


@functools.lru_cache(maxsize=256)
def _holding(dtypes: tuple[torch.dtype, ...]) -> torch.dtype:
    """The smallest integer dtype holding every one of the integer ``dtypes`` (int64 at
    most: uint64 with signed ones, checked value by value)."""
    if all(d == torch.bool for d in dtypes):
        return torch.bool
    ranges = [
        (0, 1) if d == torch.bool else (torch.iinfo(d).min, torch.iinfo(d).max) for d in dtypes
    ]
    lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
    candidates = [torch.uint8, torch.uint16, torch.uint32, torch.uint64] if lo == 0 else []
    candidates += [torch.int8, torch.int16, torch.int32, torch.int64]
    fits = [d for d in candidates if torch.iinfo(d).min <= lo and hi <= torch.iinfo(d).max]
    return fits[0] if fits else torch.int64


def _check_fits(
    key: str, values: torch.Tensor, dtype: torch.dtype, pad: int | float, where: Callable
) -> None:
    """A ValueError naming the field when uint64 ``values`` exceed int64 ``dtype``."""
    if dtype != torch.int64 or values.dtype != torch.uint64:
        return
    at = unsigned_past_int64(values)
    if at is not None:
        raise ValueError(
            f"pad_collate: field {key!r} of {where(at)} of the batch holds "
            f"{values[at].item()}, above 2**63 - 1: int64, which the padding value {pad!r} "
            "and the field's other rows need, cannot hold it"
        )


def _is_sequence(value: Any) -> bool:
    """A value pad_collate pads unless told: a 1-D array, tensor or list of numbers."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.ndim == 1 and (not isinstance(value, np.ndarray) or value.dtype.kind in "biuf")
    if not isinstance(value, (list, tuple)) or not value:
        return False
    first = value[0]
    if isinstance(first, torch.Tensor):  # a 0-d tensor of a number
        return first.ndim == 0 and not first.dtype.is_complex and first.dtype != torch.bool
    return isinstance(first, (int, float, np.integer, np.floating)) and not isinstance(first, bool)


def _all_sequences(values: list[Any]) -> bool:
    """Whether every value is a 1-D sequence of numbers or empty (all empty: a ``[B, 0]``
    tensor, so a batch's shape does not depend on its content)."""
    return bool(values) and all(
        _is_sequence(v) or (isinstance(v, (list, tuple)) and not v) for v in values
    )


def _is_column_sequence(col: Any) -> bool:
    """A column pad_collate pads unless told: Ragged arrays, a list of sequences, or a
    ``[B, k]`` array (1-D values that happen to share a length in this batch, padded as
    their records would be: a batch's shape does not depend on its content)."""
    if isinstance(col, list):
        return _all_sequences(col)
    if isinstance(col, np.ndarray):  # (numbers, as :func:`_is_sequence` takes them)
        return col.ndim == 2 and col.dtype.kind in "biuf"
    return isinstance(col, Ragged) and col.kind == "array"


def exact_numpy(items: Any) -> np.ndarray:
    """``items`` (a number or a list, nested or not) as numpy makes it, except ints past
    int64, which numpy would round to float64 (or keep as objects, or make a uint64
    torch refuses): uint64 when every item is an int (a 0-d int array too) and none is
    negative, else a ValueError (beside a float too).

    Example:
        >>> exact_numpy([1, 2**63 + 5])
        array([                  1, 9223372036854775813], dtype=uint64)
        >>> exact_numpy([[1.5, 2]]).dtype
        dtype('float64')
        >>> exact_numpy([-1, 2**63])
        Traceback (most recent call last):
        ...
        ValueError: 9223372036854775808 (past int64) beside -1: no integer dtype holds both
        >>> exact_numpy([1.5, 2**63])
        Traceback (most recent call last):
        ...
        ValueError: 9223372036854775808 (past int64) beside 1.5: float64 would round it
    """
    arr = np.asarray(items)
    kind = arr.dtype.kind
    if kind == "f":  # (numpy's float64 holds ints in [2**63, 2**64) too, rounded)
        if type(items) is list and 0 < len(items) <= 32 and arr.ndim == 1:
            if max(items) < 2.0**63:  # (a NaN first: looked at below)
                return arr
        elif arr is items or not arr.ndim or not arr.size or np.fmax.reduce(arr, None) < 2.0**63:
            return arr
    elif kind == "u":  # (numpy's ulonglong for ints past int64: torch takes ulong)
        return arr.view(np.uint64) if arr.itemsize == 8 and arr.dtype.char != _UINT64 else arr
    elif kind != "O" or arr is items or not arr.size:
        return arr
    if not arr.ndim:
        leaves = [items]
    else:
        leaves = items if arr.ndim == 1 else np.array(items, dtype=object).ravel().tolist()
    if not all(map(_is_int, leaves)):
        if kind == "f":
            big = next((int(v) for v in leaves if _is_int(v) and int(v) > _INT64_MAX), None)
            if big is not None:
                other = next(v for v in leaves if not _is_int(v))
                raise ValueError(f"{big} (past int64) beside {other!r}: float64 would round it")
        return arr
    ints = [int(v) for v in leaves]
    lo, hi = min(ints), max(ints)
    if lo < -(2**63) or hi >= 2**64:
        raise ValueError(f"{lo if lo < -(2**63) else hi} is past int64's and uint64's range")
    if hi <= _INT64_MAX:
        return arr
    if lo < 0:
        raise ValueError(f"{hi} (past int64) beside {lo}: no integer dtype holds both")
    return np.array(ints, dtype=np.uint64).reshape(arr.shape)


_UINT64 = np.dtype(np.uint64).char
_INT64_MAX = 2**63 - 1


def _is_int(v: Any) -> bool:
    """A Python or numpy int, or a 0-d int array (not a bool)."""
    if isinstance(v, np.ndarray):
        return not v.ndim and v.dtype.kind in "iu"
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def holds_tensor(items: list[Any] | tuple[Any, ...]) -> bool:
    """Whether a list or tuple holds a tensor (its items' types looked at once: 4x faster
    than an isinstance of each).

    Example:
        >>> holds_tensor([1.5, 2]), holds_tensor([1, torch.tensor(2)])
        (False, True)
    """
    types = {*map(type, items)}
    return not types <= _NUMBERS and any(issubclass(t, torch.Tensor) for t in types)


_NUMBERS = frozenset({int, float, bool})


def _as_row(value: Any, key: str, i: int) -> torch.Tensor:
    try:
        if isinstance(value, (list, tuple)) and holds_tensor(value):
            # numpy has no bfloat16 and refuses tensors requiring grad: torch keeps them
            if all(isinstance(v, torch.Tensor) for v in value):
                value = torch.stack(value)
            else:  # numpy, so Python floats stay float64
                value = exact_numpy(
                    [v.tolist() if isinstance(v, torch.Tensor) else v for v in value]
                )
        elif isinstance(value, (list, tuple)):  # Python floats stay float64, as default_collate's
            value = exact_numpy(value) if value else np.zeros(0, np.int64)
        if isinstance(value, torch.Tensor):
            t = value
        elif isinstance(value, np.ndarray):
            if value.dtype.kind not in "biuf":
                raise TypeError(f"an array of {value.dtype}")
            t = as_tensor(value)
        else:
            raise TypeError(f"a {type(value).__name__}")
        if t.ndim != 1:
            raise TypeError(f"a value of shape {list(t.shape)}")
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(
            f"pad_collate: field {key!r} of record {i} of the batch must be a 1-D list, "
            f"numpy array or tensor of numbers, got {e}"
        ) from None
    return t


# ----------------------------------------------------- the default collate's dicts
def collate_records(batch: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
    """What torch's default collate makes of a batch of dict records, with a
    :class:`~torchgrain.errors.RaggedBatchError` naming the key when a key's values
    differ in length.

    Registered with torch's default collate (for ``dict`` and its subclasses without
    their own entry); the result is torch's: a mapping of the same type with each key
    collated.

    Example:
        >>> import numpy as np, torch, torchgrain as tg
        >>> ds = tg.Dataset([{"ids": np.zeros(3)}, {"ids": np.ones(5)}])
        >>> next(iter(torch.utils.data.DataLoader(ds, batch_size=2)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchgrain.errors.RaggedBatchError: cannot collate key 'ids': its values differ in length within the batch ([3] at entry 0, [5] at entry 1); pad them with collate_fn=tg.pad_collate(keys=['ids']) ...
    """
    elem = batch[0]
    out = {}
    for key in elem:
        values = [d[key] for d in batch]
        try:
            out[key] = collate(values, collate_fn_map=collate_fn_map)
        except RaggedBatchError:
            raise
        except (RuntimeError, TypeError, ValueError) as e:
            message = _ragged_message(key, values)
            if message is not None:
                raise RaggedBatchError(message) from e
            exact = _as_uint64(key, values)
            if exact is None:
                raise
            out[key] = collate(exact, collate_fn_map=collate_fn_map)
        if _maybe_mixed(values, out[key]):
            out[key] = _exact_or_refused(key, values, out[key])
    if type(elem) is dict:
        return out
    try:  # a dict subclass keeps its type, as torch's default collate keeps it
        clone = copy.copy(elem)
        clone.update(out)
        return clone
    except TypeError:
        return out


def _maybe_mixed(values: list[Any], out: Any) -> bool:
    """Whether ``values`` may be of several types or dtypes that torch's stack ``out`` may
    not hold exactly: judged from ``out`` for Python ints and floats (a float beside ints
    makes it float32; beside floats, only an int past 2**53 changes in float64), else
    from their types (:func:`_mixed`). Tensors are stacked by torch's own rules."""
    if not isinstance(out, torch.Tensor) or any(isinstance(v, torch.Tensor) for v in values[:1]):
        return False
    first = type(values[0])
    if first is int or first is bool:
        return out.is_floating_point()
    if first is float:
        return out.numel() > 0 and bool(out.abs().max() >= 2**53)
    return _mixed(values)


def _mixed(values: list[Any]) -> bool:
    """Whether ``values`` are of several types, or arrays of several dtypes (torch then
    stacks them in one dtype, which may not hold them all)."""
    kinds = set(map(type, values))
    return len(kinds) > 1 or (kinds == {np.ndarray} and len({v.dtype for v in values}) > 1)


def _exact_or_refused(key: str, values: list[Any], out: Any) -> Any:
    """``out``, torch's stack of ``values`` of several types or dtypes, where it holds each
    value exactly, else a TypeError naming the key and entry. Numbers of several types with
    a float among them are stacked as float64 whatever the first one is (torch stacks by
    the first value's type: ``[1, 0.1]`` as float32, ``[0.1, 1]`` as float64), so a key's
    dtype does not change from batch to batch; a ``uint64`` past 2**53 beside a float is
    refused (no dtype holds both).

    Example:
        >>> _exact_or_refused("x", [1, 0.1], torch.tensor([1, 0.1])).dtype
        torch.float64
        >>> _exact_or_refused("x", [2**60 + 1, 0.5], torch.tensor([2**60 + 1, 0.5]))
        Traceback (most recent call last):
        ...
        TypeError: cannot collate key 'x': entry 0 holds 1152921504606846977, which a float64 batch would change (its values are of several types: make them one type in a map)
    """
    if not isinstance(out, torch.Tensor) or any(isinstance(v, torch.Tensor) for v in values):
        return out  # (tensors: stacked by torch's own rules)
    wanted = [np.asarray(v) for v in values]
    if all(w.ndim == 0 and w.dtype.kind in "biuf" for w in wanted) and any(
        w.dtype.kind == "f" for w in wanted
    ):
        out = torch.from_numpy(np.array([w.item() for w in wanted], dtype=np.float64))
    bad = _changed(wanted, out)
    if bad is not None and len({w.shape for w in wanted}) == 1:
        # (in a worker, torch stacks into a buffer of the first value's dtype: numpy's
        # common dtype may hold them all, float64 beside float32)
        out = torch.from_numpy(np.stack(wanted))
        bad = _changed(wanted, out)
    if bad is None:
        return out
    raise TypeError(
        f"cannot collate key {key!r}: entry {bad} holds {values[bad]!r}, which a "
        f"{str(out.dtype).removeprefix('torch.')} batch would change (its values are of "
        "several types: make them one type in a map)"
    )


def _changed(wanted: list[np.ndarray], out: torch.Tensor) -> int | None:
    """The first entry of ``wanted`` that row ``i`` of ``out`` does not hold exactly."""
    rows = out.numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        for i, (w, row) in enumerate(zip(wanted, rows)):
            if w.dtype.kind not in "biufc" or w.shape != row.shape:
                continue  # (not numbers: torch's own conversion)
            back = row.astype(w.dtype)  # (and back again: no value rounded either way)
            if not (_equal(back, w) and _equal(back.astype(row.dtype), row)):
                return i
    return None


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` hold the same values, NaN equal to NaN."""
    same = a == b
    if a.dtype.kind in "fc":
        same |= np.isnan(a) & np.isnan(b)
    return bool(np.all(same))


def _as_uint64(key: str, values: list[Any]) -> list[torch.Tensor] | None:
    """Tensors of uint64 (which torch does not promote) beside other ints or bools, all
    made uint64 where none is negative, else a TypeError naming the key; None when
    ``values`` are not such tensors."""
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None
    dtypes = {v.dtype for v in values}
    if torch.uint64 not in dtypes or len(dtypes) < 2:
        return None
    wide = next(i for i, v in enumerate(values) if v.dtype == torch.uint64)
    for i, v in enumerate(values):
        if v.dtype.is_floating_point or v.dtype.is_complex:
            raise TypeError(
                f"cannot collate key {key!r}: entry {i} holds {v.dtype} beside uint64 at "
                f"entry {wide}, which {v.dtype} would round"
            )
        if v.dtype != torch.uint64 and v.numel() and bool((v < 0).any()):
            raise TypeError(
                f"cannot collate key {key!r}: entry {i} holds {v.min().item()} beside uint64 "
                f"at entry {wide}: no integer dtype holds both"
            )
    return [v.to(torch.uint64) for v in values]


def _ragged_message(key: str, values: list[Any]) -> str | None:
    """Why ``values`` cannot be stacked, when it is their lengths; None otherwise."""
    shapes = []
    for v in values:
        shape = getattr(v, "shape", None)
        if shape is not None:
            shapes.append(tuple(shape))
        elif isinstance(v, (list, tuple)):
            shapes.append((len(v),))
        else:
            return None
    if len(set(shapes)) < 2:
        return None
    if key == "cu_seqlens":  # token windows' boundaries: padding them would step back to 0
        return (
            "cannot collate key 'cu_seqlens': its values differ in length within the batch; "
            "token windows batch with collate_fn=torchgrain.tokens.windows.collate_windows, "
            "which joins every window's boundaries into the batch's cu_seqlens"
        )
    seen = [f"{list(s)} at entry {i}" for i, s in enumerate(shapes) if s != shapes[0]][:2]
    lengths = f"{list(shapes[0])} at entry 0, " + ", ".join(seen)
    if len(values) > 3:
        firsts = [s[0] if s else 0 for s in shapes]
        lengths += f", ...: {len(values)} values, lengths {min(firsts)}..{max(firsts)}"
    return (
        f"cannot collate key {key!r}: its values differ in length within the batch "
        f"({lengths}); pad them with collate_fn=tg.pad_collate(keys=[{key!r}]) (add "
        f"multiple_of=8 for tensor cores), or cut fixed-length windows with "
        f"ds.windows({key!r}, seq_len)"
    )
