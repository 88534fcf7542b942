"""Full disks under the caches: a write that finds no room (ENOSPC, EDQUOT, or EFBIG
under a file-size limit) is named, and the read goes on without the cache.

The shard cache, the decoded Parquet cache and the dataset index each run in a child
process under ``RLIMIT_FSIZE`` (``SIGXFSZ`` ignored, so a write past the limit fails with
EFBIG instead of killing the process), and together on a tiny tmpfs for a real ENOSPC
(where this host lets us mount one). The messages are checked with the error injected.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import warnings

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import torchgrain as tg
from tests.servers import RangeHTTPServer
from tests.test_shard_cache_safety import FORMATS, N, _expected, _write
from torchgrain.formats.codecs import get_codec
from torchgrain.formats.tfrecord import write_tfrecord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in a child: the limit (argv[1] bytes; 0: none) is set after the imports.
_PRELUDE = """
import json, os, resource, signal, sys, warnings
import numpy as np
import torch
import torchgrain as tg
from tests.test_shard_cache_safety import _read_all, _source

def limit_file_size():
    nbytes = int(sys.argv[1])
    if nbytes:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not death by signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

def said(caught, text):
    return [str(w.message) for w in caught if text in str(w.message)]
"""

# argv: limit, server URL, data root, cache dir, format. Two epochs of batches read
# straight from the source (records compared in the parent).
_SHARD_CACHE = (
    _PRELUDE
    + """
url, root, cache_dir, fmt = sys.argv[2:6]
limit_file_size()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    src = _source(fmt, url, root, cache_dir)
    epochs = [_read_all(src, "batch") for _ in range(2)]
print(json.dumps({
    "epochs": [[[i, x.hex()] for i, x in e] for e in epochs],
    "warned": said(caught, "shard cache"),
    "stats": src.io_stats,
}))
"""
)

# argv: limit, server URL, data root, cache dir. An epoch through a DataLoader with two
# workers (each warns on stderr, once).
_SHARD_CACHE_WORKERS = (
    _PRELUDE
    + """
url, root, cache_dir = sys.argv[2:5]
ds = tg.Dataset(_source("array_record", url, root, cache_dir, read_ahead_bytes=0))
loader = torch.utils.data.DataLoader(
    ds, batch_size=16, sampler=tg.GlobalShuffleSampler(ds, seed=0), num_workers=2,
    collate_fn=list,
)
tg.stats(loader)  # its shared counters made before the limit (files in /dev/shm obey it too)
limit_file_size()
print(json.dumps(sorted([int(r["i"]), np.asarray(r["x"]).tobytes().hex()]
                        for b in loader for r in b)))
"""
)

# argv: limit, Parquet directory, decoded cache dir.
_DECODED = (
    _PRELUDE
    + """
from torchgrain.sources.parquet.decoded_cache import DecodedCache
data, cache_dir = sys.argv[2:4]
limit_file_size()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    src = tg.ParquetSource(data, decoded_cache=DecodedCache(cache_dir, min_free_bytes=0))
    order = np.random.default_rng(0).permutation(len(src))
    ids = [int(r["id"]) for a in range(0, len(order), 16)
           for r in src.__getitems__(order[a:a + 16])]
print(json.dumps({"ids": ids, "order": order.tolist(), "stats": src.decoded_cache.stats,
                  "warned": said(caught, "decoded Parquet cache")}))
"""
)

# argv: limit, TFRecord directory, index dir. Two sources over the same files.
_INDEX = (
    _PRELUDE
    + """
data, index_dir = sys.argv[2:4]
limit_file_size()
files = sorted(os.path.join(data, f) for f in os.listdir(data))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    srcs = [tg.TFRecordSource(files, codec="msgpack", index_dir=index_dir) for _ in range(2)]
    ids = [[int(r["i"]) for r in s.__getitems__(list(range(len(s))))] for s in srcs]
