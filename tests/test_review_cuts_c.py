"""Behaviour that the line cuts in torchgrain/formats and the node indexes must keep: how a
TFDS tensor takes its spec's dtype, the metadata a derived index's ``fill`` returns, and the
work of encoding an ndarray or a scalar Example feature, of reading one TFRecord record
from an open file and of making an ArrayRecord footer's arrays."""

from __future__ import annotations

import contextlib

import _riegeli as R
import numpy as np
import pytest

from torchgrain.errors import RecordDecodeError
from torchgrain.formats import tf_example
from torchgrain.formats.arrayrecord_file import ArrayRecordFile
from torchgrain.formats.codecs import MsgpackCodec
from torchgrain.formats.tf_example import encode_tf_example
from torchgrain.formats.tfds import TFDSCodec
from torchgrain.formats.tfrecord import read_tfrecord_at, write_tfrecord
from torchgrain.sources.node_index.derived import derived_index


def _codec(dtype: str) -> TFDSCodec:
    tensor = {"shape": {"dimensions": ["-1"]}, "dtype": dtype}
    return TFDSCodec({"featuresDict": {"features": {"x": {"tensor": tensor}}}})


def test_a_datetime_tensor_of_bytes_that_are_no_date_names_them():
    with pytest.raises(RecordDecodeError, match="'x'") as e:
        _codec("datetime64").decode(encode_tf_example({"x": [b"abc"]}))
    assert "abc" in str(e.value)


def test_a_datetime_tensor_of_bytes_not_utf8_fails_as_a_parse_error():
    with pytest.raises(RecordDecodeError, match="'x'") as e:
        _codec("datetime64[s]").decode(encode_tf_example({"x": [b"\xff"]}))
    assert type(e.value.__cause__) is ValueError
    assert "datetime" in str(e.value)


@pytest.mark.parametrize("dtype", ["S", "U"])
def test_an_empty_feature_of_an_unsized_string_tensor_keeps_its_dtype(dtype):
    got = _codec(dtype).decode(encode_tf_example({"x": []}))["x"]
    assert got.shape == (0,)
    assert got.dtype == np.asarray([]).astype(dtype).dtype


def test_a_derived_index_takes_metadata_returned_as_pairs():
    def fill(sink):
        sink.append("kept", np.arange(3, dtype="<u4"))
        return [("n", 3)]

    ix = derived_index("demo", "pairs1", {"kept": ("<u4", ())}, fill, index_dir=None)
    assert ix.meta["n"] == 3
    assert ix.meta["key"] == "pairs1"
    assert ix.arrays["kept"].tolist() == [0, 1, 2]


def test_an_ndarray_is_encoded_without_another_conversion(monkeypatch):
    calls = []
    real = np.asarray

    def counted(*args, **kwargs):
        calls.append(type(args[0]).__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "asarray", counted)
    data = MsgpackCodec().encode({"x": np.arange(4, dtype=np.int32)})
    monkeypatch.undo()
    assert MsgpackCodec().decode(data)["x"].tolist() == [0, 1, 2, 3]
    assert calls == []


def test_a_record_read_from_an_open_file_enters_no_exit_stack(monkeypatch, tmp_path):
    p = str(tmp_path / "a.tfrecord")
    write_tfrecord([b"ab", b"cde"], p)
    made = []

    class Counted(contextlib.ExitStack):
        def __init__(self) -> None:
            made.append(1)
            super().__init__()

    monkeypatch.setattr(contextlib, "ExitStack", Counted)
    with open(p, "rb") as f:
        assert read_tfrecord_at(f, 18) == b"cde"
    assert made == []


def test_a_bytes_str_or_float_scalar_feature_is_classified_once(monkeypatch):
    calls = []
    real = tf_example._classify

    def counted(name, value):
        calls.append(name)
        return real(name, value)

    monkeypatch.setattr(tf_example, "_classify", counted)
    data = encode_tf_example({"b": b"abc", "s": "t", "f": 1.5})
    monkeypatch.undo()
    assert tf_example.decode_tf_example(data, squeeze=True) == {"b": b"abc", "s": b"t", "f": 1.5}
    assert calls == ["b", "s", "f"]


def test_a_footer_makes_its_arrays_without_np_append(monkeypatch, tmp_path):
    p = str(tmp_path / "a.array_record")
    recs = [b"r%d" % i for i in range(10)]
    R.write(p, [R.Chunk(recs[a : a + 4], "none") for a in range(0, 10, 4)])
    calls = []
    real = np.append

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "append", counted)
    f = ArrayRecordFile(p)
    assert f.record_offsets.tolist() == [0, 4, 8, 10]
    assert f.read([9, 0]) == [b"r9", b"r0"]
    monkeypatch.undo()
    assert calls == []
