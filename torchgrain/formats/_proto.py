"""Protocol-buffer varints decoded with numpy, for the formats that parse protobufs by hand.

A run of varints (packed repeated fields of a ``tf.train.Example``, the record sizes of
an ArrayRecord chunk) decodes in a few vectorised steps: a byte below 0x80 ends a
varint, and the 7-bit groups of one varint never overlap, so summing them shifted into
place is the same as OR-ing them.

The scalar varint readers stay with their formats: ``tf.train.Example`` drops the bits
past 64 of a 10-byte varint (as protobuf does), while the ArrayRecord reader keeps them,
so that a size that overflows 64 bits can never pass for a small one.

Example:
    >>> import numpy as np
    >>> values, starts = decode_varints(np.array([5, 0xAC, 0x02, 0x7F], np.uint8))
    >>> values.tolist(), starts.tolist()
    ([5, 300, 127], [0, 1, 3])
"""

from __future__ import annotations

import numpy as np

__all__ = ["VarintError", "decode_varints"]


class VarintError(ValueError):
    """A run of varints is malformed; ``pos`` is where, in bytes from its start, and
    ``truncated`` whether it ends inside a varint (else a varint is over 10 bytes)."""

    def __init__(self, msg: str, pos: int, *, truncated: bool) -> None:
        super().__init__(msg)
        self.pos = pos
        self.truncated = truncated


def decode_varints(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decode ``raw`` (uint8), a buffer that is exactly a sequence of varint64s.

    Returns (values as uint64, start byte of each varint).

    Raises:
        VarintError: the buffer ends inside a varint, or a varint is longer than 10 bytes.

    Example:
        >>> decode_varints(np.array([0x80], np.uint8))
        Traceback (most recent call last):
        ...
        torchgrain.formats._proto.VarintError: buffer ends inside a varint
    """
    if raw.size == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    if raw[-1] >= 0x80:
        raise VarintError("buffer ends inside a varint", raw.size - 1, truncated=True)
    ends = np.flatnonzero(raw < 0x80)
    if len(ends) == raw.size:  # every varint one byte long
        return raw.astype(np.uint64), ends
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > 10:
        at = int(starts[lengths.argmax()])
        raise VarintError("varint longer than 10 bytes", at, truncated=False)
    within = np.arange(raw.size, dtype=np.int64) - np.repeat(starts, lengths)
    parts = (raw & 0x7F).astype(np.uint64) << (within * 7).astype(np.uint64)
    return np.add.reduceat(parts, starts), starts
