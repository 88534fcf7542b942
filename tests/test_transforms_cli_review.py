"""Reproducible augmentation and the command line against hostile use: draws that depend on
what a worker read before, caches cleared by an empty or foreign name, a FIFO in a dataset
directory, a conversion over an existing dataset."""

from __future__ import annotations

import os
import threading

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # no online version check

import albumentations as A
import numpy as np
import pyarrow.parquet as pq
import pytest

import torchgrain as tg
from torchgrain.cli import main
from torchgrain.dataset import record_rng


# ------------------------------------------------------------------ augmentation
def test_albumentations_draws_do_not_depend_on_the_record_read_before():
    # random.Random.gauss keeps its second normal for the next call: a record's
    # augmentation took the previous record's draw, so it changed with the order a
    # worker read records in (workers, batch size, resume point).
    aug = A.Compose([A.PlanckianJitter(sampling_method="gaussian", p=1)])
    recs = [{"image": np.full((8, 8, 3), 128, np.uint8)} for _ in range(4)]

    def augmented():
        return tg.Dataset(recs).random_map(tg.Albumentations(aug), seed=0)

    alone = augmented()[2]["image"]
    after_another = augmented()
    after_another[1]
    assert np.array_equal(after_another[2]["image"], alone)


def test_random_map_reading_another_augmented_dataset_keeps_its_own_draws():
    partner = tg.Dataset([{"x": float(i)} for i in range(4)]).random_map(
        lambda r, rng: {"x": r["x"] + rng.random()}, seed=1
    )

    def mixup(rec, rng):
        other = partner[int(rng.integers(2))]
        return {**rec, "lam": rng.random(), "other": other["x"]}

    ds = tg.Dataset([{"x": float(i)} for i in range(40)]).random_map(mixup, seed=0)
    lams = [ds[i]["lam"] for i in range(40)]
    expected = []
    for i in range(40):  # the generator random_map documents: (seed, epoch, index) alone
        rng = record_rng(0, 0, i)
        rng.integers(2)
        expected.append(rng.random())
    assert len(set(lams)) == 40  # 2 distinct values (one per partner) before
    assert lams == expected


# ------------------------------------------------------------------ cache clear
def _root_with_caches(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    (root / "filter-index").mkdir(parents=True)
    (root / "filter-index" / "k.tgindex").write_bytes(b"x" * 10)
    (root / "demo-10").mkdir()
    (root / "demo-10" / "data.array_record").write_bytes(b"y")
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(root))
    return root


def test_cache_clear_of_an_empty_name_clears_nothing(tmp_path, monkeypatch, capsys):
    # `torchgrain cache clear "$NAME"` with NAME unset: the root joined with "" was
    # taken for a cache, and every cache under it was deleted.
    root = _root_with_caches(tmp_path, monkeypatch)
    assert main(["cache", "clear", ""]) == 2
    assert "no cache ''" in capsys.readouterr().err
    assert (root / "filter-index" / "k.tgindex").read_bytes() == b"x" * 10
    assert (root / "demo-10" / "data.array_record").exists()


def test_cache_clear_leaves_a_directory_under_the_root_that_is_no_cache(
    tmp_path, monkeypatch, capsys
):
    # $TORCHGRAIN_CACHE on a scratch disk that also holds a dataset: `cache list` shows
    # it as "other", and clearing it by name or with --all deleted the dataset.
    root = _root_with_caches(tmp_path, monkeypatch)
    tg.write_array_record([{"x": 1}], root / "imagenet")
    assert main(["cache", "clear", "imagenet"]) == 2
    assert "not a torchgrain cache" in capsys.readouterr().err
    assert main(["cache", "clear", "--all"]) == 0
    assert tg.ArrayRecordSource(str(root / "imagenet"))[0] == {"x": 1}
    assert not (root / "filter-index" / "k.tgindex").exists()  # the caches are cleared
    assert not (root / "demo-10" / "data.array_record").exists()


# ------------------------------------------------------------------ inspect, convert
def test_inspect_of_a_directory_holding_a_fifo_never_opens_it(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    tg.write_array_record([{"x": np.arange(3)} for _ in range(4)], data)
    (data / "torchgrain.json").unlink()  # the shards are found by listing the directory
    fifo = data / "zz.array_record"
    os.mkfifo(fifo)
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))
    result: dict[str, int] = {}
    t = threading.Thread(
        target=lambda: result.setdefault("rc", main(["inspect", str(data)])), daemon=True
    )
    t.start()
    opened = 0
    while t.is_alive():
        try:  # succeeds only while a reader has the FIFO open (or is blocked opening it)
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            t.join(0.05)
            continue
        opened += 1
        os.close(fd)  # the reader sees an empty file and goes on
    assert opened == 0, "inspect opened the FIFO: without a writer it waits forever"
    assert result["rc"] == 0 or "zz.array_record" in capsys.readouterr().err


