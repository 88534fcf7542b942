"""Structure-aware fuzzing of every decoder torchgrain owns, in supervised subprocesses.

Each target makes valid inputs (ArrayRecord files of every compression, msgpack records
and batches of them, tf.Example protos, TFRecord files plain and compressed, Parquet
files), mutates them where the format's fields are (sizes, counts, varints, lengths,
shapes, compression streams, footers) and at random bytes (flips, truncations,
insertions, splices), and checks the outcome: the right value or a torchgrain error,
never a crash, a hang, another exception or memory over the budget.

Cases run in a worker process (``python tests/fuzz.py --worker``) under an address-space
limit (RLIMIT_AS); the worker resets its peak RSS before each case and reports it after
(``/proc/self/clear_refs``), and the parent kills it when a case overruns its time. A
worker that dies (a signal, an abort) or is killed is a failure of the case it was
running; the parent starts another and goes on.

Run: ``python tests/fuzz.py --seconds 600`` (``make fuzz``) fuzzes every target in turn
and writes each failing case to ``tests/fuzz_corpus/<target>/`` (JSON: the input, what
the oracle needs, the failure). ``tests/test_fuzz.py`` replays that corpus and runs a
bounded, seeded campaign on every test run.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import gzip
import hashlib
import io
import itertools
import json
import math
import os
import random
import re
import resource
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.environ.get("TORCHGRAIN_FUZZ_CORPUS", os.path.join(HERE, "fuzz_corpus"))
#: The torchgrain checkout the worker imports (another one: to find what an older
#: version gets wrong).
ROOT = os.environ.get("TORCHGRAIN_FUZZ_ROOT", os.path.dirname(HERE))

#: Decoders run with small ceilings, so that "bounded" is checked tightly.
MAX_CHUNK = 4 << 20
MAX_RECORD = 1 << 20
#: Peak RSS a case may add to the worker's (ceilings included, with room for copies).
RSS_BUDGET_MIB = 160
#: Address space of a worker: an allocation past it fails (MemoryError, a failure too).
AS_LIMIT = 3 << 30
CASE_SECONDS = 20.0

_U64 = (1 << 64) - 1
# Values that break arithmetic: zero, one past int64, wrap-arounds of 8-byte items.
NASTY = [0, 1, 2, 255, 256, 65535, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 61) + 1, 1 << 62]
NASTY += [(1 << 63) - 1, 1 << 63, (1 << 63) + 1, _U64, MAX_CHUNK, MAX_CHUNK + 1, 1 << 40]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def varint(v: int) -> bytes:
    v &= _U64
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def nasty(rng: random.Random, near: int | None = None) -> int:
    if near is not None and rng.random() < 0.5:
        return max(0, near + rng.choice([-2, -1, 1, 2, 7, 1000]))
    return rng.choice(NASTY)


# ------------------------------------------------------------------ byte mutations
def mutate_bytes(rng: random.Random, data: bytes, other: bytes | None = None) -> bytes:
    """One random byte-level mutation of ``data`` (never empty-preserving by accident)."""
    b = bytearray(data)
    op = rng.randrange(7)
    if not b:
        return bytes(rng.randbytes(rng.randint(1, 16)))
    i = rng.randrange(len(b))
    if op == 0:  # flip a bit
        b[i] ^= 1 << rng.randrange(8)
    elif op == 1:  # set a byte
        b[i] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
    elif op == 2:  # truncate
        del b[i:]
    elif op == 3:  # delete a few bytes
        del b[i : i + rng.randint(1, 8)]
    elif op == 4:  # insert a few bytes
        b[i:i] = rng.randbytes(rng.randint(1, 8))
    elif op == 5:  # overwrite 8 bytes with a nasty little-endian integer
        b[i : i + 8] = struct.pack("<Q", nasty(rng))
    elif other:  # splice
        j = rng.randrange(len(other))
        b[i:] = other[j : j + rng.randint(1, 64)]
    else:
        b[i:i] = b[i : i + rng.randint(1, 32)]
    return bytes(b)


# ------------------------------------------------------------------ outcome checks
class Bad(Exception):
    """The oracle's verdict: the decoder misbehaved (wrong value, bare exception...)."""


def expect_error_or(fn: Callable[[], Any], errors: tuple[type, ...]) -> Any:
    """``fn()``, or None when it raises one of ``errors`` (a torchgrain error, that did
    not come from a MemoryError); anything else is :class:`Bad`."""
    try:
        return fn()
    except errors as e:
        cause = e
        while cause is not None:
            if isinstance(cause, MemoryError):
                raise Bad(f"{type(e).__name__} hides a MemoryError: {e}") from e
            cause = cause.__cause__ or cause.__context__
        if not str(e):
            raise Bad(f"{type(e).__name__} without a message") from e
        return None
    except Bad:
        raise
    except BaseException as e:
        raise Bad(f"bare {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}") from e


def tg_errors() -> tuple[type, ...]:
    from torchgrain.errors import TorchgrainError

    return (TorchgrainError,)


def same(a: Any, b: Any) -> bool:
    import numpy as np

    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