print(json.dumps({"ids": ids, "warned": said(caught, "dataset index")}))
"""
)


def _child(script: str, *args: object, limit: int = 0, prefix: tuple[str, ...] = ()) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [*prefix, sys.executable, "-c", script, str(limit), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if isinstance(got, dict):
        got["stderr"] = out.stderr
    return got


def _files(directory) -> list[str]:
    """Every file under ``directory`` that is not a lock (kept by design: empty, or the
    eviction lock's running total of the entries' bytes)."""
    out = []
    for d, _, names in os.walk(directory):
        out += [
            os.path.join(d, n)
            for n in names
            if not n.endswith(".lock") and os.path.getsize(os.path.join(d, n)) > 0
        ]
    return sorted(out)


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    with RangeHTTPServer(root) as srv:
        yield srv, str(root)


def _pairs(epoch) -> list[tuple[int, bytes]]:
    return [(i, bytes.fromhex(x)) for i, x in epoch]


def _write_ids(d, files: int = 2, rows: int = 64, rg: int = 8) -> str:
    os.makedirs(d)
    for f in range(files):
        ids = np.arange(f * rows, (f + 1) * rows)
        table = pa.table({"id": ids, "s": [f"s{i}" * 20 for i in ids]})
        pq.write_table(table, os.path.join(d, f"part-{f}.parquet"), row_group_size=rg)
    return str(d)


def _write_tfrecords(d, files: int = 3, per: int = 20) -> str:
    os.makedirs(d)
    codec = get_codec("msgpack")
    for f in range(files):
        recs = [codec.encode({"i": i}) for i in range(f * per, (f + 1) * per)]
        write_tfrecord(recs, os.path.join(d, f"part-{f}.tfrecord"))
    return str(d)


# ----------------------------------------------------------------- the shard cache
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_full_shard_cache_reads_the_remote_shards_by_ranges(served, tmp_path, fmt):
    srv, root = served
    _write(root, fmt)
    cache = tmp_path / "cache"
    got = _child(_SHARD_CACHE, srv.url, root, cache, fmt, limit=1024)
    for epoch in got["epochs"]:
        assert _pairs(epoch) == _expected(range(N))
    assert len(got["warned"]) == 1, got["warned"]  # once per cache and process
    message = got["warned"][0]
    assert str(cache) in message and "/.tmp-" in message  # the directory, the file
    assert f"{srv.url}/{fmt}/" in message  # the shard it was downloading
    assert "cache_dir_bytes" in message and "cache_dir=" in message  # the remedy
    assert "File too large" in message
    assert got["stats"]["cache_misses"] == 0 and got["stats"]["remote_reads"] > 0
    assert _files(cache) == []  # nothing partial kept


def test_a_full_shard_cache_under_dataloader_workers(served, tmp_path):
    srv, root = served
    _write(root, "array_record")
    cache = tmp_path / "cache"
    out = subprocess.run(  # (no read-ahead: the main process downloads nothing)
        [sys.executable, "-c", _SHARD_CACHE_WORKERS, "1024", srv.url, root, str(cache)],
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(i, bytes.fromhex(x)) for i, x in got] == _expected(range(N))
    # One warning per worker process, each naming the cache.
    assert out.stderr.count(f"the shard cache in '{cache}'") == 2, out.stderr[-4000:]
    assert _files(cache) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_the_shard_cache_names_a_full_disk(tmp_path, monkeypatch, code):
    from torchgrain.io import remote
    from torchgrain.io.shard_cache import ShardCache

    fsspec.filesystem("memory").pipe("/full-disk/shard-0", b"x" * 100)

    def no_room(fs, rpath, lpath, **kw):
        with open(lpath, "wb") as f:
            f.write(b"x" * 10)  # part of it, then the disk is full
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(remote, "get_file", no_room)
    cache = ShardCache(tmp_path / "cache", max_bytes=1000)
    with pytest.raises(tg.CacheDiskFullError) as info:
        cache.fetch("memory://full-disk/shard-0")
    e = info.value
    assert isinstance(e, OSError) and e.errno == code  # `except OSError` still works
    message = str(e)
    assert os.strerror(code) in message
    assert repr(cache.directory) in message and e.directory == cache.directory
    assert e.path.startswith(os.path.join(cache.directory, ".tmp", ".tmp-"))
    assert repr(e.path) in message
    assert "memory://full-disk/shard-0" in message
    assert "cache_dir_bytes" in message and "1,000 bytes" in message and "cache_dir=" in message
    assert cache.disk_full
    assert _files(cache.directory) == []


def test_a_forked_child_tries_a_full_shard_cache_again(tmp_path, monkeypatch):
    from torchgrain.io import remote
    from torchgrain.io.shard_cache import ShardCache

    fsspec.filesystem("memory").pipe("/full-disk/shard-1", b"x" * 100)
    monkeypatch.setattr(remote, "get_file", lambda *a, **kw: _raise(errno.ENOSPC))
    cache = ShardCache(tmp_path / "cache", max_bytes=1000)
    with pytest.raises(OSError):
        cache.fetch("memory://full-disk/shard-1")
    assert cache.disk_full  # this process reads without it from now on
    pid = os.fork()
    if pid == 0:  # (the next epoch's workers: space may have been freed meanwhile)
        os._exit(0 if not cache.disk_full else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert cache.disk_full


def test_hints_that_find_no_room_are_named_and_leave_the_cache_in_use(tmp_path, monkeypatch):
    # Read-ahead writes the hints and swallows its errors: were they to turn the cache
    # off, nobody would say so. A download that finds no room does, and warns.
    from torchgrain.io import shard_cache

    monkeypatch.setattr(shard_cache, "write_hints", lambda *a: _raise(errno.ENOSPC))
    cache = shard_cache.ShardCache(tmp_path / "cache", max_bytes=1000, eviction="belady")
    with pytest.raises(tg.CacheDiskFullError, match="next-use hints"):
        cache.advise({"memory://full-disk/shard-2": 3})
    assert not cache.disk_full


def _raise(code: int) -> None:
    raise OSError(code, os.strerror(code))


def test_read_ahead_into_a_full_shard_cache_warns_once_and_reads_on(tmp_path, monkeypatch):
    from torchgrain.io import remote

    root = tmp_path / "www"
    root.mkdir()
    _write(str(root), "array_record")

    def no_room(fs, rpath, lpath, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(remote, "get_file", no_room)
    with RangeHTTPServer(root) as srv:
        src = tg.ArrayRecordSource(f"{srv.url}/array_record", cache_dir=tmp_path / "cache")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert src.prefetch_shard(0) is False  # what read-ahead calls: no error
            assert src.prefetch_shard(1) is False
            got = sorted((r["i"], bytes(r["x"])) for r in src.__getitems__(list(range(N))))
    assert got == _expected(range(N))
    assert len([w for w in caught if "shard cache" in str(w.message)]) == 1


def test_a_shard_cache_whose_directories_cannot_be_made_reads_by_ranges(tmp_path, monkeypatch):
    # (a disk full to its last inode or block before the first run: the source was not
    # made at all, a CacheDiskFullError from ShardCache.__init__)
    cache = str(tmp_path / "cache")
    makedirs = os.makedirs

    def no_room(path, *args, **kwargs):
        if os.fspath(path).startswith(cache):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return makedirs(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", no_room)
    root = tmp_path / "www"
    root.mkdir()
    _write(str(root), "array_record")
    with RangeHTTPServer(root) as srv, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        src = tg.ArrayRecordSource(f"{srv.url}/array_record", cache_dir=cache)
        for _ in range(2):
            got = sorted((r["i"], bytes(r["x"])) for r in src.__getitems__(list(range(N))))
            assert got == _expected(range(N))
        assert src.prefetch_shard(0) is False
    said = [str(w.message) for w in caught if "shard cache" in str(w.message)]
    assert len(said) == 1, said
    assert os.strerror(errno.ENOSPC) in said[0] and f"the shard cache in {cache!r}" in said[0]
    assert not os.path.exists(cache)


def test_a_rename_that_finds_no_room_leaves_no_record(tmp_path, monkeypatch):
    from torchgrain.io import node_store

    monkeypatch.setattr(node_store, "publish", lambda *a, **k: _raise(errno.ENOSPC))
    root = tmp_path / "www"
    root.mkdir()
    _write(str(root), "array_record")
    cache = tmp_path / "cache"
    with RangeHTTPServer(root) as srv, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        src = tg.ArrayRecordSource(f"{srv.url}/array_record", cache_dir=cache)
        got = sorted((r["i"], bytes(r["x"])) for r in src.__getitems__(list(range(N))))
    assert got == _expected(range(N))
    said = [str(w.message) for w in caught if "shard cache" in str(w.message)]
    assert len(said) == 1 and ".sums" not in said[0], said  # names the copy, not its record
    assert _files(cache) == []  # no record of a copy that is not there


# ----------------------------------------------------------- the decoded Parquet cache
def test_a_full_decoded_parquet_cache_decodes_row_groups_again(tmp_path):
    data = _write_ids(tmp_path / "ids")
    cache = tmp_path / "decoded"
    got = _child(_DECODED, data, cache, limit=256)
    assert got["ids"] == got["order"]  # the epoch completed, each record right
    assert got["stats"]["builds"] == 0 and got["stats"]["not_stored"] >= 16
    assert len(got["warned"]) == 1, got["warned"]
    message = got["warned"][0]
    assert "File too large" in message and repr(str(cache)) in message
    assert os.path.join(str(cache), ".tmp", "") in message  # the file it was writing
    assert "part-" in message and "row group" in message  # what it was decoded from
    assert "decoded_cache_bytes" in message and "decoded_cache=" in message  # the remedy
    assert "TORCHGRAIN_CACHE" in message
    assert not [f for f in _files(cache) if f.endswith(".arrow") or ".tmp" in f]


def test_a_decoded_cache_directory_that_cannot_be_made_is_named(tmp_path, monkeypatch):
    from torchgrain.sources.parquet.decoded_cache import DecodedCache

    def no_room(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(DecodedCache, "_make_dirs", no_room)
    directory = str(tmp_path / "decoded")
    with pytest.raises(tg.CacheDiskFullError) as info:
        DecodedCache(directory)
    assert info.value.errno == errno.ENOSPC and info.value.directory == directory
    assert repr(directory) in str(info.value) and "decoded_cache=" in str(info.value)


# ------------------------------------------------------------------- the dataset index
def test_a_full_index_directory_keeps_the_index_in_memory(tmp_path):
    data = _write_tfrecords(tmp_path / "tf")
    index_dir = tmp_path / "index"
    got = _child(_INDEX, data, index_dir, limit=64)
    assert got["ids"] == [list(range(60))] * 2
    assert len(got["warned"]) == 1, got["warned"]  # two sources, one process: one warning
    message = got["warned"][0]
    assert "File too large" in message and repr(str(index_dir)) in message
    assert ".tgindex" in message  # the file
    assert "index_dir=" in message and "TORCHGRAIN_CACHE" in message  # the remedy
    assert not [f for f in _files(index_dir) if "tgindex" in f]  # nothing partial


def test_the_dataset_index_names_a_full_disk(tmp_path, monkeypatch):
    from torchgrain.formats import index_file

    def no_room(self, name, rows):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(index_file.IndexFileWriter, "append", no_room)
    data = _write_tfrecords(tmp_path / "tf")
    files = sorted(os.path.join(data, f) for f in os.listdir(data))
    index_dir = str(tmp_path / "index")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        src = tg.TFRecordSource(files, codec="msgpack", index_dir=index_dir)
        assert [r["i"] for r in src.__getitems__(list(range(60)))] == list(range(60))
    said = [str(w.message) for w in caught if "dataset index" in str(w.message)]
    assert len(said) == 1 and os.strerror(errno.EDQUOT) in said[0]
    assert repr(index_dir) in said[0] and ".tgindex'" in said[0]
    # (each file's offsets are entries of their own: kept)
    index = [f for f in os.listdir(index_dir) if not f.endswith(".offsets.tgindex")]
    assert not [f for f in index if f.endswith(".tgindex") or ".tmp-" in f]


# ------------------------------------------------------------- a real ENOSPC: tmpfs
# argv: limit (0), server URL, data root, tmpfs mount point, Parquet dir, TFRecord dir.
_TMPFS = (
    _PRELUDE
    + """
