"""Token windows: fixed-length training windows over the tokenized documents of a dataset.

``Dataset.windows(column, seq_len)`` turns a dataset of documents (a column holding a
list or array of token ids per record, or text and a tokenizer) into a map-style dataset
of windows, each a dict of ``input_ids``, ``labels``, ``position_ids``, ``cu_seqlens``
and ``document_ids``. Two modes:

``mode="concat"`` (pretraining) cuts the documents' token stream (with ``bos``/``eos``)
into windows, each token but the first a label once per epoch; ``mode="pack"``
(fine-tuning) packs whole documents by best-fit decreasing, padding the rest. The index
(document lengths' prefix sums, 8 bytes per document) is built once per machine and
checked when opened; a batch of windows is one batched read of the documents it touches.

Design notes: docs/design-notes.md#tokens-windows.
"""

from __future__ import annotations

import array
import bisect
import os
import reprlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch.utils.data

from torchgrain.columns import ColumnBatch, Ragged
from torchgrain.compose.filter import as_is, changes_with_epoch, identified
from torchgrain.compose.view import Composed, as_records
from torchgrain.dataset import Dataset
from torchgrain.errors import CorruptDataError
from torchgrain.protocols import HasBlockOffsets
from torchgrain.sources.base import Source
from torchgrain.sources.index import ShardIndex
from torchgrain.sources.node_index.derived import (
    DEFAULT,
    DerivedIndex,
    callable_fingerprint,
    dataset_fingerprint,
    derived_index,
    hash_parts,
)
from torchgrain.tokens.tokenize import tokenize_batch

__all__ = ["TokenWindows", "WindowDataset", "collate_windows", "windows"]

#: The ``labels`` value of positions that predict nothing (PyTorch's ``ignore_index``).
IGNORE = -100
_KIND = "windows"
_CHUNK = 1024  # documents per read when measuring lengths by reading the column
_PACK_STEP = 1 << 16  # documents' lengths taken at a time by the pack build
_SCHEMA = {
    "input_ids": "int64[?]",
    "labels": "int64[?]",
    "position_ids": "int64[?]",
    "cu_seqlens": "int32[?]",
    "document_ids": "int64[?]",
}


# ------------------------------------------------------------------- reading documents
class _Documents:
    """How the documents' token arrays are read from the dataset: ``read(docs)`` returns
    one int64 array per document, in ``docs`` order, with one batched read."""

    def __init__(self, ds: Dataset, column: str, tokenizer: Any, length_column: str | None) -> None:
        self.column = column
        self.tokenizer = tokenizer
        self.length_column = length_column
        self.name = _describe(ds.source)
        source = ds._source
        # length_parquet: a Parquet source of the one column the lengths are read from
        # (the tokens' list offsets, or the count column), when there is one.
        self.parquet = self.length_parquet = None
        if not ds._ops and tokenizer is None:
            source = _narrowed_parquet(source, column)
            self.parquet = source if _is_parquet(source) else None
            counted = column if length_column is None else length_column
            counts = source if counted == column else _narrowed_parquet(ds._source, counted)
            if _is_parquet(counts) and counts.keys == [counted]:
                self.length_parquet = counts
        # Native column reads (no Python object per token) when the dataset is the
        # source itself; through the Dataset (its transforms) otherwise.
        self.columns = (
            source if not ds._ops and type(source).read_columns is not Source.read_columns else None
        )
        self.ds = as_records(ds)

    def read(self, docs: np.ndarray) -> list[np.ndarray]:
        if len(docs) == 0:
            return []
        if self.columns is not None:
            batch = self.columns.read_columns(docs)
            if self.column not in batch:
                raise CorruptDataError(
                    f"records {docs.tolist()[:8]} of {self.name} have no column {self.column!r}"
                )
            col = batch[self.column]
            if isinstance(col, Ragged) and col.kind == "array":
                values, offsets = np.asarray(col.values), np.asarray(col.offsets)
                if values.dtype.kind in "iu":
                    self._check_range(values, docs)
                    return [values[offsets[k] : offsets[k + 1]] for k in range(len(docs))]
            elif isinstance(col, np.ndarray) and col.ndim == 2 and col.dtype.kind in "iu":
                self._check_range(col, docs)
                return list(col)
            values = list(col)
            # A record without the column reads as None in a column batch (of records
            # that hold it): read alone, it is named. (A Parquet null is an empty document.)
            nulls = [k for k, v in enumerate(values) if v is None]
            if nulls and _is_parquet(self.columns):
                nulls = []
            if nulls:
                records = self.ds.__getitems__(docs[nulls].tolist())
                for k, record in zip(nulls, records):
                    values[k] = self._field(record, int(docs[k]))
        else:
            values = [self._field(r, d) for r, d in zip(self.ds.__getitems__(docs.tolist()), docs)]
        if self.tokenizer is not None:
            values = _tokenize(self.tokenizer, values, self, docs)
        return [self._tokens(v, int(d)) for v, d in zip(values, docs.tolist())]

    def _check_range(self, values: np.ndarray, docs: np.ndarray) -> None:
        """Token ids must be >= 0 and fit the windows' int64 (only a uint64 array can
        hold more)."""
        # (against a uint64: numpy 1 compares a uint64 scalar with a Python int as floats)
        if values.dtype == np.uint64 and values.size and values.max() > _INT64_MAX:
            raise CorruptDataError(
                f"records {docs.tolist()[:8]} of {self.name}: column {self.column!r} holds a "
                "token id above 2**63 - 1"
            )
        # A negative id would reach an embedding as an index (a device-side assert on a
        # GPU), or read as the labels' ignore value -100 and train on nothing.
        if values.dtype.kind == "i" and values.size and values.min() < 0:
            raise CorruptDataError(
                f"records {docs.tolist()[:8]} of {self.name}: column {self.column!r} holds a "
                f"negative token id ({int(values.min())})"
            )

    def _field(self, record: Any, doc: int) -> Any:
        if self.column not in record:
            raise CorruptDataError(f"record {doc} of {self.name} has no column {self.column!r}")
        return record[self.column]

    def _tokens(self, value: Any, doc: int) -> np.ndarray:
        if value is None:
            return np.zeros(0, np.int64)
        try:
            arr = np.asarray(value)
        except ValueError as e:  # a ragged nested list: numpy refuses its shape
            raise CorruptDataError(
                f"record {doc} of {self.name}: column {self.column!r} holds "
                f"{type(value).__name__} that is not a list of token ids ({e})"
            ) from None
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise CorruptDataError(
                f"record {doc} of {self.name}: column {self.column!r} holds "
                f"{type(value).__name__} of shape {arr.shape} and dtype {arr.dtype}, "
                "not a list of token ids (pass tokenizer= for text)"
            )
        self._check_range(arr, np.array([doc]))
        return arr

    def lengths(self, num_workers: int | None, progress: bool) -> Iterator[np.ndarray]:
        """Every document's token count, a chunk at a time, in document order."""
        if self.length_parquet is not None:
            counts = self.length_column is not None
            yield from _parquet_lengths(self.length_parquet, counts, num_workers, progress)
            return
        chunks = _LengthChunks(self, len(self.ds))
        if num_workers is None:
            num_workers = min(os.cpu_count() or 1, 8) if len(chunks) >= 16 else 0
        loader = torch.utils.data.DataLoader(
            chunks, batch_size=None, num_workers=num_workers, collate_fn=as_is
        )
        yield from _progress(loader, len(chunks), progress, f"document lengths of {self.name}")


