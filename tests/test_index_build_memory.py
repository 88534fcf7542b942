"""Building the node index of foreign ArrayRecord files: bounded memory, order, progress.

The first process of a machine that opens ArrayRecord files without torchgrain's
manifest builds the node-shared index from every shard's footer
(:func:`torchgrain.sources.node_index.build_arrayrecord_index`). It streams: the shards
are read by threads, each footer written into the index file as soon as those before
it are, with at most ``store.BUILD_BYTES`` of parsing in flight, whatever the number
of records; a long build says how far it has got on stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import torchgrain
import torchgrain as tg
from torchgrain.errors import CorruptDataError
from torchgrain.sources.node_index import arrayrecord, arrayrecord_index, store

TG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torchgrain.__file__)))


def _foreign_dataset(directory, per_shard: int, shards: int) -> list[str]:
    """``shards`` copies of one group_size:1 shard of ``per_shard`` one-byte records,
    written by array_record's C++ writer in a process of its own (which never forks
    after importing it), without torchgrain's manifest."""
    os.makedirs(directory)
    first = os.path.join(directory, "part-00000.array_record")
    code = textwrap.dedent(f"""
        from array_record.python.array_record_module import ArrayRecordWriter
        w = ArrayRecordWriter({first!r}, "group_size:1")
        for i in range({per_shard}):
            w.write(b"x")
        w.close()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    paths = [first]
    for k in range(1, shards):
        paths.append(os.path.join(directory, f"part-{k:05d}.array_record"))
        shutil.copyfile(first, paths[-1])
    return paths


_CHILD = textwrap.dedent("""
    import json, sys
    import torchgrain  # the interpreter and its imports are the baseline
    from torchgrain.sources.node_index import arrayrecord_index, store

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024

    store.BUILD_BYTES = int(sys.argv[3])  # an attribute the earlier code did not read
    paths = json.loads(sys.argv[1])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident size, to the current size
    base = status("VmRSS")
    ix = arrayrecord_index(paths, index_dir=sys.argv[2])
    print(json.dumps({"peak": status("VmHWM") - base, "counts": ix.counts.tolist()}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_the_build_of_2m_records_peaks_within_its_budget(tmp_path):
    """2*10^6 records in 16 shards: the earlier code parsed the footers of a batch of
    256 shards at once and held them all until the batch was written (peak 380-390 MiB
    here, ~200 bytes a record); the build now holds at most BUILD_BYTES (24 MiB here)
    of footers in flight, written into the index file as they come. Peak resident
    memory of a fresh building process beyond its imports, the index file's mapped
    pages included: under 160 MiB (65 MiB measured)."""
    per, shards = 125_000, 16
    paths = _foreign_dataset(tmp_path / "d", per, shards)
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(paths), str(tmp_path / "ix"), str(24 << 20)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # torchgrain from TG_ROOT, not from the current directory
        env=dict(os.environ, PYTHONPATH=TG_ROOT, PYTHONWARNINGS="ignore"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["counts"] == [per] * shards
    assert got["peak"] < 160 << 20, f"peak {got['peak'] / 2**20:.0f} MiB beyond the imports"


def test_shards_start_in_order_within_the_budget_and_the_first_error_is_raised():
    """_in_order: results in order whatever the threads' timing, the cost of work
    started and not yet consumed never over the budget (one over-budget item runs
    alone), and the first failing item's error raised, later items never started."""
    rng = np.random.default_rng(0)
    delays = rng.uniform(0, 0.01, 40)
    costs = [30] * 40
    costs[7] = 500  # over the budget alone: let in alone
    lock = threading.Lock()
    held = [0]
    peak = [0]

    def peek(i):
        time.sleep(delays[i])
        return i, costs[i]

    def work(i):
        with lock:
            held[0] += costs[i]
            peak[0] = max(peak[0], held[0] if i != 7 else 0)
            assert i != 7 or held[0] == costs[7], "an over-budget item ran beside others"
        time.sleep(delays[-1 - i])
        return i

    out = []
    for i in store.in_order(40, peek, work, budget=100, max_workers=6):
        out.append(i)
        with lock:
            held[0] -= costs[i]
    assert out == list(range(40))
    assert 0 < peak[0] <= 100

    started = []

    def failing(i):
        with lock:
            started.append(i)
        if i == 5:
            raise CorruptDataError("shard 5 is damaged")
        return i

    got = []
    with pytest.raises(CorruptDataError, match="shard 5"):
        for i in store.in_order(200, lambda i: (i, 1), failing, budget=3, max_workers=4):
            got.append(i)
    assert got == [0, 1, 2, 3, 4]
    assert max(started) < 5 + 3 + 4  # nothing far past the error was read


def test_a_slow_build_reports_progress_on_stderr_and_a_fast_one_is_silent(
    tmp_path, monkeypatch, capfd
):
    d = tmp_path / "d"
    tg.write_array_record([{"x": i} for i in range(40)], d, num_shards=8)
    paths = sorted(str(p) for p in d.glob("*.array_record"))

    # Fast (a few milliseconds, against the 2 s before the first line): nothing said.
    ix = arrayrecord_index(paths, index_dir=str(tmp_path / "fast"))
    assert ix.counts.sum() == 40
    assert "indexing" not in capfd.readouterr().err

    # Slow: each footer takes 0.1 s; the first line after 0.05 s, then every 0.1 s.
    footer_of = arrayrecord._footer_of

    def slow(f):
        time.sleep(0.1)
        return footer_of(f)

    monkeypatch.setattr(arrayrecord, "_footer_of", slow)
    monkeypatch.setattr(store, "_PROGRESS_AFTER", 0.05)
    monkeypatch.setattr(store, "_PROGRESS_EVERY", 0.1)
    monkeypatch.setattr(store, "_BUILD_THREADS", 2)
    ix = arrayrecord_index(paths, index_dir=str(tmp_path / "slow"))
    assert ix.counts.sum() == 40
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "indexing" in ln]
    prefix = f"torchgrain: indexing 8 shards of {d}: "
    assert lines and all(ln.startswith(prefix) for ln in lines), lines
    done = [int(ln[len(prefix) :].split("/")[0]) for ln in lines[:-1]]
    assert done == sorted(done) and all(0 < k <= 8 for k in done)
    assert lines[-1].startswith(prefix + "8/8, done in ")


def test_a_build_abandoned_midway_leaves_no_thread_waiting(tmp_path):
    """A caller that raises while a build's generator is suspended (its traceback kept,
    so the generator is never closed) leaves no worker thread waiting on it: the
    process still exits."""
    script = textwrap.dedent("""
        import sys
        from torchgrain.sources.node_index import store
        gen = store.in_order(64, lambda i: (i, 10), lambda i: i, budget=20, max_workers=4)
        try:
            for i in gen:
                if i == 3:
                    raise RuntimeError("the sink failed")
        except RuntimeError:
            kept = sys.exc_info()  # the frame, and the generator, stay alive
        print("done", flush=True)
    """)
    p = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=TG_ROOT),
    )
    assert p.returncode == 0 and p.stdout.strip() == "done", p.stderr[-2000:]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_a_footer_larger_than_the_budget_is_parsed_in_slices(tmp_path):
    """One shard of 10^6 one-byte records (10^6 chunks): its footer alone costs ~200 MiB
    to parse whole (~210 bytes a chunk: 392 MiB measured here for 2*10^6 before it was
    read in slices); it is decoded and written into the index a slice of chunks at a
    time, so the peak does not grow with the chunk count (18 MiB for 2*10^6). Peak
    resident memory of a fresh building process beyond its imports, the footer's mapped
    pages included, with a budget of 8 MiB: under 64 MiB."""
    n = 1_000_000
    paths = _foreign_dataset(tmp_path / "d", n, 1)
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(paths), str(tmp_path / "ix"), str(8 << 20)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=TG_ROOT, PYTHONWARNINGS="ignore"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["counts"] == [n]
    assert got["peak"] < 64 << 20, f"peak {got['peak'] / 2**20:.0f} MiB beyond the imports"


@pytest.mark.parametrize("options", ["group_size:3", "group_size:2,uncompressed"])
def test_a_footer_read_in_slices_gives_the_whole_parse(tmp_path, options):
    """FooterReader.slices(step) gives the same entries, record offsets and group size
    as the whole parse, whatever the step; a footer cut short names its file."""
    from array_record.python.array_record_module import ArrayRecordWriter

    from torchgrain.formats.arrayrecord.file import ArrayRecordFile
    from torchgrain.formats.arrayrecord.footer import FooterReader

    p = str(tmp_path / "a.array_record")
    w = ArrayRecordWriter(p, options)
    for i in range(1000):
        w.write(b"%d" % i)
    w.close()
    f = ArrayRecordFile(p)
    whole = f._ensure_footer()
    view = f._local_view()
    for step in (1, 7, 333, 10_000):
        r = FooterReader(f, view, 0, len(view), f._fetch)
        parts = list(r.slices(step))
        assert len(parts) == -(-len(whole.chunk_offsets) // step)
        offsets, dsizes, ends = (np.concatenate([q[j] for q in parts]) for j in range(3))
        assert np.array_equal(offsets, whole.chunk_offsets)
        assert np.array_equal(dsizes, whole.decoded_sizes)
        assert np.array_equal(ends, whole.record_offsets[1:])
        assert (r.group_size, r.num_records) == (whole.group_size, 1000)
    r = FooterReader(f, view, 0, len(view), f._fetch)
    r._data = r._data[: len(r._data) - 3]  # the footer's values cut short
    with pytest.raises(CorruptDataError, match=r"a\.array_record.*bad footer"):
        list(r.slices(5))
    f.close()


def test_an_index_of_footers_read_in_slices_is_the_same_index(tmp_path, monkeypatch):
    """With a budget smaller than two footers (read 2 chunks at a time), the index
    file holds the same arrays as one built from whole footers, tolerate or not."""
    from array_record.python.array_record_module import ArrayRecordWriter

    paths = []
    for k, (n, options) in enumerate(
        [(100, "group_size:3"), (7, "group_size:1"), (160, "group_size:4,uncompressed")]
    ):
        paths.append(str(tmp_path / f"{k}.array_record"))
        w = ArrayRecordWriter(paths[-1], options)
        for i in range(n):
            w.write(b"%d" % i)
        w.close()
    whole = arrayrecord.build_arrayrecord_index(paths, out=str(tmp_path / "whole.idx"))
    monkeypatch.setattr(store, "BUILD_BYTES", 32 * arrayrecord._PARSE_COST)
    sliced = []

    class Reader(arrayrecord.FooterReader):
        def slices(self, step=None):
            sliced.append((self.file_size, step))
            return super().slices(step)

    monkeypatch.setattr(arrayrecord, "FooterReader", Reader)
    for tolerate in (False, True):
        out = str(tmp_path / f"sliced-{tolerate}.idx")
        ix = arrayrecord.build_arrayrecord_index(paths, out=out, tolerate=tolerate)
        assert ix.counts.tolist() == [100, 7, 160]
        for name, arr in whole._a.arrays.items():
            assert np.array_equal(ix._a.arrays[name], arr), name
    # Shards 0 and 2 (35 and 41 footer entries) read 2 chunks at a time; tolerate
    # reads them twice.
    assert len(sliced) == 6 and {step for _, step in sliced} == {2}
