"""Token windows take a ``name`` that their index's key adds: the state a transform's code
calls (a helper, a global) is not in the documents' fingerprint, so an index built under
another helper is found stale when read; naming the state builds the index anew.

A shard rewritten in place between runs with its size and modification time put back
(``rsync --inplace -t``) is indexed anew on this machine (the node-shared TFRecord and
ArrayRecord indexes are keyed by change time and inode too), not refused for good.

An answer of a remote file that carries none of the validators its version was pinned
by (a proxy that drops them, a server that names versions otherwise) is refused: it
could be of a replaced file.

A ResumableLoader's pass tells the dataset its epoch when it starts: a mixture another
sampler moved to a later epoch is read at the pass's own."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import torchgrain as tg
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io.retry import RetryPolicy

_REPEAT = [1]


def _tokens(r: dict) -> dict:
    return {"t": np.tile(r["t"], _REPEAT[0])}


def test_windows_name_keys_the_index(tmp_path):
    tg.write_array_record([{"t": np.arange(i % 5 + 1)} for i in range(40)], tmp_path / "d")
    ds = tg.Dataset(tg.ArrayRecordSource(tmp_path / "d")).map(lambda r: _tokens(r))
    index_dir = tmp_path / "ix"
    first = ds.windows("t", 8, eos=99, index_dir=index_dir, name="repeat-1")
    before = [first[i]["input_ids"].tolist() for i in range(len(first))]
    try:
        _REPEAT[0] = 2  # what the transform calls changed; its own code did not
        stale = ds.windows("t", 8, eos=99, index_dir=index_dir, name="repeat-1")
        with pytest.raises(tg.CorruptDataError, match="name="):
            [stale[i] for i in range(len(stale))]
        fresh = ds.windows("t", 8, eos=99, index_dir=index_dir, name="repeat-2")
        tokens = np.concatenate(
            [np.append(np.tile(np.arange(i % 5 + 1), 2), 99) for i in range(40)]
        )
        assert len(fresh) == (len(tokens) - 1) // 8 > len(first)
        got = np.concatenate([fresh[i]["input_ids"] for i in range(len(fresh))])
        assert got.tolist() == tokens[: len(got)].tolist()
    finally:
        _REPEAT[0] = 1
    # The first name's index is still the one it built.
    again = ds.windows("t", 8, eos=99, index_dir=index_dir, name="repeat-1")
    assert [again[i]["input_ids"].tolist() for i in range(len(again))] == before
    with pytest.raises(TypeError, match="name must be a string"):
        ds.windows("t", 8, index_dir=None, name=1)


def _rewrite_in_place(path, data: bytes) -> None:
    """``path`` rewritten in place with ``data`` (of its size), its modification time put
    back: what ``rsync --inplace -t`` or ``cp -p`` onto the file does."""
    st = os.stat(path)
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_tfrecord_rewritten_in_place_between_runs_is_indexed_anew(tmp_path):
    (tmp_path / "data").mkdir()
    path = tmp_path / "data" / "a.tfrecord"
    write_tfrecord([bytes([65 + i]) * 10 for i in range(4)], str(path))
    write_tfrecord([b"X" * 36, b"Y" * 36], str(tmp_path / "new"))  # as many bytes, 2 records
    ix = tmp_path / "ix"
    old = tg.TFRecordSource(tmp_path / "data", codec="raw", index_dir=ix)
    assert [old[i]["bytes"] for i in range(len(old))] == [bytes([65 + i]) * 10 for i in range(4)]
    _rewrite_in_place(path, (tmp_path / "new").read_bytes())
    new = tg.TFRecordSource(tmp_path / "data", codec="raw", index_dir=ix)
    assert [new[i]["bytes"] for i in range(len(new))] == [b"X" * 36, b"Y" * 36]
    assert [r["bytes"] for r in new.iter_shard(0)] == [b"X" * 36, b"Y" * 36]


def test_arrayrecord_rewritten_in_place_between_runs_is_indexed_anew(tmp_path):
    for name, value, n, group in (("w1", "a" * 10, 4, 1), ("w2", "b" * 3, 11, 2)):
        tg.write_array_record(
            [{"x": value}] * n, tmp_path / name, compression="uncompressed", group_size=group
        )
    (tmp_path / "ar").mkdir()  # files without their manifest: indexed on this machine
    path = tmp_path / "ar" / "a.array_record"
    shutil.copy(next((tmp_path / "w1").glob("*.array_record")), path)
    ix = tmp_path / "ix"
    old = tg.ArrayRecordSource(tmp_path / "ar", index_dir=ix)
    assert [old[i]["x"] for i in range(len(old))] == ["a" * 10] * 4
    _rewrite_in_place(path, next((tmp_path / "w2").glob("*.array_record")).read_bytes())
    new = tg.ArrayRecordSource(tmp_path / "ar", index_dir=ix)
    assert [new[i]["x"] for i in range(len(new))] == ["b" * 3] * 11
    assert [r["x"] for r in new.__getitems__(list(range(11)))] == ["b" * 3] * 11


def test_an_answer_without_the_pinned_validators_is_refused():
    """Once a file's answers named its version (an ETag, a Last-Modified), one that names
    none of those validators, or only one the pin lacks, may be of another version."""
    from torchgrain.io import responses

    path = "h://s65/switch"
    responses.pin(path, 10, fresh=True)
    responses.check_file_answer(path, 10, '"v1"', None)
    for etag, modified in ((None, None), (None, "Mon, 01 Jan 2024 00:00:00 GMT")):
        with pytest.raises(responses.RangeAnswerError, match="none of the validators"):
            responses.check_file_answer(path, 10, etag, modified)
    # One it has, the same: a validator it lacked is taken with it, and checked from then on.
    responses.check_file_answer(path, 10, 'W/"v1"', "Tue, 02 Jan 2024 00:00:00 GMT")
    with pytest.raises(responses.RangeAnswerError, match="Last-Modified"):
        responses.check_file_answer(path, 10, '"v1"', "Wed, 03 Jan 2024 00:00:00 GMT")
    # A listing's headers may leave a validator out: checked where given.
    responses.check_file_answer(path, 10, None, None, complete=False)
    with pytest.raises(responses.RangeAnswerError, match="ETag"):
        responses.check_file_answer(path, 10, '"v2"', None, complete=False)
    # A file whose first answers named no version takes the first validators given.
    bare = "h://s65/bare"
    responses.pin(bare, 10, fresh=True)
    responses.check_file_answer(bare, 10, None, None)
    responses.check_file_answer(bare, 10, '"v1"', None)
    assert responses.pinned(bare).etag == '"v1"'


def test_a_file_replaced_behind_a_proxy_that_drops_its_validators_is_refused(tmp_path):
    """A file read over HTTP, replaced by one of its size (one value changed), and served
    from then on without ``ETag``/``Last-Modified`` (a proxy that drops them): the next
    read is refused, not given the new version's bytes."""
    from servers import RangeHTTPServer

    (tmp_path / "www").mkdir()
    path = tmp_path / "www" / "a.parquet"
    values = [bytes([i]) * (1 << 20) for i in range(20)]  # (row 10 is not read with row 0)
    pq.write_table(
        pa.table({"x": np.arange(20), "b": values}), path, row_group_size=7, compression="none"
    )
    data = path.read_bytes()
    quick = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05, deadline=10)
    with RangeHTTPServer(tmp_path / "www") as srv:
        src = tg.ParquetSource(
            f"{srv.url}/a.parquet", retry=quick, decoded_cache=False, cache_bytes=0
        )
        assert src[0]["b"] == values[0]
        at = data.index(values[10])
        path.write_bytes(data[:at] + b"\xaa" * 4096 + data[at + 4096 :])
        assert len(path.read_bytes()) == len(data)
        srv.etags = False
        with pytest.raises(tg.RemoteIOError, match=r"a\.parquet.*none of the validators"):
            src[10]


