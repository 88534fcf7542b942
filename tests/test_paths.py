"""A dataset never reads (or requests) a file outside its root, whatever it names.

Names come from manifests, directory listings (an HTTP server's page of links), globs and
redirects. Each is tried through the public sources on every transport (local, HTTP,
HTTP with a shard cache, S3 through a logging proxy, memory://), and every test that
expects a refusal also checks, in the server's log, that no request for the file outside
was made. Control tests open the same hostile datasets with ``allow_external_paths=True``
and do read the outside file: the fixtures really escape, so a missing check fails them.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import urllib.parse

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

import torchgrain as tg
from tests.servers import FaultProxy, RangeHTTPServer
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io.paths import MAX_DECODINGS, is_inside, unsafe_reason

SECRET = "secret/data-00000-of-00001.array_record"

# name -> the hostile shard name (``{s}``: the secret shard relative to the www root).
HOSTILE = {
    "dotdot": "../{s}",
    "encoded": "%2e%2e/{s}",
    "upper-encoded": "%2E%2E/{s}",
    "double-encoded": "%252e%252e/{s}",
    "triple-encoded": "%25252e%25252e/{s}",
    "half-encoded": ".%2e/{s}",
    "encoded-slashes": "..%2f{enc}",
    "backslashes": "..\\{bs}",
    "fullwidth-dots": "\uff0e\uff0e/{s}",
    "path-parameter": "..;/{s}",
    "trailing-dot": ".../{s}",
    "iis-escape": "%u002e%u002e/{s}",
    "overlong-utf8": "%c0%ae%c0%ae/{s}",
    "nested": "sub/../../{s}",
    "absolute": "{abs}",
    "url": "{url}",
}


def _decoded(path: str) -> str:
    for _ in range(MAX_DECODINGS + 2):
        path = urllib.parse.unquote(path)
    return path


def _requested_secret(log) -> list[str]:
    """Logged requests that reached for the secret directory, in any encoding."""
    return [p for _, p in log if "secret" in _decoded(p).lower()]


def _name(kind: str, *, abs_: str, url: str) -> str:
    return HOSTILE[kind].format(
        s=SECRET,
        enc=urllib.parse.quote(SECRET, safe=""),
        bs=SECRET.replace("/", "\\"),
        abs=abs_,
        url=url,
    )


@pytest.fixture(scope="module")
def www(tmp_path_factory):
    """A web root: ``ds`` (4 records, 2 shards) and ``secret`` (2 records), plus Parquet
    and TFRecord files inside (``flat/``) and outside (``secret/``) a dataset."""
    root = tmp_path_factory.mktemp("www")
    tg.write_array_record([{"x": i, "who": "ds"} for i in range(4)], root / "ds", num_shards=2)
    tg.write_array_record([{"x": 100 + i, "who": "secret"} for i in range(2)], root / "secret")
    (root / "flat").mkdir()
    pq.write_table(pa.table({"x": np.arange(5)}), root / "flat" / "a.parquet")
    pq.write_table(pa.table({"x": np.arange(100, 103)}), root / "secret" / "b.parquet")
    write_tfrecord([encode_tf_example({"x": [i]}) for i in range(3)], root / "flat" / "a.tfrecord")
    write_tfrecord([encode_tf_example({"x": [99]})], root / "secret" / "c.tfrecord")
    shutil.copy(root / "ds" / "data-00000-of-00002.array_record", root / "flat" / "a.array_record")
    shutil.copy(
        root / "secret" / "data-00000-of-00001.array_record", root / "secret" / "d.array_record"
    )
    return root


def _hostile_copy(www, case: str, name: str) -> str:
    """A copy of ``ds`` whose manifest names ``name`` for shard 1 (2 records, like the
    secret shard, so that following it would serve the secret's records)."""
    d = www / case
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(www / "ds", d)
    m = json.loads((d / "torchgrain.json").read_text())
    m["shards"][1]["path"] = name
    m["shards"][1].pop("checksum", None)
    m["shards"][1].pop("file_checksum", None)
    m["shards"][1]["num_bytes"] = -1
    (d / "torchgrain.json").write_text(json.dumps(m))
    return case


@pytest.fixture(scope="module")
def http_www(www):
    with RangeHTTPServer(www) as srv:
        yield srv


@pytest.fixture(scope="module")
def s3_www(www, moto_s3):
    """The web root in an S3 bucket ``www`` of moto, behind a logging proxy."""
    client, endpoint = moto_s3
    client.create_bucket(Bucket="www")
    for sub in ("ds", "secret"):
        for f in os.listdir(www / sub):
            client.upload_file(str(www / sub / f), "www", f"{sub}/{f}")
    with FaultProxy(endpoint) as proxy:
        yield client, proxy


# ------------------------------------------------------------------------ the rule
@pytest.mark.parametrize(
    "name",
    [
        "..",
        "../x",
        "a/../../x",
        "%2e%2e/x",
        "%2E%2e/x",
        "%252e%252e/x",
        "%2525252e%2525252e/x",
        ".%2e/x",
        "a%2f..%2f..%2fx",
        "a\\..\\x",
        "..\\x",
        "/etc/passwd",
        "//host/x",
        "http://evil/x",
        "s3://bucket/x",
        "file:///etc/passwd",
        "simplecache::s3://b/x",
        "c:/x",
        "C:\\x",
        "c:x",
        "",
        "a\x00b",
        "a%00b",
        "a\nb",
        "a%0d%0aHost: evil",
        "a//b",
        "./x",
        "x/",
        "\uff0e\uff0e/x",
        "\uff0e\uff0e\uff0fx",
        "%ef%bc%8e%ef%bc%8e/x",
        "%c0%ae%c0%ae/x",
        "%ff/x",
        "\ud800",
        "..;/x",
        "a/..;jsessionid=1/../x",
        "%2e%2e;/x",
        ";x/y",
        "...",
        "a/. ./x",
        ".. /x",
        "..%20/x",
        "%u002e%u002e/x",
        "%U002E%u002e%u002fx",
        "x" * 5000,
        "a/" + "b" * 256,
        None,
        3,
        ["a"],
    ],
)
def test_a_name_that_could_leave_the_root_in_any_reading_is_refused(name):
    assert unsafe_reason(name) is not None


@pytest.mark.parametrize("name", ["x?y", "x#y", "a/b?c=d"])
def test_query_and_fragment_characters_are_refused_below_an_http_root(name):
    assert unsafe_reason(name, http=True) is not None


@pytest.mark.parametrize(
    "name",
    [
        "data-00000-of-00008.array_record",
        "sub/dir/x.tfrecord-00001-of-00002",
        "year=2024/month=01/part-0.parquet",
        "key=a%20b/x.parquet",
        "100%.parquet",
        "x..y.parquet",
        "..x",
        "名前/データ.parquet",
        "x?y",
        "x.",
        "a;b.parquet",
        "d/" + "b" * 255,
    ],
)
def test_ordinary_names_are_accepted(name):
    assert unsafe_reason(name) is None


_TRICKY = st.lists(
    st.sampled_from([*"./\\%2eE5cCfF0a:", "\uff0e", "\uff0f", "%2e", "%2f", "%25", "%5c"]),
    max_size=14,
).map("".join)


@given(_TRICKY)
def test_an_accepted_name_stays_inside_the_root_however_it_is_decoded(name):
    """Soundness: whatever a client, proxy or server does with an accepted name (decode it
    once or more, NFKC-normalise it, treat backslashes as slashes, resolve dot segments),
    it resolves below the root."""
    import unicodedata

    if unsafe_reason(name) is not None:
        return
    readings = [name]
    for _ in range(MAX_DECODINGS + 2):
        readings.append(urllib.parse.unquote(readings[-1]))
    readings += [unicodedata.normalize("NFKC", r) for r in readings]
    for r in readings:
        resolved = posixpath.normpath(posixpath.join("/root", r.replace("\\", "/")))
        assert resolved.startswith("/root/"), (name, r, resolved)


def test_a_listed_location_is_inside_only_on_the_same_host_and_below_the_root():
    fs = fsspec.filesystem("http")
    root = "http://h:8000/ds"
    assert is_inside(fs, root, "http://h:8000/ds/a/x.parquet")
    assert is_inside(fs, root, "http://H:8000/ds/x%20y.parquet")
    for outside in [
        "http://h:8000/dsx/x.parquet",
        "http://h:8000/secret/x.parquet",
        "http://h:8000/ds/../secret/x.parquet",
        "http://h:8000/ds/%2e%2e/secret/x.parquet",
        "http://h:8001/ds/x.parquet",
        "https://h:8000/ds/x.parquet",
        "http://evil@h:8000/ds/x.parquet",
        "http://h:8000@evil/ds/x.parquet",
        "http://h:8000/ds/x.parquet?sig=1",
        "http://h:8000/ds/a\\..\\..\\x.parquet",
    ]:
        assert not is_inside(fs, root, outside), outside


# ------------------------------------------------------------------- manifests
def _abs_and_url(transport, www, srv=None):
    if transport == "local":
        return str(www / SECRET), f"file://{www / SECRET}"
    if transport == "memory":
        return f"/www/{SECRET}", f"memory:///www/{SECRET}"
    if transport == "s3":
        return f"/www/{SECRET}", f"s3://www/{SECRET}"
    return f"/{SECRET}", f"{srv.url}/{SECRET}"


def _mirror_memory(www, case):
    mem = fsspec.filesystem("memory")
    for sub in (case, "secret"):
        for f in os.listdir(www / sub):
            mem.pipe(f"/www/{sub}/{f}", (www / sub / f).read_bytes())
    return f"memory:///www/{case}"


def _open_hostile(transport, www, case, request, **kw):
    """Open dataset ``case`` over ``transport``; returns (source or exception, log)."""
    if transport == "local":
        return (lambda: tg.ArrayRecordSource(str(www / case), **kw)), None
    if transport == "memory":
        url = _mirror_memory(www, case)
        return (lambda: tg.ArrayRecordSource(url, **kw)), None
    if transport == "s3":
        client, proxy = request.getfixturevalue("s3_www")
        for f in os.listdir(www / case):
            client.upload_file(str(www / case / f), "www", f"{case}/{f}")
        proxy.log.clear()
        opts = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing"}
        return (lambda: tg.ArrayRecordSource(f"s3://www/{case}", storage_options=opts, **kw)), (
            proxy.log
        )
    srv = request.getfixturevalue("http_www")
    srv.reset_counts()
    if transport == "http+cache":
        kw = {**kw, "cache_dir": request.getfixturevalue("tmp_path") / "cache"}
    return (lambda: tg.ArrayRecordSource(f"{srv.url}/{case}", **kw)), srv.log


TRANSPORTS = ["local", "memory", "http", "http+cache", "s3"]
# Every spelling on the cheap transports; the main ones where a request costs more.
CASES = [
    (transport, kind)
    for transport in TRANSPORTS
    for kind in HOSTILE
    if transport in ("local", "memory", "http") or kind in ("dotdot", "encoded", "url", "absolute")
]


@pytest.mark.parametrize(("transport", "kind"), CASES)
def test_a_manifest_naming_a_shard_outside_the_dataset_is_refused_before_any_request(
    transport, kind, www, request
):
    srv = request.getfixturevalue("http_www") if transport.startswith("http") else None
    abs_, url = _abs_and_url(transport, www, srv)
    case = f"m-{transport}-{kind}".replace("+", "-")
    name = _name(kind, abs_=abs_, url=url)
    _hostile_copy(www, case, name)
    opener, log = _open_hostile(transport, www, case, request)
    with pytest.raises(tg.UnsafePathError) as ei:
        src = opener()
        src.__getitems__([0, 1, 2, 3])  # were it opened, the secret's records would be here
    message = str(ei.value)
    assert "shard 1" in message and repr(name) in message and case in message
    if log is not None:
        assert _requested_secret(log) == []


@pytest.mark.parametrize(
    ("transport", "kind"),
    [(t, "dotdot") for t in TRANSPORTS] + [("http", "encoded"), ("http+cache", "encoded")],
)
def test_the_hostile_manifests_do_reach_outside_when_the_user_allows_external_paths(
    transport, kind, www, request
):
    """The control: the fixtures really escape (over HTTP, ``%2e%2e`` is decoded by the
    client), so the refusals above are what stop them."""
    srv = request.getfixturevalue("http_www") if transport.startswith("http") else None
    abs_, url = _abs_and_url(transport, www, srv)
    case = f"c-{transport}-{kind}".replace("+", "-")
    _hostile_copy(www, case, _name(kind, abs_=abs_, url=url))
    opener, _ = _open_hostile(transport, www, case, request, allow_external_paths=True)
    src = opener()
    assert [r["who"] for r in src.__getitems__([0, 1, 2, 3])] == ["ds", "ds", "secret", "secret"]


# ------------------------------------------------------------------ manifest content
def _manifest_case(www, tmp_path, edit) -> str:
    d = tmp_path / "ds"
    shutil.copytree(www / "ds", d)
    m = json.loads((d / "torchgrain.json").read_text())
    out = edit(m)
    (d / "torchgrain.json").write_text(out if isinstance(out, str) else json.dumps(m))
    return str(d)


def _set_shard(key, value):
    def edit(m):
        m["shards"][1][key] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (_set_shard("path", ""), r"shard 1 \(''\): path is empty"),
        (_set_shard("path", "a\x00b.array_record"), r"shard 1 .*NUL"),
        (_set_shard("path", 7), r"shard 1 \(7\): path must be a string"),
        (_set_shard("path", None), r"shard 1 \(None\): path must be a string"),
        (_set_shard("num_records", -1), r"shard 1 .*num_records is -1"),
        (_set_shard("num_records", 1.5), r"shard 1 .*num_records must be an integer"),
        (_set_shard("num_records", True), r"shard 1 .*num_records must be an integer"),
        (_set_shard("num_records", "2"), r"shard 1 .*num_records must be an integer"),
        (_set_shard("num_records", 2**70), r"shard 1 .*num_records is \d+, outside"),
        (_set_shard("num_bytes", -5), r"shard 1 .*num_bytes is -5"),
        (_set_shard("checksum", 12), r"shard 1 .*checksum must be a string"),
        (
            lambda m: m["shards"][1].__setitem__("path", m["shards"][0]["path"]),
            r"shard 1 .* is listed twice \(also as shard 0\)",
        ),
        (lambda m: m.__setitem__("shards", {"a": 1}), "shards must be a list"),
        (lambda m: m["shards"].__setitem__(1, "x"), "shard 1 must be an object"),
        (lambda m: m.__setitem__("num_records", 5), "num_records is 5 but the shards hold 4"),
        (lambda m: m.__setitem__("codec", 3), "codec must be a non-empty string"),
        (lambda m: m.__setitem__("codec", "pickle"), "unknown codec 'pickle'"),
        (_set_shard("checksum", "md5"), r"shard 1 .*checksum 'md5' is not ALGORITHM:HEX"),
        (_set_shard("file_checksum", "shake_128:00ff00ff00"), r"shard 1 .*unknown algorithm"),
        (_set_shard("file_checksum", "nope:00ff00ff00"), r"shard 1 .*unknown algorithm"),
        (lambda m: m.__setitem__("schema", {"x": 1}), "schema must be an object of strings"),
        (lambda m: m.__setitem__("group_size", 0), r"group_size is 0"),
        (lambda m: json.dumps(m).replace('"version": 1', '"version": 1e999'), "version"),
        (lambda m: "[" * 100_000, "nested too deeply"),
        (lambda m: "[1, 2", "not JSON"),
        (lambda m: '{"format": "other"}', "not a torchgrain/array_record manifest"),
        (lambda m: "[]", "not a torchgrain/array_record manifest"),
    ],
)
def test_a_malformed_manifest_is_a_corrupt_data_error_naming_it_and_the_shard(
    www, tmp_path, edit, expected
):
    d = _manifest_case(www, tmp_path, edit)
    with pytest.raises(tg.CorruptDataError, match=expected) as ei:
        tg.ArrayRecordSource(d)
    assert "torchgrain.json" in str(ei.value)


