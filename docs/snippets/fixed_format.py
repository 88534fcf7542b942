"""A fixed-width record file (``.fixed``) as a torchgrain format, in public names only.

A file is a 16-byte header (``FIXEDREC``, then the slot width and the record count as
little-endian uint32) and ``count`` slots of ``width`` bytes: a record's msgpack
encoding, after its length (uint32), zero-padded. Record ``r`` is at a known offset,
so the reader gives byte ranges and torchgrain fetches a remote batch's at once.
"""

import os
import struct

import numpy as np

import torchgrain as tg

HEADER = struct.Struct("<8sII")
CODEC = tg.sources.get_codec("msgpack")


class FixedFormat:
    name, suffixes = "fixed", (".fixed",)

    def open(self, file: tg.sources.ShardFile) -> "FixedReader":
        magic, width, count = HEADER.unpack(file.read_ranges([(0, HEADER.size)])[0])
        if magic != b"FIXEDREC" or width < 4 or HEADER.size + width * count > file.size:
            raise tg.CorruptDataError(f"{file.path!r} is not a .fixed file of its size")
        return FixedReader(file, width, count)


class FixedReader:
    def __init__(self, file: tg.sources.ShardFile, width: int, count: int) -> None:
        self.file, self.width, self.count = file, width, count

    def __len__(self) -> int:
        return self.count

    def byte_ranges(self, rows: np.ndarray) -> list[tuple[int, int]]:
        starts = HEADER.size + rows * self.width
        return list(zip(starts.tolist(), (starts + self.width).tolist()))

    def decode(self, rows: np.ndarray, chunks: list[memoryview]) -> list[dict]:
        lengths = [struct.unpack_from("<I", c)[0] for c in chunks]
        if max(lengths, default=0) > self.width - 4:
            raise tg.CorruptDataError(f"{self.file.path!r}: a record overflows its slot")
        return [CODEC.decode(bytes(c[4 : 4 + n])) for c, n in zip(chunks, lengths)]

    def read(self, rows: np.ndarray) -> list[dict]:
        return self.decode(rows, self.file.read_ranges(self.byte_ranges(rows)))

    def close(self) -> None:
        pass


class FixedSource(tg.FormatSource):
    format = FixedFormat()


def write_fixed(records, directory: str, *, num_shards: int = 1) -> list[str]:
    blobs = [CODEC.encode(r) for r in records]
    width = 4 + max(map(len, blobs), default=0)
    os.makedirs(directory, exist_ok=True)
    paths = []
    for k in range(num_shards):
        part = blobs[len(blobs) * k // num_shards : len(blobs) * (k + 1) // num_shards]
        name = f"data-{k:05d}-of-{num_shards:05d}.fixed"
        tmp = os.path.join(directory, f".{name}.tmp")  # hidden: never read as a shard
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(b"FIXEDREC", width, len(part)))
            f.writelines(struct.pack("<I", len(b)) + b.ljust(width - 4, b"\0") for b in part)
        paths.append(os.path.join(directory, name))
        os.replace(tmp, paths[-1])  # complete, or not there: never a partial shard
    return paths


FIXED = tg.sources.Format.for_source(FixedSource, write=write_fixed, description="fixed-width")

if __name__ == "__main__":
    import tempfile

    tg.sources.register_format(FIXED)  # tg.open and the torchgrain command know it now
    d = tempfile.mkdtemp()
    write_fixed([{"id": i, "x": np.full(3, i, np.float32)} for i in range(10)], d, num_shards=2)
    src = tg.open(d, cache_bytes=0)  # any ReadOptions: cache_dir=, io_threads=, retry=...
    assert isinstance(src, FixedSource) and len(src) == 10 and src.num_shards == 2
    assert [r["id"] for r in src.__getitems__([7, 2, 9])] == [7, 2, 9]
    print(src, src.schema)
