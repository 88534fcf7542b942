"""A remote range answer is the range asked, of the file opened.

A server (or a proxy, or a store re-uploaded during a run) may answer a range request
with other bytes than asked, honestly named in its ``Content-Range``; with a ``200`` and
the file's first bytes; or with bytes of another version of the file. Each ends in a
torchgrain error naming the URL, never in records read from the wrong offsets. Also: an
HTTP file URL is recognised from a ``HEAD`` (whatever its ``Content-Type``), and a
redirect is refused on the Parquet footer's GET as on every other path.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io import remote, responses
from torchgrain.io.fs import expand_paths, get_filesystem
from torchgrain.io.retry import RetryPolicy, using

FAST = RetryPolicy(
    attempts=5,
    base_delay=0.01,
    max_delay=0.05,
    connect_timeout=5.0,
    read_timeout=5.0,
    request_timeout=10.0,
    deadline=30.0,
)
N = 24
PAD = 200  # every record the same length: a frame one record earlier parses as one


def _tf_records(tag: int, n: int = N, pad: int = PAD) -> list[bytes]:
    # x from 200 to 1,200: two-byte varints, so every record of every tag is the same
    # length and a frame at another record's offset, or of another version, parses.
    return [encode_tf_example({"x": [_x(tag, i)], "pad": [b"p" * pad]}) for i in range(n)]


def _x(tag: int, i: int) -> int:
    return 200 + 100 * tag + i


@pytest.fixture
def root(tmp_path):
    (tmp_path / "tf").mkdir()
    write_tfrecord(_tf_records(0), tmp_path / "tf" / "part-0.tfrecord")
    tg.write_array_record(
        [{"x": np.int64(i), "pad": b"p" * PAD} for i in range(N)], tmp_path / "ar", num_shards=1
    )
    (tmp_path / "pq").mkdir()
    pq.write_table(
        pa.table({"x": np.arange(N), "b": [b"q" * 3000] * N}),
        tmp_path / "pq" / "part-0.parquet",
        row_group_size=6,
    )
    return tmp_path


@pytest.fixture(autouse=True)
def _fresh_pins():
    # Each test is a fresh process as far as pinned files go.
    _forget_pins()
    yield
    _forget_pins()


def _forget_pins() -> None:
    getattr(responses, "_PINS", {}).clear()


@pytest.fixture
def srv(root):
    with RangeHTTPServer(root) as s:
        yield s


def _tf(srv, **kw):
    return tg.TFRecordSource(f"{srv.url}/tf", index_dir=None, retry=FAST, **kw)


def _ar(srv, **kw):
    return tg.ArrayRecordSource(f"{srv.url}/ar", cache_bytes=0, retry=FAST, **kw)


def _pinned(path: str):
    """What this process pinned of ``path`` (None where nothing pins)."""
    return getattr(responses, "pinned", lambda p: None)(path)


def _xs(records) -> list[int]:
    return [int(np.asarray(r["x"]).reshape(-1)[0]) for r in records]


def _frame(root) -> int:
    """The bytes of one TFRecord frame (all are the same length)."""
    return os.path.getsize(root / "tf" / "part-0.tfrecord") // N


# ------------------------------------------------------------------ wrong bytes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("multi_range", [False, True])
def test_a_content_range_naming_other_bytes_is_an_error_not_other_records(srv, root, multi_range):
    src = _tf(srv, multi_range=multi_range)
    assert _xs(src.__getitems__([3, 9, 15])) == [_x(0, 3), _x(0, 9), _x(0, 15)]
    srv.answer_shift = _frame(root)  # one record earlier, named so
    if multi_range:
        srv.multirange = "shifted"
    with pytest.raises(tg.RemoteIOError, match=r"part-0\.tfrecord") as ei:
        src.__getitems__([4, 10, 16])
    assert "asked for bytes" in str(ei.value) or "Content-Range" in str(ei.value)


@pytest.mark.timeout(120)
def test_arrayrecord_refuses_a_shifted_answer(srv, root):
    from torchgrain.formats.arrayrecord.file import ArrayRecordFile

    shard = next(p for p in (root / "ar").iterdir() if ".array_record" in p.name)
    local = ArrayRecordFile(str(shard))
    _, ranges = local.chunk_ranges(np.arange(N))
    local.close()
    sizes = {e - s for s, e in ranges[1:]}
    assert len(sizes) == 1  # every chunk the same length: one chunk earlier parses
    src = _ar(srv, multi_range=False)
    assert _xs(src.__getitems__([0])) == [0]  # the footer read
    srv.answer_shift = sizes.pop()
    with pytest.raises(tg.RemoteIOError, match=r"\.array_record.*asked for bytes"):
        src.__getitems__([3, 9, 15])


@pytest.mark.timeout(120)
def test_a_200_with_the_files_first_bytes_is_not_taken_for_the_range(srv):
    src = _tf(srv, multi_range=False)
    srv.answer = "first"
    with pytest.raises(tg.RemoteIOError, match=r"part-0\.tfrecord.*status 200"):
        src[5]


@pytest.mark.timeout(60)
def test_a_200_is_used_only_when_it_is_the_range_asked(srv, root):
    fs, path = get_filesystem(f"{srv.url}/tf/part-0.tfrecord")
    data = (root / "tf" / "part-0.tfrecord").read_bytes()
    srv.answer = "whole"
    with using(FAST):
        getattr(remote, "pin", lambda *a: None)(fs, path, len(data))
        assert remote.cat_file(fs, path, 0, len(data)) == data  # the whole file was asked
        with pytest.raises(tg.RemoteIOError, match="does not honour Range"):
            remote.cat_file(fs, path, 10, 20)
    srv.reset_counts()
    with using(FAST), pytest.raises(tg.RemoteIOError, match="does not honour Range"):
        remote.cat_file(fs, path, 10, 20)
    assert srv.gets() == 2  # retried once from scratch, then an error


def test_check_range_answer_accepts_only_the_range_asked():
    check = responses.check_range_answer
    responses.pin("u", 100)
    check("u", 10, 20, 206, "bytes 10-19/100", None, None)
    check("u", 90, 120, 206, "bytes 90-99/100", None, None)  # a short file: reported later
    for header in (
        "bytes 9-18/100",
        "bytes 10-20/100",
        "bytes 10-19/101",
        "bytes 10-19",
        "bytes 19-10/100",
        "",
        None,
    ):
        with pytest.raises(responses.RangeAnswerError):
            check("u", 10, 20, 206, header, None, None)
    with pytest.raises(responses.RangeAnswerError):
        check("u", 0, 10, 200, None, None, None, length=10)  # the first bytes
    check("u", 0, 100, 200, None, None, None, length=100)


# ------------------------------------------------------------------ swapped objects
def _swap_tf(root, *, tag: int, extra: int = 0, later: float = 10) -> None:
    """Replace the TFRecord shard (atomically, as an upload does) by one whose records
    are others, at the same offsets (records of the same length), ``extra`` more of them:
    the old index's offsets parse as records of the new file."""
    path = root / "tf" / "part-0.tfrecord"
    st = os.stat(path)
    tmp = root / "tf" / ".new"
    write_tfrecord(_tf_records(tag, n=N + extra), tmp)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns + int(later * 1e9)))
    os.replace(tmp, path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("multi_range", [False, True])
@pytest.mark.parametrize("same_size", [False, True])
def test_a_shard_replaced_while_open_is_an_error_not_the_new_files_bytes(
    srv, root, multi_range, same_size
):
    src = _tf(srv, multi_range=multi_range)
    assert _xs(src.__getitems__([3, 9, 15])) == [_x(0, 3), _x(0, 9), _x(0, 15)]
    _swap_tf(root, tag=7, extra=0 if same_size else 2)
    with pytest.raises(tg.RemoteIOError, match=r"part-0\.tfrecord.*(changed|pinned)"):
        src.__getitems__([4, 10, 16])


@pytest.mark.timeout(120)
def test_a_same_size_swap_is_caught_by_the_etag_alone(srv, root):
    """Last-Modified kept (cp -p): the ETag differs (a store's content hash would); the
    test server's ETag is from mtime and size, so the server is told to send another."""
    src = _tf(srv, multi_range=False)
    src.__getitems__([1])
    pinned = _pinned(f"{srv.url}/tf/part-0.tfrecord")
    if pinned is not None:
        assert pinned.etag and pinned.modified
        pinned.modified = None  # as from a store that sends only an ETag
    _swap_tf(root, tag=7, later=20)
    srv.reset_counts()
    with pytest.raises(tg.RemoteIOError, match=r"412|ETag"):
        src.__getitems__([4])


@pytest.mark.timeout(120)
def test_a_worker_opening_a_shard_after_its_swap_detects_it(srv, root):
    """A source is pickled to a worker (spawn: nothing pinned in it yet), the shard is
    re-uploaded with another size before the worker's first read: the size pinned at open
    (the index) travels with the source."""
    for make in (_tf, _ar):
        src = make(srv, multi_range=False)
        blob = pickle.dumps(src)
        if make is _tf:
            _swap_tf(root, tag=9, extra=3)
        else:
            shard = next(p for p in (root / "ar").iterdir() if ".array_record" in p.name)
            data = shard.read_bytes()
            shard.write_bytes(data[:-10] + b"\0" * 20 + data[-10:])  # another size
        _forget_pins()
        worker = pickle.loads(blob)
        if make is _tf:
            with pytest.raises(tg.RemoteIOError, match=r"part-0\.tfrecord.*pinned"):
                worker.__getitems__([2, 5])
        else:
            with pytest.raises((tg.RemoteIOError, tg.CorruptDataError)):
                worker.__getitems__([2, 5])


@pytest.mark.timeout(120)
def test_a_server_without_etags_still_has_sizes_checked(srv, root):
    srv.etags = False
    src = _tf(srv, multi_range=False)
    assert _xs(src.__getitems__([2])) == [_x(0, 2)]
    _swap_tf(root, tag=7, extra=1)
    with pytest.raises(tg.RemoteIOError, match="pinned"):
        src.__getitems__([4])


@pytest.mark.timeout(120)
def test_a_parquet_worker_reads_against_the_footer_reads_size(srv, root):
    """The file re-uploaded with other values (same layout) before a worker's first read:
    its reads are of another file than the footers and cache keys the source holds."""
    src = tg.ParquetSource(f"{srv.url}/pq", cache_bytes=0, retry=FAST)
    blob = pickle.dumps(src)
    t = pa.table({"x": np.arange(N) + 500, "b": [b"r" * 3100] * N})
    pq.write_table(t, root / "pq" / "part-0.parquet", row_group_size=6)
    _forget_pins()
    with pytest.raises(tg.RemoteIOError, match="part-0"):
        pickle.loads(blob).__getitems__([20])


@pytest.mark.timeout(180)
def test_s3_answers_are_checked_against_the_object_opened(root):
    from tests.servers import start_moto_s3

    server, endpoint = start_moto_s3()
    try:
        import boto3

        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="k",
            aws_secret_access_key="s",
            region_name="us-east-1",
        )
        s3.create_bucket(Bucket="ident")
        key = "tf/part-0.tfrecord"
        s3.put_object(Bucket="ident", Key=key, Body=(root / key).read_bytes())
        opts = {"endpoint_url": endpoint, "key": "k", "secret": "s"}
        src = tg.TFRecordSource("s3://ident/tf", index_dir=None, retry=FAST, storage_options=opts)
        assert _xs(src.__getitems__([3, 9])) == [_x(0, 3), _x(0, 9)]
        pinned = _pinned("ident/tf/part-0.tfrecord")
        assert pinned is None or pinned.etag
        # Same size, other bytes: the ETag (the content's MD5) differs.
        s3.put_object(Bucket="ident", Key=key, Body=_tf_bytes(root, _tf_records(5)))
        with pytest.raises(tg.RemoteIOError, match=r"part-0\.tfrecord.*(412|ETag|changed)"):
            src.__getitems__([4])
        # Another size.
        s3.put_object(Bucket="ident", Key=key, Body=_tf_bytes(root, _tf_records(5, pad=PAD + 3)))
        if pinned is not None:
            pinned.etag = None  # only the size to go by
        with pytest.raises(tg.RemoteIOError, match="pinned"):
            src.__getitems__([4])
    finally:
        server.stop()


