"""HighwayHash-64 in pure Python, keyed as Riegeli keys it.

Riegeli protects every block header, chunk header and chunk payload with a 64-bit
HighwayHash. No maintained wheel of HighwayHash exists on PyPI, so this module
implements the portable reference algorithm with Python integers (each 64-bit lane
masked after arithmetic). It is slow (a few MB/s), which is why checksum
verification is opt-in in :class:`~torchgrain.formats.arrayrecord_file.ArrayRecordFile`.

Example:
    >>> hex(riegeli_hash(b""))  # the data hash of Riegeli's file-signature chunk
    '0x72c3b1e9c0139fe1'
"""

from __future__ import annotations

import operator
import struct

__all__ = ["RIEGELI_KEY", "highwayhash64", "riegeli_hash"]

_M64 = 0xFFFFFFFFFFFFFFFF
_M32 = 0xFFFFFFFF

# 'Riegeli/', 'records\n', 'Riegeli/', 'records\n' read as little-endian integers.
RIEGELI_KEY = (0x2F696C6567656952, 0x0A7364726F636572, 0x2F696C6567656952, 0x0A7364726F636572)

_INIT_MUL0 = (0xDBE6D5D5FE4CCE2F, 0xA4093822299F31D0, 0x13198A2E03707344, 0x243F6A8885A308D3)
_INIT_MUL1 = (0x3BD39E10CB0EF593, 0xC0ACF169B5F18A8C, 0xBE5466CF34E90C6C, 0x452821E638D01377)

_LANES = struct.Struct("<4Q")


# The bytes of (v1 << 64 | v0), little-endian, in the order the zipper merge takes them.
_ZIPPER = operator.itemgetter(3, 12, 2, 5, 14, 1, 15, 0, 11, 4, 10, 13, 9, 6, 8, 7)


def _zipper(v1: int, v0: int) -> tuple[int, int]:
    """The byte shuffle that mixes multiplication results across lanes: (add1, add0)."""
    out = int.from_bytes(bytes(_ZIPPER((v0 | v1 << 64).to_bytes(16, "little"))), "little")
    return out >> 64, out & _M64


class _State:
    __slots__ = ("mul0", "mul1", "v0", "v1")

    def __init__(self, key: tuple[int, int, int, int]) -> None:
        self.mul0 = list(_INIT_MUL0)
        self.mul1 = list(_INIT_MUL1)
        self.v0 = [self.mul0[i] ^ key[i] for i in range(4)]
        self.v1 = [self.mul1[i] ^ (((key[i] >> 32) | (key[i] << 32)) & _M64) for i in range(4)]

    def update(self, lanes: tuple[int, ...] | list[int]) -> None:
        v0, v1, mul0, mul1 = self.v0, self.v1, self.mul0, self.mul1
        for i in range(4):
            a = (v1[i] + mul0[i] + lanes[i]) & _M64
            v1[i] = a
            m0 = mul0[i] ^ ((a & _M32) * (v0[i] >> 32))
            mul0[i] = m0
            b = (v0[i] + mul1[i]) & _M64
            v0[i] = b
            mul1[i] ^= (b & _M32) * (a >> 32)
        for src, dst in ((v1, v0), (v0, v1)):  # v0 from v1, then v1 from the new v0
            for hi, lo in ((1, 0), (3, 2)):
                add1, add0 = _zipper(src[hi], src[lo])
                dst[hi] = (dst[hi] + add1) & _M64
                dst[lo] = (dst[lo] + add0) & _M64

    def update_remainder(self, rest: bytes) -> None:
        n = len(rest)
        for i in range(4):
            self.v0[i] = (self.v0[i] + (n << 32) + n) & _M64
            half0, half1 = self.v1[i] & _M32, self.v1[i] >> 32
            half0 = ((half0 << n) | (half0 >> (32 - n))) & _M32
            half1 = ((half1 << n) | (half1 >> (32 - n))) & _M32
            self.v1[i] = half0 | (half1 << 32)
        mod4, whole = n & 3, n & ~3
        packet = bytearray(32)
        packet[:whole] = rest[:whole]
        if n & 16:
            # The last four input bytes, which may overlap the whole-word part.
            packet[28:32] = rest[n - 4 : n]
        elif mod4:
            tail = rest[whole:]
            packet[16:19] = tail[0], tail[mod4 >> 1], tail[mod4 - 1]
        self.update(_LANES.unpack(packet))

    def finalize64(self) -> int:
        for _ in range(4):
            v0 = self.v0
            self.update([((v0[i] >> 32) | (v0[i] << 32)) & _M64 for i in (2, 3, 0, 1)])
        return (self.v0[0] + self.v1[0] + self.mul0[0] + self.mul1[0]) & _M64


def highwayhash64(data: bytes | bytearray | memoryview, key: tuple[int, int, int, int]) -> int:
    """HighwayHash-64 of ``data`` under the 256-bit ``key`` (four 64-bit integers).

    Example:
        >>> highwayhash64(b"", RIEGELI_KEY) == riegeli_hash(b"")
        True
    """
    mv = memoryview(data).cast("B")
    state = _State(key)
    n = len(mv)
    whole = n - (n & 31)
    update = state.update
    for lanes in struct.iter_unpack("<4Q", mv[:whole]):
        update(lanes)
    if n & 31:
        state.update_remainder(bytes(mv[whole:]))
    return state.finalize64()


def riegeli_hash(data: bytes | bytearray | memoryview) -> int:
    """HighwayHash-64 with Riegeli's fixed key.

    Example:
        >>> hex(riegeli_hash(bytes(8) + (64).to_bytes(8, "little")))  # a block header's hash
        '0x3f4a880dd170af83'
    """
    return highwayhash64(data, RIEGELI_KEY)
