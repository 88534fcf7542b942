"""Hostile metadata and records met as torchgrain errors, not as the exceptions of the
code that parses them: TFDS feature specs whose dimensions or dtypes numpy cannot take
(an OverflowError, a SyntaxError) or that would make a record of a few bytes decode to
gigabytes; a manifest whose dataset-index checksum names an unknown algorithm; a msgpack
ndarray dtype numpy parses as Python (``decode_columns``)."""

import json
import struct

import msgpack
import numpy as np
import pytest

import torchgrain as tg
from torchgrain.formats.codecs import MsgpackCodec
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfrecord import write_tfrecord
from torchgrain.io.retry import RetryPolicy


def _tfds(d, dtype, dims, values):
    spec = {"tensor": {"shape": {"dimensions": dims}, "dtype": dtype}}
    features = {"featuresDict": {"features": {"x": spec}}}
    (d / "features.json").write_text(json.dumps(features))
    write_tfrecord([encode_tf_example({"x": values})], str(d / "ds-train.tfrecord-00000-of-00001"))


@pytest.mark.parametrize(
    ("dtype", "dims"), [("float32", [float("inf")]), ("i4,(", ["2"])], ids=["inf", "syntax"]
)
def test_a_tfds_spec_numpy_cannot_take_is_a_corrupt_dataset(tmp_path, dtype, dims):
    _tfds(tmp_path, dtype, dims, [1.0, 2.0])
    try:
        src = tg.TFRecordSource(str(tmp_path), index_dir=None)
    except tg.CorruptDataError as e:
        assert "features.json" in str(e)
        return
    with pytest.raises(tg.RecordDecodeError, match=r"ds-train.*row 0"):
        src[0]


def test_a_tfds_dtype_of_any_width_does_not_decode_a_few_bytes_to_gigabytes(tmp_path):
    _tfds(tmp_path, "U500000000", ["3"], [1.0, 2.0, 3.0])  # 3 x 2 GB
    src = tg.TFRecordSource(str(tmp_path), index_dir=None)
    with pytest.raises(tg.RecordDecodeError, match="bytes a tensor may decode to"):
        src[0]


def test_a_manifest_index_checksum_of_an_unknown_algorithm_is_not_trusted(tmp_path):
    d = tmp_path / "ds"
    tg.write_array_record([{"x": i} for i in range(4)], str(d), num_shards=1)
    doc = json.loads((d / "torchgrain.json").read_text())
    assert doc["index"]["file_checksum"].startswith("blake2b-file:")
    doc["index"]["file_checksum"] = doc["index"]["file_checksum"].replace("blake2b", "blaoe2b")
    (d / "torchgrain.json").write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match="unknown checksum algorithm 'blaoe2b-file'"):
        src = tg.ArrayRecordSource(str(d), index_dir=None)  # (the shards indexed instead)
    assert src.__getitems__([3, 0]) == [{"x": 3}, {"x": 0}]


def test_a_msgpack_dtype_numpy_parses_as_python_is_left_to_the_records():
    dt = b"i4,("
    payload = struct.pack("<B", len(dt)) + dt + bytes([1]) + struct.pack("<Q", 1) + bytes(4)
    rec = msgpack.packb({"x": msgpack.ExtType(1, payload)})
    codec = MsgpackCodec()
    buf = np.frombuffer(rec, np.uint8)
    assert codec.decode_columns(buf, np.array([0]), np.array([len(rec)])) is None
    with pytest.raises(tg.RecordDecodeError):
        codec.decode(rec)


def test_reading_a_remote_tfrecord_in_order_keeps_to_the_source_retry_policy(tmp_path):
    from tests.servers import RangeHTTPServer

    write_tfrecord([b"x" * 100] * 50, str(tmp_path / "d.tfrecord"))
    policy = RetryPolicy(attempts=2, base_delay=0.01, deadline=30)
    with RangeHTTPServer(str(tmp_path)) as srv:
        src = tg.TFRecordSource(f"{srv.url}/d.tfrecord", codec="raw", index_dir=None, retry=policy)
        srv.reset_counts()
        srv.fail_next(20, "503")  # (transient: retried, as the policy says)
        with pytest.raises(tg.RemoteIOError, match="after 2 attempts"):
            list(src.iter_shard(0))
        assert srv.gets() == 2  # (the default policy made 6)