def _tf_bytes(tmp, records: list[bytes]) -> bytes:
    write_tfrecord(records, tmp / "new.tfrecord")
    return (tmp / "new.tfrecord").read_bytes()


# ------------------------------------------------------------------ what a URL is
@pytest.mark.timeout(120)
@pytest.mark.parametrize("suffix", [".parquet", ".tfrecord"])
def test_a_file_url_without_a_content_type_is_recognised_from_a_head(tmp_path, suffix):
    (tmp_path / f"big{suffix}").write_bytes(b"\0" * (40 << 20))
    with RangeHTTPServer(tmp_path) as s:
        s.content_types = False
        with using(FAST):
            _, files = expand_paths(f"{s.url}/big{suffix}", suffixes=[suffix])
        assert files == [f"{s.url}/big{suffix}"]
        assert s.gets() == 0  # nothing fetched to tell what it is


# ------------------------------------------------------------------ redirects
@pytest.mark.timeout(60)
def test_a_redirect_on_the_parquet_footer_read_is_refused_as_unsafe(srv, root):
    srv.redirects["/pq/part-0.parquet"] = "http://127.0.0.1:9/elsewhere.parquet"
    srv.redirect_methods = {"GET"}  # HEAD answered, GET redirected
    with pytest.raises(tg.UnsafePathError, match="redirect"):
        tg.ParquetSource(f"{srv.url}/pq/part-0.parquet", retry=FAST)