def test_a_fifo_named_as_a_path_is_refused_and_a_link_to_a_shard_is_listed(tmp_path):
    data = tmp_path / "data"
    tg.write_parquet([{"x": i} for i in range(3)], data)
    (shard,) = data.glob("*.parquet")
    os.mkfifo(data / "zz.parquet")
    with pytest.raises(tg.DatasetNotFoundError, match=r"zz\.parquet' is not a regular file"):
        tg.ParquetSource(str(data / "zz.parquet"))  # (it said: does not exist)
    os.symlink(shard.name, data / "link.parquet")  # a link to a regular file is data
    assert len(tg.ParquetSource(str(data))) == 6


@pytest.mark.parametrize(
    "command",
    [
        ["inspect", "--samples", "0"],
        ["convert", "-q", "{out}"],
    ],
    ids=["inspect", "convert"],
)
def test_a_recursive_glob_over_a_directory_with_links_to_itself_is_checked_in_bounded_time(
    command, tmp_path, monkeypatch
):
    data = tmp_path / "data"
    tg.write_parquet([{"x": i} for i in range(3)], data)
    os.symlink(".", data / "a")
    os.symlink(".", data / "b")
    scandir, calls = os.scandir, []

    def counted(path="."):  # a count, not a clock: the walk is exponential, not slow
        calls.append(path)
        if len(calls) > 5_000:
            raise RuntimeError(f"{len(calls)} directories listed: {os.fspath(path)[-60:]}")
        return scandir(path)

    monkeypatch.setattr(os, "scandir", counted)
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))
    name, *options = (a.format(out=tmp_path / "out") for a in command)
    assert main([name, f"{data}/**/*.parquet", *options]) == 0


def test_inspect_never_sends_the_datas_control_characters_to_the_terminal(tmp_path, capsys):
    # A key that sets the terminal's title and erases the line it is printed on.
    key = "\x1b]0;owned\x07\x1b[2Kx"
    tg.write_array_record([{key: 1, "b": b"\x1b[31m"}], tmp_path / "d")
    assert main(["inspect", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert repr(key) in out  # shown escaped, as Python writes it


def test_convert_to_parquet_refuses_a_directory_holding_a_parquet_dataset(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    tg.write_parquet([{"x": i} for i in range(5)], src)
    tg.write_parquet([{"y": "precious"}], dst)
    (shard,) = dst.glob("*.parquet")
    with pytest.raises(FileExistsError):
        tg.convert(str(src), str(dst), to="parquet")
    assert pq.read_table(shard).to_pylist() == [{"y": "precious"}]


def test_convert_names_the_file_it_would_replace_and_replaces_it_with_overwrite(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    tg.write_array_record([{"x": i} for i in range(5)], src)
    tg.write_array_record([{"y": "precious"}], dst)
    (dst / "torchgrain.json").unlink()  # shards without a manifest are someone's data too
    (shard,) = dst.glob("*.array_record")
    with pytest.raises(FileExistsError, match=f"holds '{shard.name}'"):
        tg.convert(str(src), str(dst))
    assert not (dst / ".torchgrain-convert").exists()  # the journal it made is gone
    tg.convert(str(src), str(dst), overwrite=True)
    assert [r["x"] for r in tg.ArrayRecordSource(str(dst))] == list(range(5))


def test_demo_never_replaces_a_dataset_that_is_not_its_own(tmp_path, monkeypatch):
    data = tmp_path / "train"
    tg.write_array_record([{"text": f"precious {i}"} for i in range(20)], data, num_shards=2)
    monkeypatch.setenv("TORCHGRAIN_CACHE", str(tmp_path / "cache"))
    args = "--num-records 16 --batch-size 8 --epochs 1 --workers 0 --max-steps 1 --device cpu"
    main(["demo", "--data-dir", str(data), *args.split()])
    src = tg.ArrayRecordSource(str(data))
    assert (len(src), src.keys) == (20, ["text"])


_FIFO_SHARD = """
import os, sys, warnings
warnings.simplefilter("ignore")
import numpy as np, torchgrain as tg
d, ix = sys.argv[1], sys.argv[2]
tg.write_array_record([{"i": np.int64(i)} for i in range(20)], d, num_shards=2)
tg.ArrayRecordSource(d, index_dir=ix)[0]  # the index: counts from the files
first = os.path.join(d, sorted(f for f in os.listdir(d) if f.endswith(".array_record"))[0])
os.unlink(first)
os.mkfifo(first)
try:
    tg.ArrayRecordSource(d, index_dir=ix)[0]
except tg.CorruptDataError as e:
    print("refused:", e)
"""


def test_a_fifo_in_place_of_a_shard_a_manifest_names_is_refused_not_waited_on(tmp_path):
    """A shard replaced by a FIFO, named by the dataset's manifest (no listing): opening
    it waited for a writer forever; it is a CorruptDataError naming it (a child with a
    deadline: a hang fails the test, not the run)."""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-c", _FIFO_SHARD, str(tmp_path / "ds"), str(tmp_path / "ix")],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(tg.__file__))),
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "refused:" in p.stdout and "is not a regular file" in p.stdout, p.stdout