def test_a_manifest_with_no_shards_is_an_empty_dataset(www, tmp_path):
    def edit(m):
        m["shards"], m["num_records"] = [], 0

    assert len(tg.ArrayRecordSource(_manifest_case(www, tmp_path, edit))) == 0


COLLIDING = {
    "encoded-dot": "data-00000-of-00002%2earray_record",
    "encoded-letter": "%64ata-00000-of-00002.array_record",
    "double-encoded": "data-00000-of-00002%252earray_record",
    "other-case": "DATA-00000-of-00002.array_record",
    "fullwidth": "data-00000-of-00002\uff0earray_record",
}


@pytest.mark.parametrize("transport", ["local", "http"])
@pytest.mark.parametrize("spelling", list(COLLIDING))
def test_two_manifest_names_for_one_file_are_refused(www, http_www, transport, spelling):
    """Over HTTP ``%2e`` is sent as ``.``: shard 1 would be shard 0 again, its records
    served twice in place of shard 1's (a case-insensitive disk does the same with case)."""
    case = f"collide-{transport}-{spelling}"
    _hostile_copy(www, case, COLLIDING[spelling])
    url = str(www / case) if transport == "local" else f"{http_www.url}/{case}"
    with pytest.raises(tg.UnsafePathError, match=r"shard 1 .* and shard 0 .* one file"):
        tg.ArrayRecordSource(url).__getitems__([0, 1, 2, 3])