@pytest.mark.timeout(120)
def test_a_listing_page_serving_byte_ranges_is_listed_not_taken_for_a_file(srv):
    """A directory's listing served as a static page (an index.html behind a CDN) says
    ``Accept-Ranges: bytes``: it is still a page of links, not a file."""
    srv.listings["/ds"] = (
        '<html><body><a href="a.tfrecord">a</a> <a href="b.tfrecord">b</a></body></html>'
    )
    srv.listing_ranges = True
    with using(FAST):
        _, files = expand_paths(f"{srv.url}/ds", suffixes=[".tfrecord"])
    assert files == [f"{srv.url}/ds/a.tfrecord", f"{srv.url}/ds/b.tfrecord"]


# ------------------------------------------------------------------ a later opening
@pytest.mark.timeout(120)
def test_a_file_replaced_by_one_of_the_same_size_is_read_anew_by_a_later_opening(srv, root):
    """A manifest read whole, then rewritten (same size, new ETag) and read again in the
    same process: the second read is of the file as it is now, not a 412 for ever."""
    fs, path = get_filesystem(f"{srv.url}/m.json")
    (root / "m.json").write_bytes(b'{"v": 1}')
    with using(FAST):
        assert remote.cat_file(fs, path, limit=1 << 20) == b'{"v": 1}'
        (root / "m.json").write_bytes(b'{"v": 2}')
        os.utime(root / "m.json", (os.stat(root / "m.json").st_mtime + 30,) * 2)
        assert remote.cat_file(fs, path, limit=1 << 20) == b'{"v": 2}'


