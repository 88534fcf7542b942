"""Read errors of the built-in sources in the one wording: the record a batch's read
failed at (the first that fails alone, as FormatSource names it), and bad bytes that are
also a NotImplementedError (a transposed ArrayRecord chunk) named as bad bytes."""

import pytest

import torchgrain as tg
from tests.servers import RangeHTTPServer
from torchgrain.formats.tfrecord import write_tfrecord


def test_a_batch_read_names_the_record_whose_bytes_are_bad(tmp_path):
    path = tmp_path / "a.tfrecord"
    write_tfrecord([b"record-%03d" % i for i in range(10)], str(path))
    data = bytearray(path.read_bytes())
    data[5 * (16 + 10) + 12] ^= 0xFF  # record 5's payload: its data CRC fails
    path.write_bytes(bytes(data))
    with RangeHTTPServer(str(tmp_path)) as srv:
        for url in (str(path), f"{srv.url}/a.tfrecord"):
            src = tg.TFRecordSource(url, codec="raw", index_dir=None)
            assert src.__getitems__([4, 6]) == [{"bytes": b"record-004"}, {"bytes": b"record-006"}]
            for ask in ([5], [0, 5], [3, 4, 5, 6]):
                with pytest.raises(
                    tg.CorruptDataError, match=r"shard 0 of 1 '.*a\.tfrecord', record index 5\)"
                ):
                    src.__getitems__(ask)


def test_a_transposed_chunk_is_named_as_bad_bytes(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "t.array_record")
    w = ArrayRecordWriter(path, "group_size:2,transpose")
    for r in [b"a", b"b", b"c"]:
        w.write(r)
    w.close()
    src = tg.ArrayRecordSource(path, codec="raw", index_dir=None)
    for read in (lambda: src[1], lambda: src.__getitems__([1, 2])):
        with pytest.raises(
            tg.CorruptDataError, match=r"transposed.*\(ArrayRecord shard 0 of 1 .*record index 1\)"
        ):
            read()
