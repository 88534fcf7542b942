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


class _SlowCodec:
    """A codec of msgpack records with no column form whose decode takes 5 ms."""

    name = "slow"

    def __init__(self) -> None:
        from torchgrain.formats.codecs import get_codec

        self._inner = get_codec("msgpack")

    def decode(self, data):
        import time

        time.sleep(0.005)
        return self._inner.decode(data)

    def decode_batch(self, blobs):
        return None

    def decode_columns(self, buf, starts, ends):
        return None


@pytest.mark.parametrize("kind", ["arrayrecord", "tfrecord"])
def test_read_columns_counts_its_decoding_once(tmp_path, monkeypatch, kind):
    """A batch whose codec has no column form is decoded record by record: its decode
    time is counted once (it was counted twice: tg.stats showed 2x the wall time)."""
    import time

    import torchgrain as tg
    from torchgrain.formats.codecs import get_codec

    recs = [{"i": i} for i in range(12)]
    if kind == "arrayrecord":
        tg.write_array_record(recs, tmp_path / "d", num_shards=2)
        src = tg.ArrayRecordSource(tmp_path / "d", codec=_SlowCodec())
    else:
        (tmp_path / "d").mkdir()
        msgpack = get_codec("msgpack")
        write_tfrecord([msgpack.encode(r) for r in recs], str(tmp_path / "d" / "a.tfrecord"))
        src = tg.TFRecordSource(tmp_path / "d", codec=_SlowCodec(), index_dir=None)
    counted = []
    monkeypatch.setattr(
        "torchgrain.sources.format.count_decode", lambda s: counted.append(s), raising=True
    )
    if kind == "arrayrecord":
        monkeypatch.setattr(
            "torchgrain.sources.arrayrecord.count_decode", lambda s: counted.append(s)
        )
    t0 = time.perf_counter()
    cols = src.read_columns(list(range(12)))
    wall = time.perf_counter() - t0
    assert cols.records() == recs
    assert 0.05 <= sum(counted) <= wall, (counted, wall)
