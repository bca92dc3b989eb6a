"""Protocol buffers' base-128 varint, written out independently of sparknet's reader (for tests that build or
edit Caffe's binary files by hand)."""

from __future__ import annotations


def varint(n: int) -> bytes:
    """``n`` (non-negative) as a protobuf varint: seven bits a byte, low bits first, the top bit marking more."""
    out = bytearray()
    while True:
        bits, n = n & 0x7F, n >> 7
        out.append(bits | (0x80 if n else 0))
        if not n:
            return bytes(out)