def test_two_links_to_one_file_in_an_http_listing_are_refused(http_www):
    http_www.listings["/flat"] = _page(["a.parquet", "%61.parquet"], http_www.url)
    try:
        with pytest.raises(tg.UnsafePathError, match=r"the listing of .* one file"):
            tg.ParquetSource(f"{http_www.url}/flat")
    finally:
        del http_www.listings["/flat"]


@pytest.mark.parametrize(
    ("name", "error", "expected"),
    [
        ("sub", tg.CorruptDataError, "is a directory"),
        ("nope.array_record", tg.DatasetNotFoundError, "does not exist"),
    ],
)
def test_a_manifest_shard_that_is_a_directory_or_missing_is_an_error_naming_the_shard(
    www, tmp_path, name, error, expected
):
    def edit(m):
        m["shards"][1]["path"] = name

    d = _manifest_case(www, tmp_path, edit)
    os.mkdir(os.path.join(d, "sub"))
    with pytest.raises(error, match=rf"shard 1 .*{name}.* {expected}"):
        tg.ArrayRecordSource(d)[2]


@pytest.mark.parametrize("remote", [False, True])
def test_a_manifest_larger_than_the_limit_is_refused_before_it_is_read(
    www, http_www, monkeypatch, remote
):
    monkeypatch.setattr("torchgrain.formats.manifest._MAX_MANIFEST_BYTES", 100)
    url = f"{http_www.url}/ds" if remote else str(www / "ds")
    with pytest.raises(tg.CorruptDataError, match=r"torchgrain\.json is \d+ bytes, more than"):
        tg.ArrayRecordSource(url)


