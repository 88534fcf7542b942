"""The public format contract (torchgrain/sources/format.py), through the example format of
docs/sources.md (docs/snippets/fixed_format.py, imported as it is): local and remote
reads under a global shuffle, a remote batch's byte ranges fetched across its shards at
once, the shard cache, forked workers, pickles, and hostile readers."""

from __future__ import annotations

import os
import pickle
import runpy

import numpy as np
import pytest
from torch.utils.data import DataLoader

import torchgrain as tg
from docs.snippets.fixed_format import FixedFormat, FixedReader, FixedSource, write_fixed
from tests.servers import RangeHTTPServer
from torchgrain.io.ranges import range_store
from torchgrain.sources import registry

N, SHARDS = 240, 8


def records(n: int = N) -> list[dict]:
    return [{"id": i, "x": np.full(1 + i % 5, i, np.int32), "s": "r" * (i % 7)} for i in range(n)]


def same(a: dict, b: dict) -> bool:
    return a["id"] == b["id"] and a["s"] == b["s"] and np.array_equal(a["x"], b["x"])


@pytest.fixture
def data(tmp_path):
    root = tmp_path / "data"
    write_fixed(records(), str(root), num_shards=SHARDS)
    return root


def shuffled(src: tg.Source, batch: int = 48) -> list[list[int]]:
    ds = tg.Dataset(src)
    order = tg.GlobalShuffleSampler(ds, seed=5, num_replicas=1, rank=0).indices().tolist()
    return [order[a : a + batch] for a in range(0, len(order), batch)]


def test_the_documented_example_runs_and_registers_in_one_call(monkeypatch, capsys):
    monkeypatch.setattr(registry, "_FORMATS", dict(registry._FORMATS))
    runpy.run_path("docs/snippets/fixed_format.py", run_name="__main__")
    assert "FixedSource(format='fixed', num_records=10, num_shards=2)" in capsys.readouterr().out
    assert registry.get_format("fixed").description == "fixed-width"


def test_local_reads_under_a_global_shuffle_are_the_records_written(data):
    src = FixedSource(str(data), io_threads=4)
    truth = records()
    assert len(src) == N and src.num_shards == SHARDS and src.keys == ["id", "x", "s"]
    for batch in shuffled(src):
        assert all(same(r, truth[i]) for r, i in zip(src.__getitems__(batch), batch, strict=True))
    assert [r["id"] for r in src.iter_shard(3)] == list(range(90, 120))