from torchgrain.sources.parquet.decoded_cache import DecodedCache
url, root, mnt, parquet, tfrecords = sys.argv[2:7]
ballast = os.path.join(mnt, "ballast")
fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)
try:  # fill the disk
    while True:
        os.write(fd, bytes(4096))
except OSError as e:
    assert e.errno == 28, e
os.close(fd)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    src = _source("array_record", url, root, os.path.join(mnt, "shards"))
    shards = _read_all(src, "batch")
    pq_src = tg.ParquetSource(
        parquet, decoded_cache=DecodedCache(os.path.join(mnt, "decoded"), min_free_bytes=0)
    )
    ids = [int(r["id"]) for r in pq_src.__getitems__(list(range(len(pq_src))))]
    files = sorted(os.path.join(tfrecords, f) for f in os.listdir(tfrecords))
    tf_src = tg.TFRecordSource(files, codec="msgpack", index_dir=os.path.join(mnt, "index"))
    tf_ids = [int(r["i"]) for r in tf_src.__getitems__(list(range(len(tf_src))))]
os.unlink(ballast)
left = [os.path.join(d, n) for d, _, ns in os.walk(mnt) for n in ns
        if os.path.getsize(os.path.join(d, n))]
print(json.dumps({"shards": [[i, x.hex()] for i, x in shards], "ids": ids, "tf_ids": tf_ids,
                  "warned": [str(w.message) for w in caught], "left": left}))