def _mixture() -> tg.Dataset:
    a = tg.Dataset([{"id": i} for i in range(10)])
    b = tg.Dataset([{"id": 100 + i} for i in range(7)])
    return tg.mix([a, b], [0.5, 0.5], seed=0, stopping="all_exhausted")


def _same(record: dict) -> dict:
    return record


def _ids(records: list) -> list:
    return [r["id"] for r in records]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_pass_reads_the_mixture_at_its_own_epoch(workers):
    """A ResumableLoader tells the dataset its epoch as each pass starts: a new one over
    a mixture another sampler (or the last loader's end of pass) moved to a later epoch,
    through the same object or another view of it, reads epoch 0 as a fresh process
    does, and its saved state resumes to the same records."""

    def loader(ds):
        sampler = tg.GlobalShuffleSampler(ds, seed=0, num_replicas=1, rank=0)
        return tg.ResumableLoader(
            torch.utils.data.DataLoader(
                ds, batch_size=5, sampler=sampler, num_workers=workers, collate_fn=_ids
            )
        )

    fresh = list(loader(_mixture()))
    ds = _mixture()
    moved = tg.GlobalShuffleSampler(ds, seed=0, num_replicas=1, rank=0)
    moved.set_epoch(3)
    [ds[i] for i in moved]
    assert list(loader(ds)) == fresh  # (a sampler made before this one moved it)
    assert list(loader(ds)) == fresh  # (the last pass's ResumableLoader set epoch 1)
    moved.set_epoch(5)
    assert list(loader(ds.map(_same))) == fresh  # (another view of the mixture)
    first = loader(ds)
    it = iter(first)
    head = [next(it), next(it)]
    state = first.state_dict()
    del it
    again = loader(_mixture())
    again.load_state_dict(state)
    assert head + list(again) == fresh


