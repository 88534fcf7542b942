"""A source reading through a shard cache (cache_dir=) takes copies and downloads of the
version its own opening read, not of the one a later opening in the process re-pinned:
a file replaced on the server (same size) since is a RemoteIOError naming it, in the
process and in forked DataLoader workers, while the later opening reads the new version
through the same cache directory."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import torchgrain as tg
from docs.snippets.fixed_format import FixedSource, write_fixed
from tests.servers import RangeHTTPServer
from tests.test_pins_review import _replace
from tests.test_remote_audit_review import QUICK, _parquet, _replace_parquet
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord


def _served(kind: str, root) -> tuple[str, str, callable, callable, str]:
    """``(path under the server, file name, open(url, cache), replace(), v1 / v2 index 3)``
    of a one-version-replaceable dataset of ``kind`` served from ``root / "www"``."""
    www = root / "www"
    www.mkdir()
    if kind == "parquet":
        (www / "pq").mkdir()
        _parquet(www / "pq" / "p0.parquet", 0)
        return (
            "pq",
            "p0.parquet",
            lambda url, cache: tg.ParquetSource(url, retry=QUICK, cache_dir=cache),
            lambda: _replace_parquet(www / "pq" / "p0.parquet", 5000),
            ({"x": 3}, {"x": 5003}),
        )
    if kind == "tfrecord":
        write_tfrecord(
            [encode_tf_example({"v": [b"a%d" % i]}) for i in range(8)], www / "a.tfrecord"
        )
        write_tfrecord([encode_tf_example({"v": [b"b%d" % i]}) for i in range(8)], root / "b")
        return (
            "a.tfrecord",
            "a.tfrecord",
            lambda url, cache: tg.TFRecordSource(url, retry=QUICK, index_dir=None, cache_dir=cache),
            lambda: _replace(www / "a.tfrecord", (root / "b").read_bytes()),
            ({"v": [b"a3"]}, {"v": [b"b3"]}),
        )
    if kind.startswith("arrayrecord"):
        for name, ch in (("www/ar", "a"), ("v2", "b")):
            tg.write_array_record([{"v": ch * 50} for _ in range(8)], root / name, num_shards=1)
        (shard,) = [n for n in os.listdir(root / "v2") if n.endswith(".array_record")]
        # Without checksums (a manifest with them checks the bytes: any other version is a
        # CorruptDataError, to every opening), its sizes and the versions pin the shard.
        manifest = json.loads((www / "ar" / "torchgrain.json").read_text())
        for entry in manifest["shards"]:
            del entry["checksum"], entry["file_checksum"]
        (www / "ar" / "torchgrain.json").write_text(json.dumps(manifest))
        return (
            f"ar/{shard}" if kind == "arrayrecord-url" else "ar",
            shard,
            lambda url, cache: tg.ArrayRecordSource(url, retry=QUICK, cache_dir=cache),
            lambda: _replace(www / "ar" / shard, (root / "v2" / shard).read_bytes()),
            ({"v": "a" * 50}, {"v": "b" * 50}),
        )
    (served,) = write_fixed([{"v": f"a{i}"} for i in range(8)], str(www))
    (other,) = write_fixed([{"v": f"b{i}"} for i in range(8)], str(root / "v2"))
    name = os.path.basename(served)
    return (
        name,
        name,
        lambda url, cache: FixedSource(url, retry=QUICK, cache_dir=cache),
        lambda: _replace(www / name, open(other, "rb").read()),
        ({"v": "a3"}, {"v": "b3"}),
    )


KINDS = ["parquet", "tfrecord", "arrayrecord-url", "arrayrecord-manifest", "format"]


def _workers_read(src, index: int):
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(src, [index, index]),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=lambda x: x,
    )
    it = iter(loader)
    try:
        return list(it)
    finally:
        # Stopped here, not by the garbage collector: the error a worker raised keeps
        # the iterator in a cycle (its traceback), and collected later, on whichever
        # thread allocates (the remote I/O loop's too), it finds its queues closed and
        # waits 5 s for each worker, stalling the next test's requests past their timeout.
        it._shutdown_workers()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [False, True], ids=["process", "forked-workers"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_source_opened_before_a_replacement_refuses_it_through_a_shared_shard_cache(
    tmp_path, kind, workers
):
    """Opened on v1, the file then replaced (same size) and the dataset opened again (v2
    pinned in the process): the first source's shard cache downloaded, or hit the later
    opening's copy of, v2 and read its records at v1's counts, with no error."""
    under, name, open_source, replace, (v1, v2) = _served(kind, tmp_path)
    cache = str(tmp_path / "cache")
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = f"{srv.url}/{under}"
        first = open_source(url, cache)
        if kind == "arrayrecord-manifest":
            # Its opening reads nothing of the shard (sizes only): the first read pins
            # the version (and copies it), one a same-size replacement can be told from.
            assert first[0] == v1
        replace()
        again = open_source(url, cache)
        assert again[3] == v2  # (its copy of v2 now in the cache)
        with pytest.raises(Exception, match=re.escape(name)) as e:
            got = _workers_read(first, 3) if workers else first[3]
            pytest.fail(f"read the replaced file: {got} (v1: {v1})")
        if not workers:
            assert isinstance(e.value, tg.RemoteIOError)
        assert "changed" in str(e.value)
        assert again[3] == v2
        assert _workers_read(again, 3) == [v2, v2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_a_source_opened_before_a_replacement_refuses_to_download_it(tmp_path, kind):
    """As above, the first source reading after the later opening did, through a cache
    directory of its own: its download, checked against the process's pin (v2), took v2's
    bytes. (An ArrayRecord file named by its URL is copied at the opening: v1 is read.)"""
    under, name, open_source, replace, (v1, v2) = _served(kind, tmp_path)
    with RangeHTTPServer(tmp_path / "www") as srv:
        url = f"{srv.url}/{under}"
        first = open_source(url, str(tmp_path / "c1"))
        if kind == "arrayrecord-manifest":  # (as above)
            assert first[0] == v1
        replace()
        again = open_source(url, str(tmp_path / "c2"))
        assert again[3] == v2
        try:
            got = first[3]
        except tg.RemoteIOError as e:
            assert name in str(e)
        else:
            assert got == v1, f"read the replaced file: {got} (v1: {v1})"