def _describe(source: Any) -> str:
    """A short name of the dataset for messages: a Source's repr, else its type and size."""
    if isinstance(source, Source):
        return reprlib.repr(source) if len(repr(source)) > 300 else repr(source)
    return f"a {type(source).__name__} of {len(source)} records"


class _LengthChunks(torch.utils.data.Dataset):
    """Chunk ``k``: the token counts of documents ``[k * _CHUNK, (k + 1) * _CHUNK)``."""

    def __init__(self, docs: _Documents, n: int) -> None:
        self.docs, self.n = docs, n

    def __len__(self) -> int:
        return -(-self.n // _CHUNK)

    def __getitem__(self, k: int) -> np.ndarray:
        ids = np.arange(k * _CHUNK, min(self.n, (k + 1) * _CHUNK), dtype=np.int64)
        docs = self.docs
        name = docs.length_column
        if name is None:
            return np.array([len(t) for t in docs.read(ids)], dtype=np.int64)
        if docs.columns is not None:
            values = list(docs.columns.read_columns(ids)[name])
        else:
            values = [r[name] for r in docs.ds.__getitems__(ids.tolist())]
        for j, (v, d) in enumerate(zip(values, ids.tolist())):
            # A scalar as msgpack records hold it, or as a tf.train.Example does (a list
            # of one): checked against the tokens at every read.
            if isinstance(v, np.ndarray) and v.shape in ((), (1,)):
                values[j] = v = v.reshape(())[()]
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < 2**63:
                raise CorruptDataError(
                    f"record {d} of {docs.name}: its token count {name!r} is {v!r}, not an int "
                    "in [0, 2**63)"
                )
        return np.array(values, dtype=np.int64)


def _progress(it: Any, total: int, progress: bool, what: str) -> Any:
    if not progress or total < 16:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, total=total, desc=what[:60], unit="chunk")


def _is_parquet(source: Any) -> bool:
    from torchgrain.sources.parquet.source import ParquetSource

    return isinstance(source, ParquetSource)


def count_column(ds: Dataset, column: str) -> str | None:
    """The column ``windows(lengths="auto")`` takes the token counts of ``column`` from:
    ``num_<column>`` (what ``torchgrain convert --tokenize`` writes beside the tokens) when
    the records have it, in Parquet only as an integer column of every file (a file
    without it would read no count; a list column, as a tf.Example's num_tokens
    converts, counts no tokens); else None (the tokens are measured).

    Example:
        >>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq, torchgrain as tg
        >>> d = tempfile.mkdtemp()
        >>> pq.write_table(pa.table({"t": [[1, 2]], "num_t": [2]}), os.path.join(d, "a.parquet"))
        >>> pq.write_table(pa.table({"t": [[3]], "num_t": [[1]]}), os.path.join(d, "b.parquet"))
        >>> count_column(tg.Dataset(tg.ParquetSource(os.path.join(d, "a.parquet"))), "t")
        'num_t'
        >>> count_column(tg.Dataset(tg.ParquetSource(os.path.join(d, "b.parquet"))), "t") is None
        True
    """
    name, source = f"num_{column}", ds._source
    keys = source.keys or []
    if name not in keys:
        return None
    if not _is_parquet(source):
        return name
    import pyarrow as pa

    names = [f.name for f in source._file_fields]
    if name not in names:
        return name  # a partition key: its values are read and checked one by one
    pos = names.index(name)
    whole = pa.types.is_integer(source._file_fields[pos].type) and source._present[:, pos].all()
    return name if whole else None