def test_stats_of_a_loader_read_through_timed_has_the_loop_time(tmp_path):
    """``tg.stats(loader)`` after ``for batch in tg.timed(loader)`` (as the performance
    page writes it) says the wait's share of the loop, as ``tg.stats`` of the iterator."""
    tg.write_array_record([{"x": np.full(64, i, np.uint8)} for i in range(256)], tmp_path / "d")
    ds = tg.Dataset(tg.ArrayRecordSource(tmp_path / "d"))
    loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=2)
    timed = tg.timed(loader)
    assert sum(len(b["x"]) for b in timed) == 256
    for report in (tg.stats(loader), tg.stats(timed), tg.stats(ds)):
        assert report.consumer["batches"] == 8
        assert report.wait_fraction is not None and 0 < report.wait_fraction <= 1
        assert "% of loop time)" in str(report)
    # Taken in the middle of the next loop, before and after a reset: the waits and the
    # loop's time are of the same stretch.
    for k, _ in enumerate(timed):
        if k in (2, 5):
            fraction = tg.stats(loader, reset=k == 2).wait_fraction
            assert fraction is not None and 0 < fraction <= 1


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_set_on_the_dataset_by_hand_stays(workers):
    """``ds.set_epoch(e)`` (transforms.md: the random_map epoch is the sampler's or the
    dataset's) is not undone by a pass of a sampler that told the dataset nothing since."""
    ds = tg.Dataset([{"x": i} for i in range(8)]).random_map(
        lambda r, rng: {"noise": int(rng.integers(1 << 30))}, seed=1
    )
    sampler = tg.GlobalShuffleSampler(ds, shuffle=False, num_replicas=1, rank=0)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=8,
        sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,
        collate_fn=lambda b: tuple(r["noise"] for r in b),
    )
    seen = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        seen.append(next(iter(loader)))
        assert ds.epoch == epoch
    assert len(set(seen)) == 3


