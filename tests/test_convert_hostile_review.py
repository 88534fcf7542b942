"""A conversion's output directory is data: a plan, journal record or journal
directory left there (by a crash, by hand, by someone else) must not make a resumed
conversion write outside the directory, publish a dataset mixing shards, or fail
with a bare JSON/KeyError."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.errors import TorchgrainError


def _src(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        pq.write_table(
            pa.table({"id": list(range(i * 10, i * 10 + 10))}), src / f"part-{i}.parquet"
        )
    return src


def _converted(tmp_path):
    src, dst = _src(tmp_path), tmp_path / "dst"
    tg.convert(src, dst, num_shards=2)
    return src, dst, dst / ".torchgrain-convert"


def _ids(dst):
    s = tg.ArrayRecordSource(dst)
    return [int(s[i]["id"]) for i in range(len(s))]


def test_plan_naming_a_file_outside_is_refused(tmp_path):
    src, dst, jdir = _converted(tmp_path)
    outside = tmp_path / "outside.array_record"
    plan = json.loads((jdir / "plan.json").read_text())
    plan["tasks"][0]["name"] = str(outside)
    (jdir / "plan.json").write_text(json.dumps(plan))
    (jdir / "shard-00000.json").unlink()
    with pytest.raises(TorchgrainError, match=r"plan\.json"):
        tg.convert(src, dst, num_shards=2)
    assert not outside.exists()


def test_plan_with_other_pieces_is_refused(tmp_path):
    # Task 0 made of input 1 too: record 10..19 twice, 0..9 never, counts adjusted.
    src, dst, jdir = _converted(tmp_path)
    plan = json.loads((jdir / "plan.json").read_text())
    plan["tasks"][0]["pieces"] = [[1, 0, 10]]
    (jdir / "plan.json").write_text(json.dumps(plan))
    (jdir / "shard-00000.json").unlink()
    with pytest.raises(TorchgrainError, match=r"plan\.json"):
        tg.convert(src, dst, num_shards=2)


def test_record_naming_another_shard_is_not_taken(tmp_path):
    src, dst, jdir = _converted(tmp_path)
    r1 = json.loads((jdir / "shard-00001.json").read_text())
    (jdir / "shard-00000.json").write_text(json.dumps({**r1, "index": 0}))
    tg.convert(src, dst, num_shards=2)
    assert _ids(dst) == list(range(20))


def test_record_naming_a_file_outside_is_not_taken(tmp_path):
    src, dst, jdir = _converted(tmp_path)
    r0 = json.loads((jdir / "shard-00000.json").read_text())
    outside = tmp_path / "outside.array_record"
    os.replace(dst / r0["path"], outside)
    (jdir / "shard-00000.json").write_text(json.dumps({**r0, "path": "../" + outside.name}))
    tg.convert(src, dst, num_shards=2)
    m = json.loads((dst / "torchgrain.json").read_text())
    assert all("/" not in s["path"] for s in m["shards"])
    assert _ids(dst) == list(range(20))


def test_corrupt_plan_is_a_named_error(tmp_path):
    src, dst, jdir = _converted(tmp_path)
    (jdir / "plan.json").write_text('{"tasks": [')
    with pytest.raises(TorchgrainError, match=r"plan\.json"):
        tg.convert(src, dst, num_shards=2)
    (jdir / "plan.json").write_text("[]")
    with pytest.raises(TorchgrainError, match=r"plan\.json"):
        tg.convert(src, dst, num_shards=2)


def test_corrupt_record_is_redone(tmp_path):
    src, dst, jdir = _converted(tmp_path)
    (jdir / "shard-00000.json").write_text("{")
    (jdir / "shard-00001.json").write_text('{"index": 1}')
    tg.convert(src, dst, num_shards=2)
    assert _ids(dst) == list(range(20))


def test_journal_dir_linked_elsewhere_is_refused(tmp_path):
    src = _src(tmp_path)
    dst, elsewhere = tmp_path / "dst", tmp_path / "elsewhere"
    dst.mkdir()
    elsewhere.mkdir()
    (dst / ".torchgrain-convert").symlink_to(elsewhere)
    with pytest.raises(TorchgrainError, match=r"\.torchgrain-convert"):
        tg.convert(src, dst, num_shards=2)
    assert os.listdir(elsewhere) == []


@pytest.mark.parametrize("name", ["sub", "a\x00b", "x" * 5000])
def test_overwrite_skips_plan_names_that_are_not_files(tmp_path, name):
    src, dst, jdir = _converted(tmp_path)
    (dst / "sub").mkdir()
    plan = json.loads((jdir / "plan.json").read_text())
    plan["fingerprint"]["options"]["group_size"] = 2  # another conversion's plan
    plan["tasks"][0]["name"] = name
    (jdir / "plan.json").write_text(json.dumps(plan))
    tg.convert(src, dst, num_shards=2, overwrite=True)
    assert _ids(dst) == list(range(20))
    assert (dst / "sub").is_dir()


def test_run_refused_the_lock_leaves_the_other_runs_journal(tmp_path, monkeypatch):
    import fcntl
    import sys

    conv = sys.modules["torchgrain.convert"]  # the package (tg.convert is the function)

    src, dst = _src(tmp_path), tmp_path / "dst"
    jdir = dst / ".torchgrain-convert"
    real = conv.locked
    held = []

    def racing(journal):
        # Another conversion into the same new directory takes the lock first.
        jdir.mkdir(exist_ok=True)
        fd = os.open(jdir / "lock", os.O_RDWR | os.O_CREAT)
        held.append(fd)
        fcntl.flock(fd, fcntl.LOCK_EX)
        (jdir / "plan.json").write_text('{"fingerprint": {}, "counts": [], "tasks": []}')
        return real(journal)

    monkeypatch.setattr(conv, "locked", racing)
    try:
        with pytest.raises(TorchgrainError, match="another conversion"):
            tg.convert(src, dst, num_shards=2)
        assert (jdir / "lock").exists() and (jdir / "plan.json").exists()
    finally:
        for fd in held:
            os.close(fd)


def test_finished_shards_swapped_are_not_taken(tmp_path):
    # Two shards of one size swapped (or one replaced by a copy of another): a rerun
    # published them in the wrong order.
    src, dst, _ = _converted(tmp_path)
    a, b = (dst / s.path for s in tg.ArrayRecordSource(dst).manifest.shards)
    assert a.stat().st_size == b.stat().st_size
    os.rename(a, tmp_path / "a")
    os.rename(b, a)
    os.rename(tmp_path / "a", b)
    tg.convert(src, dst, num_shards=2)
    assert _ids(dst) == list(range(20))


def test_input_rewritten_with_its_size_and_mtime_is_not_mixed(tmp_path):
    # A crash after shard 0; the two inputs' bytes exchanged (same sizes, their mtimes restored,
    # as cp -p or rsync -t do); the rerun kept the old shard 0 beside a new shard 1.
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    for i in range(2):  # files of one size
        t = pa.table({"id": [f"r{i}{k}" for k in range(10)]})
        pq.write_table(t, src / f"part-{i}.parquet", write_statistics=False)
    tg.convert(src, dst, num_shards=2)
    (dst / ".torchgrain-convert" / "shard-00001.json").unlink()
    p0, p1 = src / "part-0.parquet", src / "part-1.parquet"
    st0, st1 = p0.stat(), p1.stat()
    assert st0.st_size == st1.st_size
    b0, b1 = p0.read_bytes(), p1.read_bytes()
    p0.write_bytes(b1)
    p1.write_bytes(b0)
    os.utime(p0, ns=(st0.st_atime_ns, st0.st_mtime_ns))
    os.utime(p1, ns=(st1.st_atime_ns, st1.st_mtime_ns))
    try:
        tg.convert(src, dst, num_shards=2)
    except (TorchgrainError, FileExistsError):  # FileExistsError: "of other inputs"
        return
    s = tg.ArrayRecordSource(dst)
    ids = [s[i]["id"] for i in range(len(s))]
    old = [f"r{i}{k}" for i in range(2) for k in range(10)]
    assert ids in (old, old[10:] + old[:10])


def test_overwrite_replaces_a_corrupt_manifest(tmp_path):
    src, dst = _src(tmp_path), tmp_path / "dst"
    dst.mkdir()
    (dst / "torchgrain.json").write_text("{not json")
    with pytest.raises(TorchgrainError, match=r"torchgrain\.json"):
        tg.convert(src, dst, num_shards=2)
    tg.convert(src, dst, num_shards=2, overwrite=True)
    assert _ids(dst) == list(range(20))


def test_a_directory_under_a_temp_name_is_not_unlinked(tmp_path):
    src, dst = _src(tmp_path), tmp_path / "dst"
    (dst / ".x.tmp-1.array_record").mkdir(parents=True)
    tg.convert(src, dst, num_shards=2)
    assert _ids(dst) == list(range(20))