def test_a_remote_batch_is_fetched_across_its_shards_at_once(data):
    truth = records()
    with RangeHTTPServer(data.parent) as srv:
        src = FixedSource(f"{srv.url}/data", max_inflight=16)
        src.__getitems__(list(range(0, N, N // SHARDS)))  # each shard's reader open
        srv.latency_s = 0.05  # so that requests in flight together are seen together
        for batch in shuffled(src)[:3]:
            srv.reset_counts()
            assert len({i * SHARDS // N for i in batch}) == SHARDS  # every shard
            served = range_store().stats["served"]
            got = src.__getitems__(batch)
            # Fetched for the whole batch, then each shard's ranges taken from the store.
            assert range_store().stats["served"] - served == len(batch)
            assert all(same(r, truth[i]) for r, i in zip(got, batch, strict=True))
            assert srv.gets() <= SHARDS < len(batch)  # a request per shard at most
            assert srv.max_inflight >= 2  # the shards' requests in flight together
        assert pickle.loads(pickle.dumps(src))[7]["id"] == 7


def test_the_shard_cache_makes_later_passes_local(data, tmp_path):
    with RangeHTTPServer(data.parent) as srv:
        src = FixedSource(f"{srv.url}/data", cache_dir=str(tmp_path / "cache"))
        batches = shuffled(src)
        first = [r["id"] for b in batches for r in src.__getitems__(b)]
        assert src.io_stats["cache_misses"] == SHARDS  # each shard downloaded once
        srv.reset_counts()
        again = pickle.loads(pickle.dumps(src))  # another process, say: nothing open
        second = [r["id"] for b in batches for r in again.__getitems__(b)]
        assert first == second == [i for b in batches for i in b]
        assert srv.gets() == 0 and again.io_stats["cache_hits"] == SHARDS


def test_forked_workers_read_it_and_it_pickles_small(data):
    src = FixedSource(str(data))
    assert src[0]["id"] == 0  # a read in the parent before forking
    assert len(pickle.dumps(src)) < 4096
    ds = tg.Dataset(src)
    sampler = tg.GlobalShuffleSampler(ds, seed=1, num_replicas=1, rank=0)
    loader = DataLoader(
        ds,
        batch_size=16,
        sampler=sampler,
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=list,
    )
    assert [r["id"] for b in loader for r in b] == sampler.indices().tolist()


class Dropping(FixedReader):
    def decode(self, rows, chunks):
        return super().decode(rows, chunks)[:-1]  # one record short


class Outside(FixedReader):
    def byte_ranges(self, rows):
        return [(s, e + 10**6) for s, e in super().byte_ranges(rows)]


class Lying(FixedReader):
    def __len__(self):
        return 10**6  # more records than the file holds


@pytest.mark.parametrize("reader", [Dropping, Outside])
def test_a_hostile_reader_is_corrupt_data_naming_shard_and_index(data, monkeypatch, reader):
    monkeypatch.setattr("docs.snippets.fixed_format.FixedReader", reader)
    src = FixedSource(str(data))
    with pytest.raises(tg.CorruptDataError, match=r"fixed shard 2 .*data-00002-of-00008.*index 70"):
        src.__getitems__([70, 71])
    with RangeHTTPServer(data.parent) as srv:
        remote = FixedSource(f"{srv.url}/data")
        with pytest.raises(
            tg.CorruptDataError, match=r"shard (2|5) .*data-0000(2|5).*index (70|150)"
        ):
            remote.__getitems__([70, 150])


def test_a_shard_whose_count_changed_since_open_is_corrupt_data(data, monkeypatch):
    src = FixedSource(str(data))
    monkeypatch.setattr("docs.snippets.fixed_format.FixedReader", Lying)
    src.close()  # the readers opened to count are let go: the shard is opened again
    with pytest.raises(tg.CorruptDataError, match=r"fixed shard 1 .* counted 30.*record index 40"):
        src[40]


def test_a_format_without_byte_ranges_reads_a_remote_batchs_shards_concurrently(tmp_path):
    from tests.test_format_registry import NpySource, write_npy

    write_npy(({"array": np.full(3, i, np.int16)} for i in range(6)), str(tmp_path / "npy"))
    with RangeHTTPServer(tmp_path) as srv:
        src = NpySource(f"{srv.url}/npy", io_threads=4)
        srv.latency_s = 0.05
        got = src.__getitems__([5, 0, 3, 1])
        assert [int(r["array"][0]) for r in got] == [5, 0, 3, 1] and srv.max_inflight >= 2


class Floats(FixedReader):
    def byte_ranges(self, rows):
        ranges = super().byte_ranges(rows)
        return [(s + 0.5 if r % 2 else s, e) for r, (s, e) in zip(rows.tolist(), ranges)]


def test_byte_ranges_not_of_integers_or_over_the_ceiling_are_corrupt_data(data, monkeypatch):
    monkeypatch.setattr("docs.snippets.fixed_format.FixedReader", Floats)
    with pytest.raises(tg.CorruptDataError, match=r"is not a byte range.*shard 1 .*index 31"):
        FixedSource(str(data)).__getitems__([30, 31])  # (not truncated to [s, e))
    with tg.sources.ShardFile(0, FixedSource(str(data)).paths[0]) as f:
        assert len(f.read_ranges([(0, 8), (8, 16)], max_bytes=16)) == 2
        with pytest.raises(tg.CorruptDataError, match="more than the 15 allowed"):
            f.read_ranges([(0, 8), (8, 16)], max_bytes=15)


def test_opening_sizes_shards_from_the_listing_and_keeps_their_readers(data, monkeypatch):
    import fsspec

    from torchgrain.io import remote

    store = fsspec.filesystem("memory")
    for f in data.iterdir():
        store.pipe(f"/contract/{f.name}", f.read_bytes())
    asked, file_size = [], remote.file_size
    monkeypatch.setattr(remote, "file_size", lambda *a, **k: asked.append(a) or file_size(*a, **k))
    src = FixedSource("memory://contract", io_threads=4)
    assert isinstance(src.format, tg.sources.ShardFormat)  # (runtime-checkable)
    assert asked == [] and src.shard_integrity(3)[0] == store.size(src.paths[3])
    with RangeHTTPServer(data.parent) as srv:
        remote_src = FixedSource(f"{srv.url}/data", max_open_files=SHARDS)
        srv.reset_counts()
        batch = list(range(0, N, N // SHARDS))
        assert [r["id"] for r in remote_src.__getitems__(batch)] == batch
        assert srv.gets() == SHARDS  # the records' ranges only: no shard opened again


class EncodedReader(FixedReader):
    """The example's reader giving each record's bytes (its format has a codec)."""

    def decode(self, rows, chunks):
        lengths = [int.from_bytes(c[:4], "little") for c in chunks]
        if max(lengths, default=0) > self.width - 4:
            raise tg.CorruptDataError(f"{self.file.path!r}: a record overflows its slot")
        return [bytes(c[4 : 4 + n]) for c, n in zip(chunks, lengths)]


class EncodedFixed(FixedFormat):
    """The example format as an EncodedFormat (the source decodes the records' bytes) and
    ReadsBatches (a batch of more than one record read by the format at once)."""

    record_codec = tg.sources.get_codec("msgpack")

    def __init__(self) -> None:
        self.batches, self.closed = 0, 0

    def open(self, file):
        r = super().open(file)
        return EncodedReader(r.file, r.width, r.count)

    def read_batch(self, paths, shards, rows, indices):
        if len(rows) == 1:
            return None  # read through the readers
        self.batches += 1
        out = []
        for k, r in zip(shards.tolist(), rows.tolist()):
            with tg.sources.ShardFile(k, paths[k]) as f:
                out += self.open(f).read(np.array([r]))
        return out

    def read_one(self, paths, shard, row, index):
        if index % 2:
            return None  # a batch of one: through its shard's reader
        with tg.sources.ShardFile(shard, paths[shard]) as f:
            return self.open(f).read(np.array([row]))[0]

    def close(self) -> None:
        self.closed += 1


def test_an_encoded_format_that_reads_batches_is_decoded_and_named_by_the_source(data):
    fmt = EncodedFixed()
    assert isinstance(fmt, tg.sources.EncodedFormat) and isinstance(fmt, tg.sources.ReadsBatches)
    src = tg.FormatSource(str(data), format=fmt)
    truth = records()
    for batch in shuffled(src):
        assert all(same(r, truth[i]) for r, i in zip(src.__getitems__(batch), batch, strict=True))
        cols = src.read_columns(batch)  # msgpack's column form
        assert cols["id"].tolist() == batch
    assert same(src[77], truth[77]) and same(src[78], truth[78])
    assert src.format.batches == 2 * len(shuffled(src))
    src.close()
    assert src.format.closed == 1
    # A record that does not decode is named: its index, shard, file and row.
    path = str(data / "data-00002-of-00008.fixed")
    width = (os.path.getsize(path) - 16) // 30
    with open(path, "r+b") as f:
        f.seek(16 + 5 * width + 4)
        f.write(bytes([0xC1]))  # (msgpack's one unused byte)
    src = tg.FormatSource(str(data), format=EncodedFixed())
    with pytest.raises(
        tg.RecordDecodeError,
        match=r"cannot decode record 65 \(fixed shard 2 of 8 .*data-00002-of-00008\.fixed', row 5\) with codec 'msgpack'",
    ):
        src.__getitems__([3, 65, 100])
    with pytest.raises(tg.RecordDecodeError, match="record 65 "):
        src.read_columns([3, 65, 100])


class DecodingFixed(FixedFormat):
    """The example format with a ``codec`` of its own that its readers use: not an
    EncodedFormat, its records are not decoded again."""

    codec = tg.sources.get_codec("msgpack")


class ShortBatches(EncodedFixed):
    def read_batch(self, paths, shards, rows, indices):
        got = super().read_batch(paths, shards, rows, indices)
        return None if got is None else got[:-1]


def test_a_format_is_encoded_only_by_its_record_codec_and_a_short_batch_is_refused(data):
    assert not isinstance(DecodingFixed(), tg.sources.EncodedFormat)
    src = tg.FormatSource(str(data), format=DecodingFixed())
    truth = records()
    assert all(same(r, truth[i]) for r, i in zip(src.__getitems__([3, 9]), [3, 9], strict=True))
    assert same(src[5], truth[5]) and src.read_columns([1, 2])["id"].tolist() == [1, 2]
    short = tg.FormatSource(str(data), format=ShortBatches())
    with pytest.raises(tg.CorruptDataError, match="read_batch returned 2 records for 3 indices"):
        short.__getitems__([3, 9, 40])
