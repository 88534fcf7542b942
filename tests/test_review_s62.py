"""Review of the format contract's new capabilities (TFRecordSource on FormatSource): a
node-shared TFRecord index truncated under a running job is refused by every read of
the index, in-order reads and block offsets included (they read its map: SIGBUS)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from torchgrain.formats.tfrecord import write_tfrecord

_TRUNCATED = r"""
import glob, os, sys
sys.path.insert(0, sys.argv[1])
import torchgrain as tg

d, ix, what = sys.argv[2:5]
src = tg.TFRecordSource(d, codec="raw", index_dir=ix)
src.__getitems__([0, 5])
(main,) = glob.glob(os.path.join(ix, "tfrecord-*.tgindex"))
os.truncate(main, 0)
try:
    if what == "iter_shard":
        list(src.iter_shard(1))
    else:
        src.block_offsets()
except Exception as e:
    print("REFUSED", type(e).__name__, e)
else:
    print("READ")
"""


@pytest.mark.parametrize("what", ["iter_shard", "block_offsets"])
def test_reads_in_order_refuse_a_truncated_index(tmp_path, what):
    d = tmp_path / "d"
    d.mkdir()
    for f in range(3):
        write_tfrecord([f"r{f}_{i}".encode() * 50 for i in range(400)], str(d / f"p{f}.tfrecord"))
    root = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    got = subprocess.run(
        [sys.executable, "-c", _TRUNCATED, root, str(d), str(tmp_path / "ix"), what],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, (got.returncode, got.stderr[-2000:])  # -7: SIGBUS
    assert "REFUSED ChangedWhileOpen" in got.stdout, got.stdout