@pytest.mark.timeout(120)
def test_a_tfrecord_shard_swapped_same_size_is_indexed_anew_by_a_new_source(srv, root):
    """A new source opened (its index built) after the shard was re-uploaded with records
    of the same length reads the new records; it used to fail its index build on If-Match
    for the rest of the process."""
    src = _tf(srv, multi_range=False)
    assert _xs(src.__getitems__([1, 2])) == [_x(0, 1), _x(0, 2)]
    _swap_tf(root, tag=7, later=30)
    again = _tf(srv, multi_range=False)
    assert _xs(again.__getitems__([1, 2])) == [_x(7, 1), _x(7, 2)]

    # A read at an offset the first index found is no opening: the old ETag still holds.
    from torchgrain.formats.tfrecord import iter_tfrecord

    url = f"{srv.url}/tf/part-0.tfrecord"
    offset = 3 * _frame(root)
    _swap_tf(root, tag=8, later=60)
    with using(FAST), pytest.raises(tg.RemoteIOError, match=r"part-0\.tfrecord.*(412|ETag)"):
        next(iter_tfrecord(url, offset=offset))


@pytest.mark.timeout(120)
def test_range_reads_ask_for_the_bytes_uncompressed(srv, root):
    """A server (or proxy) that gzips partial content for a client accepting gzip: a
    range's bytes are those of the file, so a range request asks for no compression (an
    incompressible range's gzip is longer than the range: every read failed after all
    its attempts)."""
    from torchgrain.io import inflight

    data = np.random.default_rng(0).bytes(50_000)  # incompressible
    (root / "r.bin").write_bytes(data)
    srv.gzip_ranges = True
    fs, path = get_filesystem(f"{srv.url}/r.bin")
    with using(FAST):
        assert remote.cat_file(fs, path, 100, 4100) == data[100:4100]
        got = inflight.cat_many(fs, [path] * 2, [10, 30_000], [2010, 32_000])
    assert got == [data[10:2010], data[30_000:32_000]]