def test_corrupt_tfds_metadata_is_an_error_naming_it_not_a_silent_change_of_decoding(tmp_path):
    d = tmp_path / "tfds"
    tg.write_array_record([{"x": 1}], d)
    os.unlink(d / "torchgrain.json")
    (d / "features.json").write_text('{"featuresDict": ')
    with pytest.raises(tg.CorruptDataError, match=r"features\.json"):
        tg.ArrayRecordSource(str(d))
    (d / "features.json").write_text('{"featuresDict": {"features": 5}}')
    with pytest.raises(tg.CorruptDataError, match=r"features\.json"):
        tg.ArrayRecordSource(str(d))


# -------------------------------------------------------------------- listings
LINKS_OUT = [
    "../secret/b.parquet",
    "%2e%2e/secret/b.parquet",
    "%252e%252e/secret/b.parquet",
    "..%2fsecret%2fb.parquet",
    "sub/../../secret/b.parquet",
    "./../secret/b.parquet",
    "..\\secret\\b.parquet",
    "{url}/flat/../secret/b.parquet",
    "{url}/flat/%2e%2e/secret/b.parquet",
]
DIRS_OUT = [
    "../",
    "../secret/",
    "%2e%2e/secret/",
    "/secret/",
    "{url}/secret/",
    "{url}/flat/../secret/",
    "//127.0.0.1:1/secret/",
    "http://127.0.0.2:9/secret/",
    "sub/../../secret/",
    "?C=N;O=D",
]


