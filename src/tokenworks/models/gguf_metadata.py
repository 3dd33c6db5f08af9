"""A GGUF file's metadata alone, read in one pass: the key-value pairs before its tensor index.

The gguf package's reader builds a numpy view for every string of every array, some 20 s
for a 262,000-piece vocabulary and its half a million merges; what only needs the
tokenizer's fields or the chat template (a vocabulary file, a template shown to a user) reads
them here, in well under a second. Values come out as the reader's `contents()` gives them:
numbers, strings, bools and lists.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np

# GGUF value types -> numpy dtypes of the fixed-size ones
_NUMERIC = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
            10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, data: memoryview):
        self.data, self.at = data, 0

    def take(self, n: int) -> memoryview:
        if self.at + n > len(self.data):
            raise ValueError(f"the metadata runs past the end of the file at byte {self.at}")
        piece = self.data[self.at : self.at + n]
        self.at += n
        return piece

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> str:
        return str(self.take(self.u64()), "utf-8", errors="replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = self.u32(), self.u64()
            if inner == _STRING:
                return [self.string() for _ in range(count)]
            if inner == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMERIC[inner])
            return np.frombuffer(self.take(count * dtype.itemsize), dtype).tolist()
        if kind not in _NUMERIC:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.at}")
        dtype = np.dtype(_NUMERIC[kind])
        return np.frombuffer(self.take(dtype.itemsize), dtype)[0].item()


def read_metadata(path: Path) -> dict:
    """Every key of the file's metadata and its value."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        data = memoryview(mapped)  # (only the pages the metadata is on are read)
        try:
            cursor = _Cursor(data)
            if bytes(cursor.take(4)) != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
            version = cursor.u32()
            if version < 2:
                raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 are read")
            cursor.u64()  # tensors
            return {cursor.string(): cursor.value(cursor.u32()) for _ in range(cursor.u64())}
        finally:
            data.release()