def _swap_ar_pq(root, *, tag: int) -> None:
    """Re-upload the ArrayRecord and Parquet datasets with other values, at the same
    sizes and layout (the old offsets parse in the new files), ten seconds newer."""
    ar = root / "ar"
    tg.write_array_record(
        [{"x": np.int64(tag + i), "pad": b"p" * PAD} for i in range(N)],
        ar,
        num_shards=1,
        overwrite=True,
    )
    path = root / "pq" / "part-0.parquet"
    pq.write_table(
        pa.table({"x": np.arange(N) + tag, "b": [b"q" * 3000] * N}), path, row_group_size=6
    )
    for p in [path, *ar.iterdir()]:
        st = os.stat(p)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10 * 10**9))


@pytest.mark.timeout(120)
def test_a_dataset_reopened_after_a_same_size_reupload_reads_the_new_files_and_old_sources_refuse(
    srv, root
):
    # In one process (a notebook): a dataset opened, re-uploaded at the same sizes, and
    # opened again. The new opening reads the new files; a source of the old opening
    # never reads them at its old offsets.
    ar_old = _ar(srv)
    pq_old = tg.ParquetSource(f"{srv.url}/pq", retry=FAST, cache_bytes=0)
    assert _xs([ar_old[0]]) == [0] and _xs([pq_old[0]]) == [0]
    _swap_ar_pq(root, tag=100)
    assert _xs(_ar(srv).__getitems__([0, 5])) == [100, 105]
    pq_new = tg.ParquetSource(f"{srv.url}/pq", retry=FAST, cache_bytes=0)
    assert _xs(pq_new.__getitems__([0, N - 1])) == [100, 100 + N - 1]
    with pytest.raises(tg.RemoteIOError, match="changed"):
        ar_old[5]
    try:
        got = _xs([pq_old[N - 1]])  # a row group the old source has not read
    except (tg.RemoteIOError, tg.CorruptDataError):
        pass
    else:
        assert got == [N - 1]  # if read at all, of the version it opened