def _page(links, url):
    return (
        "<html><body>"
        + "".join(f'<a href="{h.format(url=url)}">x</a>' for h in links)
        + "</body></html>"
    )


@pytest.mark.parametrize("link", LINKS_OUT)
def test_an_http_listing_that_names_a_data_file_outside_is_refused_before_any_request(
    http_www, link
):
    http_www.listings["/flat"] = _page(["a.parquet", link], http_www.url)
    http_www.reset_counts()
    try:
        with pytest.raises(tg.UnsafePathError, match="the listing of"):
            tg.ParquetSource(f"{http_www.url}/flat")
        assert _requested_secret(http_www.log) == []
    finally:
        del http_www.listings["/flat"]


@pytest.mark.parametrize(
    ("source", "name"),
    [
        (tg.ParquetSource, "a.parquet"),
        (tg.TFRecordSource, "a.tfrecord"),
        (tg.ArrayRecordSource, "a.array_record"),
    ],
)
def test_an_http_listing_with_links_out_reads_only_its_own_files_and_requests_nothing_outside(
    http_www, source, name
):
    http_www.listings["/flat"] = _page([name, *DIRS_OUT], http_www.url)
    http_www.reset_counts()
    try:
        kw = {"index_dir": None} if source is tg.TFRecordSource else {}
        src = source(f"{http_www.url}/flat", **kw)
        assert src.paths == [f"{http_www.url}/flat/{name}"]
        src.__getitems__(list(range(len(src))))
        assert _requested_secret(http_www.log) == []
    finally:
        del http_www.listings["/flat"]