"""
)


def _tmpfs_prefix() -> tuple[str, ...] | None:
    """A command prefix that runs a program with a 256 KiB tmpfs mounted on ``$MNT`` in a
    mount namespace of its own (gone with it), or None where mounting is not permitted."""
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs -o size=256k tmpfs /mnt",
        ],
        capture_output=True,
        timeout=30,
    )
    return None if probe.returncode else ("unshare", "--mount", "--propagation", "private")


def test_a_real_full_disk_on_tmpfs(served, tmp_path):
    prefix = _tmpfs_prefix()
    if prefix is None:
        pytest.skip("mounting a tmpfs is not permitted here (needs root or a user namespace)")
    srv, root = served
    _write(root, "array_record")
    parquet = _write_ids(tmp_path / "ids")
    tfrecords = _write_tfrecords(tmp_path / "tf")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (
        "import subprocess, sys; "
        f"subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=256k', 'tmpfs', {str(mnt)!r}], "
        "check=True); exec(compile(sys.argv.pop(2), 'child', 'exec'))"
    )
    got = _child(script, _TMPFS, srv.url, root, mnt, parquet, tfrecords, prefix=prefix)
    assert _pairs(got["shards"]) == _expected(range(N))
    assert got["ids"] == list(range(128)) and got["tf_ids"] == list(range(60))
    full = [m for m in got["warned"] if "No space left on device" in m]
    assert any(f"the shard cache in '{mnt}/shards'" in m for m in full), got["warned"]
    assert any(f"'{mnt}/index'" in m for m in full), got["warned"]
    # (the decoded cache sees the disk has no room before it writes, and says so)
    assert any(f"decoded Parquet cache in '{mnt}/decoded'" in m for m in got["warned"])
    assert got["left"] == []  # nothing partial kept
    assert os.listdir(mnt) == []  # the mount went with its namespace


# ------------------------------------------------------------- the statistics' table
# argv: limit, data dir. The statistics' shared table is a file in /dev/shm (or a
# temporary directory): under a file-size limit it cannot be made. Two Datasets read in
# this process, then through a DataLoader with two forked workers.
_STATS_TABLE = (
    _PRELUDE
    + """