def _narrowed_parquet(source: Source, column: str) -> Source:
    """A Parquet source reading ``column`` only (the same files and options), so that a
    window's read decodes no other column; other sources as they are."""
    if not _is_parquet(source) or source.keys == [column]:
        return source
    if column not in [f.name for f in source._file_fields]:
        return source  # a partition key, or absent: read through the source as it is
    from torchgrain.sources.parquet.source import ParquetSource

    narrowed = ParquetSource(
        source.paths,
        columns=[column],
        options=source.options,
        decoded_cache=source.decoded_cache if source.decoded_cache is not None else False,
        partitioning=None,
        max_row_group_bytes=source.max_row_group_bytes,
    )
    if len(narrowed) != len(source):  # pragma: no cover - the files changed meanwhile
        raise CorruptDataError(f"{source!r} changed while opening its column {column!r}")
    return narrowed


def _parquet_lengths(
    source: Any, counts: bool, num_workers: int | None, progress: bool
) -> Iterator[np.ndarray]:
    """The token counts of the source's only column, a row group at a time (in threads:
    Arrow decodes without the GIL): with ``counts``, an integer column's values (token
    counts written beside the tokens), else a list column's lengths from its list
    offsets (a null list has length 0)."""
    column = source.keys[0]
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa
    import pyarrow.compute as pc

    from torchgrain.sources.parquet.schema import is_list_type

    typ = source.arrow_schema.field(0).type
    # (a list of ints taken for counts would count 1 per document, as a tf.Example's
    # num_tokens converted to Parquet; a list of lists or of strings has list offsets
    # too: either would build an index that fails only at the first read)
    if counts and not pa.types.is_integer(typ):
        raise TypeError(
            f"token count column {column!r} of {source!r} is {typ}, not an integer column "
            "(lengths=None measures the tokens)"
        )
    if not counts and not (is_list_type(typ) and pa.types.is_integer(typ.value_type)):
        raise TypeError(
            f"column {column!r} of {source!r} is {typ}, not a list of token ids (pass "
            "tokenizer= for a text column)"
        )
    offsets = source._rg_offsets

    def lengths_of(g: int) -> np.ndarray:
        first = int(offsets[g])
        if int(offsets[g + 1]) == first:
            return np.zeros(0, np.int64)
        col = source._decode(g, first).column(0)
        if counts:
            values = col.to_numpy().astype(np.int64) if col.null_count == 0 else None
            if values is None or (values < 0).any():
                where = int(source._rg_local[g])
                path = source.paths[int(source._rg_shard[g])]
                raise CorruptDataError(
                    f"row group {where} of {path!r}: token count column {column!r} holds "
                    "nulls or negative values"
                )
            return values
        return pc.list_value_length(col).fill_null(0).to_numpy().astype(np.int64)

    groups = range(source.num_row_groups)
    workers = num_workers or min(os.cpu_count() or 1, 8)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        it = pool.map(lengths_of, groups)
        yield from _progress(it, len(groups), progress, f"document lengths of {source!r}")


def _tokenize(tokenizer: Any, texts: list[Any], docs: _Documents, ids: np.ndarray) -> list[Any]:
    strings = []
    for t, d in zip(texts, ids.tolist()):
        if not isinstance(t, (str, bytes)):
            raise CorruptDataError(
                f"record {d} of {docs.name}: column {docs.column!r} holds "
                f"{type(t).__name__}, not text for the tokenizer"
            )
        try:  # (bytes: text as TFRecord, ArrayRecord or binary columns hold it)
            strings.append(t if isinstance(t, str) else t.decode())
        except UnicodeDecodeError as e:
            raise CorruptDataError(
                f"record {d} of {docs.name}: column {docs.column!r} is not UTF-8 text ({e})"
            ) from None
    return tokenize_batch(tokenizer, strings)


# ----------------------------------------------------------------------- the indexes
def _check_offsets(ix: DerivedIndex, documents: int, special: int) -> str | None:
    """Why the document index ``ix`` does not fit: its prefix sums must start at 0,
    grow by at least ``special`` tokens per document and end at its ``tokens``."""
    off = ix.arrays["offsets"]
    if len(off) != documents + 1:
        return f"it has {len(off) - 1} documents, the dataset {documents}"
    if off[0] != 0 or int(off[-1]) != ix.meta.get("tokens"):
        return "its offsets do not run from 0 to its token count"
    step = 1 << 20
    for a in range(0, len(off) - 1, step):
        chunk = off[a : a + step + 1]
        # (compared before subtracting: a difference can wrap around int64)
        if (chunk[1:] < chunk[:-1]).any() or (np.diff(chunk) < special).any():
            return "its offsets are not increasing"
    return None


def _check_bins(ix: DerivedIndex, offsets: np.ndarray, seq_len: int, special: int) -> str | None:
    docs, bins = ix.arrays["docs"], ix.arrays["bins"]
    if len(bins) == 0 or bins[0] != 0 or bins[-1] != len(docs) or (np.diff(bins) <= 0).any():
        return "its window offsets do not cover its documents"
    n = len(offsets) - 1
    if len(docs) and (docs.min() < 0 or docs.max() >= n):
        return "it names documents the dataset does not have"
    if len(docs) and np.bincount(docs, minlength=n).max() > 1:
        return "it places a document twice"
    # Each document once, in range: all n of them (empty ones too: a window reads them
    # to check), or no windows and no tokens at all.
    if len(docs) != n and (len(bins) > 1 or offsets[-1] > 0):
        return "it leaves out documents"
    full = offsets[docs + 1] - offsets[docs]
    lens = np.minimum(full, seq_len)
    if len(docs) and (np.add.reduceat(lens, bins[:-1]) > seq_len).any():
        return f"a window holds more than {seq_len} tokens"
    if int(lens.sum()) != ix.meta.get("tokens"):
        return "its token count is wrong"
    if int(np.count_nonzero(full > seq_len)) != ix.meta.get("truncated"):
        return "its count of truncated documents is wrong"
    return None