def test_a_glob_over_an_http_listing_is_confined_too(http_www):
    http_www.listings["/flat"] = _page(
        ["a.parquet", *DIRS_OUT, "../secret/b.parquet"], http_www.url
    )
    http_www.reset_counts()
    try:
        with pytest.raises(tg.UnsafePathError):
            tg.ParquetSource(f"{http_www.url}/flat/*.parquet")
        assert _requested_secret(http_www.log) == []
        http_www.listings["/flat"] = _page(["a.parquet", *DIRS_OUT], http_www.url)
        src = tg.ParquetSource(f"{http_www.url}/flat/*.parquet")
        assert [r["x"] for r in src.__getitems__(range(5))] == list(range(5))
        assert _requested_secret(http_www.log) == []
    finally:
        del http_www.listings["/flat"]


def test_format_detection_walks_only_the_directory_it_was_given(http_www):
    http_www.listings["/flat"] = _page(["a.parquet", *DIRS_OUT], http_www.url)
    http_www.reset_counts()
    try:
        src = tg.open(f"{http_www.url}/flat")
        assert isinstance(src, tg.ParquetSource) and len(src) == 5
        assert _requested_secret(http_www.log) == []
    finally:
        del http_www.listings["/flat"]


def test_a_listing_that_never_ends_is_refused(http_www, monkeypatch):
    monkeypatch.setattr("torchgrain.io.fs.MAX_LISTING_DEPTH", 3)
    # Every directory lists a deeper one: /loop, /loop/a/, /loop/a/a/, ...
    for k in range(6):
        http_www.listings["/loop" + "/a" * k] = _page(["a/"], http_www.url)
    try:
        with pytest.raises(tg.CorruptDataError, match="deeper than 3 directories"):
            tg.ParquetSource(f"{http_www.url}/loop")
    finally:
        for k in range(6):
            del http_www.listings["/loop" + "/a" * k]