# ================================================================== targets
class Target:
    """How to make, mutate and check one decoder's inputs.

    ``make(rng)`` gives a case: a JSON-able dict with at least ``data`` (base64 input)
    and whatever the oracle needs; ``mutate(rng, case)`` gives a mutated copy;
    ``check(case, workdir)`` raises :class:`Bad` on misbehaviour (runs in the worker).
    """

    name = ""

    def make(self, rng: random.Random) -> dict[str, Any]:
        raise NotImplementedError

    def mutate(self, rng: random.Random, case: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def check(self, case: dict[str, Any], workdir: str) -> None:
        raise NotImplementedError


# ------------------------------------------------------------------ ArrayRecord
class ArrayRecordTarget(Target):
    """ArrayRecord files (every compression, footer, postscript) through
    :class:`ArrayRecordFile` (per record, batch, range, several files together) and
    :class:`ArrayRecordSource` (per record, batch, columns, in order)."""

    name = "arrayrecord"
    COMPRESSIONS = ("none", "zstd", "brotli", "snappy")

    def _spec(self, rng: random.Random) -> dict[str, Any]:
        comp = rng.choice(self.COMPRESSIONS)
        group = rng.choice([1, 1, 2, 5])
        n = rng.randint(1, 12)
        sizes = [rng.choice([0, 1, 3, 30, 300, 3000, 70000]) for _ in range(n)]
        records = [
            bytes(rng.randrange(256) for _ in range(min(s, 16))) * (s // 16 or 1) for s in sizes
        ]
        records = [r[:s] for r, s in zip(records, sizes)]
        return {"compression": comp, "group": group, "records": records, "lies": {}}

    def _build(self, spec: dict[str, Any]) -> bytes:
        import _riegeli as R

        recs = spec["records"]
        g = spec["group"]
        chunks = [R.Chunk(recs[a : a + g], spec["compression"]) for a in range(0, len(recs), g)]
        lies = spec["lies"]
        for key, value in lies.items():
            if key.startswith("chunk."):
                _, k, field = key.split(".", 2)
                c = chunks[int(k) % len(chunks)]
                if field == "values_stream":
                    c.values_buffer = _bomb(value, c)
                elif field == "sizes":
                    sizes = [len(r) for r in c.records]
                    j, delta = value
                    sizes[j % len(sizes)] = max(0, sizes[j % len(sizes)] + delta) & _U64
                    c.sizes = sizes
                elif field == "values_prefix":
                    c.values_buffer = (
                        R.varint(value) + R.stream(c.compression, b"".join(c.records))
                        if c.compression != "none"
                        else None
                    )
                elif field == "sizes_prefix" and c.compression != "none":
                    raw = b"".join(R.varint(len(r)) for r in c.records)
                    c.sizes_buffer = R.varint(value) + R.stream(c.compression, raw)
                elif field in ("decoded_both", "records_both"):
                    if field == "decoded_both":
                        c.decoded_size = c.footer_decoded = value
                    else:
                        c.num_records = c.footer_records = value
                elif field == "trailing":
                    c.trailing = bytes(value)
                else:
                    setattr(c, field, value)
        kw = {k.split(".", 1)[1]: v for k, v in lies.items() if k.startswith("file.")}
        return R.build(chunks, writer_options=f"group_size:{g}", **kw)

    def make(self, rng: random.Random) -> dict[str, Any]:
        spec = self._spec(rng)
        return {
            "data": b64(self._build(spec)),
            "records": [b64(r) for r in spec["records"]],
            "spec": _spec_json(spec),
            "exact": True,
        }

    def mutate(self, rng: random.Random, case: dict[str, Any]) -> dict[str, Any]:
        case = dict(case)
        spec = _spec_from_json(case["spec"])
        if rng.random() < 0.5:
            # A hostile writer: one field lies, every hash is right.
            nchunks = -(-len(spec["records"]) // spec["group"])
            k = rng.randrange(max(nchunks, 1))
            field = rng.choice(
                [
                    "data_size",
                    "decoded_size",
                    "num_records",
                    "footer_decoded",
                    "footer_records",
                    "decoded_both",
                    "records_both",
                    "values_prefix",
                    "sizes_prefix",
                    "sizes",
                    "values_stream",
                    "trailing",
                    "chunk_type",
                    "file.num_records",
                    "file.num_chunks",
                    "file.footer_compression",
                ]
            )
            records = spec["records"]
            if field == "sizes":
                value: Any = [rng.randrange(8), rng.choice([-1, 1, 1000, 1 << 40, (1 << 63)])]
            elif field == "values_stream":
                value = rng.choice(
                    [
                        "zstd_bomb",
                        "zstd_bomb_nosize",
                        "zstd_claim",
                        "brotli_bomb",
                        "snappy_claim",
                        "truncated",
                        "empty",
                    ]
                )
            elif field == "trailing":
                value = list(rng.randbytes(rng.randint(1, 40)))
            elif field == "chunk_type":
                value = rng.choice([0x74, 0x6D, 0x70, 0x73, 0x00])
            elif field == "file.footer_compression":
                value = rng.choice(self.COMPRESSIONS)
            else:
                value = nasty(rng, len(records))
            key = field if field.startswith("file.") else f"chunk.{k}.{field}"
            spec["lies"] = {**spec["lies"], key: value}
            case["data"] = b64(self._build(spec))
            case["spec"] = _spec_json(spec)
            # Sizes redistributed inside a chunk, and a chunk type changed, may read as
            # other (consistent) records: only checksums could tell. A footer's counts
            # number the records: a count that lies is found where its chunk is read,
            # and the chunks after it are numbered as the footer says.
            case["exact"] = field not in (
                "sizes",
                "chunk_type",
                "file.footer_compression",
                "trailing",
                "footer_records",
                "records_both",
            )
            case["hashed"] = True
        else:
            data = unb64(case["data"])
            for _ in range(rng.randint(1, 3)):
                data = mutate_bytes(rng, data)
            case["data"] = b64(data)
            case["hashed"] = False
            case["exact"] = False  # exact only where checksums are verified
        return case

    def check(self, case: dict[str, Any], workdir: str) -> None:
        errors = tg_errors()
        path = os.path.join(workdir, "x.array_record")
        with open(path, "wb") as f:
            f.write(unb64(case["data"]))
        original = [unb64(r) for r in case["records"]]

        def verdict(got: Any, rows: list[int], verified: bool) -> None:
            if got is None:
                return
            if not isinstance(got, list) or len(got) != len(rows):
                raise Bad(f"read gave {type(got).__name__} of {len(got)} for {len(rows)} rows")
            for r, x in zip(rows, got):
                if type(x) is not bytes:
                    raise Bad(f"record {r} is a {type(x).__name__}")
                if (case.get("exact") or verified) and (r >= len(original) or x != original[r]):
                    raise Bad(
                        f"record {r} read as {x[:40]!r}... ({len(x)} bytes), not the original"
                    )

        for verify in (False, True):
            # With verified checksums a byte-level change is either caught or harmless.
            self._file(path, original, case, verify, verdict, errors)
        self._source(path, original, case, errors)

    def _file(
        self,
        path: str,
        original: list[bytes],
        case: dict[str, Any],
        verify: bool,
        verdict: Callable[[Any, list[int], bool], None],
        errors: tuple,
    ) -> None:
        import numpy as np

        from torchgrain.formats.arrayrecord_file import ArrayRecordFile

        verified = verify and not case.get("hashed", False)
        f = ArrayRecordFile(path, verify_checksums=verify, max_chunk_bytes=MAX_CHUNK)
        g = ArrayRecordFile(path, verify_checksums=verify, max_chunk_bytes=MAX_CHUNK)
        n = expect_error_or(lambda: f.num_records, errors)
        if n is None:
            return
        # A footer that lies about counts is only found out where a chunk is read.
        if verified and n != len(original):
            raise Bad(f"{n} records, not {len(original)}")
        rows = list(range(min(n, 64)))
        for r in rows[:8]:
            verdict(expect_error_or(lambda r=r: f.read([r]), errors), [r], verified)
        order = rows[::-1] + rows
        verdict(expect_error_or(lambda: f.read(order), errors), order, verified)
        verdict(expect_error_or(lambda: f.read_range(0, len(rows)), errors), rows, verified)
        got = expect_error_or(lambda: g.read(np.array(rows)), errors)  # a second reader
        if got is not None:
            verdict(got, rows, verified)
        f.close()
        g.close()

    def _source(
        self, path: str, original: list[bytes], case: dict[str, Any], errors: tuple
    ) -> None:
        import torchgrain as tg

        src = expect_error_or(
            lambda: tg.ArrayRecordSource(path, codec="raw", max_chunk_bytes=MAX_CHUNK), errors
        )
        if src is None:
            return
        n = min(len(src), 64)
        exact = case.get("exact")
        for i in range(min(n, 4)):
            rec = expect_error_or(lambda i=i: src[i], errors)
            if rec is not None and exact and rec["bytes"] != original[i]:
                raise Bad(f"source record {i} differs")
        idx = list(range(n))[::-1]
        recs = expect_error_or(lambda: src.__getitems__(idx), errors)
        if recs is not None and exact and [r["bytes"] for r in recs] != [original[i] for i in idx]:
            raise Bad("source batch differs")
        cols = expect_error_or(lambda: src.read_columns(idx), errors)
        if (
            cols is not None
            and exact
            and idx
            and cols["bytes"].tolist() != [original[i] for i in idx]
        ):
            raise Bad("source columns differ")
        seq = expect_error_or(lambda: list(src.iter_shard_bytes(0)), errors)
        if seq is not None and exact and seq != original:
            raise Bad("sequential read differs")


_BOMBS: dict[str, bytes] = {}


def _bomb(kind: str, chunk: Any) -> bytes:
    """A values buffer for ``chunk`` whose stream holds far more (or less) than it says."""
    import _riegeli as R
    import cramjam
    import zstandard

    raw = b"".join(chunk.records)
    declared = len(raw)
    if kind not in _BOMBS:
        big = bytes(64 * MAX_CHUNK)
        _BOMBS["zstd_bomb"] = zstandard.ZstdCompressor(level=1).compress(big)
        _BOMBS["zstd_bomb_nosize"] = zstandard.ZstdCompressor(
            level=1, write_content_size=False
        ).compress(big)
        c = cramjam.brotli.Compressor(level=5)  # 256 MiB in 407 bytes
        c.compress(big)
        _BOMBS["brotli_bomb"] = bytes(c.finish())
    if kind in ("zstd_bomb", "zstd_bomb_nosize"):
        chunk.compression = "zstd"
        return R.varint(declared) + _BOMBS[kind]
    if kind == "brotli_bomb":
        chunk.compression = "brotli"
        return R.varint(declared) + _BOMBS[kind]
    if kind == "zstd_claim":  # a frame header that claims 1 TiB
        chunk.compression = "zstd"
        body = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
        return R.varint(declared) + b"\x28\xb5\x2f\xfd\xe0" + struct.pack("<Q", 1 << 40) + body[6:]
    if kind == "snappy_claim":
        chunk.compression = "snappy"
        return R.varint(declared) + varint(1 << 40) + bytes(cramjam.snappy.compress_raw(raw))[1:]
    if kind == "truncated" and chunk.compression != "none":
        whole = R.stream(chunk.compression, raw)
        return R.varint(declared) + whole[: len(whole) // 2]
    return R.varint(declared) if chunk.compression != "none" else b""


def _spec_json(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "records": [b64(r) for r in spec["records"]]}


def _spec_from_json(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "records": [unb64(r) for r in spec["records"]], "lies": dict(spec["lies"])}


# ------------------------------------------------------------------ msgpack
def _ndarray_ext(dtype: str, shape: list[int], payload: bytes) -> Any:
    import msgpack

    dt = dtype.encode()
    header = struct.pack(
        f"<B{len(dt)}sB{len(shape)}Q", len(dt), dt, len(shape), *[s & _U64 for s in shape]
    )
    return msgpack.ExtType(1, header + payload)


def _msgpack_record(rng: random.Random, shape_seed: int) -> dict[str, Any]:
    """A record description: values that JSON can carry, arrays as ext specs."""
    r = random.Random(shape_seed)
    dtype = r.choice(["<i8", "<f4", "|u1", "<i2", "|b1"])
    ndim = r.choice([1, 1, 2])
    shape = [r.randint(0, 4) for _ in range(ndim)]
    if ndim == 1 and rng.random() < 0.5:
        shape = [rng.randint(0, 6)]  # ragged across records
    return {
        "id": rng.randint(-(1 << 40), 1 << 40),
        "score": rng.random(),
        "name": "".join(rng.choice("abcé") for _ in range(rng.randint(0, 5))),
        "blob": list(rng.randbytes(rng.randint(0, 9))),
        "flag": rng.random() < 0.5,
        "x": {"dtype": dtype, "shape": shape},
    }


def _pack_record(desc: dict[str, Any], rng: random.Random) -> bytes:
    import msgpack
    import numpy as np

    out: dict[str, Any] = {}
    for k, v in desc.items():
        if k == "x":
            dt = np.dtype(v["dtype"])
            n = math.prod(v["shape"])
            payload = bytes(
                rng.randrange(2) if dt.kind == "b" else rng.randrange(256)
                for _ in range(n * dt.itemsize)
            )
            out[k] = _ndarray_ext(v["dtype"], v["shape"], payload)
        elif k == "blob":
            out[k] = bytes(v)
        else:
            out[k] = v
    return msgpack.packb(out, use_bin_type=True)


def _mutate_record(rng: random.Random, data: bytes) -> bytes:
    """A field-aware mutation of a msgpack record: its ndarray header (dtype, ndim,
    shape, payload length) or a length/type byte; else a byte-level one."""
    b = bytearray(data)
    at = data.find(b"\xc7")  # ext 8: [c7][len][type][n][dtype][ndim][shape...]
    if at < 0:
        at = data.find(b"\xd7") if b"\xd7" in data else data.find(b"\xd8")
    choice = rng.randrange(6)
    if at >= 0 and choice < 4 and data[at] == 0xC7 and at + 4 < len(data):
        n = data[at + 3]
        ndim_at = at + 4 + n
        if choice == 0 and ndim_at < len(data):  # a nasty shape dimension
            d = rng.randrange(max(data[ndim_at], 1))
            pos = ndim_at + 1 + 8 * d
            b[pos : pos + 8] = struct.pack("<Q", nasty(rng))
        elif choice == 1:  # another dtype string of the same length, or another length
            new = rng.choice(
                [
                    b"|V0",
                    b"|O8",
                    b"<U0",
                    b"<i8",
                    b"|S0",
                    b"|V9",
                    b"<c16",
                    b"i4,i4",
                    b"(3,)i8",
                    b"<M8[s]",
                    b"(1,)<i4",
                    b"(2,)<i4",
                ]
            )
            b[at + 4 : at + 4 + n] = new
            b[at + 3] = len(new)
            b[at + 1] = (b[at + 1] + len(new) - n) & 0xFF  # the ext's length follows
        elif choice == 2 and ndim_at < len(b):  # ndim
            b[ndim_at] = rng.choice([0, 1, 2, 31, 32, 33, 255])
        else:  # the ext length
            b[at + 1] = rng.randrange(256)
        return bytes(b)
    if choice == 4:
        # A length field of a str/bin: make it claim more than there is.
        for code in (0xC4, 0xD9, 0xC5, 0xDA):
            i = data.find(bytes([code]))
            if i >= 0 and i + 2 < len(data):
                b[i + 1] = 0xFF
                return bytes(b)
    return mutate_bytes(rng, data)


class MsgpackRecordTarget(Target):
    """One msgpack record through the codec (copying and zero-copy, one and batched)."""

    name = "msgpack"

    def make(self, rng: random.Random) -> dict[str, Any]:
        desc = _msgpack_record(rng, rng.randrange(1 << 30))
        return {"data": b64(_pack_record(desc, rng))}

    def mutate(self, rng: random.Random, case: dict[str, Any]) -> dict[str, Any]:
        data = unb64(case["data"])
        for _ in range(rng.randint(1, 3)):
            data = _mutate_record(rng, data)
        return {"data": b64(data)}

    def check(self, case: dict[str, Any], workdir: str) -> None:
        from torchgrain.columns import ColumnBatch
        from torchgrain.errors import RecordDecodeError
        from torchgrain.formats.codecs import MsgpackCodec

        data = unb64(case["data"])
        for codec in (MsgpackCodec(), MsgpackCodec(zero_copy=True)):
            rec = expect_error_or(lambda c=codec: c.decode(data), (RecordDecodeError,))
            if rec is not None and not isinstance(rec, dict):
                raise Bad(f"decoded a {type(rec).__name__}")
            batch = expect_error_or(lambda c=codec: c.decode_batch([data, data]), ())
            if batch is not None and (rec is None or not same(batch, [rec, rec])):
                raise Bad("decode_batch disagrees with decode")
            if rec is not None:
                expect_error_or(lambda r=rec: ColumnBatch.from_records([r, r]).records(), ())


class MsgpackColumnsTarget(Target):
    """A batch of msgpack records through the vectorised columns decoder, checked
    against the records decoded one by one (the differential oracle)."""

    name = "msgpack_columns"

    def make(self, rng: random.Random) -> dict[str, Any]:
        shape_seed = rng.randrange(1 << 30)
        recs = [
            _pack_record(_msgpack_record(rng, shape_seed), rng) for _ in range(rng.randint(1, 6))
        ]
        return {"data": b64(b"".join(recs)), "lengths": [len(r) for r in recs]}

    def mutate(self, rng: random.Random, case: dict[str, Any]) -> dict[str, Any]:
        data = unb64(case["data"])
        lengths = list(case["lengths"])
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        recs = [data[a:b] for a, b in itertools.pairwise(bounds)]
        # The same field-aware change in every record (as one writer would make it), or
        # in one.
        which = range(len(recs)) if rng.random() < 0.5 else [rng.randrange(len(recs))]
        seed = rng.randrange(1 << 30)
        for k in which:
            recs[k] = _mutate_record(random.Random(seed), recs[k])
        return {"data": b64(b"".join(recs)), "lengths": [len(r) for r in recs]}

    def check(self, case: dict[str, Any], workdir: str) -> None:
        import numpy as np

        from torchgrain.columns import ColumnBatch, Ragged
        from torchgrain.errors import RecordDecodeError
        from torchgrain.formats.codecs import MsgpackCodec
        from torchgrain.formats.msgpack_columns import decode_columns

        data = unb64(case["data"])
        lengths = np.array(case["lengths"], dtype=np.int64)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        buf = np.frombuffer(data, np.uint8)
        batch = expect_error_or(lambda: decode_columns(buf, starts, ends), ())
        codec = MsgpackCodec()
        records = []
        for a, b in zip(starts.tolist(), ends.tolist()):
            records.append(
                expect_error_or(lambda a=a, b=b: codec.decode(data[a:b]), (RecordDecodeError,))
            )
        if batch is None:
            if None not in records:
                expect_error_or(lambda: ColumnBatch.from_records(records), ())
            return
        if None in records:
            raise Bad("the columns decoder accepted a batch that a record of it fails to decode")
        for key, col in batch.items():
            if isinstance(col, Ragged) and (
                col.offsets[0] != 0
                or (np.diff(col.offsets) < 0).any()
                or col.offsets[-1] != len(col.values)
            ):
                raise Bad(f"column {key!r}: offsets {col.offsets[:8].tolist()}")
        got = batch.records()
        for i, (g, r) in enumerate(zip(got, records)):
            for key in r:
                a, b = g[key], r[key]
                if isinstance(b, np.ndarray) and b.ndim == 0:
                    b = b.reshape(1)[0]
                    a = a if not isinstance(a, np.ndarray) else a.reshape(-1)[0]
                if isinstance(a, np.generic):
                    a = a.item()
                if isinstance(b, np.generic):
                    b = b.item()
                if not same(a, b) and not (
                    isinstance(a, np.ndarray)
                    and isinstance(b, np.ndarray)
                    and np.array_equal(a, b)
                    and a.dtype == b.dtype
                ):
                    raise Bad(f"record {i} key {key!r}: columns give {a!r}, the record {b!r}")


# ------------------------------------------------------------------ tf.Example
def _proto_fields(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of the varints (tags, lengths, values) of a protobuf message,
    walked through nested length-delimited fields where they parse."""
    out: list[tuple[int, int]] = []

    def varint(pos: int, b: int) -> tuple[int, int] | None:
        """(value, position after it) of the varint at ``pos``; None if it runs past ``b``."""
        value = shift = 0
        while pos < b:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value, pos
        return None

    def walk(a: int, b: int, depth: int) -> None:
        pos = a
        while pos < b:
            start = pos
            got = varint(pos, b)
            if got is None:
                return
            tag, pos = got
            out.append((start, pos))
            wt = tag & 7
            if wt in (0, 2):
                got = varint(pos, b)
                if got is None:
                    return
                value, end = got
                out.append((pos, end))
                pos = end
                if wt == 2:
                    if depth < 8 and pos + value <= b:
                        walk(pos, pos + value, depth + 1)
                    pos += value
            elif wt == 5:
                pos += 4
            elif wt == 1:
                pos += 8
            else:
                return

    walk(0, len(data), 0)
    return out


class TFExampleTarget(Target):
    """tf.Example protos (squeezed or not, some keys or all), and through TFDS specs."""

    name = "tf_example"

    def make(self, rng: random.Random) -> dict[str, Any]:
        from torchgrain.formats.tf_example import encode_tf_example

        feats: dict[str, Any] = {}
        for k in range(rng.randint(1, 5)):
            kind = rng.randrange(3)
            n = rng.choice([0, 1, 2, 40])
            if kind == 0:
                feats[f"b{k}"] = [rng.randbytes(rng.randint(0, 5)) for _ in range(n)]
            elif kind == 1:
                feats[f"f{k}"] = [rng.random() for _ in range(n)] or [0.5]
            else:
                feats[f"i{k}"] = [rng.randint(-(1 << 62), 1 << 62) for _ in range(n)] or [7]
        return {"data": b64(encode_tf_example(feats))}

    def mutate(self, rng: random.Random, case: dict[str, Any]) -> dict[str, Any]:
        data = unb64(case["data"])
        for _ in range(rng.randint(1, 3)):
            fields = _proto_fields(data)
            if fields and rng.random() < 0.6:
                a, b = rng.choice(fields)
                data = (
                    data[:a]
                    + varint(nasty(rng, int.from_bytes(data[a:b], "little") & 0x7F))
                    + data[b:]
                )
            else:
                data = mutate_bytes(rng, data)
        return {"data": b64(data)}

    def check(self, case: dict[str, Any], workdir: str) -> None:
        from torchgrain.errors import RecordDecodeError
        from torchgrain.formats.tf_example import TFExampleCodec, decode_tf_example
        from torchgrain.formats.tfds import TFDSCodec

        data = unb64(case["data"])
        for kw in ({}, {"squeeze": True}, {"keys": ["b0", "i1", "f2"]}):
            got = expect_error_or(lambda kw=kw: decode_tf_example(data, **kw), (RecordDecodeError,))
            if got is not None and not isinstance(got, dict):
                raise Bad(f"decoded a {type(got).__name__}")
        spec = {
            "featuresDict": {
                "features": {
                    "i1": {"tensor": {"shape": {"dimensions": ["-1"]}, "dtype": "int64"}},
                    "b0": {"tensor": {"shape": {}, "dtype": "float32", "encoding": "zlib"}},
                    "f2": {"tensor": {"shape": {"dimensions": ["2"]}, "dtype": "float32"}},
                }
            }
        }
        codec = TFDSCodec(spec)
        expect_error_or(lambda: codec.decode(data), (RecordDecodeError,))
        expect_error_or(lambda: TFExampleCodec().decode(data), (RecordDecodeError,))


# ------------------------------------------------------------------ TFRecord
def _tf_frame(rec: bytes) -> bytes:
    from torchgrain.formats.tfrecord import masked_crc32c

    n = struct.pack("<Q", len(rec))
    return n + struct.pack("<I", masked_crc32c(n)) + rec + struct.pack("<I", masked_crc32c(rec))


class TFRecordTarget(Target):
    """TFRecord files (plain, gzip, zlib): framing, both CRCs, lengths, through
    ``iter_tfrecord``, ``index_tfrecord``/``read_tfrecord_at`` and :class:`TFRecordSource`
    (per record, batch, columns)."""

    name = "tfrecord"

    def make(self, rng: random.Random) -> dict[str, Any]:
        recs = [rng.randbytes(rng.choice([0, 1, 10, 300, 5000])) for _ in range(rng.randint(0, 8))]
        return {
            "data": b64(b"".join(map(_tf_frame, recs))),
            "records": [b64(r) for r in recs],
            "compression": rng.choice(["", "", "gzip", "zlib"]),
        }

    def mutate(self, rng: random.Random, case: dict[str, Any]) -> dict[str, Any]:
        case = dict(case)
        data = bytearray(unb64(case["data"]))
        if rng.random() < 0.4 and len(data) >= 16:
            # A hostile writer: a length field that lies, with its CRC right.
            from torchgrain.formats.tfrecord import masked_crc32c

            offsets = [0]
            recs = [unb64(r) for r in case["records"]]
            for r in recs:
                offsets.append(offsets[-1] + len(r) + 16)
            at = rng.choice(offsets[:-1] or [0])
            length = nasty(rng, struct.unpack_from("<Q", data, at)[0])
            n = struct.pack("<Q", length)
            data[at : at + 12] = n + struct.pack("<I", masked_crc32c(n))
        else:
            for _ in range(rng.randint(1, 3)):
                data = bytearray(mutate_bytes(rng, bytes(data)))
        case["data"] = b64(bytes(data))
        return case

    def check(self, case: dict[str, Any], workdir: str) -> None:
        import torchgrain as tg
        from torchgrain.errors import CorruptDataError
        from torchgrain.formats.tfrecord import index_tfrecord, iter_tfrecord, read_tfrecord_at

        errors = tg_errors()
        original = [unb64(r) for r in case["records"]]
        raw = unb64(case["data"])
        comp = case["compression"]
        name = {"": "x.tfrecord", "gzip": "x.tfrecord.gz", "zlib": "x.tfrecord.zz"}[comp]
        path = os.path.join(workdir, name)
        blob = (
            gzip.compress(raw, mtime=0)
            if comp == "gzip"
            else zlib.compress(raw)
            if comp == "zlib"
            else raw
        )
        with open(path, "wb") as f:
            f.write(blob)
        got: list[bytes] = []

        def walk() -> None:
            for rec in iter_tfrecord(path, max_record_bytes=MAX_RECORD):
                got.append(rec)

        expect_error_or(walk, (CorruptDataError,))
        # A mutation can copy a whole valid frame: records past the original's are
        # bytes of the file, framed and checksummed; those before must be the original.
        if got[: len(original)] != original[: len(got)]:
            raise Bad(f"iter_tfrecord gave records that are not the original's ({len(got)})")
        if comp:
            return
        offsets = expect_error_or(lambda: index_tfrecord(path), (CorruptDataError,))
        if offsets is not None:
            for i, off in enumerate(offsets.tolist()[:8]):
                rec = expect_error_or(
                    lambda off=off: read_tfrecord_at(path, off, max_record_bytes=MAX_RECORD),
                    (CorruptDataError,),
                )
                if rec is not None and i < len(original) and rec != original[i]:
                    raise Bad(f"read_tfrecord_at gave a wrong record {i}")
        src = expect_error_or(
            lambda: tg.TFRecordSource(
                path, codec="raw", index_dir=None, max_record_bytes=MAX_RECORD
            ),
            errors,
        )
        if src is None:
            return
        n = len(src)
        for i in range(min(n, 4)):
            rec = expect_error_or(lambda i=i: src[i], errors)
            if rec is not None and i < len(original) and rec["bytes"] != original[i]:
                raise Bad(f"TFRecordSource[{i}] is not the original record")
        idx = list(range(n))[::-1]
        recs = expect_error_or(lambda: src.__getitems__(idx), errors)
        if recs is not None and [r["bytes"] for r, i in zip(recs, idx) if i < len(original)] != [
            original[i] for i in idx if i < len(original)
        ]:
            raise Bad("TFRecordSource batch is not the original records")
        cols = expect_error_or(lambda: src.read_columns(idx), errors)
        if (
            cols is not None
            and n
            and [b for b, i in zip(cols["bytes"].tolist(), idx) if i < len(original)]
            != [original[i] for i in idx if i < len(original)]
        ):
            raise Bad("TFRecordSource columns are not the original records")


# ------------------------------------------------------------------ Parquet footers
def _thrift_ints(data: bytes, start: int, end: int) -> list[tuple[int, int]]:
    """(start, end) of every zigzag varint integer of a thrift compact struct (a
    Parquet footer's FileMetaData) in ``data[start:end]``."""
    out: list[tuple[int, int]] = []
    pos = start

    def rvarint() -> int:
        nonlocal pos
        v = shift = 0
        while True:
            if pos >= end:
                raise ValueError
            b = data[pos]
            pos += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return v

    def value(t: int, depth: int) -> None:
        nonlocal pos
        if depth > 16:
            raise ValueError
        if t in (1, 2):
            return
        if t == 3:
            pos += 1
        elif t in (4, 5, 6):
            s = pos
            rvarint()
            out.append((s, pos))
        elif t == 7:
            pos += 8
        elif t == 8:
            n = rvarint()
            pos += n
        elif t in (9, 10):
            head = data[pos]
            pos += 1
            n = head >> 4
            if n == 15:
                n = rvarint()
            et = head & 0x0F
            for _ in range(min(n, 10000)):
                value(et, depth + 1) if et not in (1, 2) else None
                if et in (1, 2):
                    pos += 1
        elif t == 12:
            struct_(depth + 1)
        else:
            raise ValueError

    def struct_(depth: int) -> None:
        nonlocal pos
        while pos < end:
            head = data[pos]
            pos += 1
            if head == 0:
                return
            t = head & 0x0F
            if head >> 4 == 0:
                rvarint()
            value(t, depth)

    with contextlib.suppress(ValueError, IndexError):
        struct_(0)
    return out


def _zigzag(v: int) -> bytes:
    return varint((v << 1) ^ (v >> 63) if v >= 0 else ((-v) << 1) - 1)


def claim_rows(data: bytes, rows: int, claim: int) -> bytes:
    """``data``, a Parquet file of ``rows`` rows, with ``claim`` in its footer wherever
    the footer says ``rows`` (the file's count; with one row group, its count and each
    column chunk's): a lie that agrees with itself, which only a bound on what the claim
    costs can stop."""
    end = len(data) - 8
    start = end - struct.unpack_from("<I", data, end)[0]
    old = _zigzag(rows)
    footer = data[start:end]
    for a, b in reversed(_thrift_ints(data, start, end)):
        if data[a:b] == old:
            footer = footer[: a - start] + _zigzag(claim) + footer[b - start :]
    return data[:start] + footer + struct.pack("<I", len(footer)) + b"PAR1"


class ParquetTarget(Target):
    """Parquet files with hostile footers (row counts, row-group sizes, offsets, schema)
    through :class:`ParquetSource`: open, per record, batch, columns."""

    name = "parquet"

    def make(self, rng: random.Random) -> dict[str, Any]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        n = rng.randint(1, 30)
        table = pa.table(
            {
                "i": list(range(n)),
                "s": [f"s{i}" * (i % 3) for i in range(n)],
                "l": [[float(i)] * (i % 4) for i in range(n)],
            }
        )
        sink = io.BytesIO()
        pq.write_table(
            table,
            sink,
            row_group_size=rng.choice([1, 4, 50]),
            compression=rng.choice(["none", "snappy", "zstd"]),
        )
        return {"data": b64(sink.getvalue()), "rows": n}

    def mutate(self, rng: random.Random, case: dict[str, Any]) -> dict[str, Any]:
        data = unb64(case["data"])
        if rng.random() < 0.2:
            claim = rng.choice([case["rows"] + 1, 1 << 31, 1 << 40, (1 << 63) - 1])
            return {"data": b64(claim_rows(data, case["rows"], claim)), "rows": case["rows"]}
        for _ in range(rng.randint(1, 2)):
            if len(data) < 12 or data[-4:] != b"PAR1":
                data = mutate_bytes(rng, data)
                continue
            flen = struct.unpack_from("<I", data, len(data) - 8)[0]
            fstart = len(data) - 8 - flen
            ints = _thrift_ints(data, fstart, len(data) - 8) if fstart >= 4 else []
            if ints and rng.random() < 0.7:
                a, b = rng.choice(ints)
                new = _zigzag(
                    rng.choice(
                        [
                            -1,
                            0,
                            1,
                            2,
                            1 << 31,
                            (1 << 63) - 1,
                            -(1 << 63),
                            rng.randint(-100, 100),
                            1 << 40,
                        ]
                    )
                )
                footer = data[fstart:a] + new + data[b : len(data) - 8]
                data = data[:fstart] + footer + struct.pack("<I", len(footer)) + b"PAR1"
            elif rng.random() < 0.5 and fstart >= 4:
                footer = mutate_bytes(rng, data[fstart : len(data) - 8])
                data = data[:fstart] + footer + struct.pack("<I", len(footer)) + b"PAR1"
            else:
                data = mutate_bytes(rng, data)
        return {"data": b64(data), "rows": case["rows"]}

    def check(self, case: dict[str, Any], workdir: str) -> None:
        import torchgrain as tg

        errors = tg_errors()
        path = os.path.join(workdir, "x.parquet")
        with open(path, "wb") as f:
            f.write(unb64(case["data"]))
        src = expect_error_or(
            lambda: tg.ParquetSource(path, cache_bytes=1 << 20, max_row_group_bytes=MAX_CHUNK),
            errors,
        )
        if src is None:
            return
        n = len(src)
        idx = list(range(min(n, 40)))
        for i in idx[:3]:
            expect_error_or(lambda i=i: src[i], errors)
        expect_error_or(lambda: src.__getitems__(idx[::-1]), errors)
        expect_error_or(lambda: src.read_columns(idx), errors)


def _page_headers(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of every page header of a Parquet file (walked from its footer)."""
    import pyarrow.parquet as pq

    from torchgrain.formats.parquet_pages import chunk_range, page_header

    out = []
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    for r in range(meta.num_row_groups):
        for j in range(meta.num_columns):
            start, length = chunk_range(meta.row_group(r).column(j))
            pos = start
            while pos < start + length:
                header = page_header(data[pos : pos + 4096])
                out.append((pos, pos + header.header_size))
                pos += header.header_size + header.compressed_size
    return out


class ParquetPagesTarget(Target):
    """Parquet files with hostile page headers (sizes, value counts, any field: same-
    length varints, so that no offset moves; random bytes) and decompression bombs
    (a zstd page of 64 MiB of zeros) through :class:`ParquetSource` under a ceiling of
    ``MAX_CHUNK``: a bomb must be refused, anything else read or refused in bounded
    memory."""

    name = "parquet_pages"

    def make(self, rng: random.Random) -> dict[str, Any]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        bomb = rng.random() < 0.1
        if bomb:
            table = pa.table({"i": [1], "b": pa.array([bytes(64 << 20)], pa.binary())})
        else:
            n = rng.randint(1, 300)
            table = pa.table(
                {
                    "i": list(range(n)),
                    "s": [f"s{i}" * (i % 5) for i in range(n)],
                    "l": [[float(i)] * (i % 4) for i in range(n)],
                    "t": [{"x": i, "y": [i] * (i % 3)} for i in range(n)],
                }
            )
        sink = io.BytesIO()
        pq.write_table(
            table,
            sink,
            row_group_size=rng.choice([7, 50, 1000]),
            compression="zstd" if bomb else rng.choice(["none", "snappy", "zstd", "gzip"]),
            use_dictionary=not bomb and rng.random() < 0.5,
            data_page_version=rng.choice(["1.0", "2.0"]),
            data_page_size=rng.choice([64, 1024, 1 << 20]),
        )
        return {"data": b64(sink.getvalue()), "bomb": bomb}

    def mutate(self, rng: random.Random, case: dict[str, Any]) -> dict[str, Any]:
        data = bytearray(unb64(case["data"]))
        headers = _page_headers(bytes(data))
        for _ in range(rng.randint(1, 3)):
            start, end = rng.choice(headers)
            ints = _thrift_ints(bytes(data), start, end)
            if ints and rng.random() < 0.8:
                a, b = rng.choice(ints)
                # A same-length varint: the value's zigzag, capped at what its bytes hold.
                v = rng.choice([*NASTY, -1, rng.randint(-300, 300)])
                v = max(-(1 << 62), min(v, 1 << 62))
                n = b - a
                num = min(v << 1 if v >= 0 else ((-v) << 1) - 1, (1 << (7 * n)) - 1)
                data[a:b] = bytes(
                    ((num >> (7 * i)) & 0x7F) | (0x80 if i < n - 1 else 0) for i in range(n)
                )
            else:
                data[start:end] = mutate_bytes(rng, bytes(data[start:end]))[: end - start].ljust(
                    end - start, b"\0"
                )
        return {"data": b64(bytes(data)), "bomb": case["bomb"]}

    def check(self, case: dict[str, Any], workdir: str) -> None:
        import torchgrain as tg

        errors = tg_errors()
        path = os.path.join(workdir, "x.parquet")
        with open(path, "wb") as f:
            f.write(unb64(case["data"]))
        src = expect_error_or(
            lambda: tg.ParquetSource(
                path, cache_bytes=1 << 20, max_row_group_bytes=MAX_CHUNK, decoded_cache=False
            ),
            errors,
        )
        if src is None:
            return
        if case["bomb"]:
            try:
                src[0]
            except tg.CorruptDataError:
                return
            raise Bad("a page inflating to 64 MiB was read under max_row_group_bytes=4 MiB")
        idx = list(range(min(len(src), 40)))
        for i in idx[:3]:
            expect_error_or(lambda i=i: src[i], errors)
        expect_error_or(lambda: src.__getitems__(idx[::-1]), errors)
        expect_error_or(lambda: src.read_columns(idx), errors)


class SelfTestTarget(Target):
    """Misbehaviour on purpose, to show the harness sees it (``tests/test_fuzz.py``)."""

    name = "selftest"

    def make(self, rng: random.Random) -> dict[str, Any]:
        return {"data": "", "mode": "ok"}

    def mutate(self, rng: random.Random, case: dict[str, Any]) -> dict[str, Any]:
        return case

    def check(self, case: dict[str, Any], workdir: str) -> None:
        mode = case["mode"]
        if mode == "crash":
            os.abort()
        elif mode == "hang":
            if case.get("started"):  # tell whoever waits for the case to be running
                open(case["started"], "w").close()
            time.sleep(3600)
        elif mode == "memory":  # touched pages, under the address-space limit
            block = bytearray(RSS_BUDGET_MIB * 2 << 20)
            block[:: 1 << 12] = b"x" * len(block[:: 1 << 12])
        elif mode == "bare":
            expect_error_or(lambda: {}["missing"], tg_errors())
        elif mode == "hidden_memory_error":
            from torchgrain.errors import CorruptDataError

            def fail() -> None:
                try:
                    raise MemoryError
                except MemoryError as e:
                    raise CorruptDataError("a named error") from e

            expect_error_or(fail, tg_errors())


# ------------------------------------------------------------------ multipart/byteranges
class ByteRangesTarget(Target):
    """A server's ``multipart/byteranges`` answer (one part per range, or merged) through
    :mod:`torchgrain.io.byteranges`: each range's bytes of the right length, or a
    ``MultipartError``; unmutated, exactly the file's bytes."""

    name = "byteranges"

    def make(self, rng: random.Random) -> dict[str, Any]:
        from torchgrain.io.byteranges import merge_ranges

        size = rng.randint(1, 4000)
        ranges = []
        for _ in range(rng.randint(1, 12)):
            s = rng.randrange(size)
            ranges.append((s, min(size, s + rng.randint(1, 400))))
        merged = merge_ranges(ranges)
        sent = [(merged[0][0], merged[-1][1])] if rng.random() < 0.2 else merged
        boundary = rng.choice(["00000000000000000001", "B", "3d6b6a416f9b5"])
        seed = rng.randrange(1 << 30)
        return {
            "data": b64(self._body(seed, size, sent, boundary)),
            "seed": seed,
            "size": size,
            "ranges": ranges,
            "boundary": boundary,
            "faithful": True,
        }

    @staticmethod
    def _body(seed: int, size: int, parts: list[tuple[int, int]], boundary: str) -> bytes:
        data = random.Random(seed).randbytes(size)
        out = b"".join(
            f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Range: bytes {s}-{e - 1}/{size}\r\n\r\n".encode()
            + data[s:e]
            for s, e in parts
        )
        return out + f"\r\n--{boundary}--\r\n".encode()

    def mutate(self, rng: random.Random, case: dict[str, Any]) -> dict[str, Any]:
        data = unb64(case["data"])
        for _ in range(rng.randint(1, 3)):
            data = mutate_bytes(rng, data)
        return {**case, "data": b64(data), "faithful": False}

    def check(self, case: dict[str, Any], workdir: str) -> None:
        from torchgrain.io.byteranges import (
            MultipartError,
            merge_ranges,
            parse_byteranges,
            slice_parts,
        )

        body = unb64(case["data"])
        ranges = [tuple(r) for r in case["ranges"]]
        merged = merge_ranges(ranges)
        got = expect_error_or(
            lambda: slice_parts(
                parse_byteranges(body, case["boundary"], max_parts=len(merged))[0], ranges
            ),
            (MultipartError,),
        )
        if got is None:
            if case["faithful"]:
                raise Bad("a faithful answer was refused")
            return
        if [len(g) for g in got] != [e - s for s, e in ranges]:
            raise Bad(f"lengths {[len(g) for g in got]} for ranges {ranges}")
        if case["faithful"]:
            data = random.Random(case["seed"]).randbytes(case["size"])
            if got != [data[s:e] for s, e in ranges]:
                raise Bad("a faithful answer gave other bytes")


# ------------------------------------------------------------------ one range's answer
class RangeAnswerTarget(Target):
    """A server's answer to a request for one byte range (status, ``Content-Range``, body)
    through :func:`torchgrain.io.responses.check_range_answer` and the length check every
    range read makes: the bytes asked for, of the file pinned, or a ``RangeAnswerError``.

    An answer is made as a server would send it: honest about what it holds (its
    ``Content-Range`` names the bytes of the body), but maybe of other bytes (shifted),
    of another version of the file (another size), or a ``200`` with the whole file or its
    first bytes; then its ``Content-Range`` text is mutated at random. Accepted, it must be
    exactly the file's bytes asked for, and its header must say so (a reference parser)."""

    name = "range_answer"
    # (range units are case-insensitive, RFC 9110 14.1)
    _HEADER = re.compile(r"(?i:bytes) (\d{1,19})-(\d{1,19})/(\d{1,19}|\*)")

    def make(self, rng: random.Random) -> dict[str, Any]:
        size = rng.randint(1, 5000)
        start = rng.randrange(size)
        end = min(size, start + rng.randint(1, 600)) if rng.random() < 0.9 else size + 5
        if rng.random() < 0.1:
            start, end = 0, size  # the whole file, asked as a range
        return {
            "data": b64(b""),
            "seed": rng.randrange(1 << 30),
            "size": size,
            "start": start,
            "end": end,
            "kind": "faithful",
            "shift": 0,
            "served_size": size,
            "header": None,
        }

    def mutate(self, rng: random.Random, case: dict[str, Any]) -> dict[str, Any]:
        kind = rng.choice(["shifted", "other_size", "whole", "first", "header", "header"])
        out = {**case, "kind": kind}
        if kind == "shifted":
            out["shift"] = rng.choice([-1, 1, -case["start"], rng.randint(-700, 700)])
        elif kind == "other_size":
            out["served_size"] = max(1, case["size"] + rng.choice([-7, -1, 1, 3, 1000]))
        elif kind == "header":
            first, last, total = self._served(out)[:3]
            text = f"bytes {first}-{last}/{total}".encode()
            for _ in range(rng.randint(1, 3)):
                text = mutate_bytes(rng, text)
            out["header"] = text.decode("latin-1")
        return out

    @staticmethod
    def _served(case: dict[str, Any]) -> tuple[int, int, int, bytes, int]:
        """``(first, last, total, body, status)`` an honest server sends for the case."""
        size, served = case["size"], case["served_size"]
        data = random.Random(case["seed"]).randbytes(max(size, served))[:served]
        if case["kind"] in ("whole", "first"):
            n = served if case["kind"] == "whole" else case["end"] - case["start"]
            return 0, n - 1, served, data[:n], 200
        first = max(0, min(served - 1, case["start"] + case["shift"]))
        last = min(served - 1, first + (case["end"] - case["start"]) - 1)
        return first, last, served, data[first : last + 1], 206

    def check(self, case: dict[str, Any], workdir: str) -> None:
        from torchgrain.io import responses

        first, last, total, body, status = self._served(case)
        header = case["header"] if case["header"] is not None else f"bytes {first}-{last}/{total}"
        path = f"fuzz://{case['seed']}"
        start, end, size = case["start"], case["end"], case["size"]
        responses._PINS.pop(path, None)
        responses.pin(path, size)

        def read() -> bytes:
            responses.check_range_answer(
                path,
                start,
                end,
                status,
                None if status == 200 else header,
                None,
                None,
                length=len(body) if status == 200 else None,
            )
            if len(body) > end - start or (len(body) < end - start and end <= size):
                raise responses.ResponseSizeError("the body's length is not the range's")
            return body

        try:
            got = expect_error_or(read, (responses.ResponseSizeError,))
        finally:
            responses._PINS.pop(path, None)
        if got is None:
            if case["kind"] == "faithful":
                raise Bad("a faithful answer was refused")
            return
        want = random.Random(case["seed"]).randbytes(size)[start:end]
        if got != want:
            raise Bad(f"bytes {start}-{end} of a {size}-byte file: other bytes accepted")
        if status == 206:
            m = self._HEADER.fullmatch(header)
            if m is None or int(m[1]) != start or (m[3] != "*" and int(m[3]) != size):
                raise Bad(f"Content-Range {header!r} accepted for bytes {start}-{end}")


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        ArrayRecordTarget(),
        MsgpackRecordTarget(),
        MsgpackColumnsTarget(),
        TFExampleTarget(),
        TFRecordTarget(),
        ParquetTarget(),
        ParquetPagesTarget(),
        ByteRangesTarget(),
        RangeAnswerTarget(),
        SelfTestTarget(),
    )
}
#: What a campaign fuzzes by default.
FUZZED = [name for name in TARGETS if name != "selftest"]


# ================================================================== the worker
def _peak_reset() -> None:
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def status_mib(key: str) -> float:
    """This process's ``key`` from /proc ("VmRSS": resident now, "VmHWM": its peak), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024
    return 0.0


def worker_main() -> None:
    """Read cases (one JSON line each) from stdin, answer one JSON line each."""
    sys.path.insert(0, HERE)
    sys.path.insert(0, ROOT)
    import numpy  # noqa: F401 - imported before the baseline is taken
    import pyarrow.parquet  # noqa: F401

    import torchgrain
    import torchgrain.formats.arrayrecord_file  # noqa: F401

    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    if sys.platform.startswith("linux"):
        # Die with the supervisor (kill -9 included): no worker left behind in a case.
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    out = sys.stdout
    for line in sys.stdin:
        case = json.loads(line)
        target = TARGETS[case["target"]]
        with tempfile.TemporaryDirectory(prefix="tgfuzz-") as workdir:
            base = status_mib("VmRSS")
            _peak_reset()
            t0 = time.perf_counter()
            try:
                target.check(case, workdir)
                verdict = ""
            except Bad as e:
                verdict = str(e)
            except BaseException as e:  # the oracle itself failed: report, never hide
                verdict = f"oracle error {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
            peak = status_mib("VmHWM") - base
        if not verdict and peak > RSS_BUDGET_MIB:
            verdict = f"peak RSS {peak:.0f} MiB over the worker's, budget {RSS_BUDGET_MIB} MiB"
        out.write(json.dumps({"bad": verdict, "peak": peak, "s": time.perf_counter() - t0}) + "\n")
        out.flush()


class Supervisor:
    """Runs cases in a worker, restarting it after a crash or a hang."""

    def __init__(self, case_seconds: float = CASE_SECONDS) -> None:
        self.case_seconds = case_seconds
        self.proc: subprocess.Popen | None = None
        self.stderr: Any = None  # the worker's, in a file: what a crash printed

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]), OMP_NUM_THREADS="1")
        if self.stderr is not None:
            self.stderr.close()
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the worker
        return subprocess.Popen(
            # faulthandler: a crash in C prints the Python stack it happened under.
            [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            text=True,
            bufsize=1,
        )

    def _last_words(self) -> str:
        """The end of what the dead worker printed (a C crash's stack, an abort's cause)."""
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-2000:]

    def run(self, case: dict[str, Any]) -> str:
        """'' when the case passed, else what went wrong."""
        fresh = self.proc is None or self.proc.poll() is not None
        if fresh:
            self.proc = self._start()
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(case) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            self.proc = None
            return f"worker died before the case (exit {proc.wait()})"
        # The first case of a worker also pays its start-up (imports).
        wait = self.case_seconds + (60 if fresh else 0)
        ready, _, _ = select.select([proc.stdout], [], [], wait)
        if not ready:
            proc.kill()
            proc.wait()
            self.proc = None
            return f"hang: no answer within {self.case_seconds:.0f} s"
        line = proc.stdout.readline()
        if not line:
            code = proc.wait()
            self.proc = None
            return f"crash: the worker died (exit {code})\n{self._last_words()}"
        answer = json.loads(line)
        if answer["s"] > self.case_seconds:
            return f"slow: {answer['s']:.1f} s"
        return answer["bad"]

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(Exception):
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout=30)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None


def campaign(
    targets: list[str],
    *,
    seed: int,
    cases: int | None = None,
    seconds: float | None = None,
    sup: Supervisor | None = None,
    on_failure: Callable[[dict[str, Any], str], None] | None = None,
) -> tuple[int, list[tuple[dict[str, Any], str]]]:
    """Fuzz ``targets`` in turn: ``cases`` mutated cases each (or for ``seconds`` in
    all). Returns (cases run, failures)."""
    own = sup is None
    sup = sup or Supervisor()
    failures: list[tuple[dict[str, Any], str]] = []
    run = 0
    deadline = None if seconds is None else time.monotonic() + seconds
    try:
        k = 0
        while True:
            name = targets[k % len(targets)]
            rng = random.Random(f"{seed}-{name}-{k // len(targets)}")
            target = TARGETS[name]
            base = target.make(rng)
            case = target.mutate(rng, base) if rng.random() < 0.9 else base
            case["target"] = name
            verdict = sup.run(case)
            run += 1
            if verdict:
                failures.append((case, verdict))
                if on_failure is not None:
                    on_failure(case, verdict)
            k += 1
            if cases is not None and k >= cases * len(targets):
                break
            if deadline is not None and time.monotonic() > deadline:
                break
    finally:
        if own:
            sup.close()
    return run, failures


def corpus_cases() -> list[tuple[str, dict[str, Any]]]:
    """Every case kept in ``tests/fuzz_corpus``, as (file name, case)."""
    out = []
    for root, _, files in os.walk(CORPUS):
        for name in sorted(files):
            if name.endswith(".json"):
                with open(os.path.join(root, name)) as f:
                    case = json.load(f)
                if "data_z" in case:
                    case["data"] = b64(zlib.decompress(unb64(case.pop("data_z"))))
                out.append((os.path.relpath(os.path.join(root, name), CORPUS), case))
    return sorted(out)


def save_case(case: dict[str, Any], verdict: str) -> str:
    """Keep a failing case in the corpus (named by its content; the input compressed:
    files are mostly padding)."""
    data = unb64(case["data"])
    case = {k: v for k, v in case.items() if k != "data"}
    case["data_z"] = b64(zlib.compress(data, 9))
    blob = json.dumps(case, sort_keys=True)
    name = hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()
    folder = os.path.join(CORPUS, case["target"])
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.json")
    with open(path, "w") as f:
        json.dump({**case, "found": verdict.splitlines()[0][:300]}, f, sort_keys=True, indent=0)
        f.write("\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=600.0, help="total time (default 600)")
    p.add_argument("--seed", type=int, default=None, help="default: from the clock")
    p.add_argument("--targets", default=",".join(FUZZED), help="comma-separated")
    p.add_argument("--no-save", action="store_true", help="do not add failures to the corpus")
    args = p.parse_args()
    if args.worker:
        worker_main()
        return
    seed = args.seed if args.seed is not None else int(time.time())
    targets = args.targets.split(",")
    print(f"fuzzing {targets} for {args.seconds:.0f} s, seed {seed}", flush=True)

    def report(case: dict[str, Any], verdict: str) -> None:
        where = "" if args.no_save else f" -> {save_case(case, verdict)}"
        print(f"FAIL {case['target']}: {verdict.splitlines()[0][:200]}{where}", flush=True)

    run, failures = campaign(targets, seed=seed, seconds=args.seconds, on_failure=report)
    print(f"{run} cases, {len(failures)} failures (seed {seed})")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