@pytest.mark.parametrize("cache", [False, True])
def test_s3_tfrecord_reuploaded_and_reopened_reads_the_new_version(tmp_path, moto_s3, cache):
    """A TFRecord file re-uploaded (as many bytes, other records) and opened again in the
    same process, its index found on this machine (an earlier version's, uploaded again):
    the opening pins the file anew. It kept the first opening's ETag: a 412, or with a
    shard cache the copy of the other version, served with no error."""
    client, endpoint = moto_s3
    client.create_bucket(Bucket="s65-reupload")
    url = "s3://s65-reupload/t.tfrecord"
    kw = {"storage_options": {"endpoint_url": endpoint}, "index_dir": tmp_path / "ix"}
    if cache:
        kw["cache_dir"] = tmp_path / "cache"

    def upload_and_read(gen: int) -> list:
        path = tmp_path / f"{gen}.tfrecord"
        write_tfrecord([f"{gen:04d}{i:04d}".encode() for i in range(20)], str(path))
        client.upload_file(str(path), "s65-reupload", "t.tfrecord")
        src = tg.TFRecordSource(url, codec="raw", **kw)
        return [r["bytes"] for r in src.__getitems__(range(len(src)))]

    first, second, again = upload_and_read(0), upload_and_read(1), upload_and_read(0)
    assert first == again == [f"0000{i:04d}".encode() for i in range(20)]
    assert second == [f"0001{i:04d}".encode() for i in range(20)]


def test_s3_parquet_reuploaded_and_reopened_reads_the_new_version(tmp_path, moto_s3):
    """A Parquet file on S3 read through a shard cache, re-uploaded, and opened again
    without one: every pin of the file has one key (its path without ``s3://``). The
    opening pinned the new version under the URL while the source took the old one
    from the path, and refused the file as changed since it was read from."""
    client, endpoint = moto_s3
    client.create_bucket(Bucket="s65-parquet")
    url = "s3://s65-parquet/p.parquet"
    options = {"storage_options": {"endpoint_url": endpoint}}

    def upload(gen: int) -> None:
        path = tmp_path / f"{gen}.parquet"
        pq.write_table(pa.table({"id": np.arange(40) + 1000 * gen}), path, row_group_size=8)
        client.upload_file(str(path), "s65-parquet", "p.parquet")

    upload(0)
    cached = tg.ParquetSource(url, cache_dir=tmp_path / "cache", **options)
    assert [r["id"] for r in cached.__getitems__([0, 39])] == [0, 39]
    upload(1)
    src = tg.ParquetSource(url, **options)
    assert [r["id"] for r in src.__getitems__([0, 11, 39])] == [1000, 1011, 1039]


def test_an_s3_tfrecord_source_opened_before_a_reupload_refuses_the_new_file(tmp_path, moto_s3):
    """A source opened (its index found on this machine) but not read before the file is
    replaced by one of its size and frames refuses it, as one that read before does:
    its opening pinned the ETag its index describes, not the size alone."""
    client, endpoint = moto_s3
    client.create_bucket(Bucket="s65-opened")
    url = "s3://s65-opened/t.tfrecord"
    kw = {"storage_options": {"endpoint_url": endpoint}, "index_dir": tmp_path / "ix"}

    def upload(gen: int) -> None:
        path = tmp_path / f"{gen}.tfrecord"
        write_tfrecord([f"{gen:04d}{i:04d}".encode() for i in range(20)], str(path))
        client.upload_file(str(path), "s65-opened", "t.tfrecord")

    upload(0)
    read = tg.TFRecordSource(url, codec="raw", **kw)
    assert read[0]["bytes"] == b"00000000"
    opened = tg.TFRecordSource(url, codec="raw", **kw)  # (its index found: nothing read)
    upload(1)
    new = tg.TFRecordSource(url, codec="raw", **kw)
    for old in (opened, read):
        with pytest.raises(tg.RemoteIOError, match=r"t\.tfrecord"):
            old.__getitems__([0, 2])
    assert [r["bytes"] for r in new.__getitems__([0, 2])] == [b"00010000", b"00010002"]
