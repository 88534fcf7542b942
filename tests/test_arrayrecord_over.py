"""ArrayRecordFile.over: a reader over another's map, built without handles of its own."""

from __future__ import annotations

import _riegeli as R

from torchgrain.formats.arrayrecord_file import ArrayRecordFile


def test_a_reader_over_a_map_has_a_fresh_readers_state_and_likes_contexts(tmp_path):
    file = str(tmp_path / "a.array_record")
    R.write(file, [R.Chunk([b"rec %d" % i], "zstd") for i in range(3)])
    like = ArrayRecordFile(file)
    like.read_range(0, 3)  # its map, handles and contexts made
    f = ArrayRecordFile.over(like._local_view(), file, like._ensure_footer(), like)
    fresh = ArrayRecordFile(file)
    assert vars(f).keys() == vars(fresh).keys()
    shared = {"_lock", "_token", "_tls", "_view", "_footer", "_fast", "_fs", "_path"}
    assert {k: v for k, v in vars(f).items() if k not in shared} == {
        k: v for k, v in vars(fresh).items() if k not in shared
    }
    assert f._tls is like._tls and f._lock is like._lock
    assert f.chunk_record(2) == b"rec 2"