def test_a_listing_of_an_object_store_is_confined_too(tmp_path):
    mem = fsspec.filesystem("memory")
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": [1]}), buf)
    mem.pipe("/store/ds/ok.parquet", buf.getvalue().to_pybytes())
    mem.pipe("/store/ds/../secret/x.parquet", buf.getvalue().to_pybytes())
    try:
        with pytest.raises(tg.UnsafePathError, match="dot segment"):
            tg.ParquetSource("memory:///store/ds")
    finally:
        mem.rm("/store", recursive=True)


# ------------------------------------------------------------------- redirects
def test_a_redirect_out_of_the_url_asked_for_is_refused_before_it_is_followed(http_www):
    http_www.redirects["/flat/r.parquet"] = "/secret/b.parquet"
    http_www.redirects["/flat/s.parquet"] = "http://127.0.0.2:1/secret/b.parquet"
    http_www.reset_counts()
    try:
        for name in ("r.parquet", "s.parquet"):
            with pytest.raises(tg.UnsafePathError, match="redirects to"):
                tg.ParquetSource([f"{http_www.url}/flat/{name}"])
        assert _requested_secret(http_www.log) == []
        # The control: allowed, the redirect is followed to the other file.
        src = tg.ParquetSource([f"{http_www.url}/flat/r.parquet"], allow_external_paths=True)
        assert [r["x"] for r in src.__getitems__(range(3))] == [100, 101, 102]
    finally:
        http_www.redirects.clear()


@pytest.mark.parametrize("fmt", ["parquet", "array_record"])
def test_a_redirect_that_appears_after_opening_is_refused_too(http_www, fmt):
    if fmt == "parquet":
        src = tg.ParquetSource([f"{http_www.url}/flat/a.parquet"], cache_bytes=0)
        http_www.redirects["/flat/a.parquet"] = "/secret/b.parquet"
    else:
        src = tg.ArrayRecordSource(f"{http_www.url}/ds", cache_bytes=0)
        http_www.redirects["/ds/data-00001-of-00002.array_record"] = f"/{SECRET}"
    http_www.reset_counts()
    try:
        with pytest.raises(tg.UnsafePathError, match="redirects to"):
            src.__getitems__([2])
        assert _requested_secret(http_www.log) == []
    finally:
        http_www.redirects.clear()


def test_a_directory_redirect_to_its_own_url_with_a_slash_is_followed(http_www):
    http_www.redirects["/flat"] = "/flat/"
    try:
        src = tg.ParquetSource(f"{http_www.url}/flat")
        assert [r["x"] for r in src.__getitems__(range(5))] == list(range(5))
    finally:
        http_www.redirects.clear()


def test_a_tfrecord_index_is_cached_under_its_own_name_whatever_the_file_is_called(tmp_path):
    from torchgrain.sources.tfrecord import _cache_file

    for name in ("..%2f..%2fx.tfrecord", "../../x.tfrecord", "a\\..\\..\\x.tfrecord", "x\x00y"):
        cached = _cache_file(tmp_path, f"http://h/ds/{name}", 10, "etag")
        assert os.path.dirname(cached) == str(tmp_path)
        assert not set(os.path.basename(cached)) & {"/", "\\", "\x00", "%"}
