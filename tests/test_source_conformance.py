"""The Source contract, checked for every registered format.

Each format in ``torchgrain.sources.registry`` that can write test data runs the same
checks: random access against a sequential read of the same files, batched order and
duplicates, bad indices, a read in the parent before forked and spawned DataLoader
workers, small pickles, reading over HTTP through fsspec, truncated and missing files,
and both samplers over it. A new format gets all of them by registering itself.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import torchgrain as tg
from docs.snippets.fixed_format import FIXED
from tests.servers import RangeHTTPServer
from torchgrain.sources import registry
from torchgrain.sources.registry import detect_format, formats

N = 53
SHARDS = 3
# The registered formats, and the example format of docs/sources.md (a FormatSource).
FORMATS = [*sorted(name for name, fmt in formats().items() if fmt.write is not None), FIXED.name]
# The value types a schema may name (see tg.Source).
_TYPE = re.compile(
    r"^(null|bool|int|float|str|bytes|map|time|Decimal|list(\[[^\]]*\])?|"
    r"(\w+(\[\w+\])?)(\[[0-9?,.]*\])?)(\|.+)?$"
)


def make_records(n: int = N) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        payload = rng.integers(0, 256, 1 + i % 17, dtype=np.uint8).tobytes()
        if i % 5 == 0:
            payload += b"\x00\x00"  # payloads that end in zero bytes must survive
        out.append({"id": i, "payload": payload, "vec": np.full(3, i / 2, np.float32)})
    return out


def ident(rec: dict) -> int:
    """The record's id, whatever container the format hands it out in."""
    return int(np.asarray(rec["id"]).ravel()[0])


def payload(rec: dict) -> bytes:
    """The record's payload bytes (a bare value, or a one-element list or array)."""
    value = rec["payload"]
    if not isinstance(value, bytes):
        value = np.asarray(value, dtype=object).ravel()[0]
    return bytes(value)


def as_list(batch):
    return batch  # picklable (spawned workers), unlike a lambda