def _best_fit(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents (indices into ``lengths``, each ``<= seq_len``; empty ones left out)
    grouped into windows by best-fit decreasing: longest first, each into the open
    window with the least room that fits it (a sorted list of the distinct free sizes:
    O(log seq_len) to find it; of windows with the same room, the one left with it
    last). Returns the documents in window order and the windows' offsets into them.

    Nothing is held per document but int64 arrays (the sorted order, each document's
    window and their grouping: 24-32 bytes a document at the peak): the lengths are
    taken a slice of the order at a time, and the open windows of each free size are a
    stack linked through one int64 per window.

    Example:
        >>> docs, bins = _best_fit(np.array([3, 5, 0, 2, 4]), 8)
        >>> [docs[a:b].tolist() for a, b in zip(bins[:-1], bins[1:])]
        [[1, 0], [4, 3]]
    """
    order = np.argsort(-lengths, kind="stable")
    order = order[: int(np.count_nonzero(lengths > 0))]  # the empty ones sort last
    which = np.empty(len(order), np.int64)
    sizes: list[int] = []  # distinct free sizes of open windows, sorted
    top: dict[int, int] = {}  # free size -> the window with it placed last
    below = array.array("q")  # window -> the window with its free size before it, or -1
    for a in range(0, len(order), _PACK_STEP):
        got = []
        for n in lengths[order[a : a + _PACK_STEP]].tolist():
            k = bisect.bisect_left(sizes, n)
            if k == len(sizes):
                b, room = len(below), seq_len
                below.append(-1)
            else:
                room = sizes[k]
                b = top[room]
                nxt = below[b]
                if nxt < 0:
                    del sizes[k], top[room]
                else:
                    top[room] = nxt
            got.append(b)
            left = room - n
            if left > 0:
                nxt = top.get(left, -1)
                if nxt < 0:
                    bisect.insort(sizes, left)
                below[b] = nxt
                top[left] = b
        which[a : a + len(got)] = got
    count = len(below)
    del below
    return _grouped(order, which, count, out=which)


def _grouped(docs: np.ndarray, which: np.ndarray, count: int, out: Any = None) -> Any:
    """``docs`` grouped by their window ``which`` (in order within a window), and the
    ``count + 1`` windows' offsets into them."""
    bins = np.zeros(count + 1, np.int64)
    np.cumsum(np.bincount(which, minlength=count), out=bins[1:])
    return np.take(docs, np.argsort(which, kind="stable"), out=out), bins


def _with_empty(
    docs: np.ndarray, bins: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_best_fit`'s windows with the empty documents added, in turn over the
    windows: they take no room, and a window reads them, so an index that says a
    document is empty is checked against its tokens (never left unread).

    Example:
        >>> lengths = np.array([3, 5, 0, 2, 4, 0])
        >>> docs, bins = _with_empty(*_best_fit(lengths, 8), lengths)
        >>> [docs[a:b].tolist() for a, b in zip(bins[:-1], bins[1:])]
        [[1, 0, 2], [4, 3, 5]]
    """
    empty = np.flatnonzero(lengths == 0)
    count = len(bins) - 1
    if not count or not len(empty):
        return docs, bins
    which = np.repeat(np.arange(count, dtype=np.int64), np.diff(bins))
    which = np.concatenate([which, np.arange(len(empty), dtype=np.int64) % count])
    return _grouped(np.concatenate([docs, empty]), which, count)


# ----------------------------------------------------------------------- the view
class TokenWindows(Composed):
    """The windows of :func:`windows` as a :class:`~torchgrain.Source` over a dataset of
    documents (see the module docstring for the two modes).

    Holds the dataset, the node-shared document index (:attr:`offsets`: int64 prefix
    sums of each document's length with its ``bos``/``eos``) and, in pack mode, the
    bins. A DataLoader worker maps the same index files; it pickles small.

    It offers ``block_offsets()`` in concat mode over a dataset with blocks, and
    ``read_ahead`` when the dataset has it
    (:class:`~torchgrain.protocols.DeclaresCapabilities`): a window's read is its
    documents' (:meth:`pass_plan`), one level of a composition's pass plan.
    """

    def __init__(
        self,
        docs: _Documents,
        index: DerivedIndex,
        seq_len: int,
        *,
        bos: int | None,
        eos: int | None,
        mode: str,
        pad_id: int,
        bins: DerivedIndex | None,
    ) -> None:
        self._docs = docs
        self._index = index
        self._bins = bins
        self.seq_len = seq_len
        self.bos, self.eos, self.mode, self.pad_id = bos, eos, mode, pad_id
        # (bins: pack mode's windows; None in concat mode)
        tokens = int(index.meta["tokens"])
        self._n = max(0, (tokens - 1) // seq_len) if bins is None else len(bins.arrays["bins"]) - 1
        self._check = ShardIndex([self._n])

    # -------------------------------------------------------------- what it holds
    @property
    def offsets(self) -> np.ndarray:
        """int64 prefix sums of the documents' lengths (with ``bos``/``eos``)."""
        return self._index.arrays["offsets"]

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        """Tokens of every document, ``bos``/``eos`` included."""
        return int(self._index.meta["tokens"])

    @property
    def packing_efficiency(self) -> float:
        """Share of the windows' ``seq_len * len(self)`` positions that hold a document's
        token (pack mode); in concat mode every position does (1.0)."""
        if self._bins is None or self._n == 0:
            return 1.0
        return int(self._bins.meta["tokens"]) / (self._n * self.seq_len)

    @property
    def truncated_documents(self) -> int:
        """Documents longer than ``seq_len``, truncated (pack mode; 0 in concat mode)."""
        return 0 if self._bins is None else int(self._bins.meta["truncated"])

    @property
    def index_paths(self) -> list[str | None]:
        """The index files mapped (None: kept in memory)."""
        return [ix.path for ix in (self._index, self._bins) if ix is not None]

    # ------------------------------------------------------------------ contract
    def __len__(self) -> int:
        return self._n

    @property
    def keys(self) -> list[str]:
        return list(_SCHEMA)

    @property
    def schema(self) -> dict[str, str]:
        return dict(_SCHEMA)

    def _documents_of(self, idx: np.ndarray) -> list[np.ndarray]:
        """The documents each window in ``idx`` touches, in stream order; in concat mode
        with the empty ones among them and, for the last window, every document after it
        (read, so that each document's length in the index is checked against its
        tokens: none is left unread)."""
        # An index file written or truncated since it was mapped is refused
        # (ChangedWhileOpen, naming it): a page past a truncated end is a SIGBUS.
        self._index.check_unchanged()
        if self._bins is not None:
            self._bins.check_unchanged()
            docs, bins = self._bins.arrays["docs"], self._bins.arrays["bins"]
            return [docs[bins[i] : bins[i + 1]] for i in idx.tolist()]
        off = self.offsets
        L = self.seq_len
        starts = idx * L
        first = off.searchsorted(starts, side="right") - 1
        first[starts == 0] = 0  # (empty documents before the first token: window 0's)
        last = off.searchsorted(starts + L + 1, side="left")
        last[idx == self._n - 1] = len(off) - 1  # (the tail: fewer than L + 1 tokens)
        return [np.arange(a, b, dtype=np.int64) for a, b in zip(first.tolist(), last.tolist())]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        idx = self._check.check(indices)
        per_window = self._documents_of(idx)
        if not per_window:
            return []
        # One batched read for the whole batch: each document once.
        wanted = np.unique(np.concatenate(per_window))
        tokens = dict(zip(wanted.tolist(), self._read(wanted)))
        build = self._concat_window if self.mode == "concat" else self._packed_window
        return [build(i, d, tokens) for i, d in zip(idx.tolist(), per_window)]

    def _read(self, wanted: np.ndarray) -> list[np.ndarray]:
        """The tokens of documents ``wanted``, each checked against its length in the index."""
        read = self._docs.read(wanted)
        special = (self.bos is not None) + (self.eos is not None)
        expect = self.offsets[wanted + 1] - self.offsets[wanted] - special
        got = np.fromiter(map(len, read), np.int64, len(read))
        if (got != expect).any():
            k = int(np.flatnonzero(got != expect)[0])
            raise CorruptDataError(
                f"document {int(wanted[k])} of {self._docs.name}: column "
                f"{self._docs.column!r} has {int(got[k])} tokens, its window index "
                f"({self._index.path or 'in memory'}) says {int(expect[k])}: the data "
                "changed since the index was built, or a transform before the windows (a "
                "random_map, say) changes token counts from epoch to epoch, which cannot "
                "be under windows: apply it to the windows instead; or such a transform's "
                "code changed in what it calls (a helper, a global), which the index's key "
                "does not see: delete the index file, or pass another index_dir or a new "
                "name="
            )
        return read

    def _augmented(self, t: np.ndarray, lo: int, hi: int, out: np.ndarray) -> None:
        """Tokens ``[lo, hi)`` of ``[bos] + t + [eos]`` into ``out``."""
        nb = self.bos is not None
        if nb and lo == 0 < hi:  # (hi 0: a document after the last window's tokens)
            out[0] = self.bos
        tl, th = max(lo - nb, 0), min(hi - nb, len(t))
        if th > tl:
            out[tl + nb - lo : th + nb - lo] = t[tl:th]
        if self.eos is not None and hi == len(t) + nb + 1:
            out[hi - lo - 1] = self.eos

    def _concat_window(
        self, i: int, docs: np.ndarray, tokens: dict[int, np.ndarray]
    ) -> dict[str, Any]:
        L = self.seq_len
        s = i * L
        off = self.offsets
        first = off[docs]
        lo = np.maximum(first, s)
        counts = np.maximum(np.minimum(off[docs + 1], s + L + 1) - lo, 0)
        # Each position's place in its document, and its document (vectorised).
        pos = np.arange(s, s + L + 1, dtype=np.int64) - np.repeat(first, counts)
        ids = np.repeat(docs, counts)
        buf = np.empty(L + 1, np.int64)
        at = 0
        plain = self.bos is None and self.eos is None
        for d, a, n in zip(docs.tolist(), (lo - first).tolist(), counts.tolist()):
            if plain:
                buf[at : at + n] = tokens[d][a : a + n]
            else:
                self._augmented(tokens[d], a, a + n, buf[at : at + n])
            at += n
        starts = np.flatnonzero(pos[:L] == 0)
        head = [] if len(starts) and starts[0] == 0 else [0]
        cu = np.concatenate([head, starts, [L]]).astype(np.int32)
        return {
            "input_ids": buf[:L],
            "labels": buf[1:].copy(),  # not a view of input_ids: a map may edit those
            "position_ids": pos[:L],
            "cu_seqlens": cu,
            "document_ids": ids[:L],
        }

    def _packed_window(
        self, i: int, docs: np.ndarray, tokens: dict[int, np.ndarray]
    ) -> dict[str, Any]:
        L = self.seq_len
        off = self.offsets
        inputs = np.full(L, self.pad_id, np.int64)
        labels = np.full(L, IGNORE, np.int64)
        pos = np.zeros(L, np.int64)
        ids = np.full(L, -1, np.int64)
        cu = [0]
        at = 0
        for d in docs.tolist():
            n = min(int(off[d + 1] - off[d]), L)
            if not n:  # an empty document: read to check it, nothing to place
                continue
            self._augmented(tokens[d], 0, n, inputs[at : at + n])
            labels[at : at + n - 1] = inputs[at + 1 : at + n]
            pos[at : at + n] = np.arange(n)
            ids[at : at + n] = d
            at += n
            cu.append(at)
        if at < L:  # the padding: a segment of its own, predicting nothing
            pos[at:] = np.arange(L - at)
            cu.append(L)
        return {
            "input_ids": inputs,
            "labels": labels,
            "position_ids": pos,
            "cu_seqlens": np.array(cu, np.int32),
            "document_ids": ids,
        }

    # ------------------------------------------------------------- capabilities
    def offers(self, capability: type) -> bool:
        pack = capability is HasBlockOffsets and self.mode != "concat"
        return not pack and isinstance(self._docs.ds, capability)

    def block_offsets(self) -> np.ndarray:
        """Concat mode: the windows where the dataset's blocks (row groups, shards) start,
        so :class:`~torchgrain.BlockShuffleSampler` keeps its reads in a few blocks.
        Pack mode: ``TypeError`` (a window's documents come from anywhere)."""
        if self.mode != "concat":
            raise TypeError(
                f"token windows in {self.mode} mode have no block boundaries (give "
                "BlockShuffleSampler block_offsets=)"
            )
        blocks = np.asarray(self._docs.ds.block_offsets(), np.int64)
        starts = np.minimum(self.offsets[blocks] // self.seq_len, self._n)
        return np.unique(np.concatenate([[0], starts, [self._n]]))

    @property
    def children(self) -> tuple[Dataset]:
        """The dataset of documents (what ``set_epoch`` and ``read_ahead`` reach)."""
        return (self._docs.ds,)

    def pass_plan(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The documents the windows at ``indices`` read (their tokens and each one's
        last label), in the windows' order, each once."""
        per = self._documents_of(self._check.check(indices))
        docs = np.concatenate([np.zeros(0, np.int64), *per])
        rows = np.repeat(np.arange(len(per)), [len(d) for d in per])
        keep = np.sort(np.unique(docs, return_index=True)[1])
        return rows[keep], np.zeros(len(keep), np.int64), docs[keep]

    def identity(self) -> Any:
        """The documents' column, the digests of the document index and the bins, the
        mode, the window length, ``bos``, ``eos`` and (pack mode) ``pad_id``."""
        if self._bins is None:
            return (self._docs.column, self._index.digest, self.seq_len, self.bos, self.eos)
        return (
            self._docs.column,
            self._index.digest,
            self._bins.digest,
            self.seq_len,
            self.bos,
            self.eos,
            self.pad_id,
        )

    def fingerprint(self) -> str:
        """What the windows hold: the index's key, the mode and the window length."""
        bins = self._bins.meta["key"] if self._bins is not None else None
        return hash_parts(self._index.meta["key"], bins, self.mode, self.seq_len, self.pad_id)

    def __repr__(self) -> str:
        return (
            f"TokenWindows({self._docs.name}, column={self._docs.column!r}, "
            f"seq_len={self.seq_len}, mode={self.mode!r}, windows={self._n})"
        )


class WindowDataset(Dataset):
    """The :class:`~torchgrain.Dataset` :func:`windows` returns: a Dataset over a
    :class:`TokenWindows`, with its counts at hand."""

    @property
    def packing_efficiency(self) -> float:
        """See :attr:`TokenWindows.packing_efficiency`."""
        return self.source.packing_efficiency

    @property
    def truncated_documents(self) -> int:
        """See :attr:`TokenWindows.truncated_documents`."""
        return self.source.truncated_documents

    @property
    def num_tokens(self) -> int:
        """See :attr:`TokenWindows.num_tokens`."""
        return self.source.num_tokens


_INT64_MAX = np.uint64(np.iinfo(np.int64).max)
_CU_LIMIT = 2**31  # cu_seqlens are int32, as variable-length attention kernels take them


def collate_windows(batch: Sequence[dict[str, Any]] | Sequence[ColumnBatch]) -> dict[str, Any]:
    """A DataLoader ``collate_fn`` for windows: ``input_ids``, ``labels``,
    ``position_ids`` and ``document_ids`` stacked into ``[B, seq_len]`` int64 tensors,
    and the batch as variable-length attention kernels take it flattened to ``B *
    seq_len`` tokens: ``cu_seqlens`` (int32, every window's boundaries shifted to its
    place, from 0 to ``B * seq_len``) and ``max_seqlen`` (an int). Other fields (a
    ``map``'s loss mask) go through torch's default collate. Takes window records, or
    the ``[ColumnBatch]`` a DataLoader passes for a ``batch_format="columns"`` dataset.
    Picklable.

    Example:
        >>> import numpy as np
        >>> w = Dataset([{"t": np.arange(5)}, {"t": np.arange(4)}]).windows("t", 4, index_dir=None)
        >>> b = collate_windows([w[0], w[1]])
        >>> b["input_ids"].shape, b["cu_seqlens"].tolist(), b["max_seqlen"]
        (torch.Size([2, 4]), [0, 4, 5, 8], 4)
    """
    if len(batch) == 1 and isinstance(batch[0], ColumnBatch):  # (a columns dataset's)
        batch = batch[0].records()
    if not batch:
        raise ValueError("collate_windows needs at least one window")
    L = len(batch[0]["input_ids"])
    if len(batch) * L >= _CU_LIMIT:
        raise ValueError(
            f"a batch of {len(batch)} windows of {L} tokens holds 2**31 tokens or more, "
            "past what its int32 cu_seqlens can count: use smaller batches"
        )
    out: dict[str, Any] = {
        k: torch.from_numpy(np.stack([r[k] for r in batch]))
        for k in ("input_ids", "labels", "position_ids", "document_ids")
    }
    parts = [np.asarray(r["cu_seqlens"][:-1], np.int64) + b * L for b, r in enumerate(batch)]
    cu = np.concatenate([*parts, [len(batch) * L]]).astype(np.int32)
    out["cu_seqlens"] = torch.from_numpy(cu)
    out["max_seqlen"] = int(np.diff(cu).max())
    extra = [k for k in batch[0] if k not in _SCHEMA]
    if extra:
        out.update(torch.utils.data.default_collate([{k: r[k] for k in extra} for r in batch]))
    return out


def _token_id(name: str, value: Any, low: int = 0) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a token id (an int) or None, got {value!r}")
    # Checked here: it is written into int64 windows when they are read (in workers).
    if not low <= value < 2**63:
        lo = "0" if low == 0 else "-2**63"
        raise ValueError(f"{name} must be a token id in [{lo}, 2**63), got {value!r}")
    return int(value)


def windows(
    ds: Any,
    column: str,
    seq_len: int,
    *,
    eos: int | None = None,
    bos: int | None = None,
    mode: str = "concat",
    pad_id: int = 0,
    tokenizer: Callable[[list[str]], Any] | None = None,
    lengths: str | None = "auto",
    index_dir: str | os.PathLike | None = DEFAULT,
    num_workers: int | None = None,
    progress: bool = True,
    name: str | None = None,
) -> WindowDataset:
    """Fixed-length token windows over the documents of ``column`` (``Dataset.windows``).

    See :mod:`torchgrain.tokens.windows` for the two modes. Each item is a dict of int64
    arrays ``input_ids``, ``labels`` and ``position_ids`` (restarting at 0 at each
    document's start; in pack mode the padding counts from 0 too) and ``document_ids``
    (each token's document index; -1 on padding), all ``seq_len`` long, and
    ``cu_seqlens``: the int32 boundaries of the documents inside the window, from 0 to
    ``seq_len`` (what variable-length attention kernels take; its length varies, so
    batch windows with :func:`collate_windows`, which joins them: padded by
    ``pad_collate``, the boundaries would step back to 0).

    Args:
        ds: the documents: a :class:`~torchgrain.Dataset`, a Source, or anything
            ``Dataset`` accepts. Its transforms apply before ``column`` is read.
        column: the record key holding each document's token ids (a list or 1-D
            integer array; a null list in Parquet, or None in memory or ArrayRecord
            records, counts as an empty document: its ``bos``/``eos`` only), or its text
            when ``tokenizer`` is given.
        seq_len: tokens per window.
        eos, bos: token ids added after / before every document (None: none).
        mode: ``"concat"`` (windows across documents) or ``"pack"`` (whole documents
            packed into padded windows).
        pad_id: the padding token of pack mode.
        tokenizer: a callable on a list of strings returning a list of token-id lists (a
            fast HF ``tokenizers.Tokenizer`` works too), applied to ``column``'s text in
            the process that reads it (DataLoader workers).
        lengths: the record key holding each document's token count, read to build
            the index instead of the tokens (an int column of Parquet: no token
            decoded); ``"auto"`` (default) uses ``num_<column>`` (``num_tokens`` for
            ``tokens``), what ``torchgrain convert --tokenize`` writes, when the records
            have it (in Parquet, as an integer column of every file) and no tokenizer or
            transform is given; None measures the tokens. A count that disagrees with
            the tokens is found when the document is read
            (:class:`~torchgrain.CorruptDataError`), and a count of 0 with no
            ``bos``/``eos`` when the index is built (those documents' tokens are read
            then: no pack-mode window reads them).
        index_dir: where the node-shared index files live (default: the torchgrain
            cache's ``windows-index``; this process's memory when records held in
            memory are among the documents' sources, which nothing on disk tells apart
            from others of their length); None keeps them in this process's memory.
        num_workers: processes of the pass that measures document lengths (default: up
            to 8 for large datasets, none for small ones).
        progress: show a progress bar during that pass.
        name: a word the index's key adds to the documents' fingerprint (their files
            and the code of their transforms and ``tokenizer``). That fingerprint does
            not see what such code calls (a helper, a global, a vocabulary file): name
            that state here and change the name when it changes, as a filter's ``name``.

    Example:
        >>> import numpy as np, tempfile, torchgrain as tg
        >>> docs = [{"tokens": np.arange(n)} for n in (3, 0, 5)]
        >>> w = tg.Dataset(docs).windows("tokens", 4, eos=99, index_dir=tempfile.mkdtemp())
        >>> len(w), w[0]["input_ids"].tolist(), w[0]["labels"].tolist()
        (2, [0, 1, 2, 99], [1, 2, 99, 99])
        >>> w[1]["input_ids"].tolist(), w[1]["position_ids"].tolist(), w[1]["cu_seqlens"].tolist()
        ([99, 0, 1, 2], [0, 0, 1, 2], [0, 1, 4])
        >>> p = tg.Dataset(docs).windows("tokens", 6, mode="pack", index_dir=None)
        >>> p[0]["input_ids"].tolist(), p[0]["labels"].tolist()
        ([0, 1, 2, 3, 4, 0], [1, 2, 3, 4, -100, -100])
    """
    ds = ds if isinstance(ds, Dataset) else Dataset(ds)
    mixture = changes_with_epoch(ds, transforms=False)
    if mixture is not None:  # its documents' lengths are indexed once, at one epoch
        raise TypeError(
            f"token windows need documents that stay the same from epoch to epoch; "
            f"{mixture} reads other records each epoch: make the windows of each dataset, "
            "then mix them (tg.mix([a.windows(...), b.windows(...)], weights))"
        )
    if not isinstance(column, str):
        raise TypeError(f"column must be a record key (a str), got {column!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    if seq_len >= _CU_LIMIT:  # a window's cu_seqlens are int32
        raise ValueError(f"seq_len must be below 2**31, got {seq_len}")
    seq_len = int(seq_len)
    if mode not in ("concat", "pack"):
        raise ValueError(f"mode must be 'concat' or 'pack', got {mode!r}")
    bos, eos = _token_id("bos", bos), _token_id("eos", eos)
    pad_id = int(_token_id("pad_id", pad_id, low=-(2**63)))  # type: ignore[arg-type]
    if tokenizer is not None and not callable(tokenizer) and not hasattr(tokenizer, "encode_batch"):
        raise TypeError("tokenizer must be callable on a list of strings")
    if lengths == "auto":
        # What `torchgrain convert --tokenize` writes beside the tokens.
        # (num_<column>, as convert --tokenize --tokens-column and inspect name it: a
        # num_tokens beside another column may count something else)
        auto = tokenizer is None and not ds._ops
        lengths = count_column(ds, column) if auto else None
    if lengths is not None and not isinstance(lengths, str):
        raise TypeError(f"lengths must be a record key (a str) or None, got {lengths!r}")
    if index_dir is DEFAULT and not identified(ds):
        # Records held in memory are fingerprinted by their type and length alone: two
        # lists of one length would share one cached index (and fail as changed data).
        index_dir = None
    docs = _Documents(ds, column, tokenizer, lengths)
    special = (bos is not None) + (eos is not None)
    n = len(ds)
    tokenized = callable_fingerprint(tokenizer) if tokenizer is not None else None
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    key = hash_parts("documents", dataset_fingerprint(ds), column, bos, eos, tokenized, lengths)
    if name is not None:  # (None: the key of earlier releases, their index files found)
        key = hash_parts(key, "named", name)

    # Documents a count column says are empty, with no bos/eos: no window reads them in
    # pack mode, so their tokens are checked here, once per machine (lost unread else).
    empty: list[np.ndarray] | None = [] if lengths is not None and not special else None

    def fill(sink: Any) -> dict[str, Any]:
        sink.append("offsets", np.zeros(1, np.int64))
        total, seen = 0, 0
        for lens in docs.lengths(num_workers, progress):
            lens = np.asarray(lens, np.int64) + special
            if empty is not None:
                empty.append(np.flatnonzero(lens == 0) + seen)
            seen += len(lens)
            part = np.cumsum(lens) + total
            if not len(part):
                continue
            # int64 wraps silently: a sum past 2**63 - 1 shows as a step down (each count
            # is below 2**63), which would leave a wrong (often empty) set of windows.
            if lens.min() < special or part[0] < total or (part[1:] < part[:-1]).any():
                raise CorruptDataError(
                    f"the token counts of {docs.name} add up past 2**63 - 1 (documents up to "
                    f"{seen}): not token counts"
                )
            total = int(part[-1])
            sink.append("offsets", part)
        if seen != n:
            raise CorruptDataError(f"{docs.name} gave {seen} document lengths for {n} records")
        unread = np.concatenate([np.zeros(0, np.int64), *(empty or ())])
        for a in range(0, len(unread), 4096):
            some = unread[a : a + 4096]
            got = [len(t) for t in docs.read(some)]
            if any(got):
                k = next(k for k, g in enumerate(got) if g)
                raise CorruptDataError(
                    f"document {int(some[k])} of {docs.name}: column {lengths!r} says it has "
                    f"0 tokens, column {column!r} has {got[k]}: not its token count"
                )
        return {"documents": n, "tokens": total}

    def built(what: str, key: str, names: list[str], fill: Any, check: Any, *args: Any) -> Any:
        """The index of arrays ``names`` (int64), never served when ``check(ix, *args)``
        finds it wrong (a file is checked when opened; one built here, after)."""

        def fits(ix: DerivedIndex) -> str | None:
            return check(ix, *args)

        columns = dict.fromkeys(names, ("<i8", ()))
        ix = derived_index(_KIND, key, columns, fill, index_dir=index_dir, fits=fits)
        why = fits(ix)
        if why is not None:
            raise CorruptDataError(f"token-window {what} {ix.path or '(in memory)'}: {why}")
        return ix

    index = built("index", key, ["offsets"], fill, _check_offsets, n, special)
    bins = None
    if mode == "pack":
        offsets = index.arrays["offsets"]

        def fill_bins(sink: Any) -> dict[str, Any]:
            lens = np.diff(offsets)
            truncated = int(np.count_nonzero(lens > seq_len))
            np.minimum(lens, seq_len, out=lens)
            order, starts = _with_empty(*_best_fit(lens, seq_len), lens)
            sink.append("docs", order)
            sink.append("bins", starts)
            return {"tokens": int(lens.sum()), "truncated": truncated}

        key = hash_parts("pack", index.meta["key"], seq_len)
        bins = built(
            "bins", key, ["docs", "bins"], fill_bins, _check_bins, offsets, seq_len, special
        )
        if bins.meta["truncated"]:
            warnings.warn(
                f"{bins.meta['truncated']} documents of {docs.name} are longer than "
                f"seq_len={seq_len}: packed truncated to their first {seq_len} tokens",
                stacklevel=3,
            )
    view = TokenWindows(docs, index, seq_len, bos=bos, eos=eos, mode=mode, pad_id=pad_id, bins=bins)
    if not len(view):  # no window reads the documents (fewer than seq_len + 1 tokens)
        for a in range(0, n, _CHUNK):
            view._read(np.arange(a, min(n, a + _CHUNK)))
    return WindowDataset(view, batch_format=ds.batch_format)
