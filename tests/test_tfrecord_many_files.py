"""TFRecord at 10^4 files: a batch's cost does not grow with the files it touches, and
the offsets index is built in bounded memory (issue 38)."""

from __future__ import annotations

import builtins
import json
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchgrain as tg
from torchgrain.errors import CorruptDataError
from torchgrain.formats.tfrecord import _frame, index_tfrecord, iter_tfrecord_offsets
from torchgrain.io.region import supported

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pack = struct.Struct("<Q").pack


def _write_files(d, files: int, per_file: int) -> None:
    """``files`` TFRecord files of ``per_file`` records; record ``i`` holds ``pack(i)``
    (written frame by frame: the writer's durable publish costs ~3 ms a file)."""
    d.mkdir(exist_ok=True)
    for f in range(files):
        frames = b"".join(_frame(pack(f * per_file + r)) for r in range(per_file))
        (d / f"part-{f:05d}.tfrecord").write_bytes(frames)


@pytest.mark.skipif(not supported(), reason="one map of every file needs Linux x86-64/arm64")
def test_ten_thousand_files_read_with_no_open_or_step_per_file(tmp_path, monkeypatch):
    d = tmp_path / "data"
    _write_files(d, 10_000, 2)
    src = tg.TFRecordSource(str(d), codec="raw", index_dir=None)
    assert len(src) == 20_000 and src.num_shards == 10_000
    order = tg.GlobalShuffleSampler(len(src), seed=3, num_replicas=1, rank=0).indices(0, len(src))
    batches = [order[k : k + 256].tolist() for k in range(0, len(order), 256)]

    def epoch() -> None:
        seen = np.zeros(len(src), bool)
        for b in batches:
            got = [int.from_bytes(r["bytes"], "little") for r in src.__getitems__(b)]
            assert got == b  # every record's bytes, in request order
            seen[b] = True
        assert seen.all()

    epoch()  # maps every file once
    opened, per_file = [], []
    real_open, real_os_open = builtins.open, os.open
    data = str(d)

    def count(fn, *a, **k):
        if str(a[0]).startswith(data):
            opened.append(a[0])
        return fn(*a, **k)

    monkeypatch.setattr(builtins, "open", lambda *a, **k: count(real_open, *a, **k))
    monkeypatch.setattr(os, "open", lambda *a, **k: count(real_os_open, *a, **k))
    read_group = type(src)._read_group
    monkeypatch.setattr(
        type(src), "_read_group", lambda self, *a: per_file.append(a[0]) or read_group(self, *a)
    )
    epoch()
    # The second pass opens no file and takes no Python step per file: its batches touch
    # ~250 files each, all read through one map (the previous code read file by file and,
    # here, reopened ~half of the files at every batch).
    assert opened == [] and per_file == []


def _reference_offsets(data: bytes) -> list[int]:
    out, off = [], 0
    while off < len(data):
        out.append(off)
        off += 16 + struct.unpack_from("<Q", data, off)[0]
    return out


@settings(max_examples=40, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30)), min_size=1, max_size=8),
    chunk=st.integers(1, 50),
    damage=st.none() | st.integers(0, 10**6),
)
def test_the_offsets_walk_agrees_with_a_plain_one(tmp_path_factory, runs, chunk, damage):
    # Runs of one length are checked a block at a time: the offsets must be a plain
    # walk's, in chunks of at most `chunk`, and a damaged length CRC inside a run is
    # still an error naming its offset.
    records = [bytes([k % 251]) * length for k, (length, n) in enumerate(runs) for _ in range(n)]
    data = bytearray(b"".join(map(_frame, records)))
    path = tmp_path_factory.mktemp("walk") / "x.tfrecord"
    expect = _reference_offsets(bytes(data))
    if damage is not None:
        at = expect[damage % len(expect)]
        data[at + 8] ^= 0x40  # the length's CRC
        path.write_bytes(data)
        with pytest.raises(CorruptDataError, match=f"length checksum mismatch .* offset {at}$"):
            list(iter_tfrecord_offsets(path, chunk=chunk))
        return
    path.write_bytes(data)
    parts = list(iter_tfrecord_offsets(path, chunk=chunk))
    assert all(1 <= len(p) < 2 * chunk for p in parts)
    assert np.concatenate(parts).tolist() == expect == index_tfrecord(path).tolist()


def test_a_damaged_record_in_a_batch_names_its_file_and_index(tmp_path):
    d = tmp_path / "data"
    _write_files(d, 40, 5)
    path = d / "part-00007.tfrecord"
    raw = bytearray(path.read_bytes())
    raw[48 + 12 + 3] ^= 1  # record 37's data (file 7, row 2): its CRC no longer matches
    path.write_bytes(raw)
    src = tg.TFRecordSource(str(d), codec="raw", index_dir=None)
    assert int.from_bytes(src.__getitems__([36, 199, 0])[0]["bytes"], "little") == 36
    with pytest.raises(CorruptDataError, match=r"part-00007.*data checksum.*record index 37"):
        src.__getitems__([5, 100, 37, 8])
    with pytest.raises(CorruptDataError, match=r"part-00007.*data checksum.*record index 37"):
        src[37]


def test_forked_workers_read_every_record_once(tmp_path):
    d = tmp_path / "data"
    _write_files(d, 64, 16)
    src = tg.TFRecordSource(str(d), codec="raw", index_dir=str(tmp_path / "index"))
    src[3]  # maps a file in the parent, which the workers inherit
    ds = tg.Dataset(src)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=64,
        sampler=tg.GlobalShuffleSampler(ds, seed=1),
        num_workers=2,
        collate_fn=lambda b: [int.from_bytes(r["bytes"], "little") for r in b],
        multiprocessing_context="fork",
    )
    got = [i for b in loader for i in b]
    assert sorted(got) == list(range(64 * 16))


_BUILD = textwrap.dedent(
    """
    import json, os, sys, warnings
    sys.path.insert(0, sys.argv[1])
    warnings.simplefilter("ignore")
    import torchgrain as tg
    from torchgrain.sources.node_index import store
    store.BUILD_BYTES = 4 << 20  # what the build may hold of walked offsets

    def status():
        out = {}
        for line in open("/proc/self/status"):
            key, value = line.split(":", 1)
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) * 1024
        return out

    before = status()
    src = tg.TFRecordSource(sys.argv[2], codec="raw", index_dir=sys.argv[3])
    after = status()
    print(json.dumps({
        "records": len(src),
        "peak": after["VmHWM"] - before["VmRSS"],
        "kept": after["RssAnon"] - before["RssAnon"],
        "last": src[len(src) - 1]["bytes"].hex(),
    }))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_offsets_index_of_two_million_records_is_built_in_bounded_memory(tmp_path):
    n = 2_000_000
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.tfrecord").write_bytes(_frame(b"") * (n - 1) + _frame(b"end"))
    child = subprocess.run(
        [sys.executable, "-c", _BUILD, ROOT, str(d), str(tmp_path / "index")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert got["records"] == n and bytes.fromhex(got["last"]) == b"end"
    # 16 MB of offsets: streamed into the index file a chunk at a time (the peak here is
    # ~15 MiB, most of it the index file's copy buffer, whatever the count), nothing
    # per record kept once published. The previous code walked the file into a list of
    # Python ints: a peak of ~92 MiB and ~31 MiB kept.
    assert got["peak"] < 48 << 20, got
    assert got["kept"] < 4 << 20, got
