"""A Parquet footer that pyarrow reads but cannot serialize again (a column order cut
short: pyarrow 26 kills the process with SIGSEGV when it re-serializes it) is opened and
read from its own bytes."""

import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq


def _cut_column_order(path):
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[-8:-4], "little")
    # column_orders (field 7, a list of 6 ColumnOrder unions "1c 00 00") ends the footer:
    # zero the second union's field header, so the bytes left over read as another field.
    i = data.index(b"\x19\x6c\x1c\x00\x00\x1c\x00\x00", len(data) - 8 - n) + 5
    data[i] = 0
    path.write_bytes(bytes(data))


def test_a_footer_pyarrow_cannot_serialize_again_is_read_from_its_bytes(tmp_path):
    table = pa.table({c: [1, 2, 3] for c in "abcdef"})
    pq.write_table(table, tmp_path / "x.parquet")
    _cut_column_order(tmp_path / "x.parquet")
    assert pq.read_table(tmp_path / "x.parquet").equals(table)  # pyarrow reads it
    code = textwrap.dedent(
        f"""
        import pickle, torchgrain as tg
        src = tg.ParquetSource({str(tmp_path)!r}, columns=["a", "c"])
        again = pickle.loads(pickle.dumps(src))
        print(src.__getitems__([2, 0]), again[1], len(tg.ParquetSource({str(tmp_path)!r})))
        """
    )
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1")
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.strip() == "[{'a': 3, 'c': 3}, {'a': 1, 'c': 1}] {'a': 2, 'c': 2} 3"