data = sys.argv[2]
limit_file_size()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ds = [tg.Dataset(tg.ArrayRecordSource(data, index_dir=None)) for _ in range(2)]
    got = [int(r["i"]) for d in ds for r in d.__getitems__(list(range(8)))]
    loader = torch.utils.data.DataLoader(ds[0], batch_size=8, num_workers=2, collate_fn=list,
                                         multiprocessing_context="fork")
    got += sorted(int(r["i"]) for b in loader for r in b)
    records = tg.stats(ds[1]).total["records"]
print(json.dumps({"got": got, "records": records, "warned": said(caught, "shared memory")}))
"""
)


def test_statistics_without_shared_memory_never_fail_a_read(tmp_path):
    data = str(tmp_path / "ar")
    tg.write_array_record([{"i": np.int64(i)} for i in range(N)], data)
    got = _child(_STATS_TABLE, data, limit=4096)
    assert got["got"] == list(range(8)) * 2 + list(range(N))
    assert got["records"] == 8  # (counted in this process's own table)
    assert len(got["warned"]) == 1, got["warned"]  # once per process, for both Datasets
    assert "/dev/shm" in got["warned"][0]


# ---------------------------------------------------------- the TFRecord offset cache
def test_the_tfrecord_offset_cache_names_a_full_disk_once(tmp_path, monkeypatch):
    from torchgrain.sources.node_index import store

    def no_room(self, *args, **kwargs):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(store.EntryWriter, "write", no_room)  # each file's offsets only
    data = _write_tfrecords(tmp_path / "tf")
    files = sorted(os.path.join(data, f) for f in os.listdir(data))
    index_dir = str(tmp_path / "index")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # three files each, two sources, one process: one warning
            src = tg.TFRecordSource(files, codec="msgpack", index_dir=index_dir)
            assert [r["i"] for r in src.__getitems__(list(range(60)))] == list(range(60))
    said = [str(w.message) for w in caught if "offset cache" in str(w.message)]
    assert len(said) == 1, said
    assert os.strerror(errno.EDQUOT) in said[0] and repr(index_dir) in said[0]
    assert ".offsets.tgindex'" in said[0] and "index_dir=" in said[0]  # the file, the remedy
    assert not [f for f in os.listdir(index_dir) if f.endswith(".offsets.tgindex") or ".tmp-" in f]
    assert not os.listdir(os.path.join(index_dir, ".tmp"))  # (the temp files' folder)


# ------------------------------------------------------ an error from a worker process
class _NoRoom(torch.utils.data.Dataset):
    """A dataset whose reads raise a full cache's error (what a worker meets)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        raise tg.CacheDiskFullError(
            errno.ENOSPC,
            "No space left on device: the shard cache in '/c' cannot write '/c/x'. Free space.",
            directory="/c",
            path="/c/x",
        )


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_full_disk_error_from_a_worker_keeps_its_type_and_message(context):
    loader = torch.utils.data.DataLoader(_NoRoom(), num_workers=1, multiprocessing_context=context)
    with pytest.raises(tg.CacheDiskFullError) as info:
        next(iter(loader))
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert "the shard cache in '/c' cannot write '/c/x'. Free space." in str(info.value)


def test_a_full_disk_error_pickles_with_its_message_and_errno():
    import pickle

    full = tg.CacheDiskFullError(
        errno.EDQUOT, "Disk quota exceeded: x", directory="/c", path="/c/x"
    )
    text = tg.CacheDiskFullError("Caught CacheDiskFullError in a worker (no errno given)")
    for e in (full, text):
        got = pickle.loads(pickle.dumps(e))
        assert type(got) is tg.CacheDiskFullError and str(got) == str(e)
        assert (got.errno, got.directory, got.path) == (e.errno, e.directory, e.path)
    assert full.errno == errno.EDQUOT and text.errno is None