def normalize(value):
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [normalize(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    # Derived data (TFRecord offset indexes) goes to this test's own cache directory.
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(params=FORMATS)
def dataset(request, tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "_FORMATS", dict(registry._FORMATS))
    registry.register_format(FIXED)  # for this test only
    fmt = formats()[request.param]
    root = tmp_path / f"ds-{fmt.name}"
    fmt.write(make_records(), str(root), num_shards=SHARDS)
    return fmt, str(root)


def sequential(src: tg.Source) -> list[dict]:
    """The ground truth: every shard read in order, without random access."""
    out = []
    for shard in range(src.num_shards):
        out.extend(src.iter_shard(shard))
    return out


def test_every_builtin_format_is_checked():
    assert {"array_record", "parquet", "tfrecord"} <= set(FORMATS)


def test_contract(dataset):
    fmt, root = dataset
    src = tg.open(root)
    assert type(src) is fmt.source and detect_format(root) == fmt.name
    assert isinstance(src, tg.Source)
    assert len(src) == N and src.num_shards == SHARDS
    assert len(src.paths) == SHARDS and int(src.shard_counts.sum()) == N
    assert src.keys == list(src.schema) and set(src.keys) == {"id", "payload", "vec"}
    for key, name in src.schema.items():
        assert _TYPE.match(name), f"{fmt.name}: schema[{key!r}] = {name!r}"
    blocks = src.block_offsets()
    assert blocks[0] == 0 and blocks[-1] == N and (np.diff(blocks) >= 0).all()
    assert type(src).__name__ in repr(src) and str(N) in repr(src)


def test_random_access_matches_sequential_read(dataset):
    _, root = dataset
    src = tg.open(root)
    truth = sequential(src)
    assert [ident(r) for r in truth] == list(range(N))
    assert [payload(r) for r in truth] == [rec["payload"] for rec in make_records()]
    for i in (0, 1, N // 2, N - 1):
        assert normalize(src[i]) == normalize(truth[i])
    order = np.random.default_rng(1).permutation(N).tolist()
    request = [*order, order[0], order[-1], order[0]]  # duplicates too
    got = src.__getitems__(request)
    assert [normalize(r) for r in got] == [normalize(truth[i]) for i in request]
    assert src.__getitems__([]) == []
    assert [normalize(r) for r in src.__getitems__(np.array([3, 2], np.int64))] == [
        normalize(truth[3]),
        normalize(truth[2]),
    ]


def test_bad_indices(dataset):
    _, root = dataset
    src = tg.open(root)
    for bad in (-1, N, 2**70):
        with pytest.raises(IndexError):
            src[bad]
        with pytest.raises(IndexError):
            src.__getitems__([0, bad])
    for bad in (1.5, "a", True, None):
        with pytest.raises(TypeError):
            src.__getitems__([bad])


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_after_a_read_in_the_parent(dataset, context):
    _, root = dataset
    src = tg.open(root)
    truth = [normalize(r) for r in sequential(src)]
    assert normalize(src[0]) == truth[0]  # what users do before building the loader
    ds = tg.Dataset(src)
    sampler = tg.GlobalShuffleSampler(ds, seed=3, num_replicas=1, rank=0)
    loader = DataLoader(
        ds,
        batch_size=8,
        sampler=sampler,
        num_workers=2,
        multiprocessing_context=context,
        collate_fn=as_list,
    )
    got = [r for batch in loader for r in batch]
    assert [ident(r) for r in got] == sampler.indices().tolist()
    assert all(normalize(r) == truth[ident(r)] for r in got)


def test_pickles_small_and_reads_after(dataset):
    _, root = dataset
    src = tg.open(root)
    truth = [normalize(r) for r in sequential(src)]
    src.__getitems__(list(range(N)))  # readers open, caches warm
    data = pickle.dumps(src)
    assert len(data) < 16_384 + 16 * N, f"{len(data)} bytes"
    copy = pickle.loads(data)
    assert [normalize(r) for r in copy.__getitems__(list(range(N)))] == truth
    copy.close()
    src.close()
    assert normalize(src[N - 1]) == truth[N - 1]  # closed readers reopen


def test_reads_over_http_through_fsspec(dataset, tmp_path):
    fmt, root = dataset
    truth = [normalize(r) for r in sequential(tg.open(root))]
    with RangeHTTPServer(os.path.dirname(root)) as srv:
        url = f"{srv.url}/{os.path.basename(root)}"
        src = fmt.source(url)
        assert len(src) == N and all(p.startswith("http") for p in src.paths)
        order = np.random.default_rng(2).permutation(N).tolist()
        assert [normalize(r) for r in src.__getitems__(order)] == [truth[i] for i in order]
        assert src.io_stats["remote_reads"] >= 1
        assert normalize(pickle.loads(pickle.dumps(src))[5]) == truth[5]


def test_missing_and_truncated_files_name_the_file(dataset, tmp_path):
    fmt, root = dataset
    with pytest.raises(tg.DatasetNotFoundError):
        fmt.source(os.path.join(root, "no-such-dir"))
    broken = str(tmp_path / "broken")
    shutil.copytree(root, broken)
    victim = sorted(tg.open(broken).paths)[-1]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    name = re.escape(os.path.basename(victim))
    with pytest.raises(tg.CorruptDataError, match=name):
        src = fmt.source(broken)
        src.__getitems__(list(range(len(src))))


@pytest.mark.parametrize("sampler", ["global", "block"])
def test_samplers_cover_the_source_once(dataset, sampler):
    _, root = dataset
    ds = tg.Dataset(tg.open(root))
    if sampler == "block":
        s = tg.BlockShuffleSampler(ds, window=2, seed=1, num_replicas=1, rank=0)
    else:
        s = tg.GlobalShuffleSampler(ds, seed=1, num_replicas=1, rank=0)
    loader = DataLoader(ds, batch_size=7, sampler=s, collate_fn=as_list)
    ids = [ident(r) for batch in loader for r in batch]
    assert sorted(ids) == list(range(N)) and ids == s.indices().tolist()


def test_a_new_format_registers_once_and_is_found(tmp_path):
    from torchgrain.sources.registry import Format, get_format, register_format

    class Lines(tg.Source):
        def __init__(self, paths, **options):
            files = sorted(os.path.join(paths, f) for f in os.listdir(paths))
            self._lines = []
            for f in files:
                with open(f) as fh:
                    self._lines.extend(fh.read().splitlines())

        def __len__(self):
            return len(self._lines)

        def __getitems__(self, indices):
            idx = tg.ShardIndex([len(self)]).check(indices)
            return [{"line": self._lines[i]} for i in idx.tolist()]

        keys = property(lambda self: ["line"])
        schema = property(lambda self: {"line": "str"})

    (tmp_path / "a.lines").write_text("x\ny\n")
    register_format(Format("lines", Lines, (".lines",)))
    try:
        assert detect_format(str(tmp_path)) == "lines"
        src = tg.open(str(tmp_path))
        assert isinstance(src, Lines) and src[1] == {"line": "y"}
        loader = torch.utils.data.DataLoader(tg.Dataset(src), batch_size=2)
        assert list(loader) == [{"line": ["x", "y"]}]  # its records, through a DataLoader
        assert get_format("lines").source is Lines
    finally:
        from torchgrain.sources import registry

        registry._FORMATS.pop("lines", None)
