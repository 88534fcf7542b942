"""A filter's saved selection over a remote ArrayRecord dataset is not reused after the
dataset was re-uploaded with files of the same names and sizes: the selection's key knows
each remote shard by the checksum its manifest records, or, where the manifest records
none, by the version the server gives (before, a remote shard opened through its manifest
was known by its name and size only, and a new job got the old job's selection: records
that fail its predicate)."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer

JOB = textwrap.dedent(
    """
    import sys, torchgrain as tg
    url, index_dir = sys.argv[1], sys.argv[2]
    ds = tg.Dataset(tg.ArrayRecordSource(url))
    even = ds.filter(lambda r: int(r["v"][0]) % 2 == 0, index_dir=index_dir, progress=False)
    print([int(r["v"][0]) for r in even])
    """
)


def _write(root, base, checksums):
    d = os.path.join(root, "ds")
    records = [{"v": np.full(4, base + i, np.int64)} for i in range(40)]
    tg.write_array_record(records, d, num_shards=2, compression="uncompressed", overwrite=True)
    if not checksums:  # as a manifest written by other tools may be
        path = Path(d) / "torchgrain.json"
        doc = json.loads(path.read_text())
        for shard in doc["shards"]:
            shard.pop("checksum", None), shard.pop("file_checksum", None)
        path.write_text(json.dumps(doc))
    return {n: os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if "array_record" in n}


@pytest.mark.parametrize("checksums", [True, False], ids=["manifest_checksums", "none"])
def test_a_remote_dataset_uploaded_again_is_not_read_through_the_old_selection(tmp_path, checksums):
    root, index_dir = tmp_path / "www", tmp_path / "index"
    root.mkdir()
    (tmp_path / "job.py").write_text(JOB)
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1")
    with RangeHTTPServer(str(root)) as srv:

        def job():
            run = subprocess.run(
                [sys.executable, str(tmp_path / "job.py"), srv.url + "/ds", str(index_dir)],
                capture_output=True,
                text=True,
                timeout=180,
                env=env,
            )
            assert run.returncode == 0, run.stderr[-2000:]
            return json.loads(run.stdout.strip().splitlines()[-1])

        sizes = _write(str(root), 0, checksums)
        assert job() == list(range(0, 40, 2))
        time.sleep(1.1)  # (a new Last-Modified)
        assert _write(str(root), 1, checksums) == sizes  # the same names and sizes
        assert job() == list(range(2, 41, 2))


def test_a_remote_dataset_keeps_its_selection_key_after_its_shards_are_read(tmp_path):
    root = tmp_path / "www"
    _write(str(root), 0, True)
    calls = []

    def even(r):
        calls.append(1)
        return int(r["v"][0]) % 2 == 0

    with RangeHTTPServer(str(root)) as srv:
        src = tg.ArrayRecordSource(srv.url + "/ds", index_dir=None)
        ds = tg.Dataset(src)
        first = ds.filter(even, name="even", index_dir=str(tmp_path / "ix"), progress=False)
        assert len(calls) == 40 and len(first) == 20
        src[0]  # (every shard was read: its version pinned)
        again = ds.filter(even, name="even", index_dir=str(tmp_path / "ix"), progress=False)
        assert len(calls) == 40 and len(again) == 20  # the saved selection, not built again
