"""Token windows: loader-only tokens/s against a memory-mapped flat token array, and the
cost of the window index.

One synthetic corpus (lognormal document lengths, int32 token ids) is written three ways:
a flat token file (what Megatron's ``.bin``/``.idx`` and LitData's ``TokensLoader`` read),
Parquet (a ``tokens`` list<int32> column and ``num_tokens``, a few files) and ArrayRecord
(torchgrain's writer). Each reader then makes one pass over ``--windows`` windows of
``--seq-len`` tokens (default: a whole epoch, so that Parquet's row groups are decoded
once per worker as in training, not once per few windows) in a global shuffle (``GlobalShuffleSampler`` over windows), through
a ``DataLoader`` with the same batch size, workers and collate (stack ``input_ids`` and
``labels`` into tensors), each in a fresh process, rounds interleaved:

* ``mmap``: the physical reference: window ``i`` is ``tokens[i L : (i + 1) L + 1]`` of a
  ``numpy.memmap``, sliced;
* ``arrayrecord`` / ``parquet``: ``tg.Dataset(source).windows("tokens", L)`` (the index
  built once beforehand, as a job's first run leaves it; each child maps it).

Then the index: build time for ``--index-docs`` documents (default 10^7) from a Parquet
file's list offsets and from its ``num_tokens`` column, and the index's bytes per
document and per window (concat mode; pack mode's bins at ``--pack-docs``).

Beside them, the peers over the same tokens, each in the interpreter that has it (``--peers-python``,
default ``.venv-peers/bin/python`` when there, built by ``scripts/setup_peers.sh``):

* ``litdata``: LitData's ``TokensLoader``, as its LLM pre-training docs write and read
  it: ``optimize`` of the documents' token arrays with ``item_loader=TokensLoader()``
  (not timed, like the other writes), then ``StreamingDataset(item_loader=
  TokensLoader(block_size=L + 1), shuffle=True, drop_last=True)`` and a
  ``StreamingDataLoader``; ``input_ids``/``labels`` are a batch's blocks shifted;
* ``hf``: HF's ``group_texts`` recipe: the Parquet files loaded by ``datasets``, a
  ``map(group_texts, batched=True)`` cutting the concatenated ``input_ids`` into blocks
  of ``L + 1`` (timed apart: ``hf group_texts map s``), then the packed dataset
  (``with_format("numpy")``) read in a ``DataLoader`` with a ``RandomSampler``.

A peer whose package is missing is reported as not measured.

Run: ``python benchmarks/tokens.py [--tokens 10000000] [--windows 0] [--workers 2]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from _common import describe_machine, print_table, write_json  # noqa: E402

VOCAB = 50257
READERS = ("mmap", "arrayrecord", "parquet")
PEERS = ("litdata", "hf")
PEERS_PYTHON = os.path.join(os.path.dirname(HERE), ".venv-peers", "bin", "python")


def lognormal_lengths(total: int, seed: int = 0, median: float = 400.0) -> np.ndarray:
    """Document lengths (a lognormal of sigma 1, as web text's) adding up to ~``total``."""
    rng = np.random.default_rng(seed)
    n = max(1, int(total / (median * np.exp(0.5))))
    return np.maximum(1, rng.lognormal(np.log(median), 1.0, n).astype(np.int64))


def write_corpus(directory: str, total: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    import torchgrain as tg

    lengths = lognormal_lengths(total)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.random.default_rng(1).integers(0, VOCAB, int(offsets[-1])).astype(np.int32)
    tokens.tofile(os.path.join(directory, "tokens.bin"))
    np.save(os.path.join(directory, "offsets.npy"), offsets)  # for the peers' writers
    docs = [tokens[offsets[i] : offsets[i + 1]] for i in range(len(lengths))]
    os.makedirs(os.path.join(directory, "parquet"))
    files = 4
    per = -(-len(docs) // files)
    for f in range(files):
        part = slice(f * per, (f + 1) * per)
        values = tokens[offsets[part.start] : offsets[min(part.stop, len(docs))]]
        offs = (offsets[part.start : min(part.stop, len(docs)) + 1] - offsets[part.start]).astype(
            np.int32
        )
        table = pa.table(
            {
                "tokens": pa.ListArray.from_arrays(pa.array(offs), pa.array(values)),
                "num_tokens": pa.array(lengths[part].astype(np.int32)),
            }
        )
        pq.write_table(
            table, os.path.join(directory, "parquet", f"part-{f}.parquet"), row_group_size=1024
        )
    tg.write_array_record(
        ({"tokens": d, "num_tokens": len(d)} for d in docs),
        os.path.join(directory, "arrayrecord"),
        num_shards=files,
    )
    return {"documents": len(lengths), "tokens": int(offsets[-1])}


def _litdata_docs(part: tuple[str, int, int]):
    """LitData's ``optimize`` function: the token arrays of documents ``[a, b)``."""
    import torch

    directory, a, b = part
    tokens = np.memmap(os.path.join(directory, "tokens.bin"), np.int32, mode="r")
    offsets = np.load(os.path.join(directory, "offsets.npy"))
    for d in range(a, b):
        yield torch.from_numpy(np.array(tokens[offsets[d] : offsets[d + 1]]))


def write_litdata(directory: str, seq_len: int) -> None:
    """LitData's TokensLoader format, as its LLM pre-training docs write it."""
    from litdata import TokensLoader, optimize

    n = len(np.load(os.path.join(directory, "offsets.npy"))) - 1
    parts = [(directory, k * n // 4, (k + 1) * n // 4) for k in range(4)]
    optimize(
        fn=_litdata_docs,
        inputs=parts,
        output_dir=os.path.join(directory, "litdata"),
        chunk_size=(seq_len + 1) * 512,  # tokens per chunk: 512 blocks (4 MB of int32)
        item_loader=TokensLoader(),
        num_workers=2,
    )


def write_hf(directory: str, seq_len: int) -> float:
    """HF's ``group_texts`` over the Parquet files' tokens; returns the map's seconds."""
    import glob
    from itertools import chain

    import datasets

    datasets.disable_progress_bars()
    block = seq_len + 1

    def group_texts(examples: dict) -> dict:
        ids = list(chain(*examples["input_ids"]))
        total = len(ids) // block * block
        return {"input_ids": [ids[i : i + block] for i in range(0, total, block)]}

    files = sorted(glob.glob(os.path.join(directory, "parquet", "*.parquet")))
    raw = datasets.load_dataset(
        "parquet", data_files=files, split="train", cache_dir=os.path.join(directory, "hf-cache")
    )
    raw = raw.rename_column("tokens", "input_ids").remove_columns(["num_tokens"])
    t0 = time.perf_counter()
    packed = raw.map(group_texts, batched=True, num_proc=2)
    took = time.perf_counter() - t0
    packed.save_to_disk(os.path.join(directory, "hf"))
    return took


class FlatWindows:
    """The physical reference: window ``i`` sliced from a memory-mapped flat token file."""

    def __init__(self, path: str, seq_len: int) -> None:
        self.path, self.seq_len = path, seq_len
        self.n = (os.path.getsize(path) // 4 - 1) // seq_len
        self.tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.tokens is None:
            self.tokens = np.memmap(self.path, np.int32, mode="r")
        s = int(i) * self.seq_len
        w = self.tokens[s : s + self.seq_len + 1].astype(np.int64)
        return {"input_ids": w[:-1], "labels": w[1:]}


class LengthOnly:
    """Documents of the given lengths (zeros), made when read: a large dataset in no memory."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        n = int(self.lengths[i])
        return {"t": np.zeros(n, np.int32), "num_tokens": n}


def collate(batch: list) -> dict:
    import torch

    return {k: torch.from_numpy(np.stack([r[k] for r in batch])) for k in ("input_ids", "labels")}


def child(
    reader: str, directory: str, seq_len: int, windows: int, workers: int, batch: int
) -> dict:
    """One timed pass in this (new) process: open, then read ``windows`` windows."""
    import torch  # imported before timing, as in a training script

    if reader in PEERS:  # its package imported before timing too
        __import__(PEER_MODULES[reader])
    else:
        import torchgrain as tg

    t0 = time.perf_counter()
    if reader in PEERS:
        loader = _peer_loader(reader, directory, seq_len, workers, batch)
        return _timed(reader, loader, t0, windows, seq_len)
    if reader == "mmap":
        ds = FlatWindows(os.path.join(directory, "tokens.bin"), seq_len)
    else:
        src = (
            tg.ArrayRecordSource(os.path.join(directory, "arrayrecord"))
            if reader == "arrayrecord"
            else tg.ParquetSource(os.path.join(directory, "parquet"))
        )
        ds = tg.Dataset(src).windows(
            "tokens", seq_len, index_dir=os.path.join(directory, "index"), progress=False
        )
    sampler = tg.GlobalShuffleSampler(len(ds), seed=0, num_replicas=1, rank=0)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=batch,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate,
        prefetch_factor=4 if workers else None,
    )
    return _timed(reader, loader, t0, windows, seq_len)


def _peer_loader(reader: str, directory: str, seq_len: int, workers: int, batch: int):
    """A peer's loader of ``{"input_ids", "labels"}`` batches (blocks of ``seq_len + 1``
    tokens, shifted), made in its workers as :func:`collate` makes the others'."""
    import torch

    if reader == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

        ds = StreamingDataset(
            input_dir=os.path.join(directory, "litdata"),
            item_loader=TokensLoader(block_size=seq_len + 1),
            shuffle=True,
            drop_last=True,
            seed=0,
        )
        return StreamingDataLoader(
            ds, batch_size=batch, num_workers=workers, collate_fn=_shifted_blocks
        )
    import datasets

    ds = datasets.load_from_disk(os.path.join(directory, "hf")).with_format("numpy")
    return torch.utils.data.DataLoader(
        ds,
        batch_size=batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        num_workers=workers,
        collate_fn=_shifted_rows,
        prefetch_factor=4 if workers else None,
    )


def _shifted_blocks(blocks: list) -> dict:
    """LitData's blocks of ``L + 1`` tokens as :func:`collate`'s batch."""
    w = np.stack([np.asarray(b) for b in blocks]).astype(np.int64)
    return collate([{"input_ids": r[:-1], "labels": r[1:]} for r in w])


def _shifted_rows(rows: list) -> dict:
    """HF's packed rows (``input_ids`` of ``L + 1`` tokens) as :func:`collate`'s batch."""
    return _shifted_blocks([r["input_ids"] for r in rows])


def _timed(reader: str, loader, t0: float, windows: int, seq_len: int) -> dict:
    tokens = first_tokens = 0
    t_first = None
    for b in loader:
        tokens += b["labels"].numel()
        if t_first is None:  # open, workers started, first batch read
            t_first, first_tokens = time.perf_counter(), tokens
        if windows and tokens >= windows * seq_len:
            break
    end = time.perf_counter()
    wall = end - t0
    return {
        "reader": reader,
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "first_batch_s": t_first - t0,
        "steady_tokens_per_s": (tokens - first_tokens) / max(end - t_first, 1e-9),
    }


#: The module each peer needs.
PEER_MODULES = {"litdata": "litdata", "hf": "datasets"}


def peer_python(reader: str, peers_python: str) -> str | None:
    """The interpreter that runs ``reader``: the peers' one where it has the package,
    else this one where it has it, else None (not measured)."""
    if reader not in PEERS:
        return sys.executable
    for python in (peers_python, sys.executable):
        if python and os.path.exists(python):
            probe = [python, "-c", f"import {PEER_MODULES[reader]}"]
            if subprocess.run(probe, capture_output=True).returncode == 0:
                return python
    return None


def run_child(args: argparse.Namespace, reader: str, python: str = sys.executable) -> dict:
    cmd = [
        python,
        os.path.abspath(__file__),
        "--child",
        reader,
        "--dir",
        args.dir,
        "--seq-len",
        str(args.seq_len),
        "--windows",
        str(args.windows),
        "--workers",
        str(args.workers),
        "--batch-size",
        str(args.batch_size),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{reader} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def index_costs(directory: str, docs: int, pack_docs: int, seq_len: int) -> dict:
    """Build time and bytes of the window index for ``docs`` documents of synthetic
    lengths (a Parquet file with a list column and its ``num_tokens``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import torchgrain as tg

    rng = np.random.default_rng(2)
    lengths = rng.integers(0, 4, docs).astype(np.int32)  # short: the index's cost per document
    offsets = np.zeros(docs + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.zeros(int(offsets[-1]), np.int32)
    path = os.path.join(directory, "many")
    os.makedirs(path, exist_ok=True)
    pq.write_table(
        pa.table(
            {
                "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
                "num_tokens": pa.array(lengths),
            }
        ),
        os.path.join(path, "docs.parquet"),
        row_group_size=1 << 20,
    )
    out = {"documents": docs}
    for how, columns, lengths_key in (
        ("list offsets", ["tokens"], None),
        ("num_tokens column", None, "num_tokens"),
    ):
        src = tg.ParquetSource(path, columns=columns)
        ix = os.path.join(directory, f"ix-{lengths_key}")
        t0 = time.perf_counter()
        w = tg.Dataset(src).windows(
            "tokens", seq_len, lengths=lengths_key, index_dir=ix, progress=False
        )
        out[f"build_s ({how})"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        tg.Dataset(src).windows("tokens", seq_len, lengths=lengths_key, index_dir=ix)
        out[f"open_s ({how})"] = time.perf_counter() - t0
    size = os.path.getsize(w.source.index_paths[0])
    out["index_bytes"] = size
    out["bytes_per_document"] = size / docs
    out["windows"] = len(w)
    out["bytes_per_window"] = 0.0  # nothing per window: offsets only
    # Pack mode's bins over pack_docs documents of lognormal lengths (median 200 tokens,
    # the longest truncated): the document index first, then the bins, timed alone.
    docs = LengthOnly(np.minimum(rng.lognormal(np.log(200), 1.0, pack_docs), 8192).astype(int))
    ds = tg.Dataset(docs)
    ix = os.path.join(directory, "ix-pack")
    ds.windows("t", seq_len, eos=0, lengths="num_tokens", progress=False, index_dir=ix)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the truncated documents
        p = ds.windows(
            "t", seq_len, mode="pack", eos=0, lengths="num_tokens", progress=False, index_dir=ix
        )
    out["pack_documents"] = pack_docs
    out["pack_build_s"] = time.perf_counter() - t0
    out["pack_windows"] = len(p)
    out["pack_bins_bytes"] = os.path.getsize(p.source.index_paths[1])
    out["pack_bins_bytes_per_document"] = (out["pack_bins_bytes"] - 8 * len(p)) / pack_docs
    out["pack_truncated_documents"] = p.truncated_documents
    out["packing_efficiency"] = p.packing_efficiency
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument(
        "--windows", type=int, default=0, help="windows read per pass (0: the whole epoch)"
    )
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--index-docs", type=int, default=10_000_000, help="0: the index costs are not measured"
    )
    ap.add_argument("--pack-docs", type=int, default=1_000_000)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", choices=READERS + PEERS, default=None)
    ap.add_argument("--write-peer", choices=PEERS, default=None)
    ap.add_argument(
        "--peers-python",
        default=PEERS_PYTHON,
        help="the interpreter of LitData and HF datasets (scripts/setup_peers.sh builds it)",
    )
    args = ap.parse_args()
    if args.write_peer == "litdata":
        write_litdata(args.dir, args.seq_len)
        return
    if args.write_peer == "hf":
        print(json.dumps(write_hf(args.dir, args.seq_len)))
        return
    if args.child:
        print(
            json.dumps(
                child(
                    args.child, args.dir, args.seq_len, args.windows, args.workers, args.batch_size
                )
            )
        )
        return

    import torchgrain as tg

    print(describe_machine())
    with tempfile.TemporaryDirectory() as tmp:
        args.dir = tmp
        t0 = time.perf_counter()
        corpus = write_corpus(tmp, args.tokens)
        print(f"corpus: {corpus} written in {time.perf_counter() - t0:.1f} s")
        builds = {}
        for name, src in (
            ("arrayrecord", tg.ArrayRecordSource(os.path.join(tmp, "arrayrecord"))),
            ("parquet", tg.ParquetSource(os.path.join(tmp, "parquet"))),
        ):
            t0 = time.perf_counter()
            tg.Dataset(src).windows(
                "tokens", args.seq_len, index_dir=os.path.join(tmp, "index"), progress=False
            )
            builds[name] = time.perf_counter() - t0
        print(f"window index built in {builds}")
        pythons = {r: peer_python(r, args.peers_python) for r in READERS + PEERS}
        readers = [r for r in READERS + PEERS if pythons[r]]
        not_measured = {r: f"{PEER_MODULES[r]} not installed" for r in PEERS if not pythons[r]}
        for peer in PEERS:
            if not pythons[peer]:
                continue
            t0 = time.perf_counter()
            cmd = [pythons[peer], os.path.abspath(__file__), "--write-peer", peer]
            cmd += ["--dir", tmp, "--seq-len", str(args.seq_len)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                not_measured[peer] = f"writing failed: {out.stderr.strip().splitlines()[-1:]}"
                readers.remove(peer)
                continue
            builds[peer] = time.perf_counter() - t0
            if peer == "hf":
                builds["hf group_texts map"] = json.loads(out.stdout.strip().splitlines()[-1])
        peers = {k: round(v, 1) for k, v in builds.items() if k not in READERS}
        print(f"peers written in {peers} s (not measured: {not_measured or 'none'})")
        runs: dict[str, list[dict]] = {r: [] for r in readers}
        for _ in range(args.rounds):
            for reader in readers:
                runs[reader].append(run_child(args, reader, pythons[reader]))

        def med(reader: str, key: str) -> float:
            return statistics.median(r[key] for r in runs[reader])

        rows = [
            {
                "reader": r,
                "tokens/s": med(r, "tokens_per_s"),
                "vs mmap": med(r, "tokens_per_s") / med("mmap", "tokens_per_s"),
                "first batch s": med(r, "first_batch_s"),
                "steady tokens/s": med(r, "steady_tokens_per_s"),
                "steady vs mmap": med(r, "steady_tokens_per_s")
                / med("mmap", "steady_tokens_per_s"),
            }
            for r in readers
        ]
        print(
            f"{args.windows or 'all'} windows of {args.seq_len} tokens, global shuffle, batch "
            f"{args.batch_size}, {args.workers} workers, median of {args.rounds} fresh "
            "processes (tokens/s: open to last batch; steady: after the first batch)"
        )
        cols = ["reader", "tokens/s", "vs mmap", "first batch s", "steady tokens/s"]
        print_table(rows, [*cols, "steady vs mmap"])
        for peer, why in not_measured.items():
            print(f"{peer}: not measured ({why})")
        index = (
            index_costs(tmp, args.index_docs, args.pack_docs, args.seq_len)
            if args.index_docs
            else {}
        )
        print(json.dumps(index, indent=1))
        write_json(
            "tokens",
            {
                "corpus": corpus,
                "settings": {k: v for k, v in vars(args).items() if k not in ("dir", "child")},
                "index_build_s": builds,
                "rows": rows,
                "runs": runs,
                "index": index,
                "pythons": pythons,
                "not_measured": not_measured,
            },
        )


if __name__ == "__main__":
    main()
